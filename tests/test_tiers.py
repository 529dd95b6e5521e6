"""The test tiers (tests/tiers.py): every name the tier lists hold exists, so a rename cannot
quietly move tests from one tier to the other, and the rules pick the tier they say."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import tiers

HERE = Path(__file__).resolve().parent


def _functions(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_every_listed_module_exists() -> None:
    missing = sorted(m for m in tiers.E2E_MODULES if not (HERE / m).is_file())
    assert not missing, f"tests/tiers.py lists modules that are gone: {missing}"


def test_every_listed_test_exists_in_a_module_of_the_unit_tier() -> None:
    for name in sorted(tiers.E2E_TESTS):
        module, function = name.split("::")
        assert (HERE / module).is_file(), f"{name}: no module {module}"
        assert module not in tiers.E2E_MODULES, f"{name}: its whole module is e2e already"
        assert function in _functions(HERE / module), f"{name}: no test {function}"


def test_every_listed_fixture_is_defined_in_conftest() -> None:
    defined = _functions(HERE / "conftest.py")
    assert defined >= tiers.E2E_FIXTURES, tiers.E2E_FIXTURES - defined


@pytest.mark.parametrize(
    ("fixtures", "param_id", "module", "function", "marked", "tier"),
    [
        ((), None, "test_groups.py", "test_x", False, tiers.UNIT),
        (("tiny_model_dir",), None, "test_groups.py", "test_x", False, tiers.E2E),
        (("tmp_path", "docker_daemon"), None, "test_groups.py", "test_x", False, tiers.E2E),
        ((), "bwrap-1", "test_groups.py", "test_x", False, tiers.E2E),
        ((), "local-1", "test_groups.py", "test_x", False, tiers.UNIT),
        ((), "tiny_think_model_dir", "test_groups.py", "test_x", False, tiers.E2E),
        ((), None, "test_vllm.py", "test_x", False, tiers.E2E),
        (
            (),
            None,
            "test_env_failures.py",
            "test_state_after_a_timeout_never_asks_the_abandoned_env",
            False,
            tiers.E2E,
        ),
        ((), None, "test_env_failures.py", "test_other", False, tiers.UNIT),
        ((), None, "test_groups.py", "test_x", True, tiers.E2E),
    ],
)
def test_tier_of_follows_its_rules(
    fixtures: tuple[str, ...],
    param_id: str | None,
    module: str,
    function: str,
    marked: bool,
    tier: str,
) -> None:
    assert tiers.tier_of(module, function, fixtures, param_id, marked_e2e=marked) == tier


@pytest.mark.parametrize(
    ("expression", "deselects"),
    [
        ("not e2e", True),
        ("unit", True),
        ("unit and not k8s", True),
        ("", False),
        ("e2e", False),
        ("unit or e2e", False),
        ("not unit", False),
        ("(", False),  # pytest reports the bad expression itself
    ],
)
def test_only_expressions_that_leave_out_every_e2e_test_skip_importing_e2e_modules(
    expression: str, deselects: bool
) -> None:
    assert tiers.deselects_e2e(expression) is deselects
