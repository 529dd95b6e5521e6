"""Start and stop megatron-core's parallel state, on a CPU (gloo) or on CUDA GPUs (NCCL).

Everything corral does to make megatron-core run without a GPU lives here, so that the rest of
the trainer is the same code on both::

    from corral.trainer import megatron_runtime

    runtime = megatron_runtime.setup("cpu")  # or "cuda"; idempotent
    ...  # build a GPTModel, train
    megatron_runtime.teardown()

or ``with megatron_runtime.runtime("cpu") as rt: ...``.

``setup`` brings up ``torch.distributed`` (unless the caller already has: then that group is
used and left alone), then megatron's model-parallel groups (``initialize_model_parallel``).
Which world it joins:

- started by ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the
  environment; ``LOCAL_RANK`` picks the GPU): that world, rendezvous ``env://``;
- ``setup(..., world_size=N, rank=R, init_method=URL)``: that world (``init_method`` e.g.
  ``"tcp://127.0.0.1:PORT"`` or ``"file:///shared/path"``; default ``"env://"``);
- neither: a world of one, rendezvous through a file store in a private temporary folder: no
  port to pick, so no race for one.

Layout: ``tensor_parallel_size`` (TP) ranks split each layer's tensors; the world is
``TP x PP x DP`` with data parallel size ``DP = world / (TP x PP)``; megatron orders ranks
tensor-parallel first, so ranks ``0..TP-1`` are one tensor-parallel group (on one host under
``torchrun``, which is where NVLink is). ``corral.trainer.parallel`` has the collectives the
trainer needs on top (gradient reduction, the global gradient norm, sharing python objects).

On ``"cuda"`` nothing is patched: NCCL, ``torch.cuda.set_device(LOCAL_RANK)`` (``LOCAL_RANK``
from the environment, else ``rank % device_count``) and megatron's own
``model_parallel_cuda_manual_seed``. CUDA's current device is per *thread*, and megatron
allocates on ``torch.cuda.current_device()`` (its logits gather, its buffers), as do
``torch.distributed``'s object collectives: a trainer that runs in a worker thread (e.g.
``asyncio.to_thread``) would be on ``cuda:0`` there. ``on_device`` (a decorator; the trainer's
entry points in ``model``, ``convert``, ``step`` and ``parallel`` wear it) makes the runtime's
device current for the call; on CPU it does nothing.

On ``"cpu"`` (megatron-core 0.16) two things assume CUDA on the dense GPT path, and ``setup``
redirects exactly those, for megatron only, until ``teardown``:

1. ``torch.cuda.current_device()`` is called as a device argument in a few megatron modules
   (``_CURRENT_DEVICE_USERS``): the rotary embedding moves its frequencies there on the first
   forward, the global memory buffer (the attention scores' scratch tensor) is allocated
   there, and under tensor parallelism the all-gather of the logits' vocabulary shards
   (``tensor_parallel.mappings``) allocates its output there. On a CPU-only torch the call
   raises. ``setup`` rebinds the name ``torch`` *in those modules only* to a transparent view
   of torch whose ``cuda.current_device()`` answers ``torch.device("cpu")``; every other
   attribute is torch's own. torch itself, and every other module (transformers, the local
   engine, the caller), still see the real ``torch.cuda``.
2. The RNG tracker (``tensor_parallel.get_cuda_rng_tracker()``) keeps named CUDA generator states
   and swaps them in ``fork()``, which every attention forward enters (for dropout). ``setup``
   installs, through the tracker slot megatron reads (``tensor_parallel.random``'s module
   state), a subclass of megatron's tracker that keeps the same named streams (seeded as
   megatron seeds them, per tensor-parallel rank) as CPU generator states and swaps the CPU
   generator in ``fork()``.

Also on ``"cpu"``: megatron is asked not to create its extra gloo copies of the data-parallel
groups (``create_gloo_process_groups=False``): the default backend already is gloo there, and
each group is one more rendezvous at start-up.

Not covered on CPU (each would need CUDA anyway): megatron's fused kernels, activation
recompute (``CheckpointFunction`` saves CUDA RNG states), the inference/KV-cache paths,
megatron's ``DistributedDataParallel`` and distributed optimizer (use ``torch.optim`` on the
unwrapped model; ``corral.trainer.parallel`` reduces the gradients), sequence parallelism.
The model must be built with ``use_cpu_initialization=True`` and called with an explicit
attention mask (megatron's default causal mask is built with ``device="cuda"``);
``corral.trainer.model`` does both.

Waiting is not computing. A rank that waits for the leader's next command (while the leader
plays a step's rollouts or evaluates, which can take hours with agentic tasks) waits on
:func:`command_group`, a gloo group with a timeout of :data:`COMMAND_WAIT_S`; the training
collectives keep ``collective_timeout_s``: the default group's timeout, and megatron's groups'
rounded up to whole minutes (None: the defaults, torch's for the default group, 10 minutes
under NCCL and 30 under gloo, and megatron's 30 minutes for its groups), so a hung all-reduce
still fails in minutes while a long rollout phase does not end the world.

Nothing is patched at import time, and importing this module does not import megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, Literal, ParamSpec, TypeVar

import torch

__all__ = [
    "Device",
    "Runtime",
    "current",
    "device_scope",
    "on_device",
    "runtime",
    "setup",
    "teardown",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")

Device = Literal["cpu", "cuda"]

# The megatron modules whose torch.cuda.current_device() calls the dense GPT training path
# reaches (found by running forward, backward and an AdamW step on a CPU-only torch, dropping
# modules from a longer list until it failed): the rotary embedding's frequencies and the global
# memory buffer. Another module joins this list when a CPU test trips over it.
_CURRENT_DEVICE_USERS: Final = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
    # tensor parallel: gathering the logits' vocabulary shards (parallel_output=False)
    "megatron.core.tensor_parallel.mappings",
)
_RNG_MODULE: Final = "megatron.core.tensor_parallel.random"
# How long a rank may wait for the leader's next command (command_group). A dead leader ends
# a torchrun world anyway (its agent stops every rank), so this only has to outlast the
# longest rollout phase.
COMMAND_WAIT_S: Final = 24 * 3600.0
# megatron's seed arithmetic in model_parallel_cuda_manual_seed, so that a CPU run draws dropout
# masks from streams seeded the way a GPU run's are.
_TP_SEED_OFFSET: Final = 2718
_EXPERT_SEED_OFFSET: Final = 1024


@dataclass(frozen=True)
class Runtime:
    """What ``setup`` brought up: the device models go on and the parallel layout.

    ``rank`` / ``world_size`` are the global ones; ``tensor_parallel_rank`` and
    ``data_parallel_rank`` this process's place in its tensor- and data-parallel groups
    (``data_parallel_size = world_size / (tensor_parallel_size x pipeline_parallel_size)``)."""

    device: torch.device
    backend: str
    world_size: int
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    seed: int
    data_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    data_parallel_rank: int = 0

    @property
    def is_writer(self) -> bool:
        """True on the one rank that writes shared outputs (files, logs): tensor-parallel rank
        0 of data-parallel rank 0 (global rank 0 under megatron's rank order)."""
        return self.tensor_parallel_rank == 0 and self.data_parallel_rank == 0


@dataclass
class _State:
    """What a ``setup`` started, so that ``teardown`` (or a failed ``setup``) can undo it."""

    runtime: Runtime | None = None
    owns_process_group: bool = False
    owns_model_parallel: bool = False
    store_dir: Path | None = None
    # (module, its original ``torch`` global), restored by teardown
    rebound: list[tuple[types.ModuleType, Any]] = field(default_factory=list)
    # megatron's RNG tracker slot (tracker, initialised flag) before setup replaced it
    rng_saved: tuple[Any, Any] | None = None
    command_group: Any = None  # a world of several ranks: the gloo group commands travel on
    collective_timeout_s: float | None = None  # as setup was given it


_state: _State | None = None


def current() -> Runtime | None:
    """The live runtime, or None before ``setup`` / after ``teardown``."""
    return _state.runtime if _state else None


def setup(
    device: Device = "cpu",
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    world_size: int | None = None,
    rank: int | None = None,
    init_method: str | None = None,
    collective_timeout_s: float | None = None,
) -> Runtime:
    """Bring up torch.distributed and megatron's parallel groups for ``device``; idempotent.

    The world: the caller's process group if one is up; else ``world_size`` / ``rank`` /
    ``init_method`` when given (all ranks call ``setup`` with the same ``world_size`` and
    ``init_method``); else torchrun's environment; else a world of one (module docstring).
    Every rank of the world must call ``setup`` with the same layout: megatron's group
    creation is collective. ``collective_timeout_s``: how long a collective of the process
    group may wait, and one of megatron's groups the same rounded up to whole minutes (None:
    torch's and megatron's defaults); waiting for a command is :func:`command_group`'s
    (module docstring). It is part of the layout a second ``setup`` must repeat.

    A second call with the same arguments returns the same ``Runtime``; with different ones it
    raises ``RuntimeError`` (call ``teardown`` first). ``device="cuda"`` without a GPU raises
    ``RuntimeError``; a parallel layout that does not fit the world size (or megatron groups the
    caller initialised differently) raises ``ValueError``. On any failure, what this call
    started is undone before the exception propagates.
    """
    global _state
    wanted = (device, tensor_parallel_size, pipeline_parallel_size, seed, collective_timeout_s)
    if _state is not None:
        rt = _state.runtime
        assert rt is not None  # set before _state is published
        have = (
            rt.device.type,
            rt.tensor_parallel_size,
            rt.pipeline_parallel_size,
            rt.seed,
            _state.collective_timeout_s,
        )
        if have != wanted:
            raise RuntimeError(
                f"megatron is already set up as {rt}; call teardown() before setup{wanted}"
            )
        return rt
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("setup('cuda'): torch sees no CUDA device (use setup('cpu'))")
    if (world_size is None) != (rank is None):
        raise ValueError("world_size and rank go together")
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")

    state = _State(collective_timeout_s=collective_timeout_s)
    try:
        timeout = None if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
        torch_device = _init_process_group(device, state, world_size, rank, init_method, timeout)
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if world > 1:  # collective: every rank creates it, in the same order
            state.command_group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=COMMAND_WAIT_S)
            )
        if world % (tensor_parallel_size * pipeline_parallel_size):
            raise ValueError(
                f"world size {world} is not divisible by tensor parallel {tensor_parallel_size}"
                f" x pipeline parallel {pipeline_parallel_size}"
            )
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            minutes = {}
            if collective_timeout_s is not None:
                whole = max(1, math.ceil(collective_timeout_s / 60))
                minutes["distributed_timeout_minutes"] = whole
            parallel_state.initialize_model_parallel(
                tensor_parallel_size,
                pipeline_parallel_size,
                # gloo is the default backend on CPU: its gloo copies would be duplicates
                create_gloo_process_groups=device == "cuda",
                **minutes,
            )
            state.owns_model_parallel = True
        elif (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        ) != (tensor_parallel_size, pipeline_parallel_size):
            raise ValueError("megatron's parallel groups are already up with another layout")
        if device == "cpu":
            state.rebound = _rebind_current_device()
            state.rng_saved = _install_cpu_rng_tracker(
                seed, parallel_state.get_tensor_model_parallel_rank()
            )
        else:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    except BaseException:
        _undo(state)
        raise
    state.runtime = Runtime(
        device=torch_device,
        backend=str(torch.distributed.get_backend()),
        world_size=world,
        rank=rank,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        seed=seed,
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
    )
    _state = state
    return state.runtime


def teardown() -> None:
    """Undo ``setup``: the CPU redirections, and megatron's groups and the process group where
    ``setup`` created them (a caller's own are left up). A no-op when nothing is set up."""
    global _state
    if _state is None:
        return
    state, _state = _state, None
    _undo(state)


def command_group() -> Any | None:
    """The gloo group the leader's commands travel on (module docstring); None in a world of
    one or before ``setup``."""
    return _state.command_group if _state is not None else None


def device_scope() -> contextlib.AbstractContextManager[Any]:
    """A ``with`` in which the runtime's CUDA device is this thread's current device (module
    docstring); does nothing on CPU or before ``setup``."""
    rt = current()
    if rt is None or rt.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(rt.device)


def on_device(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator: run ``fn`` inside ``device_scope()``."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with device_scope():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def runtime(
    device: Device = "cpu",
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    world_size: int | None = None,
    rank: int | None = None,
    init_method: str | None = None,
    collective_timeout_s: float | None = None,
) -> Iterator[Runtime]:
    """``setup`` for the body of a ``with``; ``teardown`` after it, unless it was already set
    up before the ``with`` (then it is left as it was)."""
    was_up = _state is not None
    rt = setup(
        device,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        seed=seed,
        world_size=world_size,
        rank=rank,
        init_method=init_method,
        collective_timeout_s=collective_timeout_s,
    )
    try:
        yield rt
    finally:
        if not was_up:
            teardown()


# ---------------------------------------------------------------------------------------------
# Process group


def _init_process_group(
    device: Device,
    state: _State,
    world_size: int | None,
    rank: int | None,
    init_method: str | None,
    timeout: timedelta | None,
) -> torch.device:
    """Start the default process group if none is up; returns the device models go on."""
    dist = torch.distributed
    if device == "cuda":
        # One process per GPU: torchrun's LOCAL_RANK, else the global rank on this host.
        if "LOCAL_RANK" in os.environ:
            local_rank = int(os.environ["LOCAL_RANK"])
        else:
            known = dist.get_rank() if dist.is_initialized() else rank
            local_rank = (known or 0) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    if dist.is_initialized():
        return torch_device
    backend = "nccl" if device == "cuda" else "gloo"
    if world_size is not None and rank is not None:
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
    elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        state.store_dir = Path(tempfile.mkdtemp(prefix="corral-megatron-"))
        store = dist.FileStore(str(state.store_dir / "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    state.owns_process_group = True
    return torch_device


def _undo(state: _State) -> None:
    """Tear down whatever of ``state`` is up, in reverse order of ``setup``."""
    if state.rng_saved is not None:
        random_module: Any = sys.modules[_RNG_MODULE]
        tracker, initialized = state.rng_saved
        random_module._CUDA_RNG_STATE_TRACKER = tracker
        random_module._CUDA_RNG_STATE_TRACKER_INITIALIZED = initialized
        state.rng_saved = None
    for module, original in reversed(state.rebound):
        module.torch = original
    state.rebound = []
    if state.owns_model_parallel:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        state.owns_model_parallel = False
    if state.command_group is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group(state.command_group)
    state.command_group = None
    if state.owns_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    state.owns_process_group = False
    if state.store_dir is not None:
        shutil.rmtree(state.store_dir, ignore_errors=True)
        state.store_dir = None


# ---------------------------------------------------------------------------------------------
# CPU redirections


class _CudaOnCpu:
    """``torch.cuda`` as the rebound megatron modules see it: ``current_device()`` is the CPU;
    every other attribute is the real ``torch.cuda``'s."""

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as the rebound megatron modules see it: the real module but for ``cuda``."""

    cuda: Final = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch, with cuda.current_device() -> cpu, for megatron on CPU>"


_TORCH_ON_CPU: Final = _TorchOnCpu()


def _rebind_current_device() -> list[tuple[types.ModuleType, Any]]:
    """Point the name ``torch`` in ``_CURRENT_DEVICE_USERS`` at ``_TORCH_ON_CPU``; returns what
    to restore. A module already rebound (a second setup in a row) is left as it is."""
    rebound = []
    for name in _CURRENT_DEVICE_USERS:
        module: Any = importlib.import_module(name)
        original = module.__dict__.get("torch")
        if original is _TORCH_ON_CPU:
            continue
        if original is not torch:
            raise RuntimeError(
                f"{name}.torch is {original!r}, not the torch module: megatron changed; "
                "revisit corral.trainer.megatron_runtime"
            )
        module.torch = _TORCH_ON_CPU
        rebound.append((module, original))
    return rebound


def _install_cpu_rng_tracker(seed: int, tp_rank: int) -> tuple[Any, Any]:
    """Put a CPU tracker, seeded as megatron seeds its CUDA one at tensor-parallel rank
    ``tp_rank`` (expert parallel rank 0), into megatron's tracker slot; returns the slot's
    previous content."""
    random_module: Any = importlib.import_module(_RNG_MODULE)
    saved = (
        random_module._CUDA_RNG_STATE_TRACKER,
        random_module._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    tracker = _cpu_tracker_class()()
    tracker.add(random_module._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random_module._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(
        random_module._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_SEED_OFFSET + tp_rank
    )
    random_module._CUDA_RNG_STATE_TRACKER = tracker
    random_module._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return saved


@functools.cache
def _cpu_tracker_class() -> type:
    """megatron's ``CudaRNGStatesTracker`` with CPU generator states (a subclass, so that
    megatron's ``isinstance`` checks on the tracker still hold). Built on first use so that
    importing this module does not import megatron."""
    from megatron.core.tensor_parallel.random import (
        _MODEL_PARALLEL_RNG_TRACKER_NAME,
        CudaRNGStatesTracker,
    )

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Named RNG streams as CPU generator states; ``fork(name)`` runs its body on one."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} is not tracked")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker
