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

import math
import time
from typing import Any

from corral.trainer.checkpoint import TrainerState
from corral.trainer.config import SftConfig, model_path
from corral.trainer.metrics import peak_memory_gb, reset_peak_memory
from corral.trainer.sampling import RowSampler
from corral.trainer.schedule import Checkpointing, Evaluation
from corral.trainer.step import scheduled_lr, set_lr
from corral.trainer.training_run import OnLine, Policy, RunLog, megatron_world, write_run_config


def run_sft(config: SftConfig, *, on_line: OnLine | None = None) -> list[dict[str, Any]]:
    """Run ``config`` (module docstring), resuming from the run folder's latest checkpoint, and
    return the metrics lines written (none on a rank other than 0). ValueError for data that
    cannot be trained on (a bad line, a conversation the template renders unstably, one over
    ``max_tokens``), naming it."""
    from transformers import AutoTokenizer

    from corral.trainer import parallel
    from corral.trainer.convert import save_hf_checkpoint
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
    with megatron_world(config.model, config.seed) as runtime:
        leader = runtime.rank == 0
        policy = Policy.load(runtime, path, config.model, config.optim)
        model, optimizer = policy.model, policy.optimizer
        sampler = RowSampler(train, seed=config.seed)  # any sequence: a seeded epoch order
        step = 0
        state = policy.resume(config.run_dir)
        if state is not None:
            sampler.restore(state.sampler)
            step = state.step
        if leader:
            write_run_config(config.run_dir, config)
        checkpointing = Checkpointing(config.checkpoint_every)
        opened = RunLog.open(
            config.run_dir,
            tensorboard=config.tensorboard,
            resume_step=step,
            on_line=on_line,
            leader=leader,
        )
        with opened as log:
            # Evaluations are collective: every rank must agree on which are still to do.
            done = parallel.broadcast_objects(log.evaluated_steps)
            evaluation = Evaluation(enabled=bool(evals), every=config.eval_every, done=set(done))

            def evaluate() -> None:
                result = sft_eval_loss(model, evals, settings)
                evaluation.mark(step)
                log.write({"step": step, "kind": "eval", "eval/loss": result["loss"],
                           "eval/accuracy": result["accuracy"]})  # fmt: skip

            # The start, or a resumed step whose evaluation a crash cut off after its checkpoint.
            if evaluation.due(step):
                evaluate()
            while step < total:
                batch = sampler.take(config.batch_size)
                reset_peak_memory(device)
                began = time.monotonic()
                set_lr(optimizer, scheduled_lr(config.optim, step, total))
                result = sft_update(model, optimizer, batch, settings)
                step += 1
                log.write({
                    "step": step,
                    "epoch": step / steps_per_epoch,
                    **result,
                    "lr": policy.lr,
                    "time/training": time.monotonic() - began,
                    "memory/peak_gb": peak_memory_gb(device),
                })  # fmt: skip
                if checkpointing.due(step, final=step == total):
                    state = TrainerState.capture(step, sampler.state(), 0, f"sft-{step}")
                    policy.save(config.run_dir, state, keep=config.keep_checkpoints)
                if evaluation.due(step):
                    evaluate()
            if evaluation.due(step, final=True):
                evaluate()
        save_hf_checkpoint(model, policy.spec, config.run_dir / "model", tokenizer_from=path)
    return log.lines
