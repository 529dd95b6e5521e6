"""``corral view``: the reader over real folders, the app's safety rules, and the page in a
real headless Chromium (Debian's ``chromium`` + ``chromium-driver`` through Selenium; the
browser tests skip without them).

The folders are written by corral's own writers (tests/viewer_folders.py), and one is the run
folder of a real one-step ``corral train`` on the weather bundle (a row that raises: a failed
eval episode and a dropped group)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral.rollouts.evals import write_eval
from corral.viewer import reader
from corral.viewer.app import create_app, open_state
from corral.viewer.redact import REDACTED, scrub
from tests.viewer_folders import (
    FAILURE,
    HOSTILE,
    eval_report,
    pieces,
    write_eval_folder,
    write_play_folder,
    write_run_folder,
)

SECRET = "sk-must-not-show"  # the api_key the play folder's sessions carry in metadata


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("viewer")
    return {
        "run": write_run_folder(root / "run"),
        "eval": write_eval_folder(root / "eval", n=20),
        "play": write_play_folder(root / "play"),
    }


# -- the reader --------------------------------------------------------------------------------


def test_a_run_folder_has_its_evals_metrics_and_dropped_groups(folders: dict[str, Path]) -> None:
    sources, sets = reader.open_sources([folders["run"]])
    assert sources[0].kind == "run"
    assert [(s.name, s.step, s.weight_version) for s in sets] == [
        (f"evals/step-{n:06d}", n, f"step-{n}") for n in range(3)
    ]
    assert sets[0].group_by == "battery.capacity_mwh" and len(sets[0].episodes) == 12
    run = reader.run_metrics(sources[0])
    assert [line["step"] for line in run["steps"]] == [1, 2]
    assert [line["step"] for line in run["evals"]] == [0, 1, 2]
    (dropped,) = run["dropped"]
    assert (dropped["reason"], dropped["detail"], dropped["tasks"]) == (
        "failed_rollout",
        FAILURE,
        ["train-0007"],
    )


def test_the_list_is_compact_columns_and_failed_episodes_carry_their_reason(
    folders: dict[str, Path],
) -> None:
    _, sets = reader.open_sources([folders["eval"]])
    columns = reader.episode_columns(sets)
    assert set(columns) == set(reader.LIST_COLUMNS)
    assert len(columns["task_id"]) == 20
    failed = [i for i, f in enumerate(columns["failed"]) if f]
    assert failed == [2, 9, 16]
    assert {columns["reason"][i] for i in failed} == {FAILURE}
    assert all(columns["flagged"][i] for i in failed)
    assert set(columns["group"]) == {"1", "2", "4"} and set(columns["family"]) == {"eval"}


def test_an_eval_episode_has_its_conversation_grade_and_time(folders: dict[str, Path]) -> None:
    _, sets = reader.open_sources([folders["eval"]])
    detail = reader.episode_detail(sets[0], 1)
    messages = detail["record"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[-1]["content"] == HOSTILE  # kept as data: the page inserts it as text
    assert messages[2]["tool_calls"][0]["function"]["name"] == "simulate_schedule"
    assert detail["spans"]["kind"] == "sums"
    assert [s["name"] for s in detail["spans"]["spans"]] == ["model", "tools", "total"]
    assert detail["samples"] == []  # an eval folder keeps messages, not tokens
    assert reader.episode_detail(sets[0], 2)["record"]["reason"] == FAILURE


def test_a_play_folder_gives_samples_by_mask_weight_version_and_fork(
    folders: dict[str, Path],
) -> None:
    _, (play,) = reader.open_sources([folders["play"]])
    assert play.kind == "play"
    forked = reader.episode_detail(play, 0)
    assert [s["trajectory"] for s in forked["samples"]] == [0, 1]
    drift = forked["samples"][1]["drift"]
    assert drift["reason"] == "diverged" and drift["compared_trajectory"] == 0
    assert (drift["held_text"], drift["new_text"]) == ("will check.|", "WILL CHECK.|")

    sample = reader.sample_detail(play, 1, 0, pieces)
    prompt = sample["mask"].count(-1)
    assert sample["mask"][:prompt] == [-1] * prompt and {0, 1} <= set(sample["mask"])
    assert all(lp is None for lp in sample["logprobs"][:prompt])
    assert sample["weight_versions"] == ["step-0", "step-1"]
    assert max(sample["turn"]) == 1  # two model turns, an observation between them
    assert HOSTILE in "".join(sample["pieces"])
    assert sample["metadata"]["api_key"] == REDACTED

    fork = reader.sample_detail(play, 0, 1, pieces)
    assert fork["fork"]["position"] == drift["position"]
    assert fork["pieces"][fork["fork"]["position"]] == "W"  # the first divergent token

    failed = reader.episode_detail(play, 2)
    assert failed["record"]["reason"] == FAILURE
    assert all(s["status"] == "failed" for s in failed["samples"])


def test_a_traces_file_gives_the_episode_its_spans(tmp_path: Path) -> None:
    play = write_play_folder(tmp_path / "play")
    session = json.loads((play / "episodes.jsonl").read_text().splitlines()[0])["session_id"]
    # The span format the reader accepts (module docstring of corral.viewer.reader); no
    # writer exists yet.
    spans = [
        {"session_id": session, "name": "model turn 0", "start_s": 0.0, "end_s": 0.4},
        {"session_id": session, "name": "tool simulate", "start_s": 0.4, "duration_s": 0.1,
         "attrs": {"auth_token": "secret-value"}},
        {"session_id": "another", "name": "not ours", "start_s": 0.0, "end_s": 1.0},
    ]  # fmt: skip
    (play / "traces.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    _, (episodes,) = reader.open_sources([play])
    timeline = reader.episode_detail(episodes, 0)["spans"]
    assert timeline["kind"] == "trace"
    assert [(s["name"], s["end_s"]) for s in timeline["spans"]] == [
        ("model turn 0", 0.4),
        ("tool simulate", pytest.approx(0.5)),
    ]
    assert timeline["spans"][1]["attrs"] == {"auth_token": REDACTED}


def test_two_sets_compare_by_paired_differences(folders: dict[str, Path]) -> None:
    _, sets = reader.open_sources([folders["run"]])
    compared = reader.compare_sets(sets[0], sets[2])
    graded = [e for e in sets[0].episodes if e.reward is not None]
    assert compared["paired"] == len(graded) and compared["unpaired"] == 12 - len(graded)
    assert compared["mean_diff"] == pytest.approx(
        sum(p["b"] - p["a"] for p in compared["pairs"]) / len(graded)
    )
    assert compared["better"] + compared["worse"] + compared["same"] == len(graded)


def test_scrub_drops_secrets_and_keeps_token_ids() -> None:
    data = {
        "tokens": [1, 2, 3], "held_token": 7, "token_var": "CORRAL_ADMIN",
        "api_key": "sk-1", "admin_token": "abc", "headers": {"Authorization": "Bearer x"},
        "note": "Bearer abcdefghijkl", "nested": [{"password": 1, "max_tokens": 10}],
    }  # fmt: skip
    assert scrub(data) == {
        "tokens": [1, 2, 3], "held_token": 7, "token_var": "CORRAL_ADMIN",
        "api_key": REDACTED, "admin_token": REDACTED, "headers": {"Authorization": REDACTED},
        "note": REDACTED, "nested": [{"password": REDACTED, "max_tokens": 10}],
    }  # fmt: skip


def test_ten_thousand_episodes_are_indexed_and_listed_in_under_two_seconds(
    tmp_path: Path,
) -> None:
    """The server's part of opening 10,000 episodes: reading the file once and answering the
    list (the page's part is timed in Chromium below)."""
    write_eval(eval_report(10_000, failed_every=7), tmp_path / "big")
    times = []
    for _ in range(3):  # the best of three: a loaded machine (CI, two cores) is noisy
        began = time.perf_counter()
        state = open_state([tmp_path / "big"])
        body = json.dumps(reader.episode_columns(state.sets))
        times.append(time.perf_counter() - began)
        assert len(json.loads(body)["task_id"]) == 10_000
    seconds = min(times)
    print(f"indexed and listed 10,000 episodes in {seconds:.2f} s ({len(body)} bytes)")
    assert seconds < 2.0


# -- the app -----------------------------------------------------------------------------------


def test_the_app_is_read_only_loopback_only_and_never_serves_a_secret(
    folders: dict[str, Path],
) -> None:
    state = open_state([folders["run"], folders["eval"], folders["play"]], pieces=pieces)
    with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
        index = client.get("/")
        assert "script-src 'self'" in index.headers["content-security-policy"]
        assert index.headers["x-content-type-options"] == "nosniff"
        assert client.post("/api/sources").status_code == 405
        assert client.get("/api/sources", headers={"host": "attacker.example"}).status_code == 400
        assert client.get("/api/episodes/99/0").status_code == 404
        bodies = [client.get("/api/sources").text, client.get("/api/episodes").text]
        play = len(state.sets) - 1
        for line in range(3):
            detail = client.get(f"/api/episodes/{play}/{line}").json()
            bodies.append(json.dumps(detail))
            for n in range(len(detail["samples"])):
                bodies.append(client.get(f"/api/episodes/{play}/{line}/samples/{n}").text)
        assert not any(SECRET in body for body in bodies)
        assert client.get("/static/app.js").status_code == 200


def test_the_view_command_parses() -> None:
    import argparse

    from corral.cli.view import add_view_command

    parser = argparse.ArgumentParser()
    add_view_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["view", "runs/a", "runs/b", "--port", "9000"])
    assert (args.paths, args.port, args.host) == (["runs/a", "runs/b"], 9000, "127.0.0.1")


# -- a real corral train -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of ``corral train`` on the weather bundle's ``ok`` and ``raise`` rows (both
    evaluated: the ``raise`` episode fails; a group drawn from it is dropped)."""
    pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")
    from corral.cli import main
    from tests.weather import write_weather_bundle

    root = tmp_path_factory.mktemp("trained")
    bundle = write_weather_bundle(root / "weather", modes=("ok", "raise"))
    run = root / "run"
    sets = [f'model.path="{tiny_model_dir}"', f'env.bundle="{bundle}"', 'env.eval_split="train"',
            "rollout.groups_per_step=1", "rollout.rollouts_per_row=2", "rollout.max_draws=4",
            "rollout.temperature=0", "rollout.max_tokens=32", "schedule.eval_every=1",
            "tensorboard=false"]  # fmt: skip
    assert (
        main(["train", "--run-dir", str(run), "--steps", "1", *[f"--set={s}" for s in sets]]) == 0
    )
    return run


def test_the_viewer_reads_a_real_corral_train_run(trained_run: Path) -> None:
    sources, found = reader.open_sources([trained_run])
    sets = [s for s in found if s.step is not None]
    assert sources[0].kind == "run" and [s.step for s in sets] == [0, 1]
    assert [s.weight_version for s in sets] == ["step-0", "step-1"]
    # What the one update trained on (and the dropped group's rollouts): every rollout with
    # its session's samples and its spans.
    (trained,) = [s for s in found if s.name == "rollouts/update-000001"]
    assert trained.kind == "play" and len(trained.episodes) >= 2
    assert {e.task_id for e in trained.episodes} <= {"w-ok", "w-raise"}
    ok = next(e for e in trained.episodes if not e.failed)
    detail = reader.episode_detail(trained, ok.line)
    assert detail["samples"] and detail["spans"]["kind"] == "trace"
    names = [span["name"] for span in detail["spans"]["spans"]]
    assert names[0] == "episode" and "model_call" in names and "env_reset" in names
    for episode_set in sets:
        by_task = {e.task_id: e for e in episode_set.episodes}
        assert set(by_task) == {"w-ok", "w-raise"}
        assert by_task["w-raise"].failed and by_task["w-raise"].reason
        assert not by_task["w-ok"].failed
        detail = reader.episode_detail(episode_set, by_task["w-ok"].line)
        assert detail["record"]["messages"][0]["role"] in ("system", "user")
    run = reader.run_metrics(sources[0])
    assert [line["step"] for line in run["steps"]] == [1]
    assert all(d["reason"] == "failed_rollout" for d in run["dropped"])


# -- the page, in headless Chromium --------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1400"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(folders: dict[str, Path], trained_run: Path) -> Iterator[tuple[str, Any]]:
    from corral.serving import serve_in_thread

    state = open_state([trained_run, folders["eval"], folders["play"]], pieces=pieces)
    with serve_in_thread(create_app(state)) as url:
        yield url, state


def _wait(driver: Any, css: str, timeout: float = 15.0) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def _until(driver: Any, check: Any, timeout: float = 15.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: check(d))


def _go(driver: Any, url: str, hash_: str, ready: str) -> Any:
    driver.get(f"{url}/{hash_}")
    return _wait(driver, ready)


def test_the_page_lists_every_episode_and_a_filter_narrows_it(
    browser: Any, page: tuple[str, Any]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, state = page
    total = sum(len(s.episodes) for s in state.sets)
    failed = sum(e.failed for s in state.sets for e in s.episodes)
    _go(browser, url, "#/episodes", ".ep-row")
    count = browser.find_element(By.ID, "ep-count")
    assert count.text == f"{total} of {total} episodes"
    rows = browser.find_elements(By.CSS_SELECTOR, ".ep-row")
    assert len(rows) == total  # every episode fits the window: all are rendered
    Select(browser.find_element(By.NAME, "status")).select_by_value("failed")
    _until(browser, lambda d: count.text == f"{failed} of {total} episodes")
    rows = browser.find_elements(By.CSS_SELECTOR, ".ep-row")
    assert len(rows) == failed and 0 < failed < total
    assert all(r.find_elements(By.CSS_SELECTOR, ".failed") for r in rows)

    rows[0].click()  # a failed episode shows its reason
    reason = _wait(browser, "#reason")
    assert reason.text.strip()


def test_a_failed_episode_of_the_real_run_shows_its_reason(
    browser: Any, page: tuple[str, Any]
) -> None:
    url, state = page
    run_set = next(s for s in state.sets if s.step == 0)  # the run's first evaluation
    line = next(e.line for e in run_set.episodes if e.failed)
    reason = _go(browser, url, f"#/episode/{run_set.id}/{line}", "#reason")
    assert reason.text == reader.episode_detail(run_set, line)["record"]["reason"].strip()


def test_a_sample_colours_masked_and_trained_tokens_apart(
    browser: Any, page: tuple[str, Any]
) -> None:
    url, state = page
    play = state.sets[-1]
    _go(browser, url, f"#/sample/{play.id}/1/0", ".tok.m1")
    colours = browser.execute_script(
        "const bg = (c) => getComputedStyle(document.querySelector(c)).backgroundColor;"
        "return [bg('.tok.mp'), bg('.tok.m0'), bg('.tok.m1')];"
    )
    assert len(set(colours)) == 3, colours
    assert all(c not in ("rgba(0, 0, 0, 0)", "transparent") for c in colours)


def test_a_forked_session_shows_its_fork(browser: Any, page: tuple[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    url, state = page
    play = state.sets[-1]
    forks = _go(browser, url, f"#/sample/{play.id}/0/1", "#forks")
    assert "diverged" in forks.text
    assert browser.find_element(By.ID, "held-text").text == "will check.|"
    assert browser.find_element(By.ID, "new-text").text == "WILL CHECK.|"
    marked = _wait(browser, ".tok.fork")
    assert marked.text == "W"  # the first divergent token, marked in the token view


def test_model_output_with_a_script_renders_as_text(browser: Any, page: tuple[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    url, state = page
    evals = next(s for s in state.sets if s.source == 1)
    conversation = _go(browser, url, f"#/episode/{evals.id}/1", "#conversation")
    assert HOSTILE in conversation.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#conversation script, #conversation img")
    play = state.sets[-1]
    _go(browser, url, f"#/sample/{play.id}/1/0", ".tok.m1")
    time.sleep(0.2)
    assert browser.execute_script("return window.__pwned === undefined")


def test_the_page_opens_ten_thousand_episodes_in_under_two_seconds(
    browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    from corral.serving import serve_in_thread

    write_eval(eval_report(10_000, failed_every=7), tmp_path / "big")
    state = open_state([tmp_path / "big"])
    with serve_in_thread(create_app(state)) as url:
        began = time.perf_counter()
        _go(browser, url, "#/episodes", ".ep-row")
        _until(browser, lambda d: d.find_element(By.ID, "ep-count").text.startswith("10000 of"))
        seconds = time.perf_counter() - began
        rendered = len(browser.find_elements(By.CSS_SELECTOR, ".ep-row"))
    print(f"the page showed 10,000 episodes in {seconds:.2f} s ({rendered} rows rendered)")
    assert rendered < 200  # only what is on screen
    assert seconds < 2.0


def test_a_live_gateway_lists_its_sessions_and_opens_one(browser: Any, stack: Any) -> None:
    """The viewer in front of a real gateway (the local engine, the tiny model): the page
    lists the session made here with its task and reward, a click opens its conversation
    (model input shown as text) and its sample's tokens by loss mask."""
    import httpx
    from selenium.webdriver.common.by import By

    from corral.serving import serve_in_thread
    from corral.viewer.gateway_source import GatewaySource
    from tests.gateway_stack import ADMIN, AUTH

    made = stack.session(metadata={"task_id": "live-task"})
    answered = httpx.post(
        f"{made['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {made['api_key']}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": HOSTILE}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=60,
    )
    assert answered.status_code == 200, answered.text
    reward = httpx.post(
        f"{stack.url}/sessions/{made['id']}/reward", headers=AUTH, json={"reward": 0.5}
    )
    assert reward.status_code == 200
    state = open_state([], pieces=pieces, gateway=GatewaySource(stack.url, ADMIN))
    with serve_in_thread(create_app(state)) as url:
        _go(browser, url, "#/", ".session-row")
        rows = browser.find_elements(By.CSS_SELECTOR, ".session-row")
        (row,) = [r for r in rows if made["id"] in r.text]
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[1:5] == ["live-task", "1", "1", "0.500"]
        assert made["api_key"] not in browser.page_source
        row.find_element(By.TAG_NAME, "a").click()
        conversation = _wait(browser, "#conversation")
        assert HOSTILE in conversation.text
        assert browser.find_element(By.ID, "reward").text == "0.500"
        assert browser.execute_script("return window.__pwned === undefined")
        _go(browser, url, f"#/session/{made['id']}/sample/0", ".tok.m1")
