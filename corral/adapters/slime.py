"""slime's custom generate function, dynamic sampling filter and reward post-process, backed by
corral's player and gateway.

Launch flags and the data layout are in ``docs/slime.md``. The contracts followed here were read
from slime's source at commit :data:`SLIME_COMMIT` (``slime/utils/types.py``,
``slime/rollout/sglang_rollout.py``, ``slime/rollout/filter_hub/base_types.py``,
``slime/ray/rollout.py``):

- ``generate(args, sample, sampling_params, evaluation=False)`` is awaited by slime's
  ``generate_and_rm`` for every sample of a group; it may return a ``Sample`` or a
  ``list[Sample]``. This one always returns a list (one shape for every rollout, so slime's
  flattening of ``list[list[list[Sample]]]`` holds), every sample with ``rollout_id`` set to the
  same int, so slime's loss reducer counts the rollout once. Every returned sample carries a
  float reward, so slime never calls its own reward model for them.
- The dynamic sampling filter is called as ``fn(args, group)`` where ``group`` holds one entry per
  ``--n-samples-per-prompt``: a ``Sample`` or, with this generate, a ``list[Sample]``. It returns
  a ``DynamicFilterOutput(keep, reason)``; slime counts drops per reason as the metric
  ``rollout/dynamic_filter/drop_{reason}``, so reasons here are short fixed words.
- When slime has enough groups it sets ``GenerateState.aborted``, aborts every engine request
  and waits for the generates still running (it does not cancel them). A flag is all it offers,
  so a running generate polls it and, once set, cancels its rollout (the player closes the
  episode and deletes the session) and returns one ``ABORTED`` sample. Cancelling the generate
  task itself does the same and re-raises.

slime's types are taken from the objects slime hands over (``type(sample)``, its ``Status``), and
``DynamicFilterOutput`` / ``GenerateState`` are looked up lazily under slime's module names, so
nothing here imports slime at import time and a stand-in registered under those names serves as
slime in tests.

The gateway: unless ``CORRAL_GATEWAY_URL`` names a running one (admin token in
``CORRAL_GATEWAY_ADMIN_TOKEN``), the first generate in a process serves corral's gateway on
127.0.0.1 in a background thread, in front of slime's router at ``args.sglang_router_ip`` /
``args.sglang_router_port``, with the tokenizer of ``args.hf_checkpoint``.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import os
import secrets
import statistics
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from corral.gateway.client import GatewayAdmin
from corral.rollouts.player import Player, Rollout
from corral.rollouts.rows import Row, RowMetadata
from corral.samples import Sample as CorralSample

logger = logging.getLogger(__name__)

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

GATEWAY_URL_VAR = "CORRAL_GATEWAY_URL"
GATEWAY_TOKEN_VAR = "CORRAL_GATEWAY_ADMIN_TOKEN"
TOOL_CALL_PARSER_VAR = "CORRAL_TOOL_CALL_PARSER"
REASONING_PARSER_VAR = "CORRAL_REASONING_PARSER"

# Metadata keys this adapter writes (besides the session's own and the row's).
FAILURE_KEY = "failure"  # why the rollout failed; present only when it did
ABORTED_KEY = "aborted"  # why the rollout was cut short by the trainer
SCORES_KEY = "scores"
TIMING_KEY = "timing"
TURNS_KEY = "episode_turns"

# The reasons keep_scored_groups gives (metric names in slime: keep them short and fixed).
DROP_FAILED = "failed_rollout"
DROP_ABORTED = "aborted_rollout"

# How often a running generate looks at slime's abort flag (seconds).
ABORT_POLL_S = 0.5

# slime's advantage estimators that normalise rewards within a group, and those of them that
# also divide by the group's standard deviation (slime/ray/rollout.py).
_GROUP_NORMALISED = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
_STD_NORMALISED = frozenset({"grpo", "gspo", "cispo"})

# SGLang reasoning parser names that corral spells differently.
_REASONING_ALIASES = {"deepseek-r1": "deepseek_r1", "qwen3-thinking": "qwen3"}


# --------------------------------------------------------------------------- sampling


def session_sampling(sampling_params: Mapping[str, Any], *, evaluation: bool) -> dict[str, Any]:
    """slime's ``sampling_params`` as a corral session's sampling overrides.

    Mapped: ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens`` (per model turn, as
    ``max_tokens``), ``stop``, ``sampling_seed`` (as ``seed``). Ignored, because they only shape
    the engine's detokenised text and corral records token ids and detokenises itself:
    ``skip_special_tokens``, ``no_stop_trim``, ``spaces_between_special_tokens``.
    Anything else set to a value that changes sampling raises ``ValueError`` naming it, and so
    does top-p token replay in training (``custom_params.return_top_p_token_ids``, which slime asks
    for when ``--rollout-top-p`` is not 1 and then requires on every sample).
    """
    mapping = {
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "max_new_tokens": "max_tokens",
        "stop": "stop",
        "sampling_seed": "seed",
    }
    formatting = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
    out: dict[str, Any] = {}
    refused: list[str] = []
    for key, value in sampling_params.items():
        if key in mapping:
            if value is not None and value != []:
                out[mapping[key]] = value
        elif key == "custom_params":
            custom = dict(value or {})
            if evaluation:
                custom.pop("return_top_p_token_ids", None)  # no training step reads it
            if custom.get("return_top_p_token_ids"):
                raise ValueError(
                    "slime asks for top-p token replay (--rollout-top-p is not 1.0), which "
                    "corral's samples do not carry; run with --rollout-top-p 1.0"
                )
            refused.extend(f"custom_params.{k}" for k, v in custom.items() if v)
        elif key not in formatting and not _neutral(key, value):
            refused.append(key)
    if refused:
        raise ValueError(
            f"corral's sessions cannot honour slime's sampling parameter(s) {sorted(refused)}; "
            f"supported: {sorted(mapping)}"
        )
    return out


def _neutral(key: str, value: Any) -> bool:
    """Whether ``value`` leaves sampling as if ``key`` were not given."""
    if value is None or value == [] or value == {}:
        return True
    if key == "repetition_penalty":
        return bool(value == 1.0)
    return key == "min_new_tokens" and value == 0


# --------------------------------------------------------------------------- the gateway


def gateway_settings(args: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:class:`~corral.gateway.settings.GatewaySettings` overrides from slime's ``args``.

    ``tool_call_parser`` / ``reasoning_parser``: ``$CORRAL_TOOL_CALL_PARSER`` /
    ``$CORRAL_REASONING_PARSER`` when set, else slime's ``--sglang-tool-call-parser`` /
    ``--sglang-reasoning-parser`` (SGLang's names), else the gateway's defaults.
    ``chat_template_kwargs``: ``--apply-chat-template-kwargs``. ``max_context_tokens``:
    ``--rollout-max-context-len`` when set (else the model's window). ``engine_timeout_s``:
    ``--sglang-router-request-timeout-secs``.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    tool_parser = env.get(TOOL_CALL_PARSER_VAR) or getattr(args, "sglang_tool_call_parser", None)
    if tool_parser:
        out["tool_call_parser"] = tool_parser
    reasoning = env.get(REASONING_PARSER_VAR) or getattr(args, "sglang_reasoning_parser", None)
    if reasoning:
        out["reasoning_parser"] = _REASONING_ALIASES.get(reasoning, reasoning)
    kwargs = getattr(args, "apply_chat_template_kwargs", None)
    if isinstance(kwargs, str):  # slime parses it with json.loads; a config file may not
        kwargs = json.loads(kwargs or "{}")
    if kwargs:
        out["chat_template_kwargs"] = dict(kwargs)
    context = getattr(args, "rollout_max_context_len", None)
    if context:
        out["max_context_tokens"] = int(context)
    timeout = getattr(args, "sglang_router_request_timeout_secs", None)
    if timeout:
        out["engine_timeout_s"] = float(timeout)
    return out


def router_url(args: Any) -> str:
    """slime's SGLang router, from ``args.sglang_router_ip`` / ``args.sglang_router_port``."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not ip or not port:
        raise ValueError(
            "slime's router address is not set (args.sglang_router_ip / sglang_router_port); "
            f"or set {GATEWAY_URL_VAR} to a running corral gateway"
        )
    if ":" in ip and not ip.startswith("["):
        ip = f"[{ip}]"  # an IPv6 literal
    return f"http://{ip}:{port}"


@dataclass(frozen=True)
class ServedGateway:
    """The gateway this process's rollouts use: its URL and admin token, the tokenizer that
    decodes sample text (``None`` without ``args.hf_checkpoint``), and what stops it when this
    process serves it (``None`` for a gateway named by ``CORRAL_GATEWAY_URL``)."""

    url: str
    admin_token: str | None
    tokenizer: Any
    stack: ExitStack | None


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def _start_gateway(args: Any) -> ServedGateway:
    """Serve corral's gateway in front of slime's router, or take the one named in the
    environment. Blocking (loads a tokenizer, starts a server thread)."""
    checkpoint = getattr(args, "hf_checkpoint", None)
    named = os.environ.get(GATEWAY_URL_VAR)
    if named:
        logger.info("corral: using the gateway at %s", named)
        token = os.environ.get(GATEWAY_TOKEN_VAR) or None
        return ServedGateway(named.rstrip("/"), token, _load_tokenizer(checkpoint), None)
    if not checkpoint:
        raise ValueError(
            "args.hf_checkpoint is not set (the gateway's tokenizer and template); "
            f"or set {GATEWAY_URL_VAR} to a running corral gateway"
        )
    from corral.gateway.launch import GatewayLaunch
    from corral.stack.gateway import gateway_in_thread

    engine = router_url(args)
    settings = gateway_settings(args)
    # Only this process talks to it, but it listens on a port: its admin API needs a secret.
    token = secrets.token_urlsafe(24)
    launch = GatewayLaunch(engine_url=engine, model=Path(checkpoint))
    stack = ExitStack()
    url = stack.enter_context(gateway_in_thread(launch, admin_token=token, **settings))
    logger.info("corral: gateway at %s in front of %s (%s)", url, engine, settings)
    return ServedGateway(url, token, _load_tokenizer(checkpoint), stack)


class _ProcessGateway:
    """One gateway per process, started by the first rollout that needs it (thread-safe: slime
    may call from more than one thread; async-safe: the blocking start runs off the loop), and
    one player (with its admin and OpenAI clients) per event loop (an HTTP client belongs to
    the loop that made it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: ServedGateway | None = None
        self._players: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, Player]] = (
            weakref.WeakKeyDictionary()
        )

    async def get(self, args: Any) -> ServedGateway:
        served = self._served
        if served is None:
            served = await asyncio.to_thread(self._start_once, args)
        return served

    def _start_once(self, args: Any) -> ServedGateway:
        with self._lock:
            if self._served is None:
                self._served = _start_gateway(args)
            return self._served

    def player(self, served: ServedGateway) -> Player:
        """This loop's player for ``served`` (sampling is given per rollout)."""
        loop = asyncio.get_running_loop()
        cached = self._players.get(loop)
        if cached is None or cached[0] != served.url:
            cached = (served.url, Player(GatewayAdmin(served.url, served.admin_token)))
            self._players[loop] = cached
        return cached[1]

    async def close_clients(self) -> None:
        """Close this loop's player and admin clients (the next rollout makes new ones)."""
        cached = self._players.pop(asyncio.get_running_loop(), None)
        if cached is not None:
            await cached[1].aclose()
            await cached[1].gateway.aclose()

    def stop(self) -> None:
        with self._lock:
            served, self._served = self._served, None
        if served is not None and served.stack is not None:
            served.stack.close()


_GATEWAY = _ProcessGateway()


async def close_clients() -> None:
    """Close the HTTP clients rollouts on the running loop use (call it on that loop before
    the loop ends, or aiohttp warns of unclosed sessions); the gateway keeps running."""
    await _GATEWAY.close_clients()


def shutdown() -> None:
    """Stop the gateway this process serves (if any); the next generate starts a fresh one and
    reads ``CORRAL_GATEWAY_URL`` again. For tests and orderly shutdown; a process that just
    exits needs nothing (the server thread is a daemon)."""
    _GATEWAY.stop()


# --------------------------------------------------------------------------- rows and samples


def row_from_sample(sample: Any) -> Row:
    """The corral row a slime sample was read from: ``sample.prompt`` is the row's ``messages``
    (slime's ``--input-key messages`` without ``--apply-chat-template``) and ``sample.metadata``
    holds the row's ``metadata`` (``--metadata-key metadata``; other keys are ignored here)."""
    prompt = sample.prompt
    if isinstance(prompt, str):
        raise ValueError(
            "sample.prompt is text, not the row's messages: launch slime with --input-key "
            "messages and without --apply-chat-template (corral's gateway renders the template)"
        )
    metadata = sample.metadata or {}
    fields = {k: metadata[k] for k in RowMetadata.model_fields if k in metadata}
    try:
        return Row.model_validate({"messages": prompt, "metadata": fields})
    except ValidationError as exc:
        raise ValueError(
            "sample.metadata is not a corral row's metadata (launch slime with --metadata-key "
            f"metadata on rows written by `corral rows`): {exc}"
        ) from None


def rollout_number(sample: Any, session_id: str) -> int:
    """The int slime groups a rollout's samples by: the input sample's ``rollout_id``, else its
    ``index`` (unique per rollout in slime's data source), else one derived from the session id
    (60 bits of its hash: collisions are negligible within a step)."""
    for value in (getattr(sample, "rollout_id", None), getattr(sample, "index", None)):
        if value is not None:
            return int(value)
    return int(hashlib.sha256(session_id.encode()).hexdigest()[:15], 16)


def _summary(rollout: Rollout) -> dict[str, Any]:
    """What every sample of the episode says about it, besides the session's metadata."""
    summary: dict[str, Any] = {
        "session_id": rollout.session_id,
        SCORES_KEY: dict(rollout.scores),
        TURNS_KEY: rollout.turns,
        TIMING_KEY: {
            "model_s": rollout.timing.model_s,
            "tools_s": rollout.timing.tools_s,
            "total_s": rollout.timing.total_s,
        },
    }
    if rollout.failed:
        summary[FAILURE_KEY] = rollout.reason
    return summary


def _derived(base: Any, rollout_id: int, *metadata: Mapping[str, Any]) -> Any:
    """A deep copy of the framework's input sample (prompt, label, group and index kept) for
    one output, its metadata updated with each of ``metadata`` in turn."""
    out = copy.deepcopy(base)
    out.rollout_id = rollout_id
    merged = dict(out.metadata or {})
    for part in metadata:
        merged.update(part)
    out.metadata = merged
    return out


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    return "" if tokenizer is None or not tokens else str(tokenizer.decode(tokens))


def training_samples(
    rollout: Rollout, base: Any, rollout_id: int, tokenizer: Any = None
) -> list[Any]:
    """The episode's samples as the framework's ``Sample`` type (that of ``base``), token for
    token the gateway's: ``tokens``, ``response_length``, ``loss_mask``, ``rollout_log_probs``;
    ``status`` by value; ``reward`` the episode's (0.0 for a failed rollout, which is flagged
    with ``metadata["failure"]``, status ``FAILED`` or ``ABORTED``, and ``remove_sample``);
    ``metadata`` the input sample's, then the session's, then the episode summary."""
    status_type = type(base).Status
    reward = 0.0 if rollout.reward is None else float(rollout.reward)
    non_generation = max(0.0, rollout.timing.total_s - rollout.timing.model_s)
    out = []
    for s in rollout.samples:
        sample = _derived(base, rollout_id, s.metadata, _summary(rollout))
        sample.tokens = list(s.tokens)
        sample.response_length = s.response_length
        sample.response = _decode(tokenizer, s.tokens[s.prompt_length :])
        sample.loss_mask = list(s.loss_mask)
        sample.rollout_log_probs = list(s.rollout_log_probs)
        sample.reward = reward
        sample.status = status_type(s.status)
        sample.remove_sample = s.remove_sample or rollout.failed
        versions = s.metadata.get("weight_versions") or []
        sample.weight_versions = [str(v) for v in versions if v is not None]
        sample.non_generation_time = non_generation
        out.append(sample)
    return out


def evaluation_sample(rollout: Rollout, base: Any, rollout_id: int) -> Any:
    """One sample for the whole episode carrying only its reward (0.0 when the rollout failed,
    which is flagged), so an eval mean is a mean over episodes. No tokens: nothing to train."""
    status_type = type(base).Status
    sample = _derived(base, rollout_id, _summary(rollout))
    sample.tokens, sample.response_length, sample.loss_mask = [], 0, []
    sample.rollout_log_probs = []
    sample.response = _last_assistant_text(rollout.messages)
    sample.reward = 0.0 if rollout.reward is None else float(rollout.reward)
    last: CorralSample | None = rollout.samples[-1] if rollout.samples else None
    if rollout.failed:
        sample.status = status_type.FAILED
    else:
        sample.status = status_type(last.status if last is not None else "completed")
    sample.remove_sample = True
    sample.non_generation_time = max(0.0, rollout.timing.total_s - rollout.timing.model_s)
    return sample


def aborted_sample(base: Any, rollout_id: int, why: str) -> Any:
    """The one sample of a rollout the trainer cut short: ``ABORTED``, nothing to train on."""
    sample = _derived(base, rollout_id, {ABORTED_KEY: why})
    sample.tokens, sample.response_length, sample.loss_mask = [], 0, []
    sample.rollout_log_probs = []
    sample.response = ""
    sample.reward = 0.0
    sample.status = type(base).Status.ABORTED
    sample.remove_sample = True
    return sample


def _last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


# --------------------------------------------------------------------------- playing


async def _until(flag: Callable[[], bool]) -> None:
    # The trainer offers a plain flag, no event to wait on: poll it.
    while not flag():  # noqa: ASYNC110
        await asyncio.sleep(ABORT_POLL_S)


async def _play_unless_aborted(
    player: Player, row: Row, aborted: Callable[[], bool] | None, **kw: Any
) -> Rollout | None:
    """Play ``row``; ``None`` when ``aborted()`` turned true first (the rollout was cancelled:
    the player closed its episode and deleted its session before this returns). Cancelling
    the caller cancels the rollout the same way, then re-raises."""
    if aborted is None:
        return await player.play(row, **kw)
    play = asyncio.ensure_future(player.play(row, **kw))
    watch = asyncio.ensure_future(_until(aborted))
    try:
        await asyncio.wait({play, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not play.done():
            play.cancel()
            # Wait for the player's cleanup (episode closed, session deleted) before going on.
            await asyncio.gather(play, return_exceptions=True)
    return None if play.cancelled() else play.result()


async def play_sample(
    args: Any,
    sample: Any,
    sampling_params: Mapping[str, Any],
    *,
    evaluation: bool,
    aborted: Callable[[], bool] | None,
    tokenizer: Any = None,
) -> list[Any]:
    """Play the row behind a framework's input ``sample`` and return the framework's samples
    (see :func:`training_samples`, :func:`evaluation_sample`, :func:`aborted_sample`).
    ``aborted``: the framework's "stop this step" flag, polled while the rollout runs.
    ``tokenizer`` decodes ``response`` text (default: the gateway's model's).

    Raises ``ValueError`` for a sample that is not a corral row or sampling corral cannot honour,
    and :class:`~corral.rollouts.player.PlayerError` for a row that cannot be played at all
    (e.g. its token variable is unset): configuration errors, not failed rollouts."""
    row = row_from_sample(sample)
    overrides = session_sampling(sampling_params, evaluation=evaluation)
    if aborted is not None and aborted():
        number = rollout_number(sample, secrets.token_hex(8))
        return [aborted_sample(sample, number, "the trainer aborted the step before it started")]
    served = await _GATEWAY.get(args)
    rollout = await _play_unless_aborted(
        _GATEWAY.player(served),
        row,
        aborted,
        group_index=sample.group_index,
        index=sample.index,
        sampling=overrides,
    )
    if rollout is None:
        number = rollout_number(sample, secrets.token_hex(8))
        return [aborted_sample(sample, number, "the trainer aborted the step while it ran")]
    number = rollout_number(sample, rollout.session_id)
    if rollout.failed:
        logger.info("corral: rollout %s failed: %s", rollout.session_id, rollout.reason)
    if evaluation:
        return [evaluation_sample(rollout, sample, number)]
    return training_samples(rollout, sample, number, tokenizer or served.tokenizer)


def slime_aborted() -> bool:
    """slime's "enough samples, stop" flag (``GenerateState.aborted``), read without creating
    slime's state: ``False`` when slime's rollout module or its state does not exist."""
    module = sys.modules.get("slime.rollout.sglang_rollout")
    state_type = getattr(module, "GenerateState", None)
    instances = getattr(state_type, "_instances", None)  # slime's SingletonMeta registry
    state = instances.get(state_type) if isinstance(instances, dict) else None
    return bool(getattr(state, "aborted", False))


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """slime's custom generate (``--custom-generate-function-path
    corral.adapters.slime.generate``): play the row behind ``sample`` and return its samples.

    Training: the session's samples, sharing one int ``rollout_id`` (the input's ``rollout_id``
    or ``index``), each with the episode's reward, tokens, loss mask, rollout logprobs, status and
    metadata (the input's merged with the session's and the episode's summary); a failed rollout
    is flagged (``metadata["failure"]``, status ``FAILED``/``ABORTED``, ``remove_sample``) for
    :func:`keep_scored_groups`. Evaluation: one sample per episode carrying only its reward.
    slime aborting the step while this runs: one ``ABORTED`` sample, the episode closed."""
    return await play_sample(
        args, sample, sampling_params, evaluation=evaluation, aborted=slime_aborted
    )


# --------------------------------------------------------------------------- the filter


def _leaves(samples: Any) -> Iterator[Any]:
    """Every sample in a group given as ``list[Sample]`` or ``list[list[Sample]]``."""
    if isinstance(samples, list | tuple):
        for item in samples:
            yield from _leaves(item)
    else:
        yield samples


def _rollout_key(sample: Any) -> Any:
    rid = getattr(sample, "rollout_id", None)
    return rid if rid is not None else getattr(sample, "index", None)


def flagged_rollouts(samples: Any) -> dict[Any, str]:
    """The flagged rollouts of a group, by rollout id: ``failed_rollout`` for one flagged
    failed (``metadata["failure"]`` or status ``FAILED``), else ``aborted_rollout`` for one cut
    short (status ``ABORTED``: a partial episode is no evidence of the policy's play)."""
    flagged: dict[Any, str] = {}
    for sample in _leaves(samples):
        status = getattr(getattr(sample, "status", None), "value", None)
        if (sample.metadata or {}).get(FAILURE_KEY) or status == "failed":
            flagged[_rollout_key(sample)] = DROP_FAILED
        elif status == "aborted":
            flagged.setdefault(_rollout_key(sample), DROP_ABORTED)
    return flagged


def group_verdict(samples: Any) -> tuple[bool, str | None]:
    """``(keep, reason)`` for a group: dropped as a whole when any rollout in it is flagged
    (``failed_rollout`` wins over ``aborted_rollout``)."""
    flagged = flagged_rollouts(samples)
    if not flagged:
        return True, None
    reason = DROP_FAILED if DROP_FAILED in flagged.values() else DROP_ABORTED
    logger.info("corral: dropping a group, rollouts flagged: %s", flagged)
    return False, reason


def keep_scored_groups(args: Any, samples: Any, **kwargs: Any) -> Any:
    """slime's dynamic sampling filter (``--dynamic-sampling-filter-path
    corral.adapters.slime.keep_scored_groups``): a ``DynamicFilterOutput`` that leaves out a
    whole group when any of its rollouts is flagged (reason ``failed_rollout`` or
    ``aborted_rollout``), so slime draws more rows; keeps it otherwise. ``samples`` is the group:
    one ``Sample`` or ``list[Sample]`` per rollout."""
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    keep, reason = group_verdict(samples)
    return DynamicFilterOutput(keep=keep, reason=reason)


# --------------------------------------------------------------------------- rewards


def _reward_value(args: Any, sample: Any) -> float:
    key = getattr(args, "reward_key", None)
    reward = sample.reward[key] if key else sample.reward
    return float(reward)


def normalize_group_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """A reward post-process (``--custom-reward-post-process-path
    corral.adapters.slime.normalize_group_rewards``) that does what slime's default GRPO
    normalisation does, but per rollout: the group baseline (and standard deviation) is taken
    over the group's rollouts, each counted once however many samples it produced, and every
    sample gets its rollout's normalised reward. slime's default reshapes rewards by sample
    count and, when rollouts produce several samples, falls back to one batch-wide group.

    Returns ``(raw_rewards, rewards)`` per sample, as slime expects. Groups are
    ``group_index``; rollouts ``rollout_id`` (else ``index``)."""
    raw = [_reward_value(args, s) for s in samples]
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in _GROUP_NORMALISED or not getattr(args, "rewards_normalization", True):
        return raw, list(raw)
    divide = estimator in _STD_NORMALISED and getattr(args, "grpo_std_normalization", True)
    per_group: dict[Any, dict[Any, float]] = {}
    for sample, reward in zip(samples, raw, strict=True):
        per_group.setdefault(sample.group_index, {})[_rollout_key(sample)] = reward
    stats: dict[Any, tuple[float, float]] = {}
    for group, rollouts in per_group.items():
        values = list(rollouts.values())
        spread = statistics.stdev(values) if len(values) > 1 else 0.0  # as torch.std: n - 1
        stats[group] = (statistics.fmean(values), spread)
    out = []
    for sample, reward in zip(samples, raw, strict=True):
        mean, spread = stats[sample.group_index]
        out.append((reward - mean) / (spread + 1e-6) if divide else reward - mean)
    return raw, out
