"""What enters a sandbox: only the env side of a bundle, owner-only, and the env's view of a task.

The static checks (the env side may not import grading code, nor a module outside its declared
``[env] modules``) run on small bundles written here. The sandboxed tests use the real
:class:`~corral.envs.hosting.SandboxHost` with the ``bwrap`` provider (and ``docker`` where the
daemon is reachable the way tests/conftest.py finds it): a probe env reports what it received
and what it can see, and shellcraft's answer-recomputing shell command, which scored 1.0 while
the whole bundle and the seed were in the sandbox, now scores 0 while the reference commands
still score 1.
"""

from __future__ import annotations

import json
import shutil
import stat
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from corral.envs.bundle import (
    BundleError,
    EntryPoint,
    TaskDataError,
    load_bundle,
    validate_bundle,
)
from corral.envs.episode import Task
from corral.envs.hosting import (
    RUNNER_MODULES,
    EnvFailure,
    InProcessHost,
    SandboxHost,
    build_payload,
)
from corral.sandboxes.base import SandboxProvider, SandboxSpec
from corral.sandboxes.bwrap import BwrapProvider
from tests.bundle_files import problem_with, write_tree
from tests.conftest import ROOT, SANDBOX_IMAGE

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
GRIDSIM = ROOT / "bundles" / "gridsim"
RUNNER_FILES = {
    "corral/__init__.py",
    "corral/envs/__init__.py",
    *(f"corral/envs/{m}" for m in RUNNER_MODULES),
}

TOML = """\
name = "probe"
version = "1"
system_prompt = "probe"
max_turns = 3

[splits]
train = "tasks/train.jsonl"

[sandbox]
needs = "process"

[env]
module = "env.py"
class = "ProbeEnv"
{env_extra}

[verifier]
module = "verifier.py"
function = "grade"
{verifier_extra}

[reward]
score = "seen"

[[tools]]
name = "look"
description = "what the env received and sees"
parameters = {{ type = "object", properties = {{}} }}
{tail}
"""

ENV = """\
import json, os
from corral.envs.episode import ToolOutcome
from . import helper


class ProbeEnv:
    def reset(self, task):
        self.task = task.to_json()
        return task.prompt

    def call_tool(self, name, arguments):
        here = os.path.dirname(os.path.abspath(__file__))
        shipped = sorted(
            os.path.relpath(os.path.join(d, f), here) for d, _, fs in os.walk(here) for f in fs
        )
        jail = os.environ.get("CORRAL_MODEL_JAIL")
        return ToolOutcome(json.dumps({"task": self.task, "shipped": shipped, "jail": jail,
                                       "helper": helper.VALUE}))

    def state(self):
        return {"task": self.task}
"""

VERIFIER = """\
from .secrets import expected


def grade(task, state):
    return {"seen": float(state["task"]["data"].get("word") == expected(task.data))}
"""

SECRETS = "def expected(data):\n    return data['secret'][::-1]\n"
VIEW = """\
from .secrets import expected


def for_env(task):
    return {"word": "hidden-" + str(len(expected(task.data)))}
"""


def write_probe(root: Path, files: dict[str, str] | None = None, **toml: str) -> Path:
    """A probe bundle in ``root``: ``toml`` fills the manifest's blanks, ``files`` override or
    add files ("" leaves one out)."""
    fields = {"env_extra": "", "verifier_extra": "", "tail": "", **toml}
    contents = {
        "bundle.toml": TOML.format(**fields),
        "env.py": ENV,
        "helper.py": "VALUE = 7\n",
        "verifier.py": VERIFIER,
        "secrets.py": SECRETS,
        "view.py": VIEW,
        "generate.py": "SEEDS = [1, 2, 3]\n",
        "tasks/train.jsonl": json.dumps(
            {"id": "t0", "prompt": "go", "data": {"secret": "s3cr3t-seed", "word": "leak"}}
        )
        + "\n",
        **(files or {}),
    }
    return write_tree(root, contents)


def refused(root: Path, *needles: str) -> str:
    """The one problem that holds every needle; load_bundle refuses with it too."""
    return problem_with(root, *needles, only=True)


def modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


# --- the payload -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bundle_dir", "env_files"),
    [
        (SHELLCRAFT, {"env.py", "shell.py", "snapshot.py", "workspace.py"}),
        (GRIDSIM, {"env.py", "market.py"}),
    ],
)
def test_the_payload_holds_the_env_side_only_owner_only(
    bundle_dir: Path, env_files: set[str], tmp_path: Path
) -> None:
    bundle = load_bundle(bundle_dir)
    assert set(bundle.payload_files()) == env_files
    root = build_payload(bundle, tmp_path)
    found = modes(root)
    files = {rel for rel in found if (root / rel).is_file()}
    assert files == RUNNER_FILES | {f"bundle/{f}" for f in env_files}
    assert all(found[rel] == 0o600 for rel in files), found
    assert all(mode == 0o700 for rel, mode in found.items() if rel not in files), found
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for rel in env_files:
        assert (root / "bundle" / rel).read_bytes() == (bundle_dir / rel).read_bytes()


def test_an_undeclared_env_side_is_what_the_env_imports(tmp_path: Path) -> None:
    root = write_probe(
        tmp_path / "p",
        {
            "env.py": ENV.replace("import helper", "import helper\nfrom .lib import deep"),
            "lib/__init__.py": "\n",
            "lib/deep.py": "from ..helper import VALUE\nfrom . import leaf\n",
            "lib/leaf.py": "\n",
        },
    )
    bundle = load_bundle(root)
    assert bundle.payload_files() == [
        "env.py",
        "helper.py",
        "lib/__init__.py",
        "lib/deep.py",
        "lib/leaf.py",
    ]
    payload = build_payload(bundle, tmp_path / "out")
    shipped = {p.relative_to(payload / "bundle").as_posix() for p in payload.rglob("bundle/**/*")}
    assert "verifier.py" not in shipped and "tasks/train.jsonl" not in shipped
    assert "bundle.toml" not in shipped and "generate.py" not in shipped


def test_a_declared_folder_ships_whole(tmp_path: Path) -> None:
    root = write_probe(
        tmp_path / "p",
        {"data/table.txt": "rows\n", "data/sub/more.txt": "x\n"},
        env_extra='modules = ["env.py", "helper.py", "data", "bundle.toml"]',
    )
    assert load_bundle(root).payload_files() == [
        "bundle.toml",
        "data/sub/more.txt",
        "data/table.txt",
        "env.py",
        "helper.py",
    ]


# --- static validation -------------------------------------------------------------------------


def test_an_env_that_imports_its_verifier_is_refused(tmp_path: Path) -> None:
    root = write_probe(
        tmp_path / "p",
        {"helper.py": "VALUE = 7\n", "env.py": ENV + "from .verifier import grade\n"},
    )
    problem = refused(root, "env.py -> verifier.py")
    assert "grading code" in problem and "the [verifier] module" in problem


def test_a_grading_module_reached_through_a_helper_is_refused_naming_the_chain(
    tmp_path: Path,
) -> None:
    root = write_probe(
        tmp_path / "p",
        {"helper.py": "import os\n\ndef f():\n    from .secrets import expected\n\nVALUE = 7\n"},
        verifier_extra='modules = ["secrets.py"]',
    )
    problem = refused(root, "env.py -> helper.py -> secrets.py")
    assert "a [verifier] modules entry" in problem


def test_an_absolute_import_of_a_bundle_module_counts(tmp_path: Path) -> None:
    root = write_probe(tmp_path / "p", {"helper.py": "import verifier\nVALUE = 7\n"})
    refused(root, "env.py -> helper.py -> verifier.py")


def test_solver_baselines_and_a_server_side_task_data_are_grading_code(tmp_path: Path) -> None:
    tail = (
        '[solver]\nmodule = "solve.py"\nfunction = "reference"\n'
        '[[baselines]]\nname = "lazy"\nmodule = "lazy.py"\nfunction = "calls"\n'
    )
    for grading, role in (
        ("solve.py", "the [solver] module"),
        ("lazy.py", "the [[baselines]] 'lazy' module"),
        ("view.py", "the [env] task_data module (server side)"),
    ):
        root = write_probe(
            tmp_path / grading,
            {
                "helper.py": f"from . import {grading[:-3]}\nVALUE = 7\n",
                "solve.py": "\n",
                "lazy.py": "\n",
            },
            env_extra='task_data = "view.py:for_env"',
            tail=tail,
        )
        assert role in refused(root, f"env.py -> helper.py -> {grading}")


def test_a_module_outside_the_declared_modules_is_refused(tmp_path: Path) -> None:
    root = write_probe(tmp_path / "p", env_extra='modules = ["env.py"]')
    problem = refused(root, "env.py -> helper.py")
    assert "outside [env] modules" in problem and "add helper.py" in problem


def test_declared_modules_must_exist_hold_the_env_and_no_grading_or_task_file(
    tmp_path: Path,
) -> None:
    root = write_probe(tmp_path / "a", env_extra='modules = ["env.py", "helper.py", "nope.py"]')
    assert "env.modules[2]" in refused(root, "nope.py: missing")
    root = write_probe(tmp_path / "b", env_extra='modules = ["helper.py"]')
    refused(root, "does not include the env module 'env.py'")
    root = write_probe(
        tmp_path / "c", env_extra='modules = ["env.py", "helper.py", "verifier.py", "tasks"]'
    )
    problems = validate_bundle(root)
    assert any("verifier.py is the [verifier] module" in p for p in problems), problems
    assert any("tasks/train.jsonl is a task file" in p for p in problems), problems
    root = write_probe(tmp_path / "d", verifier_extra='modules = ["gone.py"]')
    refused(root, "gone.py: missing", "verifier.modules[0]")


def test_task_data_must_name_a_function_of_one_argument(tmp_path: Path) -> None:
    root = write_probe(tmp_path / "a", env_extra='task_data = "view.py:nothing"')
    refused(root, "view.py: defines no callable 'nothing'")
    root = write_probe(tmp_path / "b", env_extra='task_data = "absent.py:f"')
    refused(root, "absent.py: missing")
    root = write_probe(
        tmp_path / "c",
        {"view.py": "def f(a, b):\n    return {}\n"},
        env_extra='task_data = "view.py:f"',
    )
    refused(root, "view.py: f must take (task)")


def test_a_solver_that_does_not_exist_yet_does_not_stop_loading(tmp_path: Path) -> None:
    tail = '[solver]\nmodule = "solve.py"\nfunction = "reference"\n'
    root = write_probe(tmp_path / "p", {"solve.py": "X = 1\n"}, tail=tail)
    bundle = load_bundle(root)  # the function is looked up lazily
    assert validate_bundle(root) == []
    assert bundle.manifest.solver is not None
    with pytest.raises(BundleError, match=r"solve\.py: defines no callable 'reference'"):
        bundle.entry_point(bundle.manifest.solver)
    (root / "solve.py").write_text("def reference(task):\n    return [task.id]\n")
    solver = load_bundle(root).entry_point(EntryPoint(module="solve.py", function="reference"))
    assert solver(bundle.task("train", 0)) == ["t0"]
    (root / "solve.py").unlink()
    assert any("solve.py: missing" in p for p in validate_bundle(root))
    load_bundle(root)  # still loads: the play validator reports the missing solver


# --- the env's view of a task ------------------------------------------------------------------


def test_env_task_replaces_the_data_with_the_views(tmp_path: Path) -> None:
    root = write_probe(tmp_path / "p", env_extra='task_data = "view.py:for_env"')
    bundle = load_bundle(root)
    task = bundle.task("train", 0)
    seen = bundle.env_task(task)
    assert seen.data == {"word": "hidden-11"}
    assert (seen.id, seen.prompt, seen.split, seen.index) == (task.id, task.prompt, "train", 0)
    assert task.data["secret"] == "s3cr3t-seed"  # the bundle's own task is untouched
    plain = load_bundle(write_probe(tmp_path / "q"))
    assert plain.env_task(plain.task("train", 0)) is plain.task("train", 0)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("raise KeyError('secret')", "raised KeyError"),
        ("return [1]", "returned list, not a JSON object"),
        ("return {'x': float('nan')}", "not JSON"),
        ("return {'x': object()}", "not JSON"),
    ],
)
def test_a_bad_view_is_a_clear_error(tmp_path: Path, body: str, why: str) -> None:
    view = f"def for_env(task):\n    {body}\n"
    root = write_probe(tmp_path / "p", {"view.py": view}, env_extra='task_data = "view.py:for_env"')
    bundle = load_bundle(root)
    with pytest.raises(TaskDataError, match=why) as err:
        bundle.env_task(bundle.task("train", 0))
    assert "view.py:for_env" in str(err.value)


async def test_the_in_process_host_resets_with_the_view_too(tmp_path: Path) -> None:
    root = write_probe(
        tmp_path / "p",
        {"bundle.toml": TOML.format(env_extra='task_data = "view.py:for_env"', verifier_extra="",
                                    tail="").replace('"process"', '"none"')},
    )  # fmt: skip
    bundle = load_bundle(root)
    env = await InProcessHost(bundle).start()
    await env.reset(bundle.task("train", 0))
    look = (await env.call_tool("look", {})).content
    assert json.loads(look)["task"]["data"] == {"word": "hidden-11"} and "s3cr3t" not in look


# --- in a real sandbox -------------------------------------------------------------------------


def _bwrap(tmp_path: Path) -> SandboxProvider:
    return BwrapProvider(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")


@pytest.fixture(params=["bwrap", "docker"])
def provider(request: pytest.FixtureRequest, tmp_path: Path) -> SandboxProvider:
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        return DockerProvider(f"test-{uuid.uuid4().hex[:8]}", image=SANDBOX_IMAGE)
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return _bwrap(tmp_path)


async def _episode(
    bundle_root: Path,
    provider: SandboxProvider,
    task: Task,
    calls: list[tuple[str, dict[str, Any]]],
) -> tuple[list[str], dict[str, Any], float]:
    """Play ``calls`` on ``task`` in a fresh sandbox; the tool answers, the state, the reward."""
    bundle = load_bundle(bundle_root)
    host = SandboxHost(bundle, provider, SandboxSpec(workdir="/work"))
    await host.open()
    try:
        env = await host.start()
        try:
            await env.reset(task)
            answers = [(await env.call_tool(name, args)).content for name, args in calls]
            state = await env.state()
        finally:
            await env.close()
    finally:
        await host.aclose()
    assert await provider.list_owned() == []
    return answers, state, bundle.reward(bundle.grade(task, state))


async def test_the_sandboxed_env_gets_the_view_and_only_its_side(
    provider: SandboxProvider, tmp_path: Path
) -> None:
    root = write_probe(tmp_path / "p", env_extra='task_data = "view.py:for_env"')
    task = load_bundle(root).task("train", 0)
    (look,), state, reward = await _episode(root, provider, task, [("look", {})])
    seen = json.loads(look)
    assert seen["task"]["data"] == {"word": "hidden-11"}
    assert "s3cr3t" not in look and "leak" not in look
    assert seen["shipped"] == ["env.py", "helper.py"] and seen["helper"] == 7
    assert json.loads(seen["jail"]) == list(provider.model_jail(SandboxSpec(workdir="/work")))
    assert state["task"]["id"] == "t0" and reward == 0.0  # graded outside, on the full task


async def test_a_failing_view_fails_the_reset_and_leaves_nothing(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    view = "def for_env(task):\n    raise ValueError('no view for ' + task.id)\n"
    root = write_probe(tmp_path / "p", {"view.py": view}, env_extra='task_data = "view.py:for_env"')
    bundle = load_bundle(root)
    provider = _bwrap(tmp_path)
    host = SandboxHost(bundle, provider, SandboxSpec(workdir="/work"))
    await host.open()
    env = await host.start()
    try:
        with pytest.raises(EnvFailure, match="no view for t0"):
            await env.reset(bundle.task("train", 0))
    finally:
        await env.close()
        await host.aclose()
    assert await provider.list_owned() == []


def cheat_command(prompt: str) -> str:
    """One bash command that does none of the task: it loads the bundle's generator and answer
    code from the sandbox's payload, finds the task by its prompt and its files, and writes
    the expected answer (it worked while the whole bundle was shipped)."""
    script = textwrap.dedent(
        f"""
        import pathlib, sys
        from corral.envs.importing import bundle_package, import_file
        root = pathlib.Path("/opt/corral/bundle")
        pkg = bundle_package(root, "cheat")
        gen = import_file(root, pkg, "generate.py")
        answers = import_file(root, pkg, "answers.py")
        files = import_file(root, pkg, "files.py")
        for split, count in gen.SPLITS.items():
            for i in range(count):
                task = gen.make_task(split, i)
                if task["prompt"] != {prompt!r}:
                    continue
                ws = files.build(task["data"])
                if all(f.gzipped or pathlib.Path(f.path).read_bytes() == f.content
                       for f in ws.inputs):
                    for path, text in answers.expected_outputs(task["data"]).items():
                        out = pathlib.Path(path)
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_text(text)
                    print("answered", task["id"])
                    sys.exit(0)
        sys.exit(3)
        """
    )
    return f"PYTHONPATH=/opt/corral python3 - <<'CHEAT'\n{script}CHEAT\n"


async def test_shellcraft_cannot_be_answered_from_the_payload_but_is_still_solvable(
    provider: SandboxProvider,
) -> None:
    """The reference commands still score 1.0 and an idle episode 0; the cheat finds no
    answer code (and no seed) in the sandbox, and scores 0."""
    from bundles.shellcraft.solver import solve

    bundle = load_bundle(SHELLCRAFT)
    task = next(t for t in bundle.tasks("eval") if t.data["family"] == "status_counts")
    calls = [("bash", {"command": c}) for c in solve(task.data)] + [("submit", {})]
    answers, _, reward = await _episode(SHELLCRAFT, provider, task, calls)
    assert all(a.startswith("exit code: 0") for a in answers[:-1]), answers
    assert reward == pytest.approx(1.0)
    _, _, idle = await _episode(SHELLCRAFT, provider, task, [("submit", {})])
    assert idle == 0.0
    calls = [("bash", {"command": cheat_command(task.prompt)}), ("submit", {})]
    (cheat, _), state, reward = await _episode(SHELLCRAFT, provider, task, calls)
    # No generator, no answer code, no seed where the command runs (and, where the backend
    # jails model commands, not even the env's own code).
    assert not cheat.startswith("exit code: 0") and "answered" not in cheat, cheat
    assert reward == 0.0 and state["outputs"] == {
        "status_counts.csv": {"text": None, "problem": "missing"}
    }


class _Unjailed(BwrapProvider):
    """bwrap with no model jail: model commands see what the runner sees (``/opt/corral``),
    so this checks the payload alone keeps the answer out, whatever the jail does."""

    def model_jail(self, spec: SandboxSpec) -> tuple[str, ...]:
        return ()


async def test_even_unjailed_a_command_finds_no_answer_code_and_no_seed(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    provider = _Unjailed(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")
    bundle = load_bundle(SHELLCRAFT)
    task = next(t for t in bundle.tasks("eval") if t.data["family"] == "jsonl_totals")
    seed = str(task.data["seed"])
    calls = [
        ("bash", {"command": cheat_command(task.prompt)}),
        ("bash", {"command": "cd /opt/corral && find . -type f | sort"}),
        ("bash", {"command": f"grep -rl -- {seed} /opt/corral /work; echo grep=$?"}),
        ("submit", {}),
    ]
    (cheat, listing, grep, _), _, reward = await _episode(SHELLCRAFT, provider, task, calls)
    assert "No such file or directory: '/opt/corral/bundle/generate.py'" in cheat, cheat
    shipped = listing.split("stdout:\n", 1)[1].split()
    assert shipped == sorted(
        [f"./{rel}" for rel in RUNNER_FILES]
        + [f"./bundle/{f}" for f in ("env.py", "shell.py", "snapshot.py", "workspace.py")]
    )
    assert grep.endswith("grep=1"), grep  # the seed is nowhere the command can read
    assert reward == 0.0


def test_an_env_module_that_is_also_the_verifier_is_refused(tmp_path: Path) -> None:
    env = ENV + "\n\ndef grade(task, state):\n    return {'seen': 0.0}\n"
    root = write_probe(tmp_path / "p", {"env.py": env}, verifier_extra="")
    (root / "bundle.toml").write_text(
        (root / "bundle.toml").read_text().replace('module = "verifier.py"', 'module = "env.py"')
    )
    refused(root, "env.module: env.py is also the [verifier] module")
    assert len(validate_bundle(root)) == 1, validate_bundle(root)
