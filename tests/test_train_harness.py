"""``corral train`` with an ``[agent]`` section: every rollout is played by a real agent CLI
(Codex, Claude Code) inside its episode's bwrap sandbox, on CPU.

The run starts its own env server (shellcraft, two train tasks, in bwrap, handed the agent
CLIs) and trains the tiny model's weights with megatron-core on CPU; the gateway fronts the
scripted test engine (``tests/scripted_engine.py``), which stands in for the policy's engine
because the tiny model cannot drive a CLI: it answers each CLI's first request with one shell
tool call that solves the task (shellcraft's reference solver, from the prompt found in the
request) and the second with a short text. One of the two tasks' requests get HTTP 500, so
its rollouts fail (the CLI, allowed no retries, exits non-zero) and its groups are dropped.
The weights still go to that engine each step (``update_weights_from_disk``). The step lines
must count the rollouts kept, played and failed and the dropped groups exactly.

The policy is the tiny model's shape with a tokenizer of its own: the CLIs' requests are long
(Codex's first is ~48k tokens with the tiny model's 788-token vocabulary), which megatron's
unfused attention on CPU cannot hold (an s x s score matrix per head). So the test first plays
one rollout with the CLI to capture what it sends, trains a byte-level BPE on that text (the
tiny model's special tokens and chat template kept) and makes a randomly initialised model of
the tiny shape over it: the same requests are then a few thousand tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from corral.envs.agent_clis import find_agent_clis
from corral.envs.bundle import load_bundle
from corral.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.gateway_stack import ADMIN
from tests.scripted_engine import Failure, ScriptedEngine
from tests.servers import serve

pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")

CLIS_DIR = Path(os.environ.get("CORRAL_AGENT_CLIS", "/var/cache/corral-agent-clis"))
MODEL = "corral-test-model"
FINAL_TEXT = "Done."
SHELL_TOOL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd")}
ROLLOUTS_PER_ROW = 2


@dataclass(frozen=True)
class Tasks:
    bundle: Path
    good_prompt: str  # this task's requests get the solution
    bad_prompt: str  # this one's get HTTP 500
    solution: str


def two_task_shellcraft(root: Path) -> Tasks:
    """shellcraft with train tasks 0 and 1 only (and eval task 0)."""
    from bundles.shellcraft.solver import solve

    bundle = root / "shellcraft"
    shutil.copytree(ROOT / "bundles" / "shellcraft", bundle)
    for split, keep in (("train", 2), ("eval", 1)):
        path = bundle / "tasks" / f"{split}.jsonl"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:keep]))
    loaded = load_bundle(bundle)
    good, bad = loaded.task("train", 0), loaded.task("train", 1)
    assert good.prompt != bad.prompt
    solution = " && ".join(f"{{ {c}; }}" for c in solve(good.data))
    return Tasks(bundle, good.prompt, bad.prompt, solution)


@contextmanager
def scripted_stack(
    model_dir: Path, harness: str, tasks: Tasks, *, seen: list[str] | None = None
) -> Iterator[tuple[str, str]]:
    """(engine URL, gateway URL): the scripted engine answering as the module docstring says,
    behind a real gateway with the admin token, rendering with ``model_dir``'s tokenizer.
    ``seen`` collects the text of every request."""
    from corral.engines.sglang import SGLangClient
    from corral.gateway.app import build_gateway_app
    from corral.gateway.pipeline import TurnPipeline
    from corral.gateway.settings import GatewaySettings

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def ids(text: str) -> list[int]:
        return [*tokenizer(text, add_special_tokens=False).input_ids, end]

    tool, argument = SHELL_TOOL[harness]
    call = json.dumps({"name": tool, "arguments": {argument: tasks.solution}})

    def answer(input_ids: list[int]) -> list[int] | Failure:
        text = tokenizer.decode(input_ids)
        if seen is not None:
            seen.append(text)
        if tasks.bad_prompt in text:
            return Failure(500, "scripted: no model for this task")
        if "<|im_start|>assistant\n<tool_call>" in text:  # the tool ran: answer
            return ids(FINAL_TEXT)
        return ids(f"<tool_call>\n{call}\n</tool_call>")

    engine = ScriptedEngine(
        eos_token_ids=[end], decode=lambda i: str(tokenizer.decode(i)), default=answer
    )
    settings = GatewaySettings(
        model_name=MODEL, max_context_tokens=262_144, admin_token=ADMIN, engine_timeout_s=60
    )
    with serve(engine.app) as engine_url:
        client = SGLangClient(engine_url, timeout=60, retries=0)
        pipeline = TurnPipeline(settings, client, tokenizer)
        with serve(build_gateway_app(settings, client, pipeline)) as gateway_url:
            yield engine_url, gateway_url


def capture_requests(tiny_model_dir: Path, harness: str, tasks: Tasks, tmp_path: Path) -> list[str]:
    """The text of every request the CLI makes in one rollout of the good task (rendered by
    the gateway, as any tokenizer of this chat template would see it)."""
    import asyncio
    import uuid

    from corral.envs.server import build_app
    from corral.gateway.client import GatewayAdmin
    from corral.rollouts.harness_play import HarnessPlayer, make_harness
    from corral.sandboxes.bwrap import BwrapProvider
    from tests.test_harness_rollouts import shellcraft_row

    texts: list[str] = []
    provider = BwrapProvider(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")
    app = build_app(tasks.bundle, sandbox=provider, agent_clis=CLIS_DIR)
    with (
        scripted_stack(tiny_model_dir, harness, tasks, seen=texts) as (_, gateway_url),
        serve(app) as url,
    ):
        row, _ = shellcraft_row(url, "train", 0)

        async def play() -> Any:
            async with GatewayAdmin(gateway_url, ADMIN) as admin:
                player = HarnessPlayer(admin, make_harness(harness), timeout_s=120, model=MODEL)
                return await player.play(row, group_index=0, index=0)

        rollout = asyncio.run(play())
    assert not rollout.failed, rollout.reason
    return texts


def compact_policy(tiny_model_dir: Path, corpus: list[str], out: Path) -> Path:
    """A model of the tiny shape (random weights) over a byte-level BPE trained on
    ``corpus``, with the tiny model's special and marker tokens and chat template."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2ForCausalLM

    base: Any = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    added = list(base.added_tokens_decoder.values())
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        min_frequency=2,
        special_tokens=[t.content for t in added if t.special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    markers = [t.content for t in added]
    plain = []
    for text in corpus:
        for marker in markers:
            text = text.replace(marker, "\n")
        plain.append(text)
    bpe.train_from_iterator(plain * 2, trainer)  # twice: every stretch of it is frequent
    bpe.add_tokens([AddedToken(t.content, special=False, normalized=False) for t in added
                    if not t.special])  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=base.chat_template,
        model_max_length=131_072,
        clean_up_tokenization_spaces=False,
    )
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.vocab_size = len(tokenizer)
    config.max_position_embeddings = 131_072
    config.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("harness", ["codex", "claude-code"])
def test_corral_train_plays_its_rollouts_with_an_agent_in_the_sandbox(
    harness: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral.cli import main

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    if not CLIS_DIR.is_dir():
        pytest.skip(f"the agent CLIs are not installed (bash scripts/agent_clis.sh {CLIS_DIR})")
    clis = find_agent_clis(CLIS_DIR)
    if (clis.codex if harness == "codex" else clis.claude) is None:
        pytest.skip(f"{harness}'s CLI is not in {CLIS_DIR}")
    tasks = two_task_shellcraft(tmp_path)
    corpus = capture_requests(tiny_model_dir, harness, tasks, tmp_path)
    policy = compact_policy(tiny_model_dir, corpus, tmp_path / "policy")
    monkeypatch.setenv("CORRAL_TEST_ADMIN", ADMIN)
    run = tmp_path / "run"
    with scripted_stack(policy, harness, tasks) as (engine_url, gateway_url):
        sets = [
            f'model.path="{policy}"', f'engine.url="{engine_url}"',
            f'engine.gateway="{gateway_url}"', 'engine.admin_token_var="CORRAL_TEST_ADMIN"',
            f'env.bundle="{tasks.bundle}"', "env.tool_timeout=30",
            f'agent.harness="{harness}"', 'agent.sandbox="bwrap"', f'agent.clis="{CLIS_DIR}"',
            f'agent.model="{MODEL}"', "agent.timeout_s=120", "agent.settings={max_retries=0}",
            "rollout.groups_per_step=1", f"rollout.rollouts_per_row={ROLLOUTS_PER_ROW}",
            "rollout.concurrency=2", "rollout.max_draws=4", "rollout.max_tokens=4096",
            "optim.max_tokens_per_micro_batch=4096", "schedule.eval_every=0",
            "schedule.checkpoint_every=0", "tensorboard=false",
        ]  # fmt: skip
        rc = main(["train", "--run-dir", str(run), "--steps", "2", *[f"--set={s}" for s in sets]])
    dropped_file = run / "dropped.jsonl"
    assert rc == 0, dropped_file.read_text() if dropped_file.is_file() else "(nothing dropped)"
    lines = read_metrics(run)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        dropped = line["dropped/failed_rollout"]
        assert line["rollouts"] == ROLLOUTS_PER_ROW and line["groups"] == 1
        assert line["rollouts_failed"] == ROLLOUTS_PER_ROW * dropped
        assert line["rollouts_played"] == ROLLOUTS_PER_ROW * (1 + dropped)
        assert line["draws"] == 1 + dropped
        assert line["reward/mean"] == 1.0  # every kept rollout solved its task
        assert line["samples"] == ROLLOUTS_PER_ROW  # one sample per CLI conversation
    # Two kept groups of the one good task need a pass over both tasks: at least one of the
    # bad task's groups was played, failed and dropped, and its reason says why.
    assert sum(line["dropped/failed_rollout"] for line in lines) >= 1
    dropped_groups = [json.loads(x) for x in (run / "dropped.jsonl").read_text().splitlines()]
    assert dropped_groups and all(d["reason"] == "failed_rollout" for d in dropped_groups)
    assert all("agent: exited with code" in d["detail"] for d in dropped_groups), dropped_groups
    assert (run / "weights" / "step-2" / "config.json").is_file()  # pushed to the engine
