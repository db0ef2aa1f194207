"""The page's HTML, rendered from queries' answers as they come off the bus: what it
shows of hosts, pools, decisions and a lease's trail, and that every name and text from
the bus is escaped. The answers are the core queries' own, over a folded state."""

from __future__ import annotations

import html.parser
from typing import Any

import pytest

from reconciler.core.queries import QUERIES
from reconciler.web.page import Bar, lease_path, render_lease, render_overview, render_problem
from tests.support.builders import Fleet, admit, cmd, gpu, lifecycle, pool, snapshot

NOW = "2026-12-05 21:00:00 UTC"
EVIL = "<script>alert(1)</script>"


class Parsed(html.parser.HTMLParser):
    """Every tag and the text of the document, to look at what a browser would build."""

    def __init__(self, document: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(document)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        if data.strip():
            self.text.append(data.strip())


def fleet() -> Fleet:
    f = Fleet()
    f.send(
        snapshot("h1", cpu=16),
        snapshot("g1", gpus=[gpu(0), gpu(1)]),
        pool("warm", cpu=4, min_ready=2, max_ready=3),
        admit("w0", "warm", "w0", kind="warm", host="h1"),
        lifecycle("h1", "instance-ready", "w0"),
        cmd("claim-warm", "c1", pool="warm", job=EVIL),
        admit("r9", "nope", "vm9"),
        cmd("cordon", "k1", host="g1"),
    )
    return f


def answers(f: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    return QUERIES["fleet"](f.state, {}), QUERIES["decisions"](f.state, {})


def test_the_overview_shows_hosts_with_their_bars_pools_and_decisions() -> None:
    page = Parsed(render_overview(*answers(fleet()), now=NOW, refresh_s=10))

    rows = [a for t, a in page.tags if t == "tr" and a.get("class") == "host"]
    assert [r["data-host"] for r in rows] == ["g1", "h1"]
    widths = [a["width"] for t, a in page.tags if t == "rect" and "fill" in (a.get("class") or "")]
    assert "25.0" in widths  # h1: 4 of 16 vCPU booked
    assert "cordoned" in page.text and "4/16 vCPU" in page.text and "0/2" in page.text
    assert [a["data-pool"] for t, a in page.tags if t == "tr" and a.get("class") == "pool"] == [
        "warm"
    ]
    assert [a["data-request"] for t, a in page.tags if a.get("class") == "decision"] == [
        "k1",
        "r9",
        "c1",
        "w0",
    ]
    assert "unknown-pool" in page.text and "no pool named 'nope'" in page.text
    links = [a["href"] for t, a in page.tags if t == "a" and a.get("class") == "lease"]
    assert links == ["/lease/L4", "/lease/L4"]
    assert ("meta", {"http-equiv": "refresh", "content": "10"}) in page.tags


def test_no_refresh_leaves_the_page_still() -> None:
    page = Parsed(render_overview(*answers(fleet()), now=NOW, refresh_s=0))
    assert not [a for t, a in page.tags if t == "meta" and a.get("http-equiv") == "refresh"]


def test_the_overview_is_whole_and_has_no_script() -> None:
    document = render_overview(*answers(fleet()), now=NOW)
    page = Parsed(document)
    assert document.startswith("<!doctype html>")
    assert not [t for t, _ in page.tags if t == "script"]
    assert ("link", {"rel": "stylesheet", "href": "/static/page.css"}) in page.tags


def test_every_text_from_the_bus_is_escaped() -> None:
    fleet_answer, decisions = answers(fleet())
    decisions["decisions"][0]["detail"] = EVIL
    decisions["decisions"][0]["reason"] = '"><img src=x onerror=alert(1)>'
    fleet_answer["pools"][0]["pool"] = EVIL
    document = render_overview(fleet_answer, decisions, now=NOW)

    assert EVIL not in document and "<img" not in document
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in document
    page = Parsed(document)
    assert not [t for t, _ in page.tags if t in ("script", "img")]


def test_a_lease_page_shows_the_lease_and_its_trail_in_stream_order() -> None:
    f = fleet()
    lease = QUERIES["lease"](f.state, {"identifier": "L4"})
    lease["history"] = [
        [4, "admit", None, "reserved"],
        {"input_seq": 5, "event": "instance-ready", "from_state": "reserved", "to_state": "ready"},
        {"input_seq": 6, "event": "claim", "from_state": "ready", "to_state": "claimed"},
    ]
    recent = QUERIES["decisions"](f.state, {})["decisions"]
    lease["decisions"] = [d for d in recent if d.get("lease", {}).get("lease_id") == "L4"]

    page = Parsed(render_lease("L4", lease, now=NOW))

    rows = [a.get("class") for t, a in page.tags if t == "tr" and a.get("class")]
    assert rows == ["transition", "decision", "transition", "transition", "decision"]
    assert "claim-warm" in " ".join(page.text) and "→" in " ".join(page.text)
    assert EVIL not in render_lease("L4", lease, now=NOW)  # the job's name, escaped
    assert any(EVIL in t for t in page.text)  # and shown as text


def test_a_lease_nothing_is_known_by_says_so() -> None:
    page = Parsed(render_lease("nobody", None, now=NOW))
    assert "nothing is known as nobody" in page.text


def test_a_problem_is_shown_instead_of_numbers() -> None:
    page = Parsed(render_overview(None, None, now=NOW, problem="no answer from a replica"))
    assert "no answer from a replica" in page.text
    assert not [a for t, a in page.tags if t == "tr" and a.get("class") == "host"]
    assert "nope" in Parsed(render_problem("not found", "nope", now=NOW)).text


def test_a_warm_hit_ratio_is_shown_when_the_pools_status_has_one() -> None:
    fleet_answer, decisions = answers(fleet())
    without = render_overview(fleet_answer, decisions, now=NOW)
    fleet_answer["pools"][0]["warm_claims"] = {"claimed": 3, "no_warm": 1, "hit_ratio": 0.75}
    page = Parsed(render_overview(fleet_answer, decisions, now=NOW))

    assert "warm hit ratio" not in without
    assert "warm hit ratio" in page.text and "75 % (3/4)" in page.text


def test_identifiers_are_quoted_whole_in_links() -> None:
    assert lease_path("L12") == "/lease/L12"
    assert lease_path("octo/repo run 42") == "/lease/octo%2Frepo%20run%2042"


@pytest.mark.parametrize(
    ("bar", "percent", "level"),
    [
        (Bar(0, 0, ""), 0.0, "none"),
        (Bar(1, 4, ""), 25.0, "low"),
        (Bar(3, 4, ""), 75.0, "high"),
        (Bar(4, 4, ""), 100.0, "full"),
        (Bar(6, 4, ""), 100.0, "full"),  # foreign VMs over-commit a host
        (Bar(2, 0, ""), 100.0, "full"),
    ],
)
def test_bars_are_clamped_and_coloured_by_how_full(bar: Bar, percent: float, level: str) -> None:
    assert (bar.percent, bar.level) == (percent, level)


def test_requests_waiting_for_room_are_listed_in_the_order_they_would_be_admitted() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=8), pool("ci", cpu=4))
    f.send(admit("a1", "ci", "vm-1"), admit("a2", "ci", "vm-2"))
    f.send(admit("q1", "ci", "vm-3", wait_s=600), admit(EVIL, "ci", "vm-4", wait_s=600))
    fleet_answer, decisions = answers(f)
    waiting = QUERIES["queue"](f.state, {"limit": 1})
    page = Parsed(render_overview(fleet_answer, decisions, now=NOW, queue=waiting))

    rows = [a for t, a in page.tags if t == "tr" and a.get("class") == "waiting"]
    assert [r["data-request"] for r in rows] == ["q1"]
    assert "2 request(s) in the admission queue, the first 1 shown, in the order they would be " \
        "admitted" in page.text  # fmt: skip
    assert "insufficient-capacity" in page.text
    every = render_overview(fleet_answer, decisions, now=NOW, queue=QUERIES["queue"](f.state, {}))
    assert EVIL not in every and "&lt;script&gt;" in every  # a request id is escaped

    for nothing in (None, {"requests": [], "total": 0}):
        assert 'id="queue"' not in render_overview(fleet_answer, decisions, now=NOW, queue=nothing)
