"""The replay's --store: never the live memory, left as it was found, and an unreachable
one fails at once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from coda_memory import ExponentialDecay, MemoryService, ObservationType
from coda_memory.errors import ConnectionLost
from coda_memory.replay import Event, ReplayResult, build_timeline, harness, replay_decay
from tests.helpers import T0
from tests.pg_fixtures import new_database
from tests.postgres.helpers import fetch
from tests.postgres.test_cli import assert_one_line_error, run, seed_alice


@pytest.fixture
def scratch_url(_pg_server: URL, _pg_template: str) -> Iterator[str]:
    """A second migrated database, for the replay to write to."""
    with new_database(_pg_server, _pg_template) as url:
        yield url


_COUNTS = (
    "SELECT (SELECT count(*) FROM coda_memory.observations),"
    " (SELECT count(*) FROM coda_memory.facts),"
    " (SELECT count(*) FROM coda_memory.fact_events),"
    " (SELECT count(*) FROM coda_memory.checkpoints)"
)


def _counts(url: str) -> tuple[int, int, int, int]:
    return tuple(asyncio.run(fetch(url, _COUNTS))[0])


def test_replay_refuses_a_store_that_holds_the_memory_it_replays(pg_url: str) -> None:
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    before = _counts(pg_url)
    result = run("replay", "--url", pg_url, "--store", pg_url, "--split", "0.2")
    assert_one_line_error(
        result, 2, "--store: the replay's store already holds memory of 2 of the 2 identities"
    )
    assert _counts(pg_url) == before


def test_a_scratch_postgres_store_scores_as_memory_does_and_is_left_empty(
    pg_url: str, scratch_url: str
) -> None:
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    arguments = ("replay", "--url", pg_url, "--split", "0.2", "--format", "json")
    in_memory = run(*arguments)
    in_postgres = run(*arguments, "--store", scratch_url)
    assert in_memory.exit_code == in_postgres.exit_code == 0, in_postgres.output
    assert json.loads(in_postgres.stdout) == json.loads(in_memory.stdout)
    assert _counts(scratch_url) == (0, 0, 0, 0)


def test_a_scratch_schema_of_the_live_database_is_the_store_the_replay_writes_to(
    pg_url: str,
) -> None:
    """The help and the README said to give the replay an empty schema, but nothing named
    the schema of a Postgres --store (--schema names the one the events are read from):
    it wrote into coda_memory, the live schema here, and refused it as holding memory."""
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    assert run("migrate", "--url", pg_url, "--schema", "replay_scratch").exit_code == 0
    before = _counts(pg_url)
    arguments = ("replay", "--url", pg_url, "--split", "0.2", "--format", "json")
    in_memory = run(*arguments)
    in_scratch = run(*arguments, "--store", pg_url, "--store-schema", "replay_scratch")
    assert in_memory.exit_code == in_scratch.exit_code == 0, in_scratch.output
    assert json.loads(in_scratch.stdout) == json.loads(in_memory.stdout)
    assert _counts(pg_url) == before
    scratch = asyncio.run(fetch(pg_url, _COUNTS.replace("coda_memory.", "replay_scratch.")))
    assert tuple(scratch[0]) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    "store", ["postgresql://postgres@127.0.0.1:1/scratch", "redis://127.0.0.1:1/13"]
)
def test_replay_into_an_unreachable_store_fails_at_once(pg_url: str, store: str) -> None:
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    script = Path(sys.executable).parent / "coda-memory"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODA_MEMORY_")}
    # Before, the writer retried the store every two seconds, for ever.
    done = subprocess.run(
        [str(script), "replay", "--url", pg_url, "--store", store, "--split", "0.2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "127.0.0.1" in lines[0] or "onnect" in lines[0], lines[0]


class _Stopped(Exception):
    """Stands for what stops a replay half-way: a store error, Ctrl-C."""


async def test_a_replay_that_lost_its_store_does_not_wait_to_erase_it(
    scratch_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store gone, the first forget waited out its 10 s before failing, and the
    replay's own error came that much later: it erases nothing then, and says so."""
    events = [
        Event(user, T0 + timedelta(days=day, hours=9), ObservationType.ENTITY_ACCESS, "doc:a")
        for day in range(6)
        for user in ("ana", "bob")
    ]
    timeline = build_timeline(events, split=0.5)

    def lost(*arguments: Any) -> None:
        raise ConnectionLost("the connection to the database died")

    forgotten: list[str] = []

    async def forget(self: MemoryService, identity_id: str) -> Any:
        forgotten.append(identity_id)

    monkeypatch.setattr(harness, "_score", lost)
    monkeypatch.setattr(MemoryService, "forget", forget)
    with pytest.raises(ConnectionLost):
        await replay_decay(timeline, ExponentialDecay(), url=scratch_url)
    assert forgotten == []


async def test_a_replay_stopped_half_way_leaves_its_store_empty(
    scratch_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay that failed left what it had written; the next replay on the store then
    refused it as holding memory of the identities (StoreNotScratch), until each was
    forgotten by hand."""
    events = [
        Event(user, T0 + timedelta(days=day, hours=9), ObservationType.ENTITY_ACCESS, "doc:a")
        for day in range(6)
        for user in ("ana", "bob")
    ]
    timeline = build_timeline(events, split=0.5)
    scored = harness._score
    sessions = 0

    def score_then_stop(*arguments: Any) -> None:
        nonlocal sessions
        sessions += 1
        if sessions == 4:
            raise _Stopped
        scored(*arguments)

    monkeypatch.setattr(harness, "_score", score_then_stop)
    with pytest.raises(_Stopped):
        await replay_decay(timeline, ExponentialDecay(), url=scratch_url)
    assert tuple((await fetch(scratch_url, _COUNTS))[0]) == (0, 0, 0, 0)
    monkeypatch.setattr(harness, "_score", scored)
    result = await replay_decay(timeline, ExponentialDecay(), url=scratch_url)
    assert result.fit.ranking.sessions + result.test.ranking.sessions == 10
    assert tuple((await fetch(scratch_url, _COUNTS))[0]) == (0, 0, 0, 0)


def _figures(result: ReplayResult) -> list[tuple[int, float, int, int, float]]:
    return [
        (
            p.ranking.sessions,
            round(p.ranking.ndcg, 9),
            p.facts_total,
            p.calibration.count,
            round(p.calibration.brier_sum, 9),
        )
        for p in (result.fit, result.test)
    ]


async def test_a_session_that_comes_back_after_weeks_reinforces_as_on_every_store(
    store_url: str,
) -> None:
    """Redis keeps a session's reinforcements for its session_horizon (30 days): a session
    id that came back 45 days later reinforced doc:a a second time there, where Postgres
    and memory:// took its reinforcement as final (other sessions reinforced it since)."""
    access = ObservationType.ENTITY_ACCESS
    events = [Event("ana", T0, access, "doc:a", "s1")]
    events += [Event("ana", T0 + timedelta(days=d), access, "doc:a", f"d{d}") for d in range(1, 41)]
    events += [Event("ana", T0 + timedelta(days=45), access, "doc:a", "s1")]
    events += [
        Event("ana", T0 + timedelta(days=d), access, "doc:b", f"d{d}") for d in range(46, 50)
    ]
    timeline = build_timeline(events, split=0.5, horizon_days=1)
    expected = await replay_decay(timeline, ExponentialDecay())
    result = await replay_decay(timeline, ExponentialDecay(), url=store_url)
    assert _figures(result) == _figures(expected)
