"""Bundles written to disk by tests, and the problems validation finds in them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from corral.envs.bundle import BundleError, load_bundle, validate_bundle


def write_tree(root: Path, contents: Mapping[str, str]) -> Path:
    """Write ``contents`` (bundle-relative path -> text) under ``root``; "" leaves a file out."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in contents.items():
        if text == "":
            continue
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def problem_with(root: Path, *needles: str, only: bool = False) -> str:
    """The problem of the bundle at ``root`` that holds every needle (the only such one when
    ``only``); ``load_bundle`` must refuse the bundle with it too."""
    problems = validate_bundle(root)
    matches = [p for p in problems if all(n in p for n in needles)]
    if only:
        assert len(matches) == 1, f"not exactly one problem with {needles} in {problems}"
    assert matches, f"no problem with {needles} in {problems}"
    with pytest.raises(BundleError) as err:
        load_bundle(root)
    assert matches[0] in err.value.problems
    return matches[0]
