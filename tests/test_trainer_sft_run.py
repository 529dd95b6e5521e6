"""``corral sft`` end to end on CPU: weather-tool conversations in OpenAI's fine-tuning shape,
the tiny model trained on them, eval loss, checkpoints, an exact resume, and the result as a
Hugging Face folder that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corral.cli import main
from corral.trainer.metrics import read_metrics
from tests.weather import weather_conversation, write_weather_chats

pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")


def _args(data: Path, run: Path, model: Path, *extra: str) -> list[str]:
    sets = ["batch_size=4", "optim.lr=3e-3", "checkpoint_every=2", "eval_every=2",
            "tensorboard=false", *extra]  # fmt: skip
    args = ["sft", "--data", str(data), "--eval-data", str(data), "--run-dir", str(run)]
    args += ["--model", str(model)]
    return args + [a for s in sets for a in ("--set", s)]


def test_sft_trains_resumes_and_writes_a_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data = write_weather_chats(tmp_path / "chats.jsonl")
    run = tmp_path / "run"

    assert main(_args(data, run, tiny_model_dir, "epochs=2")) == 0  # 8 conversations: 4 steps
    first = read_metrics(run)
    steps = [m for m in first if m.get("kind") != "eval"]
    evals = [m for m in first if m.get("kind") == "eval"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert evals[-1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]
    assert all(m["trained_tokens"] > 0 and m["grad_norm"] > 0 for m in steps)

    # Resume: two more epochs continue from step 4's checkpoint.
    assert main(_args(data, run, tiny_model_dir, "epochs=3")) == 0
    assert [m["step"] for m in read_metrics(run) if m.get("kind") != "eval"] == [1, 2, 3, 4, 5, 6]

    trained = AutoModelForCausalLM.from_pretrained(run / "model")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert not torch.allclose(trained(ids).logits, original(ids).logits)
    assert (run / "model" / "tokenizer.json").is_file()


def test_sft_follows_the_learning_rate_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    from corral.trainer.config import OptimSettings
    from corral.trainer.step import scheduled_lr

    data = write_weather_chats(tmp_path / "chats.jsonl")
    sets = ['optim.lr_decay_style="cosine"', "optim.lr_warmup_steps=1", "optim.min_lr=3e-4"]
    assert main(_args(data, tmp_path / "run", tiny_model_dir, "epochs=2", *sets)) == 0
    rates = [m["lr"] for m in read_metrics(tmp_path / "run") if m.get("kind") != "eval"]
    optim = OptimSettings(lr=3e-3, lr_decay_style="cosine", lr_warmup_steps=1, min_lr=3e-4)
    assert rates == pytest.approx([scheduled_lr(optim, step, 4) for step in range(4)])
    assert rates[0] == rates[1] == pytest.approx(3e-3) and rates[3] < rates[2] < rates[1]


def test_sft_refuses_bad_data_with_the_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(weather_conversation("Oslo", 0)) + "\n{not json\n")
    rc = main(_args(data, tmp_path / "run", tiny_model_dir))
    assert rc == 1
    assert not (tmp_path / "run" / "model").exists()
    assert main(["sft", "--set", "batch_size=0", "--data", str(data)]) == 2
