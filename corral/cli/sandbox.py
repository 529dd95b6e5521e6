"""``corral sandbox image build``: the docker sandbox image, built without a registry."""

from __future__ import annotations

import argparse
from typing import Any

from corral.cli.errors import RunError
from corral.sandboxes.image import DEFAULT_TAG


def cmd_sandbox_image_build(args: argparse.Namespace) -> int:
    from corral.sandboxes.image import build_image, inputs_hash

    try:
        built = build_image(args.tag, force=args.force)
    except RuntimeError as exc:
        raise RunError(str(exc)) from None
    print(f"{args.tag}: {'built' if built else 'cached'} (inputs {inputs_hash()})")
    return 0


def add_sandbox_command(sub: Any) -> None:
    sandbox = sub.add_parser(
        "sandbox", help="sandbox backends", description="Sandbox backends."
    ).add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    image = sandbox.add_parser(
        "image", help="the docker sandbox image", description="The docker sandbox image."
    ).add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = image.add_parser(
        "build",
        help="build the docker sandbox image without a registry (debootstrap + docker import)",
        description="Debootstraps a minimal Debian root with python3 and imports it into the "
        "daemon DOCKER_HOST names. Cached: an image whose input-hash label matches is reused. "
        "Needs root, debootstrap, docker and a Debian mirror (CORRAL_DEBIAN_MIRROR).",
    )
    build.add_argument("--tag", default=DEFAULT_TAG, help="the image's name:tag")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.set_defaults(func=cmd_sandbox_image_build)
