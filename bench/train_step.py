"""A training step's time split and peak memory, and what overlapping generation with
training (off-policy by one) buys.

Run: ``python bench/train_step.py [--device cuda] [--size small] [--steps 4] [--tp 1 2]``.

Each variant is a real ``corral train`` run (a subprocess; ``torchrun`` for tensor parallel >1)
on gridsim with the local engine and gateway in the trainer's process: rollouts through the
gateway, the group filter, the Megatron-core update, the in-memory weight push. The policy is a
randomly initialised Qwen2-architecture model of the chosen size on the tiny model's tokenizer
(built here, offline): it cannot play gridsim (every rollout is one reply of ``max_tokens``
tokens, graded 0), but its steps cost what a real model's of that shape would.

Printed per variant: the mean over steps after the first (warm-up) of generation, training and
weight-sync seconds, the step time, tokens trained per second and the peak memory; then the
overlap's step-time ratio against the same settings without it (the baseline of this run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

# (hidden, layers, heads, kv heads, intermediate): "small" is Qwen2.5-0.5B's trunk.
SIZES = {
    "tiny": (64, 2, 4, 2, 256),
    "mini": (256, 4, 8, 2, 1024),
    "small": (896, 24, 14, 2, 4864),
}


def build_model(out: Path, size: str, *, seed: int = 0) -> Path:
    """A random Qwen2 model of ``size`` with the tiny model's tokenizer, saved at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from corral.engines.tiny_model import cached_tiny_model

    if (out / "config.json").exists():
        return out
    tiny = cached_tiny_model()
    hidden, layers, heads, kv, inter = SIZES[size]
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return out


def run_variant(
    name: str, model: Path, out: Path, args: argparse.Namespace, *, tp: int, overlap: bool
) -> dict[str, float]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f'model.path="{model}"',
        f'model.device="{args.device}"',
        f'model.dtype="{"bfloat16" if args.device == "cuda" else "float32"}"',
        f"model.tensor_parallel={tp}",
        f'env.bundle="{ROOT / "bundles" / "gridsim"}"',
        f"rollout.groups_per_step={args.groups}",
        f"rollout.rollouts_per_row={args.rollouts_per_row}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.concurrency={args.groups * args.rollouts_per_row}",
        f"rollout.overlap={'true' if overlap else 'false'}",
        "schedule.eval_every=0",
        "schedule.checkpoint_every=0",
        "tensorboard=false",
    ]
    corral = [sys.executable, "-m", "corral.cli", "train", "--run-dir", str(run_dir)]
    corral += ["--steps", str(args.steps)] + [f"--set={o}" for o in overrides]
    if tp > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}"]
        command = [*launcher, "-m", "corral.cli", *corral[3:]]
    else:
        command = corral
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x.get("kind") != "eval"][1:]  # the first step warms up
    if not steps:
        raise SystemExit(f"{name}: need at least 2 steps to measure")
    keys = ("time/generation", "time/training", "time/weight_sync", "time/step", "tokens")
    mean = {k: statistics.fmean(x[k] for x in steps) for k in keys}
    mean["memory/peak_gb"] = max(x["memory/peak_gb"] for x in steps)
    mean["tokens/s"] = mean["tokens"] / mean["time/training"]
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--rollouts-per-row", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--no-overlap", action="store_true", help="skip the overlap variant")
    parser.add_argument("--out", type=Path, default=ROOT / ".corral" / "bench-train")
    args = parser.parse_args()
    model = build_model(args.out / f"model-{args.size}", args.size)
    results: dict[str, dict[str, float]] = {}
    for tp in args.tp:
        results[f"tp{tp}"] = run_variant(f"tp{tp}", model, args.out, args, tp=tp, overlap=False)
    if not args.no_overlap:
        results["tp1-overlap"] = run_variant(
            "tp1-overlap", model, args.out, args, tp=1, overlap=True
        )

    table = Table(title=f"corral train step, {args.size} model on {args.device}")
    for col in ("variant", "generation s", "training s", "weight sync s", "step s",
                "tokens/s (train)", "peak GiB"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['time/generation']:.2f}",
            f"{r['time/training']:.2f}",
            f"{r['time/weight_sync']:.3f}",
            f"{r['time/step']:.2f}",
            f"{r['tokens/s']:.0f}",
            f"{r['memory/peak_gb']:.2f}",
        )
    console = Console()
    console.print(table)
    if "tp1-overlap" in results:
        ratio = results["tp1-overlap"]["time/step"] / results["tp1"]["time/step"]
        console.print(f"overlap: step time {ratio:.2f}x the sequential step's (baseline tp1)")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
