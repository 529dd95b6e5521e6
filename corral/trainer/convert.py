"""Weights between Hugging Face (Qwen2, Qwen3, Llama) and megatron-core's local-spec GPTModel.

Written here rather than taken from ``mbridge``: mbridge 0.15 builds its models with the
Transformer Engine layer spec only (``use_transformer_engine=True``, whose parameter names fuse
the layer norms into the linear layers), moves them to CUDA unconditionally, and so neither
runs on a CPU nor matches the local spec's names.

The layout (tensor parallel size 1: full, unsharded tensors), per layer ``i``:

=================================================  ==============================================
megatron-core (``decoder.layers.{i}.``)             Hugging Face (``model.layers.{i}.``)
=================================================  ==============================================
``input_layernorm.weight``                          ``input_layernorm.weight``
``self_attention.linear_qkv.weight`` / ``.bias``    ``self_attn.{q,k,v}_proj.weight`` / ``.bias``
``self_attention.q_layernorm.weight`` (Qwen3)       ``self_attn.q_norm.weight``
``self_attention.k_layernorm.weight`` (Qwen3)       ``self_attn.k_norm.weight``
``self_attention.linear_proj.weight``               ``self_attn.o_proj.weight``
``pre_mlp_layernorm.weight``                        ``post_attention_layernorm.weight``
``mlp.linear_fc1.weight``                           ``mlp.{gate,up}_proj.weight``
``mlp.linear_fc2.weight``                           ``mlp.down_proj.weight``
=================================================  ==============================================

plus ``embedding.word_embeddings.weight`` = ``model.embed_tokens.weight``,
``decoder.final_layernorm.weight`` = ``model.norm.weight`` and, untied only,
``output_layer.weight`` = ``lm_head.weight``.

``linear_qkv`` is grouped by key/value head: for each of the ``num_query_groups`` groups, the
group's query heads, then its key head, then its value head (``head_dim`` rows each); a query
head ``h`` of transformers belongs to group ``h // heads_per_group`` (``repeat_kv``).
``linear_fc1`` is ``gate_proj`` stacked over ``up_proj`` (megatron's GLU applies the activation
to the first half). Conversion only reshapes and concatenates, so a round trip is bit-exact.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from corral.trainer.model import ModelSpec, build_model

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = [
    "ConversionError",
    "hf_to_megatron",
    "load_hf_checkpoint",
    "load_megatron_state_dict",
    "megatron_state_dict",
    "megatron_to_hf",
    "read_hf_state_dict",
    "save_hf_checkpoint",
]

# Files copied from ``tokenizer_from`` into a saved checkpoint when present.
TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
# Non-parameter buffers some older checkpoints carry; they hold nothing the model needs.
_IGNORED_HF_SUFFIXES: Final = (".rotary_emb.inv_freq",)
_MAX_SHARD_SIZE: Final = "5GB"


class ConversionError(ValueError):
    """A state dict that does not fit the spec: missing, unexpected or misshapen tensors."""


# ---------------------------------------------------------------------------------------------
# State dicts


def _plain_pairs(spec: ModelSpec) -> Iterator[tuple[str, str]]:
    """(megatron name, Hugging Face name) of the tensors that map one to one."""
    yield "embedding.word_embeddings.weight", "model.embed_tokens.weight"
    yield "decoder.final_layernorm.weight", "model.norm.weight"
    if not spec.tie_word_embeddings:
        yield "output_layer.weight", "lm_head.weight"
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        yield m + "input_layernorm.weight", h + "input_layernorm.weight"
        yield m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"
        yield m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"
        yield m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight"
        if spec.qk_norm:
            yield m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"
            yield m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight"


def _qkv_kinds(spec: ModelSpec) -> tuple[str, ...]:
    return ("weight", "bias") if spec.qkv_bias else ("weight",)


def _take(source: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in source:
        raise ConversionError(f"missing tensor {name!r}")
    used.add(name)
    return source[name]


def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.shape[0] != rows:
        raise ConversionError(f"{name} has {tensor.shape[0]} rows, expected {rows}")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    groups, dim = spec.num_query_groups, spec.head_dim
    rest = q.shape[1:]
    per_group = [
        q.reshape(groups, spec.heads_per_group, dim, *rest),
        k.reshape(groups, 1, dim, *rest),
        v.reshape(groups, 1, dim, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _split_qkv(
    qkv: torch.Tensor, spec: ModelSpec, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, dim, per = spec.num_query_groups, spec.head_dim, spec.heads_per_group
    _check_rows(name, qkv, (spec.num_attention_heads + 2 * groups) * dim)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per + 2, dim, *rest)
    q = grouped[:, :per].reshape(-1, *rest)
    k = grouped[:, per].reshape(-1, *rest)
    v = grouped[:, per + 1].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def hf_to_megatron(hf: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Megatron-core state dict (local spec, tensor parallel 1) from a Hugging Face one.

    Tensors keep their dtype and device. With tied embeddings ``lm_head.weight`` may be absent
    (as in the saved files) or present and equal to the embeddings. Raises ``ConversionError``
    on a missing tensor, a tensor of the wrong size, an unexpected name, or a tied
    ``lm_head.weight`` that differs from the embeddings.
    """
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for m_name, h_name in _plain_pairs(spec):
        out[m_name] = _take(hf, h_name, used)
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
        heads = {"q": spec.num_attention_heads, "k": spec.num_query_groups}
        for kind in _qkv_kinds(spec):
            parts = []
            for proj in "qkv":
                name = f"{h}{proj}_proj.{kind}"
                parts.append(_take(hf, name, used))
                _check_rows(name, parts[-1], heads.get(proj, heads["k"]) * spec.head_dim)
            out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                parts[0], parts[1], parts[2], spec
            )
        h = f"model.layers.{i}.mlp."
        gate, up = _take(hf, h + "gate_proj.weight", used), _take(hf, h + "up_proj.weight", used)
        _check_rows(h + "gate_proj.weight", gate, spec.ffn_hidden_size)
        _check_rows(h + "up_proj.weight", up, spec.ffn_hidden_size)
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if spec.tie_word_embeddings and "lm_head.weight" in hf:
        used.add("lm_head.weight")
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise ConversionError("tied embeddings, but lm_head.weight differs from embed_tokens")
    extra = sorted(n for n in hf if n not in used and not n.endswith(_IGNORED_HF_SUFFIXES))
    if extra:
        raise ConversionError(f"unexpected tensors for {spec.architecture}: {extra[:8]}")
    return out


def megatron_to_hf(mcore: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face state dict from a megatron-core one (local spec, tensor parallel 1).

    The names are those transformers saves: with tied embeddings there is no
    ``lm_head.weight``. ``_extra_state`` entries are ignored. Raises ``ConversionError`` on a
    missing, misshapen or unexpected tensor.
    """
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for m_name, h_name in _plain_pairs(spec):
        out[h_name] = _take(mcore, m_name, used)
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in _qkv_kinds(spec):
            name = f"{m}self_attention.linear_qkv.{kind}"
            q, k, v = _split_qkv(_take(mcore, name, used), spec, name)
            for proj, tensor in zip("qkv", (q, k, v), strict=True):
                out[f"{h}self_attn.{proj}_proj.{kind}"] = tensor
        name = f"{m}mlp.linear_fc1.weight"
        fc1 = _take(mcore, name, used)
        _check_rows(name, fc1, 2 * spec.ffn_hidden_size)
        gate, up = fc1.chunk(2, dim=0)
        out[f"{h}mlp.gate_proj.weight"] = gate.contiguous()
        out[f"{h}mlp.up_proj.weight"] = up.contiguous()
    extra = sorted(n for n in mcore if n not in used and not n.endswith("._extra_state"))
    if extra:
        raise ConversionError(f"unexpected megatron tensors for {spec.architecture}: {extra[:8]}")
    return out


def megatron_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's parameters by megatron name, detached (sharing storage with the model),
    without the local spec's ``_extra_state`` placeholders."""
    return {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if not name.endswith("._extra_state")
    }


def load_megatron_state_dict(model: GPTModel, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters (cast to their dtype and device).

    Strict but for ``_extra_state``: raises ``ConversionError`` listing missing or unexpected
    names, and ``RuntimeError`` (torch's) on a shape mismatch; on an error nothing is copied.
    """
    expected = set(megatron_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    result = model.load_state_dict(dict(state), strict=False)
    leftover = [n for n in result.missing_keys if not n.endswith("._extra_state")]
    if leftover or result.unexpected_keys:  # cannot happen after the check above
        raise ConversionError(f"load_state_dict left {leftover} / {result.unexpected_keys}")


# ---------------------------------------------------------------------------------------------
# Checkpoint folders


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face model folder's safetensors files (one file or an indexed
    set of shards), on CPU. Raises ``FileNotFoundError`` when the folder has none."""
    from safetensors.torch import load_file

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors(.index.json)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[GPTModel, ModelSpec]:
    """A megatron-core model holding the weights of the Hugging Face model folder ``path``.

    Needs ``corral.trainer.megatron_cpu.setup`` first (tensor parallel size 1). ``dtype``
    defaults to the checkpoint's. Raises ``UnsupportedModelError`` for an architecture
    ``ModelSpec`` refuses, ``ConversionError`` for weights that do not fit the config,
    ``FileNotFoundError`` without safetensors files.
    """
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(path)))
    hf = read_hf_state_dict(path)
    state = hf_to_megatron(hf, spec)
    model = build_model(
        spec, dtype=dtype or state["embedding.word_embeddings.weight"].dtype, init=False
    )
    load_megatron_state_dict(model, state)
    return model, spec


def save_hf_checkpoint(
    model: GPTModel,
    spec: ModelSpec,
    out_dir: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face model folder that ``AutoModelForCausalLM`` loads.

    ``config.json`` is the spec's source config; weights go to ``model.safetensors`` (or
    5 GB shards with an index), cast to ``dtype`` if given; the tokenizer files and
    ``generation_config.json`` are copied from the folder ``tokenizer_from`` when given.
    Files already in ``out_dir`` under those names are overwritten. Returns ``out_dir``.
    """
    from huggingface_hub import save_torch_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = megatron_to_hf(megatron_state_dict(model), spec)
    tensors = {n: _owning((t.to(dtype) if dtype else t).cpu()) for n, t in hf.items()}
    # Drop a stale index or shards from an earlier, larger save into the same folder.
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    save_torch_state_dict(tensors, out, max_shard_size=_MAX_SHARD_SIZE)
    config = _hf_config(spec)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out)
    if tokenizer_from is not None:
        source = Path(tokenizer_from)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    return out


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied if it is a view into a larger storage (gate and up are halves of
    ``linear_fc1``; q/k/v of ``linear_qkv``): safetensors refuses partly shared storage."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.contiguous().clone()


def _hf_config(spec: ModelSpec) -> Any:
    """The transformers config object of the spec's source config."""
    from transformers import AutoConfig

    values = dict(spec.hf_config)
    model_type = values.pop("model_type", None) or spec.family
    # A config built in code has no architectures; a saved folder should name its class.
    values["architectures"] = values.get("architectures") or [spec.architecture]
    return AutoConfig.for_model(model_type, **values)
