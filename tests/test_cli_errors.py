"""Every misuse of ``corral`` is one line on stderr (the problem and the fix) with the right
exit code, never a traceback: each case runs the real command in a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from corral.cli import build_parser
from corral.cli.errors import PACKAGE_EXTRAS
from corral.gateway.parsers.reasoning import reasoning_parser_names
from corral.gateway.parsers.tool_calls import tool_call_parser_names
from corral.rollouts.rows import EnvRef, Row, RowMetadata
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
CORRAL = [sys.executable, "-m", "corral.cli"]
# `corral` with some modules made unimportable (None in sys.modules: "import x" fails with
# ModuleNotFoundError naming x, as when it is not installed).
BLOCKED = (
    "import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',')]; "
    "from corral.cli import main; sys.exit(main(sys.argv[2:]))"
)
ADMIN_VAR = "CORRAL_TEST_CLI_ADMIN"


def run(
    *args: str, env: dict[str, str] | None = None, command: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [*(command or CORRAL), *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=300,
    )


def blocked(modules: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run(modules, *args, command=[sys.executable, "-c", BLOCKED])


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, *texts: str) -> str:
    """The command exited ``code`` with one line on stderr holding every one of ``texts``."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert len(lines) == 1, out.stderr
    for text in texts:
        assert text in lines[0], lines[0]
    return lines[0]


def write_rows(path: Path, env_url: str = "http://127.0.0.1:9") -> Path:
    """A valid rows file of one eval row (its env server is never reached in these tests)."""
    env = EnvRef(
        url=env_url,
        token_var=None,
        max_turns=1,
        tool_timeout=5,
        reset_timeout=5,
        model_timeout=5,
    )
    meta = RowMetadata(split="eval", index=0, task_id="t0", tools=[], env=env)
    row = Row(messages=[{"role": "user", "content": "hi"}], metadata=meta)
    path.write_text(row.model_dump_json() + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# the framework


def test_version_is_the_installed_distributions() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"corral {version('corral')}"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    names = {p.prog for p in _parsers(parser)}
    for command in ("train", "sft", "plot", "play", "doctor", "eval", "sandbox image build"):
        assert f"corral {command}" in names
    for sub in _parsers(parser):
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), sub.prog
                continue
            assert action.help and action.help.strip(), f"{sub.prog} {action.dest} has no help"
        text = sub.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, sub.prog
    serve = run("serve", "--help")
    assert serve.returncode == 0 and "(default: 8200)" in serve.stdout
    gateway = build_parser().parse_args(["gateway", "--engine-url", "u", "--model", "m"])
    assert gateway.max_sessions == 10_000  # from GatewaySettings, shown in the help
    usage = run("sft", "--help").stdout.split("\n\n")[0]
    assert "--data DATA" in usage and "[--data DATA]" not in usage  # required


def _patched(attribute: str, body: str) -> str:
    """A -c program: `corral` with ``corral.cli.bundle.<attribute>`` replaced by a function
    whose body is ``body``."""
    return (
        "import sys, corral.cli.bundle as c\n"
        f"def boom(args):\n    {body}\n"
        f"c.{attribute} = boom\n"
        "from corral.cli import main\nsys.exit(main(sys.argv[1:]))"
    )


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    program = [
        sys.executable,
        "-c",
        _patched("cmd_bundle_validate", "raise OSError('disk\\nfull')"),
    ]
    out = run("bundle", "validate", str(tmp_path), command=program)
    assert_one_line(
        out, 1, "corral bundle validate: OSError: disk full (run with --debug for the traceback)"
    )
    for args in (["--debug", "bundle", "validate"], ["bundle", "validate", "--debug"]):
        traced = run(*args, str(tmp_path), command=program)
        assert traced.returncode == 1 and "Traceback" in traced.stderr, traced.stderr
        assert traced.stderr.rstrip().endswith(
            "OSError: disk full (run with --debug for the traceback)"
        )
    quiet = [sys.executable, "-c", _patched("cmd_bundle_validate", "raise KeyboardInterrupt")]
    interrupted = run("bundle", "validate", str(tmp_path), command=quiet)
    assert interrupted.returncode == 130 and interrupted.stderr == ""


def test_a_usage_error_from_argparse_is_one_line() -> None:
    assert_one_line(
        run("eval"), 2, "corral eval: the following arguments are required: rows, --gateway."
    )


# ---------------------------------------------------------------------------------------------
# the misuses


def test_eval_against_a_closed_port_says_the_gateway_cannot_be_reached(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = run("eval", str(write_rows(tmp_path / "rows.jsonl")), "--gateway", url)
    assert_one_line(
        out,
        1,
        f"corral eval: cannot reach the gateway at {url} (connection refused).",
        "Is `corral gateway` running there",
    )


def test_eval_without_the_admin_token_says_the_gateway_refused_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.gateway_stack import scripted_gateway

    rows = str(write_rows(tmp_path / "rows.jsonl"))
    with scripted_gateway(tiny_model_dir) as gateway:
        missing = run("eval", rows, "--gateway", gateway.url)
        wrong = run(
            "eval", rows, "--gateway", gateway.url, "--admin-token-var", ADMIN_VAR,
            env={ADMIN_VAR: "not-the-token"},
        )  # fmt: skip
    assert_one_line(missing, 1, "refused", "(401)", "Pass --admin-token-var NAME")
    assert_one_line(wrong, 1, f"refused the admin token in ${ADMIN_VAR} (401)", "--admin-token-var")


def test_serve_without_a_bundle() -> None:
    assert_one_line(
        run("serve", "/no/such/folder"),
        2,
        "corral serve: no bundle at /no/such/folder (a folder with bundle.toml)",
    )


@pytest.mark.parametrize("command", ["engine", "gateway"])
def test_a_model_that_is_no_local_folder(command: str, tmp_path: Path) -> None:
    extra = ["--engine-url", "http://127.0.0.1:9"] if command == "gateway" else []
    fix = "--model takes a local Hugging Face folder (`corral model tiny OUT` builds one)"
    out = run(command, *extra, "--model", "/no/such")
    line = assert_one_line(out, 2, f"corral {command}: no model folder at /no/such: {fix}")
    assert "Repo id" not in line
    assert_one_line(run(command, *extra, "--model", str(tmp_path)), 2, "no config.json", fix)
    (tmp_path / "config.json").write_text("{}")
    assert_one_line(run(command, *extra, "--model", str(tmp_path)), 2, "no tokenizer", fix)


@pytest.mark.parametrize(
    ("flag", "names"),
    [
        ("--tool-call-parser", tool_call_parser_names()),
        ("--reasoning-parser", reasoning_parser_names()),
    ],
)
def test_an_unknown_parser_lists_the_known_ones(flag: str, names: list[str]) -> None:
    out = run("gateway", "--engine-url", "http://x", "--model", "m", flag, "nope")
    line = assert_one_line(out, 2, f"corral gateway: argument {flag}: invalid choice: 'nope'")
    assert all(repr(name) in line for name in names)


def test_play_without_a_rows_file() -> None:
    out = run("play", "/no/such.jsonl", "--gateway", "http://127.0.0.1:9", "--agent-cmd", "true")
    assert_one_line(out, 2, "corral play: no rows file at /no/such.jsonl", "corral rows")


def test_train_refuses_cuda_on_a_cpu_torch_and_bad_settings_before_starting(
    tmp_path: Path,
) -> None:
    import torch

    run_dir = ["--run-dir", str(tmp_path / "run")]
    if not torch.cuda.is_available():
        out = run("train", *run_dir, "--set", "model.device=cuda")
        assert_one_line(out, 2, "corral train: model.device=cuda but this torch has no CUDA")
    syntax = run("train", *run_dir, "--set", "rollout")
    assert_one_line(syntax, 2, "override 'rollout' is not section.key=value")
    unknown = run("train", *run_dir, "--set", "rollout.nope=1")
    assert_one_line(unknown, 2, "rollout.nope: Extra inputs are not permitted")
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_train_on_a_finished_run_says_how_to_go_on(tmp_path: Path) -> None:
    """The run folder as a finished one-step run leaves it (checkpoint.py's layout: the step
    in the checkpoint's state.json); nothing is started."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    state = {"step": 1, "sampler": {}, "next_group_index": 2, "weight_version": "1"}
    (checkpoint / "state.json").write_text(json.dumps(state))
    out = run("train", "--run-dir", str(tmp_path / "run"), "--steps", "1")
    assert_one_line(
        out,
        0,
        f"corral train: run {tmp_path / 'run'} already finished 1 steps; pass --steps M "
        "(more than 1) to continue or a new --run-dir",
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]


def test_a_missing_optional_package_names_the_extra_that_installs_it(tmp_path: Path) -> None:
    assert PACKAGE_EXTRAS["megatron"] == ("megatron-core", "train")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    plot = blocked("matplotlib", "plot", str(tmp_path))
    assert_one_line(
        plot,
        1,
        "corral plot: this command needs matplotlib, which is not installed.",
        "pip install 'corral[train]'",
    )
    train = blocked("megatron", "train", "--run-dir", str(tmp_path / "run"), "--steps", "1")
    assert_one_line(
        train,
        1,
        "corral train: this command needs megatron-core, which is not installed.",
        "pip install 'corral[train]'",
    )
    assert not (tmp_path / "run").exists()
    # A module corral does not know as optional is a bug: reported as unexpected.
    other = blocked("corral.envs.bundle", "bundle", "validate", str(tmp_path))
    assert_one_line(other, 1, "ModuleNotFoundError", "(run with --debug for the traceback)")
