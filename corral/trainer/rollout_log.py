"""What each training step played, kept for ``corral view``: a folder per update under the run,
``rollouts/update-NNNNNN/``, holding

- ``episodes.jsonl``: one :class:`~corral.rollouts.evals.EpisodeRecord` line per rollout the
  step played (its ``group`` the GRPO group index, its ``attempt`` the rollout's index in the
  group), kept or dropped alike (``dropped.jsonl`` says which groups were dropped and why);
- ``samples.jsonl``: every sample those rollouts' sessions recorded (``rollout_id`` the
  session id), the exact tokens the update trained on;
- ``traces.jsonl``: their spans (:mod:`corral.rollouts.traces`), when the player ran in this
  process (Ray's rollout workers play elsewhere: their steps have no traces).

The folder of update N holds the rollouts update N trained on, played under the weights before
it (each model turn's own weight version is in the samples). Only every ``every``-th update is
kept, and only the newest ``keep`` folders (0: all): a step's samples are its whole batch of
tokens, tens of megabytes on a real run.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from corral.rollouts.evals import EpisodeRecord
from corral.rollouts.player import Rollout
from corral.rollouts.traces import Span, TraceWriter

ROLLOUTS_DIR = "rollouts"
# Sessions whose spans are held at once, waiting for their step (a fill's rollouts, and under
# overlap the next fill's): past it the oldest are dropped, so a run that never writes them
# holds no more than this.
MAX_HELD_SESSIONS = 10_000


def update_folder(run_dir: Path, step: int) -> Path:
    """Where update ``step``'s rollouts go."""
    return run_dir / ROLLOUTS_DIR / f"update-{step:06d}"


class SessionTraces:
    """A :class:`~corral.rollouts.traces.TraceSink` that holds each episode's spans by its
    session id until the step that trained on it takes them (rollouts end in any order, and
    under overlap the next step's start before this one's are written). Thread-safe; bounded by
    :data:`MAX_HELD_SESSIONS`."""

    def __init__(self, max_sessions: int = MAX_HELD_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._held: OrderedDict[str, list[Span]] = OrderedDict()
        self._lock = threading.Lock()

    def write(self, spans: Sequence[Span]) -> None:
        with self._lock:
            for span in spans:
                if span.session_id is not None:
                    self._held.setdefault(span.session_id, []).append(span)
            while len(self._held) > self.max_sessions:
                self._held.popitem(last=False)

    def take(self, session_ids: Iterable[str]) -> list[Span]:
        """The spans of ``session_ids``, forgotten here; none for a session it never saw."""
        with self._lock:
            return [span for sid in session_ids for span in self._held.pop(sid, [])]


class RolloutLog:
    """Writes the rollouts of every ``every``-th update (0: none) under ``run_dir``, keeping the
    newest ``keep`` folders (0: all). A write that fails is an OSError: the trainer's own
    files are on the same disk, and a run that cannot write them should stop."""

    def __init__(self, run_dir: Path, *, every: int, keep: int) -> None:
        self.run_dir = run_dir
        self.every = every
        self.keep = keep
        self.traces = SessionTraces()

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def write(self, step: int, played: Sequence[Rollout]) -> Path | None:
        """Write update ``step``'s ``played`` rollouts when it is due (module docstring);
        return the folder, or None when not due. The spans of every rollout played are taken
        from :attr:`traces` either way."""
        spans = self.traces.take(r.session_id for r in played)
        if not self.due(step):
            return None
        folder = update_folder(self.run_dir, step)
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "episodes.jsonl").open("w") as episodes:
            for rollout in played:
                group, attempt = _place(rollout)
                record = EpisodeRecord.of(rollout, attempt, None if group is None else str(group))
                episodes.write(record.model_dump_json() + "\n")
        with (folder / "samples.jsonl").open("w") as samples:
            for rollout in played:
                for sample in rollout.samples:
                    samples.write(sample.model_dump_json() + "\n")
        summary = {"step": step, "rollouts": len(played), "group_by": "group_index"}
        (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        TraceWriter(folder).write(spans)
        self._prune()
        return folder

    def _prune(self) -> None:
        if not self.keep:
            return
        folders = sorted((self.run_dir / ROLLOUTS_DIR).glob("update-*"))
        for old in folders[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _place(rollout: Rollout) -> tuple[int | None, int]:
    """The rollout's GRPO group and its index in the group, as its samples carry them (a
    rollout that recorded no sample: no group, index 0)."""
    for sample in rollout.samples:
        return sample.group_index, int(sample.index or 0)
    return None, 0
