"""The Megatron policy model on CPU: HF <-> Megatron weights, logits against transformers,
saved folders that transformers and the local engine load, a training step, refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install megatron-core"
)

from corral.trainer import megatron_runtime  # noqa: E402
from corral.trainer.convert import (  # noqa: E402
    ConversionError,
    hf_to_megatron,
    load_hf_checkpoint,
    load_megatron_state_dict,
    megatron_state_dict,
    megatron_to_hf,
    read_hf_state_dict,
    save_hf_checkpoint,
)
from corral.trainer.model import (  # noqa: E402
    ModelSpec,
    UnsupportedModelError,
    build_model,
    forward_logits,
)

# float32 on CPU: Megatron and transformers compute the same functions in a different order
# (fused QKV matmul, torch.nn.RMSNorm, RoPE tables); measured differences are around 1e-5.
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime() -> Iterator[megatron_runtime.Runtime]:
    runtime = megatron_runtime.setup("cpu")
    yield runtime
    megatron_runtime.teardown()


def _randomize(model: Any, seed: int) -> Any:
    """Every parameter random, norms around 1 and biases included (transformers initialises
    biases to zero and norms to one, which would hide a misplaced bias or a swapped norm)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


_SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}

# name -> a function building a random transformers model of that shape
CONFIGS: dict[str, Callable[[], Any]] = {
    # GQA: 8 query heads over 2 KV heads, untied output layer
    "qwen2-gqa-untied": lambda: transformers.Qwen2Config(
        **_SMALL, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False
    ),
    # plain multi-head attention, tied embeddings
    "qwen2-mha-tied": lambda: transformers.Qwen2Config(
        **_SMALL, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
    ),
    # QK-norm, and a head dim (24) that is not hidden / heads (16)
    "qwen3-qknorm": lambda: transformers.Qwen3Config(
        **_SMALL,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
    ),
    # no biases, one KV head, Llama 3.x RoPE scaling
    "llama3-rope-scaled": lambda: transformers.LlamaConfig(
        **_SMALL,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def _random_hf(name: str, seed: int = 0) -> Any:
    config = CONFIGS[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _randomize(model, seed)


def _megatron_from_hf(hf_model: Any) -> tuple[Any, ModelSpec]:
    spec = ModelSpec.from_hf_config(hf_model.config)
    model = build_model(spec, init=False)
    load_megatron_state_dict(model, hf_to_megatron(hf_model.state_dict(), spec))
    return model.eval(), spec


def _ids(vocab: int, batch: int = 2, seq: int = 33, seed: int = 1) -> Any:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: Any, b: Any) -> float:
    return float((a - b).abs().max())


# ---------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_of_the_tiny_model_is_bit_exact(tiny_model_dir: Path) -> None:
    original = read_hf_state_dict(tiny_model_dir)
    model, spec = load_hf_checkpoint(tiny_model_dir)
    assert (spec.family, spec.tie_word_embeddings, spec.qkv_bias) == ("qwen2", True, True)
    back = megatron_to_hf(megatron_state_dict(model), spec)
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_through_a_megatron_model_is_bit_exact(name: str) -> None:
    hf_model = _random_hf(name)
    model, spec = _megatron_from_hf(hf_model)
    back = megatron_to_hf(megatron_state_dict(model), spec)
    expected = dict(hf_model.state_dict())
    if spec.tie_word_embeddings:  # transformers does not save the tied copy either
        expected.pop("lm_head.weight")
    assert sorted(back) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(back[key], tensor), key


# ---------------------------------------------------------------------------------------------
# Logits


def test_tiny_model_logits_match_transformers(tiny_model_dir: Path) -> None:
    model, spec = load_hf_checkpoint(tiny_model_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = _ids(spec.vocab_size, batch=3, seq=64)
    with torch.no_grad():
        ours = forward_logits(model.eval(), ids)
        theirs = hf_model(input_ids=ids).logits
    assert ours.shape == (3, 64, spec.vocab_size)
    assert theirs.abs().max() > 1.0  # the imprinted model is far from uniform
    assert _max_diff(ours, theirs) < ATOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name: str) -> None:
    hf_model = _random_hf(name)
    model, spec = _megatron_from_hf(hf_model)
    # The RoPE frequencies, scaled ones included, are the same numbers.
    assert torch.allclose(model.rotary_pos_emb.inv_freq, hf_model.model.rotary_emb.inv_freq)
    ids = _ids(spec.vocab_size)
    with torch.no_grad():
        ours = forward_logits(model, ids)
        theirs = hf_model(input_ids=ids).logits
    assert _max_diff(ours, theirs) < ATOL


def test_left_padding_and_packing_give_the_logits_of_each_sample_alone() -> None:
    hf_model = _random_hf("qwen2-gqa-untied")
    model, spec = _megatron_from_hf(hf_model)
    first, second = _ids(spec.vocab_size, 1, 9, seed=2), _ids(spec.vocab_size, 1, 14, seed=3)
    with torch.no_grad():
        alone = [forward_logits(model, first)[0], forward_logits(model, second)[0]]
        # left padding: 5 pad tokens (id 0) before the first sample
        padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), first], dim=1)
        mask = torch.tensor([[0] * 5 + [1] * 9])
        left = forward_logits(model, padded, attention_mask=mask)[0, 5:]
        # packing: both samples in one row, told apart by segment ids
        row = torch.cat([first, second], dim=1)
        segments = torch.tensor([[0] * 9 + [1] * 14])
        packed = forward_logits(model, row, segment_ids=segments)[0]
        # without the segment ids the second sample sees the first: different logits
        unmasked = forward_logits(model, row)[0]
    assert _max_diff(left, alone[0]) < ATOL
    assert _max_diff(packed[:9], alone[0]) < ATOL
    assert _max_diff(packed[9:], alone[1]) < ATOL
    assert _max_diff(unmasked[9:], alone[1]) > 1e-2


def test_mask_shapes_are_checked() -> None:
    hf_model = _random_hf("qwen2-mha-tied")
    model, spec = _megatron_from_hf(hf_model)
    ids = _ids(spec.vocab_size, 2, 5)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        forward_logits(model, ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        forward_logits(model, ids[0])


# ---------------------------------------------------------------------------------------------
# Saved folders


def test_saved_folder_loads_in_transformers_and_the_local_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, spec = load_hf_checkpoint(tiny_model_dir)
    out = save_hf_checkpoint(model, spec, tmp_path / "saved", tokenizer_from=tiny_model_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    saved = read_hf_state_dict(out)
    original = read_hf_state_dict(tiny_model_dir)
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], original[k]) for k in original)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        generated = reloaded.generate(ids, max_new_tokens=8, do_sample=False)
    # The imprinted tiny model answers this prompt with exactly this (tiny_model's contract).
    assert tokenizer.decode(generated[0, ids.shape[1] :]) == "Hello!<|im_end|>"

    from corral.engines.local.engine import LocalEngine

    engine = LocalEngine(out)
    assert engine.vocab_size == spec.vocab_size
    assert engine.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>"), 0}


def test_saved_folder_of_a_config_built_in_code_names_its_architecture(tmp_path: Path) -> None:
    hf_model = _random_hf("qwen3-qknorm")
    model, spec = _megatron_from_hf(hf_model)
    out = save_hf_checkpoint(model, spec, tmp_path / "qwen3")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    ids = _ids(spec.vocab_size)
    with torch.no_grad():
        assert _max_diff(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits) == 0


# ---------------------------------------------------------------------------------------------
# Training


def test_a_training_step_changes_the_weights_and_the_converted_model(tiny_model_dir: Path) -> None:
    model, spec = load_hf_checkpoint(tiny_model_dir)
    model.train()
    before = {k: v.clone() for k, v in megatron_state_dict(model).items()}
    ids = _ids(spec.vocab_size, batch=2, seq=24, seed=4)

    def loss_of(logits: Any) -> Any:
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, spec.vocab_size).float(), ids[:, 1:].reshape(-1)
        )

    loss = loss_of(forward_logits(model, ids))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0).step()
    after = megatron_state_dict(model)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert sorted(changed) == sorted(before)

    with torch.no_grad():
        new_logits = forward_logits(model.eval(), ids)
    assert float(loss_of(new_logits)) < float(loss.detach())

    # The converted-back weights are the trained ones: transformers computes the new logits.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        old_hf_logits = hf_model(input_ids=ids).logits
    trained = megatron_to_hf(after, spec)
    original = read_hf_state_dict(tiny_model_dir)
    assert all(not torch.equal(trained[k], original[k]) for k in original)
    hf_model.load_state_dict(trained, strict=False)
    with torch.no_grad():
        new_hf_logits = hf_model(input_ids=ids).logits
    assert _max_diff(new_hf_logits, new_logits) < ATOL
    assert _max_diff(new_hf_logits, old_hf_logits) > 1e-3


# ---------------------------------------------------------------------------------------------
# Refusals and errors


REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "gpt2": (lambda: transformers.GPT2Config(), "model type 'gpt2' is not supported"),
    "mistral": (
        lambda: transformers.MistralConfig(architectures=["MistralForCausalLM"]),
        "architecture MistralForCausalLM is not supported",
    ),
    "sliding-window": (
        lambda: transformers.Qwen2Config(use_sliding_window=True, sliding_window=64),
        "sliding-window",
    ),
    "llama-attention-bias": (
        lambda: transformers.LlamaConfig(attention_bias=True),
        "attention_bias=True",
    ),
    "gelu": (lambda: transformers.LlamaConfig(hidden_act="gelu"), "hidden_act 'gelu'"),
    "yarn": (
        lambda: transformers.Qwen2Config(
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
        ),
        "RoPE type 'yarn'",
    ),
    "llama3-other-constants": (
        lambda: transformers.LlamaConfig(
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        "low_freq_factor=2.0",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_models_are_refused(name: str) -> None:
    make, message = REFUSED[name]
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_hf_config(make())


def test_an_unsupported_folder_is_refused_before_its_weights_are_read(tmp_path: Path) -> None:
    transformers.MistralConfig(architectures=["MistralForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        load_hf_checkpoint(tmp_path)


def test_state_dicts_that_do_not_fit_the_spec_are_refused() -> None:
    hf_model = _random_hf("qwen2-mha-tied")
    spec = ModelSpec.from_hf_config(hf_model.config)
    state = dict(hf_model.state_dict())

    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ConversionError, match=r"missing tensor 'model.layers.1.mlp.up_proj"):
        hf_to_megatron(missing, spec)
    with pytest.raises(ConversionError, match=r"unexpected tensors.*model.layers.2"):
        hf_to_megatron({**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, spec)
    untied = {**state, "lm_head.weight": torch.zeros_like(state["lm_head.weight"])}
    with pytest.raises(ConversionError, match=r"lm_head.weight differs"):
        hf_to_megatron(untied, spec)
    short = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 64)}
    with pytest.raises(ConversionError, match=r"self_attn.k_proj.weight has 8 rows, expected 64"):
        hf_to_megatron(short, spec)

    model = build_model(spec, init=False)
    converted = hf_to_megatron(state, spec)
    with pytest.raises(ConversionError, match=r"missing.*output_layer|unexpected.*output_layer"):
        load_megatron_state_dict(model, {**converted, "output_layer.weight": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------
# The CPU runtime


def test_cpu_runtime_is_idempotent_scoped_to_megatron_and_undone_by_teardown(
    cpu_runtime: megatron_runtime.Runtime,
) -> None:
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    from megatron.core import parallel_state, tensor_parallel

    assert cpu_runtime.device == torch.device("cpu") and cpu_runtime.backend == "gloo"
    assert megatron_runtime.setup("cpu") is cpu_runtime
    with pytest.raises(RuntimeError, match="already set up"):
        megatron_runtime.setup("cpu", seed=1)

    # Only megatron's modules see the redirected current_device; torch itself is untouched.
    assert rotary.torch.cuda.current_device() == torch.device("cpu")
    assert rotary.torch.float32 is torch.float32
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()

    # fork() runs its body on the tracked stream and leaves the caller's RNG where it was.
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    assert not torch.equal(inside, expected)

    megatron_runtime.teardown()
    try:
        assert megatron_runtime.current() is None
        assert tensor_parallel.get_cuda_rng_tracker() is not tracker
        assert rotary.torch is torch
        assert not parallel_state.model_parallel_is_initialized()
        assert not torch.distributed.is_initialized()
        with pytest.raises(RuntimeError, match="setup"):
            build_model(ModelSpec.from_hf_config(CONFIGS["qwen2-mha-tied"]()))
        megatron_runtime.teardown()  # a second teardown is a no-op
        # A failed setup leaves nothing behind.
        with pytest.raises(ValueError, match="not divisible by tensor parallel 2"):
            megatron_runtime.setup("cpu", tensor_parallel_size=2)
        assert megatron_runtime.current() is None and not torch.distributed.is_initialized()
        assert rotary.torch is torch
        # The context manager form sets up for its body only.
        with megatron_runtime.runtime("cpu", seed=3) as scoped:
            assert megatron_runtime.current() is scoped and scoped.seed == 3
            assert rotary.torch is not torch
        assert megatron_runtime.current() is None and rotary.torch is torch
    finally:
        # the module fixture's runtime, back as it was for the tests that follow
        assert megatron_runtime.setup("cpu") == cpu_runtime
