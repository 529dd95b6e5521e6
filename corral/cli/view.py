"""``corral view``: the trace viewer, a read-only web page over run, eval and play folders or
a live gateway (:mod:`corral.viewer`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from corral.cli.errors import UsageError

DEFAULT_PORT = 8300


def add_view_command(sub: Any) -> None:
    """Add ``corral view PATH_OR_URL... [--port] [--host] [--tokenizer] [--admin-token-var]``."""
    view = sub.add_parser(
        "view",
        help="a web page over run, eval and play folders, or a live gateway (read-only)",
        description="Serves a read-only page on 127.0.0.1: a run's reward curves, time split "
        "and dropped groups; every episode with filters; an episode's conversation, grade "
        "and timeline; a sample's tokens by loss mask with logprobs and forks; two episode "
        "sets compared on the same tasks. Give one or more folders (a run folder, an eval or "
        "play folder) and at most one gateway URL (http://...). Never shows tokens or keys.",
    )
    view.add_argument(
        "paths", nargs="+", metavar="PATH_OR_URL", help="run, eval or play folders; a gateway URL"
    )
    view.add_argument("--port", type=int, default=DEFAULT_PORT, help="default: %(default)s")
    view.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; the page is meant for loopback)",
    )
    view.add_argument(
        "--tokenizer",
        type=Path,
        metavar="MODEL_DIR",
        help="a model folder whose tokenizer shows token ids as text (default: the run's "
        "model.path, when it is a folder here)",
    )
    view.add_argument(
        "--admin-token-var",
        metavar="NAME",
        help="the variable holding the gateway's admin token (the page never sees it)",
    )
    view.set_defaults(func=cmd_view)


def cmd_view(args: argparse.Namespace) -> int:
    from corral.cli.options import listening
    from corral.env_secrets import SecretMissing, env_secret
    from corral.serving import serve_forever
    from corral.viewer.app import LOOPBACK_HOSTS, create_app, open_state
    from corral.viewer.gateway_source import GatewaySource
    from corral.viewer.pieces import load_pieces, tokenizer_folder
    from corral.viewer.reader import ViewerError

    urls = [p for p in args.paths if p.startswith(("http://", "https://"))]
    folders = [Path(p) for p in args.paths if p not in urls]
    if len(urls) > 1:
        raise UsageError("corral view takes at most one gateway URL")
    if not folders and not urls:
        raise UsageError("give a run, eval or play folder, or a gateway URL")
    gateway = None
    if urls:
        try:
            token = env_secret(args.admin_token_var, "--admin-token-var")
        except SecretMissing as exc:
            raise UsageError(str(exc), f"Export {args.admin_token_var}.") from None
        gateway = GatewaySource(urls[0], token)
    try:
        state = open_state(folders, gateway=gateway)
    except ViewerError as exc:
        raise UsageError(str(exc)) from None
    model_dir = args.tokenizer or next(
        (tokenizer_folder(s.config) for s in state.sources if tokenizer_folder(s.config)), None
    )
    state.pieces = load_pieces(model_dir)
    if args.tokenizer is not None and state.pieces is None:
        raise UsageError(f"no tokenizer could be loaded from {args.tokenizer}")
    hosts = list(LOOPBACK_HOSTS)
    if args.host not in hosts:
        hosts.append(args.host)
    app = create_app(state, allowed_hosts=hosts)
    episodes = sum(len(s.episodes) for s in state.sets)
    print(
        f"corral view: {episodes} episodes in {len(state.sets)} sets; "
        f"http://{args.host}:{args.port}/",
        file=sys.stderr,
    )
    with listening(args.host, args.port):
        serve_forever(app, host=args.host, port=args.port, log_level="warning")
    return 0
