"""A run's per-step metrics: one JSON line per step in ``metrics.jsonl``, mirrored to TensorBoard.

Every line has every key of :data:`STEP_KEYS` (a count that did not occur is 0, never absent;
a value that was not measured, like ``kl`` without a reference model, is ``null``),
so tools can read the file without guessing; evaluation keys (:data:`EVAL_KEYS`) appear on the
steps where evaluation ran, with ``step`` the number of updates done before it (an evaluation
before the first update is step 0, a line of its own with ``kind = "eval"``).

Keys, by group:

- rollouts: ``reward/mean``, ``reward/std`` (over the kept rollouts), ``reward/zero_share``,
  ``rollouts`` (kept), ``rollouts_played`` (dropped groups' too), ``rollouts_failed`` (played
  and flagged failed: a timed-out or crashed agent, an env failure), ``groups``, ``samples``,
  ``samples_per_rollout``, ``response_tokens/mean``;
- the group filter: ``dropped/failed_rollout``, ``dropped/aborted_rollout``,
  ``dropped/all_equal``, ``draws``, ``surplus_groups``;
- the update: ``loss``, ``pg_loss``, ``kl``, ``entropy``, ``clip_fraction``, ``tis_weight``,
  ``grad_norm``, ``tokens``, ``trained_tokens``, ``micro_batches``, ``lr``;
- time (seconds): ``time/generation`` (waiting for the step's rollouts), ``time/training``,
  ``time/weight_sync``, ``time/eval``, ``time/step``; ``memory/peak_gb`` (the accelerator's peak
  allocated memory, or the process's peak resident size on CPU);
- evaluation: ``eval/reward/mean``, ``eval/reward/se``, ``eval/zero_share``, ``eval/failed``,
  ``eval/episodes``, and ``eval/group/<name>`` per group of the bundle's ``[eval] group_by``.
"""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from corral.trainer.groups import DROP_ABORTED, DROP_ALL_EQUAL, DROP_FAILED

STEP_KEYS: tuple[str, ...] = (
    "step",
    "weight_version",
    "reward/mean",
    "reward/std",
    "reward/zero_share",
    "rollouts",
    "rollouts_played",
    "rollouts_failed",
    "groups",
    "samples",
    "samples_per_rollout",
    "response_tokens/mean",
    f"dropped/{DROP_FAILED}",
    f"dropped/{DROP_ABORTED}",
    f"dropped/{DROP_ALL_EQUAL}",
    "draws",
    "surplus_groups",
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clip_fraction",
    "tis_weight",
    "grad_norm",
    "tokens",
    "trained_tokens",
    "micro_batches",
    "lr",
    "time/generation",
    "time/training",
    "time/weight_sync",
    "time/eval",
    "time/step",
    "memory/peak_gb",
)
EVAL_KEYS: tuple[str, ...] = (
    "eval/reward/mean",
    "eval/reward/se",
    "eval/zero_share",
    "eval/failed",
    "eval/episodes",
)
METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends lines to ``<run_dir>/metrics.jsonl`` (flushed per line, so a crash loses at
    most the line being written) and, with ``tensorboard``, writes every numeric value as a
    scalar under ``<run_dir>/tensorboard``. A resumed run keeps appending; lines of steps
    beyond the checkpoint that a crash left are dropped first, so each step appears once.
    :attr:`evaluated_steps` are the steps with an eval line (kept or written), so a resumed
    run neither repeats nor loses the evaluation of the step it resumes from. That rewrite is
    never in place (a temporary file fsynced, then renamed over the old one), so a crash
    during it leaves the old file whole."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        self._evaluated: set[int] = set()
        if self.path.exists():
            kept = [line for line in read_metrics(self.path) if line["step"] <= resume_step]
            self._evaluated = {int(line["step"]) for line in kept if line.get("kind") == "eval"}
            _replace_atomically(self.path, "".join(json.dumps(line) + "\n" for line in kept))
        self._file = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, line: Mapping[str, Any]) -> None:
        """Append ``line``; a non-finite number is written as ``null`` (strict JSON: "not
        measured", e.g. ``kl`` without a reference model)."""
        clean = {k: None if _nonfinite(v) else v for k, v in line.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        if line.get("kind") == "eval":
            self._evaluated.add(int(line["step"]))
        if self._tb is not None:
            step = int(line["step"])
            for key, value in line.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    @property
    def evaluated_steps(self) -> frozenset[int]:
        """Every step the file holds an eval line of."""
        return frozenset(self._evaluated)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replace_atomically(path: Path, text: str) -> None:
    """``path`` holding ``text``: written to a sibling temporary file, fsynced, renamed over
    ``path`` and the folder fsynced; on any failure ``path`` is as it was and no temporary
    file is left."""
    scratch = path.with_name(f".{path.name}.tmp")
    try:
        with scratch.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics file (a run folder or the file itself). A torn last line (a
    crash mid-write) is skipped; any other malformed line raises ValueError with its number."""
    path = path / METRICS_FILE if path.is_dir() else path
    lines = path.read_text().splitlines()
    out: list[dict[str, Any]] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    return out


def series(lines: list[dict[str, Any]], key: str) -> Iterator[tuple[int, float]]:
    """``(step, value)`` for the lines that have a finite numeric ``key``."""
    for line in lines:
        value = line.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            yield int(line["step"]), float(value)


def reset_peak_memory(device: str) -> None:
    """Start a new peak for :func:`peak_memory_gb` (on CUDA; CPU has only the process's)."""
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb(device: str) -> float:
    """The accelerator's peak allocated memory since :func:`reset_peak_memory`, in GiB; on CPU
    the process's peak resident size since it started (``ru_maxrss``, KiB on Linux)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
