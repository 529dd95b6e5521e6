"""``corral run``: the main job on embedded defaults.

Stages on 127.0.0.1:

1. the gateway: build the tiny model (once, cached under the workdir), start the local engine
   and the gateway, and play tool-calling conversations through the official OpenAI SDK,
   exactly as a black-box agent would, then collect each session's samples and drift report;
2. the env server: serve the gridsim bundle with each episode's env in a sandbox of the
   ``sandbox`` backend (``local`` by default: a subprocess in a temporary folder, which runs on
   any machine), write its tasks as training rows, and play eval episodes over the WebSocket
   protocol with a scripted idle policy (the bundle's floor, 0.2);
3. rollouts: play eval rows the way slime would, through slime's custom-generate contract
   (:func:`corral.adapters.slime.generate`, with slime-shaped samples and the local engine as
   slime's router): the adapter serves its own gateway, the player runs each episode through
   it against the env server, and the samples (tokens, loss masks, logprobs, the verifier's
   reward) are saved;
4. the trained policy: the model examples/gridsim_rl trained (kept in the repository) plays
   eval days through its own local engine and gateway on the CPU, greedily, and its grades
   are reported (a model that solves gridsim, where the tiny model cannot).

The trainer joins this job as it lands (README, "RL engineer: train with corral's trainer").
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.progress import track
from rich.table import Table

from corral.engines.tiny_model import CITIES, CONDITIONS, TOOLS, cached_tiny_model
from corral.stack import local_stack

if TYPE_CHECKING:
    from corral.adapters.evals import EvalReport


@dataclass(frozen=True)
class EpisodeResult:
    session_id: str
    cities: list[str]
    answer: str
    reward: float
    turns: int
    samples: list[dict[str, Any]]
    drift: dict[str, Any]


def weather_tool(city: str, rng: random.Random) -> str:
    """The episode's tool, run here on the agent's side: a made-up forecast."""
    forecast = {"city": city, "weather": rng.choice(CONDITIONS), "temp_c": rng.randint(-5, 35)}
    return json.dumps(forecast)


def play_episode(
    gateway: str, rng: random.Random, *, stream: bool, max_turns: int = 4
) -> EpisodeResult:
    """One conversation through a fresh session with the OpenAI SDK. The reward is 1 when the
    model asked the tool for exactly the cities in the question and its final answer names
    each of them, else 0 (a toy verifier: the env server brings real ones)."""
    from openai import OpenAI

    session = httpx.post(f"{gateway}/sessions", json={"metadata": {"job": "corral run"}}).json()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    cities = rng.sample(CITIES, k=rng.choice([1, 2]))
    question = " and ".join(cities)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"What is the weather in {question}?"}
    ]
    asked: list[str] = []
    answer = ""
    for _ in range(max_turns):
        message = _ask(client, messages, stream=stream)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            answer = message.get("content") or ""
            break
        for call in calls:
            city = str(json.loads(call["function"]["arguments"]).get("city"))
            asked.append(city)
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": weather_tool(city, rng)}
            )
    reward = float(sorted(asked) == sorted(cities) and all(c in answer for c in cities))
    httpx.post(f"{gateway}/sessions/{session['id']}/reward", json={"reward": reward})
    view = httpx.get(f"{gateway}/sessions/{session['id']}").json()
    samples = httpx.get(f"{gateway}/sessions/{session['id']}/samples").json()
    httpx.delete(f"{gateway}/sessions/{session['id']}")
    return EpisodeResult(
        session_id=session["id"],
        cities=cities,
        answer=answer,
        reward=reward,
        turns=len(view["turns"]),
        samples=samples,
        drift=view["drift"],
    )


def _ask(client: Any, messages: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    kwargs = {"model": "tiny", "messages": messages, "tools": TOOLS, "temperature": 0}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return dict(reply.choices[0].message.model_dump(exclude_none=True))
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(
                tc.index,
                {"id": tc.id, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if tc.function and tc.function.name:
                slot["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["function"]["arguments"] += tc.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


DEFAULT_BUNDLE = Path(__file__).resolve().parents[1] / "bundles" / "gridsim"
# The policy examples/gridsim_rl trained (a 7M-parameter Qwen3, bf16): it plays gridsim on CPU.
TRAINED_GRIDSIM_POLICY = Path(__file__).resolve().parents[1] / "examples" / "gridsim_rl" / "model"


class PolicyMissing(FileNotFoundError):
    """The policy the main job was asked to play is not a model folder."""


async def _idle_episodes(url: str, split: str, count: int) -> list[float | None]:
    """Play ``count`` tasks of ``split`` submitting an all-idle schedule; their rewards."""
    from corral.envs.client import EnvClient

    rewards: list[float | None] = []
    for index in range(count):
        async with EnvClient(url) as client:
            await client.reset(split=split, index=index)
            result = await client.call_tool("submit_schedule", {"schedule": [0] * 24})
            rewards.append(result.reward)
    return rewards


def run_env_stage(
    bundle: Path,
    out: Path,
    episodes: int,
    console: Console,
    sandbox: str = "local",
    *,
    engine_url: str,
    model_dir: Path,
    policy: Path | None = None,
    policy_days: int = 0,
) -> None:
    from corral.adapters.rows import RowSettings, write_rows
    from corral.envs.server import build_app
    from corral.serving import serve_in_thread

    with serve_in_thread(build_app(bundle, sandbox=sandbox)) as url:
        console.print(f"env server {url} serving {bundle}, each episode in a {sandbox} sandbox")
        counts = write_rows(url, out / "rows", RowSettings())
        rewards = asyncio.run(_idle_episodes(url, "eval", episodes))
        run_slime_stage(out, episodes, console, engine_url=engine_url, model_dir=model_dir)
        if policy is not None and policy_days > 0:
            run_policy_stage(out, policy, policy_days, console)
    console.print(
        "rows: " + ", ".join(f"{name} {n}" for name, n in counts.items()) + f" in {out / 'rows'}"
    )
    console.print(
        f"{len(rewards)} eval episodes with the idle policy over the WebSocket: rewards "
        f"{rewards} (the verifier grades idling 0.2)"
    )


def run_slime_stage(
    out: Path, episodes: int, console: Console, *, engine_url: str, model_dir: Path
) -> None:
    """Play ``episodes`` eval rows through slime's generate contract; save their samples."""
    from argparse import Namespace
    from urllib.parse import urlsplit

    from corral.adapters import slime
    from corral.adapters.slime_shapes import Sample

    engine = urlsplit(engine_url)
    args = Namespace(  # the fields slime's rollout process passes; the engine is its router
        sglang_router_ip=engine.hostname,
        sglang_router_port=engine.port,
        hf_checkpoint=str(model_dir),
        apply_chat_template_kwargs={},
        rollout_max_context_len=None,
    )
    lines = (out / "rows" / "eval.jsonl").read_text().splitlines()[:episodes]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64}

    async def play_all() -> list[list[Any]]:
        played = []
        for i, line in enumerate(track(lines, description="slime rollouts", console=console)):
            row = json.loads(line)
            sample = Sample(
                group_index=i, index=i, prompt=row["messages"], metadata=row["metadata"]
            )
            played.append(await slime.generate(args, sample, dict(sampling)))
        await slime.close_clients()
        return played

    try:
        played = asyncio.run(play_all())
    finally:
        slime.shutdown()
    table = Table(title="eval rows played through corral.adapters.slime.generate")
    for col in ("task", "samples", "tokens", "model tokens", "status", "reward", "failure"):
        table.add_column(col)
    with (out / "slime-samples.jsonl").open("w") as f:
        for samples in played:
            first = samples[0]
            for s in samples:
                f.write(json.dumps(_sample_json(s)) + "\n")
            table.add_row(
                str(first.metadata.get("task_id")),
                str(len(samples)),
                str(sum(len(s.tokens) for s in samples)),
                str(sum(sum(s.loss_mask or []) for s in samples)),
                first.status.value,
                f"{first.reward}",
                str(first.metadata.get("failure") or ""),
            )
    console.print(table)
    console.print(f"slime-shaped samples in {out / 'slime-samples.jsonl'}")


def run_policy_stage(out: Path, policy: Path, days: int, console: Console) -> EvalReport:
    """The trained policy plays the first ``days`` eval rows (already written under
    ``out/rows``, their env server running) through its own local engine and gateway on this
    machine's CPU, greedily, with the player: the whole rollout path with a model that solves
    the task. Writes ``out/policy-eval`` (summary and episodes)."""
    from corral.adapters.evals import eval_rows, report_table, write_eval
    from corral.adapters.rows import read_rows

    rows = read_rows(out / "rows" / "eval.jsonl")[:days]
    console.print(f"the trained policy {policy} plays {len(rows)} eval days on the CPU")
    with local_stack(policy, max_batch_size=max(len(rows), 1)) as urls:
        report = asyncio.run(
            eval_rows(rows, urls.gateway, concurrency=len(rows), sampling={"temperature": 0.0})
        )
    write_eval(report, out / "policy-eval")
    title = f"the trained policy on {len(rows)} gridsim eval days (idle grades 0.2)"
    console.print(report_table(report, title))
    console.print(f"episodes in {out / 'policy-eval'}")
    return report


def _sample_json(sample: Any) -> dict[str, Any]:
    keys = ("group_index", "index", "rollout_id", "tokens", "response_length", "loss_mask",
            "rollout_log_probs", "reward", "metadata", "remove_sample")  # fmt: skip
    return {k: getattr(sample, k) for k in keys} | {"status": sample.status.value}


def run_main_job(
    *,
    workdir: Path,
    episodes: int = 4,
    seed: int = 0,
    bundle: Path = DEFAULT_BUNDLE,
    sandbox: str = "local",
    policy: Path | None = TRAINED_GRIDSIM_POLICY,
    policy_days: int = 24,
) -> int:
    """The main job (module docstring). ``policy``: a model that plays the bundle, played on
    ``policy_days`` eval rows after the other stages (skipped when it is None or
    ``policy_days`` is 0). PolicyMissing, before anything starts, when ``policy`` is no model
    folder."""
    if policy is not None and policy_days > 0 and not (policy / "config.json").is_file():
        raise PolicyMissing(f"no model at {policy}")
    console = Console()
    console.print("the tiny model: built offline once, then cached")
    model_dir = cached_tiny_model("qwen25", seed=seed, cache_dir=workdir / "models")
    out = workdir / "runs" / "gateway-demo"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    results: list[EpisodeResult] = []
    with local_stack(model_dir) as urls:
        console.print(f"engine {urls.engine}  gateway {urls.gateway}")
        for i in track(range(episodes), description="episodes", console=console):
            results.append(play_episode(urls.gateway, rng, stream=i % 2 == 1))
        _report_gateway_stage(results, out, console)
        run_env_stage(
            bundle,
            workdir / "runs" / "gridsim",
            episodes,
            console,
            sandbox,
            engine_url=urls.engine,
            model_dir=model_dir,
            policy=policy,
            policy_days=policy_days,
        )
    return 0


def _report_gateway_stage(results: list[EpisodeResult], out: Path, console: Console) -> None:

    table = Table(title="episodes through the gateway")
    for col in (
        "session",
        "cities",
        "mode",
        "turns",
        "samples",
        "tokens",
        "model tokens",
        "reward",
    ):
        table.add_column(col)
    with (out / "samples.jsonl").open("w") as f:
        for i, r in enumerate(results):
            for s in r.samples:
                f.write(json.dumps(s) + "\n")
            table.add_row(
                r.session_id[:8],
                ", ".join(r.cities),
                "stream" if i % 2 else "plain",
                str(r.turns),
                str(len(r.samples)),
                str(sum(len(s["tokens"]) for s in r.samples)),
                str(sum(sum(s["loss_mask"]) for s in r.samples)),
                f"{r.reward:.0f}",
            )
    (out / "drift.json").write_text(json.dumps([r.drift for r in results], indent=2))
    console.print(table)
    forks = sum(r.drift.get("forks", 0) for r in results)
    console.print(
        f"{len(results)} episodes, mean reward "
        f"{sum(r.reward for r in results) / len(results):.2f}, {forks} forks; "
        f"samples in {out / 'samples.jsonl'}"
    )
