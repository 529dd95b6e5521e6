"""examples/gridsim_rl end to end on CPU at its smoke size: every stage with real parts (corral's
env server and row writer, the built tokenizer and model, corral's SFT run, corral's RL loop
with the local engine, gateway and env server), then the outputs checked: the transcripts are
the rows' prompts with the teacher's submission (the greedy rule's, edited on some days),
rendered as the gateway renders them and read back by the gateway's tool-call parser; the
tokenizer compresses gridsim text; synthetic days never are eval days; a second run skips what
is done and an RL run with more steps resumes from its checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")

from gridsim_rl.days import (  # noqa: E402
    check_disjoint,
    greedy,
    gridsim,
    synthetic_task,
    synthetic_tasks,
)
from gridsim_rl.run import STAGES, main  # noqa: E402
from gridsim_rl.settings import DEFAULT_SETTINGS, load_settings  # noqa: E402
from gridsim_rl.teacher import teacher_schedule  # noqa: E402

from corral.rollouts.rows import read_rows  # noqa: E402
from corral.trainer.metrics import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gridsim_rl")
    assert main(["--smoke", "--out", str(out)]) == 0
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_stage_writes_its_outputs(smoke_run: Path) -> None:
    out = smoke_run
    for path in (
        "rows/all.jsonl",
        "data/train.jsonl",
        "data/eval.jsonl",
        "data/summary.json",
        "base_model/config.json",
        "base_model/model.safetensors",
        "base_model/tokenizer.json",
        "base_model/build.json",
        "sft/phase-1/model/model.safetensors",
        "sft/phase-2/model/model.safetensors",
        "rl/metrics.jsonl",
        "rl/evals/step-000000/summary.json",
        "rl/evals/step-000001/episodes.jsonl",
        "report/results.json",
        "report/results.md",
        "report/curves.png",
        "report/reward.png",
        "report/final_model/model.safetensors",
        "report/final_model/tokenizer.json",
    ):
        assert (out / path).is_file(), path
    assert set(json.loads((out / "times.json").read_text())) == set(STAGES)

    summary = json.loads((out / "data/summary.json").read_text())
    assert summary["train"]["conversations"] == 16 + 20 and summary["held_out_days"] == 4
    assert len(_lines(out / "data/train.jsonl")) == 36 and len(_lines(out / "data/eval.jsonl")) == 4

    for phase in ("phase-1", "phase-2"):
        steps = [m for m in read_metrics(out / "sft" / phase) if m.get("kind") != "eval"]
        assert steps and all(m["trained_tokens"] > 0 and m["loss"] > 0 for m in steps)
    assert read_metrics(out / "sft/phase-1")[-1]["kind"] == "eval"  # held-out loss

    lines = read_metrics(out / "rl")
    assert [(m["step"], m.get("kind", "step")) for m in lines] == [
        (0, "eval"),
        (1, "step"),
        (1, "eval"),
    ]
    step = lines[1]
    assert step["rollouts"] == 4 and step["groups"] == 2 and step["trained_tokens"] > 0
    assert lines[0]["eval/episodes"] == 3 and lines[0]["eval/failed"] == 0
    for name in ("1", "2", "4"):
        assert f"eval/group/{name}" in lines[0]  # per battery size
    episodes = _lines(out / "rl/evals/step-000001/episodes.jsonl")
    assert len(episodes) == 3
    assert all(e["messages"][-1]["role"] == "assistant" for e in episodes)  # played via gateway

    results = json.loads((out / "report/results.json").read_text())
    assert list(results["policies"]) == [
        "idle",
        "greedy rule",
        "SFT start (step 0)",
        "after RL (step 1)",
    ]
    assert results["policies"]["idle"]["overall"]["mean"] == pytest.approx(0.2)
    assert results["eval_days"] == 3
    assert "greedy rule" in (out / "report/results.md").read_text()


@pytest.mark.parametrize("template", ["built", "qwen25"])
def test_transcripts_are_rows_with_the_teachers_submission_as_the_gateway_reads_it(
    smoke_run: Path, template: str
) -> None:
    """The built tokenizer (the settings' compact template), and one trained here with corral's
    own qwen25 template (system prompt and tool schemas rendered), on the same transcripts."""
    from gridsim_rl.build import corpus, train_tokenizer
    from transformers import AutoTokenizer

    from corral.gateway.parsers.tool_calls import ToolSpec, get_tool_call_parser
    from corral.trainer.sft import ChatExample, tokenize_chat

    out = smoke_run
    settings = load_settings(DEFAULT_SETTINGS, smoke=True)
    transcripts = _lines(out / "data/train.jsonl") + _lines(out / "data/eval.jsonl")
    if template == "built":
        tokenizer = AutoTokenizer.from_pretrained(str(out / "base_model"))
    else:
        tok_settings = settings.tokenizer.model_copy(update={"template": template})
        tokenizer = train_tokenizer(corpus(transcripts, template), tok_settings)
    rows = {r.metadata.task_id: r for r in read_rows(out / "rows/all.jsonl")}
    parser = get_tool_call_parser("qwen25")
    days = settings.days
    tasks = [*gridsim().tasks("train")[: days.train_days], *synthetic_tasks(days)]
    assert len(transcripts) == len(tasks)
    edited = 0
    for task, line in zip(tasks, transcripts, strict=True):
        if task.split == "train":  # the real rows: same prompt messages, same tools
            row = rows[task.id]
            assert line["messages"][:2] == row.messages
            assert line["tools"] == row.metadata.tools
        sample = tokenize_chat(tokenizer, ChatExample(line["messages"], line["tools"]))
        reply = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
        text = tokenizer.decode(reply, skip_special_tokens=False)
        assert text.endswith("<|im_end|>")
        parsed = parser.parse(
            text.removesuffix("<|im_end|>"), [ToolSpec.from_openai(t) for t in line["tools"]]
        )
        assert not parsed.errors and parsed.content is None
        assert [c.name for c in parsed.tool_calls] == ["submit_schedule"]
        teacher = teacher_schedule(task, days.edit_share, days.seed)
        assert json.loads(parsed.tool_calls[0].arguments) == {"schedule": teacher.schedule}
        assert (teacher.schedule != greedy(task)) == teacher.edited
        edited += teacher.edited
        assert len(reply) < 60  # a submission is short: one token per hour and the wrapper
        prompt = tokenizer.decode(sample.tokens[: sample.loss_mask.index(1)])
        assert line["messages"][1]["content"] in prompt
        assert (line["messages"][0]["content"] in prompt) == (template == "qwen25")
    summary = json.loads((out / "data/summary.json").read_text())
    assert 0 < edited < len(tasks)
    assert edited == summary["train"]["edited"] + summary["eval"]["edited"]


def test_the_tokenizer_compresses_gridsim_text(smoke_run: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smoke_run / "base_model"))
    row = read_rows(smoke_run / "rows/all.jsonl", split="eval")[0]
    prompt = tokenizer.apply_chat_template(
        row.messages, tools=row.metadata.tools, tokenize=False, add_generation_prompt=True
    )
    assert len(tokenizer(prompt)["input_ids"]) < 0.5 * len(prompt)
    user = row.messages[-1]["content"]
    assert len(tokenizer(user)["input_ids"]) < 0.5 * len(user)
    # The price table: an hour label, the integer part, the cents and a newline per hour (the
    # smoke corpus is too small to merge every cent value).
    pieces = [tokenizer.decode([i]) for i in tokenizer("07:00 61.83\n")["input_ids"]]
    assert pieces[:2] == ["07:00", " 61"] and "".join(pieces[2:]) == ".83\n"
    assert len(pieces) <= 5
    build = json.loads((smoke_run / "base_model/build.json").read_text())
    assert build["tokens"]["longest"] < 4096 // 2


def test_synthetic_days_are_never_eval_days() -> None:
    evals = gridsim().tasks("eval")
    for smoke in (True, False):
        days = load_settings(DEFAULT_SETTINGS, smoke=smoke).days
        # Every synthetic day falls before the train split, and so before 2025's eval days.
        first = synthetic_task(days.synthetic - 1, days.seed, days.last_date).data["date"]
        assert (
            first < days.last_date.isoformat() < "2019-07-01" < min(t.data["date"] for t in evals)
        )
        every = range(0, days.synthetic, 97)
        check_disjoint([synthetic_task(i, days.seed, days.last_date) for i in every], evals)
    with pytest.raises(ValueError, match="is an eval day"):
        check_disjoint([evals[5]], evals)


def test_the_full_size_model_fits_the_repository() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = load_settings(DEFAULT_SETTINGS)
    m = settings.model
    config = Qwen3Config(
        vocab_size=settings.tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.hidden_size // m.num_attention_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert 2 * sum(p.numel() for p in model.parameters()) <= 15_000_000  # bytes in bf16
    rl = settings.train_config(run_dir=Path("/tmp/x"), model=Path("/tmp/m"))
    assert rl.rollout.rollouts_per_row == 8 and rl.rollout.temperature > 1
    assert rl.env.max_turns <= 4 and rl.schedule.eval_limit is None
    assert rl.schedule.eval_temperature == 0 and rl.env.sandbox is None


def test_a_second_run_skips_what_is_done_and_rl_resumes(smoke_run: Path, capsys: Any) -> None:
    out = smoke_run
    sft_before = (out / "sft/phase-2/model/model.safetensors").read_bytes()
    assert main(["--smoke", "--out", str(out), "--set", "rl.schedule.steps=2"]) == 0
    printed = capsys.readouterr().out
    for stage in ("data", "model", "sft"):
        assert f"{stage}: done already" in printed
    assert (out / "sft/phase-2/model/model.safetensors").read_bytes() == sft_before
    lines = read_metrics(out / "rl")
    assert [(m["step"], m.get("kind", "step")) for m in lines][-2:] == [(2, "step"), (2, "eval")]
    assert (out / "rl/checkpoints/step-000002/state.json").is_file()
    results = json.loads((out / "report/results.json").read_text())
    assert "after RL (step 2)" in results["policies"]
    # Other teacher edits than the data folder's: refused, nothing reused or overwritten.
    data_before = (out / "data/train.jsonl").read_bytes()
    assert main(["--smoke", "--out", str(out), "--set", "days.edit_share=0.9"]) == 1
    assert "edit_share" in capsys.readouterr().out
    assert (out / "data/train.jsonl").read_bytes() == data_before
    final = json.loads((out / "report/final_model/checkpoint.json").read_text())
    assert final["step"] == 2
