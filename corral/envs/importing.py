"""Import a bundle's modules as a package of their own (standard library only).

Shared by the server (:mod:`corral.envs.bundle`) and the runner inside a sandbox
(:mod:`corral.envs.runner`), so a bundle imports the same way in both places: the bundle folder
becomes a package with a unique name per folder, and its modules may import each other
relatively (``from .market import simulate``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


def identifier(text: str) -> str:
    """``text`` with every character that cannot be in a Python name replaced by ``_``."""
    return re.sub(r"\W", "_", text)


def package_name(root: Path, bundle_name: str) -> str:
    # One package per bundle folder: two bundles with the same module names never collide.
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return f"_corral_bundle_{identifier(bundle_name)}_{digest}"


def bundle_package(root: Path, bundle_name: str) -> str:
    """(Re)create the bundle's package in ``sys.modules`` so a fresh load sees edited code;
    return its name."""
    package = package_name(root, bundle_name)
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_loader(package, loader=None, is_package=True)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(root.resolve())]
    sys.modules[package] = module
    return package


def import_file(root: Path, package: str, rel: str) -> ModuleType:
    """Import the bundle file ``rel`` (a ``.py`` path relative to ``root``) as a submodule of
    ``package``, or return it if already imported. Whatever the module raises while importing
    propagates (and it is not left half-imported in ``sys.modules``); ``ImportError`` when the
    file cannot be loaded at all."""
    name = f"{package}.{identifier(rel.removesuffix('.py'))}"
    if name in sys.modules:
        return sys.modules[name]  # the env and verifier may share one module
    spec = importlib.util.spec_from_file_location(name, root / rel)
    if spec is None or spec.loader is None:
        raise ImportError(f"{rel}: cannot be imported (no loader for it)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
