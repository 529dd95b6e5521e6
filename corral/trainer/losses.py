"""GRPO advantages and the policy loss on merged multi-turn samples.

Advantages (:func:`grpo_advantages`). For a group ``g`` of rollouts with rewards ``r_1..r_n``
(one per *rollout*, however many samples each produced)::

    A_i = r_i - mean(r)                       (normalize_std=False)
    A_i = (r_i - mean(r)) / (std(r) + eps)    (normalize_std=True; std with n - 1, 0 for n = 1)

and every sample (every token) of rollout ``i`` gets ``A_i``. ``std`` uses Bessel's correction,
as ``torch.std`` and the slime adapter's ``normalize_group_rewards`` do, so both trainers give
the same advantages.

Policy loss (:func:`policy_loss`), per trainable response token ``t`` with current logprob
``lp``, old-policy logprob ``lp_old`` (the trainer's, before this step's updates; ``lp``
detached when not given: one update per step), engine logprob ``lp_roll`` and advantage ``A``::

    ratio = exp(lp - lp_old)
    pg    = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)   if clipped
            -A * ratio                                       otherwise
    clipped: (A > 0 and ratio > 1 + clip_high) or (A < 0 and ratio < 1 - clip_low)
    tis   = min(exp(lp_old - lp_roll), tis_cap)              (detached; 1 without a cap)
    kl    = k1:         lp - lp_ref
            k3:         exp(d) - d - 1,  d = lp_ref - lp
            low_var_kl: k3 with d clamped to [-20, 20] and the result to [-10, 10]
    L_t   = tis * pg + kl_coef * kl - entropy_coef * entropy

``pg`` is PPO's ``max(-A * ratio, -A * clamp(ratio))`` written out so the boundary is defined:
at ``ratio`` exactly ``1 + clip_high`` (or ``1 - clip_low``) both terms are equal, the token
counts as *not* clipped and its gradient flows. Separate ``clip_low`` / ``clip_high`` are
DAPO's clip-higher (a larger ``clip_high`` lets unlikely tokens with positive advantage grow).
TIS (truncated importance sampling) reweights by how much more likely the trainer's old policy
finds a token than the engine that sampled it did (numerics, kernels, quantisation), capped so
one token cannot dominate; it is a constant factor, so it scales gradients but has none.

Aggregation: ``loss = sum_t w_t * L_t`` with ``w_t = mask_t / (n_r * R)`` (built by
:func:`corral.trainer.batches.build_train_samples`): a token mean within each rollout over
all its samples, then a mean over the step's ``R`` rollouts. A rollout split into 3 samples
weighs as much as one in 1 sample, and a long rollout as much as a short one. Alternatives
considered:

- token mean over the whole batch (DAPO's token-level loss): long rollouts dominate the step;
- mean over samples of per-sample token means (slime's and verl's default
  "seq-mean-token-mean"): a rollout whose context was rewritten into 3 samples weighs 3x;
- sum divided by a constant (Dr. GRPO's ``max_tokens``): unbiased in length, but its scale
  depends on a configured constant rather than the data.

The per-rollout mean keeps GRPO's unit (the rollout) as the unit of weight, which is what the
baseline is computed over. Every metric is weighted with the same ``w_t``, so a metric is a
contribution: summing a step's micro-batches' metrics gives the step's value.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from corral.trainer.batches import TokenStats, TrainBatch
from corral.trainer.groups import Group

KLEstimator = Literal["k1", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k3", "low_var_kl")
# low_var_kl's clamps: exp(20) is still finite in float32, and a per-token KL above 10 is
# noise that would dominate the step.
_LOW_VAR_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def grpo_advantages(
    groups: Sequence[Group], *, normalize_std: bool = True, eps: float = 1e-6
) -> dict[str, float]:
    """Each rollout's advantage, by ``rollout_id`` (formula in the module docstring): its
    reward minus the mean over its group's rollouts, divided by ``std + eps`` when
    ``normalize_std``. ValueError: a rollout without a reward (filter the groups first), a
    rollout id in two groups, or ``eps < 0``."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, not {eps}")
    out: dict[str, float] = {}
    for group in groups:
        rewards: list[float] = []
        for r in group.rollouts:
            if r.reward is None:
                raise ValueError(f"rollout {r.rollout_id!r} has no reward: filter groups first")
            if r.rollout_id in out:
                raise ValueError(f"rollout {r.rollout_id!r} appears in two groups")
            rewards.append(float(r.reward))
        mean = statistics.fmean(rewards)
        std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        for r, reward in zip(group.rollouts, rewards, strict=True):
            out[r.rollout_id] = (reward - mean) / (std + eps) if normalize_std else reward - mean
    return out


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's knobs (formulas in the module docstring). ``tis_cap`` ``None`` turns
    TIS off; ``kl_coef`` 0 leaves the KL out of the loss (it is still reported when reference
    logprobs are given). ValueError on out-of-range values."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), not {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0, not {self.clip_high}")
        if self.tis_cap is not None and not self.tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0 or None, not {self.tis_cap}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}")


@dataclass(frozen=True)
class LossOutput:
    """``loss``: a scalar carrying the gradient (this micro-batch's share of the step loss).
    ``metrics``: detached scalars, each this micro-batch's weighted contribution (sum them over
    the step's micro-batches): ``loss``, ``pg_loss``, ``clip_fraction`` (and its
    ``clip_fraction_low`` / ``clip_fraction_high`` parts), ``tis_weight`` (the mean TIS
    factor), ``tis_capped_fraction``; ``kl`` with reference logprobs, ``entropy`` with
    entropies."""

    loss: Tensor
    metrics: dict[str, Tensor]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs (both
    ``[N]``; the gradient flows through ``logprobs``). Formulas in the module docstring: k1 is
    unbiased but can be negative; k3 is unbiased and never negative; low_var_kl is k3 clamped
    for stability. ValueError for an unknown estimator or mismatched shapes."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(logprobs.shape)} vs {tuple(ref_logprobs.shape)}")
    if estimator == "k1":
        return logprobs - ref_logprobs
    d = ref_logprobs - logprobs
    if estimator == "k3":
        return torch.exp(d) - d - 1
    if estimator == "low_var_kl":
        d = d.clamp(-_LOW_VAR_LOG_RATIO_CLAMP, _LOW_VAR_LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {KL_ESTIMATORS}")


def policy_loss(
    logprobs: Tensor,
    *,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    token_weights: Tensor,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    config: LossConfig | None = None,
) -> LossOutput:
    """The weighted policy loss over ``N`` response tokens (formulas in the module docstring).

    Every tensor is ``[N]``: ``logprobs`` (current policy, with gradient), ``rollout_logprobs``
    (the engine's), ``advantages`` (per token, its rollout's), ``loss_mask`` (1 trains the
    token), ``token_weights`` (``w_t``), optional ``old_logprobs`` (default ``logprobs``
    detached), ``ref_logprobs`` (needed when ``config.kl_coef > 0``) and ``entropy`` (with
    gradient; needed when ``config.entropy_coef > 0``).

    A token with mask 0 changes nothing, not even through inf/nan in its inputs (observation
    tokens carry a rollout logprob of 0.0): its inputs are replaced before any arithmetic, so
    its gradient is exactly 0. ValueError: mismatched shapes or a missing input the config
    needs."""
    config = config or LossConfig()
    given = {
        "rollout_logprobs": rollout_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "token_weights": token_weights,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "entropy": entropy,
    }
    for name, value in given.items():
        if value is not None and value.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}, logprobs {tuple(logprobs.shape)}"
            )
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be [N], not {tuple(logprobs.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    on = loss_mask > 0

    def safe(x: Tensor) -> Tensor:
        # Selecting on the *inputs* keeps masked tokens' values (and gradients) out of every
        # later op: masking the output instead would let a 0 * inf = nan through backward.
        return torch.where(on, x, torch.zeros_like(x))

    weights = safe(token_weights).detach()
    lp = safe(logprobs)
    old = safe(old_logprobs.detach() if old_logprobs is not None else logprobs.detach())
    adv = safe(advantages).detach()

    ratio = torch.exp(lp - old)
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    clipped_high = (adv > 0) & (ratio > high)
    clipped_low = (adv < 0) & (ratio < low)
    clipped = clipped_high | clipped_low
    # A clipped token's term is a constant: no gradient, as PPO's max() gives it.
    bound = torch.where(clipped_high, torch.full_like(ratio, high), torch.full_like(ratio, low))
    pg = -adv * torch.where(clipped, bound, ratio)

    if config.tis_cap is None:
        tis = torch.ones_like(ratio)
        capped = torch.zeros_like(on)
    else:
        raw = torch.exp(old - safe(rollout_logprobs).detach())
        capped = raw > config.tis_cap
        tis = raw.clamp(max=config.tis_cap)

    per_token = tis * pg
    metrics: dict[str, Tensor] = {}
    if ref_logprobs is not None:
        kl = kl_penalty(lp, safe(ref_logprobs).detach(), config.kl_estimator)
        metrics["kl"] = _weighted(kl.detach(), weights)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    if entropy is not None:
        ent = safe(entropy)
        metrics["entropy"] = _weighted(ent.detach(), weights)
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * ent

    loss = (weights * per_token).sum()
    metrics.update(
        loss=loss.detach(),
        pg_loss=_weighted((tis * pg).detach(), weights),
        clip_fraction=_weighted(clipped.to(weights.dtype), weights),
        clip_fraction_low=_weighted(clipped_low.to(weights.dtype), weights),
        clip_fraction_high=_weighted(clipped_high.to(weights.dtype), weights),
        tis_weight=_weighted(tis.detach(), weights),
        tis_capped_fraction=_weighted(capped.to(weights.dtype), weights),
    )
    return LossOutput(loss, metrics)


def _weighted(values: Tensor, weights: Tensor) -> Tensor:
    return (weights * values).sum()


def batch_policy_loss(
    batch: TrainBatch, stats: TokenStats, config: LossConfig | None = None
) -> LossOutput:
    """:func:`policy_loss` on a micro-batch: ``stats`` from
    :func:`corral.trainer.batches.batch_token_stats` on the policy's logits for ``batch``;
    old and reference logprobs from the batch when set. ValueError as :func:`policy_loss`."""
    like = stats.logprobs  # the batch's tensors move to the logits' device and dtype

    def optional(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.to(like)

    return policy_loss(
        like,
        rollout_logprobs=batch.rollout_log_probs.to(like),
        advantages=batch.advantages.to(like),
        loss_mask=batch.loss_mask.to(like),
        token_weights=batch.token_weights.to(like),
        old_logprobs=optional(batch.old_log_probs),
        ref_logprobs=optional(batch.ref_log_probs),
        entropy=stats.entropy,
        config=config,
    )
