"""The sizes of a run: full and quick."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """An identity profile: stored facts, then new observations over some sessions."""

    name: str
    facts: int
    new: int
    sessions: int
    identities: int


@dataclass(frozen=True)
class Sizes:
    mode: str
    pgbench_seconds: int
    profiles: tuple[Profile, ...]
    load_identities: int
    throughput_identities: int
    throughput_facts: int
    throughput_new: int
    workers: int
    ingest_rows: int
    naive_rows: int
    emit_calls: int
    memory_emits: int
    #: (facts per identity, identities measured) for the facts-per-identity scaling.
    fact_levels: tuple[tuple[int, int], ...]
    #: Observation-table sizes for the table-size scaling; the last one is the analytics
    #: data set's observation count.
    table_levels: tuple[int, ...]
    table_identities: int
    analytics_identities: int
    analytics_facts: int
    #: The host-shaped run: identities x facts, requests with 8 and with 1 in flight.
    host_identities: int
    host_facts: int
    host_requests: int
    host_sequential_requests: int
    host_concurrency: int
    #: Typical load_memory with 50 new observations: identities measured; then
    #: identities that also have a long consumed history (observations each).
    typical_load_identities: int
    history_identities: int
    history_observations: int
    #: The noisy neighbour's facts, and the other identities' measured loads.
    neighbour_facts: int
    neighbour_loads: int
    #: Facts of the identities far over the cap (one size after the other).
    cap_facts: tuple[int, ...]
    #: Seconds each table is held ACCESS EXCLUSIVE in the lock-isolation section.
    lock_seconds: float
    #: Fresh services started in the cold-start section (10 requests each).
    cold_starts: int
    #: Rounds of ``host_requests`` in the long run, before the tables are rewritten.
    long_run_rounds: int
    #: Requests one at a time after each round of the long run (its probe).
    long_run_probe: int
    #: Facts per identity at which a request's cost is measured, and requests at each.
    facts_cost_levels: tuple[int, ...]
    facts_cost_requests: int


FULL = Sizes(
    mode="full",
    pgbench_seconds=10,
    profiles=(
        Profile("small", facts=10, new=5, sessions=1, identities=500),
        Profile("typical", facts=200, new=50, sessions=5, identities=500),
        Profile("heavy", facts=2_000, new=1_000, sessions=20, identities=30),
    ),
    load_identities=500,
    throughput_identities=10_000,
    throughput_facts=20,
    throughput_new=3,
    workers=8,
    ingest_rows=200_000,
    naive_rows=10_000,
    emit_calls=1_000_000,
    memory_emits=1_000_000,
    fact_levels=((10, 40), (100, 40), (1_000, 20), (10_000, 6)),
    table_levels=(100_000, 1_000_000, 10_000_000),
    table_identities=40,
    analytics_identities=100_000,
    analytics_facts=1_000_000,
    host_identities=200,
    host_facts=200,
    host_requests=1_600,
    host_sequential_requests=400,
    host_concurrency=8,
    typical_load_identities=200,
    history_identities=60,
    history_observations=10_000,
    neighbour_facts=30_000,
    neighbour_loads=200,
    cap_facts=(150_000, 400_000),
    lock_seconds=10.0,
    cold_starts=5,
    long_run_rounds=12,
    long_run_probe=200,
    facts_cost_levels=(100, 200, 400),
    facts_cost_requests=400,
)

QUICK = Sizes(
    mode="quick",
    pgbench_seconds=3,
    profiles=(
        Profile("small", facts=10, new=5, sessions=1, identities=60),
        Profile("typical", facts=200, new=50, sessions=5, identities=60),
        Profile("heavy", facts=2_000, new=1_000, sessions=20, identities=4),
    ),
    load_identities=60,
    throughput_identities=1_000,
    throughput_facts=20,
    throughput_new=3,
    workers=8,
    ingest_rows=30_000,
    naive_rows=2_000,
    emit_calls=200_000,
    memory_emits=300_000,
    fact_levels=((10, 10), (100, 10), (1_000, 6), (10_000, 2)),
    table_levels=(10_000, 100_000, 1_000_000),
    table_identities=10,
    analytics_identities=10_000,
    analytics_facts=100_000,
    host_identities=200,
    host_facts=200,
    host_requests=400,
    host_sequential_requests=100,
    host_concurrency=8,
    typical_load_identities=60,
    history_identities=20,
    history_observations=2_000,
    neighbour_facts=30_000,
    neighbour_loads=60,
    cap_facts=(60_000,),
    lock_seconds=2.0,
    cold_starts=2,
    long_run_rounds=3,
    long_run_probe=50,
    facts_cost_levels=(100, 200, 400),
    facts_cost_requests=100,
)
