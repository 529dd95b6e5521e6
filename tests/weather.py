"""A bundle the tiny model can play: its one tool is ``get_weather(city)``, the tool the model
was imprinted to call. Each task's ``mode`` says how its env behaves, to drive every path of a
rollout: ``ok`` answers and ends the episode (graded 1 when the model asked for the task's
city), ``wrong`` asks about another city than the one it grades (reward 0), ``raise`` raises,
``hang`` sleeps past a short tool timeout (``stall`` too, after marking its working folder),
``crash`` makes the verifier raise."""

from __future__ import annotations

import json
from pathlib import Path

WEATHER_TOML = """
name = "weather"
version = "1"
system_prompt = "You can look up the weather."
max_turns = 2

[splits]
train = "tasks/train.jsonl"

[env]
module = "env.py"
class = "WeatherEnv"

[reward]
score = "right_city"

[[tools]]
name = "get_weather"
description = "The current weather in a city."

[tools.parameters]
type = "object"
required = ["city"]
[tools.parameters.properties.city]
type = "string"
"""

WEATHER_ENV = """
import time
from corral.envs.episode import ToolOutcome


class WeatherEnv:
    def reset(self, task):
        self.task, self.asked = task, []
        return task.prompt

    def call_tool(self, name, arguments):
        mode = self.task.data["mode"]
        if mode == "raise":
            raise RuntimeError("the weather service is down")
        if mode == "stall":  # a hang that marks its working folder first (a sandbox's)
            open("hanging", "w").close()
        if mode in ("hang", "stall"):
            time.sleep(5)
        self.asked.append(arguments.get("city"))
        return ToolOutcome(f"sunny in {arguments.get('city')}", done=True)

    def state(self):
        return {"asked": self.asked}
"""

WEATHER_VERIFIER = """
def grade(task, state):
    if task.data["mode"] == "crash":
        raise ValueError("the verifier crashed on purpose")
    return {"right_city": float(state["asked"] == [task.data["city"]])}
"""

MODES = ("ok", "raise", "hang", "stall", "crash")


def write_weather_bundle(root: Path, *, modes: tuple[str, ...] = MODES) -> Path:
    """Write the bundle at ``root`` (one train task per mode, ids ``w-<mode>``); its evals
    group by mode."""
    (root / "tasks").mkdir(parents=True)
    (root / "bundle.toml").write_text(WEATHER_TOML + '\n[eval]\ngroup_by = "mode"\n')
    (root / "env.py").write_text(WEATHER_ENV)
    (root / "verifier.py").write_text(WEATHER_VERIFIER)
    lines = [
        {"id": f"w-{mode}",
         "prompt": f"What is the weather in {'Oslo' if mode == 'wrong' else 'Paris'}?",
         "data": {"mode": mode, "city": "Paris"}}
        for mode in modes
    ]  # fmt: skip
    (root / "tasks" / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
    return root


def weather_conversation(city: str, i: int) -> dict[str, object]:
    """A chat fine-tuning line (OpenAI's shape) of the tiny model's one skill: asked about
    ``city``'s weather, it calls ``get_weather`` (call id ``call_{i}``), then answers."""
    from corral.engines.tiny_model import TOOLS

    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    call = {"id": f"call_{i}", "type": "function", "function": function}
    return {
        "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"rain in {city}"},
            {"role": "assistant", "content": f"It rains in {city}."},
        ],
        "tools": TOOLS,
    }


def write_weather_chats(path: Path) -> Path:
    """A chat fine-tuning file at ``path``: :func:`weather_conversation` for each of the tiny
    model's cities."""
    from corral.engines.tiny_model import CITIES

    lines = [weather_conversation(city, i) for i, city in enumerate(CITIES)]
    path.write_text("".join(json.dumps(c) + "\n" for c in lines))
    return path
