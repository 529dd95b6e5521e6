"""The shellcraft bundle: reproducible tasks, the env's bash tool (timeouts, process groups,
truncation, tool errors), the state it reads back, and the verifier's scores.

Episodes run in-process, each in its own temporary work folder (the env writes its inputs into
the current working folder), with the bundle's own loader, env class and verifier.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bundles.shellcraft import answers, files, generate, snapshot, workspace
from bundles.shellcraft.baselines import baseline_rows
from bundles.shellcraft.solver import solve
from corral.envs.bundle import Bundle, load_bundle, validate_bundle
from corral.envs.episode import Task

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "shellcraft"


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return load_bundle(BUNDLE)


def first_of(bundle: Bundle, split: str, family: str, count: int = 1) -> list[Task]:
    return [t for t in bundle.tasks(split) if t.data["family"] == family][:count]


def start(bundle: Bundle, task: Task, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh env, reset on ``task`` as the server resets it (the env's view of the task,
    ``[env] task_data``) with ``folder`` as the working folder."""
    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(folder)
    env = bundle.env_class()
    assert env.reset(bundle.env_task(task)) == task.prompt
    return env


def run(env: Any, command: str) -> str:
    outcome = env.call_tool("bash", {"command": command})
    assert not outcome.error and not outcome.done, outcome.content
    return str(outcome.content)


def reward_of(bundle: Bundle, task: Task, env: Any) -> tuple[float, dict[str, float]]:
    state = env.state()
    json.dumps(state)  # plain JSON data: it crosses the sandbox boundary
    scores = bundle.grade(task, state)
    return bundle.reward(scores), scores


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes (a deadline, not a sleep that
    hopes the other side is done)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def process_gone(pid: int) -> bool:
    """Whether ``pid`` is dead: no such process, or a zombie that only waits to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# --- the bundle and its tasks -----------------------------------------------------------------


def test_the_bundle_validates(bundle: Bundle) -> None:
    assert validate_bundle(BUNDLE) == []
    manifest = bundle.manifest
    assert manifest.sandbox.needs == "process"
    assert [t.name for t in manifest.tools] == ["bash", "submit"]
    assert manifest.tools[0].parameters["required"] == ["command"]
    assert manifest.reward.weights == {"correct": 0.8, "partial": 0.2}
    assert bundle.reward({"correct": 1.0, "partial": 1.0}) == pytest.approx(1.0)


def test_generation_is_reproducible(tmp_path: Path) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    for split in ("train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (
            BUNDLE / "tasks" / f"{split}.jsonl"
        ).read_bytes()
    assert generate.make_task("train", 7, seed=1) != generate.make_task("train", 7)


def test_splits_mix_the_families_and_hold_no_answers(bundle: Bundle) -> None:
    for split, count in generate.SPLITS.items():
        tasks = bundle.tasks(split)
        assert len(tasks) == count
        per_family = {f: sum(t.data["family"] == f for t in tasks) for f in files.FAMILIES}
        assert per_family == {f: count // 4 for f in files.FAMILIES}
        for task in tasks:
            assert set(task.data) == {"family", "seed", "params"}
            output = next(iter(answers.expected_outputs(task.data)))
            assert output.split("/")[0] in task.prompt  # the prompt names where to write
    train_seeds = {t.data["seed"] for t in bundle.tasks("train")}
    assert not train_seeds & {t.data["seed"] for t in bundle.tasks("eval")}


def test_inputs_are_the_same_in_every_process(bundle: Bundle) -> None:
    """Another interpreter, another hash seed: the verifier outside the sandbox must rebuild
    the exact inputs the env wrote inside it."""
    tasks = [first_of(bundle, "eval", f)[0] for f in files.FAMILIES]

    def digest(data: dict[str, Any]) -> str:
        blob = b"".join(f.path.encode() + f.content for f in files.build(data).inputs)
        return hashlib.sha256(blob).hexdigest()

    script = (
        "import hashlib, json, sys\n"
        "from bundles.shellcraft import files\n"
        "for data in json.load(sys.stdin):\n"
        "    ws = files.build(data)\n"
        "    print(hashlib.sha256(b''.join(f.path.encode() + f.content for f in ws.inputs))"
        ".hexdigest())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([t.data for t in tasks]),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)},
        check=True,
    )
    assert proc.stdout.split() == [digest(t.data) for t in tasks]


def test_the_env_imports_only_the_standard_library_and_the_episode_module() -> None:
    """The env runs in a sandbox where corral is not installed: follow its relative imports
    through the bundle and allow only the standard library and the corral modules shipped
    beside the runner (``episode``, ``model_actions``)."""
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    seen: set[str] = set()
    todo = ["env"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        tree = ast.parse((BUNDLE / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo.extend([node.module] if node.module else [a.name for a in node.names])
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module is not None
                top = node.module.split(".")[0]
                shipped = node.module in ("corral.envs.episode", "corral.envs.model_actions")
                assert shipped or top in allowed, (module, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in allowed, (module, alias.name)
    # files.py (the generator), answers.py (the answer code) stay outside the sandbox
    assert seen == {"env", "shell", "snapshot", "workspace"}
    assert load_bundle(BUNDLE).payload_files() == [f"{m}.py" for m in sorted(seen)]


def test_the_env_gets_the_files_and_never_the_seed(bundle: Bundle) -> None:
    """``[env] task_data``: the view holds each input's bytes and the answer's names, and
    nothing the answer derives from that the prompt does not state (no seed, no params)."""
    for task in first_of(bundle, "eval", "csv_to_tsv", 2) + first_of(bundle, "eval", "find_files"):
        view = bundle.env_task(task).data
        assert set(view) == {"family", "inputs", "output_files", "output_dir"}
        assert str(task.data["seed"]) not in json.dumps(view)
        full = files.build(task.data)
        assert workspace.from_view(view) == full  # the same workspace, input for input
        assert workspace.from_view(json.loads(json.dumps(view))) == full  # as JSON, too
    view = bundle.env_task(first_of(bundle, "eval", "status_counts")[0]).data
    for bad in ("/etc/passwd", "../up", "a//b", "./a", ""):
        broken = {**view, "inputs": [{**view["inputs"][0], "path": bad}]}
        with pytest.raises(ValueError, match="not a relative path"):
            workspace.from_view(broken)
    with pytest.raises(ValueError, match="bad base64"):
        workspace.from_view({**view, "inputs": [{**view["inputs"][0], "content_b64": "@@"}]})
    with pytest.raises(TypeError, match="gzipped must be a boolean"):
        workspace.from_view({**view, "inputs": [{**view["inputs"][0], "gzipped": "yes"}]})


# --- episodes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", files.FAMILIES)
def test_the_solver_scores_the_max_reward(
    bundle: Bundle, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks = first_of(bundle, "eval", family, 3) + first_of(bundle, "train", family, 2)
    for task in tasks:
        env = start(bundle, task, tmp_path / task.id, monkeypatch)
        for command in solve(task.data):
            run(env, command)
        outcome = env.call_tool("submit", {"note": "done"})
        assert outcome.done and not outcome.error
        reward, scores = reward_of(bundle, task, env)
        assert reward == pytest.approx(1.0), (task.id, scores)
        assert scores == {"correct": 1.0, "partial": 1.0, "intact": 1.0, "submitted": 1.0}


@pytest.mark.parametrize("family", files.FAMILIES)
def test_an_untouched_folder_scores_zero(
    bundle: Bundle, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", family)[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    reward, scores = reward_of(bundle, task, env)
    assert reward == 0.0
    assert scores == {"correct": 0.0, "partial": 0.0, "intact": 1.0, "submitted": 0.0}


def write_answer(root: Path, outputs: dict[str, str]) -> None:
    for path, text in outputs.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


@pytest.mark.parametrize("family", ["status_counts", "find_files", "jsonl_totals"])
def test_wrong_answers_earn_only_partial_credit(
    bundle: Bundle, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", family)[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    [(path, text)] = answers.expected_outputs(task.data).items()
    lines = text.splitlines()
    n = len(lines)

    write_answer(tmp_path, {path: "\n".join(lines)})  # no final newline: forgiven
    assert reward_of(bundle, task, env)[0] == pytest.approx(1.0)

    write_answer(tmp_path, {path: "\n".join(lines[:-1]) + "\n"})  # a line missing
    reward, scores = reward_of(bundle, task, env)
    assert scores["correct"] == 0.0 and scores["partial"] == pytest.approx((n - 1) / n)
    assert reward == pytest.approx(0.2 * (n - 1) / n)

    padded = lines + [f"{line}x" for line in lines]  # padding does not pay
    write_answer(tmp_path, {path: "\n".join(padded) + "\n"})
    assert reward_of(bundle, task, env)[1]["partial"] == pytest.approx(0.5)

    write_answer(tmp_path, {path: "\n".join(reversed(lines)) + "\n"})  # right lines, wrong order
    assert reward_of(bundle, task, env)[1] == {
        "correct": 0.0,
        "partial": 1.0,
        "intact": 1.0,
        "submitted": 0.0,
    }

    write_answer(tmp_path, {path: text.replace("\n", "\r\n")})  # CRLF is another line
    assert reward_of(bundle, task, env)[1]["correct"] == 0.0


def test_an_answer_folder_counts_missing_and_extra_files(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "csv_to_tsv")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    expected = answers.expected_outputs(task.data)
    k = len(expected)
    write_answer(tmp_path, expected)
    assert reward_of(bundle, task, env)[0] == pytest.approx(1.0)

    (tmp_path / "out" / "notes.txt").write_text("scratch\n")  # out/ must hold nothing else
    scores = reward_of(bundle, task, env)[1]
    assert scores["correct"] == 0.0 and scores["partial"] == pytest.approx(k / (k + 1))

    (tmp_path / "out" / "notes.txt").unlink()
    (tmp_path / next(iter(sorted(expected)))).unlink()
    assert reward_of(bundle, task, env)[1]["partial"] == pytest.approx((k - 1) / k)


def test_a_changed_input_scores_zero(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "status_counts")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    for command in solve(task.data):
        run(env, command)
    assert reward_of(bundle, task, env)[0] == pytest.approx(1.0)

    # Recompressing a gzip input keeps its content: still intact.
    run(env, "zcat logs/access.log.2.gz | gzip -9 > x.gz && mv x.gz logs/access.log.2.gz")
    assert reward_of(bundle, task, env)[1]["intact"] == 1.0

    # One line dropped from a rotated log (the answer file still holds the right counts).
    run(env, "sed -i 1d logs/access.log.1")
    reward, scores = reward_of(bundle, task, env)
    assert reward == 0.0
    assert scores == {"correct": 0.0, "partial": 0.0, "intact": 0.0, "submitted": 0.0}


def test_the_verifier_trusts_only_what_it_recomputes(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task, other = first_of(bundle, "eval", "status_counts", 2)
    env = start(bundle, task, tmp_path / "a", monkeypatch)
    for command in solve(task.data):
        run(env, command)
    state = env.state()
    # The same folder state graded against another task: its digests and answer differ.
    assert bundle.grade(other, state)["correct"] == 0.0
    # Claims the env makes about itself do not score; digests for the wrong content fail.
    forged = {**state, "submitted": True, "inputs": dict.fromkeys(state["inputs"], "0" * 64)}
    assert bundle.reward(bundle.grade(task, forged)) == 0.0
    for junk in ({}, {"outputs": "x", "inputs": []}, {"outputs": {"status_counts.csv": 5}}):
        assert bundle.reward(bundle.grade(task, junk)) == 0.0


# --- the bash tool ----------------------------------------------------------------------------


def test_tool_errors_keep_the_episode_going(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "find_files")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    bad_calls: list[tuple[str, Any]] = [
        ("shell", {"command": "ls"}),
        ("bash", {}),
        ("bash", {"command": 42}),
        ("bash", {"command": ["ls", "-la"]}),
        ("bash", {"command": "   "}),
        ("bash", {"command": "ls", "timeout": 60}),
        ("bash", {"command": "x" * 20_001}),
        ("bash", "ls"),
        ("submit", {"note": 3}),
        ("submit", {"answer": "done"}),
    ]
    for name, arguments in bad_calls:
        outcome = env.call_tool(name, arguments)
        assert outcome.error and not outcome.done and outcome.content.startswith("error: ")
    assert "not an array" in env.call_tool("bash", {"command": ["ls"]}).content
    assert env.state()["tool_errors"] == len(bad_calls) + 1 and env.state()["commands"] == 0

    assert "project" in run(env, "ls")
    turn = env.end_turn({"answer": "thinking"})
    assert not turn.done and "submit" in turn.content
    assert env.call_tool("submit", {}).done
    again = env.call_tool("bash", {"command": "ls"})
    assert again.error and "already submitted" in again.content
    assert env.state()["submitted"] is True and env.state()["commands"] == 1


def test_a_removed_work_folder_is_the_models_mistake(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "jsonl_totals")[0]
    env = start(bundle, task, tmp_path / "work", monkeypatch)
    run(env, f"cd / && rm -rf {tmp_path / 'work'}")
    outcome = env.call_tool("bash", {"command": "ls"})
    assert outcome.error and not outcome.done and "gone" in outcome.content
    reward, scores = reward_of(bundle, task, env)
    assert reward == 0.0 and scores["intact"] == 0.0


def test_bash_reports_exit_codes_and_runs_in_a_fixed_environment(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_SECRET_TOKEN", "do-not-leak")
    task = first_of(bundle, "eval", "jsonl_totals")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    assert run(env, "echo out; echo err >&2; exit 3") == "exit code: 3\nstdout:\nout\nstderr:\nerr"
    assert run(env, "true") == "exit code: 0\n(no output)"
    assert run(env, "kill -9 $$").startswith("killed by signal 9")
    environment = run(env, "env")
    assert "do-not-leak" not in environment and "LC_ALL=C" in environment
    assert f"HOME={tmp_path}" in environment
    run(env, "cd events && export X=1 && touch made-here")
    assert run(env, 'pwd; echo "[$X]"') == f"exit code: 0\nstdout:\n{tmp_path}\n[]"
    assert (tmp_path / "events" / "made-here").exists()  # files carry over, the shell does not


def test_output_is_cut_at_the_limit(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "csv_to_tsv")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    env.output_limit_bytes = 100
    text = run(env, "head -c 5000 /dev/zero | tr '\\0' a; echo; printf 'e%.0s' $(seq 150) >&2")
    out, err = text.split("stderr:\n")
    assert "a" * 100 in out and "a" * 101 not in out
    assert "[stdout cut: showing the first 100 of 5,001 bytes]" in out
    assert err.startswith("e" * 100 + "\n[stderr cut: showing the first 100 of 150 bytes]")
    # A flood for the whole call costs no memory beyond the limit and still returns.
    started = time.monotonic()
    assert "of 2,000,000 bytes" in run(env, "yes | head -c 2000000")
    assert time.monotonic() - started < 5


def test_a_timeout_kills_the_whole_process_group(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "status_counts")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    env.command_timeout_s = 0.5
    started = time.monotonic()
    text = run(env, "sleep 60 & echo $! > child.pid; sleep 61 & echo started; wait")
    assert time.monotonic() - started < 5
    assert text.startswith("timed out after 0.5 s") and "started" in text  # output kept
    child = int((tmp_path / "child.pid").read_text())
    assert wait_until(lambda: process_gone(child))
    assert env.state()["timeouts"] == 1


def test_background_jobs_do_not_outlive_their_call(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "status_counts")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    started = time.monotonic()
    assert run(env, "sleep 60 > /dev/null 2>&1 & echo $! > bg.pid") == "exit code: 0\n(no output)"
    assert time.monotonic() - started < 5
    background = int((tmp_path / "bg.pid").read_text())
    assert wait_until(lambda: process_gone(background))


def test_a_process_that_leaves_the_group_cannot_hang_a_call(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "status_counts")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    started = time.monotonic()
    # setsid: a session of its own, out of reach of the group kill, holding the stdout pipe;
    # the loop waits until it is in its session (field 6 of /proc/PID/stat) before bash exits.
    command = (
        "setsid sleep 30 & echo $! > escaped.pid; "
        'until [ "$(cut -d" " -f6 /proc/$!/stat)" = "$!" ]; do :; done; echo bye'
    )
    text = run(env, command)
    escaped = int((tmp_path / "escaped.pid").read_text())
    try:
        assert time.monotonic() - started < 5
        assert text == "exit code: 0\nstdout:\nbye"
        assert not process_gone(escaped)  # it did escape: the call returned all the same
    finally:
        os.kill(escaped, 9)


def test_orphans_are_reaped_when_the_env_is_their_reaper(tmp_path: Path) -> None:
    """In a bwrap sandbox the runner is pid 1, so killed leftovers of a command become its
    children: they must not pile up as zombies (they count against the pids limit)."""
    script = f"""
import ctypes, os, sys
from pathlib import Path
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from corral.envs.bundle import load_bundle
bundle = load_bundle({str(BUNDLE)!r})
task = [t for t in bundle.tasks("eval") if t.data["family"] == "find_files"][0]
os.chdir({str(tmp_path)!r})
env = bundle.make_env()
env.reset(bundle.env_task(task))
for _ in range(3):
    env.call_tool("bash", {{"command": "for i in $(seq 10); do sleep 60 & done; echo ok"}})
env.state()
def zombies():
    me, count = str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        count += fields[0] == "Z" and fields[1] == me
    return count
print(zombies())
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        timeout=60,
    )
    # 30 sleeps were killed; the last call's may still be dying when state() reaps.
    assert int(proc.stdout.strip()) <= 10, proc.stdout + proc.stderr


# --- the state the env reads back --------------------------------------------------------------


def test_state_reads_only_regular_files_within_bounds(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "status_counts")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    answer = tmp_path / files.STATUS_CSV
    os.mkfifo(answer)  # opening a FIFO for reading would block forever
    assert env.state()["outputs"][files.STATUS_CSV] == {
        "text": None,
        "problem": "not a regular file",
    }
    answer.unlink()
    answer.symlink_to("/dev/zero")
    assert env.state()["outputs"][files.STATUS_CSV]["text"] is None
    answer.unlink()
    answer.write_bytes(b"a" * (snapshot.MAX_OUTPUT_BYTES + 1))
    assert "larger than" in env.state()["outputs"][files.STATUS_CSV]["problem"]
    answer.write_bytes(b"\xff\xfe")
    assert env.state()["outputs"][files.STATUS_CSV]["problem"] == "not UTF-8 text"

    # An input swapped for a symlink to a copy of itself is not taken as intact.
    log = tmp_path / "logs" / "access.log"
    (tmp_path / "copy.log").write_bytes(log.read_bytes())
    log.unlink()
    log.symlink_to(tmp_path / "copy.log")
    assert env.state()["inputs"]["logs/access.log"] is None


def test_a_gzip_bomb_is_not_inflated() -> None:
    bomb = gzip.compress(b"\0" * (snapshot.MAX_INPUT_BYTES + 1))
    with pytest.raises(snapshot.Unreadable, match="inflates beyond"):
        snapshot.gunzip_bounded(bomb, snapshot.MAX_INPUT_BYTES)
    two_members = gzip.compress(b"ab") + gzip.compress(b"cd")
    assert snapshot.gunzip_bounded(two_members, 100) == b"abcd"  # as zcat reads it
    with pytest.raises(snapshot.Unreadable):
        snapshot.gunzip_bounded(two_members[:-3], 100)


def test_an_output_folder_is_listed_within_bounds(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = first_of(bundle, "eval", "csv_to_tsv")[0]
    env = start(bundle, task, tmp_path, monkeypatch)
    run(env, f"mkdir out && touch out/f{{1..{snapshot.MAX_OUTPUT_ENTRIES + 5}}}.tsv")
    state = env.state()
    assert len(state["outputs"]) == snapshot.MAX_OUTPUT_ENTRIES
    assert state["outputs_omitted"] == 5
    run(env, "rm -r out && mkdir elsewhere && ln -s elsewhere out")
    assert env.state()["outputs"] == {}  # a symlinked out/ could point anywhere


def test_reset_refuses_a_used_folder(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "logs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="not a fresh one"):
        bundle.env_class().reset(bundle.env_task(first_of(bundle, "eval", "status_counts")[0]))
    with pytest.raises(ValueError, match="unknown shellcraft family"):
        bundle.env_class().reset(Task("x", "eval", 0, "p", {"family": "x", "inputs": []}))
    full = first_of(bundle, "eval", "status_counts")[0]  # the full data: no view, no seed read
    with pytest.raises(KeyError, match="inputs"):
        bundle.env_class().reset(full)


def test_every_family_sets_its_traps(bundle: Bundle) -> None:
    """The inputs hold what the prompts warn about, in the shipped eval split."""
    seen: dict[str, set[str]] = {f: set() for f in files.FAMILIES}
    for task in bundle.tasks("eval"):
        ws = files.build(task.data)
        paths = [f.path for f in ws.inputs]
        kinds = seen[ws.family]
        kinds |= {"gzip"} if any(f.gzipped for f in ws.inputs) else set()
        kinds |= {"space"} if any(" " in p for p in paths) else set()
        kinds |= {"hidden"} if any("/." in p for p in paths) else set()
        kinds |= {"crlf"} if any(b"\r\n" in f.content for f in ws.inputs) else set()
        kinds |= {"subfolder csv"} if any("/archive/" in p for p in paths) else set()
        kinds |= {"error log"} if "logs/error.log" in paths else set()
        kinds |= {"nested user"} if any(b'{"user"' in f.content for f in ws.inputs) else set()
    assert {"gzip", "error log"} <= seen["status_counts"]
    assert {"space", "hidden"} <= seen["find_files"]
    assert {"crlf", "subfolder csv", "space"} <= seen["csv_to_tsv"]
    assert {"gzip", "nested user"} <= seen["jsonl_totals"]
    assert answers.line_matches("x = DEPRECATED-api", {"mode": "word", "needle": "deprecated"})
    for miss in ("undeprecated", "deprecated_api", "deprecated2"):
        assert not answers.line_matches(miss, {"mode": "word", "needle": "deprecated"})


def test_baselines_idle_naive_solver_on_eval() -> None:
    rows = baseline_rows(BUNDLE, "eval")
    assert [r.family for r in rows] == [*files.FAMILIES, None]
    assert rows[-1].tasks == 100
    for row in rows:
        assert row.results["idle"][0] == 0.0
        assert row.results["solver"][0] == pytest.approx(1.0) and row.results["solver"][2] == 1
        assert 0.0 < row.results["naive"][0] < 0.5
