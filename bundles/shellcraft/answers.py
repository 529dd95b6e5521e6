"""The expected answer of a shellcraft task, recomputed from its data (verifier side).

:func:`expected_outputs` rebuilds the task's input files with :func:`files.build` and derives
the answer by reading those bytes the way the prompt describes them, not from the generator's
internals: what the model is asked to do is what this code does. The reference solver
(``solver.py``) does the same with shell pipelines, and the tests check that both agree on
every task.

Answers are text files; every line ends with "\\n". The env never imports this module: the
answer code need not be inside the sandbox.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from . import files

# The combined log format up to the status: host ident user [time] "METHOD PATH PROTO" STATUS.
_ACCESS = re.compile(r'^\S+ \S+ \S+ \[[^\]]*\] "(\S+) (\S+) [^"]*" (\d{3}) ')
_ACCESS_NAME = re.compile(r"^access\.log(\.\d+(\.gz)?)?$")
_WORD_CHARS = "A-Za-z0-9_"


def expected_outputs(data: Mapping[str, Any]) -> dict[str, str]:
    """The answer files, path (relative to the work folder) -> text; raises like
    :func:`files.build` for data that is not a shellcraft task."""
    workspace = files.build(data)
    params = data["params"]
    match workspace.family:
        case "status_counts":
            return {files.STATUS_CSV: status_counts(workspace.inputs, params)}
        case "find_files":
            return {files.MATCHES_TXT: find_files(workspace.inputs, params)}
        case "csv_to_tsv":
            return csv_to_tsv(workspace.inputs, params)
        case "jsonl_totals":
            return {files.TOTALS_CSV: jsonl_totals(workspace.inputs, params)}
    raise ValueError(f"unknown family {workspace.family!r}")


def expected_input_digests(data: Mapping[str, Any]) -> dict[str, str]:
    """Input path -> digest of its content: what an untouched work folder reports."""
    return {f.path: files.content_digest(f.content) for f in files.build(data).inputs}


def _lines(rows: list[str]) -> str:
    return "".join(row + "\n" for row in rows)


def status_counts(inputs: tuple[files.InputFile, ...], params: Mapping[str, Any]) -> str:
    """``status,count`` rows over the access logs (not the error log), most requests first,
    ties by status ascending; only requests of ``method`` / under ``path_prefix`` when set."""
    method, prefix = params.get("method"), params.get("path_prefix")
    counts: Counter[str] = Counter()
    for f in inputs:
        folder, _, name = f.path.rpartition("/")
        if folder != files.LOG_DIR or not _ACCESS_NAME.match(name):
            continue
        for line in f.content.decode().splitlines():
            m = _ACCESS.match(line)
            if m is None:
                raise ValueError(f"{f.path}: not a combined-log line: {line!r}")
            if method is not None and m[1] != method:
                continue
            if prefix is not None and not m[2].startswith(prefix):
                continue
            counts[m[3]] += 1
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return _lines(["status,count", *(f"{status},{n}" for status, n in rows)])


def line_matches(line: str, params: Mapping[str, Any]) -> bool:
    """Whether a line holds the needle: a case-sensitive string ("literal"), or a whole word in
    any case ("word": no letter, digit or underscore right before or after it)."""
    needle = params["needle"]
    if params["mode"] == "literal":
        return needle in line
    pattern = rf"(?<![{_WORD_CHARS}]){re.escape(needle)}(?![{_WORD_CHARS}])"
    return re.search(pattern, line, re.IGNORECASE) is not None


def find_files(inputs: tuple[files.InputFile, ...], params: Mapping[str, Any]) -> str:
    """The matching files' paths, sorted by code point (byte order for these ASCII names)."""
    extension = params["extension"]
    paths = [
        f.path
        for f in inputs
        if (extension is None or f.path.endswith(extension))
        and any(line_matches(line, params) for line in f.content.decode().split("\n"))
    ]
    return _lines(sorted(paths))


def csv_to_tsv(inputs: tuple[files.InputFile, ...], params: Mapping[str, Any]) -> dict[str, str]:
    """``out/<name>.tsv`` for each ``data/<name>.csv`` directly in ``data/``: tab-separated,
    the ``drop`` column removed and the ``rename`` column renamed in the header."""
    rename, drop = params["rename"], params["drop"]
    outputs = {}
    for f in inputs:
        folder, _, name = f.path.rpartition("/")
        if folder != files.DATA_DIR or not name.endswith(".csv"):
            continue
        text = f.content.decode().replace("\r\n", "\n")
        rows = [line.split(",") for line in text.removesuffix("\n").split("\n")]
        header = rows[0]
        keep = [i for i, column in enumerate(header) if column != drop]
        if rename is not None:
            header[header.index(rename[0])] = rename[1]
        tsv = ["\t".join(row[i] for i in keep) for row in rows]
        outputs[f"{files.OUT_DIR}/{name.removesuffix('.csv')}.tsv"] = _lines(tsv)
    return outputs


def jsonl_totals(inputs: tuple[files.InputFile, ...], params: Mapping[str, Any]) -> str:
    """``user,<metric>`` per user with a counted event, by user: ``net_cents`` = purchases'
    minus refunds' ``amount_cents``; ``purchases`` = the number of purchases; only events in
    ``currency`` when it is set. Users are the top-level ``user`` field."""
    metric, currency = params["metric"], params["currency"]
    counted = ("purchase", "refund") if metric == "net_cents" else ("purchase",)
    totals: defaultdict[str, int] = defaultdict(int)
    for f in inputs:
        if not re.fullmatch(rf"{files.EVENTS_DIR}/[^/]+\.jsonl(\.gz)?", f.path):
            continue
        for line in f.content.decode().split("\n"):
            if not line.strip():
                continue
            event = json.loads(line)
            if event["type"] not in counted:
                continue
            if currency is not None and event["currency"] != currency:
                continue
            if metric == "purchases":
                totals[event["user"]] += 1
            else:
                sign = 1 if event["type"] == "purchase" else -1
                totals[event["user"]] += sign * event["amount_cents"]
    rows = [f"{user},{totals[user]}" for user in sorted(totals)]
    return _lines([f"user,{metric}", *rows])
