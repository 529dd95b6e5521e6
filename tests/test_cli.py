"""The ``corral`` command: subcommands, help, and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from corral.cli import build_parser

CORRAL = [sys.executable, "-m", "corral.cli"]


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for name in ("run", "model", "engine", "gateway"):
        assert name in help_text
    out = subprocess.run([*CORRAL, "gateway", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--admin-token-var" in out.stdout


def test_gateway_refuses_an_unset_token_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_TEST_UNSET"}
    out = subprocess.run(
        [
            *CORRAL,
            "gateway",
            "--engine-url",
            "http://127.0.0.1:9",
            "--model",
            str(tmp_path),
            "--admin-token-var",
            "CORRAL_TEST_UNSET",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode != 0
    assert "CORRAL_TEST_UNSET is not set" in out.stderr


def test_chat_template_kwargs_must_be_a_json_object() -> None:
    out = subprocess.run(
        [
            *CORRAL,
            "gateway",
            "--engine-url",
            "http://x",
            "--model",
            "m",
            "--chat-template-kwargs",
            "[1]",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "must be a JSON object" in out.stderr


def test_model_tiny_builds_a_loadable_model(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CORRAL, "model", "tiny", str(tmp_path / "m"), "--no-imprint", "--template", "qwen3"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (
        "<think>"
        in (tmp_path / "m" / "tokenizer_config.json").read_text()
        + (tmp_path / "m" / "tokenizer.json").read_text()
    )


def test_bundle_validate_accepts_gridsim_and_explains_a_broken_bundle(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    ok = subprocess.run(
        [*CORRAL, "bundle", "validate", str(root / "bundles" / "gridsim")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "bundle.toml").write_text('name = "broken"\n')
    bad = subprocess.run(
        [*CORRAL, "bundle", "validate", str(tmp_path)], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "problem(s) found" in bad.stderr and "bundle.toml" in bad.stderr


def test_serve_says_which_sandbox_isolates_and_refuses_a_bundle_that_needs_one() -> None:
    out = subprocess.run([*CORRAL, "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "NO isolation" in " ".join(out.stdout.split())
    for backend in ("local", "bwrap", "docker", "kubernetes", "e2b"):
        assert backend in out.stdout
    root = Path(__file__).resolve().parent.parent
    refused = subprocess.run(
        [*CORRAL, "serve", str(root / "bundles" / "shellcraft"), "--port", "1"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert "needs a sandbox" in refused.stderr and "--sandbox bwrap or docker" in refused.stderr
    image = subprocess.run([*CORRAL, "sandbox", "image", "build", "--help"], capture_output=True)
    assert image.returncode == 0 and b"debootstrap" in image.stdout


def test_run_refuses_a_policy_that_is_no_model_before_starting(tmp_path: Path) -> None:
    work = tmp_path / "work"
    cmd = [*CORRAL, "run", "--workdir", str(work), "--policy", str(tmp_path / "nothing")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"corral run: no model at {tmp_path / 'nothing'} (--policy)" in out.stderr
    assert not work.exists()  # refused before the tiny model or any server
