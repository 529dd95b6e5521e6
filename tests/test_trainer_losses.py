"""The trainer's numbers against hand-computed ones: GRPO advantages over rollouts (uneven
groups, a rollout split into several samples, std normalisation), the policy loss and its
gradient, PPO clipping at and around its edges, the TIS cap, masks, the KL estimators, the
per-rollout weighting, micro-batch packing and the logprob gather.

Expected values are written out with plain Python floats and ``math``, never by calling the
code under test; tensors are float64 so comparisons can be tight."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import Tensor

from corral.samples import Sample
from corral.trainer.batches import (
    TokenStats,
    TrainBatch,
    TrainSample,
    batch_token_stats,
    build_train_samples,
    pack_micro_batches,
    token_logprobs,
    token_stats,
)
from corral.trainer.groups import Group, TrainRollout, group_samples
from corral.trainer.losses import (
    LossConfig,
    batch_policy_loss,
    grpo_advantages,
    kl_penalty,
    policy_loss,
)
from tests.factories import make_sample

F64 = torch.float64
NO_TIS = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None)


def t(*values: float) -> Tensor:
    return torch.tensor(values, dtype=F64)


def loss_and_grad(logprobs: list[float], **kwargs: object) -> tuple[float, list[float], dict]:
    """``policy_loss`` on leaf logprobs: the loss, d loss / d logprobs, the metrics."""
    lp = t(*logprobs).requires_grad_()
    out = policy_loss(lp, **kwargs)  # type: ignore[arg-type]
    out.loss.backward()
    assert lp.grad is not None
    metrics = {k: float(v) for k, v in out.metrics.items()}
    return float(out.loss.detach()), lp.grad.tolist(), metrics


# --------------------------------------------------------------------------- advantages


def uneven_groups() -> list[Group]:
    """Group 0: rollouts a (reward 1, 3 samples), b (0), c (0.5); group 1: d (2), e (0)."""
    return group_samples(
        [
            make_sample("a", 0, 1.0),
            make_sample("a", 0, 1.0),
            make_sample("d", 1, 2.0),
            make_sample("b", 0, 0.0),
            make_sample("a", 0, 1.0),
            make_sample("c", 0, 0.5),
            make_sample("e", 1, 0.0),
        ]
    )


def test_grpo_baseline_is_the_mean_over_rollouts_not_samples() -> None:
    adv = grpo_advantages(uneven_groups(), normalize_std=False)
    # Group 0 mean over rollouts: (1 + 0 + 0.5) / 3 = 0.5 (over samples it would be
    # (1 + 1 + 1 + 0 + 0.5) / 5 = 0.7). Group 1: (2 + 0) / 2 = 1.
    assert adv == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0, "d": 1.0, "e": -1.0}, abs=1e-12)


def test_grpo_std_normalised() -> None:
    adv = grpo_advantages(uneven_groups(), normalize_std=True, eps=1e-6)
    # Group 0: deviations 0.5, -0.5, 0 -> sample variance (0.25 + 0.25 + 0) / 2 = 0.25, std 0.5.
    # Group 1: deviations 1, -1 -> variance (1 + 1) / 1 = 2, std sqrt(2).
    expected = {
        "a": 0.5 / (0.5 + 1e-6),
        "b": -0.5 / (0.5 + 1e-6),
        "c": 0.0,
        "d": 1.0 / (math.sqrt(2) + 1e-6),
        "e": -1.0 / (math.sqrt(2) + 1e-6),
    }
    assert adv == pytest.approx(expected, abs=1e-12)


def test_a_rollouts_samples_share_its_advantage() -> None:
    groups = uneven_groups()
    adv = grpo_advantages(groups, normalize_std=False)
    built = build_train_samples(groups, adv)
    assert [(s.rollout_id, s.advantage) for s in built] == [
        ("a", 0.5),
        ("a", 0.5),
        ("a", 0.5),
        ("b", -0.5),
        ("c", 0.0),
        ("d", 1.0),
        ("e", -1.0),
    ]
    batch = TrainBatch.from_samples(built)
    # Every response token (2 per sample) carries its rollout's advantage.
    assert batch.advantages.tolist() == [0.5] * 6 + [-0.5] * 2 + [0.0] * 2 + [1.0] * 2 + [-1.0] * 2


def test_grpo_edge_cases() -> None:
    lone = group_samples([make_sample("z", 7, 3.0)])
    # One rollout: its advantage is 0 (std taken as 0), not nan.
    assert grpo_advantages(lone, normalize_std=True) == {"z": 0.0}
    flagged = Group(
        0, (TrainRollout("f", 0, (make_sample("f", 0, 0.0),), None, "failed_rollout", "env"),)
    )
    with pytest.raises(ValueError, match="filter groups first"):
        grpo_advantages([flagged])
    with pytest.raises(ValueError, match="two groups"):
        grpo_advantages(lone + lone)


# --------------------------------------------------------------------------- the loss


def test_loss_value_and_gradient() -> None:
    # Two tokens, weight 1/2 each, no clipping (ratios 1.1 and 0.9), engine == old (TIS 1).
    loss, grad, metrics = loss_and_grad(
        [math.log(1.1), math.log(0.9)],
        old_logprobs=t(0.0, 0.0),
        rollout_logprobs=t(0.0, 0.0),
        advantages=t(1.0, -1.0),
        loss_mask=t(1, 1),
        token_weights=t(0.5, 0.5),
        config=LossConfig(),
    )
    # -A * ratio: -1.1 and +0.9; weighted: (-1.1 + 0.9) / 2.
    assert loss == pytest.approx(-0.1, abs=1e-12)
    # d/dlp (-A * exp(lp - old)) = -A * ratio, times the weight.
    assert grad == pytest.approx([-0.55, 0.45], abs=1e-12)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight"] == pytest.approx(1.0)
    assert metrics["pg_loss"] == pytest.approx(-0.1)


def test_gradient_step_raises_positive_and_lowers_negative_advantage_tokens() -> None:
    # A "model" whose logits are parameters: one SGD step on the loss must make the token of
    # the positive-advantage rollout more likely and that of the negative one less likely.
    torch.manual_seed(0)
    samples = [make_sample("up", 0, 1.0, response=[3]), make_sample("down", 0, 0.0, response=[3])]
    built = build_train_samples(group_samples(samples), {"up": 1.0, "down": -1.0})
    batch = TrainBatch.from_samples(built)
    logits = torch.randn(batch.num_tokens, 5, dtype=F64, requires_grad=True)
    before = batch_token_stats(logits, batch).logprobs.detach()
    batch = batch.with_log_probs(old=before)
    out = batch_policy_loss(batch, batch_token_stats(logits, batch), NO_TIS)
    out.loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad  # type: ignore[operator]
    after = batch_token_stats(logits, batch).logprobs.detach()
    assert after[0] > before[0]
    assert after[1] < before[1]


# Clipping with clip_low 0.2 and clip_high 0.28, one token of weight 1, TIS off:
# (advantage, ratio, expected loss, expected d loss / d logprob, clipped low, clipped high).
# Unclipped: loss -A * r, gradient -A * r; clipped: loss -A * bound, gradient 0.
CLIP_CASES = [
    (1.0, 1.28, -1.28, -1.28, 0, 0),  # exactly at 1 + clip_high: not clipped, gradient flows
    (1.0, 1.5, -1.28, 0.0, 0, 1),  # above 1 + clip_high with A > 0: clipped
    (1.0, 1.25, -1.25, -1.25, 0, 0),  # above 1 + clip_low but clip-higher lets it through
    (1.0, 0.5, -0.5, -0.5, 0, 0),  # A > 0 below 1 - clip_low: PPO does not clip
    (-1.0, 0.8, 0.8, 0.8, 0, 0),  # exactly at 1 - clip_low: not clipped
    (-1.0, 0.5, 0.8, 0.0, 1, 0),  # below 1 - clip_low with A < 0: clipped
    (-1.0, 1.5, 1.5, 1.5, 0, 0),  # A < 0 above 1 + clip_high: PPO does not clip
    (-2.0, 0.75, 1.6, 0.0, 1, 0),  # clipped at 0.8, times |A| = 2
    (0.0, 2.0, 0.0, 0.0, 0, 0),  # no advantage: no loss, no clip
]


@pytest.mark.parametrize(("adv", "ratio", "value", "slope", "low", "high"), CLIP_CASES)
def test_clipping(
    adv: float, ratio: float, value: float, slope: float, low: int, high: int
) -> None:
    # old 0, so the ratio is exp(log(ratio)) (exact in float64 for these values: checked).
    assert math.exp(math.log(ratio)) == ratio
    loss, grad, metrics = loss_and_grad(
        [math.log(ratio)],
        old_logprobs=t(0.0),
        rollout_logprobs=t(0.0),
        advantages=t(adv),
        loss_mask=t(1),
        token_weights=t(1.0),
        config=NO_TIS,
    )
    assert loss == pytest.approx(value, abs=1e-12)
    assert grad == pytest.approx([slope], abs=1e-12)
    assert (metrics["clip_fraction_low"], metrics["clip_fraction_high"]) == (low, high)
    assert metrics["clip_fraction"] == low + high
    # Same value as PPO's max(-A r, -A clamp(r, 1 - 0.2, 1 + 0.28)), computed by hand.
    assert value == pytest.approx(max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.28)))


def test_symmetric_clip_clips_what_clip_higher_lets_through() -> None:
    loss, grad, metrics = loss_and_grad(
        [math.log(1.25)],
        old_logprobs=t(0.0),
        rollout_logprobs=t(0.0),
        advantages=t(1.0),
        loss_mask=t(1),
        token_weights=t(1.0),
        config=LossConfig(clip_low=0.2, clip_high=0.2, tis_cap=None),
    )
    assert (loss, grad, metrics["clip_fraction"]) == (pytest.approx(-1.2), [0.0], 1.0)


def test_clip_fraction_is_weighted_over_tokens() -> None:
    cases = CLIP_CASES
    n = len(cases)
    _, _, metrics = loss_and_grad(
        [math.log(c[1]) for c in cases],
        old_logprobs=torch.zeros(n, dtype=F64),
        rollout_logprobs=torch.zeros(n, dtype=F64),
        advantages=t(*[c[0] for c in cases]),
        loss_mask=torch.ones(n, dtype=F64),
        token_weights=torch.full((n,), 1.0 / n, dtype=F64),
        config=NO_TIS,
    )
    # 3 of the 9 tokens are clipped: 2 low, 1 high.
    assert metrics["clip_fraction"] == pytest.approx(3 / 9)
    assert metrics["clip_fraction_low"] == pytest.approx(2 / 9)
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 9)


def test_tis_is_capped() -> None:
    # Ratio 1 (old defaults to the current logprobs), A = 1, weights 1/3. The engine's
    # logprobs make exp(old - engine) = 0.5, 1.5 and 3.0; the cap of 2 turns 3.0 into 2.0.
    engine = t(-math.log(0.5), -math.log(1.5), -math.log(3.0))
    common = {
        "rollout_logprobs": engine,
        "advantages": t(1.0, 1.0, 1.0),
        "loss_mask": t(1, 1, 1),
        "token_weights": t(1 / 3, 1 / 3, 1 / 3),
    }
    loss, grad, metrics = loss_and_grad([0.0, 0.0, 0.0], **common, config=LossConfig(tis_cap=2.0))
    # -A * ratio * tis, weighted: -(0.5 + 1.5 + 2.0) / 3; gradient -tis / 3 per token.
    assert loss == pytest.approx(-4.0 / 3, abs=1e-12)
    assert grad == pytest.approx([-0.5 / 3, -1.5 / 3, -2.0 / 3], abs=1e-12)
    assert metrics["tis_weight"] == pytest.approx(4.0 / 3)
    assert metrics["tis_capped_fraction"] == pytest.approx(1 / 3)
    # TIS off: every token weighs its plain -A * ratio.
    loss, grad, metrics = loss_and_grad([0.0, 0.0, 0.0], **common, config=NO_TIS)
    assert loss == pytest.approx(-1.0, abs=1e-12)
    assert grad == pytest.approx([-1 / 3] * 3, abs=1e-12)
    assert metrics["tis_capped_fraction"] == 0.0


def test_tis_uses_old_logprobs_not_current() -> None:
    # With old logprobs given, TIS is exp(old - engine) = exp(0.5), whatever the current
    # logprob is (here ratio exp(0.1) = 1.105..., inside the clip range).
    loss, grad, _ = loss_and_grad(
        [0.1],
        old_logprobs=t(0.0),
        rollout_logprobs=t(-0.5),
        advantages=t(1.0),
        loss_mask=t(1),
        token_weights=t(1.0),
        config=LossConfig(tis_cap=10.0),
    )
    assert loss == pytest.approx(-math.exp(0.5) * math.exp(0.1), abs=1e-12)
    assert grad == pytest.approx([-math.exp(0.5) * math.exp(0.1)], abs=1e-12)


def test_masked_tokens_change_nothing() -> None:
    # Token 1 is masked and its inputs are garbage (inf, nan): loss and gradient ignore it.
    config = LossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, tis_cap=2.0)
    # -inf: the policy rules the (observation) token out; unmasked it would give nan.
    lp = t(math.log(1.1), -math.inf, math.log(0.9)).requires_grad_()
    entropy = t(0.7, math.nan, 0.3).requires_grad_()
    out = policy_loss(
        lp,
        old_logprobs=t(0.0, math.inf, 0.0),
        rollout_logprobs=t(0.0, -math.inf, 0.0),
        ref_logprobs=t(0.0, math.nan, 0.0),
        entropy=entropy,
        advantages=t(1.0, math.nan, -1.0),
        loss_mask=t(1, 0, 1),
        token_weights=t(0.5, 123.0, 0.5),  # a weight on a masked token is ignored too
        config=config,
    )
    out.loss.backward()
    assert lp.grad is not None and entropy.grad is not None
    assert lp.grad[1] == 0.0 and entropy.grad[1] == 0.0
    assert math.isfinite(out.loss.item())
    assert all(math.isfinite(float(v)) for v in out.metrics.values())
    # Same loss as with only the two unmasked tokens.
    alone = policy_loss(
        t(math.log(1.1), math.log(0.9)),
        old_logprobs=t(0.0, 0.0),
        rollout_logprobs=t(0.0, 0.0),
        ref_logprobs=t(0.0, 0.0),
        entropy=t(0.7, 0.3),
        advantages=t(1.0, -1.0),
        loss_mask=t(1, 1),
        token_weights=t(0.5, 0.5),
        config=config,
    )
    assert out.loss.item() == pytest.approx(alone.loss.item(), abs=1e-12)
    # The metrics too (the masked token's weight of 123 counts nowhere).
    assert {k: v.item() for k, v in out.metrics.items()} == pytest.approx(
        {k: v.item() for k, v in alone.metrics.items()}, abs=1e-12
    )


def test_masked_positions_get_no_gradient_through_the_logits() -> None:
    # Response [5, 6, 7] with mask [1, 0, 1]: logits row P - 1 + 1 (the one scoring token 6)
    # gets no gradient; the rows scoring tokens 5 and 7 do.
    s = make_sample("a", 0, 1.0, prompt=[1, 2], response=[5, 6, 7], loss_mask=[1, 0, 1])
    batch = TrainBatch.from_samples(build_train_samples(group_samples([s]), {"a": 1.0}))
    logits = torch.randn(5, 8, dtype=F64, requires_grad=True)
    batch_policy_loss(batch, batch_token_stats(logits, batch), NO_TIS).loss.backward()
    grad = logits.grad
    assert grad is not None
    norms = [float(grad[i].abs().sum()) for i in range(5)]
    assert norms[2] == 0.0  # scores token 6 (masked)
    assert norms[1] > 0.0 and norms[3] > 0.0  # score tokens 5 and 7
    assert norms[0] == 0.0 and norms[4] == 0.0  # a prompt token, and the row past the end


def test_inputs_are_checked() -> None:
    one = t(0.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(
            one, rollout_logprobs=one, advantages=t(0.0, 0.0), loss_mask=one, token_weights=one
        )
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(
            one,
            rollout_logprobs=one,
            advantages=one,
            loss_mask=one,
            token_weights=one,
            config=LossConfig(kl_coef=0.1),
        )
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(
            one,
            rollout_logprobs=one,
            advantages=one,
            loss_mask=one,
            token_weights=one,
            config=LossConfig(entropy_coef=0.1),
        )
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)


# --------------------------------------------------------------------------- KL and entropy


def test_kl_estimators_closed_forms() -> None:
    lp = t(-1.0, -0.2, -3.0)
    ref = t(-1.5, -0.1, -0.5)
    d = [r - p for p, r in zip([-1.0, -0.2, -3.0], [-1.5, -0.1, -0.5], strict=True)]
    k1 = [-x for x in d]
    k3 = [math.exp(x) - x - 1 for x in d]
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx(k1, abs=1e-12)
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx(k3, abs=1e-12)
    # Within its clamps low_var_kl is k3 (exp(2.5) - 3.5 = 8.68 < 10).
    assert kl_penalty(lp, ref, "low_var_kl").tolist() == pytest.approx(k3, abs=1e-12)
    # Outside: d = 30 is clamped to 20, then exp(20) - 21 to 10; d = -30: 20 - 1 + e^-20 -> 10.
    far = kl_penalty(t(0.0, 0.0), t(30.0, -30.0), "low_var_kl").tolist()
    assert far == [10.0, 10.0]
    assert kl_penalty(t(0.0), t(-3.0), "k3").tolist() == pytest.approx([math.exp(-3) + 2])


def test_kl_estimators_are_unbiased_for_the_exact_kl() -> None:
    # Tokens sampled from p, scored by p (policy) and q (reference): the p-weighted mean of k1
    # and of k3 over the whole support is exactly KL(p || q) = sum p log(p / q).
    p = [0.5, 0.3, 0.2]
    q = [0.2, 0.5, 0.3]
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    lp, ref = t(*map(math.log, p)), t(*map(math.log, q))
    for estimator in ("k1", "k3"):
        values = kl_penalty(lp, ref, estimator).tolist()  # type: ignore[arg-type]
        mean = sum(pi * v for pi, v in zip(p, values, strict=True))
        assert mean == pytest.approx(exact, abs=1e-12), estimator


def test_kl_term_in_the_loss() -> None:
    # One token, ratio 1, A = 0 (no policy gradient), k3 with d = ref - lp = -0.5, coef 0.1.
    loss, grad, metrics = loss_and_grad(
        [0.0],
        rollout_logprobs=t(0.0),
        ref_logprobs=t(-0.5),
        advantages=t(0.0),
        loss_mask=t(1),
        token_weights=t(1.0),
        config=LossConfig(kl_coef=0.1, kl_estimator="k3"),
    )
    k3 = math.exp(-0.5) + 0.5 - 1
    assert loss == pytest.approx(0.1 * k3, abs=1e-12)
    assert metrics["kl"] == pytest.approx(k3, abs=1e-12)
    # d k3 / d lp = 1 - exp(ref - lp): positive, so descent lowers lp towards the reference.
    assert grad == pytest.approx([0.1 * (1 - math.exp(-0.5))], abs=1e-12)
    # kl_coef 0: still reported, not in the loss.
    loss, grad, metrics = loss_and_grad(
        [0.0],
        rollout_logprobs=t(0.0),
        ref_logprobs=t(-0.5),
        advantages=t(0.0),
        loss_mask=t(1),
        token_weights=t(1.0),
        config=LossConfig(kl_estimator="k3"),
    )
    assert (loss, grad, metrics["kl"]) == (0.0, [0.0], pytest.approx(k3))


def test_entropy_bonus() -> None:
    lp = t(0.0).requires_grad_()
    entropy = t(0.9).requires_grad_()
    out = policy_loss(
        lp,
        rollout_logprobs=t(0.0),
        advantages=t(0.0),
        loss_mask=t(1),
        token_weights=t(0.5),
        entropy=entropy,
        config=LossConfig(entropy_coef=0.01),
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.01 * 0.5 * 0.9, abs=1e-12)
    assert entropy.grad is not None and float(entropy.grad[0]) == pytest.approx(-0.005)
    assert float(out.metrics["entropy"]) == pytest.approx(0.45)


# --------------------------------------------------------------------------- weighting


def weighting_batch() -> list[TrainSample]:
    """Rollout A: 3 samples with 2, 1 and 1 trainable tokens (one masked token); rollout B: 1
    sample with 2 trainable tokens."""
    samples = [
        make_sample("A", 0, 1.0, response=[3, 4]),
        make_sample("A", 0, 1.0, response=[5, 6], loss_mask=[0, 1]),
        make_sample("A", 0, 1.0, response=[7]),
        make_sample("B", 0, 0.0, response=[8, 9]),
    ]
    return build_train_samples(group_samples(samples), {"A": 1.0, "B": -0.5})


def test_token_weights_are_per_rollout_token_means() -> None:
    built = weighting_batch()
    # A has 4 trainable tokens, B 2; 2 rollouts: A's tokens weigh 1/(4*2), B's 1/(2*2).
    assert [s.token_weight for s in built] == [1 / 8, 1 / 8, 1 / 8, 1 / 4]
    batch = TrainBatch.from_samples(built)
    assert batch.token_weights.tolist() == [1 / 8, 1 / 8, 0.0, 1 / 8, 1 / 8, 1 / 4, 1 / 4]
    assert float(batch.token_weights.sum()) == pytest.approx(1.0)


def test_a_rollout_split_into_three_samples_does_not_weigh_three_times() -> None:
    batch = TrainBatch.from_samples(weighting_batch())
    n = batch.num_response_tokens
    logprobs = batch.rollout_log_probs.to(F64)
    out = batch_policy_loss(batch, _stats(logprobs), NO_TIS)
    # Ratio 1 everywhere: a token's loss is -A. Mean over rollouts of token means:
    # (-1 + 0.5) / 2 = -0.25. (Mean over samples: (-1 - 1 - 1 + 0.5) / 4 = -0.625; token mean
    # over the batch: (4 * -1 + 2 * 0.5) / 6 = -0.5.)
    assert out.loss.item() == pytest.approx(-0.25, abs=1e-7)
    assert n == 7  # 4 + 1 masked for A, 2 for B


def test_rollout_count_scales_for_data_parallel_shares() -> None:
    groups = group_samples([make_sample("A", 0, 1.0), make_sample("B", 0, 0.0)])
    built = build_train_samples(groups, {"A": 1.0, "B": -1.0}, rollout_count=4)
    assert [s.token_weight for s in built] == [1 / 8, 1 / 8]
    with pytest.raises(ValueError, match="below the 2 rollouts"):
        build_train_samples(groups, {"A": 1.0, "B": -1.0}, rollout_count=1)
    with pytest.raises(ValueError, match="no advantage"):
        build_train_samples(groups, {"A": 1.0})


def test_packing_does_not_change_the_step_loss_or_gradient() -> None:
    built = weighting_batch()
    torch.manual_seed(1)
    logits = torch.randn(sum(s.num_tokens for s in built), 10, dtype=F64, requires_grad=True)
    # Each sample's own logits rows, wherever packing puts it.
    starts = [sum(s.num_tokens for s in built[:i]) for i in range(len(built))]
    table = {id(s): logits[a : a + s.num_tokens] for a, s in zip(starts, built, strict=True)}

    def step_loss(batches: list[TrainBatch]) -> tuple[float, Tensor]:
        logits.grad = None
        total = torch.zeros((), dtype=F64)
        for b in batches:
            rows = torch.cat([table[id(_find(built, b, k))] for k in range(b.num_samples)])
            stats = batch_token_stats(rows, b)
            old = stats.logprobs.detach() - 0.05  # ratios exp(0.05): inside the clip range
            total = total + batch_policy_loss(b.with_log_probs(old=old), stats, NO_TIS).loss
        total.backward()
        assert logits.grad is not None
        return total.item(), logits.grad.clone()

    whole, grad_whole = step_loss([TrainBatch.from_samples(built)])
    split, grad_split = step_loss(pack_micro_batches(built, 4))  # one sample per micro-batch
    assert split == pytest.approx(whole, abs=1e-12)
    assert torch.allclose(grad_split, grad_whole, atol=1e-12)
    # Per-rollout token means: A's tokens have A = 1, B's A = -0.5, ratio exp(0.05).
    assert whole == pytest.approx(-(1.0 - 0.5) / 2 * math.exp(0.05), abs=1e-12)


def _find(built: list[TrainSample], batch: TrainBatch, k: int) -> TrainSample:
    """The sample at position ``k`` of ``batch`` (matched by its tokens)."""
    start, end = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
    tokens = batch.tokens[start:end]
    (match,) = [s for s in built if torch.equal(s.tokens, tokens)]
    return match


def _stats(logprobs: Tensor) -> TokenStats:
    return TokenStats(logprobs, torch.zeros_like(logprobs))


# --------------------------------------------------------------------------- packing


def train_sample(n_tokens: int, tag: int, response_length: int = 2) -> TrainSample:
    return TrainSample(
        tokens=(torch.arange(n_tokens) + tag) % 7,  # ids below the test vocabularies
        response_length=response_length,
        loss_mask=torch.tensor([1.0] * response_length),
        rollout_log_probs=torch.full((response_length,), -float(tag)),
        advantage=float(tag),
        rollout_id=f"r{tag}",
        group_index=tag // 2,
        token_weight=0.01 * tag,
    )


def test_pack_first_fit_decreasing() -> None:
    sizes = [5, 3, 7, 2, 4, 12]
    samples = [train_sample(n, i, response_length=1) for i, n in enumerate(sizes)]
    batches = pack_micro_batches(samples, 10)
    # Longest first: 12 alone (over budget); 7 -> new (room 3); 5 -> new (room 5); 4 -> the
    # 5's (room 1); 3 -> the 7's (room 0); 2 -> new. Inside a batch: the given order.
    assert [list(b.rollout_ids) for b in batches] == [["r5"], ["r1", "r2"], ["r0", "r4"], ["r3"]]
    assert [b.num_tokens for b in batches] == [12, 10, 9, 2]


def test_pack_keeps_every_sample_aligned() -> None:
    rng = random.Random(7)
    samples = [train_sample(rng.randint(3, 20), i, rng.randint(1, 2)) for i in range(40)]
    for budget in (1, 8, 20, 33, 1000):
        batches = pack_micro_batches(samples, budget)
        seen: list[str] = []
        for b in batches:
            assert b.num_tokens <= budget or b.num_samples == 1
            offset = 0
            for k, rid in enumerate(b.rollout_ids):
                s = samples[int(rid[1:])]
                start, end = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
                assert torch.equal(b.tokens[start:end], s.tokens)
                assert (b.prompt_lengths[k], b.response_lengths[k]) == (
                    s.prompt_length,
                    s.response_length,
                )
                assert b.group_indices[k] == s.group_index
                part = slice(offset, offset + s.response_length)
                assert torch.equal(b.loss_mask[part], s.loss_mask)
                assert torch.equal(b.rollout_log_probs[part], s.rollout_log_probs)
                assert b.advantages[part].tolist() == [s.advantage] * s.response_length
                assert b.token_weights[part].tolist() == pytest.approx(
                    [s.token_weight] * s.response_length
                )
                offset += s.response_length
                seen.append(rid)
            assert offset == b.num_response_tokens
        assert sorted(seen) == sorted(s.rollout_id for s in samples)
    with pytest.raises(ValueError, match=">= 1"):
        pack_micro_batches(samples, 0)
    with pytest.raises(ValueError, match="nothing to pack"):
        pack_micro_batches([], 10)


def test_train_sample_rejects_mismatched_lengths() -> None:
    bad = Sample.model_construct(
        tokens=[1, 2, 3, 4],
        response_length=2,
        loss_mask=[1, 1, 1],
        rollout_log_probs=[0.0, 0.0],
        reward=1.0,
        group_index=0,
        rollout_id="x",
    )
    with pytest.raises(ValueError, match="loss_mask has shape"):
        TrainSample.from_sample(bad, advantage=0.0, token_weight=1.0, group_index=0)
    with pytest.raises(ValueError, match="at least one prompt token"):
        train_sample(2, 0, response_length=2)
    with pytest.raises(ValueError, match="only 0 and 1"):
        TrainSample(
            tokens=torch.arange(3),
            response_length=1,
            loss_mask=torch.tensor([0.5]),
            rollout_log_probs=torch.tensor([0.0]),
            advantage=0.0,
            rollout_id="y",
            group_index=0,
            token_weight=1.0,
        )
    batch = TrainBatch.from_samples([train_sample(4, 1)])
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        batch.with_log_probs(old=torch.zeros(3))


# --------------------------------------------------------------------------- logprob gather


def gather_case() -> tuple[Tensor, Tensor]:
    """4 tokens [1, 1, 2, 0], response 2: rows 1 and 2 score tokens 2 and 0. Rows 0 and 3
    hold junk that must not matter."""
    logits = t(0.0, 0.0, 0.0).repeat(4, 1)
    logits[0] = t(50.0, -50.0, 7.0)
    logits[1] = t(0.0, math.log(2), math.log(3))  # probabilities 1/6, 2/6, 3/6
    logits[2] = t(math.log(4), 0.0, 0.0)  # probabilities 4/6, 1/6, 1/6
    logits[3] = t(-9.0, 80.0, 1.0)
    return logits, torch.tensor([1, 1, 2, 0])


def test_token_logprobs_by_hand() -> None:
    logits, tokens = gather_case()
    got = token_logprobs(logits, tokens, 2).tolist()
    assert got == pytest.approx([math.log(3 / 6), math.log(4 / 6)], abs=1e-12)
    # Temperature 2: row 1 becomes probabilities proportional to 1, sqrt 2, sqrt 3.
    hot = token_logprobs(logits, tokens, 2, temperature=2.0).tolist()
    row1 = math.log(math.sqrt(3) / (1 + math.sqrt(2) + math.sqrt(3)))
    row2 = math.log(2 / (2 + 1 + 1))
    assert hot == pytest.approx([row1, row2], abs=1e-12)


def test_token_entropy_by_hand() -> None:
    logits, tokens = gather_case()
    entropy = token_stats(logits, tokens, 2).entropy.tolist()
    h1 = -sum(p * math.log(p) for p in (1 / 6, 2 / 6, 3 / 6))
    h2 = -sum(p * math.log(p) for p in (4 / 6, 1 / 6, 1 / 6))
    assert entropy == pytest.approx([h1, h2], abs=1e-12)
    # A token that -inf logits rule out adds nothing (and no nan).
    ruled_out = token_stats(t(0.0, 0.0, -math.inf).repeat(2, 1), torch.tensor([0, 1]), 1)
    assert ruled_out.entropy.tolist() == pytest.approx([math.log(2)])


def test_token_logprobs_rejects_bad_shapes() -> None:
    logits, tokens = gather_case()
    with pytest.raises(ValueError, match="must be"):
        token_logprobs(logits[:3], tokens, 2)
    with pytest.raises(ValueError, match="at least one prompt token"):
        token_logprobs(logits, tokens, 4)
    with pytest.raises(ValueError, match="not within"):
        token_logprobs(logits, tokens, 5)
    assert token_logprobs(logits, tokens, 0).numel() == 0


def test_batch_token_stats_packed_and_padded_agree() -> None:
    samples = [train_sample(4, 1, 2), train_sample(6, 2, 3), train_sample(3, 3, 1)]
    batch = TrainBatch.from_samples(samples)
    torch.manual_seed(2)
    packed = torch.randn(batch.num_tokens, 11, dtype=F64)
    tokens, mask = batch.padded(pad_id=0)
    assert tokens.shape == (3, 6) and mask.sum(1).tolist() == [4, 6, 3]
    padded = torch.full((3, 6, 11), 99.0, dtype=F64)  # junk on padding
    for b in range(3):
        start, end = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
        padded[b, : end - start] = packed[start:end]
        assert tokens[b, : end - start].tolist() == batch.tokens[start:end].tolist()
    a, b_ = batch_token_stats(packed, batch), batch_token_stats(padded, batch)
    assert a.logprobs.shape == (batch.num_response_tokens,) == (6,)
    assert torch.equal(a.logprobs, b_.logprobs) and torch.equal(a.entropy, b_.entropy)
    # The second sample's first response token (packed position 4 + 3) is scored by row 6.
    row = torch.log_softmax(packed[4 + 2], -1)
    assert float(a.logprobs[2]) == pytest.approx(float(row[int(batch.tokens[4 + 3])]))
    with pytest.raises(ValueError, match="neither"):
        batch_token_stats(packed[:-1], batch)
