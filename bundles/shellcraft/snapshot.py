"""Read the work folder back at the end of an episode: the answer files and the inputs' digests.

Everything here reads files the model could have replaced with anything: a symlink (to
``/dev/zero``, to a file outside the folder), a FIFO (whose open or read blocks), a device, a
huge file, a gzip bomb. So a file is read only if it is a regular file that is not a symlink,
opened without following links and without blocking, checked again after opening, and never
beyond a byte limit; anything else is reported, not read.

Standard library only: this runs inside the sandbox.
"""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path
from typing import Any

from .workspace import InputFile, Workspace, content_digest

# An answer file larger than this is reported as too large, not read (answers are < 10 KiB).
MAX_OUTPUT_BYTES = 64 * 1024
# The most entries of an output folder that are read; the rest are only counted.
MAX_OUTPUT_ENTRIES = 32
# Inputs are < 1 MiB; reading (or inflating) beyond this means the file was changed anyway.
MAX_INPUT_BYTES = 4 * 1024 * 1024


class Unreadable(Exception):
    """A file that is not read: missing, not a regular file, too large, not valid gzip."""


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file (no symlink), at most ``limit`` of them; Unreadable when
    it is anything else or larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Unreadable("missing") from None
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a socket; EACCES, ...
        raise Unreadable(f"cannot be opened ({os.strerror(exc.errno or 0)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable("not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Unreadable(f"larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """The content of a gzip file (members concatenated, as zcat does); Unreadable when it is
    not valid gzip or inflates beyond ``limit`` bytes."""
    out, rest = bytearray(), data
    while rest:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
        except zlib.error:
            raise Unreadable("not valid gzip") from None
        if len(out) > limit:
            raise Unreadable(f"inflates beyond {limit} bytes")
        if not inflater.eof:
            raise Unreadable("a truncated gzip stream")
        rest = inflater.unused_data
    return bytes(out)


def input_digest(root: Path, spec: InputFile) -> str | None:
    """The digest of an input's current content (decompressed when it is a gzip input), or
    None when it is gone, replaced by something that is not a regular file, or unreadable."""
    try:
        data = read_regular(root / spec.path, MAX_INPUT_BYTES)
        if spec.gzipped:
            data = gunzip_bounded(data, MAX_INPUT_BYTES)
    except Unreadable:
        return None
    return content_digest(data)


def read_output(path: Path) -> dict[str, Any]:
    """An answer file as ``{"text": str}``, or ``{"text": None, "problem": why}``."""
    try:
        data = read_regular(path, MAX_OUTPUT_BYTES)
    except Unreadable as exc:
        return {"text": None, "problem": str(exc)}
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"text": None, "problem": "not UTF-8 text"}


def read_outputs(root: Path, workspace: Workspace) -> tuple[dict[str, dict[str, Any]], int]:
    """The answer: each output file, and each entry of the output folder (at most
    ``MAX_OUTPUT_ENTRIES``, by name); returns ``(path -> read_output, entries not read)``."""
    outputs = {name: read_output(root / name) for name in workspace.output_files}
    omitted = 0
    if workspace.output_dir is not None:
        folder = root / workspace.output_dir
        names: list[str] = []
        # Only a real folder is listed: a symlinked out/ could point anywhere.
        if folder.is_dir() and not folder.is_symlink():
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                names = []
        omitted = max(0, len(names) - MAX_OUTPUT_ENTRIES)
        for name in names[:MAX_OUTPUT_ENTRIES]:
            outputs[f"{workspace.output_dir}/{name}"] = read_output(folder / name)
    return outputs, omitted
