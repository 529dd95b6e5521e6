"""Scripted shell solutions: the reference solver, and a naive one that falls into the traps.

:func:`solve` is the list of ``bash`` tool commands that solve a task, written only from what
the prompt says (the family's parameters, never the seed): it finds the files by globbing,
reads them with the shell tools a Debian minbase image has (coreutils, grep, sed, gzip) and
python3 for JSON. It is an implementation independent of ``answers.py``; the tests check that
it scores 1 on every task of a sample of each family, and the baselines on the whole eval split.

:func:`naive` is what a hurried engineer types: plausible pipelines that ignore one or more of
the traps the prompt warns about (the error log, the extension filter and letter case, CRLF
line ends and per-file column orders, gzipped days and nested ``user`` keys). It measures how
much the traps matter and exercises the verifier's partial credit.

:func:`reference` (the bundle's ``[solver]``) and :func:`naive_calls` (its ``naive``
``[[baselines]]`` entry) are the same two as policies of the solver shape,
``(task) -> [{"name", "arguments"}, ...]``: each command as a ``bash`` call, then ``submit``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from corral.envs.episode import Task

BASH = "bash"
SUBMIT = "submit"

# Every access log's lines, .gz ones decompressed; the glob skips logs/error.log.
_ACCESS_LINES = (
    "for f in logs/access.log logs/access.log.*; do "
    'case "$f" in *.gz) zcat -- "$f" ;; *) cat -- "$f" ;; esac; done'
)
# '"METHOD PATH PROTO" STATUS ' -> 'METHOD PATH PROTO STATUS'.
_REQUEST_AND_STATUS = r"""sed -n 's/^[^"]*"\([^"]*\)" \([0-9][0-9][0-9]\) .*/\1 \2/p'"""
# 'STATUS,COUNT' rows: most first, ties by status.
_COUNT_ROWS = r"sort | uniq -c | sed 's/^ *\([0-9]*\) \(.*\)$/\2,\1/' | sort -t, -k2,2nr -k1,1"


def solve(data: Mapping[str, Any]) -> list[str]:
    """The bash commands that solve the task with this ``data`` (its ``params`` only)."""
    family, params = data["family"], data["params"]
    match family:
        case "status_counts":
            return _status_counts(params)
        case "find_files":
            return _find_files(params)
        case "csv_to_tsv":
            return _csv_to_tsv(params)
        case "jsonl_totals":
            return _jsonl_totals(params)
    raise ValueError(f"unknown family {family!r}")


def _status_counts(params: Mapping[str, Any]) -> list[str]:
    if params["method"] is not None:
        keep = f"grep -- {shlex.quote('^' + params['method'] + ' ')}"
    elif params["path_prefix"] is not None:
        keep = f"grep -- {shlex.quote('^[A-Z]* ' + params['path_prefix'])}"
    else:
        keep = "cat"
    return [
        "ls -la logs",
        f"{{ echo status,count; {_ACCESS_LINES} | {_REQUEST_AND_STATUS} | {keep} "
        f"| sed 's/.* //' | {_COUNT_ROWS}; }} > status_counts.csv",
        "cat status_counts.csv",
    ]


def _find_files(params: Mapping[str, Any]) -> list[str]:
    flags = "-rlF" if params["mode"] == "literal" else "-rliwF"
    extension = params["extension"]
    include = "" if extension is None else f"--include={shlex.quote('*' + extension)} "
    needle = shlex.quote(params["needle"])
    return [
        "find project -type f | head -50",
        f"grep {flags} {include}-e {needle} -- project | sort > matches.txt",
        "cat matches.txt",
    ]


def _csv_to_tsv(params: Mapping[str, Any]) -> list[str]:
    steps = ['tr -d "\\r" < "$f"', "sed '$a\\'"]  # no CRs; a final newline on the last line
    if params["drop"] is not None:
        drop = shlex.quote(params["drop"])
        steps.append('cut -d, --complement -f "$col"')
        find_col = (
            f'col=$(head -n 1 -- "$f" | tr -d "\\r" | tr , "\\n" | grep -nx -- {drop} '
            "| cut -d: -f1); "
        )
    else:
        find_col = ""
    if params["rename"] is not None:
        source, target = params["rename"]
        steps.append(f"sed '1s/\\(^\\|,\\){source}\\(,\\|$\\)/\\1{target}\\2/'")
    steps.append('tr , "\\t"')
    return [
        "ls -la data; head -n 2 data/*.csv",
        "mkdir -p out && for f in data/*.csv; do "
        f'n=$(basename -- "$f" .csv); {find_col}{" | ".join(steps)} > "out/$n.tsv"; done',
        "ls out; head -n 3 out/*.tsv",
    ]


_TOTALS_SCRIPT = """\
python3 - <<'EOF'
import collections, glob, gzip, json
metric, currency = {metric!r}, {currency!r}
counted = ("purchase", "refund") if metric == "net_cents" else ("purchase",)
totals = collections.Counter()
for path in glob.glob("events/*.jsonl") + glob.glob("events/*.jsonl.gz"):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            event = json.loads(line)
            if event["type"] not in counted or currency not in (None, event["currency"]):
                continue
            if metric == "purchases":
                totals[event["user"]] += 1
            else:
                sign = 1 if event["type"] == "purchase" else -1
                totals[event["user"]] += sign * event["amount_cents"]
with open("totals.csv", "w") as out:
    out.write(f"user,{{metric}}\\n")
    for user in sorted(totals):
        out.write(f"{{user}},{{totals[user]}}\\n")
EOF"""


def _jsonl_totals(params: Mapping[str, Any]) -> list[str]:
    script = _TOTALS_SCRIPT.format(metric=params["metric"], currency=params["currency"])
    return ["ls -la events; zcat -f events/*.jsonl* | head -3", script, "cat totals.csv"]


def naive(data: Mapping[str, Any]) -> list[str]:
    """Plausible commands that ignore the family's traps (see the module docstring)."""
    family, params = data["family"], data["params"]
    match family:
        case "status_counts":  # every file in logs/, the filter forgotten
            return [
                f"{{ echo status,count; zcat -f logs/* | cut -d' ' -f9 | {_COUNT_ROWS}; }} "
                "> status_counts.csv"
            ]
        case "find_files":  # no extension filter, case-sensitive, substrings
            return [f"grep -rl -- {shlex.quote(params['needle'])} project | sort > matches.txt"]
        case "csv_to_tsv":  # commas to tabs and nothing else
            return [
                "mkdir -p out && for f in data/*.csv; do "
                'tr , "\\t" < "$f" > "out/$(basename -- "$f" .csv).tsv"; done'
            ]
        case "jsonl_totals":  # purchase lines per first "user": .gz days, currency, nesting
            return [
                f"{{ echo user,{params['metric']}; cat events/*.jsonl | grep purchase "
                '| grep -o \'"user": *"[^"]*"\' | cut -d\'"\' -f4 | sort | uniq -c '
                "| sed 's/^ *\\([0-9]*\\) \\(.*\\)$/\\2,\\1/'; } > totals.csv"
            ]
    raise ValueError(f"unknown family {family!r}")


def reference(task: Task) -> list[dict[str, Any]]:
    """The reference solution as tool calls: :func:`solve`'s commands, then ``submit``."""
    return _calls(solve(task.data))


def naive_calls(task: Task) -> list[dict[str, Any]]:
    """The naive baseline as tool calls: :func:`naive`'s commands, then ``submit``."""
    return _calls(naive(task.data))


def _calls(commands: list[str]) -> list[dict[str, Any]]:
    bash = [{"name": BASH, "arguments": {"command": c}} for c in commands]
    return [*bash, {"name": SUBMIT, "arguments": {}}]
