"""MemoryStats: the counters a service reports (``MemoryService.stats()``), also read
by the telemetry metrics."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class MemoryStats(BaseModel):
    """Counters of a service since it started."""

    model_config = ConfigDict(frozen=True)

    #: Observations passed to ``emit_observation``.
    emitted: int
    #: Observations the store accepted.
    stored: int
    #: Observations refused as bad input (by validation or by the store), with a log line.
    rejected: int
    #: Observations dropped because the queue was full or the service was closed.
    dropped: int
    #: Observations emitted but not yet stored, rejected, dropped or discarded.
    pending: int
    #: ``load_memory`` calls; those that returned empty on timeout; those whose
    #: consolidation failed (empty, or answered from the facts at hand: ``load_stale``).
    loads: int = 0
    load_timeouts: int = 0
    load_errors: int = 0
    #: Observations the store accepted and threw away by design (``null://``).
    discarded: int = 0
    #: Observations (also counted as stored or rejected) dated more than
    #: ``max_clock_skew`` after the service clock, stored as made at the clock's now.
    future_clamped: int = 0
    #: Loads that outlived the timeout, or whose consolidation failed, and answered with
    #: the facts of the identity's last consolidation (not empty, and not counted in
    #: ``load_timeouts``).
    load_stale: int = 0
    #: Loads answered with the identity's answer of less than a second before, its facts
    #: unchanged and nothing waiting (``coda_memory.core.answers``); also in ``loads``.
    loads_reused: int = 0
    #: Times the ``max_facts`` cap applied (in a consolidation, or by the store on the
    #: server during a peek: once for both), and the facts it deleted.
    facts_capped: int = 0
    facts_evicted: int = 0
    #: Tool results (in this process) whose entities were cut to ``max_entities``.
    entity_results_capped: int = 0
    #: Postgres store: appends that stored their rows but owed their rollup (a rollup
    #: table was locked); owed transactions this service's appends folded in later (any
    #: process's: the analytics lag by the difference until it is paid); appends whose
    #: idempotency key went to ``ingest_batches_spill`` (``ingest_batches`` was locked).
    rollups_owed: int = 0
    rollups_folded: int = 0
    keys_spilled: int = 0
    #: Postgres store: peeks that a held table stopped (their loads answered from the
    #: stored facts, and the new observations waited); consolidations that a lock wait
    #: kept out (a held table, or the identity's checkpoint row past ``lock_timeout``;
    #: a load's also counts in ``load_errors``). See "Tables held" in the README.
    peeks_held_out: int = 0
    consolidations_held_out: int = 0
    #: Postgres store: facts dropped from those kept between requests to make room for
    #: other identities' (``known_facts``); while it grows, this process serves more
    #: facts than it keeps. Requests that read an identity's facts from the database
    #: because none were kept at their current version: its first request in this
    #: process, a write by another process, or its facts dropped. See "Facts kept
    #: between requests" in the README.
    kept_facts_dropped: int = 0
    facts_reads: int = 0
