"""shellcraft's task inputs: the files each task starts with, built from its data alone.

A task's ``data`` is ``{"family", "seed", "params"}``; :func:`build` turns it into a
:class:`Workspace`: the input files (paths relative to the work folder, their bytes) and where
the answer goes. The same data gives the same bytes in every process and on every machine (one
``random.Random(seed)`` per task, no ``hash()``, no set iteration, no locale, no clock), which is
what lets the verifier, outside the sandbox, recompute the inputs the env wrote inside it.

Families (``FAMILIES``), each with traps a careless pipeline falls into:

- ``status_counts``: a web server's access log and its rotations, some gzipped, beside an error
  log in another format; count requests per HTTP status, optionally only one method or one path
  prefix (referers and other paths carry look-alikes).
- ``find_files``: a source tree with hidden folders and names with spaces; list the files (of
  one extension, or all) holding a literal marker, or a word as a whole word in any case, among
  near misses.
- ``csv_to_tsv``: CSV files whose column order differs per file, some with CRLF line ends or no
  final newline, beside an archive folder and a README; convert each to TSV, renaming and/or
  dropping a column.
- ``jsonl_totals``: JSON-lines event files, older days gzipped, keys in any order, nested
  objects with a ``user`` key of their own, blank lines; total per user.

What the env receives is not this data: the seed fixes every byte of the inputs, and with
the answer code (``answers.py``) it would let a command recompute the answer without doing the
task. The bundle's ``[env] task_data`` is :func:`env_data`, run in the server's process: it
builds the workspace and hands the env only what it must write
(:func:`workspace.view_of`: each input's path, content and gzip flag, the answer's names, the
family). This module stays in the server with the verifier; the env side is
:mod:`workspace`, which holds no generator.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable, Mapping
from typing import Any

# The types the env side shares with this module (re-exported: answers and generate use them).
from .workspace import FAMILIES as FAMILIES
from .workspace import InputFile as InputFile
from .workspace import Workspace as Workspace
from .workspace import content_digest as content_digest
from .workspace import view_of


def build(data: Mapping[str, Any]) -> Workspace:
    """The workspace of a task's ``data``; KeyError / ValueError / TypeError for data that is
    not a shellcraft task (an unknown family, a missing or bad parameter)."""
    family = data["family"]
    if family not in _BUILDERS:
        raise ValueError(f"unknown shellcraft family {family!r} (families: {FAMILIES})")
    seed = data["seed"]
    if type(seed) is not int:
        raise TypeError(f"seed must be an integer, not {seed!r}")
    params = data["params"]
    if not isinstance(params, Mapping):
        raise TypeError("params must be an object")
    inputs = tuple(_BUILDERS[family](random.Random(seed), params))
    return Workspace(family, inputs, **_OUTPUTS[family])


def env_data(task: Any) -> dict[str, Any]:
    """``[env] task_data`` (server side): the env's view of ``task`` (see the module
    docstring), built from the task's full data; raises like :func:`build`."""
    return view_of(build(task.data))


# --- status_counts ----------------------------------------------------------------------------

LOG_DIR = "logs"
ACCESS_LOG = f"{LOG_DIR}/access.log"
STATUS_CSV = "status_counts.csv"
# strftime's %a and %b follow the locale: spell the names out so no process's locale leaks in.
_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_STATUSES = (200, 201, 204, 301, 302, 304, 400, 401, 403, 404, 429, 500, 502, 503)
_METHODS = (("GET", 70), ("POST", 18), ("PUT", 5), ("DELETE", 4), ("HEAD", 3))
_NETS = ("203.0.113", "198.51.100", "192.0.2", "10.20.30")
# Look-alikes on purpose: "/apidocs" and "/admin/api/keys" are not under "/api/"; referers
# mention "/api/" and "POST" outside the request field.
_PATHS = (
    "/",
    "/index.html",
    "/static/app.js",
    "/static/style.css",
    "/login",
    "/logout",
    "/health",
    "/apidocs",
    "/admin/api/keys",
    "/api/items",
    "/api/items/{n}",
    "/api/orders",
    "/api/orders/{n}",
    "/api/v2/search?q=lamp&page={n}",
)
_REFERERS = (
    "-",
    "-",
    "https://shop.example.com/",
    "https://shop.example.com/api/docs",
    "https://forum.example.net/t/why-does-POST-fail",
    "https://www.example.org/search?q=status+404",
)
_AGENTS = (
    "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0",
    "Mozilla/5.0 (iPhone; CPU iPhone OS 17_4 like Mac OS X) Mobile/15E148",
    "curl/8.5.0",
    "python-requests/2.31.0",
    "Go-http-client/1.1",
)


def _clf_time(when: dt.datetime) -> str:
    return f"{when.day:02d}/{_MONTHS[when.month - 1]}/{when.year}:{when:%H:%M:%S} +0000"


def _access_line(rng: random.Random, when: dt.datetime, statuses: list[tuple[int, int]]) -> str:
    """One request in the combined log format."""
    method = rng.choices([m for m, _ in _METHODS], [w for _, w in _METHODS])[0]
    status = rng.choices([s for s, _ in statuses], [w for _, w in statuses])[0]
    path = rng.choice(_PATHS).format(n=rng.randint(1, 999))
    user = "-" if rng.random() < 0.85 else rng.choice(("alice", "bob", "svc-batch"))
    size = "-" if status in (204, 304) or method == "HEAD" else str(rng.randint(120, 48_000))
    return (
        f"{rng.choice(_NETS)}.{rng.randint(1, 254)} - {user} [{_clf_time(when)}] "
        f'"{method} {path} HTTP/1.1" {status} {size} '
        f'"{rng.choice(_REFERERS)}" "{rng.choice(_AGENTS)}"'
    )


def _error_line(rng: random.Random, when: dt.datetime) -> str:
    """One line of the error log: another format, which no status count should take in."""
    client = f"{rng.choice(_NETS)}.{rng.randint(1, 254)}:{rng.randint(1024, 65535)}"
    message = rng.choice(
        (
            "AH00126: Invalid URI in request GET /%zz HTTP/1.1",
            "AH01630: client denied by server configuration: /srv/www/admin",
            "AH00128: File does not exist: /srv/www/favicon.ico",
            'AH01071: Got error "PHP message: upstream returned 502" from backend',
        )
    )
    stamp = (
        f"{_WEEKDAYS[when.weekday()]} {_MONTHS[when.month - 1]} {when.day:02d} "
        f"{when:%H:%M:%S}.{rng.randint(0, 999_999):06d} {when.year}"
    )
    return f"[{stamp}] [core:error] [pid {rng.randint(100, 32000)}] [client {client}] {message}"


def _status_profile(rng: random.Random) -> list[tuple[int, int]]:
    """The task's mix of status codes: 200 the most common, 4-8 others with random weights."""
    others = rng.sample([s for s in _STATUSES if s != 200], rng.randint(4, 8))
    return [(200, 100)] + [(s, rng.randint(2, 30)) for s in sorted(others)]


def _lines_over(
    rng: random.Random, start: dt.datetime, count: int, make: Callable[[dt.datetime], str]
) -> tuple[bytes, dt.datetime]:
    """``count`` lines at increasing times from ``start``; the text and the time after them."""
    lines = []
    when = start
    for _ in range(count):
        when += dt.timedelta(seconds=rng.randint(1, 240))
        lines.append(make(when))
    return ("\n".join(lines) + "\n").encode(), when


def build_status_counts(rng: random.Random, params: Mapping[str, Any]) -> list[InputFile]:
    """``logs/access.log``, ``.1`` and ``.2.gz`` .. ``.<rotations>.gz`` (oldest has the highest
    number), plus ``logs/error.log``. ``params``: ``rotations`` (>= 2), ``method`` and
    ``path_prefix`` (filters the answer only; either may be null)."""
    rotations = int(params["rotations"])
    if rotations < 2:
        raise ValueError("rotations must be >= 2")
    statuses = _status_profile(rng)
    when = dt.datetime(2025, 1, 1) + dt.timedelta(days=rng.randint(0, 300))
    files = []
    for number in range(rotations, -1, -1):  # oldest first, so time runs forward
        content, when = _lines_over(
            rng, when, rng.randint(40, 160), lambda t: _access_line(rng, t, statuses)
        )
        name = ACCESS_LOG if number == 0 else f"{ACCESS_LOG}.{number}"
        gzipped = number >= 2
        files.append(InputFile(name + (".gz" if gzipped else ""), content, gzipped))
    errors, _ = _lines_over(
        rng, when - dt.timedelta(days=1), rng.randint(8, 30), lambda t: _error_line(rng, t)
    )
    files.append(InputFile(f"{LOG_DIR}/error.log", errors))
    return sorted(files, key=lambda f: f.path)


# --- find_files -------------------------------------------------------------------------------

PROJECT_DIR = "project"
MATCHES_TXT = "matches.txt"
_FOLDERS = (
    "",
    "src",
    "src/core",
    "src/util",
    "src/.cache",
    "lib",
    "tests",
    "docs",
    "docs/api",
    "scripts",
    ".github/workflows",
)
_STEMS = (
    "app",
    "main",
    "config",
    "models",
    "views",
    "helpers",
    "io_utils",
    "parser",
    "server",
    "client",
    "schema",
    "notes",
    "setup",
    "build",
    "release notes",
    "old draft",
    "test_api",
    "test_models",
    "CHANGELOG",
    "index",
)
_EXTENSIONS = (".py", ".py", ".py", ".md", ".md", ".txt", ".cfg", ".sh", ".py.bak", ".yml")
# Filler vocabulary: none of it is, or contains, a needle below.
_WORDS = (
    "value",
    "items",
    "request",
    "buffer",
    "count",
    "result",
    "handler",
    "cache",
    "retry",
    "token",
    "path",
    "index",
    "config",
    "update",
    "session",
    "record",
    "limit",
    "offset",
    "batch",
    "client",
)
FIND_NAMES = ("alice", "bob", "carol", "dave", "erin")
FIND_TAGS = ("TODO", "FIXME")
FIND_WORDS = ("deprecated", "legacy", "obsolete", "unsafe")


def _filler_line(rng: random.Random) -> str:
    a, b, c = (rng.choice(_WORDS) for _ in range(3))
    return rng.choice(
        (
            f"{a}_{b} = {c}({a}, {rng.randint(0, 99)})",
            f"# {a} the {b} before the {c}",
            f"def {a}_{b}(self, {c}):",
            f"    return self.{a}.get({b!r})",
            f"The {a} keeps one {b} per {c}.",
            f"{a}: {rng.randint(1, 500)}",
            "",
        )
    )


def _literal_lines(needle: str, rng: random.Random) -> tuple[list[str], list[str]]:
    """Lines holding the marker ``TAG(name)``, and near misses that do not hold it."""
    tag, name = needle.split("(")[0], needle.split("(")[1].rstrip(")")
    other = rng.choice([n for n in FIND_NAMES if n != name])
    hits = [
        f"    # {needle}: handle the empty {rng.choice(_WORDS)}",
        f"// {needle} drop this after the migration",
        f"- {needle} update the {rng.choice(_WORDS)} docs",
    ]
    misses = [
        f"# {tag}({name}ia): not the same person",
        f"# {tag} ({name}) spaced out",
        f"# {tag.lower()}({name}) lower case",
        f"# {tag}({name.capitalize()}) capitalised",
        f"# {tag}[{name}] brackets",
        f"# {tag}({other}) someone else",
        f"# {'FIXME' if tag == 'TODO' else 'TODO'}({name}) the other tag",
    ]
    return hits, misses


def _word_lines(word: str, rng: random.Random) -> tuple[list[str], list[str]]:
    """Lines holding ``word`` as a whole word (any case), and lines holding it only inside a
    longer word (letters, digits or underscores around it)."""
    form = rng.choice((word, word.capitalize(), word.upper()))
    hits = [
        f"# {form}: use the new {rng.choice(_WORDS)} instead",
        f"@{word}",
        f"This {rng.choice(_WORDS)} is {form}.",
        f"mode = '{form}-fallback'",
        f"({form.upper()})",
    ]
    misses = [
        f"un{word} = True",
        f"{word}_api = None",
        f"{word}ly done",
        f"{word}2 = 0",
        f"non{word.upper()} path",
        f"_{word} = 1",
    ]
    return hits, misses


def _plant(lines: list[str], extra: str, rng: random.Random) -> None:
    """Insert ``extra`` at a random line of ``lines``."""
    lines.insert(rng.randint(0, len(lines)), extra)


def build_find_files(rng: random.Random, params: Mapping[str, Any]) -> list[InputFile]:
    """A tree of 25-50 text files under ``project/``. ``params``: ``mode`` ("literal": the
    ``needle`` as a case-sensitive string; "word": the ``needle`` as a whole word in any case)
    and ``extension`` (".py", ".md" or null: which files count; planting favours them)."""
    mode, needle, extension = params["mode"], params["needle"], params["extension"]
    if mode == "literal":
        hits, misses = _literal_lines(needle, rng)
    elif mode == "word":
        hits, misses = _word_lines(needle, rng)
    else:
        raise ValueError(f"mode must be 'literal' or 'word', not {mode!r}")
    paths: list[str] = []
    for _ in range(rng.randint(25, 50)):
        folder = rng.choice(_FOLDERS)
        name = rng.choice(_STEMS) + rng.choice(_EXTENSIONS)
        path = "/".join(p for p in (PROJECT_DIR, folder, name) if p)
        if path not in paths:
            paths.append(path)
    bodies = {p: [_filler_line(rng) for _ in range(rng.randint(3, 30))] for p in paths}
    counted = [p for p in paths if extension is None or p.endswith(extension)]
    if not counted:  # every task needs at least one file of the counted kind
        counted = [f"{PROJECT_DIR}/src/extra{extension}"]
        bodies[counted[0]] = [_filler_line(rng) for _ in range(5)]
    for path in rng.sample(counted, min(len(counted), rng.randint(2, 6))):
        _plant(bodies[path], rng.choice(hits), rng)
    for path in rng.sample(sorted(bodies), rng.randint(3, 10)):
        _plant(bodies[path], rng.choice(misses), rng)
    if extension is not None:  # the needle itself, in files of the wrong kind
        others = [p for p in sorted(bodies) if not p.endswith(extension)]
        for path in rng.sample(others, min(len(others), rng.randint(1, 3))):
            _plant(bodies[path], rng.choice(hits), rng)
    return [InputFile(p, ("\n".join(bodies[p]) + "\n").encode()) for p in sorted(bodies)]


# --- csv_to_tsv -------------------------------------------------------------------------------

DATA_DIR = "data"
OUT_DIR = "out"
CSV_RENAMES = (
    ("amount", "amount_eur"),
    ("qty", "quantity"),
    ("city", "town"),
    ("email", "contact_email"),
    ("date", "order_date"),
)
CSV_DROPS = ("note", "email", "sku", "status")
_CSV_COLUMNS = ("name", "city", "amount", "qty", "sku", "date", "status", "email", "note")
_CSV_FILES = (
    "orders_2024_q1",
    "orders_2024_q2",
    "customers",
    "returns",
    "shop berlin",
    "shop_paris",
    "export-march",
    "batch7",
)
_PEOPLE = ("Ada", "Bo", "Chen", "Dana", "Emil", "Fay", "Goran", "Hana", "Ivo", "Jun")
_CITIES = ("Berlin", "Paris", "Lyon", "Porto", "Oslo", "Riga", "Turin", "Ghent")
_STATES = ("new", "paid", "shipped", "cancelled")


def _csv_value(column: str, rng: random.Random, row_id: int, person: str) -> str:
    """One field: never a comma, quote or tab; ``email`` and ``note`` are sometimes empty."""
    match column:
        case "id":
            return str(row_id)
        case "name":
            return person
        case "city":
            return rng.choice(_CITIES)
        case "amount":
            return f"{rng.randint(1, 99999) / 100:.2f}"
        case "qty":
            return str(rng.randint(1, 12))
        case "sku":
            return f"SKU-{rng.randint(1000, 9999)}"
        case "date":
            return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        case "status":
            return rng.choice(_STATES)
        case "email":
            return "" if rng.random() < 0.15 else f"{person.lower()}@example.com"
        case "note":
            return "" if rng.random() < 0.4 else " ".join(rng.sample(_WORDS, 2))
    raise ValueError(f"no such CSV column {column!r}")


def _csv_text(rng: random.Random, columns: list[str]) -> bytes:
    """One CSV file: a header, 4-30 rows; sometimes CRLF line ends, sometimes no final newline."""
    first_id = rng.randint(1, 5000)
    rows = [",".join(columns)]
    for row_id in range(first_id, first_id + rng.randint(4, 30)):
        person = rng.choice(_PEOPLE)
        rows.append(",".join(_csv_value(c, rng, row_id, person) for c in columns))
    end = "\r\n" if rng.random() < 0.35 else "\n"
    text = end.join(rows) + ("" if rng.random() < 0.25 else end)
    return text.encode()


def build_csv_to_tsv(rng: random.Random, params: Mapping[str, Any]) -> list[InputFile]:
    """3-6 ``data/<name>.csv`` files sharing a column set in per-file orders, plus
    ``data/archive/*.csv`` and ``data/README.txt`` (not to convert). ``params``: ``rename``
    (``[from, to]`` or null) and ``drop`` (a column or null), not both null."""
    rename, drop = params["rename"], params["drop"]
    if rename is None and drop is None:
        raise ValueError("csv_to_tsv needs a rename, a drop or both")
    required = [c for c in (rename[0] if rename else None, drop) if c is not None]
    others = [c for c in _CSV_COLUMNS if c not in required]
    columns = ["id", *required, *rng.sample(others, rng.randint(2, 4))]
    files = []
    for name in rng.sample(_CSV_FILES, rng.randint(3, 6)):
        order = list(columns)
        if rng.random() < 0.7:  # most files order their columns their own way
            rng.shuffle(order)
        files.append(InputFile(f"{DATA_DIR}/{name}.csv", _csv_text(rng, order)))
    for name in rng.sample(_CSV_FILES, rng.randint(1, 2)):
        files.append(InputFile(f"{DATA_DIR}/archive/{name}_old.csv", _csv_text(rng, columns)))
    readme = "Exports from the shop system. archive/ holds superseded exports.\n"
    files.append(InputFile(f"{DATA_DIR}/README.txt", readme.encode()))
    return sorted(files, key=lambda f: f.path)


# --- jsonl_totals -----------------------------------------------------------------------------

EVENTS_DIR = "events"
TOTALS_CSV = "totals.csv"
JSONL_METRICS = ("net_cents", "purchases")
JSONL_CURRENCIES = ("EUR", "USD")
_EVENT_TYPES = (("view", 45), ("purchase", 30), ("refund", 10), ("signup", 8), ("logout", 7))


def _event(rng: random.Random, when: dt.datetime, users: list[str]) -> dict[str, Any]:
    kind = rng.choices([t for t, _ in _EVENT_TYPES], [w for _, w in _EVENT_TYPES])[0]
    event: dict[str, Any] = {
        "ts": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "user": rng.choice(users),
        "type": kind,
    }
    if kind in ("purchase", "refund"):
        event["amount_cents"] = rng.randint(100, 20_000)
        event["currency"] = rng.choices(JSONL_CURRENCIES, (70, 30))[0]
    if rng.random() < 0.2:  # a nested "user" that is not the event's user
        campaign = rng.choice(("purchase", "spring-sale", "newsletter"))
        event["referrer"] = {"user": rng.choice(users), "campaign": campaign}
    if rng.random() < 0.3:
        event["device"] = rng.choice(("ios", "android", "web"))
    return event


def _event_line(rng: random.Random, event: dict[str, Any]) -> str:
    """The event as one JSON line: keys in a random order, compact or spaced."""
    keys = list(event)
    rng.shuffle(keys)
    separators = rng.choice(((",", ":"), (", ", ": ")))
    return json.dumps({k: event[k] for k in keys}, separators=separators)


def build_jsonl_totals(rng: random.Random, params: Mapping[str, Any]) -> list[InputFile]:
    """3-6 days of events, ``events/<date>.jsonl``, the oldest 1-2 days gzipped
    (``.jsonl.gz``), plus ``events/README.md``. ``params`` (``metric``, ``currency``) shape only
    the answer, but are checked here so a bad task fails at reset."""
    if params["metric"] not in JSONL_METRICS:
        raise ValueError(f"metric must be one of {JSONL_METRICS}")
    if params["currency"] not in (None, *JSONL_CURRENCIES):
        raise ValueError(f"currency must be null or one of {JSONL_CURRENCIES}")
    users = sorted(f"u{n:03d}" for n in rng.sample(range(1, 400), rng.randint(6, 15)))
    first = dt.date(2025, 1, 1) + dt.timedelta(days=rng.randint(0, 300))
    days = rng.randint(3, 6)
    zipped = rng.randint(1, 2)
    files = []
    for offset in range(days):
        day = first + dt.timedelta(days=offset)
        when = dt.datetime(day.year, day.month, day.day)
        lines = []
        for _ in range(rng.randint(15, 80)):
            when += dt.timedelta(seconds=rng.randint(1, 1000))
            lines.append(_event_line(rng, _event(rng, when, users)))
        if rng.random() < 0.3:
            _plant(lines, "", rng)  # a blank line is no record
        gzipped = offset < zipped
        path = f"{EVENTS_DIR}/{day.isoformat()}.jsonl" + (".gz" if gzipped else "")
        files.append(InputFile(path, ("\n".join(lines) + "\n").encode(), gzipped))
    readme = "One file per day. Event types: view, purchase, refund, signup, logout.\n"
    files.append(InputFile(f"{EVENTS_DIR}/README.md", readme.encode()))
    return sorted(files, key=lambda f: f.path)


_BUILDERS: dict[str, Callable[[random.Random, Mapping[str, Any]], list[InputFile]]] = {
    "status_counts": build_status_counts,
    "find_files": build_find_files,
    "csv_to_tsv": build_csv_to_tsv,
    "jsonl_totals": build_jsonl_totals,
}
_OUTPUTS: dict[str, dict[str, Any]] = {
    "status_counts": {"output_files": (STATUS_CSV,)},
    "find_files": {"output_files": (MATCHES_TXT,)},
    "csv_to_tsv": {"output_dir": OUT_DIR},
    "jsonl_totals": {"output_files": (TOTALS_CSV,)},
}
