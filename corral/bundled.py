"""What corral's repository ships beside the package: the gridsim bundle (what ``corral run``
and ``corral train`` serve unless told otherwise) and the policy examples/gridsim_rl trained
(what ``corral run`` plays on it).

Both live in the repository, not in the installed package: ``bundles/`` and ``examples/`` are
folders beside ``corral/``, not Python packages (package data covers only files inside a
package, and the policy is 14 MB of weights that do not belong in every install). They are
found when asked for, never at import: from a checkout (corral imported from its source tree,
run in place or installed editable) they are there; an installed package has none, and asking
raises :class:`BundledMissing` with how to get them.
"""

from __future__ import annotations

from pathlib import Path


class BundledMissing(FileNotFoundError):
    """What was asked for ships with corral's repository, and this corral is not run from a
    checkout of it (an installed package)."""


def repository_path(*parts: str) -> Path:
    """Where ``parts`` (``"bundles", "gridsim"``) sit in the checkout corral is imported from,
    whether or not anything is there (an installed package has no checkout around it)."""
    return Path(__file__).resolve().parents[1].joinpath(*parts)


def gridsim_bundle() -> Path:
    """The gridsim bundle's folder in the checkout; BundledMissing when it has none."""
    path = repository_path("bundles", "gridsim")
    if not (path / "bundle.toml").is_file():
        raise BundledMissing(
            f"no gridsim bundle at {path}: it ships with corral's repository, not with the "
            "installed package; run corral from a checkout (git clone, then pip install -e .) "
            "or name a bundle folder ([env] bundle, --bundle PATH)"
        )
    return path


def trained_gridsim_policy() -> Path:
    """The model examples/gridsim_rl trained (a Hugging Face folder) in the checkout;
    BundledMissing when it has none."""
    path = repository_path("examples", "gridsim_rl", "model")
    if not (path / "config.json").is_file():
        raise BundledMissing(
            f"no trained gridsim policy at {path}: it ships with corral's repository, not with "
            "the installed package; run corral from a checkout (git clone, then pip install "
            "-e .) or name a model folder (--policy PATH)"
        )
    return path
