"""Every section of the benchmark, in the order a run measures them.

A section module defines ``SECTION`` and is listed here; ``tests/unit/test_benchmarks.py``
checks that every module of this package is.
"""

from benchmarks.section import Section
from benchmarks.sections import (
    analytics,
    cold_start,
    consolidation,
    facts_cost,
    far_over_cap,
    host,
    ingest,
    load,
    locks,
    long_run,
    neighbour,
    redis_store,
    replay,
    scaling_facts,
    scaling_table,
    tenancy,
    throughput,
    typical_load,
)

SECTIONS: tuple[Section, ...] = (
    consolidation.SECTION,
    load.SECTION,
    redis_store.SECTION,
    throughput.SECTION,
    ingest.SECTION,
    scaling_facts.SECTION,
    scaling_table.SECTION,
    analytics.SECTION,
    tenancy.SECTION,
    host.SECTION,
    typical_load.SECTION,
    replay.SECTION,
    neighbour.SECTION,
    locks.SECTION,
    cold_start.SECTION,
    far_over_cap.SECTION,
    long_run.SECTION,
    facts_cost.SECTION,
)

#: The names ``--only`` accepts.
OPTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(option for section in SECTIONS for option in sorted(section.selected_by))
)

__all__ = ["OPTIONS", "SECTIONS", "Section"]
