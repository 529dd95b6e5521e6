"""``corral model tiny``: the tiny offline chat model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from corral.engines.tiny_model import build_tiny_model

    out = build_tiny_model(
        Path(args.out),
        template=args.template,
        seed=args.seed,
        imprint=not args.no_imprint,
        size=args.size,
    )
    print(out)
    return 0


def add_model_command(sub: Any) -> None:
    model = sub.add_parser(
        "model", help="build models", description="Build models offline."
    ).add_subparsers(dest="model_command", required=True, metavar="KIND")
    tiny = model.add_parser(
        "tiny",
        help="build the tiny offline chat model (Hugging Face format)",
        description="A byte-level BPE tokenizer, a ChatML tool-calling template and small "
        "random Qwen2 weights, imprinted with the tool-call format. Offline, in seconds.",
    )
    tiny.add_argument("out", help="output folder")
    tiny.add_argument(
        "--template",
        choices=["qwen25", "qwen3"],
        default="qwen25",
        help="qwen3 drops earlier <think> blocks from history (to exercise drift)",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--no-imprint", action="store_true", help="random weights only")
    tiny.add_argument(
        "--size",
        choices=["tiny", "vllm"],
        default="tiny",
        help="vllm: hidden 128, 2 heads of dimension 64 (vLLM's CPU attention needs >= 32)",
    )
    tiny.set_defaults(func=cmd_model_tiny)
