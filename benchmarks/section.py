"""What a section of the benchmark is, and what it is given."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from benchmarks.pgbench import PgbenchResult
from benchmarks.report import Report
from benchmarks.server import Server
from benchmarks.sizes import Sizes
from benchmarks.workloads import Database


@dataclass(frozen=True)
class Context:
    """What every section is given: the sizes, the report it adds to, the pgbench
    baselines taken at the start, the server, and the instant the run's data is generated around."""

    sizes: Sizes
    report: Report
    one: PgbenchResult
    eight: PgbenchResult
    base: datetime
    server: Server


@dataclass(frozen=True)
class Section:
    """One section of the benchmark: a measurement on one of the run's databases.

    ``selected_by`` lists the ``--only`` names that run it (the table-size scaling loads
    the data set analytics measures, so either name runs it)."""

    name: str
    title: str
    database: Literal["main", "big"]
    run: Callable[[Database, Context], Awaitable[None]]
    selected_by: frozenset[str]
