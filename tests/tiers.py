"""The two test tiers, as a pytest plugin (``conftest.py`` registers it and the markers).

Every test gets exactly one of two marks: ``e2e`` (real engines, sandboxes, processes, agent
CLIs, trainer runs) or ``unit`` (everything else: in-process and CPU-only, a few seconds at
most). ``pytest -m "not e2e"`` runs the unit tier; plain ``pytest`` still runs both.

A test is ``e2e`` when any of these holds, checked in this order (``tier_of``):

- it is marked ``e2e`` by hand;
- it uses, directly or through another fixture, one of ``E2E_FIXTURES`` (a new test on the
  tiny model or docker is e2e without anyone listing it);
- it is parametrized onto a real sandbox backend (an id part in ``E2E_PARAMS``) or onto one of
  ``E2E_FIXTURES`` by name (tests that take the fixture through ``request.getfixturevalue``);
- its module is in ``E2E_MODULES`` (modules whose every test drives real processes);
- it is one of ``E2E_TESTS`` (the few slow tests of otherwise fast modules).

Every name in those lists must exist (``tests/test_tiers.py`` checks it), so a rename cannot
quietly move tests between tiers. When the unit tier is run, modules in ``E2E_MODULES`` are not
even imported (importing them costs more than running the whole tier), and unit tests slower
than ``UNIT_SLOW_S`` are listed at the end, to be made faster or moved here.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

E2E = "e2e"
UNIT = "unit"
MARKERS = {
    E2E: "drives real engines, sandboxes, processes, agent CLIs or trainer runs (tests/tiers.py)",
    UNIT: "in-process and CPU-only, seconds at most: the tier of pytest -m 'not e2e'",
}

# The tiny model (trained on first use, minutes on a cold cache) and the docker daemon.
E2E_FIXTURES = frozenset({"tiny_model_dir", "tiny_think_model_dir", "docker_daemon"})

# Sandbox backends that start real sandboxes (tests parametrized by backend carry these ids).
E2E_PARAMS = frozenset({"docker", "bwrap"})

E2E_MODULES = frozenset(
    {
        # agents and harnesses: agent processes, sandboxes, the model behind the gateway
        "test_agent_adversarial.py",
        "test_agent_bridge.py",
        "test_agent_clis.py",
        "test_agent_forks.py",
        "test_agent_isolation.py",
        "test_agent_remote_sandboxes.py",
        "test_agents.py",
        "test_env_agents.py",
        "test_harness_rollouts.py",
        "test_harnesses.py",
        "test_train_harness.py",
        # sandboxes: bwrap, docker, and the e2b and kubernetes stand-in servers
        "test_env_sandboxed.py",
        "test_playcheck.py",
        "test_sandbox_attacks.py",
        "test_sandbox_contract.py",
        "test_sandbox_docker.py",
        "test_sandbox_e2b.py",
        "test_sandbox_kubernetes.py",
        "test_sandbox_local_bwrap.py",
        # engines and the gateway in front of them
        "test_anthropic_messages.py",
        "test_constrained_decoding.py",
        "test_engine_affinity.py",
        "test_evals.py",
        "test_gateway.py",
        "test_gateway_conformance.py",
        "test_gateway_startup.py",
        "test_local_engine.py",
        "test_openai_responses.py",
        "test_player.py",
        "test_routers.py",
        "test_run_output.py",
        "test_sampling_adjustments.py",
        "test_slime_adapter.py",
        "test_vllm.py",
        # megatron and trainer runs, worlds of processes, the main job
        "test_gridsim_rl_example.py",
        "test_main_job.py",
        "test_trainer_loop.py",
        "test_trainer_model.py",
        "test_trainer_parallel.py",
        "test_trainer_ray.py",
        "test_trainer_rollouts.py",
        "test_trainer_sft.py",
        "test_trainer_sft_parallel.py",
        "test_trainer_sft_run.py",
        "test_trainer_step.py",
        "test_trainer_world.py",
        # the CLI and servers as subprocesses, sockets against real deadlines, a browser
        "test_cli.py",
        "test_cli_errors.py",
        "test_doctor.py",
        "test_env_lifecycle.py",
        "test_env_transport.py",
        "test_sglang_client.py",
        "test_openenv_compat.py",
        "test_processes.py",
        "test_readme.py",
        "test_rows.py",
        "test_viewer.py",
    }
)

# "module::function": slow tests in modules that are otherwise unit.
E2E_TESTS = frozenset(
    {
        # waits out a real tool timeout (about 15 s)
        "test_env_failures.py::test_state_after_a_timeout_never_asks_the_abandoned_env",
        # plays every eval task three times (about 11 s)
        "test_shellcraft.py::test_baselines_idle_naive_solver_on_eval",
        # wait out real deadlines on a socket (2 s, 1.5 s)
        "test_env_routes.py::test_first_reset_timeout_is_a_deadline_from_connecting",
        "test_env_routes.py::test_a_socket_whose_episode_is_reaped_is_closed",
        # builds two tiny models
        "test_tiny_model.py::test_same_seed_same_weights",
        # runs the CLI as subprocesses
        "test_template_check.py::test_the_cli_refuses_unknown_parsers_and_folders",
    }
)

UNIT_SLOW_S = 5.0


def tier_of(
    module: str,
    function: str,
    fixtures: Collection[str],
    param_id: str | None = None,
    marked_e2e: bool = False,
) -> str:
    """``E2E`` or ``UNIT`` for test ``function`` of ``module`` (a file name), which uses
    ``fixtures`` (all of them, transitively) and is parametrized as ``param_id``."""
    if marked_e2e or E2E_FIXTURES.intersection(fixtures):
        return E2E
    if param_id is not None and (E2E_PARAMS | E2E_FIXTURES).intersection(param_id.split("-")):
        return E2E
    if module in E2E_MODULES or f"{module}::{function}" in E2E_TESTS:
        return E2E
    return UNIT


def deselects_e2e(markexpr: str) -> bool:
    """Whether ``-m markexpr`` leaves out every e2e test, whatever its other marks: false for
    a test marked only ``e2e`` and for one carrying every mark. (Exact for the expressions
    people write, such as ``not e2e`` or ``unit and not k8s_cluster``; when unsure, false.)"""
    if not markexpr.strip():
        return False
    try:
        expression = Expression.compile(markexpr)
    except SyntaxError:
        return False  # pytest itself reports the bad expression
    only_e2e = expression.evaluate(lambda name, **_: name == E2E)
    every_mark = expression.evaluate(lambda name, **_: name != UNIT)
    return not only_e2e and not every_mark


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name in E2E_MODULES and deselects_e2e(config.option.markexpr or ""):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        tier = tier_of(
            item.path.name,
            getattr(item, "originalname", item.name),
            getattr(item, "fixturenames", ()),
            callspec.id if callspec is not None else None,
            marked_e2e=item.get_closest_marker(E2E) is not None,
        )
        item.add_marker(tier)


class _SlowUnits:
    """Collects the unit tests whose call took longer than ``UNIT_SLOW_S``."""

    def __init__(self) -> None:
        self.slow: list[tuple[float, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and UNIT in report.keywords and report.duration > UNIT_SLOW_S:
            self.slow.append((report.duration, report.nodeid))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.slow:
            terminalreporter.section(f"unit tests slower than {UNIT_SLOW_S:.0f} s")
            for duration, nodeid in sorted(self.slow, reverse=True):
                terminalreporter.write_line(f"{duration:6.1f} s  {nodeid}")
            terminalreporter.write_line("make them faster, or list them in tests/tiers.py")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_SlowUnits(), "corral-slow-units")
