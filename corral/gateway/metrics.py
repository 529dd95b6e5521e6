"""The gateway's Prometheus metrics: requests by route, dialect and status, latency and token
histograms, and the session store's gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from corral.gateway.journal import SessionJournal
from corral.gateway.sessions import SessionStore
from corral.gateway.turns import Usage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, store: SessionStore, journal: SessionJournal | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "corral_gateway_requests",
            "Requests by route, dialect and status",
            ["route", "dialect", "status"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            "corral_gateway_turn_outcomes",
            "What became of served turns (recorded, replayed, client_gone, session_closed)",
            ["outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "corral_gateway_request_seconds",
            "Time to the last byte of an answer, by dialect",
            ["dialect"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Histogram(
            "corral_gateway_turn_tokens",
            "Prompt and completion tokens per turn, by dialect",
            ["dialect", "kind"],
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))
        if journal is not None:
            self.registry.register(_JournalCollector(journal))

    def request(self, route: str, dialect: str, status: int, seconds: float | None) -> None:
        self.requests.labels(route, dialect, str(status)).inc()
        if seconds is not None:
            self.latency.labels(dialect).observe(seconds)

    def turn(self, dialect: str, usage: Usage) -> None:
        self.tokens.labels(dialect, "prompt").observe(usage.prompt_tokens)
        self.tokens.labels(dialect, "completion").observe(usage.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """Reads the store's stats at scrape time."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        stats = self.store.stats()
        yield GaugeMetricFamily("corral_gateway_sessions", "Open sessions", value=stats.sessions)
        yield GaugeMetricFamily(
            "corral_gateway_held_tokens", "Tokens held by open sessions", value=stats.held_tokens
        )
        for name, value, doc in (
            ("turns", stats.turns_total, "Turns recorded"),
            ("merges", stats.merges_total, "Turns appended to a held trajectory"),
            ("forks", stats.forks_total, "Turns that started a new trajectory"),
            ("sessions_created", stats.created_total, "Sessions created"),
            ("sessions_expired", stats.expired_total, "Sessions expired"),
        ):
            yield CounterMetricFamily(f"corral_gateway_{name}", doc, value=value)
        reasons = CounterMetricFamily(
            "corral_gateway_merge_decisions", "Merge decisions by reason", labels=["reason"]
        )
        for reason, count in sorted(stats.decisions_by_reason.items()):
            reasons.add_metric([reason], count)
        yield reasons


class _JournalCollector:
    """The session journal's costs and output, read at scrape time."""

    def __init__(self, journal: SessionJournal) -> None:
        self.journal = journal

    def collect(self) -> Iterator[Any]:
        j = self.journal
        for name, value, doc in (
            ("journal_seconds", j.seconds, "Time the journal took on the gateway's loop"),
            ("journal_records", j.records, "Records the journal wrote"),
            ("journal_bytes", j.bytes_written, "Bytes the journal wrote"),
            ("journal_write_errors", j.write_errors, "Journal writes that failed (it stopped)"),
        ):
            yield CounterMetricFamily(f"corral_gateway_{name}", doc, value=value)
