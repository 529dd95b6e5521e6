"""The policy model: a megatron-core ``GPTModel`` (local layer spec) for Qwen2, Qwen3 and Llama.

``ModelSpec.from_hf_config`` reads a Hugging Face config into the few numbers megatron needs
and refuses, with ``UnsupportedModelError``, anything this module would get wrong (another
architecture, sliding-window attention, biases Megatron cannot place, an unknown RoPE scaling).
``build_model`` turns a spec into a ``GPTModel`` on the device of the running
``corral.trainer.megatron_runtime`` runtime; ``forward_logits`` is the forward pass training code
calls. Weights in and out of Hugging Face format live in ``corral.trainer.convert``.

How the families map onto megatron-core's ``TransformerConfig``:

- RMSNorm (``normalization="RMSNorm"``; the local spec keeps ``input_layernorm`` and
  ``pre_mlp_layernorm`` as separate ``torch.nn.RMSNorm`` modules);
- SwiGLU (``gated_linear_unit=True`` + SiLU; ``linear_fc1`` holds [gate; up]);
- grouped-query attention (``num_query_groups`` = KV heads; ``kv_channels`` = head dim, which
  Qwen3 sets independently of ``hidden_size / heads``);
- no bias on linear layers except Qwen2's Q/K/V (``add_qkv_bias``);
- Qwen3's per-head RMSNorm on queries and keys (``qk_layernorm``; in the local spec an
  RMSNorm over the head dimension, applied before RoPE, as in transformers);
- RoPE on the full head dimension, non-interleaved (``rotate_half``), base ``rope_theta``;
  Llama 3.x frequency scaling through megatron's ``rope_scaling``, whose constants are fixed
  (low 1, high 4, original context 8192), so other values are refused;
- tied or untied input/output embeddings; no dropout anywhere.

Tensor parallelism (``TP`` from the running ``parallel_state``): ``build_model`` builds this
rank's shard of the layers. The attention heads, the key/value heads (query groups) and the
MLP's intermediate size must divide by ``TP`` (else ``UnsupportedModelError``: megatron-core's
local attention cannot replicate key/value heads across ranks). The vocabulary is padded with
zero rows up to a multiple of ``TP`` (``padded_vocab_size``); ``forward_logits`` drops the
padding columns, so callers always see ``spec.vocab_size`` logits.

Logits under TP are *gathered* (``parallel_output=False``): every tensor-parallel rank gets the
full ``[batch, seq, vocab]`` logits and computes the same log-probs and entropies with the
plain code of ``corral.trainer.batches``; the gather's backward hands each rank the gradient of
its own vocabulary shard, so nothing is counted twice. This is the simple correct choice while
one micro-batch's full logits fit in a device's memory: float32 logits cost ``4 x tokens x
vocab`` bytes (about 5 GB for 8192 tokens of a 152k vocabulary), and a few copies of them live
through the backward (log-softmax, its gradient). When that stops fitting (long micro-batches,
large vocabularies, many TP ranks), compute the log-softmax vocab-parallel instead (max and
sum of exponentials all-reduced over the TP group, as megatron's
``vocab_parallel_cross_entropy`` does), which keeps ``1/TP`` of the logits per rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import torch

from corral.trainer.megatron_runtime import on_device

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "Family",
    "ModelSpec",
    "UnsupportedModelError",
    "build_model",
    "check_tensor_parallel",
    "forward_logits",
    "megatron_attention_mask",
    "padded_vocab_size",
]

Family = Literal["qwen2", "qwen3", "llama"]

# Hugging Face architecture name -> family. Anything else is refused.
_ARCHITECTURES: Final[dict[str, Family]] = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES: Final[dict[str, Family]] = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama"}
# The Llama 3.x RoPE scaling constants megatron-core hard-codes in RotaryEmbedding._apply_scaling.
_MEGATRON_LLAMA3_ROPE: Final = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class UnsupportedModelError(ValueError):
    """A Hugging Face model this trainer cannot represent exactly; the message says what."""


@dataclass(frozen=True)
class ModelSpec:
    """What the Megatron model is built from: the shape of a Qwen2/Qwen3/Llama decoder.

    Built by ``from_hf_config``, which validates; ``hf_config`` keeps the source config (as
    ``to_dict()``) so that a saved checkpoint carries the same ``config.json``.
    """

    family: Family
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    # Llama 3.x frequency scaling factor, or None for plain RoPE.
    rope_llama3_factor: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """The spec of a transformers ``PretrainedConfig`` (Qwen2, Qwen3 or Llama).

        Raises ``UnsupportedModelError`` naming the offending setting for another architecture
        or a setting the Megatron model would not reproduce.
        """
        family = _family(config)
        name = getattr(config, "architectures", None) or []
        architecture = name[0] if name else _default_architecture(family)
        _check_supported(config, family)
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % groups:
            raise UnsupportedModelError(f"{heads} attention heads are not a multiple of {groups}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta, llama3_factor = _rope(config)
        return cls(
            family=family,
            architecture=architecture,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            norm_eps=float(config.rms_norm_eps),
            rope_theta=theta,
            rope_llama3_factor=llama3_factor,
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has Q/K/V biases (transformers hard-codes them).
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            hf_config=config.to_dict(),
        )

    def transformer_config(
        self, *, device: torch.device, dtype: torch.dtype = torch.float32, init: bool = True
    ) -> TransformerConfig:
        """megatron-core's ``TransformerConfig`` for this spec, with the parallel layout of the
        initialised ``parallel_state``. ``init=False`` skips random initialisation (for weights
        that are about to be loaded)."""
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            # On CPU the parameters must be created there (megatron_runtime's docstring says why).
            use_cpu_initialization=device.type == "cpu",
            perform_initialization=init,
            # The default ("full") means the same but warns that it is deprecated.
            cuda_graph_scope=[],
        )


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tensor_parallel_size`` (megatron's
    vocab-parallel embedding and output layer split the vocabulary evenly)."""
    return -(-vocab_size // tensor_parallel_size) * tensor_parallel_size


def check_tensor_parallel(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """Raise ``UnsupportedModelError`` unless ``spec`` splits evenly over that many ranks."""
    for what, count in (
        ("attention heads", spec.num_attention_heads),
        ("key/value heads", spec.num_query_groups),
        ("MLP intermediate size", spec.ffn_hidden_size),
    ):
        if count % tensor_parallel_size:
            raise UnsupportedModelError(
                f"{count} {what} do not split over tensor parallel size {tensor_parallel_size}"
            )


@on_device
def build_model(
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    parallel_output: bool = False,
) -> GPTModel:
    """A megatron-core ``GPTModel`` for ``spec`` on the running runtime's device: this
    tensor-parallel rank's shard (module docstring), its vocabulary padded to
    ``padded_vocab_size``.

    Needs ``corral.trainer.megatron_runtime.setup`` first (else ``RuntimeError``). ``init=False``
    leaves the parameters uninitialised, for ``convert.load_megatron_state_dict`` to fill.
    ``parallel_output=False`` (the default) gathers the vocabulary shards of the logits under
    tensor parallelism, so ``forward_logits`` always returns the full vocabulary;
    ``UnsupportedModelError`` when the heads or the MLP do not split over the TP ranks.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from corral.trainer import megatron_runtime

    runtime = megatron_runtime.current()
    if runtime is None:
        raise RuntimeError("call corral.trainer.megatron_runtime.setup() before build_model()")
    config = spec.transformer_config(device=runtime.device, dtype=dtype, init=init)
    check_tensor_parallel(spec, config.tensor_model_parallel_size)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,  # annotated int in megatron, used as a float
        rope_scaling=spec.rope_llama3_factor is not None,
        rope_scaling_factor=spec.rope_llama3_factor or 8.0,
    )
    if not init:
        _declare_tensor_parallel_weights(model)
    # The vocabulary the caller sees; forward_logits drops the padding columns past it.
    model.corral_vocab_size = spec.vocab_size
    return model.to(runtime.device)


def _declare_tensor_parallel_weights(model: GPTModel) -> None:
    """Mark the sharded weights as megatron's initialisation would have.

    megatron-core 0.16 sets a parallel layer's weight attributes (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``) only inside its weight *initialisation*, so a model
    built with ``perform_initialization=False`` (on CPU or GPU) has sharded weights that look
    replicated; a global gradient norm that counts replicated parameters once would then
    count only rank 0's shards. The biases are marked either way."""
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "partition_dim"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def megatron_attention_mask(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean mask megatron's attention takes, ``True`` where attention is *blocked*.

    Causal always; ``attention_mask`` ([batch, seq], 1/True = real token, as in transformers)
    also blocks attention to padding; ``segment_ids`` ([batch, seq] integers) blocks attention
    across segments, for several samples packed into one row. Shape [1, 1, seq, seq] when only
    causal, else [batch, 1, seq, seq]. Raises ``ValueError`` on a shape that does not match.
    """
    batch, seq = input_ids.shape
    device = input_ids.device
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    for name, extra in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
        if extra is not None and tuple(extra.shape) != (batch, seq):
            raise ValueError(f"{name} has shape {tuple(extra.shape)}, expected {(batch, seq)}")
    if attention_mask is not None:
        blocked = blocked | ~attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    if segment_ids is not None:
        segments = segment_ids.to(device)
        blocked = blocked | (segments[:, None, :, None] != segments[:, None, None, :])
    return blocked


@on_device
def forward_logits(
    model: GPTModel,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits [batch, seq, vocab] for ``input_ids`` [batch, seq] (float in the
    model's dtype; autograd follows the model's mode and ``torch.no_grad``).

    Masks as in ``megatron_attention_mask``. RoPE positions are the row indices 0..seq-1:
    megatron-core's rotary embedding does not read ``position_ids``. Because RoPE scores depend
    only on the distance between two positions, a left-padded or packed sample gets the same
    logits (to float rounding) as the sample alone, as long as the masks keep it from attending
    outside.
    Logits at padding positions are meaningless. Under tensor parallelism every rank of the
    tensor-parallel group must call this with the same inputs (the layers' collectives), and
    each gets the full logits (the module docstring says why).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    # An explicit mask always: megatron's own causal default is built with device="cuda".
    mask = megatron_attention_mask(input_ids, attention_mask, segment_ids)
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    logits: torch.Tensor = model(input_ids, position_ids, mask)
    vocab = getattr(model, "corral_vocab_size", None)
    if vocab is not None and logits.shape[-1] > vocab:
        logits = logits[..., :vocab]
    return logits


# ---------------------------------------------------------------------------------------------
# Reading Hugging Face configs


def _family(config: Any) -> Family:
    names = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    if names:
        raise UnsupportedModelError(
            f"architecture {names[0]} is not supported; expected one of {sorted(_ARCHITECTURES)}"
        )
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"model type {model_type!r} is not supported; expected one of {sorted(_MODEL_TYPES)}"
    )


def _default_architecture(family: Family) -> str:
    return next(name for name, f in _ARCHITECTURES.items() if f == family)


def _check_supported(config: Any, family: Family) -> None:
    """Refuse settings the Megatron model would silently get wrong."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            "sliding-window attention (use_sliding_window) is not supported"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"layer types {sorted(set(layer_types))} are not supported (full attention only)"
        )
    if family == "llama":
        # Megatron puts biases either on Q/K/V only or on every linear layer (MLP included);
        # Llama's attention_bias (Q/K/V/O) and mlp_bias combinations do not map onto that.
        for name in ("attention_bias", "mlp_bias"):
            if getattr(config, name, False):
                raise UnsupportedModelError(f"Llama with {name}=True is not supported")
    if family in ("qwen3",) and getattr(config, "attention_bias", False):
        raise UnsupportedModelError("Qwen3 with attention_bias=True is not supported")


def _rope(config: Any) -> tuple[float, float | None]:
    """(rope_theta, Llama 3 scaling factor or None); transformers 5 keeps both in
    ``rope_parameters``, older configs in ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = params or dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the config names no rope_theta")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            if not math.isclose(float(scaling.get(key, math.nan)), expected):
                raise UnsupportedModelError(
                    f"llama3 RoPE scaling with {key}={scaling.get(key)} is not supported "
                    f"(megatron-core fixes it at {expected})"
                )
        return float(theta), float(scaling["factor"])
    raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (default, llama3)")
