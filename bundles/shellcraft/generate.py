"""Write shellcraft's task files: ``python -m bundles.shellcraft.generate`` (from the repo root).

Every task is a pure function of ``(seed, split, index)``: its RNG is seeded from a SHA-256 of
those three, so one task can be regenerated without the others and the files are byte-for-byte
reproducible. The family cycles with the index (``files.FAMILIES`` order), so each family holds
a quarter of every split. A task line is ``{"id", "prompt", "data": {"family", "seed",
"params"}}``: ``seed`` fixes the input files' content (:func:`files.build`), ``params`` what is
asked (also spelled out in the prompt). The data holds no answer; the verifier recomputes it.

Usage: ``python -m bundles.shellcraft.generate [--out DIR] [--seed N]`` (defaults: this bundle's
``tasks/`` folder, seed 20250301). Exits non-zero only if the folder cannot be written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from . import files

DEFAULT_SEED = 20250301
SPLITS = {"train": 500, "eval": 100}


def task_rng(seed: int, split: str, index: int) -> random.Random:
    """The task's own RNG (a hash, not ``hash()``, so it is the same in every process)."""
    digest = hashlib.sha256(f"shellcraft:{seed}:{split}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def make_task(split: str, index: int, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """One task line (``id``, ``prompt``, ``data``); KeyError for an unknown split."""
    if not 0 <= index < SPLITS[split]:
        raise IndexError(f"split {split!r} has {SPLITS[split]} tasks, no index {index}")
    rng = task_rng(seed, split, index)
    family = files.FAMILIES[index % len(files.FAMILIES)]
    params = choose_params(family, rng)
    data = {"family": family, "seed": rng.getrandbits(32), "params": params}
    return {"id": f"{split}-{index:04d}", "prompt": render_prompt(family, params), "data": data}


def choose_params(family: str, rng: random.Random) -> dict[str, Any]:
    """What the task asks, drawn from the family's variants."""
    match family:
        case "status_counts":
            method, prefix = rng.choice([(None, None), ("POST", None), (None, "/api/")])
            return {"rotations": rng.randint(2, 5), "method": method, "path_prefix": prefix}
        case "find_files":
            mode = rng.choice(["literal", "word"])
            if mode == "literal":
                needle = f"{rng.choice(files.FIND_TAGS)}({rng.choice(files.FIND_NAMES)})"
            else:
                needle = rng.choice(files.FIND_WORDS)
            extension = rng.choice([".py", ".py", ".md", None])
            return {"mode": mode, "needle": needle, "extension": extension}
        case "csv_to_tsv":
            source, target = rng.choice(files.CSV_RENAMES)
            drop = rng.choice([c for c in files.CSV_DROPS if c != source])
            variant = rng.choice(["rename", "drop", "both"])
            return {
                "rename": None if variant == "drop" else [source, target],
                "drop": None if variant == "rename" else drop,
            }
        case "jsonl_totals":
            return {
                "metric": rng.choice(files.JSONL_METRICS),
                "currency": rng.choice([None, *files.JSONL_CURRENCIES]),
            }
    raise ValueError(f"unknown family {family!r}")


def render_prompt(family: str, params: dict[str, Any]) -> str:
    """The user message: the files, what to compute, the exact output format."""
    match family:
        case "status_counts":
            return _status_counts_prompt(params)
        case "find_files":
            return _find_files_prompt(params)
        case "csv_to_tsv":
            return _csv_to_tsv_prompt(params)
        case "jsonl_totals":
            return _jsonl_totals_prompt(params)
    raise ValueError(f"unknown family {family!r}")


def _status_counts_prompt(params: dict[str, Any]) -> str:
    if params["method"] is not None:
        which = f"the requests whose method is {params['method']}"
    elif params["path_prefix"] is not None:
        which = f"the requests whose path starts with {params['path_prefix']}"
    else:
        which = "all requests"
    return (
        "The folder logs/ holds a web server's access log, logs/access.log, and its rotated "
        "copies: logs/access.log.1, then older ones compressed as logs/access.log.2.gz, "
        "logs/access.log.3.gz and so on. Each of their lines is one request in the combined "
        'log format: host ident user [time] "METHOD PATH PROTOCOL" STATUS SIZE "REFERER" '
        '"USER-AGENT". Other files in logs/ are not access logs.\n'
        f"Count {which} across all of the access logs, per HTTP status code, and write the "
        f"counts to {files.STATUS_CSV} in the working folder: first the header line "
        "status,count, then one line STATUS,COUNT per status code that occurs, the most "
        "requests first and ties by status code ascending. Leave logs/ as it is."
    )


def _find_files_prompt(params: dict[str, Any]) -> str:
    needle = params["needle"]
    if params["mode"] == "literal":
        what = (
            f"the text {needle} (exactly these characters, case-sensitive; a plain string, "
            "not a pattern)"
        )
    else:
        what = (
            f"the word {needle} in any letter case as a whole word: the characters right "
            "before and after it (if any) are not letters, digits or underscores"
        )
    extension = params["extension"]
    kind = "file" if extension is None else f"file whose name ends in {extension}"
    return (
        f"The folder {files.PROJECT_DIR}/ holds a source tree; some folders are hidden (their "
        "names start with a dot) and some file names contain spaces.\n"
        f"Find every {kind} anywhere under {files.PROJECT_DIR}/ that contains {what}. Write "
        f"their paths relative to the working folder (like {files.PROJECT_DIR}/src/app.py) to "
        f"{files.MATCHES_TXT}, one per line, each once, sorted in byte order (what LC_ALL=C "
        f"sort does). Leave {files.PROJECT_DIR}/ as it is."
    )


def _csv_to_tsv_prompt(params: dict[str, Any]) -> str:
    changes = []
    if params["drop"] is not None:
        changes.append(f"without the column {params['drop']}")
    if params["rename"] is not None:
        source, target = params["rename"]
        changes.append(f"with the column {source} renamed to {target} in the header")
    return (
        f"The folder {files.DATA_DIR}/ holds CSV files: comma-separated, a header line first, "
        "no quoting (no field contains a comma, a quote or a tab; fields may be empty). The "
        "files share their columns, but each file may order them its own way. Some files end "
        "their lines with \\r\\n (Windows) and some lack a final newline.\n"
        f"For every file {files.DATA_DIR}/NAME.csv directly in {files.DATA_DIR}/ (not in its "
        f"subfolders), write {files.OUT_DIR}/NAME.tsv: the same lines in the same order, "
        f"tab-separated, {' and '.join(changes)}; the other columns stay in that file's "
        "order. Every output line ends with a single \\n. "
        f"{files.OUT_DIR}/ must hold nothing else. Leave {files.DATA_DIR}/ as it is."
    )


def _jsonl_totals_prompt(params: dict[str, Any]) -> str:
    metric, currency = params["metric"], params["currency"]
    if metric == "net_cents":
        what = (
            "net_cents: the sum of amount_cents over the user's purchase events minus the sum "
            "over its refund events"
        )
        who = "at least one counted purchase or refund event"
    else:
        what = "purchases: the number of the user's purchase events"
        who = "at least one counted purchase event"
    only = "" if currency is None else f" Count only events whose currency is {currency}."
    return (
        f"The folder {files.EVENTS_DIR}/ holds an app's events, one file per day: "
        f"{files.EVENTS_DIR}/DATE.jsonl, the oldest days compressed as "
        f"{files.EVENTS_DIR}/DATE.jsonl.gz. Each non-blank line of those files is one event, a "
        "JSON object with the top-level fields ts, user and type (view, purchase, refund, "
        "signup or logout); purchase and refund events also have amount_cents (an integer) "
        "and currency. Keys come in any order, and some events hold nested objects with a user "
        "field of their own, which is not the event's user.\n"
        f"For each user compute {what}.{only} Write {files.TOTALS_CSV} in the working folder: "
        f"the header line user,{metric}, then one line USER,VALUE for each user with {who}, "
        f"sorted by user ascending. Leave {files.EVENTS_DIR}/ as it is."
    )


def task_line(task: dict[str, Any]) -> str:
    """The task as its JSONL line (compact, key order fixed: the files must be reproducible)."""
    return json.dumps(task, separators=(",", ":"), ensure_ascii=False)


def write_split(out: Path, split: str, seed: int) -> Path:
    """Write ``out/<split>.jsonl``; returns its path."""
    path = out / f"{split}.jsonl"
    lines = (task_line(make_task(split, i, seed)) for i in range(SPLITS[split]))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write shellcraft's tasks/<split>.jsonl files.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tasks")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, count in SPLITS.items():
        path = write_split(args.out, split, args.seed)
        print(f"wrote {path} ({count} tasks, {path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
