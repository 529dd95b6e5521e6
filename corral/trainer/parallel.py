"""The collectives the trainer runs on top of megatron's parallel groups: the same code on CPU
(gloo) and GPU (NCCL), and no-ops at world size 1.

Layout (set up by :func:`corral.trainer.megatron_runtime.setup`): ``TP`` tensor-parallel ranks hold
the shards of one model replica and see the same micro-batches; ``DP`` data-parallel replicas
each train on their share of a step's micro-batches. What a training step needs beyond
megatron's own layers:

- :func:`broadcast_objects`: rank 0's python objects (a step's groups) on every rank;
  :func:`broadcast_command` the same on the channel a rank may wait on for hours;
- :func:`data_parallel_share`: which of the step's micro-batches this replica trains on;
- :func:`finish_gradients`: after the backward passes, the gradients every rank would have
  after one backward over the whole step: replicated parameters that each tensor-parallel rank
  only saw part of (Qwen3's per-head ``q_layernorm`` / ``k_layernorm``: each rank applies them
  to its own heads) summed over the tensor-parallel group, as megatron's
  ``finalize_model_grads`` does, then every gradient summed over the data-parallel group;
- :func:`clip_grad_norm`: the global gradient norm (sharded parameters' squares summed over the
  tensor-parallel group, replicated ones counted once) and clipping by it;
- :func:`sum_over_data_parallel`: per-replica metric contributions summed.

Summing (not averaging) over data parallel is right because the policy loss is normalised per
step over the *whole* step's rollouts (``corral.trainer.batches``: each token's weight
``1 / (n_r * R)`` is fixed when the samples are built, and every rank builds them from all the
step's groups), so a replica's loss is its micro-batches' share of the step loss and the sum of
the replicas' gradients is the full-step gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

import torch

from corral.trainer.megatron_runtime import on_device

__all__ = [
    "barrier",
    "broadcast_command",
    "broadcast_objects",
    "clip_grad_norm",
    "data_parallel_rank",
    "data_parallel_share",
    "data_parallel_size",
    "finish_gradients",
    "pipeline_parallel_size",
    "sum_over_data_parallel",
    "tensor_parallel_rank",
]

T = TypeVar("T")

# Gradients are all-reduced in flat buckets of at most this many bytes (one collective per
# bucket instead of one per tensor, without a second full copy of every gradient at once).
_BUCKET_BYTES: Final = 256 * 1024 * 1024
# Replicated parameters whose gradients are partial per tensor-parallel rank (megatron's
# finalize_model_grads sums the same names when config.qk_layernorm).
_TP_PARTIAL_GRAD_NAMES: Final = ("q_layernorm", "k_layernorm")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _groups() -> tuple[Any, Any] | None:
    """(tensor-parallel group, data-parallel group), or None when megatron's are not up."""
    from megatron.core import parallel_state

    if not _distributed() or not parallel_state.model_parallel_is_initialized():
        return None
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group(),
    )


def tensor_parallel_rank() -> int:
    """This rank's place in its tensor-parallel group (0 without megatron's groups)."""
    groups = _groups()
    return 0 if groups is None else torch.distributed.get_rank(groups[0])


def data_parallel_rank() -> int:
    """This rank's data-parallel replica (0 without megatron's groups)."""
    groups = _groups()
    return 0 if groups is None else torch.distributed.get_rank(groups[1])


def data_parallel_size() -> int:
    """The number of data-parallel replicas (1 without megatron's groups)."""
    groups = _groups()
    return 1 if groups is None else torch.distributed.get_world_size(groups[1])


def pipeline_parallel_size() -> int:
    """The number of pipeline stages (1 without megatron's groups)."""
    from megatron.core import parallel_state

    if not _distributed() or not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_pipeline_model_parallel_world_size())


@on_device
def broadcast_objects(obj: T, *, group: Any = None) -> T:
    """``obj`` as global rank 0 has it, on every rank of ``group`` (default: the world's
    process group) (picklable python objects; every rank calls this, the others' ``obj`` is
    ignored: pass None). Identity without a process group."""
    if not _distributed() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    # With NCCL the pickled bytes travel through the current CUDA device (setup set it).
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]


def broadcast_command(obj: T) -> T:
    """:func:`broadcast_objects` for what a rank may wait long for (the leader's next command,
    sent after a rollout phase of any length): over ``megatron_runtime.command_group``, gloo with a
    day's timeout, not the training collectives' group and timeout."""
    from corral.trainer import megatron_runtime

    return broadcast_objects(obj, group=megatron_runtime.command_group())


@on_device
def barrier() -> None:
    """Wait for every rank of the world (no-op without a process group). With NCCL, on this
    process's CUDA device (``setup`` set it), which NCCL would otherwise have to guess."""
    if not _distributed() or torch.distributed.get_world_size() == 1:
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    else:
        torch.distributed.barrier()


def data_parallel_share(
    costs: Sequence[float], size: int | None = None, rank: int | None = None
) -> list[int]:
    """The indices (ascending) of the items this data-parallel rank takes out of items of
    ``costs`` (a micro-batch's token count), balanced by cost: largest first, each to the rank
    with the least cost so far, ties to the lower rank. Deterministic: every rank computes the
    same split from the same costs. ``size`` / ``rank`` default to the running layout's.
    A rank can get nothing when there are fewer items than ranks."""
    size = data_parallel_size() if size is None else size
    rank = data_parallel_rank() if rank is None else rank
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a data-parallel world of {size}")
    loads = [0.0] * size
    mine = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(size), key=lambda r: (loads[r], r))
        loads[target] += costs[i]
        if target == rank:
            mine.append(i)
    return sorted(mine)


def _all_reduce_sum(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` in place over ``group``: flattened into buckets of one dtype and device,
    one collective per bucket."""
    if not tensors or torch.distributed.get_world_size(group) == 1:
        return
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], list[int]]] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        bucket, used = open_bucket.get(key, ([], [0]))
        if bucket and used[0] + nbytes > _BUCKET_BYTES:
            bucket, used = [], [0]
        if not bucket:
            buckets.append(bucket)
            open_bucket[key] = (bucket, used)
        bucket.append(t)
        used[0] += nbytes
    for bucket in buckets:
        flat = torch._utils._flatten_dense_tensors(bucket)
        torch.distributed.all_reduce(flat, group=group)
        for dst, src in zip(
            bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
        ):
            dst.copy_(src)


@on_device
def finish_gradients(model: torch.nn.Module) -> None:
    """After a step's backward passes on this rank's micro-batches: make every rank's
    gradients the full step's (module docstring). Every rank calls this. Under data
    parallelism a parameter without a gradient (a replica that got no micro-batch) gets a zero
    one, so that every replica reduces the same tensors."""
    groups = _groups()
    if groups is None:
        return
    tp_group, dp_group = groups
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if torch.distributed.get_world_size(tp_group) > 1:
        partial = [
            p.grad
            for n, p in named
            if p.grad is not None and any(part in n for part in _TP_PARTIAL_GRAD_NAMES)
        ]
        _all_reduce_sum(partial, tp_group)
    if torch.distributed.get_world_size(dp_group) > 1:
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _all_reduce_sum([p.grad for _, p in named if p.grad is not None], dp_group)


@on_device
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of ``parameters`` so that their global L2 norm is at most
    ``max_norm`` (``math.inf``: never); returns the norm before clipping, the same on every
    rank. The norm is the whole model's: a tensor-parallel shard's squares are summed over the
    tensor-parallel group, a replicated parameter (layer norms) is counted once (megatron's
    ``param_is_not_tensor_parallel_duplicate``). Call after :func:`finish_gradients` (data
    parallel replicas then hold the same gradients). The arithmetic is
    ``torch.nn.utils.clip_grad_norm_``'s (norm computed in float32 or wider, coefficient
    ``max_norm / (norm + 1e-6)`` capped at 1)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]  # (for the type checker)
    groups = _groups()
    tp_group = groups[0] if groups is not None else None
    tp_rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    device = params[0].device if params else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float64, device=device)
    for p, g in zip(params, grads, strict=True):
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            norm = torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
            square += norm.to(torch.float64) ** 2
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(square, group=tp_group)
    total = float(square.sqrt())
    if grads and math.isfinite(max_norm):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return total


@on_device
def sum_over_data_parallel(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` summed key by key over the data-parallel group (a key missing on a replica,
    e.g. one that trained no micro-batch, counts 0), in rank order so every rank gets the same
    floats. A copy of ``values`` without data parallelism."""
    groups = _groups()
    if groups is None or torch.distributed.get_world_size(groups[1]) == 1:
        return dict(values)
    gathered: list[Any] = [None] * torch.distributed.get_world_size(groups[1])
    torch.distributed.all_gather_object(gathered, dict(values), group=groups[1])
    keys = list(dict.fromkeys(k for part in gathered for k in part))
    return {k: math.fsum(float(part.get(k, 0.0)) for part in gathered) for k in keys}
