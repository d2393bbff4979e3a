"""The replay harness on small streams generated here: metrics, baselines, the service
replay, tuning, the event format and the command."""

from __future__ import annotations

import heapq
import json
import math
import random
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda_memory import AdaptiveDecay, ExponentialDecay, ObservationType, PowerLawDecay
from coda_memory.cli import app
from coda_memory.replay import (
    Calibration,
    Event,
    build_timeline,
    hit_at,
    ndcg_at,
    plot_reliability,
    read_events,
    replay_baselines,
    replay_decay,
    report,
    tune,
    write_events,
)
from coda_memory.replay.harness import TOP, _Popularity
from coda_memory.replay.tuning import Family
from tests.helpers import T0

ENTITY = ObservationType.ENTITY_ACCESS


def access(identity: str, day: float, subject: str) -> Event:
    return Event(identity, T0 + timedelta(days=day, hours=9), ENTITY, subject)


def drifting_stream(days: int = 60) -> list[Event]:
    """``steady`` opens file:a every day; ``drifter`` works on file:b for the first half,
    then on file:c, touching a one-off file each day throughout."""
    events: list[Event] = []
    for day in range(days):
        events.append(access("steady", day, "file:a"))
        events.append(access("drifter", day, "file:b" if day < days // 2 else "file:c"))
        events.append(access("drifter", day, f"file:once-{day}"))
    return events


def test_hit_and_ndcg_on_known_rankings() -> None:
    assert hit_at(["x", "y", "z"], {"z"}, k=2) == 0.0
    assert hit_at(["x", "y", "z"], {"z"}, k=3) == 1.0
    assert ndcg_at(["a", "b"], {"a", "b"}) == pytest.approx(1.0)
    assert ndcg_at(["x", "a"], {"a"}) == pytest.approx(1 / math.log2(3))
    assert ndcg_at([], {"a"}) == 0.0


def test_brier_log_loss_and_reliability_on_known_pairs() -> None:
    calibration = Calibration()
    for probability, outcome in [(0.9, True), (0.9, False), (0.2, False), (0.2, False)]:
        calibration.add(probability, outcome)
    assert calibration.brier == pytest.approx((0.01 + 0.81 + 0.04 + 0.04) / 4)
    expected = -(math.log(0.9) + math.log(0.1) + 2 * math.log(0.8)) / 4
    assert calibration.log_loss == pytest.approx(expected)
    (low, high) = calibration.reliability()
    assert low[0] == pytest.approx(0.2) and low[1:] == (0.0, 2)
    assert high[0] == pytest.approx(0.9) and high[1:] == (0.5, 2)
    assert calibration.brier_of_constant(0.25) == pytest.approx((0.75**2 + 3 * 0.25**2) / 4)


def test_global_popularity_keeps_the_exact_top_as_counts_grow() -> None:
    rng = random.Random(7)
    popularity = _Popularity()
    for _ in range(3000):
        popularity.add(f"s{int(rng.paretovariate(1.2)) % 60}")
        counts = popularity.counts
        expected = heapq.nsmallest(TOP, counts, key=lambda s: (-counts[s], s))
        assert popularity.top == expected


def test_sessions_are_days_and_the_split_is_by_time() -> None:
    timeline = build_timeline(drifting_stream(), split=0.5, horizon_days=7)
    assert len(timeline.sessions) == 120
    assert timeline.split_at == T0 + timedelta(days=29.5, hours=9)
    assert timeline.scored == {"steady", "drifter"}
    first = timeline.sessions[0]
    assert timeline.used_within("steady", "entity_frequency:file:a", first.start)
    late = T0 + timedelta(days=31)
    assert not timeline.used_within("drifter", "entity_frequency:file:b", late)
    assert timeline.used_within("drifter", "entity_frequency:file:c", late)


def test_baselines_see_the_drift_differently() -> None:
    timeline = build_timeline(drifting_stream(), split=0.5)
    popularity, recency, frequency = replay_baselines(timeline)
    # Every scored session but each identity's first, on both sides of the split.
    assert recency.fit.ranking.sessions + recency.test.ranking.sessions == 118
    # After the drift, the most recent file is the one used next: recency finds c the day
    # after; all-time counts keep b on top, and the one-off files rank above c for a while.
    assert recency.test.ranking.hits == recency.test.ranking.sessions - 1  # the drift day
    assert frequency.test.ranking.ndcg_at_10 < recency.test.ranking.ndcg_at_10
    # Global popularity ranks what everyone used: it knows nothing of a person.
    assert popularity.test.ranking.sessions == recency.test.ranking.sessions
    # Nothing is forgotten: the baselines hold every subject ever touched.
    assert recency.test.facts_per_identity > 20


@pytest.mark.parametrize("decay", [ExponentialDecay(), AdaptiveDecay(), PowerLawDecay()], ids=repr)
async def test_a_replay_through_the_service_ranks_scores_and_forgets(decay: object) -> None:
    # 200 days: long enough for every strategy to forget a file touched once.
    timeline = build_timeline(drifting_stream(200), split=0.5, horizon_days=7)
    assert isinstance(decay, ExponentialDecay | PowerLawDecay)
    result = await replay_decay(timeline, decay, name="x")
    assert result.fit.ranking.sessions + result.test.ranking.sessions == 398
    # Daily use keeps a fact on top: file:a every session, file:c from the day after the
    # drift (the drift day itself nothing can predict).
    assert result.test.ranking.hits == result.test.ranking.sessions - 1
    # One-off files are forgotten, so memory holds fewer facts than the baselines' all.
    _, recency, _ = replay_baselines(timeline)
    assert result.test.facts_per_identity < recency.test.facts_per_identity
    # Every fact held at a scored session's start was scored as a probability, but those
    # of the last 7 days' sessions, whose "used within 7 days" the data cannot tell.
    last_week = sum(1 for s in timeline.sessions if not timeline.seen_through_horizon(s))
    assert last_week == 2 * 7
    assert 0 < result.test.calibration.count < result.test.facts_total
    assert 0.0 < result.test.calibration.base_rate < 1.0


async def test_a_session_is_scored_on_nothing_that_happened_after_it_began() -> None:
    """Sessions went through whole, in order of start: a session that began while an
    earlier one went on was scored with what the earlier one did later (here doc:fut, at
    12:00, predicted at 10:00), by memory and the baselines alike."""
    at = T0.replace(hour=0)

    def used(session: str, hours: float, subject: str) -> Event:
        return Event("u", at + timedelta(hours=hours), ENTITY, subject, session)

    events = [
        used("A", 9, "doc:x1"),
        used("A", 12, "doc:fut"),
        used("B", 10, "doc:fut"),
        used("B", 10.5, "doc:zzz"),
    ]
    timeline = build_timeline(events, split=0.3)  # B, at 10:00, after the split: held out
    memory = await replay_decay(timeline, ExponentialDecay(), name="x")
    _, recency, frequency = replay_baselines(timeline)
    for result in (memory, recency, frequency):
        assert result.test.ranking.sessions == 1
        assert result.test.ranking.hit_at_5 == 0.0  # doc:x1 only was known at 10:00
    assert memory.test.facts_total == 1


async def test_recency_ranks_by_the_last_use_as_memory_does() -> None:
    """file:z was used after file:a, in the same day's session: recency took each use as
    made at the session's start, and ranked the two by name (file:a first), where memory
    ranks file:z first."""
    at = T0.replace(hour=0)
    events = [
        Event("u", at + timedelta(hours=9), ENTITY, "file:a"),
        Event("u", at + timedelta(hours=17), ENTITY, "file:z"),
        Event("u", at + timedelta(days=1, hours=9), ENTITY, "file:z"),
    ]
    timeline = build_timeline(events, split=0.5)
    memory = await replay_decay(timeline, ExponentialDecay(), name="x")
    _, recency, frequency = replay_baselines(timeline)
    assert memory.test.ranking.ndcg_at_10 == recency.test.ranking.ndcg_at_10 == 1.0
    # All-time frequency counts sessions: one each, ties by subject.
    assert frequency.test.ranking.ndcg_at_10 == pytest.approx(1 / math.log2(3))


async def test_a_replay_loses_no_event_however_many_come_between_two_sessions() -> None:
    """The writer stores only while the replay waits, which it did only at a scored
    session's start: the events emitted in between past the writer's queue were dropped
    ("queue full", 100,000 by default: a first day of a thousand users of a hundred
    observations each), and memory was scored without them (100 of the 300 files here)."""
    events = [Event("u", T0 + timedelta(seconds=k), ENTITY, f"file:{k}") for k in range(300)]
    events.append(access("u", 1, "file:0"))
    timeline = build_timeline(events, split=0.5)
    memory = await replay_decay(timeline, ExponentialDecay(), name="x", queue_size=100)
    assert memory.test.ranking.sessions == 1
    assert memory.test.facts_total == 300


async def test_calibration_leaves_out_sessions_the_data_does_not_see_a_horizon_past() -> None:
    """Near the data's end, "used again within 30 days" counted as no for want of data,
    and confidence looked over-confident; the ranking still counts them."""
    timeline = build_timeline(drifting_stream(20), split=0.5, horizon_days=30)
    result = await replay_decay(timeline, ExponentialDecay(), name="x")
    assert result.test.ranking.sessions > 0 and result.test.facts_total > 0
    assert result.test.calibration.count == 0


async def test_a_timeline_that_ends_less_than_a_horizon_before_year_10000_replays() -> None:
    """A session's start plus the horizon was computed, past the last date a datetime
    holds: the replay failed with an OverflowError, reported as the store's failure."""
    end = datetime(9999, 12, 31, 9, tzinfo=UTC)
    events = [Event("ana", end - timedelta(days=day), ENTITY, "file:a") for day in (60, 40, 20, 0)]
    timeline = build_timeline(events, split=0.5, horizon_days=30)
    assert timeline.used_within("ana", "entity_frequency:file:a", end - timedelta(days=1))
    assert not timeline.used_within("ana", "entity_frequency:file:a", end + timedelta(hours=1))
    result = await replay_decay(timeline, ExponentialDecay(), name="x")
    assert result.fit.calibration.count == 1  # day -40's, seen 30 days past
    assert result.test.ranking.sessions == 2 and result.test.calibration.count == 0


async def test_a_strategy_whose_facts_all_expired_holds_zero_facts_not_blank() -> None:
    """Sessions 100 days apart: the exponential's facts have expired at each, and its
    "facts held" was left blank (null in JSON), as for a method that holds no facts."""
    events = [access("ana", day, "file:a") for day in range(0, 1000, 100)]
    timeline = build_timeline(events, split=0.5)
    popularity, recency, _ = replay_baselines(timeline)
    result = await replay_decay(timeline, ExponentialDecay(), name="x")
    assert result.test.ranking.sessions == 5 and result.test.facts_total == 0
    rows = report.values([popularity, recency, result])
    held = report.HEADER.index("facts held")
    assert [row[held] for row in rows] == [None, 1.0, 0.0]


async def test_the_replay_uses_the_store_the_url_names() -> None:
    timeline = build_timeline(drifting_stream(20), split=0.5)
    with pytest.raises(ValueError, match="unsupported memory URL"):
        await replay_decay(timeline, ExponentialDecay(), url="nosuch://")
    off = await replay_decay(timeline, ExponentialDecay(), url="null://")
    assert off.test.facts_total == 0
    assert off.test.ranking.hit_at_5 == 0.0


async def test_tuning_keeps_the_best_on_the_fitting_period_only() -> None:
    timeline = build_timeline(drifting_stream(), split=0.5, horizon_days=7)
    family = Family("exponential", ExponentialDecay, {"base": (0.5, 0.95, 0.99)})
    tuned = await tune(family, timeline)
    assert tuned.trials == 3  # the seed, 0.5 and 0.99 (0.95 is the seed's value)
    assert tuned.seed.name == "exponential"
    trials = {0.5: None, 0.99: None}
    for base in trials:
        result = await replay_decay(timeline, ExponentialDecay(base=base))
        assert result.fit.ranking.ndcg_at_10 <= tuned.best.fit.ranking.ndcg_at_10 + 1e-12
    chosen = tuned.best_params.get("base", 0.95)
    again = await replay_decay(timeline, ExponentialDecay(base=chosen))
    assert again.fit.ranking.ndcg_at_10 == pytest.approx(tuned.best.fit.ranking.ndcg_at_10)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_the_event_format_round_trips(tmp_path: Path, suffix: str) -> None:
    events = [
        access("ana", 0, "account:acct-1"),
        Event("ana", T0, ObservationType.TOOL_FAILURE, "run_sql", "s-1"),
        Event("b", T0 + timedelta(hours=1), ObservationType.QUERY_PATTERN, "royalty"),
    ]
    path = tmp_path / f"events{suffix}"
    write_events(path, events)
    assert read_events(path) == sorted(events, key=lambda e: e.time)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_starts_with_a_byte_order_mark_is_read(tmp_path: Path, suffix: str) -> None:
    """Excel's "CSV UTF-8" starts with one: the first column was named "\ufeffidentity",
    and every line was refused as having no identity (a JSON file as not JSON)."""
    path = tmp_path / f"events{suffix}"
    events = drifting_stream(3)
    write_events(path, events)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_events(path) == sorted(events, key=lambda e: e.time)


def test_a_session_of_a_json_number_is_read_as_its_text(tmp_path: Path) -> None:
    """Session 0 was read as no session (the UTC day's), session 1 as "1"."""
    path = tmp_path / "events.jsonl"
    good = {"identity": "a", "time": "2026-01-01T00:00:00Z", "kind": "entity_access"}
    lines = [{**good, "subject": "file:x", "session": number} for number in (0, 1)]
    lines.append({**good, "subject": "file:y", "session": ""})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [e.session_key for e in read_events(path)] == ["0", "1", "2026-01-01"]


def test_a_bad_event_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = {"identity": "a", "time": "2026-01-01T00:00:00Z", "kind": "entity_access"}
    path.write_text(
        json.dumps({**good, "subject": "file:x"}) + "\n" + json.dumps({**good, "kind": "x"})
    )
    with pytest.raises(ValueError, match=r"events.jsonl:2"):
        read_events(path)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"identity": "u" * 300}, "the service refuses the identity (identity_id is longer"),
        ({"session": "s" * 201}, "the service refuses the session (longer than 200"),
    ],
)
def test_an_event_the_service_would_reject_names_its_line(
    tmp_path: Path, change: dict[str, str], says: str
) -> None:
    """Read, then rejected by the service's writer: memory scored nothing for such an
    identity or session, while the baselines scored its events."""
    path = tmp_path / "events.jsonl"
    good = {"identity": "a", "time": "2026-01-01T00:00:00Z", "kind": "entity_access"}
    path.write_text(json.dumps({**good, "subject": "file:x", **change}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"events.jsonl:1: {says}")):
        read_events(path)


@pytest.mark.parametrize(
    ("kind", "subject", "says"),
    [
        ("tool_success", "git/push", "a tool name is 1 to 128"),
        ("tool_failure", "t" * 129, "a tool name is 1 to 128"),
        ("entity_access", "file", "an entity is type:id"),
    ],
)
def test_an_event_that_reinforces_no_fact_names_its_line(
    tmp_path: Path, kind: str, subject: str, says: str
) -> None:
    """Read, and then refused by the service or kept for nothing: the day of such an
    event was a session scored on nothing it used (hit@5 0.5 here, for every method)."""
    path = tmp_path / "events.jsonl"
    lines = [
        {"identity": "a", "time": f"2026-01-0{day}T09:00:00Z", "kind": "entity_access"}
        | {"subject": "file:x"}
        for day in (1, 3)
    ]
    odd = {"identity": "a", "time": "2026-01-02T09:00:00Z", "kind": kind, "subject": subject}
    path.write_text("".join(json.dumps(line) + "\n" for line in [lines[0], odd, lines[1]]))
    with pytest.raises(ValueError, match=re.escape("events.jsonl:2: the service keeps no fact")):
        read_events(path)
    with pytest.raises(ValueError, match=re.escape(says)):
        read_events(path)


def test_the_command_replays_an_events_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    write_events(path, drifting_stream())
    plot = tmp_path / "reliability.png"
    result = CliRunner().invoke(
        app,
        [
            "replay",
            "--events",
            str(path),
            "--split",
            "0.5",
            "--format",
            "json",
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["events"] == 180 and report["sessions"] == 120
    methods = [row["method"] for row in report["results"]]
    assert methods == [
        "no memory (global popularity)",
        "recency only",
        "all-time frequency",
        "exponential",
        "adaptive",
        "power-law",
    ]
    assert all(row["sessions"] == 60 for row in report["results"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("horizon", "noted"), [("3", True), ("1", False)])
def test_the_command_says_when_no_scored_session_is_calibrated(
    tmp_path: Path, horizon: str, noted: bool
) -> None:
    """Only bob's one session (not scored: one session) started a horizon before the end;
    ana's held-out sessions did not. Nothing was calibrated, and the command said
    nothing, counting sessions that are never scored."""
    path = tmp_path / "events.jsonl"
    events = [access("ana", day, "file:a") for day in (0, 1, 2, 8, 9)]
    write_events(path, [*events, access("bob", 5, "file:b")])
    options = ("--split", "0.5", "--horizon-days", horizon, "--format", "json")
    result = CliRunner().invoke(app, ["replay", "--events", str(path), *options])
    assert result.exit_code == 0, result.output
    assert ("nothing is calibrated" in result.stderr) is noted, result.stderr
    rows = json.loads(result.stdout)["results"]
    assert any(row["Brier"] is not None for row in rows) is not noted


async def test_the_reliability_diagram_leaves_the_host_matplotlib_as_it_was(
    tmp_path: Path,
) -> None:
    """It called ``matplotlib.use("Agg")``: a host that imported it (a notebook, a GUI)
    had its backend switched under it, and drew nothing on screen after."""
    matplotlib = pytest.importorskip("matplotlib")
    pyplot = pytest.importorskip("matplotlib.pyplot")
    timeline = build_timeline(drifting_stream(), split=0.5, horizon_days=7)
    result = await replay_decay(timeline, ExponentialDecay(), name="exponential")
    host_backend = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        plot_reliability([result], tmp_path / "reliability.png")

        assert matplotlib.get_backend() == "svg"
        assert pyplot.get_fignums() == []
    finally:
        matplotlib.use(host_backend)
    data = (tmp_path / "reliability.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
