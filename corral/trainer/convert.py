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

Tensor parallelism (``TP`` ranks; ``hf_to_megatron`` / ``megatron_to_hf`` always speak the
full, TP-1 layout above, and ``shard_megatron_state`` / ``merge_megatron_shards`` go between
it and the ranks' shards). Rank ``r`` of ``TP`` holds:

- ``linear_qkv.weight`` / ``.bias`` (column-parallel): row chunk ``r`` of ``TP`` equal chunks.
  The fused layout is grouped by query group, so that is query groups ``r*G/TP`` to
  ``(r+1)*G/TP - 1`` whole: each group's query heads with its key and value head.
- ``linear_fc1.weight`` (column-parallel, SwiGLU): ``[gate chunk r; up chunk r]``. Gate and up
  are each split into ``TP`` row chunks and each rank stacks its two (megatron's GLU halves
  the *local* output), so this is *not* a plain chunk of the fused ``[gate; up]``.
- ``linear_proj.weight``, ``linear_fc2.weight`` (row-parallel): column chunk ``r`` (dim 1),
  the inputs from the heads / intermediate units the rank holds.
- ``embedding.word_embeddings.weight``, ``output_layer.weight`` (vocab-parallel): row chunk
  ``r`` of the vocabulary padded with zero rows to a multiple of ``TP``
  (``model.padded_vocab_size``; the padding rows are never looked up, and ``forward_logits``
  drops their logits).
- everything else (the RMSNorm weights, Qwen3's ``q_layernorm`` / ``k_layernorm``): the whole
  tensor on every rank.

The heads, the key/value heads and the MLP's intermediate size must divide by ``TP``
(``model.check_tensor_parallel``). Merging concatenates in rank order (gate halves and up halves
separately for fc1) and drops the vocabulary padding, so HF -> Megatron(TP) -> HF is bit-exact
too. ``load_hf_checkpoint`` loads this rank's shard; ``megatron_state_dict`` and
``save_hf_checkpoint`` gather the full tensors over the tensor-parallel group (every rank
calls them; ``save_hf_checkpoint`` writes from one rank only).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import torch

from corral.trainer.megatron_runtime import on_device
from corral.trainer.model import ModelSpec, build_model, check_tensor_parallel, padded_vocab_size

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = [
    "ConversionError",
    "hf_to_megatron",
    "load_hf_checkpoint",
    "load_megatron_state_dict",
    "megatron_state_dict",
    "megatron_to_hf",
    "merge_megatron_shards",
    "read_hf_state_dict",
    "save_hf_checkpoint",
    "shard_megatron_state",
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


# ---------------------------------------------------------------------------------------------
# Tensor-parallel shards

Split = Literal["vocab", "rows", "glu", "columns", "replicated"]


def _split_of(name: str) -> Split:
    """How the megatron tensor ``name`` is split over tensor-parallel ranks (module docstring)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith((".linear_qkv.weight", ".linear_qkv.bias")):
        return "rows"
    if name.endswith(".linear_fc1.weight"):
        return "glu"
    if name.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return "columns"
    return "replicated"


def _check_divides(name: str, tensor: torch.Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise ConversionError(
            f"{name}: {tensor.shape[dim]} along dim {dim} do not split over {size} ranks"
        )


def _shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    split = _split_of(name)
    if split == "replicated" or size == 1:
        return tensor
    if split == "vocab":
        extra = padded_vocab_size(tensor.shape[0], size) - tensor.shape[0]
        if extra:
            tensor = torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])
        return tensor.chunk(size, dim=0)[rank]
    if split == "glu":
        _check_divides(name, tensor, 0, 2 * size)
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    dim = 0 if split == "rows" else 1
    _check_divides(name, tensor, dim, size)
    return tensor.chunk(size, dim=dim)[rank]


def _merge(name: str, shards: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    split = _split_of(name)
    if split == "replicated":
        return shards[0]
    if split == "vocab":
        return torch.cat(list(shards))[:vocab_size]
    if split == "glu":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=0 if split == "rows" else 1)


def shard_megatron_state(
    state: Mapping[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s shard (of ``size``) of a full (TP 1) megatron state dict,
    by the rules in the module docstring. Shards are views where a plain chunk is; the
    vocabulary is padded to a multiple of ``size``. ``ConversionError`` for a tensor that does
    not split evenly."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {size}")
    return {name: _shard(name, tensor, rank, size) for name, tensor in state.items()}


def merge_megatron_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], *, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The full (TP 1) megatron state dict from every tensor-parallel rank's shard, in rank
    order: the inverse of ``shard_megatron_state`` (``vocab_size`` is the unpadded one)."""
    if not shards:
        raise ValueError("no shards to merge")
    names = list(shards[0])
    if any(list(shard) != names for shard in shards[1:]):
        raise ConversionError("the shards do not hold the same tensors")
    return {name: _merge(name, [shard[name] for shard in shards], vocab_size) for name in names}


def _tensor_parallel_group() -> Any:
    """megatron's tensor-parallel group, or None when there is no tensor parallelism."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def _local_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """This rank's parameters by megatron name, detached, without ``_extra_state``."""
    return {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if not name.endswith("._extra_state")
    }


def _gathered_state_dict(
    model: GPTModel, *, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The full megatron state dict, gathered tensor by tensor over the tensor-parallel group
    (every rank of it calls this); each full tensor moved to ``device`` when given."""
    local = _local_state_dict(model)
    group = _tensor_parallel_group()
    if group is None:
        return {n: t if device is None else t.to(device) for n, t in local.items()}
    size = torch.distributed.get_world_size(group)
    vocab = getattr(model, "corral_vocab_size", None)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():  # the same names in the same order on every rank
        if _split_of(name) == "replicated":
            full = tensor.clone()
        else:
            parts = [torch.empty_like(tensor) for _ in range(size)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            rows = vocab if vocab is not None else tensor.shape[0] * size
            full = _merge(name, parts, rows)
        out[name] = full if device is None else full.to(device)
    return out


@on_device
def megatron_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's parameters by megatron name, full (TP 1 layout, unpadded vocabulary),
    without the local spec's ``_extra_state`` placeholders, on the model's device.

    Without tensor parallelism the tensors are the parameters detached (sharing storage);
    under it they are gathered copies, and every rank of the tensor-parallel group must call
    this (each gets the full dict)."""
    return _gathered_state_dict(model)


@on_device
def load_megatron_state_dict(model: GPTModel, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the full (TP 1) megatron state dict ``state`` into ``model``'s parameters (cast to
    their dtype and device); under tensor parallelism, this rank's shard of it.

    Strict but for ``_extra_state``: raises ``ConversionError`` listing missing or unexpected
    names, and ``RuntimeError`` (torch's) on a shape mismatch; on an error nothing is copied.
    """
    expected = set(_local_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    group = _tensor_parallel_group()
    if group is not None:
        size = torch.distributed.get_world_size(group)
        state = shard_megatron_state(state, torch.distributed.get_rank(group), size)
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


@on_device
def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[GPTModel, ModelSpec]:
    """A megatron-core model holding the weights of the Hugging Face model folder ``path``:
    under tensor parallelism, this rank's shard (every rank reads the folder and keeps its
    own; every rank of the world calls this).

    Needs ``corral.trainer.megatron_runtime.setup`` first. ``dtype`` defaults to the checkpoint's.
    Raises ``UnsupportedModelError`` for an architecture ``ModelSpec`` refuses or one that does
    not split over the tensor-parallel ranks, ``ConversionError`` for weights that do not fit
    the config, ``FileNotFoundError`` without safetensors files.
    """
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(path)))
    group = _tensor_parallel_group()
    check_tensor_parallel(spec, 1 if group is None else torch.distributed.get_world_size(group))
    hf = read_hf_state_dict(path)
    state = hf_to_megatron(hf, spec)
    model = build_model(
        spec, dtype=dtype or state["embedding.word_embeddings.weight"].dtype, init=False
    )
    load_megatron_state_dict(model, state)
    return model, spec


@on_device
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

    In a world of several ranks every rank calls this: data-parallel rank 0's tensor-parallel
    group gathers the full weights (to CPU, a tensor at a time), its tensor-parallel rank 0
    writes the folder, and every rank returns once it is written (a barrier).
    """
    from corral.trainer import parallel

    out = Path(out_dir)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        _write_hf_folder(megatron_state_dict(model), spec, out, tokenizer_from, dtype)
        return out
    if parallel.data_parallel_rank() == 0:
        full = _gathered_state_dict(model, device=torch.device("cpu"))
        if parallel.tensor_parallel_rank() == 0:
            _write_hf_folder(full, spec, out, tokenizer_from, dtype)
        del full
    parallel.barrier()
    return out


def _write_hf_folder(
    state: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    out: Path,
    tokenizer_from: str | Path | None,
    dtype: torch.dtype | None,
) -> None:
    """``save_hf_checkpoint``'s files, from the full megatron state dict ``state``."""
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True, exist_ok=True)
    hf = megatron_to_hf(state, spec)
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
