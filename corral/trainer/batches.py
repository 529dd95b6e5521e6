"""Training tensors: samples with their advantage and loss weight, micro-batches packed up to a
token budget, and the logprob gather from a model's logits.

Layout. A :class:`TrainBatch` (one micro-batch) holds its samples *packed*: ``tokens`` is every
sample's full sequence (prompt + response) concatenated, ``cu_seqlens`` marks where each starts
(as varlen attention kernels and Megatron's THD format take them). Everything per token of the
loss (``loss_mask``, ``rollout_log_probs``, ``advantages``, ``token_weights`` and the optional
``old_log_probs`` / ``ref_log_probs``) covers the *response* tokens only, sample after sample, so
those tensors have ``N = sum(response_lengths)`` entries and line up with
:func:`batch_token_stats`' output. :meth:`TrainBatch.padded` gives a right-padded ``[B, L]``
view for models that take padding instead.

Weights. The step loss is a token mean within each rollout (over all its samples' trainable
tokens), then a mean over rollouts (see :mod:`corral.trainer.losses`). Because a rollout's
samples may land in different micro-batches, the normalisers are fixed for the whole step when
the samples are built: each trainable token of a rollout with ``n`` trainable tokens weighs
``1 / (n * R)`` (``R`` rollouts in the step), so summing the micro-batches' weighted losses (as
gradient accumulation does) gives exactly the step loss, however the samples were packed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from corral.samples import Sample
from corral.trainer.groups import Group


@dataclass(frozen=True, eq=False)
class TrainSample:
    """One sample ready to train on. ``tokens``: ``[L]`` int64, prompt then response;
    ``loss_mask`` (0./1.) and ``rollout_log_probs`` (the engine's): ``[response_length]``
    float32. ``advantage`` is its rollout's; ``token_weight`` the weight of each of its
    trainable tokens in the step loss. ValueError on inconsistent lengths, a response with no
    prompt token before it (no logit predicts its first token), or a mask that is not 0/1."""

    tokens: Tensor
    response_length: int
    loss_mask: Tensor
    rollout_log_probs: Tensor
    advantage: float
    rollout_id: str
    group_index: int
    token_weight: float

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, not {tuple(self.tokens.shape)}")
        length = self.tokens.numel()
        if not 0 <= self.response_length <= length:
            raise ValueError(
                f"rollout {self.rollout_id!r}: response_length {self.response_length} is not "
                f"within the {length} tokens"
            )
        if self.response_length and self.response_length == length:
            raise ValueError(
                f"rollout {self.rollout_id!r}: a sample needs at least one prompt token"
            )
        for name in ("loss_mask", "rollout_log_probs"):
            shape = tuple(getattr(self, name).shape)
            if shape != (self.response_length,):
                raise ValueError(
                    f"rollout {self.rollout_id!r}: {name} has shape {shape}, response_length "
                    f"is {self.response_length}"
                )
        if not bool(((self.loss_mask == 0) | (self.loss_mask == 1)).all()):
            raise ValueError(f"rollout {self.rollout_id!r}: loss_mask may hold only 0 and 1")
        if self.token_weight < 0:
            raise ValueError(f"token_weight must be >= 0, not {self.token_weight}")

    @property
    def prompt_length(self) -> int:
        return self.tokens.numel() - self.response_length

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @classmethod
    def from_sample(
        cls, sample: Sample, *, advantage: float, token_weight: float, group_index: int
    ) -> TrainSample:
        """``sample`` as tensors (its lists are copied). ValueError as the class says."""
        return cls(
            tokens=torch.tensor(sample.tokens, dtype=torch.long),
            response_length=sample.response_length,
            loss_mask=torch.tensor(sample.loss_mask, dtype=torch.float32),
            rollout_log_probs=torch.tensor(sample.rollout_log_probs, dtype=torch.float32),
            advantage=advantage,
            rollout_id=sample.rollout_id,
            group_index=group_index,
            token_weight=token_weight,
        )


def build_train_samples(
    groups: Sequence[Group],
    advantages: Mapping[str, float],
    *,
    rollout_count: int | None = None,
) -> list[TrainSample]:
    """Every sample of ``groups`` (kept groups: no flagged rollout) with its rollout's
    advantage (``advantages[rollout_id]``, e.g. :func:`corral.trainer.losses.grpo_advantages`)
    and its token weight ``1 / (n_r * R)``: ``n_r`` the trainable (mask 1) tokens of its
    rollout over all the rollout's samples, ``R`` the rollouts of the step that have any.

    A rollout with no trainable token weighs 0 and is not counted in ``R`` (it has no loss term
    to average). ``rollout_count`` overrides ``R``: with data parallelism each rank builds its
    own share of the step and passes the step's total, so the ranks' summed gradients are the
    step's. ValueError: a flagged rollout, a missing advantage, ``rollout_count`` below the
    rollouts here that have trainable tokens, or a malformed sample."""
    rollouts = [r for g in groups for r in g.rollouts]
    for r in rollouts:
        if r.flag is not None:
            raise ValueError(f"rollout {r.rollout_id!r} is flagged {r.flag}: filter groups first")
        if r.rollout_id not in advantages:
            raise ValueError(f"no advantage for rollout {r.rollout_id!r}")
    trainable = {r.rollout_id: sum(sum(s.loss_mask) for s in r.samples) for r in rollouts}
    local = sum(1 for n in trainable.values() if n > 0)
    if rollout_count is None:
        rollout_count = local
    elif rollout_count < local:
        raise ValueError(f"rollout_count {rollout_count} is below the {local} rollouts given")
    out = []
    for r in rollouts:
        n = trainable[r.rollout_id]
        weight = 1.0 / (n * rollout_count) if n > 0 else 0.0
        for s in r.samples:
            out.append(
                TrainSample.from_sample(
                    s,
                    advantage=float(advantages[r.rollout_id]),
                    token_weight=weight,
                    group_index=r.group_index,
                )
            )
    return out


@dataclass(frozen=True, eq=False)
class TrainBatch:
    """One micro-batch (see the module docstring for the layout). ``B`` samples, ``T`` tokens
    in all, ``N`` response tokens in all:

    - ``tokens`` ``[T]`` int64, ``cu_seqlens`` ``[B + 1]`` int64 (sample ``b`` is
      ``tokens[cu_seqlens[b]:cu_seqlens[b + 1]]``);
    - per sample: ``prompt_lengths``, ``response_lengths``, ``rollout_ids``, ``group_indices``;
    - per response token, ``[N]`` float32: ``loss_mask``, ``rollout_log_probs``, ``advantages``
      (the token's rollout's), ``token_weights`` (``loss_mask`` times the sample's weight),
      and optionally ``old_log_probs`` / ``ref_log_probs`` (set with :meth:`with_log_probs`).
    """

    tokens: Tensor
    cu_seqlens: Tensor
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    rollout_ids: tuple[str, ...]
    group_indices: tuple[int, ...]
    loss_mask: Tensor
    rollout_log_probs: Tensor
    advantages: Tensor
    token_weights: Tensor
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None

    @classmethod
    def from_samples(cls, samples: Sequence[TrainSample]) -> TrainBatch:
        """The samples packed in the order given. ValueError for no samples."""
        if not samples:
            raise ValueError("a batch needs at least one sample")
        lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.long)
        cu_seqlens = torch.zeros(len(samples) + 1, dtype=torch.long)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        return cls(
            tokens=torch.cat([s.tokens for s in samples]),
            cu_seqlens=cu_seqlens,
            prompt_lengths=tuple(s.prompt_length for s in samples),
            response_lengths=tuple(s.response_length for s in samples),
            rollout_ids=tuple(s.rollout_id for s in samples),
            group_indices=tuple(s.group_index for s in samples),
            loss_mask=torch.cat([s.loss_mask for s in samples]),
            rollout_log_probs=torch.cat([s.rollout_log_probs for s in samples]),
            advantages=torch.cat([torch.full((s.response_length,), s.advantage) for s in samples]),
            token_weights=torch.cat([s.loss_mask * s.token_weight for s in samples]),
        )

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def num_response_tokens(self) -> int:
        return self.loss_mask.numel()

    def with_log_probs(self, *, old: Tensor | None = None, ref: Tensor | None = None) -> TrainBatch:
        """A copy with ``old_log_probs`` and/or ``ref_log_probs`` set (detached: they are
        targets, not parameters). ValueError unless each is ``[N]``."""
        for name, value in (("old_log_probs", old), ("ref_log_probs", ref)):
            if value is not None and tuple(value.shape) != (self.num_response_tokens,):
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, the batch has "
                    f"{self.num_response_tokens} response tokens"
                )
        return replace(
            self,
            old_log_probs=self.old_log_probs if old is None else old.detach(),
            ref_log_probs=self.ref_log_probs if ref is None else ref.detach(),
        )

    def padded(self, pad_id: int = 0) -> tuple[Tensor, Tensor]:
        """``(tokens, attention_mask)``, both ``[B, max length]``: each sample's tokens from
        position 0, right-padded with ``pad_id``; the mask is True on real tokens."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        width = max(lengths)
        tokens = torch.full((len(lengths), width), pad_id, dtype=self.tokens.dtype)
        mask = torch.zeros((len(lengths), width), dtype=torch.bool)
        for b, (start, n) in enumerate(zip(self.cu_seqlens[:-1].tolist(), lengths, strict=True)):
            tokens[b, :n] = self.tokens[start : start + n]
            mask[b, :n] = True
        return tokens, mask


def pack_micro_batches(
    samples: Sequence[TrainSample], max_tokens_per_micro_batch: int
) -> list[TrainBatch]:
    """Pack ``samples`` into micro-batches of at most ``max_tokens_per_micro_batch`` tokens
    (full sequences, prompt + response: what a forward pass costs), never splitting a sample.

    First-fit decreasing: longest sample first, each into the first micro-batch with room,
    which packs tighter than filling in order; ties keep the given order, so the result is
    deterministic. Inside a micro-batch samples keep the given order. A sample longer than the
    budget goes alone into its own micro-batch (dropping it would silently change the step's
    loss; bound sequence lengths upstream if memory cannot take it). Packing changes no loss
    value: token weights are fixed per step (see the module docstring).

    ValueError for a budget below 1 or no samples."""
    budget = max_tokens_per_micro_batch
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, not {budget}")
    if not samples:
        raise ValueError("nothing to pack")
    bins: list[list[int]] = []
    room: list[int] = []
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    for i in order:
        size = samples[i].num_tokens
        if size > budget:
            bins.append([i])
            room.append(0)
            continue
        for b, left in enumerate(room):
            if size <= left:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(budget - size)
    return [TrainBatch.from_samples([samples[i] for i in sorted(b)]) for b in bins]


# --------------------------------------------------------------------------- logits -> logprobs


@dataclass(frozen=True, eq=False)
class TokenStats:
    """Per response token: ``logprobs`` of the sampled token and the policy's ``entropy``
    (both ``[N]``, carrying the gradient of the logits they came from)."""

    logprobs: Tensor
    entropy: Tensor


def token_stats(
    logits: Tensor, tokens: Tensor, response_length: int, *, temperature: float = 1.0
) -> TokenStats:
    """One sample's response-token logprobs and entropies from its logits.

    ``logits`` ``[L, V]`` are the model's outputs at the ``L`` positions of ``tokens`` ``[L]``;
    the logits at position ``t`` predict token ``t + 1``, so response token ``j`` (at position
    ``P + j``, ``P = L - response_length``) is scored by the logits at ``P + j - 1``. Only
    those ``response_length`` rows are used (the prompt's are not scored, and the last row
    predicts past the end). Logits are divided by ``temperature`` first, to score tokens under
    the distribution the engine sampled from. Returns ``[response_length]`` tensors.

    ValueError: mismatched lengths, a response with no prompt token before it, or a bad
    temperature."""
    if logits.dim() != 2 or tokens.dim() != 1 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [L, V] for tokens {tuple(tokens.shape)} [L]"
        )
    length = tokens.shape[0]
    if not 0 <= response_length <= length:
        raise ValueError(f"response_length {response_length} is not within the {length} tokens")
    if response_length and response_length == length:
        raise ValueError("a response needs at least one prompt token before it")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, not {temperature}")
    # Low-precision logits (bf16) are scored in float32; float64 stays float64.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if response_length == 0:
        empty = logits.new_zeros(0, dtype=dtype)
        return TokenStats(empty, empty)
    prompt = length - response_length
    # Slice before log_softmax: only R of the L rows are needed, and [R, V] is the big tensor.
    rows = logits[prompt - 1 : length - 1].to(dtype) / temperature
    logp = torch.log_softmax(rows, dim=-1)
    # The batch's tokens live on the CPU; the logits wherever the model runs.
    targets = tokens[prompt:].to(logp.device)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Clamped so a token that logits of -inf rule out adds 0 * finite, not 0 * -inf = nan.
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(dtype).min)).sum(-1)
    return TokenStats(picked, entropy)


def token_logprobs(
    logits: Tensor, tokens: Tensor, response_length: int, *, temperature: float = 1.0
) -> Tensor:
    """The response tokens' logprobs, ``[response_length]``: :func:`token_stats` without the
    entropy."""
    return token_stats(logits, tokens, response_length, temperature=temperature).logprobs


def batch_token_stats(logits: Tensor, batch: TrainBatch, *, temperature: float = 1.0) -> TokenStats:
    """:func:`token_stats` for every sample of ``batch``, concatenated: ``[N]``, aligned with
    the batch's per-token tensors. ``logits`` are packed ``[T, V]`` (as ``batch.tokens``) or
    padded ``[B, max length, V]`` (as :meth:`TrainBatch.padded`). ValueError on other shapes."""
    starts = batch.cu_seqlens[:-1].tolist()
    ends = batch.cu_seqlens[1:].tolist()
    if logits.dim() == 2 and logits.shape[0] == batch.num_tokens:
        per_sample = [logits[s:e] for s, e in zip(starts, ends, strict=True)]
    elif logits.dim() == 3 and logits.shape[0] == batch.num_samples:
        width = max(e - s for s, e in zip(starts, ends, strict=True))
        if logits.shape[1] < width:
            raise ValueError(f"padded logits {tuple(logits.shape)} are shorter than {width}")
        per_sample = [logits[b, : e - s] for b, (s, e) in enumerate(zip(starts, ends, strict=True))]
    else:
        raise ValueError(
            f"logits {tuple(logits.shape)} are neither [{batch.num_tokens}, V] nor "
            f"[{batch.num_samples}, L, V]"
        )
    stats = [
        token_stats(rows, batch.tokens[s:e], r, temperature=temperature)
        for rows, s, e, r in zip(per_sample, starts, ends, batch.response_lengths, strict=True)
    ]
    return TokenStats(
        torch.cat([st.logprobs for st in stats]), torch.cat([st.entropy for st in stats])
    )
