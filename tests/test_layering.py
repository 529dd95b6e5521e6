"""Which of corral's packages may import which: the import graph points one way.

Every ``import`` and ``from ... import`` in ``corral/`` counts, at module level, inside a
function (a lazy import is a dependency all the same) or under ``TYPE_CHECKING``. A module's
package is its first level below ``corral`` (``corral.gateway.app`` -> ``corral.gateway``;
``corral.samples`` is its own). The rules:

1. ``corral.samples`` (the ``Sample`` contract the gateway, the trainer and the adapters share)
   imports nothing of corral, and nothing outside the standard library but pydantic.
2. ``corral.gateway`` imports none of ``corral.envs``, ``corral.rollouts``,
   ``corral.adapters``, ``corral.trainer``, nor the application layer above everything
   (``corral.cli``, ``corral.run``, ``corral.stack``).
3. ``corral.rollouts`` (rows, the player, harness rollouts, evals) may import the gateway (its
   client), the envs, ``corral.samples``, and not ``corral.trainer``, ``corral.adapters``,
   ``corral.run`` or ``corral.stack``.
4. ``corral.trainer`` does not import ``corral.adapters``: both build on ``corral.rollouts``.
5. ``corral.envs`` imports none of ``corral.gateway``, ``corral.rollouts``, ``corral.trainer``,
   ``corral.adapters`` nor the application layer: env servers and bundles sit below all of them.
6. Only the application layer imports ``corral.cli``: ``corral.cli`` itself and the top-level
   ``corral.run``, ``corral.stack`` and ``corral.doctor``. A command's argument parsing and its
   ``UsageError``/``RunError`` live in ``corral.cli``; the packages below raise their own errors.
7. Every ``corral`` module an import names exists (a move leaves no stale import behind,
   including lazy ones that no other test runs).

The gateway's client sends the server's own ``SessionOptions`` (``corral.gateway.options``,
light on purpose); a test checks that the client stays light: none of the server's session
module or the chat-template renderer. Likewise ``corral.envs.episode``, what bundle authors
implement, loads neither the env server (FastAPI, the sandboxes) nor the client (websockets);
and ``corral sft`` reaches nothing of the RL loop.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORRAL = ROOT / "corral"

# Rule 1's one third-party import.
SAMPLES_THIRD_PARTY = frozenset({"pydantic"})
# Rules 2-4: a package and the packages it must not import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "corral.gateway": frozenset(
        {
            "corral.envs",
            "corral.rollouts",
            "corral.adapters",
            "corral.trainer",
            "corral.cli",
            "corral.run",
            "corral.stack",
        }
    ),
    "corral.rollouts": frozenset(
        {"corral.trainer", "corral.adapters", "corral.run", "corral.stack"}
    ),
    "corral.trainer": frozenset({"corral.adapters"}),
    "corral.envs": frozenset(
        {
            "corral.gateway",
            "corral.rollouts",
            "corral.trainer",
            "corral.adapters",
            "corral.cli",
            "corral.run",
            "corral.stack",
        }
    ),
}
# Rule 6: the packages that may import corral.cli (the application layer).
CLI_IMPORTERS = frozenset({"corral.cli", "corral.run", "corral.stack", "corral.doctor"})


@dataclass(frozen=True)
class Import:
    """One import in a module: the module it names (``from a.b import c`` names ``a.b.c`` when
    that is a module, else ``a.b``) and where."""

    importer: str
    target: str
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> Path | None:
    """The file of the corral module ``name``, ``None`` when there is none."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def package_of(name: str) -> str:
    """``corral.gateway.app`` -> ``corral.gateway``; ``corral`` and ``corral.samples`` stay."""
    return ".".join(name.split(".")[:2])


def imports_in(source: str, importer: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import in ``source`` (the module ``importer``), wherever it sits in the code;
    relative imports resolved against ``importer``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = importer.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                is_module = base.startswith("corral") and module_path(submodule) is not None
                yield Import(importer, submodule if is_module else base, node.lineno)


def corral_imports() -> list[Import]:
    found: list[Import] = []
    for path in sorted(CORRAL.rglob("*.py")):
        name = module_name(path)
        found.extend(imports_in(path.read_text(), name, is_package=path.name == "__init__.py"))
    return found


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    return corral_imports()


def is_corral(target: str) -> bool:
    return target == "corral" or target.startswith("corral.")


def test_the_scanner_sees_lazy_relative_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from corral.trainer.loop import Trainer\n"
        "def later():\n"
        "    import corral.adapters.slime\n"
        "    from . import client\n"
        "    from .client import GatewayAdmin\n"
    )
    targets = {i.target for i in imports_in(source, "corral.gateway.app")}
    assert {
        "corral.trainer.loop",
        "corral.adapters.slime",
        "corral.gateway.client",
    } <= targets


def test_the_graph_holds_the_known_edges(graph: list[Import]) -> None:
    """The scan finds what the code plainly does: not a vacuous graph."""
    edges = {(i.importer, i.target) for i in graph}
    assert ("corral.rollouts.player", "corral.gateway.client") in edges
    assert ("corral.gateway.sessions", "corral.samples") in edges
    assert ("corral.trainer.loop", "corral.rollouts.player") in edges


def test_samples_imports_only_the_standard_library_and_pydantic(graph: list[Import]) -> None:
    wrong = [
        i.where()
        for i in graph
        if i.importer == "corral.samples"
        and (
            is_corral(i.target)
            or (
                i.target.split(".")[0] not in sys.stdlib_module_names
                and i.target.split(".")[0] not in SAMPLES_THIRD_PARTY
            )
        )
    ]
    assert not wrong, wrong


def upward(graph: list[Import], package: str) -> list[str]:
    """Rules 2-5: the imports of ``package`` that name a package it must not import."""
    forbidden = FORBIDDEN[package]
    return [
        i.where()
        for i in graph
        if package_of(i.importer) == package and package_of(i.target) in forbidden
    ]


def into_the_cli(graph: list[Import]) -> list[str]:
    """Rule 6: the imports of ``corral.cli`` from below the application layer."""
    return [
        i.where()
        for i in graph
        if package_of(i.target) == "corral.cli" and package_of(i.importer) not in CLI_IMPORTERS
    ]


def test_the_rules_catch_their_violations() -> None:
    """Each rule, on a graph that breaks it, names the import (not a vacuous check)."""
    bad = [
        Import("corral.envs.server", "corral.gateway.app", 1),
        Import("corral.envs.hosting", "corral.rollouts.rows", 2),
        Import("corral.rollouts.harness_play", "corral.cli.errors", 3),
        Import("corral.adapters.agents", "corral.cli.checks", 4),
        Import("corral.run", "corral.cli.errors", 5),
        Import("corral.cli.play", "corral.adapters.agents", 6),
    ]
    assert upward(bad, "corral.envs") == [bad[0].where(), bad[1].where()]
    assert into_the_cli(bad) == [bad[2].where(), bad[3].where()]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_upward(graph: list[Import], package: str) -> None:
    wrong = upward(graph, package)
    assert not wrong, wrong


def test_only_the_application_layer_imports_the_cli(graph: list[Import]) -> None:
    wrong = into_the_cli(graph)
    assert not wrong, wrong


def test_every_imported_corral_module_exists(graph: list[Import]) -> None:
    missing = [i.where() for i in graph if is_corral(i.target) and module_path(i.target) is None]
    assert not missing, missing


def reachable(graph: list[Import], start: str) -> set[str]:
    """Every corral module that importing ``start`` can load, lazy imports included."""
    edges: dict[str, set[str]] = {}
    for i in graph:
        if is_corral(i.target):
            edges.setdefault(i.importer, set()).add(i.target)
    reached, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges.get(module, set()) - reached)
    return reached


def test_sft_reaches_none_of_the_rl_loop_or_its_services(graph: list[Import]) -> None:
    """``corral sft`` shares the run skeleton with RL (``corral.trainer.training_run``), not
    the RL loop, its services or its rollouts."""
    reached = reachable(graph, "corral.trainer.sft_run")
    assert "corral.trainer.training_run" in reached  # the walk follows the run's imports
    rl = {"corral.trainer.loop", "corral.trainer.services", "corral.trainer.rollouts"}
    assert not reached & rl, sorted(reached & rl)
    assert rl <= reachable(graph, "corral.trainer.launch")  # where they are, the walk finds them


def loaded_by(module: str, wanted: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``import module``, of those for which
    the expression ``wanted`` (over ``m``, a module name) holds."""
    probe = f"import sys, {module}\nprint(','.join(sorted(m for m in sys.modules if {wanted})))\n"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(filter(None, done.stdout.strip().split(",")))


def test_the_gateway_client_imports_nothing_of_the_gateway_server() -> None:
    """A rollout process imports the client; the renderer (transformers, jinja2) and the
    server's modules stay out of it."""
    loaded = loaded_by(
        "corral.gateway.client",
        "m.startswith('corral.gateway.') "
        "or m.split('.')[0] in ('transformers', 'jinja2', 'starlette')",
    )
    light = {"corral.gateway.client", "corral.gateway.options", "corral.gateway.settings"}
    assert loaded == light, loaded


def test_the_episode_protocol_imports_no_server_client_or_sandbox() -> None:
    """A bundle's env code imports ``corral.envs.episode``: that loads neither the env server
    (FastAPI, Starlette, the sandboxes) nor the client (websockets); ``corral.envs`` names them
    lazily."""
    loaded = loaded_by(
        "corral.envs.episode",
        "m.split('.')[0] in ('fastapi', 'starlette', 'websockets') "
        "or m == 'corral.sandboxes' or m.startswith('corral.sandboxes.')",
    )
    assert loaded == set(), loaded
