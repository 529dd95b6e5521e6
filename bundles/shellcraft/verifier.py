"""shellcraft's verifier: the answer files the env read back, against the recomputed answer.

It runs outside the sandbox and trusts only the task's data and, of the state, the answer
texts and the inputs' digests the env read from the work folder (the only view of it there
is). The expected answer and the expected digests are recomputed here from the task's data
(:mod:`answers`); nothing the env recorded about itself (counters, ``submitted``) affects the
reward. A state of the wrong shape grades as an empty work folder, never as an error.

Scores (``[reward]`` combines ``correct`` and ``partial``):

- ``correct``: 1 when every answer file matches line for line (a missing final newline is
  forgiven, nothing else), no other file sits in an answer folder, and every input is intact.
- ``partial``: the share of the expected lines reproduced, per answer file (lines as a
  multiset, order ignored), divided by the larger of the expected and written line counts so
  padding does not pay; averaged over the expected and written answer files (an extra or a
  missing file counts 0). 1 when ``correct``.
- ``intact``: 1 when every input file still holds its original content (a gzip input may be
  recompressed, not changed). An episode that changed an input scores 0 on both of the above.
- ``submitted``: 1 when the model called ``submit`` (a statistic; not in the reward).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from corral.envs.episode import Task

from .answers import expected_input_digests, expected_outputs


def grade(task: Task, state: dict[str, Any]) -> dict[str, float]:
    """The named scores of the episode whose final env state is ``state``."""
    expected = expected_outputs(task.data)
    state = state if isinstance(state, dict) else {}
    written = _written(state.get("outputs"))
    omitted = state.get("outputs_omitted")
    omitted = omitted if type(omitted) is int and omitted > 0 else 0
    intact = _intact(expected_input_digests(task.data), state.get("inputs"))

    names = sorted(set(expected) | set(written))
    overlaps = [line_overlap(expected.get(n), written.get(n)) for n in names]
    exact = omitted == 0 and all(same_lines(expected.get(n), written.get(n)) for n in names)
    partial = sum(overlaps) / (len(names) + omitted)
    return {
        "correct": float(intact and exact),
        "partial": partial if intact else 0.0,
        "intact": float(intact),
        "submitted": float(state.get("submitted") is True),
    }


def split_lines(text: str) -> list[str]:
    """The lines of a text file; a final newline ends the last line, it does not start one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def same_lines(expected: str | None, written: str | None) -> bool:
    """Whether a written file equals the expected one (forgiving only a missing final newline)."""
    if expected is None or written is None:
        return False
    return split_lines(expected) == split_lines(written)


def line_overlap(expected: str | None, written: str | None) -> float:
    """Lines in common (as multisets) / the larger line count; 0 when either file is absent."""
    if expected is None or written is None:
        return 0.0
    want, got = split_lines(expected), split_lines(written)
    if not want and not got:
        return 1.0
    common = sum((Counter(want) & Counter(got)).values())
    return common / max(len(want), len(got))


def _written(outputs: Any) -> dict[str, str | None]:
    """Path -> the text the env read (None where it could not), from the state's outputs."""
    if not isinstance(outputs, dict):
        return {}
    written: dict[str, str | None] = {}
    for path, entry in outputs.items():
        text = entry.get("text") if isinstance(entry, dict) else None
        written[str(path)] = text if isinstance(text, str) else None
    return written


def _intact(expected: dict[str, str], reported: Any) -> bool:
    """Whether every input's reported digest is the one recomputed from the task's data."""
    if not isinstance(reported, dict):
        return False
    return all(reported.get(path) == digest for path, digest in expected.items())
