"""5. Analytics views and functions on the large data set, with their plans."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from sqlalchemy import event

from benchmarks.bulk import fill_facts
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.workloads import CORE_TABLES, SCHEMA, Database
from coda_memory.postgres import PostgresStore, analytics

#: An analytics function: a store in, rows out.
StoreQuery = Callable[[PostgresStore], Awaitable[Sequence[Any]]]

#: The functions of :mod:`coda_memory.postgres.analytics` measured on the data set: each
#: takes a store and nothing else required.
FUNCTIONS: tuple[tuple[str, StoreQuery], ...] = (
    ("domain_trends", analytics.domain_trends),
    ("entity_popularity", analytics.entity_popularity),
    ("fact_summary", analytics.fact_summary),
    ("tool_effectiveness", analytics.tool_effectiveness),
)


async def rebuild_rollups(url: str) -> None:
    """Fill the rollup tables from the bulk-loaded observations (COPY bypasses
    ``append``, which otherwise writes them)."""
    store = PostgresStore.from_url(url)
    try:
        await analytics.rebuild_rollups(store)
    finally:
        await store.close()


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


async def analyse(
    conn: Any, sql: str, args: Sequence[Any], rollups: set[str], *, fetch: bool = True
) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, FORMAT JSON), then the client's time to fetch the whole answer
    (median of three, or one run above 100,000 rows)."""
    raw = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *args)
    explained = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    nodes = list(plan_nodes(explained["Plan"]))
    relations = {str(n["Relation Name"]) for n in nodes if "Relation Name" in n}
    kinds = sorted({str(n["Node Type"]) for n in nodes})
    rows = int(explained["Plan"].get("Actual Rows", 0))
    timings: list[float] = []
    for _ in range((1 if rows > 100_000 else 3) if fetch else 0):
        start = time.perf_counter()
        rows = len(await conn.fetch(sql, *args))
        timings.append(time.perf_counter() - start)
    return {
        "execution_ms": float(explained.get("Execution Time", math.nan)),
        "planning_ms": float(explained.get("Planning Time", math.nan)),
        "client_ms": statistics.median(timings) * 1000 if timings else math.nan,
        "rows": rows,
        "node_types": kinds,
        "relations": sorted(relations),
        "uses_index": any("Index" in k for k in kinds),
        "uses_rollups": bool(relations & rollups),
        "seq_scans": sorted(
            str(n.get("Relation Name")) for n in nodes if n["Node Type"] == "Seq Scan"
        ),
    }


async def analytics_queries(conn: Any, sample_identity: str) -> list[tuple[str, str, list[Any]]]:
    """(label, SQL, arguments) for every analytics view the library declares
    (``analytics.VIEWS``): all of it, and for a view with an ``identity_id`` column also
    one identity. A declared view missing from the database fails the run."""
    columns = await conn.fetch(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = $1 AND table_name = ANY($2::text[])",
        SCHEMA,
        list(analytics.VIEWS),
    )
    by_view: dict[str, set[str]] = {}
    for record in columns:
        by_view.setdefault(record["table_name"], set()).add(record["column_name"])
    missing = sorted(set(analytics.VIEWS) - by_view.keys())
    if missing:
        raise RuntimeError(f"analytics views missing from the database: {', '.join(missing)}")
    queries: list[tuple[str, str, list[Any]]] = []
    for view in sorted(analytics.VIEWS):
        qualified = f'"{SCHEMA}"."{view}"'
        queries.append((view, f"SELECT * FROM {qualified}", []))
        if "identity_id" in by_view[view]:
            queries.append(
                (
                    f"{view} (one identity)",
                    f"SELECT * FROM {qualified} WHERE identity_id = $1",
                    [sample_identity],
                )
            )
    return queries


async def analytics_section(big: Database, ctx: Context) -> None:
    sizes, report = ctx.sizes, ctx.report
    tables = {
        r["table_name"]
        for r in await big.conn.fetch(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = $1 AND table_type = 'BASE TABLE'",
            SCHEMA,
        )
    }
    rollups = tables - CORE_TABLES
    start = time.perf_counter()
    await fill_facts(big.conn, sizes.analytics_identities, sizes.analytics_facts, ctx.base)
    await big.conn.execute("VACUUM ANALYZE")
    report.timings["analytics_facts_and_vacuum_s"] = time.perf_counter() - start
    start = time.perf_counter()
    await rebuild_rollups(big.url)
    await big.conn.execute("ANALYZE")
    rebuild = time.perf_counter() - start
    report.add(Figure("5 analytics", "rebuild_rollups (all rollups)", rebuild * 1000, "ms"))
    counts = {
        table: int(await big.conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.{table}"))
        for table in ("observations", "facts", "fact_events", "checkpoints")
    }
    report.tables["analytics_data"] = [{"table": t, "rows": n} for t, n in counts.items()]
    await big.conn.execute("SET statement_timeout = '300s'")
    baseline = await analyse(big.conn, f"SELECT count(*) FROM {SCHEMA}.observations", [], rollups)
    queries = await analytics_queries(big.conn, "u000042")
    rows: list[dict[str, Any]] = []
    measured: list[tuple[str, Awaitable[dict[str, Any]]]] = [
        (f"view {label}", analyse(big.conn, sql, args, rollups)) for label, sql, args in queries
    ]
    store = big.service.store
    assert isinstance(store, PostgresStore)
    measured += [
        (f"{name}(store)", time_function(function, store, big.conn, rollups))
        for name, function in FUNCTIONS
    ]
    for label, pending in measured:
        try:
            result = await pending
        except Exception as error:  # one broken view must not hide the others
            report.note(f"analytics: {label} failed: {error!r}")
            continue
        rows.append({"query": label, **result})
        report.add(
            Figure(
                "5 analytics",
                label,
                result["client_ms"],
                "ms",
                baseline["client_ms"],
                "count(*) of observations",
                result["client_ms"] / baseline["client_ms"],
                "< 500 ms",
                result["client_ms"] < 500,
                result,
            )
        )
    report.tables["analytics"] = rows


async def time_function(
    function: StoreQuery,
    store: PostgresStore,
    conn: Any,
    rollups: set[str],
) -> dict[str, Any]:
    """Median time of ``function(store)`` (defaults for everything else) over three calls
    after a warm-up, and the plan of the query it sent (EXPLAIN ANALYZE of the captured
    statement with its parameters; the views' settings default to the same window)."""
    captured: list[tuple[str, Any]] = []

    def capture(*args: Any) -> None:
        statement, parameters = args[2], args[3]
        if "set_config" not in statement:
            captured.append((statement, parameters))

    engine = store.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        answer = await function(store)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    timings: list[float] = []
    for _ in range(3):
        start = time.perf_counter()
        await function(store)
        timings.append(time.perf_counter() - start)
    result: dict[str, Any] = {"client_ms": statistics.median(timings) * 1000, "rows": len(answer)}
    if captured:
        statement, parameters = captured[-1]
        explained = await analyse(conn, statement, list(parameters or ()), rollups, fetch=False)
        result.update({k: v for k, v in explained.items() if k not in ("client_ms", "rows")})
    return result


SECTION = Section(
    name="analytics",
    title="analytics",
    database="big",
    run=analytics_section,
    selected_by=frozenset({"analytics"}),
)
