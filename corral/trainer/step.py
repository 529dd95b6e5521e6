"""One policy update on a step's groups.

:func:`policy_update` turns kept groups into GRPO advantages (over rollouts, by group index),
packs their samples into micro-batches up to a token budget, and accumulates the loss of every
micro-batch before one optimizer step: the losses are normalised per step (see
:mod:`corral.trainer.losses`), so the summed micro-batch gradients are exactly the step's.
The weights reach the engines through :mod:`corral.trainer.weights`.

Parallel (``corral.trainer.megatron_runtime.setup`` with a world of several ranks): every rank
calls :func:`policy_update` with the same groups (share them with
:func:`corral.trainer.parallel.broadcast_objects`). Every rank packs the whole step's
micro-batches the same way; each data-parallel replica trains on its share of them, balanced
by tokens (:func:`corral.trainer.parallel.data_parallel_share`), the tensor-parallel ranks of a
replica on the same ones. The gradients are then summed over the data-parallel group, which is
the whole step's gradient because the loss is normalised over the whole step (see
:mod:`corral.trainer.parallel`), clipped by the global norm, and every rank steps its optimizer
on the same gradients of its shard. The metrics are summed over the replicas, so they are the
step's on every rank.

The training loop (:mod:`corral.trainer.loop`) builds on it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from corral.trainer import parallel
from corral.trainer.batches import batch_token_stats, build_train_samples, pack_micro_batches
from corral.trainer.config import OptimSettings
from corral.trainer.groups import Group
from corral.trainer.losses import LossConfig, batch_policy_loss, grpo_advantages
from corral.trainer.megatron_runtime import on_device


def adamw(params: Any, optim: OptimSettings) -> torch.optim.AdamW:
    """The AdamW of ``optim`` (lr, betas, weight decay) over ``params``."""
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay
    )


def scheduled_lr(optim: OptimSettings, step: int, total: int) -> float:
    """The learning rate of update number ``step`` (0 for the first) of ``total`` under
    ``optim``'s schedule (see :class:`~corral.trainer.config.OptimSettings`). Warmup reaches
    ``lr`` at its last step; the decay then runs over the remaining steps, starting at ``lr``
    and ending one step short of ``min_lr``. ValueError for a negative step or total."""
    if step < 0 or total < 0:
        raise ValueError(f"step ({step}) and total ({total}) must not be negative")
    if step < optim.lr_warmup_steps:
        return optim.lr * (step + 1) / optim.lr_warmup_steps
    if optim.lr_decay_style == "constant":
        return optim.lr
    progress = min((step - optim.lr_warmup_steps) / max(total - optim.lr_warmup_steps, 1), 1.0)
    if optim.lr_decay_style == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` at ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass(frozen=True)
class UpdateSettings:
    """How a step trains on its groups."""

    loss: LossConfig = field(default_factory=LossConfig)
    normalize_std: bool = True
    max_tokens_per_micro_batch: int = 8192
    temperature: float = 1.0  # the sampling temperature: logprobs must be of the same policy
    max_grad_norm: float | None = 1.0
    pad_id: int = 0


@on_device
def policy_update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Group],
    settings: UpdateSettings | None = None,
    *,
    reference: Any | None = None,
) -> dict[str, float]:
    """Train ``model`` one optimizer step on ``groups`` (kept groups: none flagged). With a
    frozen ``reference`` model (same architecture and layout), its logprobs of every response
    token are computed first (no gradient) for the loss's KL term and the ``kl`` metric. Returns the
    step's metrics: the loss terms summed over micro-batches (``loss``, ``pg_loss``,
    ``clip_fraction``, ``tis_weight``, ``entropy``, ``kl`` when there are reference logprobs),
    ``grad_norm`` (before clipping), and counts (``rollouts``, ``samples``, ``micro_batches``,
    ``tokens``, ``trained_tokens``). ValueError for samples that do not fit together (see
    :func:`corral.trainer.batches.build_train_samples`).

    In a world of several ranks every rank calls this with the same groups (module docstring);
    the metrics, ``grad_norm`` included, are the whole step's and the same on every rank
    (``micro_batches`` counts the step's, not this replica's share)."""
    from corral.trainer.model import forward_logits

    if parallel.pipeline_parallel_size() > 1:
        raise ValueError("policy_update does not run pipeline-parallel models (no schedule)")
    settings = settings or UpdateSettings()
    advantages = grpo_advantages(groups, normalize_std=settings.normalize_std)
    samples = build_train_samples(groups, advantages)
    micro_batches = pack_micro_batches(samples, settings.max_tokens_per_micro_batch)
    share = parallel.data_parallel_share([mb.num_tokens for mb in micro_batches])
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = defaultdict(float)
    device = next(model.parameters()).device
    for mb in (micro_batches[i] for i in share):
        tokens, mask = mb.padded(settings.pad_id)
        tokens, mask = tokens.to(device), mask.to(device)
        if reference is not None:
            with torch.no_grad():
                ref_logits = forward_logits(reference, tokens, attention_mask=mask)
                ref = batch_token_stats(ref_logits, mb, temperature=settings.temperature)
            mb = mb.with_log_probs(ref=ref.logprobs)
            del ref_logits
        logits = forward_logits(model, tokens, attention_mask=mask)
        stats = batch_token_stats(logits, mb, temperature=settings.temperature)
        out = batch_policy_loss(mb, stats, settings.loss)
        out.loss.backward()
        for name, value in out.metrics.items():
            totals[name] += float(value)
    parallel.finish_gradients(model)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = settings.max_grad_norm if settings.max_grad_norm is not None else math.inf
    grad_norm = parallel.clip_grad_norm(params, max_norm)
    optimizer.step()
    totals = defaultdict(float, parallel.sum_over_data_parallel(totals))
    totals.update(
        grad_norm=float(grad_norm),
        rollouts=float(len(advantages)),
        samples=float(len(samples)),
        micro_batches=float(len(micro_batches)),
        tokens=float(sum(len(s.tokens) for s in samples)),
        trained_tokens=float(sum(int(s.loss_mask.sum()) for s in samples)),
    )
    return dict(totals)
