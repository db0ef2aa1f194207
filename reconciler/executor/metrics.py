"""The executor's Prometheus metrics and probes (``reconciler executor --metrics-addr``).

Rules:

- The executor counts what it does in a :class:`CommandCounts` (plain counters, no
  Prometheus on the command path); :class:`ExecutorCollector` turns them, and what the
  executor holds at that moment (:class:`LiveFacts`), into metric families when
  ``/metrics`` is scraped (:mod:`reconciler.observe.endpoints`).
- Labels are bounded: ``host`` is one of the hosts the executor manages (a command that
  names another host is counted under the host whose consumer delivered it); ``verb``
  is ``create`` or ``delete``; ``outcome``, ``failure`` and ``reason`` are the codes of
  :mod:`reconciler.executor.commands` and of the executor's verdicts, fixed sets. The
  finished outcomes and the refusal reasons are exported at 0 from the start, so the
  first ``gave-up`` or refusal is an increase Prometheus sees: 18 series per host, and
  4 gauges; retries by ``(verb, failure)`` and duplicates by verb appear when first
  seen, at most 20 more per host.
- **Ready** (``/readyz`` 200) when the NATS connection is up and every managed host's
  consumer is bound (created or checked, and subscribed). A host's consumer is unbound
  from a failed or stalled fetch, or a NATS reconnect, until it is bound again. Incus is
  not probed: an unreachable host shows as retries (``failure="unavailable"``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from reconciler.core.messages import EXEC_VERBS
from reconciler.observe.endpoints import (
    MetricsServer,
    Readiness,
    gauge,
    labelled_counter,
    labelled_gauge,
)

__all__ = [
    "OUTCOMES",
    "REFUSALS",
    "CommandCounts",
    "ExecutorCollector",
    "ExecutorState",
    "LiveFacts",
    "executor_metrics_server",
]

#: how a command the executor acted on ends (recorded in its database)
OUTCOMES = ("created", "deleted", "absent", "superseded", "rejected", "gave-up")
#: why a message is refused before Incus (:class:`~reconciler.executor.commands.Refusal`)
REFUSALS = ("too-large", "decode", "subject", "schema", "wrong-host", "invalid-name")


class CommandCounts:
    """What the executor did, per host (see the module's rules)."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.hosts = tuple(sorted(hosts))
        #: (host, verb, outcome) → commands finished and recorded
        self.finished: Counter[tuple[str, str, str]] = Counter()
        #: (host, verb, failure) → attempts that failed and were tried again
        self.retried: Counter[tuple[str, str, str]] = Counter()
        #: (host, reason) → messages refused before Incus
        self.refused: Counter[tuple[str, str]] = Counter()
        #: (host, verb) → commands already finished, acked again without acting
        self.duplicates: Counter[tuple[str, str]] = Counter()
        #: host → commands on the stream not yet fetched, as the last fetch said
        self.backlog: dict[str, int] = dict.fromkeys(self.hosts, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveFacts:
    """What the executor holds at one moment."""

    nats_connected: bool
    #: host → messages fetched whose command is not finished
    held: Mapping[str, int]
    #: host → instances worked on now
    running: Mapping[str, int]
    #: hosts whose consumer is bound
    bound: frozenset[str]


class ExecutorState(Protocol):
    """What the collector reads from a running executor."""

    @property
    def counts(self) -> CommandCounts: ...

    def live(self) -> LiveFacts: ...


class ExecutorCollector(Collector):
    """Turns an executor's counts and live facts into metric families at scrape time."""

    def __init__(self, executor: ExecutorState) -> None:
        self.executor = executor

    def collect(self) -> Iterator[Metric]:
        counts, live = self.executor.counts, self.executor.live()
        hosts = counts.hosts
        finished: Counter[tuple[str, str, str]] = Counter(
            {(h, v, o): 0 for h in hosts for v in EXEC_VERBS for o in OUTCOMES}
        )
        finished.update(counts.finished)
        yield labelled_counter(
            "rc_executor_commands_finished",
            "Commands finished, by outcome (gave-up: failed max-attempts times; rejected: "
            "refused by Incus)",
            ["host", "verb", "outcome"],
            (([h, v, o], n) for (h, v, o), n in sorted(finished.items())),
        )
        yield labelled_counter(
            "rc_executor_command_retries",
            "Failed attempts tried again, by the failure's class",
            ["host", "verb", "failure"],
            (([h, v, f], n) for (h, v, f), n in sorted(counts.retried.items())),
        )
        refused = Counter({(h, r): 0 for h in hosts for r in REFUSALS})
        refused.update(counts.refused)
        yield labelled_counter(
            "rc_executor_commands_refused",
            "Messages refused before Incus (malformed, wrong subject or host), by reason",
            ["host", "reason"],
            (([h, r], n) for (h, r), n in sorted(refused.items())),
        )
        yield labelled_counter(
            "rc_executor_commands_duplicate",
            "Commands delivered again after they finished, acked without acting",
            ["host", "verb"],
            (([h, v], n) for (h, v), n in sorted(counts.duplicates.items())),
        )
        yield labelled_gauge(
            "rc_executor_commands_held",
            "Commands fetched and not finished (running, waiting their turn or a retry)",
            ["host"],
            (([h], live.held.get(h, 0)) for h in hosts),
        )
        yield labelled_gauge(
            "rc_executor_commands_running",
            "Instances worked on now",
            ["host"],
            (([h], live.running.get(h, 0)) for h in hosts),
        )
        yield labelled_gauge(
            "rc_executor_backlog",
            "Commands on the stream not fetched yet, as the last fetch said",
            ["host"],
            (([h], counts.backlog.get(h, 0)) for h in hosts),
        )
        yield labelled_gauge(
            "rc_executor_consumer_bound",
            "1 while the host's consumer is bound",
            ["host"],
            (([h], int(h in live.bound)) for h in hosts),
        )
        yield gauge("rc_executor_nats_connected", "1 while connected to NATS", live.nats_connected)
        yield gauge("rc_executor_ready", "1 while /readyz answers 200", _ready(counts, live))


def _ready(counts: CommandCounts, live: LiveFacts) -> bool:
    return live.nats_connected and all(h in live.bound for h in counts.hosts)


def executor_readiness(executor: ExecutorState) -> Readiness:
    """Ready, per the module's rules, with a document naming what is not."""
    counts, live = executor.counts, executor.live()
    detail: dict[str, Any] = {
        "nats_connected": live.nats_connected,
        "hosts": {
            h: {
                "consumer_bound": h in live.bound,
                "held": live.held.get(h, 0),
                "backlog": counts.backlog.get(h, 0),
            }
            for h in counts.hosts
        },
    }
    return Readiness(ready=_ready(counts, live), detail=detail)


def executor_metrics_server(*, addr: str, executor: ExecutorState) -> MetricsServer:
    """The executor's ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr``."""

    async def readiness() -> Readiness:
        return executor_readiness(executor)

    return MetricsServer(addr=addr, collectors=[ExecutorCollector(executor)], readiness=readiness)
