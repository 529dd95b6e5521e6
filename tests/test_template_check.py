"""``corral template check``: the battery of synthetic conversations, played with a template
standing in for the model, judged under both history modes; on the tiny models' templates and
on templates written here to break in known ways."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from corral.cli import main
from corral.gateway.settings import HISTORY_MODES, HistoryMode
from corral.gateway.template_check import Shape, TemplateReport, check_model_dir, shapes

ROOT = Path(__file__).resolve().parent.parent
BATTERY = {s.name: s for s in shapes(thinking_switch=True, renders_reasoning=True)}

# ChatML that writes tool calls as <function_call>{...}</function_call>: append-only, so every
# session is one sample, but the qwen25 parser finds no call in what the model writes.
UNPARSABLE_CALLS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<function_call>' + (call.function | tojson) + '</function_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML that rewrites every answer a later user message follows, and labels each user message
# with its position in the whole conversation: the held conversation renders differently once
# new messages follow it (no prefix), and new messages render differently after a probe than in
# the request (no isolated suffix).
WHOLE_HISTORY = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n[' ~ loop.index0 ~ '] ' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and loop.index0 < ns.last_user %}"
    "{{- '<|im_start|>assistant\\n(answered)<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The generation prompt opens an assistant turn; a reply is written under another role.
OTHER_ROLE = (
    "{%- for message in messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<|im_start|>' + role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def with_template(model_dir: Path, folder: Path, template: str) -> Path:
    """A copy of ``model_dir`` whose tokenizer has ``template`` as its chat template."""
    shutil.copytree(model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if "chat_template" in config:
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
    else:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def check(model_dir: Path, history: HistoryMode = "tokens", **options: Any) -> TemplateReport:
    options.setdefault("tool_call_parser", "qwen25")
    options.setdefault("reasoning_parser", "none")
    return check_model_dir(model_dir, history=history, **options)


def judged(report: TemplateReport, history: HistoryMode) -> TemplateReport:
    return dataclasses.replace(report, history=history)


def played(report: TemplateReport) -> list[Any]:
    return [s for s in report.shapes if s.skipped is None]


def test_the_qwen25_template_passes_under_both_history_modes(tiny_model_dir: Path) -> None:
    report = check(tiny_model_dir)
    for history in HISTORY_MODES:
        assert judged(report, history).breaks() == ()
    assert report.end_token == "<|im_end|>"
    skipped = {s.name: s.skipped for s in report.shapes if s.skipped is not None}
    assert skipped == {
        "reasoning_on": "the template does not render an assistant's reasoning",
        "reasoning_off": "the template has no enable_thinking switch",
    }
    long = next(s for s in report.shapes if s.name == "long_history")
    assert long.turns == 40 and long.template is not None and len(long.template.turns) == 40
    for shape in played(report):
        assert shape.template.samples == shape.tokens.samples == 1, shape.name
        assert all(not t.forks for t in shape.template.turns)
        later = shape.tokens.turns[1:]
        assert [t.boundary for t in later] == ["isolated"] * len(later), shape.name
        assert all(t.fallback is None and t.held_mismatch is None for t in shape.tokens.turns)
        assert shape.parser_misses == ()


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "off"])
def test_the_qwen3_template_forks_under_template_history_and_tokens_repairs_it(
    tiny_think_model_dir: Path, kwargs: dict[str, Any]
) -> None:
    report = check(
        tiny_think_model_dir,
        "template",
        reasoning_parser="qwen3",
        chat_template_kwargs=kwargs,
    )
    assert not report.ok
    assert [s.name for s in played(report)] == list(BATTERY)  # every shape applies
    for shape in report.shapes:
        assert shape.template is not None and shape.tokens is not None
        assert shape.template.samples > 1, shape.name
        first = next(t for t in shape.template.turns if t.forks)
        named = re.search(r"inside message (\d+) \(assistant\)", first.drift or "")
        assert named is not None and first.drift is not None, first.drift
        assert BATTERY[shape.name].messages[int(named.group(1))].role == "assistant"
        assert first.drift in "\n".join(shape.breaks("template"))
        # Token history: one sample, every later turn continued after the model's own tokens.
        assert shape.tokens.samples == 1, shape.name
        assert all(t.boundary in ("prefix", "isolated") for t in shape.tokens.turns[1:])
        assert all(t.fallback is None and t.held_mismatch is None for t in shape.tokens.turns)
        assert shape.breaks("tokens") == ()
    assert judged(report, "tokens").ok


def test_the_reasoning_parser_must_read_back_the_reasoning(tiny_think_model_dir: Path) -> None:
    report = check(tiny_think_model_dir, reasoning_parser="none")
    assert [b.shape for b in report.breaks()] == ["reasoning_on"]
    (reason,) = report.breaks()
    assert "reasoning parser none reads reasoning None" in reason.reason
    assert "'The add tool does sums.'" in reason.reason


def test_calls_the_parser_cannot_read_break_both_modes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = with_template(tiny_model_dir, tmp_path / "m", UNPARSABLE_CALLS)
    report = check(model)
    tool_shapes = {"tool_loop", "parallel_tools", "tool_error", "long_history"}
    for history in HISTORY_MODES:
        breaks = judged(report, history).breaks()
        assert {b.shape for b in breaks} == tool_shapes
        for b in breaks:
            assert b.reason.startswith("parsers misread"), b
            assert "tool-call parser qwen25 reads calls none" in b.reason
    loop = next(s for s in report.shapes if s.name == "tool_loop")
    assert 'get_weather({"city": "Paris"})' in loop.parser_misses[0].problem
    # The template itself is append-only: one sample per shape either way.
    for shape in played(report):
        assert shape.template.samples == shape.tokens.samples == 1


def test_a_template_that_renders_against_the_whole_history_breaks_both_modes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = with_template(tiny_model_dir, tmp_path / "m", WHOLE_HISTORY)
    report = check(model)
    chat = next(s for s in report.shapes if s.name == "chat")
    assert chat.template is not None and chat.tokens is not None
    assert chat.template.samples == 3 and chat.tokens.samples == 3
    (forks,) = chat.breaks("template")
    assert forks.startswith("template history: 3 samples, forks at turns 1-2")
    assert "inside message 1 (assistant)" in forks
    fallbacks = [t.fallback for t in chat.tokens.turns[1:]]
    assert all(f is not None and "no sound boundary" in f for f in fallbacks), fallbacks
    tokens_breaks = chat.breaks("tokens")
    assert any("turns 1-2 rendered in full" in r for r in tokens_breaks), tokens_breaks
    # The fork's explanation says token history was not used, and why (as the gateway's).
    assert any("token history was not used for this turn" in r for r in tokens_breaks)
    for history in HISTORY_MODES:
        assert "chat" in {b.shape for b in judged(report, history).breaks()}


def test_a_reply_that_does_not_continue_the_generation_prompt_breaks_every_shape(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = with_template(tiny_model_dir, tmp_path / "m", OTHER_ROLE)
    report = check(model)
    for shape in played(report):
        assert shape.template is None and shape.tokens is None
        assert shape.unrenderable is not None
        assert "does not continue its generation prompt" in shape.unrenderable
        for history in HISTORY_MODES:
            assert shape.breaks(history) == (shape.unrenderable,)


def test_the_cli_prints_a_table_per_mode_and_exits_by_the_verdict(
    tiny_model_dir: Path, tiny_think_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["template", "check", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    for header in ("shape", "turns", "samples", "extends?", "parser ok?", "note"):
        assert header in out
    assert "tokens history (the verdict's)" in out and "template history" in out
    assert (
        out.strip().splitlines()[-1].endswith("ok: no shape breaks under tokens history (6 played)")
    )

    assert main(["template", "check", str(tiny_think_model_dir), "--history", "template"]) == 1
    captured = capsys.readouterr()
    assert "BREAK: 8 of 8 shapes break under template history" in captured.out
    fails = [line for line in captured.err.splitlines() if " FAIL " in line]
    assert len(fails) == 8 and any("FAIL chat: template history: 3 samples" in f for f in fails)

    thinking_off = '{"enable_thinking": false}'
    argv = ["template", "check", str(tiny_think_model_dir), "--reasoning-parser", "qwen3"]
    assert main([*argv, "--chat-template-kwargs", thinking_off, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["breaks"] == []
    assert report["chat_template_kwargs"] == {"enable_thinking": False}
    assert {s["name"]: s["tokens"]["samples"] for s in report["shapes"]} == dict.fromkeys(
        BATTERY, 1
    )


def test_the_cli_refuses_unknown_parsers_and_folders(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "corral.cli", "template", "check", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    unknown = corral(str(tmp_path), "--reasoning-parser", "nope")
    assert unknown.returncode == 2 and "invalid choice: 'nope'" in unknown.stderr
    assert "deepseek_r1" in unknown.stderr  # the registry's names
    missing = corral(str(tmp_path / "absent"))
    assert missing.returncode == 2 and "no model folder" in missing.stderr
    assert "Traceback" not in missing.stderr + unknown.stderr


def test_shapes_that_do_not_apply_say_why() -> None:
    names = {s.name: s for s in shapes(thinking_switch=False, renders_reasoning=False)}
    off: Shape = names["reasoning_off"]
    assert off.skip == "the template has no enable_thinking switch"
    assert names["reasoning_on"].kwargs == {}
    assert BATTERY["reasoning_on"].kwargs == {"enable_thinking": True}
    assert BATTERY["reasoning_off"].kwargs == {"enable_thinking": False}
