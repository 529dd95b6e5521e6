"""Several engines behind one gateway without a router: ``--engine-url A,B``.

Real processes on 127.0.0.1: two ``corral engine`` children over the tiny model and a gateway
whose engine URL lists both. Every turn of a session must land on one engine, counted on the
engines' side (their ``/metrics``), the sessions must spread over both, and the samples must be
token-exact; an engine that cannot be reached moves its sessions to the next engine in their
ranking instead of failing them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from corral.engines.affinity import SessionAffineEngines, rendezvous_order
from corral.engines.client import engine_urls, make_engine_client
from corral.processes import serve_in_process
from tests.gateway_stack import check_exact_sample, gateway_stack
from tests.servers import free_port
from tests.test_routers import counts, sessions_stick_and_spread, tool_session


def test_rendezvous_order_is_stable_spreads_and_moves_only_what_it_must() -> None:
    names = ["http://a:1", "http://b:2", "http://c:3"]
    keys = [f"session-{i}" for i in range(600)]
    first = {key: names[rendezvous_order(key, names)[0]] for key in keys}
    assert first == {key: names[rendezvous_order(key, names)[0]] for key in keys}
    spread = Counter(first.values())
    assert all(150 < spread[name] < 250 for name in names), spread
    # Losing an engine moves exactly the sessions that ranked it first, each to its second.
    survivors = names[:2]
    for key in keys:
        now = survivors[rendezvous_order(key, survivors)[0]]
        if first[key] != names[2]:
            assert now == first[key]
        else:
            assert now == names[rendezvous_order(key, names)[1]]


def test_a_comma_list_makes_one_client_over_each_engine() -> None:
    assert engine_urls(" http://a:1, http://b:2 ,") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="no engine URL"):
        engine_urls(" , ")
    client = make_engine_client("sglang", "http://a:1,http://b:2")
    assert isinstance(client, SessionAffineEngines)
    assert client.names == ["http://a:1", "http://b:2"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("engines")
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                serve_in_process(["engine", "--model", str(tiny_model_dir)], log=logs / f"{i}.log")
            )
            for i in range(2)
        ]


def test_each_session_sticks_to_one_engine_and_sessions_spread(
    engines: list[str], tiny_model_dir: Path
) -> None:
    with gateway_stack(tiny_model_dir, ",".join(engines)) as stack:
        sessions_stick_and_spread(stack, engines)


def test_an_unreachable_engine_moves_its_sessions_to_the_next(
    engines: list[str], tiny_model_dir: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nobody listens there
    listed = [engines[0], dead]
    with gateway_stack(tiny_model_dir, ",".join(listed)) as stack:
        played = moved = 0
        # Until two sessions ranked the dead engine first (each does with probability 1/2).
        while moved < 2:
            assert played < 16, "no session ranked the dead engine first"
            before = counts(engines[0])
            session_id = tool_session(stack)  # asserts every turn was answered
            assert counts(engines[0]).requests - before.requests == 2
            check_exact_sample(stack, session_id, 2)
            played += 1
            moved += rendezvous_order(session_id, listed)[0] == 1
        assert httpx.get(f"{stack.url}/health").status_code == 200
