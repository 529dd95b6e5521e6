"""A world of two gloo processes on CPU: a follower waits for the leader's next command longer
than the training collectives' timeout allows (the leader's rollout phase), on the command
channel, while the same wait on the training group times out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")

from corral.trainer import megatron_runtime, parallel  # noqa: E402
from tests.worlds import spawn_world  # noqa: E402

WORLD = 2
# The training collectives' timeout; it also bounds the start-up rendezvous, so it leaves room
# for one process importing torch and megatron slower than the other on a loaded machine.
TIMEOUT_S = 8.0
LEADER_BUSY_S = 20.0  # the leader's "rollout phase": over twice the timeout
SPAWN_TIMEOUT_S = 120


def _worker(rank: int, folder: Path) -> None:
    torch.set_num_threads(1)
    megatron_runtime.setup(
        "cpu",
        world_size=WORLD,
        rank=rank,
        init_method=f"file://{folder / 'rendezvous'}",
        collective_timeout_s=TIMEOUT_S,
    )
    # Both ranks start the clock together (on the command channel: no timeout to race).
    torch.distributed.barrier(group=megatron_runtime.command_group())
    result: dict[str, object] = {}
    if rank == 0:
        time.sleep(LEADER_BUSY_S)
        parallel.broadcast_command({"kind": "train", "step": 7})
    else:
        began = time.monotonic()
        try:  # on the training group: the collectives' timeout ends the wait
            parallel.broadcast_objects(None)
            result["training_group"] = "answered"
        except RuntimeError:
            result["training_group"] = "timed out"
        result["timed_out_after_s"] = time.monotonic() - began
        result["command"] = parallel.broadcast_command(None)
        result["waited_s"] = time.monotonic() - began
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    megatron_runtime.teardown()


def test_a_follower_outwaits_the_collective_timeout_on_the_command_channel(
    tmp_path: Path,
) -> None:
    spawn_world(_worker, (tmp_path,), WORLD, SPAWN_TIMEOUT_S)
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert follower["training_group"] == "timed out"
    assert follower["timed_out_after_s"] < LEADER_BUSY_S
    assert follower["command"] == {"kind": "train", "step": 7}
    assert follower["waited_s"] >= LEADER_BUSY_S - 1.0  # it really waited out the leader
    assert follower["timed_out_after_s"] >= TIMEOUT_S - 1.0
