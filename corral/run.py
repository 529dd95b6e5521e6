"""``corral run``: the main job on embedded defaults.

Stages on 127.0.0.1, printed in the order they run, each under a numbered heading:

1. the tiny model: built once (with a progress bar), then cached under the workdir;
2. the gateway: start the local engine and the gateway, and play tool-calling conversations
   through the official OpenAI SDK, exactly as a black-box agent would, then collect each
   session's samples (``samples.jsonl``) and drift report (``drift.json``);
3. the env server: serve the gridsim bundle with each episode's env in a sandbox of the
   ``sandbox`` backend (``local`` by default: a subprocess in a temporary folder, which runs on
   any machine), write its tasks as training rows, and play eval episodes over the WebSocket
   protocol with a scripted idle policy (the bundle's floor, 0.2);
4. slime rollouts: play eval rows the way slime would, through slime's custom-generate
   contract (:func:`corral.adapters.slime.generate`, with slime-shaped samples and the local
   engine as slime's router): the adapter serves its own gateway, the player runs each episode
   through it against the env server, and the samples (tokens, loss masks, logprobs, the
   verifier's reward) are saved;
5. the trained policy: the model examples/gridsim_rl trained (kept in the repository) plays
   eval days through its own local engine and gateway on the CPU, greedily, and its grades
   are reported (a model that solves gridsim, where the tiny model cannot).

``seed`` makes the job repeatable: every stage draws from its own generator seeded from it
(:func:`stage_rng`): the conversations' cities and forecasts, the env stage's eval episodes,
the slime rollouts' sampling seeds and the policy's eval days. The same seed prints the same
numbers and writes the same samples (up to session ids, request ids, ports and timings); the
tiny model itself is built with a fixed seed (:data:`TINY_MODEL_SEED`), so another ``seed``
does not rebuild it. Every reward is printed with three decimals (:func:`reward_text`), a
mean with its standard error as ``0.929 ± 0.012`` (:func:`mean_text`).

The trainer is `corral train` (docs/training.md).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.console import make_console, print_table
from corral.engines.tiny_model import CITIES, CONDITIONS, TOOLS, cached_tiny_model
from corral.stack import local_stack

if TYPE_CHECKING:
    from corral.rollouts.evals import EvalReport
    from corral.rollouts.rows import Row

# run_main_job's ``policy`` default: the policy examples/gridsim_rl trained (a 7M-parameter
# Qwen3, bf16, kept in the repository: corral.bundled), which plays gridsim on CPU.
TRAINED: Literal["trained"] = "trained"
# The tiny model is an artifact, built once and cached: its seed is not the run's (a new run
# seed would otherwise mean a new 80-second build, and the model's contract is checked on it).
TINY_MODEL_SEED = 0
# What the idle policy is graded on gridsim (the bundle's floor), for the printed comparison.
IDLE_GRADE = 0.2


class PolicyMissing(FileNotFoundError):
    """The policy the main job was asked to play is not a model folder."""


# -- output ------------------------------------------------------------------------------------


def reward_text(reward: float | None) -> str:
    """A reward as every line of the job prints one: three decimals (``0.929``), ``-`` for
    none."""
    return "-" if reward is None else f"{reward:.3f}"


def mean_text(rewards: Sequence[float | None]) -> str:
    """The mean of the graded ``rewards`` with its standard error, ``0.929 ± 0.012`` (the
    format of the eval tables; the error is 0 for fewer than two); ``-`` when none is graded."""
    from corral.rollouts.evals import Stats

    stats = Stats.of(list(rewards))
    if stats.mean is None:
        return "-"
    return f"{stats.mean:.3f} ± {stats.se or 0.0:.3f}"


class Stages:
    """Numbered stage headings, printed as each stage starts (``3/5 the env server``)."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0

    def start(self, title: str) -> None:
        self.done += 1
        self.console.print()
        self.console.print(f"[bold]{self.done}/{self.total} {title}[/bold]")


@contextmanager
def waiting(console: Console, what: str) -> Iterator[None]:
    """Say what the job waits for while the block runs: a spinner on a terminal, one line
    when piped (spinner frames have no place in a log)."""
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        console.print(what + " ...")
        yield


@contextmanager
def progress_bar(
    console: Console, description: str, total: int | None = None
) -> Iterator[Callable[[int, int | None], None]]:
    """A progress bar for the block; yields ``update(done, total)`` (``total`` None keeps the
    last one). Piped, rich prints the bar once, finished, when the block ends."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(description, total=total)

        def update(done: int, new_total: int | None = None) -> None:
            progress.update(task, completed=done, total=new_total or progress.tasks[0].total)

        yield update


class TinyModelBuild:
    """The tiny model build's progress bar (a ``BuildProgress``), shown from the build's first
    report only: a cache hit shows none. ``built`` says whether a build ran."""

    PHASES = {"tokenizer": "training its tokenizer", "imprint": "imprinting", "save": "saving"}

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.task: Any = None

    @property
    def built(self) -> bool:
        return self.task is not None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("", total=total)
        what = self.PHASES.get(phase, phase)
        self.progress.update(
            self.task, description=f"building the tiny model: {what}", completed=done, total=total
        )

    def close(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, description="built the tiny model")
            self.progress.stop()


def stage_rng(seed: int, stage: str) -> random.Random:
    """The generator of one stage, seeded from the run's ``seed`` and the stage's name: each
    stage's draws do not depend on how many another stage made."""
    return random.Random(f"corral-run:{seed}:{stage}")


# -- 1. the tiny model ---------------------------------------------------------------------------


def tiny_model_stage(workdir: Path, console: Console) -> Path:
    """The tiny model from ``workdir/models``, built there (with a progress bar) if absent."""
    build = TinyModelBuild(console)
    try:
        model_dir = cached_tiny_model(
            "qwen25", seed=TINY_MODEL_SEED, cache_dir=workdir / "models", progress=build
        )
    finally:
        build.close()
    console.print(f"the tiny model {model_dir} ({'built' if build.built else 'cached'})")
    return model_dir


# -- 2. the gateway ----------------------------------------------------------------------------


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
    """One conversation through a fresh session with the OpenAI SDK; ``rng`` draws the
    question's cities, the forecasts and each request's sampling seed. The reward is 1 when
    the model asked the tool for exactly the cities in the question and its final answer names
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
        message = _ask(client, messages, stream=stream, seed=rng.randrange(2**31))
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


def _ask(client: Any, messages: list[dict[str, Any]], *, stream: bool, seed: int) -> dict[str, Any]:
    # Greedy (temperature 0); the seed keeps the run repeatable should the sampling change.
    kwargs = {"model": "tiny", "messages": messages, "tools": TOOLS, "temperature": 0, "seed": seed}
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


def gateway_stage(
    gateway: str, out: Path, episodes: int, seed: int, console: Console
) -> list[EpisodeResult]:
    """Play ``episodes`` conversations (odd ones streamed) through ``gateway``; print them
    and write ``out/samples.jsonl`` and ``out/drift.json``."""
    rng = stage_rng(seed, "gateway")
    results: list[EpisodeResult] = []
    with progress_bar(console, "conversations", episodes) as update:
        for i in range(episodes):
            results.append(play_episode(gateway, rng, stream=i % 2 == 1))
            update(i + 1, None)
    _report_gateway_stage(results, out, console)
    return results


def _report_gateway_stage(results: list[EpisodeResult], out: Path, console: Console) -> None:
    table = Table(title="episodes through the gateway")
    columns = ("session", "cities", "mode", "turns", "samples", "tokens", "model tokens", "reward")
    for col in columns:
        table.add_column(col)
    out.mkdir(parents=True, exist_ok=True)
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
                reward_text(r.reward),
            )
    (out / "drift.json").write_text(json.dumps([r.drift for r in results], indent=2))
    print_table(console, table)
    forks = sum(r.drift.get("forks", 0) for r in results)
    console.print(
        f"{len(results)} episodes, mean reward {mean_text([r.reward for r in results])}, "
        f"{forks} forks"
    )
    console.print(f"samples in {out / 'samples.jsonl'}")
    console.print(f"drift reports in {out / 'drift.json'}")


# -- 3. the env server -------------------------------------------------------------------------


def env_stage(url: str, out: Path, episodes: int, seed: int, console: Console) -> list[Row]:
    """Write the tasks of the env server at ``url`` as rows under ``out/rows`` and play
    ``episodes`` eval tasks (drawn with the seed) with the idle policy; the eval rows."""
    from corral.rollouts.rows import RowSettings, read_rows, write_rows

    with progress_bar(console, "reading tasks") as update:
        counts = write_rows(url, out / "rows", RowSettings(), progress=update)
    console.print(
        "rows: " + ", ".join(f"{name} {n}" for name, n in counts.items()) + f" in {out / 'rows'}"
    )
    rows = read_rows(out / "rows" / "eval.jsonl")
    picked = stage_rng(seed, "env").sample(rows, k=min(episodes, len(rows)))
    indices = [row.metadata.index for row in picked]
    rewards = asyncio.run(_idle_episodes(url, "eval", indices))
    played = ", ".join(
        f"{row.metadata.task_id} {reward_text(r)}" for row, r in zip(picked, rewards, strict=True)
    )
    console.print(
        f"{len(rewards)} eval episodes with the idle policy over the WebSocket: {played}; "
        f"mean {mean_text(rewards)} (the verifier grades idling {reward_text(IDLE_GRADE)})"
    )
    return rows


async def _idle_episodes(url: str, split: str, indices: list[int]) -> list[float | None]:
    """Play the tasks ``indices`` of ``split``, in that order, submitting an all-idle
    schedule; their rewards."""
    from corral.envs.client import EnvClient

    rewards: list[float | None] = []
    for index in indices:
        async with EnvClient(url) as client:
            await client.reset(split=split, index=index)
            result = await client.call_tool("submit_schedule", {"schedule": [0] * 24})
            rewards.append(result.reward)
    return rewards


# -- 4. slime rollouts -------------------------------------------------------------------------


def slime_stage(
    rows: list[Row],
    out: Path,
    episodes: int,
    seed: int,
    console: Console,
    *,
    engine_url: str,
    model_dir: Path,
) -> None:
    """Play the first ``episodes`` eval ``rows`` through slime's generate contract, each with
    a sampling seed drawn from ``seed``; save their samples to ``out/slime-samples.jsonl``."""
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
    chosen = rows[:episodes]
    rng = stage_rng(seed, "slime")
    seeds = [rng.randrange(2**31) for _ in chosen]

    async def play_all(update: Callable[[int, int | None], None]) -> list[list[Any]]:
        played = []
        for i, (row, sampling_seed) in enumerate(zip(chosen, seeds, strict=True)):
            sample = Sample(
                group_index=i,
                index=i,
                prompt=row.messages,
                metadata=row.metadata.model_dump(mode="json"),
            )
            sampling = {
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": 64,
                "sampling_seed": sampling_seed,
            }
            played.append(await slime.generate(args, sample, sampling))
            update(i + 1, None)
        await slime.close_clients()
        return played

    try:
        with progress_bar(console, "slime rollouts", len(chosen)) as update:
            played = asyncio.run(play_all(update))
    finally:
        slime.shutdown()
    _report_slime_stage(played, out, console)


def _report_slime_stage(played: list[list[Any]], out: Path, console: Console) -> None:
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
                reward_text(first.reward),
                str(first.metadata.get("failure") or ""),
            )
    print_table(console, table)
    console.print(f"{len(played)} rollouts, mean reward {mean_text([s[0].reward for s in played])}")
    console.print(f"slime-shaped samples in {out / 'slime-samples.jsonl'}")


def _sample_json(sample: Any) -> dict[str, Any]:
    keys = ("group_index", "index", "rollout_id", "tokens", "response_length", "loss_mask",
            "rollout_log_probs", "reward", "metadata", "remove_sample")  # fmt: skip
    return {k: getattr(sample, k) for k in keys} | {"status": sample.status.value}


# -- 5. the trained policy -----------------------------------------------------------------------


def policy_stage(
    rows: list[Row], out: Path, policy: Path, days: int, seed: int, console: Console
) -> EvalReport:
    """The trained policy plays ``days`` eval ``rows`` drawn with ``seed`` (their env server
    running) through its own local engine and gateway on this machine's CPU, greedily, with
    the player: the whole rollout path with a model that solves the task. Writes
    ``out/policy-eval`` (summary and episodes)."""
    from corral.rollouts.evals import eval_rows, report_table, write_eval

    picked = stage_rng(seed, "policy").sample(rows, k=min(days, len(rows)))
    picked.sort(key=lambda row: row.metadata.index)  # played and reported in the split's order
    console.print(f"the trained policy {policy} plays {len(picked)} eval days on the CPU")
    with ExitStack() as stack:
        with waiting(console, "starting the policy's local engine and gateway"):
            urls = stack.enter_context(local_stack(policy, max_batch_size=max(len(picked), 1)))
        with progress_bar(console, "policy episodes", len(picked)) as update:
            done = [0]

            def on_episode(_: Any) -> None:
                done[0] += 1
                update(done[0], None)

            report = asyncio.run(
                eval_rows(
                    picked,
                    urls.gateway,
                    concurrency=max(len(picked), 1),
                    sampling={"temperature": 0.0},
                    on_episode=on_episode,
                )
            )
    write_eval(report, out / "policy-eval")
    title = (
        f"the trained policy on {len(picked)} gridsim eval days "
        f"(idle grades {reward_text(IDLE_GRADE)})"
    )
    print_table(console, report_table(report, title))
    console.print(f"episodes in {out / 'policy-eval'}")
    return report


# -- the job -----------------------------------------------------------------------------------


def run_main_job(
    *,
    workdir: Path,
    episodes: int = 4,
    seed: int = 0,
    bundle: Path | None = None,
    sandbox: str = "local",
    policy: Path | Literal["trained"] | None = TRAINED,
    policy_days: int = 24,
    console: Console | None = None,
) -> int:
    """The main job (module docstring). ``bundle``: the env bundle's folder (None: the
    checkout's gridsim, :func:`corral.bundled.gridsim_bundle`, whose BundledMissing says how
    to get it). ``policy``: a model that plays the bundle (``"trained"``: the checkout's
    trained gridsim policy), played on ``policy_days`` eval rows after the other stages
    (skipped when it is None or ``policy_days`` is 0). PolicyMissing, before anything starts,
    when ``policy`` is no model folder. ``console`` defaults to :func:`make_console`'s."""
    from corral.bundled import BundledMissing, gridsim_bundle, trained_gridsim_policy
    from corral.envs.settings import ServeSettings
    from corral.stack.env_server import env_server_in_thread

    plays_policy = policy is not None and policy_days > 0
    if policy == TRAINED and plays_policy:
        try:
            policy = trained_gridsim_policy()
        except BundledMissing as exc:
            raise PolicyMissing(str(exc)) from None
    if isinstance(policy, Path) and plays_policy and not (policy / "config.json").is_file():
        raise PolicyMissing(f"no model at {policy}")
    bundle = bundle if bundle is not None else gridsim_bundle()
    console = console or make_console()
    stages = Stages(console, total=5 if plays_policy else 4)
    stages.start("the tiny model")
    model_dir = tiny_model_stage(workdir, console)
    gridsim = workdir / "runs" / "gridsim"
    with ExitStack() as stack:
        stages.start("the gateway: OpenAI-SDK conversations through the local engine")
        with waiting(console, "starting the local engine and the gateway"):
            urls = stack.enter_context(local_stack(model_dir))
        console.print(f"engine {urls.engine}  gateway {urls.gateway}")
        gateway_stage(urls.gateway, workdir / "runs" / "gateway-demo", episodes, seed, console)

        stages.start("the env server: rows and idle episodes over the WebSocket")
        with waiting(console, f"starting the env server for {bundle}"):
            served = ServeSettings(bundle=bundle, sandbox=sandbox)
            env_url = stack.enter_context(env_server_in_thread(served))
        console.print(f"env server {env_url} serving {bundle}, each episode in a {sandbox} sandbox")
        rows = env_stage(env_url, gridsim, episodes, seed, console)

        stages.start("slime rollouts: eval rows through corral.adapters.slime.generate")
        slime_stage(
            rows, gridsim, episodes, seed, console, engine_url=urls.engine, model_dir=model_dir
        )
        if isinstance(policy, Path) and plays_policy:
            stages.start("the trained policy: eval days on the CPU")
            policy_stage(rows, gridsim, policy, policy_days, seed, console)
    return 0
