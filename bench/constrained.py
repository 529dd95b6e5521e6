"""Grammar libraries for the local engine's constrained decoding, measured on this machine.

Run: ``python bench/constrained.py [--tokenizer DIR ...] [--big-vocab DIR] [--walks 20]``.

Compares llguidance, xgrammar and outlines-core (each skipped, saying so, when it is not
installed) on the tiny test model's tokenizer and on a realistic ~150k-entry byte-level BPE
(``--big-vocab DIR``: trained once into DIR with ``tokenizers`` on generated multilingual text,
Qwen 2's pre-tokenizer, about two minutes on two cores; reused when DIR exists). Per library and
tokenizer:

- ``setup``: building the library's view of the tokenizer (once per engine);
- per JSON schema: ``compile`` (schema to a matcher, no cache), and along the canonical
  tokenization of a valid instance (strings with accents, CJK and emoji, so that multi-byte
  characters are split across byte-level tokens): the mask time per token (p50/p99, into an
  int32 bitmask) and whether every next token was allowed and EOS allowed at the end;
- random walks (``--walks``): tokens drawn among the allowed ones (biased towards tokens that
  close strings and objects so that walks end), EOS taken when allowed with probability 0.3;
  each finished walk's decoded text must parse and validate (``jsonschema``); a walk whose
  mask allows nothing is a dead end (a library bug);
- install size: the distribution's files plus its required dependencies that corral's
  ``local`` extra does not already bring (xgrammar requires triton on Linux x86_64).

Measured on the 2-core development machine (shared with other jobs, so +-50%), 150k vocabulary,
cp311 manylinux wheels of llguidance 1.6.1, xgrammar 0.2.9, outlines-core 0.2.14:

=============  =========  =====  ===============  ===================  ======================
library        install    setup  compile (3 sch.)  mask p50/p99 (walks)  correctness
=============  =========  =====  ===============  ===================  ======================
llguidance     8 MB       1.8 s  0.7-1.5 ms        8-13 / 67-79 us      all valid, no dead end
xgrammar       1057 MB a  1.6 s  51-130 ms         18-25 / 97-119 us    all valid, no dead end
outlines-core  5 MB       0.7 s  0.35-1.7 s b      250-265 us / 3-4 ms  all valid, no dead end
=============  =========  =====  ===============  ===================  ======================

(a) triton (1043 MB) and apache-tvm-ffi (11 MB). (b) tool_args and nested only; the schema-free
``{"type": "object"}`` took 7-10 s to compile for the 788-token tiny vocabulary already.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMAS: dict[str, dict[str, Any]] = {
    "tool_args": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer"},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
            },
            "priority": {"enum": ["low", "normal", "high"]},
            "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "gift": {"type": "boolean"},
        },
        "required": ["id", "customer", "items"],
        "additionalProperties": False,
    },
    "any_object": {"type": "object"},
}

INSTANCES: dict[str, Any] = {
    "tool_args": {"city": "São Paulo 東京 🌧", "unit": "celsius"},
    "nested": {
        "id": 42,
        "customer": {"name": "Zoë Ångström", "email": "zoe@example.com"},
        "items": [{"sku": "ab-1", "qty": 2, "price": 9.5}, {"sku": "日本", "qty": 1}],
        "priority": "high",
        "notes": None,
        "gift": False,
    },
    "any_object": {"a": [1, {"b": "ü"}], "c": None, "d": "🙂"},
}


# ---------------------------------------------------------------------------------------------
# Library adapters: the same four operations over each library


class Matcher(Protocol):
    def fill(self, bitmask: np.ndarray) -> None: ...
    def advance(self, token: int) -> bool: ...


class Library(Protocol):
    name: str

    def setup(self, tokenizer: Any, vocab: int) -> None: ...
    def compile(self, schema: str) -> Callable[[], Matcher]: ...


class _LLGMatcher:
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def fill(self, bitmask: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def advance(self, token: int) -> bool:
        return bool(self.m.consume_token(token))


class LLGuidance:
    name = "llguidance"

    def setup(self, tokenizer: Any, vocab: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(
            tokenizer.backend_tokenizer.to_str(),
            n_vocab=vocab,
            eos_token=tokenizer.eos_token_id,
        )

    def compile(self, schema: str) -> Callable[[], Matcher]:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        first = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if first.is_error():
            raise ValueError(first.get_error())
        return lambda: _LLGMatcher(self.llg.LLMatcher(self.tok, grammar, log_level=0))


class _XGRMatcher:
    def __init__(self, matcher: Any, torch: Any) -> None:
        self.m = matcher
        self.torch = torch

    def fill(self, bitmask: np.ndarray) -> None:
        self.m.fill_next_token_bitmask(self.torch.from_numpy(bitmask))

    def advance(self, token: int) -> bool:
        return bool(self.m.accept_token(token))


class XGrammar:
    name = "xgrammar"

    def setup(self, tokenizer: Any, vocab: int) -> None:
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema: str) -> Callable[[], Matcher]:
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False)
        return lambda: _XGRMatcher(self.xgr.GrammarMatcher(compiled), self.torch)


class _OCMatcher:
    def __init__(self, guide: Any, eos: int) -> None:
        self.g = guide
        self.eos = eos

    def fill(self, bitmask: np.ndarray) -> None:
        self.g.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def advance(self, token: int) -> bool:
        if token == self.eos:
            return bool(self.g.is_finished())
        self.g.advance(token, return_tokens=False)
        return True


class OutlinesCore:
    name = "outlines-core"

    def setup(self, tokenizer: Any, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.eos = int(tokenizer.eos_token_id)
        from corral.engines.local.grammar import byte_decoder

        table = byte_decoder()
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        special = set(tokenizer.all_special_ids)
        words: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i in special or i >= vocab:
                continue
            raw = text.encode() if text in added else bytes(table[c] for c in text)
            words.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos, words)

    def compile(self, schema: str) -> Callable[[], Matcher]:
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="[ ]?")
        index = self.oc.Index(regex, self.vocabulary)
        return lambda: _OCMatcher(self.oc.Guide(index), self.eos)


LIBRARIES: dict[str, Callable[[], Library]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "outlines-core": OutlinesCore,
}
_DISTRIBUTION = {
    "llguidance": "llguidance",
    "xgrammar": "xgrammar",
    "outlines-core": "outlines_core",
}


# ---------------------------------------------------------------------------------------------
# Measurements


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@dataclass
class Result:
    setup_s: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    mask_us: dict[str, tuple[float, float]] = field(default_factory=dict)
    canonical_ok: dict[str, bool] = field(default_factory=dict)
    walks: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # done/ok/bad/dead
    walk_mask_us: dict[str, tuple[float, float]] = field(default_factory=dict)
    error: str = ""


def _canonical(
    make: Callable[[], Matcher], ids: list[int], eos: int, vocab: int
) -> tuple[bool, list[float]]:
    m = make()
    words = (vocab + 31) // 32
    bitmask = np.full(words, -1, dtype=np.int32)
    times, ok = [], True
    for token in [*ids, eos]:
        t = time.perf_counter()
        m.fill(bitmask)
        times.append((time.perf_counter() - t) * 1e6)
        if not _allowed(bitmask, vocab)[token]:
            ok = False
            break
        if token != eos and not m.advance(token):
            ok = False
            break
    return ok, times


def _walks(
    make: Callable[[], Matcher],
    tokenizer: Any,
    schema: dict[str, Any],
    eos: int,
    vocab: int,
    n: int,
    closers: np.ndarray,
    times: list[float],
) -> tuple[int, int, int, int]:
    import jsonschema

    done = ok = bad = dead = 0
    words = (vocab + 31) // 32
    for seed in range(n):
        rng = np.random.default_rng(seed)
        m = make()
        bitmask = np.full(words, -1, dtype=np.int32)
        ids: list[int] = []
        finished = False
        for _ in range(1000):
            t = time.perf_counter()
            m.fill(bitmask)
            times.append((time.perf_counter() - t) * 1e6)
            allowed = _allowed(bitmask, vocab)
            if not allowed.any():
                dead += 1
                break
            if allowed[eos] and (allowed.sum() == 1 or rng.random() < 0.3):
                finished = True
                break
            allowed[eos] = False
            weights = np.where(allowed, np.where(closers, 20.0, 1.0), 0.0)
            token = int(rng.choice(vocab, p=weights / weights.sum()))
            if not m.advance(token):
                dead += 1
                break
            ids.append(token)
        if not finished:
            continue
        done += 1
        try:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    return done, ok, bad, dead


def _p50_p99(times: list[float]) -> tuple[float, float]:
    if not times:
        return (float("nan"), float("nan"))
    times = sorted(times)
    return times[len(times) // 2], times[min(len(times) - 1, len(times) * 99 // 100)]


def measure(lib: Library, tokenizer: Any, vocab: int, walks: int, schemas: list[str]) -> Result:
    res = Result()
    eos = int(tokenizer.eos_token_id)
    t = time.perf_counter()
    lib.setup(tokenizer, vocab)
    res.setup_s = time.perf_counter() - t
    texts = [tokenizer.decode([i]) for i in range(min(vocab, len(tokenizer)))]
    closers = np.zeros(vocab, dtype=bool)
    closers[: len(texts)] = [any(c in s for c in '"}],') for s in texts]
    for name in schemas:
        schema = SCHEMAS[name]
        text = json.dumps(schema)
        runs, make = [], None
        for _ in range(3):
            t = time.perf_counter()
            make = lib.compile(text)
            make().fill(np.full((vocab + 31) // 32, -1, dtype=np.int32))  # first mask included
            runs.append((time.perf_counter() - t) * 1e3)
        assert make is not None
        res.compile_ms[name] = statistics.median(runs)
        ids = tokenizer.encode(json.dumps(INSTANCES[name], ensure_ascii=False))
        ok, times = _canonical(make, ids, eos, vocab)
        res.canonical_ok[name] = ok
        res.mask_us[name] = _p50_p99(times)
        walk_times: list[float] = []
        res.walks[name] = _walks(make, tokenizer, schema, eos, vocab, walks, closers, walk_times)
        res.walk_mask_us[name] = _p50_p99(walk_times)
    return res


def install_mb(lib: str) -> tuple[float, str]:
    """The distribution's size plus its required dependencies outside corral's ``local`` extra."""
    have = {"torch", "transformers", "tokenizers", "jinja2", "numpy", "pydantic"}
    have |= {"typing-extensions", "typing_extensions"}
    dist = md.distribution(_DISTRIBUTION[lib])
    total = sum((f.size or 0) for f in dist.files or [])
    extra = []
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        if name.lower() in have:
            continue
        try:
            dep = md.distribution(name)
        except md.PackageNotFoundError:
            extra.append(f"{name} (not installed)")
            continue
        size = sum((f.size or 0) for f in dep.files or [])
        total += size
        extra.append(f"{name} {size / 1e6:.0f} MB")
    return total / 1e6, ", ".join(extra)


# ---------------------------------------------------------------------------------------------
# The realistic tokenizer


def _corpus(rng: random.Random) -> Iterator[str]:
    scripts = [
        ("abcdefghijklmnopqrstuvwxyz", 6),
        ("абвгдежзийклмнопрстуфхцчшщыэюя", 2),
        ("αβγδεζηθικλμνξοπρστυφχψω", 1),
        ("".join(chr(c) for c in range(0x4E00, 0x4E00 + 3000)), 2),
        ("".join(chr(c) for c in range(0x3041, 0x3097)), 1),
        ("àáâäçèéêëìíîïñòóôöùúûüß", 1),
    ]
    alphabets = [s for s, _ in scripts]
    weights = [w for _, w in scripts]

    def word() -> str:
        s = rng.choices(alphabets, weights)[0]
        n = rng.randint(1, 4) if len(s) > 1000 else rng.randint(2, 11)
        w = "".join(rng.choice(s) for _ in range(n))
        return w.capitalize() if rng.random() < 0.1 else w

    lexicon = sorted({word() for _ in range(400_000)})
    rng.shuffle(lexicon)
    cum = list(itertools.accumulate(1.0 / (i + 10) ** 0.9 for i in range(len(lexicon))))
    punct = [" "] * 4 + [", ", ". ", "\n", ": ", "; ", "(", ")", '"', "'", " - ", "\t", "  "]
    punct += ["\n\n", "{", "}", "[", "]", " = ", "_", "/", "!", "?"]
    for _ in range(600_000):
        out = []
        for w in rng.choices(lexicon, cum_weights=cum, k=rng.randint(5, 40)):
            out += [w, rng.choice(punct)]
            if rng.random() < 0.05:
                out.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
        if rng.random() < 0.2:
            doc = {rng.choice(lexicon): rng.choice(lexicon), "n": rng.random(), "k": [1, 2]}
            out.append(json.dumps(doc, ensure_ascii=rng.random() < 0.5))
        yield "".join(out)


def build_big_vocab(out: Path) -> None:
    """Train a Qwen 2-like byte-level BPE (up to 151,643 merges' worth) into ``out``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=151_643,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(random.Random(0)), trainer)
    bpe.add_special_tokens([AddedToken(s, special=True) for s in ("<|im_start|>", "<|im_end|>")])
    markers = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>")
    bpe.add_tokens([AddedToken(s, special=False, normalized=False) for s in markers])
    PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(out))


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="HF tokenizer folder")
    parser.add_argument("--big-vocab", type=Path, help="folder of the ~150k BPE (built if absent)")
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--schemas", default=",".join(SCHEMAS))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    schemas = args.schemas.split(",")
    folders = list(args.tokenizer)
    if not folders:
        from corral.engines.tiny_model import cached_tiny_model

        folders.append(str(cached_tiny_model("qwen25")))
    if args.big_vocab is not None:
        if not (args.big_vocab / "tokenizer.json").exists():
            t = time.perf_counter()
            build_big_vocab(args.big_vocab)
            print(f"built {args.big_vocab} in {time.perf_counter() - t:.0f} s")
        folders.append(str(args.big_vocab))

    for lib_name in args.libraries.split(","):
        try:
            size, deps = install_mb(lib_name)
            version = md.version(_DISTRIBUTION[lib_name])
        except md.PackageNotFoundError:
            print(f"\n## {lib_name}: not installed, skipped")
            continue
        print(f"\n## {lib_name} {version}: install {size:.0f} MB ({deps or 'no new deps'})")
        for folder in folders:
            tok = AutoTokenizer.from_pretrained(folder)
            vocab = len(tok)
            try:
                res = measure(LIBRARIES[lib_name](), tok, vocab, args.walks, schemas)
            except Exception as exc:
                print(f"  {Path(folder).name} (vocab {vocab}): FAILED {type(exc).__name__}: {exc}")
                continue
            print(f"  {Path(folder).name} (vocab {vocab}): setup {res.setup_s * 1e3:.0f} ms")
            for name in schemas:
                p50, p99 = res.mask_us[name]
                w50, w99 = res.walk_mask_us[name]
                done, ok, bad, dead = res.walks[name]
                print(
                    f"    {name:<11} compile {res.compile_ms[name]:8.1f} ms | mask us p50/p99: "
                    f"canonical {p50:.0f}/{p99:.0f}, walks {w50:.0f}/{w99:.0f} | canonical "
                    f"{'ok' if res.canonical_ok[name] else 'REJECTED'} | walks: {done} ended, "
                    f"{ok} valid, {bad} INVALID, {dead} dead ends"
                )


if __name__ == "__main__":
    main()
