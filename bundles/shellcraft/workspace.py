"""A task's workspace as the env side knows it: the input files and where the answer goes.

:class:`InputFile` and :class:`Workspace` are what the env writes at reset and reads back in
its state. The server builds them from the task's full data (:func:`files.build`, which needs
the seed and stays outside the sandbox) and hands the env only their JSON view
(:func:`view_of`, the bundle's ``[env] task_data`` through :func:`files.env_data`); the env
turns the view back into a :class:`Workspace` with :func:`from_view`.

Imported by the env inside the sandbox: standard library only.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FAMILIES = ("status_counts", "find_files", "csv_to_tsv", "jsonl_totals")


@dataclass(frozen=True)
class InputFile:
    """One input file: ``path`` relative to the work folder ("/"-separated), as written to disk;
    ``content`` is what a reader sees (decompressed when ``gzipped``, which the path's ``.gz``
    suffix then says)."""

    path: str
    content: bytes
    gzipped: bool = False

    def stored_bytes(self) -> bytes:
        """The bytes on disk (mtime 0 in the gzip header, so no clock leaks in)."""
        return gzip.compress(self.content, mtime=0) if self.gzipped else self.content


@dataclass(frozen=True)
class Workspace:
    """A task's starting files and where its answer goes.

    ``output_files`` are the files read back as the answer; ``output_dir``, when set, is a
    folder whose every entry is read back (an answer of several files).
    """

    family: str
    inputs: tuple[InputFile, ...]
    output_files: tuple[str, ...] = ()
    output_dir: str | None = None

    def top_level_names(self) -> list[str]:
        """The names the task occupies directly in the work folder, sorted."""
        paths = [f.path for f in self.inputs] + list(self.output_files)
        if self.output_dir:
            paths.append(self.output_dir)
        return sorted({p.split("/", 1)[0] for p in paths})


def content_digest(content: bytes) -> str:
    """The digest the env reports and the verifier expects for an input's content."""
    return hashlib.sha256(content).hexdigest()


def view_of(workspace: Workspace) -> dict[str, Any]:
    """The workspace as JSON data, every input's content base64-encoded (the env's view)."""
    return {
        "family": workspace.family,
        "inputs": [
            {
                "path": f.path,
                "content_b64": base64.b64encode(f.content).decode("ascii"),
                "gzipped": f.gzipped,
            }
            for f in workspace.inputs
        ],
        "output_files": list(workspace.output_files),
        "output_dir": workspace.output_dir,
    }


def from_view(view: Mapping[str, Any]) -> Workspace:
    """The workspace :func:`view_of` wrote; ValueError / TypeError / KeyError for anything
    else, including a path that is absolute, climbs out (``..``) or is not "/"-separated."""
    family = view["family"]
    if family not in FAMILIES:
        raise ValueError(f"unknown shellcraft family {family!r} (families: {FAMILIES})")
    raw_inputs = view["inputs"]
    if not isinstance(raw_inputs, list):
        raise TypeError("inputs must be a list")
    inputs = []
    for entry in raw_inputs:
        if not isinstance(entry, Mapping) or not isinstance(entry["content_b64"], str):
            raise TypeError(f"an input must be an object with a base64 string: {entry!r:.80}")
        try:
            content = base64.b64decode(entry["content_b64"], validate=True)
        except binascii.Error as exc:
            raise ValueError(f"input {entry.get('path')!r}: bad base64 ({exc})") from None
        gzipped = entry["gzipped"]
        if type(gzipped) is not bool:
            raise TypeError(f"input {entry.get('path')!r}: gzipped must be a boolean")
        inputs.append(InputFile(_relative(entry["path"]), content, gzipped))
    output_files = view["output_files"]
    if not isinstance(output_files, list):
        raise TypeError("output_files must be a list")
    output_dir = view["output_dir"]
    return Workspace(
        family,
        tuple(inputs),
        output_files=tuple(_relative(name) for name in output_files),
        output_dir=None if output_dir is None else _relative(output_dir),
    )


def _relative(path: Any) -> str:
    """``path`` if it is a plain relative "/"-separated path inside the work folder."""
    if not isinstance(path, str):
        raise TypeError(f"a path must be a string, not {path!r:.80}")
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r:.80} is not a relative path inside the work folder")
    if "\0" in path:
        raise ValueError("a path may not hold a NUL byte")
    return path
