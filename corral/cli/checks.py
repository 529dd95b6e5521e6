"""Checks a command makes before it starts anything, each failing with the one-line
:class:`~corral.cli.errors.CliError` that says what to pass instead."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.cli.errors import CliError, RunError, UsageError

if TYPE_CHECKING:
    from corral.gateway.client import GatewayAdmin, GatewayAdminError

MODEL_FIX = "{option} takes a local Hugging Face folder (`corral model tiny OUT` builds one)"
# Any of these makes a folder's tokenizer loadable by transformers' AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# An id no session ever has: asking for it answers 401 (token refused) before 404 (no such
# session), so it tells a reachable gateway that takes our token from one that does not.
_PROBE_SESSION = "corral-cli-probe"
_NOT_A_GATEWAY = "Is --gateway the URL of `corral gateway`?"


def model_folder(path: str | Path, option: str = "--model") -> Path:
    """``path`` when it is a Hugging Face model folder (config.json and a tokenizer); a
    UsageError otherwise (naming ``option``, where the path came from), never the hub's
    "Repo id" message for a path that is not there."""
    folder = Path(path)
    fix = MODEL_FIX.format(option=option)
    if not folder.is_dir():
        raise UsageError(f"no model folder at {folder}: {fix}")
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder} is not a model folder (it has no config.json): {fix}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"{folder} is not a model folder (it has no tokenizer: none of "
            f"{', '.join(TOKENIZER_FILES)}): {fix}"
        )
    return folder


def bundle_folder(path: str | Path) -> Path:
    """``path`` when it holds a ``bundle.toml``; a UsageError otherwise."""
    folder = Path(path)
    if not (folder / "bundle.toml").is_file():
        raise UsageError(
            f"no bundle at {folder} (a folder with bundle.toml)",
            "Pass a bundle's folder, e.g. bundles/gridsim.",
        )
    return folder


def rows_file(path: str | Path) -> Path:
    """``path`` when it is a file; a UsageError that says how rows files are made otherwise."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no rows file at {file}", "Write one with `corral rows ENV_URL OUTDIR`.")
    return file


async def probe_gateway(admin: GatewayAdmin, token_var: str | None) -> None:
    """Check that the gateway ``admin`` talks to answers and takes its admin token (one
    request), so that a wrong URL or token is one clear error before any episode starts.
    ``token_var`` is the variable the token came from (None: no token was given)."""
    from corral.gateway.client import GatewayAdminError

    try:
        await admin.view(_PROBE_SESSION)
    except GatewayAdminError as exc:
        # A gateway's 404 names the session it did not find, quoted ("session 'x' not
        # found"); another server's does not (the request's path is in the message unquoted).
        if exc.status == 404 and repr(_PROBE_SESSION) in str(exc):
            return
        raise gateway_error(exc, admin.url, token_var) from exc
    raise RunError(f"the server at {admin.url} is not a corral gateway", _NOT_A_GATEWAY)


def gateway_error(exc: GatewayAdminError, url: str, token_var: str | None) -> CliError:
    """The CliError for a failed admin call to the gateway at ``url``."""
    import aiohttp

    if exc.status is None and isinstance(exc.__cause__, (aiohttp.ClientError, TimeoutError)):
        return RunError(
            f"cannot reach the gateway at {url} ({_why(exc.__cause__)})",
            "Is `corral gateway` running there, and is --gateway its URL?",
        )
    if exc.status == 401:
        if token_var is None:
            return RunError(
                f"the gateway at {url} refused the admin call without an admin token (401)",
                "Pass --admin-token-var NAME, NAME being the environment variable that holds "
                "the gateway's admin token.",
            )
        return RunError(
            f"the gateway at {url} refused the admin token in ${token_var} (401)",
            f"Set {token_var} to the token the gateway was started with, or pass "
            "--admin-token-var NAME naming the variable that holds it.",
        )
    if exc.status == 404:
        return RunError(f"the server at {url} is not a corral gateway ({exc})", _NOT_A_GATEWAY)
    return RunError(f"the gateway at {url} failed an admin call: {exc}")


def _why(cause: BaseException) -> str:
    """Why a connection failed, in a few words (aiohttp's messages repeat the address)."""
    os_error: Any = getattr(cause, "os_error", None)
    if isinstance(os_error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(os_error, OSError) and os_error.strerror:
        return str(os_error.strerror)
    if isinstance(cause, TimeoutError):
        return "no answer in time"
    return str(cause) or type(cause).__name__
