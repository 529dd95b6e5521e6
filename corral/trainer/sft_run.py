"""``corral sft``: the supervised fine-tuning run around :func:`corral.trainer.sft.sft_update`.

The conversations of ``data`` are tokenized once (as the gateway renders them), then each step
trains on the next ``batch_size`` of them in a seeded order, reshuffled every epoch, until
``epochs`` passes are done. Per step a metrics line (``loss``, ``accuracy``, ``grad_norm``,
``tokens``, ``trained_tokens``, ``lr``, ``time/training``, ``memory/peak_gb``; ``eval/loss``
and ``eval/accuracy`` on ``eval_data`` every ``eval_every`` steps and after the last) goes to
``<run_dir>/metrics.jsonl`` and TensorBoard; checkpoints resume exactly as the RL run's do
(:mod:`corral.trainer.checkpoint`); the final weights are written as a Hugging Face folder,
``<run_dir>/model``, with the tokenizer of the model trained.

One process on CPU or one GPU, or a world started by ``torchrun`` (one process per GPU):
``model.tensor_parallel`` ranks share each replica's layers, the rest of the world is data
parallel (each replica trains its share of a step's micro-batches; gradients and metrics are
the full step's). Every rank reads the data and takes the same batches; rank 0 alone writes the
metrics and ``config.json`` and calls ``on_line``; every rank writes its checkpoint shard and
takes part in gathering the final folder.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from corral.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from corral.trainer.config import SftConfig
from corral.trainer.metrics import MetricsWriter, peak_memory_gb, reset_peak_memory
from corral.trainer.rollouts import RowSampler
from corral.trainer.step import adamw, scheduled_lr, set_lr


def run_sft(
    config: SftConfig,
    *,
    on_line: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``config`` (module docstring), resuming from the run folder's latest checkpoint, and
    return the metrics lines written (none on a rank other than 0). ValueError for data that
    cannot be trained on (a bad line, a conversation the template renders unstably, one over
    ``max_tokens``), naming it."""
    from transformers import AutoTokenizer

    from corral.trainer import megatron_cpu, parallel
    from corral.trainer.convert import load_hf_checkpoint, save_hf_checkpoint
    from corral.trainer.services import model_path
    from corral.trainer.sft import (
        SftSettings,
        read_chat_examples,
        sft_eval_loss,
        sft_update,
        tokenize_chats,
    )

    path = model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(str(path))

    def load(data: Any) -> list[Any]:
        examples = read_chat_examples(data)
        return tokenize_chats(path, examples, max_tokens=config.max_tokens)

    train = load(config.data)
    if not train:
        raise ValueError(f"{config.data} holds no conversations")
    evals = load(config.eval_data) if config.eval_data else []
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    total = math.ceil(config.epochs * steps_per_epoch)
    settings = SftSettings(
        max_tokens_per_micro_batch=config.optim.max_tokens_per_micro_batch,
        max_grad_norm=config.optim.max_grad_norm,
        pad_id=int(tokenizer.pad_token_id or 0),
    )
    device = config.model.device
    runtime = megatron_cpu.setup(
        device,
        tensor_parallel_size=config.model.tensor_parallel,
        seed=config.seed,
        collective_timeout_s=config.model.collective_timeout_s,
    )
    leader = runtime.rank == 0
    lines: list[dict[str, Any]] = []
    try:
        dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
        model, spec = load_hf_checkpoint(path, dtype=dtype)
        model = model.to(runtime.device)
        optimizer = adamw(model.parameters(), config.optim)
        sampler = RowSampler(train, seed=config.seed)  # any sequence: a seeded epoch order
        step = 0
        resumed = latest_checkpoint(config.run_dir)
        if resumed is not None:
            state = load_checkpoint(resumed, model, optimizer, rank=runtime.rank)
            state.restore_rng()
            sampler.restore(state.sampler)
            step = state.step
        if leader:
            config.run_dir.mkdir(parents=True, exist_ok=True)
            (config.run_dir / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
        opened = (
            MetricsWriter(config.run_dir, tensorboard=config.tensorboard, resume_step=step)
            if leader
            else contextlib.nullcontext()
        )
        with opened as writer:

            def emit(line: dict[str, Any]) -> None:
                if writer is None:
                    return
                writer.write(line)
                lines.append(line)
                if on_line is not None:
                    on_line(line)

            def evaluate() -> None:
                result = sft_eval_loss(model, evals, settings)
                evaluated.add(step)
                emit({"step": step, "kind": "eval", "eval/loss": result["loss"],
                      "eval/accuracy": result["accuracy"]})  # fmt: skip

            # Evaluations are collective: every rank must agree on which are still to do.
            shared = parallel.broadcast_objects(writer.evaluated_steps if writer else None)
            evaluated = set(shared or ())
            # The start, or a resumed step whose evaluation a crash cut off after its checkpoint.
            due = step == 0 or bool(config.eval_every and step % config.eval_every == 0)
            if evals and due and step not in evaluated:
                evaluate()
            while step < total:
                batch = sampler.take(config.batch_size)
                reset_peak_memory(device)
                began = time.monotonic()
                set_lr(optimizer, scheduled_lr(config.optim, step, total))
                result = sft_update(model, optimizer, batch, settings)
                step += 1
                emit({
                    "step": step,
                    "epoch": step / steps_per_epoch,
                    **result,
                    "lr": optimizer.param_groups[0]["lr"],
                    "time/training": time.monotonic() - began,
                    "memory/peak_gb": peak_memory_gb(device),
                })  # fmt: skip
                every = config.checkpoint_every
                if every and (step % every == 0 or step == total):
                    state = TrainerState.capture(step, sampler.state(), 0, f"sft-{step}")
                    save_checkpoint(
                        config.run_dir,
                        state,
                        model,
                        optimizer,
                        rank=runtime.rank,
                        world_size=runtime.world_size,
                        keep=config.keep_checkpoints,
                    )
                if evals and config.eval_every and step % config.eval_every == 0:
                    evaluate()
            if evals and step not in evaluated:
                evaluate()
        save_hf_checkpoint(model, spec, config.run_dir / "model", tokenizer_from=path)
    finally:
        megatron_cpu.teardown()
    return lines
