"""The bundle format: a sound bundle loads; every class of problem is reported, naming its file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from corral.envs.bundle import (
    BundleError,
    RewardError,
    RewardSpec,
    TaskNotFound,
    VerifierError,
    load_bundle,
    parameters_problems,
    validate_bundle,
)
from corral.envs.episode import Env, Task, ToolOutcome
from tests.bundle_files import problem_with, write_tree

MANIFEST = """\
name = "echo"
version = "0.1.0"
description = "Echo a word back."
system_prompt = "Say the word."
max_turns = 2

[splits]
train = "tasks/train.jsonl"
eval = "tasks/eval.jsonl"

[sandbox]
needs = "none"

[env]
module = "env.py"
class = "EchoEnv"

[verifier]
module = "verifier.py"
function = "grade"

[reward]
score = "grade"

[[tools]]
name = "say"
description = "Say a word."
[tools.parameters]
type = "object"
required = ["word"]
[tools.parameters.properties.word]
type = "string"

[[tools]]
name = "shout"
description = "Say a word loudly."
[tools.parameters]
type = "object"
properties = {}
"""

ENV = """\
from corral.envs.episode import ToolOutcome

from .words import normalise


class EchoEnv:
    def reset(self, task):
        self.word = task.data["word"]
        self.said = None
        return task.prompt

    def call_tool(self, name, arguments):
        if name != "say":
            return ToolOutcome(f"unknown tool {name}", error=True)
        self.said = normalise(arguments.get("word", ""))
        return ToolOutcome("ok", done=True)

    def state(self):
        return {"word": self.word, "said": self.said}
"""

VERIFIER = """\
def grade(task, state):
    return {"grade": float(state["said"] == task.data["word"]), "length": len(state["said"] or "")}
"""

ENV_NEEDING_ARGS = ENV.replace("class EchoEnv:", "class EchoEnv:\n    def __init__(s, x): ...")
WORDS = "def normalise(word):\n    return word.strip().lower()\n"


def task_line(task_id: str, word: str = "hi", **extra: Any) -> str:
    return json.dumps({"id": task_id, "prompt": f"say {word}", "data": {"word": word}, **extra})


def write_bundle(root: Path, **files: str) -> Path:
    """A sound echo bundle in ``root``; ``files`` (path -> text) override, "" leaves one out."""
    contents = {
        "bundle.toml": MANIFEST,
        "env.py": ENV,
        "verifier.py": VERIFIER,
        "words.py": WORDS,
        "tasks/train.jsonl": "\n".join(task_line(f"t{i}", tools=["say"]) for i in range(3)) + "\n",
        "tasks/eval.jsonl": task_line("e0") + "\n",
    }
    return write_tree(root, {**contents, **files})


def only_problem(root: Path, *needles: str) -> str:
    """One of the bundle's problems holds every needle, and load_bundle refuses it too."""
    return problem_with(root, *needles)


def test_a_sound_bundle_loads_and_plays(tmp_path: Path) -> None:
    root = write_bundle(tmp_path / "echo")
    assert validate_bundle(root) == []
    bundle = load_bundle(root)
    assert bundle.name == "echo" and bundle.splits == ["train", "eval"]
    assert bundle.manifest.sandbox.needs == "none" and bundle.manifest.max_turns == 2
    assert [t.id for t in bundle.tasks("train")] == ["t0", "t1", "t2"]
    task = bundle.task("train", 1)
    assert (task.split, task.index, task.tools) == ("train", 1, ["say"])
    assert bundle.task_by_id("e0").split == "eval"
    assert [t.name for t in bundle.tools_for(task)] == ["say"]
    assert [t.name for t in bundle.tools_for(bundle.task("eval", 0))] == ["say", "shout"]
    assert bundle.manifest.tools[0].mcp().openai()["function"]["name"] == "say"

    env = bundle.make_env()
    assert isinstance(env, Env)
    assert env.reset(task) == "say hi"
    assert env.call_tool("nope", {}) == ToolOutcome("unknown tool nope", error=True)
    assert env.call_tool("say", {"word": " HI "}).done
    scores = bundle.grade(task, env.state())
    assert scores == {"grade": 1.0, "length": 2.0}
    assert bundle.reward(scores) == 1.0


def test_missing_lookups_raise_task_not_found(tmp_path: Path) -> None:
    bundle = load_bundle(write_bundle(tmp_path / "echo"))
    for lookup in (
        lambda: bundle.tasks("test"),
        lambda: bundle.task("train", 3),
        lambda: bundle.task_by_id("zzz"),
    ):
        with pytest.raises(TaskNotFound):
            lookup()


def test_two_bundles_with_the_same_module_names_do_not_collide(tmp_path: Path) -> None:
    a = load_bundle(write_bundle(tmp_path / "a"))
    other = ENV.replace("return task.prompt", "return 'other'")
    b = load_bundle(write_bundle(tmp_path / "b", **{"env.py": other}))
    task = a.task("train", 0)
    assert a.make_env().reset(task) == "say hi"
    assert b.make_env().reset(task) == "other"


def test_the_folder_and_manifest_must_exist_and_parse(tmp_path: Path) -> None:
    assert "not a directory" in validate_bundle(tmp_path / "nowhere")[0]
    root = write_bundle(tmp_path / "echo")
    (root / "bundle.toml").unlink()
    assert validate_bundle(root) == ["bundle.toml: missing (every bundle folder needs one)"]
    write_bundle(root, **{"bundle.toml": "name = 'x\n"})
    assert validate_bundle(root)[0].startswith("bundle.toml: not valid TOML")


def test_schema_violations_are_each_reported(tmp_path: Path) -> None:
    manifest = MANIFEST.replace('name = "echo"\n', "").replace("max_turns = 2", "max_turns = 0")
    manifest = manifest.replace('needs = "none"', 'needs = "vm"\ncolour = "red"')
    root = write_bundle(tmp_path / "echo", **{"bundle.toml": manifest})
    problems = validate_bundle(root)
    assert all(p.startswith("bundle.toml: ") for p in problems)
    text = "\n".join(problems)
    assert "name: required field missing" in text
    assert "max_turns:" in text
    assert "sandbox.needs:" in text
    assert "sandbox.colour: unknown field" in text
    with pytest.raises(BundleError) as err:
        load_bundle(root)
    assert len(err.value.problems) == len(problems) >= 4


def test_reward_needs_exactly_one_rule(tmp_path: Path) -> None:
    manifest = MANIFEST.replace('score = "grade"', 'score = "grade"\nweights = {grade = 1.0}')
    root = write_bundle(tmp_path / "echo", **{"bundle.toml": manifest})
    only_problem(root, "bundle.toml", "reward", "exactly one")


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ('type = "array"\nitems = { type = "string" }', '"type" must be "object"'),
        ('type = "object"', '"properties" must be a table'),
        ('type = "object"\nproperties = { word = { type = "text" } }', "not a JSON type"),
        ('type = "object"\nproperties = {}\nrequired = ["word"]', "names no property"),
    ],
)
def test_a_bad_tool_schema_is_reported(tmp_path: Path, parameters: str, needle: str) -> None:
    manifest = MANIFEST.replace('type = "object"\nproperties = {}', parameters)
    root = write_bundle(tmp_path / "echo", **{"bundle.toml": manifest})
    problem = only_problem(root, "bundle.toml", "tools[1] (shout)", needle)
    assert "parameters" in problem


def test_parameters_problems_accepts_a_rich_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer", "enum": [1, 2]}, "minItems": 2},
            "mode": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "opt": {"type": ["string", "null"]},
        },
        "required": ["xs"],
        "additionalProperties": False,
    }
    assert parameters_problems(schema) == []
    assert parameters_problems([]) == ["must be a JSON schema object (a table), not list"]


def test_tool_names_are_unique_and_end_turn_is_reserved(tmp_path: Path) -> None:
    manifest = MANIFEST.replace('name = "shout"', 'name = "say"')
    only_problem(write_bundle(tmp_path / "a", **{"bundle.toml": manifest}), "duplicate tool")
    manifest = MANIFEST.replace('name = "shout"', 'name = "end_turn"')
    only_problem(write_bundle(tmp_path / "b", **{"bundle.toml": manifest}), "reserved")


def test_missing_files_are_named(tmp_path: Path) -> None:
    root = write_bundle(tmp_path / "echo", **{"tasks/eval.jsonl": "", "verifier.py": ""})
    problems = validate_bundle(root)
    assert "tasks/eval.jsonl: missing (named by bundle.toml splits.eval)" in problems
    assert "verifier.py: missing (named by bundle.toml verifier.module)" in problems


def test_paths_must_stay_inside_the_bundle(tmp_path: Path) -> None:
    manifest = MANIFEST.replace('"tasks/eval.jsonl"', '"../outside.jsonl"')
    root = write_bundle(tmp_path / "echo", **{"bundle.toml": manifest})
    (tmp_path / "outside.jsonl").write_text(task_line("o") + "\n")
    only_problem(root, "bundle.toml", "splits.eval", "inside the bundle folder")


def test_task_line_problems_name_file_and_line(tmp_path: Path) -> None:
    train = "\n".join(
        [
            task_line("t0"),
            "{not json",
            json.dumps({"id": "t2", "data": {}}),
            task_line("t3", tools=["fly"]),
            task_line("t4", colour="red"),
            "[1, 2]",
            task_line("e0"),
        ]
    )
    root = write_bundle(tmp_path / "echo", **{"tasks/train.jsonl": train + "\n"})
    problems = validate_bundle(root)
    assert problems[0].startswith("tasks/train.jsonl:2: not JSON")
    assert "tasks/train.jsonl:3: prompt: required field missing" in problems
    assert any(p.startswith("tasks/train.jsonl:4:") and "unknown tool(s) ['fly']" for p in problems)
    assert "tasks/train.jsonl:5: colour: unknown field (not part of the format)" in problems
    assert "tasks/train.jsonl:6: a task line must be a JSON object" in problems
    assert any(
        p.startswith("tasks/eval.jsonl:1: duplicate task id 'e0'") and "tasks/train.jsonl:7" in p
        for p in problems
    )
    assert len(problems) == 6

    # load_bundle reads tasks lazily: the bad file surfaces on first use, all its lines listed.
    bundle = load_bundle(root)
    assert bundle.task("eval", 0).id == "e0"
    with pytest.raises(BundleError) as err:
        bundle.tasks("train")
    assert len(err.value.problems) == 5 and "tasks/train.jsonl:2" in str(err.value)


def test_an_empty_split_is_a_problem(tmp_path: Path) -> None:
    root = write_bundle(tmp_path / "echo", **{"tasks/eval.jsonl": "\n"})
    assert validate_bundle(root) == ["tasks/eval.jsonl: split 'eval' has no tasks"]


@pytest.mark.parametrize(
    ("files", "needles"),
    [
        ({"env.py": "import nowhere_at_all\n"}, ("env.py: does not import", "ModuleNotFound")),
        ({"env.py": "x = 1 / 0\n"}, ("env.py: does not import", "ZeroDivisionError", "env.py:1")),
        ({"env.py": "def broken(:\n"}, ("env.py: does not import", "SyntaxError")),
        ({"env.py": "class Other:\n    pass\n"}, ("env.py: defines no class 'EchoEnv'",)),
        ({"env.py": "class EchoEnv:\n    def reset(self, t): ...\n"}, ("lacks", "call_tool")),
        ({"env.py": ENV_NEEDING_ARGS}, ("env.py: class EchoEnv must take no constructor args",)),
        ({"verifier.py": "grade = 3\n"}, ("verifier.py: defines no callable 'grade'",)),
        ({"verifier.py": "def grade(task):\n    return {}\n"}, ("must take (task, state)",)),
        ({"verifier.py": "raise RuntimeError('no')\n"}, ("verifier.py: does not import",)),
    ],
)
def test_env_and_verifier_import_problems(
    tmp_path: Path, files: dict[str, str], needles: tuple[str, ...]
) -> None:
    only_problem(write_bundle(tmp_path / "echo", **files), *needles)


def test_a_crashing_or_lying_verifier_raises_verifier_error(tmp_path: Path) -> None:
    cases = {
        "def grade(task, state):\n    raise KeyError('said')\n": "verifier raised KeyError",
        "def grade(task, state):\n    return 1.0\n": "not a dict of scores",
        "def grade(task, state):\n    return {'grade': float('nan')}\n": "non-finite",
        "def grade(task, state):\n    return {'grade': 'high'}\n": "bad score",
    }
    for i, (code, needle) in enumerate(cases.items()):
        bundle = load_bundle(write_bundle(tmp_path / f"b{i}", **{"verifier.py": code}))
        with pytest.raises(VerifierError, match=needle):
            bundle.grade(bundle.task("eval", 0), {"said": "hi"})


def test_reward_combination() -> None:
    scores = {"grade": 0.5, "style": 1.0, "length": 3.0}
    assert RewardSpec(score="grade").combine(scores) == 0.5
    weighted = RewardSpec(weights={"grade": 0.5, "style": 0.5})
    assert math.isclose(weighted.combine(scores), 0.75)
    with pytest.raises(RewardError, match="style"):
        weighted.combine({"grade": 1.0})
    with pytest.raises(RewardError, match="not finite"):
        RewardSpec(score="grade").combine({"grade": math.inf})
    with pytest.raises(ValueError, match="exactly one"):
        RewardSpec()
    with pytest.raises(ValueError, match="empty"):
        RewardSpec(weights={})


def test_weighted_reward_from_a_manifest(tmp_path: Path) -> None:
    manifest = MANIFEST.replace('score = "grade"', "weights = { grade = 0.75, length = 0.125 }")
    bundle = load_bundle(write_bundle(tmp_path / "echo", **{"bundle.toml": manifest}))
    assert bundle.reward({"grade": 1.0, "length": 2.0}) == 1.0


def test_task_model_is_strict() -> None:
    task = Task(id="a", split="train", index=0, prompt="p")
    assert task.data == {} and task.tools is None
    with pytest.raises(TypeError):
        Task(id="a", split="train", index=0, prompt="p", extra=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="index"):
        Task(id="a", split="train", index=-1, prompt="p")
    assert Task.from_json(task.to_json()) == task


def test_load_bundle_error_lists_every_problem(tmp_path: Path) -> None:
    root = write_bundle(
        tmp_path / "echo", **{"env.py": "import nowhere_at_all\n", "verifier.py": "grade = 3\n"}
    )
    with pytest.raises(BundleError) as err:
        load_bundle(root)
    assert len(err.value.problems) == 2
    message = str(err.value)
    assert "env.py" in message and "verifier.py" in message
