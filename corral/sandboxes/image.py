"""Build the docker sandbox image without a registry: debootstrap a Debian root, docker import.

The build is cached in the daemon: an image with the tag *and* a ``corral.image.inputs`` label
equal to the hash of the build's inputs (suite, mirror, package list, this recipe's version) is
reused as is. A cold build takes about 80-100 s (debootstrap) on this machine; a cached one is a
single ``docker image inspect``.

Needs root (debootstrap), ``debootstrap`` and ``docker`` on ``PATH``, and a Debian mirror.
``DOCKER_HOST`` selects the daemon like for the docker CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

DEFAULT_TAG = "corral-sandbox:py3"
INPUTS_LABEL = "corral.image.inputs"
RECIPE_VERSION = "1"
SUITE = "bookworm"
# procps: ps/kill for tests and tools; coreutils (timeout, setsid via util-linux) is in minbase.
BASE_PACKAGES = ("procps",)
PYTHON_PACKAGES = ("python3",)


def _mirror() -> str:
    return os.environ.get("CORRAL_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def inputs_hash(*, python: bool = True) -> str:
    """The hash that identifies a build's inputs; a change rebuilds the image."""
    packages = sorted(BASE_PACKAGES + (PYTHON_PACKAGES if python else ()))
    blob = json.dumps(
        {"recipe": RECIPE_VERSION, "suite": SUITE, "mirror": _mirror(), "packages": packages},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _docker(*args: str, input_: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["docker", *args], input=input_, capture_output=True, check=False)


def cached(tag: str, *, python: bool = True) -> bool:
    """Whether ``tag`` exists in the daemon and was built from the current inputs."""
    proc = _docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag)
    if proc.returncode != 0:
        return False
    labels = json.loads(proc.stdout.decode() or "null") or {}
    return bool(labels.get(INPUTS_LABEL) == inputs_hash(python=python))


def build_image(tag: str = DEFAULT_TAG, *, python: bool = True, force: bool = False) -> bool:
    """Build ``tag`` unless it is cached; return whether it built. Raises ``RuntimeError``
    with the tool's output when debootstrap or the import fails."""
    if not force and cached(tag, python=python):
        return False
    for tool in ("debootstrap", "docker"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"build_image needs {tool!r} on PATH")
    packages = ",".join(BASE_PACKAGES + (PYTHON_PACKAGES if python else ()))
    digest = inputs_hash(python=python)
    with tempfile.TemporaryDirectory(prefix="corral-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        proc = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={packages}",
                SUITE,
                str(root),
                _mirror(),
            ],
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).decode(errors="replace")[-3000:]
            raise RuntimeError(f"debootstrap failed ({proc.returncode}):\n{tail}")
        # Trim what a sandbox never needs (apt lists, docs, caches): smaller import.
        for sub in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
        ):
            shutil.rmtree(root / sub, ignore_errors=True)
        (root / "work").mkdir(exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(
            [
                "docker",
                "import",
                "--change",
                f"LABEL {INPUTS_LABEL}={digest}",
                "--change",
                'CMD ["sleep", "infinity"]',
                "-",
                tag,
            ],
            stdin=tar.stdout,
            capture_output=True,
            check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        tar_rc = tar.wait()
        if tar_rc != 0 or imp.returncode != 0:
            raise RuntimeError(
                f"docker import failed (tar {tar_rc}, import {imp.returncode}): "
                f"{imp.stderr.decode(errors='replace')[-2000:]}"
            )
    return True


def main() -> None:
    """``python -m corral.sandboxes.image [TAG]``: build (or reuse) the sandbox image."""
    import sys

    tag = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TAG
    built = build_image(tag)
    print(f"{tag}: {'built' if built else 'cached'} (inputs {inputs_hash()})")


if __name__ == "__main__":
    main()
