"""Reading what corral writes, for the viewer: run, eval and play folders as typed records.

What a folder may hold (each written by corral's own writers):

- a run folder (``corral train``): ``config.json``, ``metrics.jsonl``
  (:mod:`corral.trainer.metrics`), ``dropped.jsonl`` (why each dropped group was dropped) and
  ``evals/step-NNNNNN/`` eval folders;
- an eval folder (``corral eval``, and each of a run's evaluations):
  ``episodes.jsonl`` (:class:`~corral.rollouts.evals.EpisodeRecord` lines), ``summary.json``,
  ``transcripts/<n>.jsonl``;
- a play folder (``corral play``): ``episodes.jsonl`` (one summary line per episode, with its
  ``session_id``), ``samples.jsonl`` (:class:`~corral.samples.Sample` lines, ``rollout_id`` the
  session id), ``summary.json``;
- a samples folder (``corral run``'s gateway stage): ``samples.jsonl`` and ``drift.json``
  with no episodes file: each session (``rollout_id``) becomes one episode;
- any of them may hold ``traces.jsonl``: spans, one JSON object a line, with ``name``,
  ``start_s`` and ``end_s`` (or ``duration_s``), optional ``parent``/``attrs``, and the episode
  they belong to by ``session_id`` (or ``task_id`` with ``attempt``). Nothing needs it: without
  it an episode's timeline is the sums its record carries (model, tools, total seconds).

Each folder with an ``episodes.jsonl`` (or a ``samples.jsonl`` alone) is an :class:`EpisodeSet`;
a source (one path given to ``corral view``) holds one or more. Listing reads each episodes
file once into compact :class:`EpisodeSummary` rows plus the byte offset of every line, so an
episode, a sample or a trace is read later by seeking to its line, never by parsing the file
again. Indexes are cached per file (path, size, mtime): a file that grows is re-read.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from corral.trainer.metrics import METRICS_FILE, read_metrics
from corral.viewer.pieces import Pieces
from corral.viewer.redact import scrub

EPISODES_FILE = "episodes.jsonl"
SAMPLES_FILE = "samples.jsonl"
TRACES_FILE = "traces.jsonl"
SUMMARY_FILE = "summary.json"
DROPPED_FILE = "dropped.jsonl"
DRIFT_FILE = "drift.json"
CONFIG_FILE = "config.json"

SetKind = Literal["eval", "play", "samples"]
SourceKind = Literal["run", "eval", "play", "samples"]

# A reason in the list is its first line, cut here (the episode view has all of it).
REASON_CHARS = 200
# How deep under a source to look for episode sets (a run: evals/step-N/episodes.jsonl).
_SEARCH_DEPTH = 3
_STEP = re.compile(r"step-(\d+)$")
_ROLLOUT_ID = re.compile(rb'"rollout_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
# A task family is the task id without its trailing number: "eval-0007" -> "eval".
_FAMILY = re.compile(r"^(.*?)[-_:/.]?\d+$")


class ViewerError(Exception):
    """A path that is no corral folder, or an id that names nothing in it."""


@dataclass(frozen=True, slots=True)
class EpisodeSummary:
    """One episode as the list shows it: what the filters and sorting need, no messages.

    ``line`` is the episode's line in its set's episodes file (for a samples set: the
    session's position). ``flagged``: failed, or a sample not ``completed``, or no reward.
    """

    line: int
    task_id: str
    attempt: int
    group: str | None
    family: str
    reward: float | None
    failed: bool
    flagged: bool
    reason: str | None
    turns: int
    tool_calls: int
    seconds: float | None
    session_id: str | None
    samples: int


@dataclass(slots=True)
class EpisodeSet:
    """The episodes of one folder (an evaluation of a run, an eval or a play folder).

    ``weight_version``: the weights that played them, when known (a run's eval line).
    ``group_by``: what the episodes' ``group`` means (the bundle's ``[eval] group_by``,
    e.g. ``battery.capacity_mwh``)."""

    id: int
    source: int
    name: str
    folder: Path
    kind: SetKind
    step: int | None = None
    weight_version: str | None = None
    group_by: str | None = None
    summary: dict[str, Any] | None = None
    episodes: list[EpisodeSummary] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of each episode's line

    def info(self) -> dict[str, Any]:
        """JSON-ready, without the episodes."""
        return {
            "id": self.id,
            "source": self.source,
            "name": self.name,
            "kind": self.kind,
            "step": self.step,
            "weight_version": self.weight_version,
            "group_by": self.group_by,
            "summary": self.summary,
            "episodes": len(self.episodes),
            "has_samples": (self.folder / SAMPLES_FILE).exists(),
            "has_traces": (self.folder / TRACES_FILE).exists(),
        }


@dataclass(slots=True)
class Source:
    """One path given to the viewer: a run folder (its metrics and dropped groups) or an
    eval, play or samples folder; ``sets`` are its episode sets, in step order."""

    id: int
    path: Path
    kind: SourceKind
    sets: list[EpisodeSet]
    config: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "path": str(self.path),
            "name": self.path.name or str(self.path),
            "kind": self.kind,
            "sets": [s.id for s in self.sets],
            "has_metrics": (self.path / METRICS_FILE).exists(),
            "config": self.config,
        }


# -- opening sources ---------------------------------------------------------------------------


def open_sources(paths: Sequence[Path]) -> tuple[list[Source], list[EpisodeSet]]:
    """Every path as a :class:`Source`, and all their episode sets (ids global, in order).
    :class:`ViewerError` for a path that is not a folder corral wrote."""
    sources: list[Source] = []
    sets: list[EpisodeSet] = []
    for number, path in enumerate(paths):
        source = open_source(path, number, first_set=len(sets))
        sources.append(source)
        sets.extend(source.sets)
    return sources, sets


def open_source(path: Path, number: int = 0, *, first_set: int = 0) -> Source:
    """``path`` as source ``number`` with its sets indexed (ids from ``first_set``)."""
    path = path.expanduser()
    if not path.is_dir():
        raise ViewerError(f"{path} is not a folder")
    folders = sorted(_set_folders(path), key=_set_order)
    if not folders and not (path / METRICS_FILE).exists():
        raise ViewerError(
            f"{path} holds no {METRICS_FILE}, {EPISODES_FILE} or {SAMPLES_FILE}: not a run, "
            "eval or play folder"
        )
    steps = _eval_versions(path)
    sets: list[EpisodeSet] = []
    for folder in folders:
        name = "." if folder == path else str(folder.relative_to(path))
        match = _STEP.search(folder.name)
        step = int(match.group(1)) if match else None
        episode_set = EpisodeSet(
            id=first_set + len(sets),
            source=number,
            name=name,
            folder=folder,
            kind=_set_kind(folder),
            step=step,
            weight_version=steps.get(step) if step is not None else None,
        )
        index_set(episode_set)
        sets.append(episode_set)
    config = _read_json(path / CONFIG_FILE)
    kind: SourceKind
    if (path / METRICS_FILE).exists():
        kind = "run"
    elif sets and sets[0].folder == path:
        kind = sets[0].kind
    else:
        kind = "eval"
    return Source(number, path, kind, sets, scrub(config) if isinstance(config, dict) else None)


def _set_folders(root: Path) -> Iterator[Path]:
    for depth in range(_SEARCH_DEPTH + 1):
        pattern = "/".join(["*"] * depth)
        for folder in [root] if depth == 0 else root.glob(pattern):
            if not folder.is_dir() or folder.name in ("checkpoints", "tensorboard", "weights"):
                continue
            if (folder / EPISODES_FILE).exists() or (folder / SAMPLES_FILE).exists():
                yield folder


def _set_order(folder: Path) -> tuple[int, str]:
    match = _STEP.search(folder.name)
    return (int(match.group(1)) if match else -1, str(folder))


def _set_kind(folder: Path) -> SetKind:
    if not (folder / EPISODES_FILE).exists():
        return "samples"
    return "play" if (folder / SAMPLES_FILE).exists() else "eval"


def _eval_versions(run: Path) -> dict[int, str]:
    """Each evaluated step's weight version, from the run's eval lines."""
    if not (run / METRICS_FILE).exists():
        return {}
    return {
        int(line["step"]): str(line["weight_version"])
        for line in read_metrics(run)
        if line.get("kind") == "eval" and line.get("weight_version") is not None
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- indexing a set ----------------------------------------------------------------------------


def index_set(episode_set: EpisodeSet) -> None:
    """Fill ``episode_set``'s summaries and offsets from its files (one pass over each)."""
    summary = _read_json(episode_set.folder / SUMMARY_FILE)
    if isinstance(summary, dict):
        episode_set.summary = scrub(summary)
        group_by = summary.get("group_by")
        episode_set.group_by = group_by if isinstance(group_by, str) else None
    if episode_set.kind == "samples":
        episode_set.episodes, episode_set.offsets = _index_sessions(episode_set.folder)
    else:
        episode_set.episodes, episode_set.offsets = _index_episodes(
            episode_set.folder / EPISODES_FILE
        )


def _index_episodes(path: Path) -> tuple[list[EpisodeSummary], list[int]]:
    episodes: list[EpisodeSummary] = []
    offsets: list[int] = []
    for offset, raw in _lines(path):
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a torn last line (a writer that crashed mid-line)
        if isinstance(record, dict):
            episodes.append(summarize_record(record, len(episodes)))
            offsets.append(offset)
    return episodes, offsets


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line)`` of every non-empty line."""
    offset = 0
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                yield offset, raw
            offset += len(raw)


def summarize_record(record: dict[str, Any], line: int) -> EpisodeSummary:
    """The list row of one ``episodes.jsonl`` line (an eval record or a play line)."""
    task_id = str(record.get("task_id", f"line-{line}"))
    reward = _float(record.get("reward"))
    failed = bool(record.get("failed"))
    status = record.get("status")
    tool_calls = record.get("tool_calls")
    if not isinstance(tool_calls, int):
        tool_calls = sum(
            len(m.get("tool_calls") or [])
            for m in record.get("messages") or []
            if isinstance(m, dict)
        )
    seconds = _float(record.get("total_s", record.get("seconds")))
    samples = record.get("samples")
    return EpisodeSummary(
        line=line,
        task_id=task_id,
        attempt=int(record.get("attempt") or 0),
        group=None if record.get("group") is None else str(record["group"]),
        family=task_family(task_id),
        reward=reward,
        failed=failed,
        flagged=failed or reward is None or status not in (None, "completed", "graded"),
        reason=_first_line(record.get("reason")),
        turns=int(record.get("turns") or 0),
        tool_calls=tool_calls,
        seconds=seconds,
        session_id=record.get("session_id"),
        samples=samples if isinstance(samples, int) else 0,
    )


def task_family(task_id: str) -> str:
    """A task's family: its id without the trailing number (``eval-0007`` -> ``eval``)."""
    match = _FAMILY.match(task_id)
    return match.group(1) if match and match.group(1) else task_id


def _first_line(reason: Any) -> str | None:
    if not reason:
        return None
    text = str(scrub(str(reason))).strip().splitlines()
    return text[0][:REASON_CHARS] if text else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _index_sessions(folder: Path) -> tuple[list[EpisodeSummary], list[int]]:
    """A samples folder's sessions as episodes, in order of their first sample; ``offsets``
    are each session's first sample line (the samples index has them all)."""
    first: dict[str, int] = {}
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for offset, raw in _lines(folder / SAMPLES_FILE):
        try:
            sample = json.loads(raw)
        except ValueError:
            continue
        rid = str(sample.get("rollout_id"))
        first.setdefault(rid, offset)
        meta = sample.get("metadata") or {}
        rows[rid].append(
            {
                "reward": sample.get("reward"),
                "status": sample.get("status"),
                "task_id": meta.get("task_id"),
                "failure": meta.get("failure"),
                "turns": meta.get("num_turns") or 0,
            }
        )
    episodes = []
    for line, (rid, samples) in enumerate(rows.items()):
        failure = next((s["failure"] for s in samples if s["failure"]), None)
        reward = _float(samples[0]["reward"])
        failed = any(s["status"] == "failed" for s in samples)
        task_id = str(samples[0]["task_id"] or rid)
        episodes.append(
            EpisodeSummary(
                line=line,
                task_id=task_id,
                attempt=0,
                group=None,
                family=task_family(task_id),
                reward=reward,
                failed=failed,
                flagged=failed
                or reward is None
                or any(s["status"] != "completed" for s in samples),
                reason=_first_line(failure),
                turns=max(int(s["turns"]) for s in samples),
                tool_calls=0,
                seconds=None,
                session_id=rid,
                samples=len(samples),
            )
        )
    return episodes, [first[rid] for rid in rows]


# -- the episode list --------------------------------------------------------------------------

# The list's columns, in the order the API sends them (columnar: one array per column).
LIST_COLUMNS: tuple[str, ...] = (
    "set", "line", "task_id", "attempt", "group", "family", "reward", "failed", "flagged",
    "reason", "turns", "tool_calls", "seconds", "weight_version", "samples",
)  # fmt: skip


def episode_columns(sets: Sequence[EpisodeSet]) -> dict[str, list[Any]]:
    """Every episode of ``sets`` as columns (:data:`LIST_COLUMNS`): one JSON array per column
    is a third the size of one object per episode, and the page filters and sorts them
    in place."""
    columns: dict[str, list[Any]] = {name: [] for name in LIST_COLUMNS}
    for s in sets:
        for e in s.episodes:
            columns["set"].append(s.id)
            columns["weight_version"].append(s.weight_version)
            for name in LIST_COLUMNS:
                if name not in ("set", "weight_version"):
                    columns[name].append(getattr(e, name))
    return columns


# -- one episode -------------------------------------------------------------------------------


def read_line(path: Path, offset: int) -> dict[str, Any]:
    """The JSON object on the line at byte ``offset`` of ``path``."""
    with path.open("rb") as f:
        f.seek(offset)
        value = json.loads(f.readline())
    if not isinstance(value, dict):
        raise ViewerError(f"{path} at byte {offset}: not a JSON object")
    return value


def episode_of(episode_set: EpisodeSet, line: int) -> EpisodeSummary:
    if not 0 <= line < len(episode_set.episodes):
        raise ViewerError(f"set {episode_set.id} has no episode {line}")
    return episode_set.episodes[line]


def episode_detail(episode_set: EpisodeSet, line: int) -> dict[str, Any]:
    """Everything the episode view shows, secrets scrubbed: its ``record`` (messages, scores,
    reason, the agent's run), its samples (``samples``: a summary each, forks included),
    its ``spans`` (from ``traces.jsonl``, else the record's sums) and the transcript's
    existence."""
    summary = episode_of(episode_set, line)
    if episode_set.kind == "samples":
        record: dict[str, Any] = {
            "task_id": summary.task_id,
            "session_id": summary.session_id,
            "reward": summary.reward,
            "failed": summary.failed,
            "reason": None,
            "messages": [],
        }
    else:
        record = read_line(episode_set.folder / EPISODES_FILE, episode_set.offsets[line])
    samples = [sample_summary(s, n) for n, s in enumerate(samples_of(episode_set, summary))]
    if episode_set.kind == "samples" and samples:
        record["reason"] = next((s["failure"] for s in samples if s["failure"]), None)
    transcript = episode_set.folder / "transcripts" / f"{line}.jsonl"
    return {
        "set": episode_set.id,
        "line": line,
        "summary": asdict(summary),
        "weight_version": episode_set.weight_version,
        "group_by": episode_set.group_by,
        "record": scrub(record),
        "samples": samples,
        "spans": spans_of(episode_set, summary, record),
        "transcript": transcript.exists(),
    }


def samples_of(episode_set: EpisodeSet, summary: EpisodeSummary) -> list[dict[str, Any]]:
    """The episode's samples (raw ``Sample`` JSON) from its set's ``samples.jsonl``, matched by
    session id; ``[]`` when the set keeps none (an eval folder keeps messages, not tokens)."""
    if summary.session_id is None:
        return []
    offsets = _samples_index(episode_set.folder / SAMPLES_FILE).get(summary.session_id, [])
    return [read_line(episode_set.folder / SAMPLES_FILE, o) for o in offsets]


def sample_summary(sample: dict[str, Any], number: int) -> dict[str, Any]:
    """A sample without its tokens: sizes, status, weight versions and its fork, if any."""
    meta = sample.get("metadata") or {}
    mask = sample.get("loss_mask") or []
    return {
        "number": number,
        "tokens": len(sample.get("tokens") or []),
        "response_length": sample.get("response_length"),
        "trained_tokens": sum(mask),
        "reward": sample.get("reward"),
        "status": sample.get("status"),
        "trajectory": meta.get("trajectory"),
        "origin": meta.get("origin"),
        "weight_versions": meta.get("weight_versions") or [],
        "drift": scrub(meta.get("drift")),
        "failure": _first_line(meta.get("failure")),
    }


_SAMPLES_CACHE: dict[tuple[Path, int, int], dict[str, list[int]]] = {}


def _samples_index(path: Path) -> dict[str, list[int]]:
    """Session id -> byte offsets of its samples in ``path`` (cached while the file is
    unchanged). The id is found with a regex on the raw line: a 32,000-token sample is not
    parsed to learn whose it is."""
    if not path.exists():
        return {}
    stat = path.stat()
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _SAMPLES_CACHE:
        index: dict[str, list[int]] = defaultdict(list)
        for offset, raw in _lines(path):
            match = _ROLLOUT_ID.search(raw)
            rid = json.loads(b'"' + match.group(1) + b'"') if match else None
            if rid is None:
                try:
                    rid = json.loads(raw).get("rollout_id")
                except ValueError:
                    continue
            index[str(rid)].append(offset)
        _SAMPLES_CACHE.clear()  # one samples file at a time is enough to keep
        _SAMPLES_CACHE[key] = dict(index)
    return _SAMPLES_CACHE[key]


def spans_of(
    episode_set: EpisodeSet, summary: EpisodeSummary, record: dict[str, Any]
) -> dict[str, Any]:
    """The episode's timeline: ``traces.jsonl`` spans when the set has them (``kind:
    "trace"``), else the record's own sums (``kind: "sums"``: model, tools and total
    seconds, and a harness agent's marks), which say where time went but not when."""
    traces = episode_set.folder / TRACES_FILE
    if traces.exists():
        spans = []
        for _, raw in _lines(traces):
            try:
                span = json.loads(raw)
            except ValueError:
                continue
            # A line without start_s is no span (the writer's final "truncated" marker).
            if isinstance(span, dict) and "start_s" in span and _span_matches(span, summary):
                spans.append(_span(span))
        if spans:
            spans.sort(key=lambda s: s["start_s"])
            return {"kind": "trace", "spans": spans}
    sums = []
    for key, name in (("model_s", "model"), ("tools_s", "tools"), ("total_s", "total")):
        value = _float(record.get(key))
        if value is not None:
            sums.append({"name": name, "start_s": 0.0, "end_s": value})
    agent = record.get("agent")
    if isinstance(agent, dict):
        for key in ("launched_s", "first_request_s", "seconds", "reward_set_s"):
            value = _float(agent.get(key))
            if value is not None:
                sums.append({"name": f"agent {key.removesuffix('_s')}", "start_s": 0.0,
                             "end_s": value})  # fmt: skip
    return {"kind": "sums", "spans": sums}


def _span_matches(span: dict[str, Any], summary: EpisodeSummary) -> bool:
    if span.get("session_id") is not None:
        return span["session_id"] == summary.session_id
    return (
        span.get("task_id") == summary.task_id and int(span.get("attempt") or 0) == summary.attempt
    )


def _span(span: dict[str, Any]) -> dict[str, Any]:
    start = _float(span.get("start_s")) or 0.0
    end = _float(span.get("end_s"))
    if end is None:
        end = start + (_float(span.get("duration_s")) or 0.0)
    return {
        "name": str(span.get("name", "span")),
        "start_s": start,
        "end_s": end,
        "parent": span.get("parent"),
        "attrs": scrub(span.get("attrs") or {}),
    }


# -- one sample --------------------------------------------------------------------------------


def sample_detail(
    episode_set: EpisodeSet, line: int, number: int, pieces: Pieces | None = None
) -> dict[str, Any]:
    """Sample ``number`` of the episode as :func:`sample_view`, with where it sits (``set``,
    ``line``, ``number``, ``samples``: how many the episode has)."""
    summary = episode_of(episode_set, line)
    samples = samples_of(episode_set, summary)
    if not 0 <= number < len(samples):
        raise ViewerError(f"episode {line} of set {episode_set.id} has no sample {number}")
    view = sample_view(samples[number], pieces)
    view.update(set=episode_set.id, line=line, number=number, samples=len(samples))
    return view


def sample_view(sample: dict[str, Any], pieces: Pieces | None = None) -> dict[str, Any]:
    """One sample (``Sample`` JSON) token by token: ``tokens``; ``mask`` over all tokens (-1
    prompt, 0 observation, 1 trained); ``logprobs`` over all tokens (null on the prompt);
    ``turn`` per token (the model turn a trained token belongs to, -1 elsewhere) with
    ``weight_versions`` per model turn; ``fork`` (the drift event that started this
    trajectory, or null); ``pieces`` (each token's text, with a tokenizer)."""
    tokens: list[int] = list(sample.get("tokens") or [])
    response = int(sample.get("response_length") or 0)
    prompt = len(tokens) - response
    mask = [-1] * prompt + list(sample.get("loss_mask") or [])
    logprobs: list[float | None] = [None] * prompt
    logprobs += [_float(v) for v in sample.get("rollout_log_probs") or []]
    meta = sample.get("metadata") or {}
    return {
        "tokens": tokens,
        "mask": mask,
        "logprobs": logprobs,
        "turn": model_turns(mask),
        "weight_versions": meta.get("weight_versions") or [],
        "reward": sample.get("reward"),
        "status": sample.get("status"),
        "fork": scrub(meta.get("drift")),
        "trajectory": meta.get("trajectory"),
        "metadata": scrub({k: v for k, v in meta.items() if k != "drift"}),
        "pieces": pieces(tokens) if pieces is not None else None,
    }


def model_turns(mask: Sequence[int]) -> list[int]:
    """For each token, the model turn it belongs to (each run of trained tokens is one turn,
    counted from 0), -1 for prompt and observation tokens. Two model turns with no
    observation between them read as one (the sample does not keep where they meet)."""
    out: list[int] = []
    turn, inside = -1, False
    for m in mask:
        if m == 1:
            if not inside:
                turn, inside = turn + 1, True
            out.append(turn)
        else:
            inside = False
            out.append(-1)
    return out


# -- runs and comparisons ----------------------------------------------------------------------


def run_metrics(source: Source) -> dict[str, Any]:
    """A run's ``steps`` and ``evals`` (its metrics lines split by kind) and ``dropped``
    (``dropped.jsonl``: step, group, tasks, reason, detail per dropped group)."""
    path = source.path / METRICS_FILE
    lines = read_metrics(path) if path.exists() else []
    dropped = []
    dropped_path = source.path / DROPPED_FILE
    if dropped_path.exists():
        for _, raw in _lines(dropped_path):
            try:
                dropped.append(json.loads(raw))
            except ValueError:
                continue
    return {
        "steps": [line for line in lines if line.get("kind") != "eval"],
        "evals": [line for line in lines if line.get("kind") == "eval"],
        "dropped": scrub(dropped),
    }


def compare_sets(a: EpisodeSet, b: EpisodeSet) -> dict[str, Any]:
    """Paired reward differences (``b - a``) over the episodes both sets graded, paired by
    task id and attempt: the mean difference with its standard error, how many went up,
    down or stayed, and each pair; tasks only one side has (or that failed on one side) are
    counted, not paired."""
    left = {(e.task_id, e.attempt): e for e in a.episodes}
    right = {(e.task_id, e.attempt): e for e in b.episodes}
    pairs: list[dict[str, Any]] = []
    diffs: list[float] = []
    unpaired = 0
    for key in sorted(left.keys() | right.keys()):
        x, y = left.get(key), right.get(key)
        if x is None or y is None or x.reward is None or y.reward is None:
            unpaired += 1
            continue
        pairs.append(
            {"task_id": key[0], "attempt": key[1], "group": x.group, "a": x.reward,
             "b": y.reward, "diff": y.reward - x.reward, "a_line": x.line, "b_line": y.line}
        )  # fmt: skip
        diffs.append(y.reward - x.reward)
    mean = statistics.fmean(diffs) if diffs else None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {
        "a": a.id,
        "b": b.id,
        "paired": len(pairs),
        "unpaired": unpaired,
        "mean_diff": mean,
        "se": se,
        "better": sum(d > 0 for d in diffs),
        "worse": sum(d < 0 for d in diffs),
        "same": sum(d == 0 for d in diffs),
        "pairs": pairs,
    }
