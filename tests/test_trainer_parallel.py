"""Tensor and data parallelism on CPU: two gloo processes against one.

One spawned pair of processes (module fixture ``parallel_run``) runs, per model, with tensor
parallel 2 (a world joined the way torchrun's environment says): the logits, the HF round
trip, a saved folder and one policy update; then, after a teardown, the same policy update with
data parallel 2 (a world given explicitly, file rendezvous), and one with a single micro-batch
(the second replica trains on nothing). Each writes what it got; the tests compare it with the
same work in this process at world size 1 and with transformers. About 20-35 s on 2 cores,
most of it the two processes importing torch and megatron.

The models: Qwen3 (QK-norm: replicated parameters whose gradients are partial per TP rank;
untied output layer) with a vocabulary of 97, which TP 2 pads, and Qwen2 (Q/K/V biases, tied
embeddings). The update uses SGD so that the new weights are the gradients, clipping included;
updates must agree to 1e-5 of their size plus a few float32 roundings of the weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install megatron-core"
)

from corral.trainer import megatron_runtime, parallel  # noqa: E402
from corral.trainer.convert import (  # noqa: E402
    hf_to_megatron,
    load_hf_checkpoint,
    megatron_state_dict,
    megatron_to_hf,
    merge_megatron_shards,
    read_hf_state_dict,
    save_hf_checkpoint,
    shard_megatron_state,
)
from corral.trainer.groups import Group, group_samples  # noqa: E402
from corral.trainer.losses import LossConfig  # noqa: E402
from corral.trainer.model import (  # noqa: E402
    ModelSpec,
    UnsupportedModelError,
    check_tensor_parallel,
    forward_logits,
)
from corral.trainer.step import UpdateSettings, policy_update  # noqa: E402
from tests.factories import make_sample  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.worlds import TORCHRUN_VARS, join_as_torchrun, spawn_world  # noqa: E402

WORLD = 2
SPAWN_TIMEOUT_S = 240
VOCAB = 97  # odd: tensor parallel 2 pads it to 98
_SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
MODELS: dict[str, Callable[[], Any]] = {
    "qwen3": lambda: transformers.Qwen3Config(
        **_SMALL,
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **_SMALL,
        vocab_size=VOCAB + 1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
SETTINGS = UpdateSettings(
    loss=LossConfig(entropy_coef=0.01),
    max_tokens_per_micro_batch=40,
    max_grad_norm=0.05,  # below the step's norm: the clipping is exercised
)
# One group in one micro-batch: with data parallel 2 the second replica trains on nothing.
ONE_BATCH = replace(SETTINGS, max_tokens_per_micro_batch=1000)
LR = 20.0  # large, so the weights' float32 rounding is small next to the update
# float32: the TP ranks sum partial matmuls (row-parallel layers) and DP ranks partial
# gradients in another order than one process does.
LOGITS_ATOL = 1e-5
RTOL = 1e-5


def _write_model(folder: Path, name: str, seed: int = 0) -> Path:
    """A random transformers model, every parameter random (norms around 1, biases nonzero),
    saved to ``folder``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in pname else 0.1 * noise)
    model.save_pretrained(folder)
    return folder


def _ids(seed: int = 1) -> Any:
    return torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(seed))


def _groups() -> list[Group]:
    """Two groups: rollout a in two samples (so across micro-batches), a rollout with masked
    (observation) tokens, uneven lengths; 7 samples, several micro-batches of at most 40."""
    rng = torch.Generator().manual_seed(7)

    def sample(rid: str, group: int, reward: float, prompt: int, response: int, **kw: Any) -> Any:
        tokens = torch.randint(0, VOCAB, (prompt + response,), generator=rng).tolist()
        logps = (-4.6 + 0.3 * torch.randn(response, generator=rng)).tolist()
        return make_sample(
            rid,
            group,
            reward,
            prompt=tokens[:prompt],
            response=tokens[prompt:],
            loss_mask=kw.get("mask"),
            log_probs=logps,
        )

    return group_samples(
        [
            sample("a", 0, 1.0, 6, 9),
            sample("a", 0, 1.0, 17, 12),
            sample("b", 0, 0.0, 5, 14),
            sample("c", 0, 0.5, 8, 6),
            sample("d", 1, 1.0, 4, 20, mask=[1] * 8 + [0] * 4 + [1] * 8),
            sample("e", 1, 0.0, 9, 7),
            sample("f", 1, 0.0, 3, 3),
        ]
    )


def _train(
    model: Any, groups: list[Group], settings: UpdateSettings = SETTINGS
) -> dict[str, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return policy_update(model, optimizer, groups, settings)


# ---------------------------------------------------------------------------------------------
# The two processes


def _worker(rank: int, folder: Path, port: int) -> None:
    torch.set_num_threads(1)
    out = folder / f"rank{rank}"
    out.mkdir()
    # Phase 1, tensor parallel 2: the world from the environment, as torchrun sets it.
    join_as_torchrun(rank, WORLD, port)
    rt = megatron_runtime.setup("cpu", tensor_parallel_size=2)
    assert (rt.world_size, rt.tensor_parallel_rank, rt.data_parallel_size) == (2, rank, 1)
    groups = parallel.broadcast_objects(_groups() if rank == 0 else None)
    results: dict[str, Any] = {"tp_metrics": {}, "tp_weights": {}, "tp_partition": {}}
    for name in MODELS:
        model, spec = load_hf_checkpoint(folder / name)
        # Our split rules agree with the partition megatron declares on its parameters.
        results["tp_partition"][name] = {
            n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
            for n, p in model.named_parameters()
        }
        with torch.no_grad():
            results[f"tp_logits_{name}"] = forward_logits(model.eval(), _ids())
        results[f"tp_round_trip_{name}"] = megatron_to_hf(megatron_state_dict(model), spec)
        saved = save_hf_checkpoint(model, spec, folder / f"saved-{name}")
        assert (saved / "model.safetensors").is_file()  # written before any rank returns
        results["tp_metrics"][name] = _train(model, groups)
        results["tp_weights"][name] = megatron_to_hf(megatron_state_dict(model), spec)
    megatron_runtime.teardown()
    # Phase 2, data parallel 2: the world given explicitly, rendezvous through a file.
    for var in TORCHRUN_VARS:
        del os.environ[var]
    rt = megatron_runtime.setup(
        "cpu", world_size=WORLD, rank=rank, init_method=f"file://{folder / 'rendezvous'}"
    )
    assert (rt.tensor_parallel_size, rt.data_parallel_size, rt.data_parallel_rank) == (1, 2, rank)
    results["dp_metrics"], results["dp_weights"] = {}, {}
    for name in MODELS:
        model, spec = load_hf_checkpoint(folder / name)
        results["dp_metrics"][name] = _train(model, groups)
        results["dp_weights"][name] = megatron_to_hf(megatron_state_dict(model), spec)
    model, spec = load_hf_checkpoint(folder / "qwen3")
    results["dp_one_batch_metrics"] = _train(model, groups[:1], ONE_BATCH)
    results["dp_one_batch_weights"] = megatron_to_hf(megatron_state_dict(model), spec)
    megatron_runtime.teardown()
    torch.save(results, out / "results.pt")


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both ranks' results, and the world-1 reference computed here, by model name."""
    folder = tmp_path_factory.mktemp("parallel")
    for name in MODELS:
        _write_model(folder / name, name)
    spawn_world(_worker, (folder, free_port()), WORLD, SPAWN_TIMEOUT_S)
    ranks = [torch.load(folder / f"rank{r}" / "results.pt") for r in range(WORLD)]
    reference: dict[str, Any] = {}
    with megatron_runtime.runtime("cpu"):
        for name in MODELS:
            model, spec = load_hf_checkpoint(folder / name)
            with torch.no_grad():
                reference[f"logits_{name}"] = forward_logits(model.eval(), _ids())
            reference[f"metrics_{name}"] = _train(model, _groups())
            reference[f"weights_{name}"] = megatron_to_hf(megatron_state_dict(model), spec)
        model, spec = load_hf_checkpoint(folder / "qwen3")
        reference["one_batch_metrics"] = _train(model, _groups()[:1], ONE_BATCH)
        reference["one_batch_weights"] = megatron_to_hf(megatron_state_dict(model), spec)
    yield {"folder": folder, "ranks": ranks, "reference": reference}


def _assert_same_update(got: Any, want: Any, before: Any, what: str) -> None:
    """``got`` and ``want`` (weights after a step from ``before``) made the same update, within
    ``RTOL`` of the update's size plus a few float32 roundings of the weights themselves."""
    diff = float((got - want).abs().max())
    scale = float((want - before).abs().max())
    rounding = 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert scale > 0, f"{what} did not change"
    assert diff <= RTOL * scale + rounding, f"{what}: differs by {diff} (update {scale})"


# ---------------------------------------------------------------------------------------------
# (a) logits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tensor_parallel_logits_match_one_process_and_transformers(
    parallel_run: dict[str, Any], name: str
) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(parallel_run["folder"] / name)
    with torch.no_grad():
        theirs = hf_model.eval()(input_ids=_ids()).logits
    one = parallel_run["reference"][f"logits_{name}"]
    assert one.shape == theirs.shape == (2, 19, MODELS[name]().vocab_size)  # padding dropped
    assert theirs.abs().max() > 0.5
    for rank, result in enumerate(parallel_run["ranks"]):
        tp = result[f"tp_logits_{name}"]
        assert tp.shape == one.shape, rank
        assert float((tp - one).abs().max()) < LOGITS_ATOL, rank
        assert float((tp - theirs).abs().max()) < LOGITS_ATOL, rank


# ---------------------------------------------------------------------------------------------
# (b) weights in and out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tensor_parallel_round_trip_and_saved_folder_are_bit_exact(
    parallel_run: dict[str, Any], name: str
) -> None:
    folder = parallel_run["folder"]
    original = read_hf_state_dict(folder / name)
    saved = read_hf_state_dict(folder / f"saved-{name}")
    for got in [r[f"tp_round_trip_{name}"] for r in parallel_run["ranks"]] + [saved]:
        assert sorted(got) == sorted(original)
        for key, tensor in original.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert (folder / f"saved-{name}" / "config.json").is_file()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_rules_match_the_partition_megatron_declares(
    parallel_run: dict[str, Any], name: str
) -> None:
    declared = parallel_run["ranks"][0]["tp_partition"][name]
    expected_dim = {"vocab": 0, "rows": 0, "glu": 0, "columns": 1}
    from corral.trainer.convert import _split_of

    for param, (sharded, dim) in declared.items():
        split = _split_of(param)
        assert sharded == (split != "replicated"), param
        if sharded:
            assert dim == expected_dim[split], param


def test_shards_merge_back_bit_exact_for_several_sizes(tmp_path: Path) -> None:
    folder = _write_model(tmp_path / "qwen3", "qwen3")
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(folder))
    full = hf_to_megatron(read_hf_state_dict(folder), spec)
    for size in (1, 2):
        shards = [shard_megatron_state(full, r, size) for r in range(size)]
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == -(-VOCAB // size)
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        # rank 0 holds query group 0 whole: its 2 query heads, its key and value head
        assert shards[0][qkv].shape[0] == (4 + 2 * 2) * 16 // size
        fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
        gate, up = full[fc1].chunk(2)
        assert torch.equal(shards[-1][fc1][: 96 // size], gate[-(96 // size) :])
        assert torch.equal(shards[-1][fc1][96 // size :], up[-(96 // size) :])
        merged = merge_megatron_shards(shards, vocab_size=VOCAB)
        assert sorted(merged) == sorted(full)
        assert all(torch.equal(merged[k], full[k]) for k in full)


def test_models_that_do_not_split_are_refused() -> None:
    one_kv_head = ModelSpec.from_hf_config(
        transformers.Qwen2Config(**_SMALL, num_attention_heads=4, num_key_value_heads=1)
    )
    check_tensor_parallel(one_kv_head, 1)
    with pytest.raises(UnsupportedModelError, match="1 key/value heads do not split over"):
        check_tensor_parallel(one_kv_head, 2)


# ---------------------------------------------------------------------------------------------
# (c) one policy update


@pytest.mark.parametrize("layout", ["tp", "dp"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_parallel_update_gives_the_weights_and_metrics_of_one_process(
    parallel_run: dict[str, Any], name: str, layout: str
) -> None:
    reference = parallel_run["reference"]
    want_metrics = reference[f"metrics_{name}"]
    assert want_metrics["micro_batches"] >= 3  # DP 2 gets an uneven share
    assert want_metrics["grad_norm"] > SETTINGS.max_grad_norm  # clipping happened
    original = read_hf_state_dict(parallel_run["folder"] / name)
    want = reference[f"weights_{name}"]
    for result in parallel_run["ranks"]:
        _assert_same_step(
            (result[f"{layout}_metrics"][name], result[f"{layout}_weights"][name]),
            (want_metrics, want),
            original,
        )


def test_a_data_parallel_replica_without_micro_batches_takes_its_part(
    parallel_run: dict[str, Any],
) -> None:
    reference = parallel_run["reference"]
    assert reference["one_batch_metrics"]["micro_batches"] == 1
    original = read_hf_state_dict(parallel_run["folder"] / "qwen3")
    for result in parallel_run["ranks"]:
        _assert_same_step(
            (result["dp_one_batch_metrics"], result["dp_one_batch_weights"]),
            (reference["one_batch_metrics"], reference["one_batch_weights"]),
            original,
        )


def _assert_same_step(
    got: tuple[dict[str, float], dict[str, Any]],
    want: tuple[dict[str, float], dict[str, Any]],
    original: dict[str, Any],
) -> None:
    """The same metrics and the same updated weights (SGD: the update is the clipped
    gradient) as the step in one process."""
    (metrics, weights), (want_metrics, want_weights) = got, want
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        assert math.isclose(metrics[key], value, rel_tol=RTOL, abs_tol=1e-7), key
    assert sorted(weights) == sorted(want_weights)
    for key in want_weights:
        _assert_same_update(weights[key], want_weights[key], original[key], key)


# ---------------------------------------------------------------------------------------------
# Helpers at world size 1


def test_data_parallel_share_balances_tokens_deterministically() -> None:
    costs = [30, 10, 25, 5, 40, 12]
    shares = [parallel.data_parallel_share(costs, 2, r) for r in range(2)]
    # 40 -> 0, 30 -> 1, 25 -> 1 (30 < 40), 12 -> 0 (40 < 55), 10 -> 0 (52 < 55), 5 -> 1
    assert shares == [[1, 4, 5], [0, 2, 3]]
    assert sorted(shares[0] + shares[1]) == list(range(len(costs)))
    loads = [sum(costs[i] for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(costs)
    assert parallel.data_parallel_share(costs, 1, 0) == list(range(len(costs)))
    assert [parallel.data_parallel_share([7], 2, r) for r in range(2)] == [[0], []]
    with pytest.raises(ValueError, match="not in a data-parallel world of 2"):
        parallel.data_parallel_share(costs, 2, 2)


def test_world_size_and_rank_go_together() -> None:
    with pytest.raises(ValueError, match="world_size and rank go together"):
        megatron_runtime.setup("cpu", world_size=2)
    assert megatron_runtime.current() is None
    assert parallel.broadcast_objects({"x": 1}) == {"x": 1}  # no process group: identity
