"""``corral.stack``: each server started one way, in a thread or as a child, from its typed
settings; and ``corral.bundled``: what the checkout ships, found when asked for."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from corral import bundled
from corral.envs.settings import ServeSettings
from corral.gateway.launch import GatewayLaunch
from corral.stack.env_server import env_server_in_process, env_server_in_thread
from corral.stack.gateway import gateway_in_process
from corral.trainer.config import TrainConfig
from tests.weather import write_weather_bundle

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "env-secret"


def _check_served(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/splits").status_code == 401  # the token is required
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{url}/splits", headers=auth).status_code == 200


def test_an_env_server_in_a_thread_serves_its_settings(tmp_path: Path) -> None:
    settings = ServeSettings(bundle=write_weather_bundle(tmp_path / "weather"), tool_timeout=5)
    with env_server_in_thread(settings, token=TOKEN) as url:
        _check_served(url)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_an_env_server_child_reads_its_token_from_the_variable_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STACK_TEST_ENV_TOKEN", TOKEN)
    bundle = write_weather_bundle(tmp_path / "weather")
    settings = ServeSettings(bundle=bundle, token_var="STACK_TEST_ENV_TOKEN", warm_sandboxes=0)
    log = tmp_path / "env.log"
    with env_server_in_process(settings, log=log) as url:
        _check_served(url)
    assert "Uvicorn running" in log.read_text()


def test_a_child_gateway_gets_its_admin_token_only_through_a_variable(tmp_path: Path) -> None:
    launch = GatewayLaunch(engine_url="http://127.0.0.1:1", model=tmp_path)
    with (
        pytest.raises(ValueError, match="admin_token_var"),
        gateway_in_process(launch, log=tmp_path / "g.log", admin_token="secret"),
    ):
        pytest.fail("started a child gateway with its token in no variable")
    assert "secret" not in " ".join(
        GatewayLaunch(**{**vars(launch), "admin_token_var": "V"}).to_argv()
    )


def test_the_checkout_ships_the_gridsim_bundle_and_the_trained_policy() -> None:
    assert bundled.gridsim_bundle() == ROOT / "bundles" / "gridsim"
    assert bundled.trained_gridsim_policy() == ROOT / "examples" / "gridsim_rl" / "model"
    # The trainer's default bundle is found when a run serves it, not computed at import.
    env = TrainConfig().env
    assert env.bundle is None and env.bundle_folder() == ROOT / "bundles" / "gridsim"


def test_an_installed_package_without_the_checkout_says_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled, "repository_path", lambda *parts: tmp_path.joinpath(*parts))
    with pytest.raises(bundled.BundledMissing, match=r"checkout.*--bundle PATH"):
        bundled.gridsim_bundle()
    with pytest.raises(bundled.BundledMissing, match=r"checkout.*--policy PATH"):
        bundled.trained_gridsim_policy()
    with pytest.raises(FileNotFoundError, match="gridsim bundle"):
        TrainConfig().env.bundle_folder()
    # A run that names its bundle needs none of the checkout's.
    named = TrainConfig.model_validate({"env": {"bundle": str(tmp_path)}}).env
    assert named.bundle_folder() == tmp_path
