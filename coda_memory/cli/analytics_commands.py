"""``coda-memory analytics``: cross-user tables, JSON, CSV and charts."""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.table import Table

from coda_memory.cli.app import (
    AnalyticsFormat,
    PlotOption,
    SchemaOption,
    UrlOption,
    analytics_app,
)
from coda_memory.cli.demo import plots
from coda_memory.cli.output import (
    add_row,
    checked_plot_path,
    draw_plot_or_exit,
    dump,
    fmt_number,
    fmt_percent,
    make_console,
    new_table,
    print_json,
)
from coda_memory.cli.runtime import (
    CliError,
    fail,
    open_store,
    parse_duration,
    resolve_target,
    run,
)
from coda_memory.postgres import analytics
from coda_memory.postgres.analytics import (
    DomainTrend,
    EntityPopularity,
    FactSummary,
    ToolEffectiveness,
)
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore

SinceOption = Annotated[str, typer.Option("--since", help="How far back to look, e.g. 30d.")]
MinUsersOption = Annotated[
    int,
    typer.Option("--min-users", min=1, help="Leave out rows behind fewer users (k-anonymity)."),
]
AnalyticsFormatOption = Annotated[
    AnalyticsFormat, typer.Option("--format", "-f", help="Output format.")
]

_Columns = Sequence[tuple[str, str, Callable[[Any], str]]]


def _analytics(
    fetch: Callable[[PostgresStore], Coroutine[Any, Any, Sequence[BaseModel]]],
    *,
    url: str | None,
    schema: str,
    output: AnalyticsFormat,
    title: str,
    columns: _Columns | Callable[[Sequence[Any]], Table],
    plot: Path | None,
    draw: Callable[[Sequence[Any], Path], Path],
    caption: str | None = None,
) -> None:
    async def main() -> Sequence[BaseModel]:
        target = resolve_target(url, schema)
        checked_plot_path(plot)
        async with open_store(target) as store:
            return await fetch(store)

    rows = run(main, schema)
    if plot is not None:
        draw_plot_or_exit(lambda: draw(rows, plot))
    if output is AnalyticsFormat.JSON:
        print_json(dump(rows))
    elif output is AnalyticsFormat.CSV:
        _print_csv(rows)
    elif not rows:
        typer.echo(f"{title}: no rows (try a longer --since or a lower --min-users)")
    elif callable(columns):
        make_console().print(columns(rows))
    else:
        table = new_table(title, [(header, justify) for header, justify, _ in columns])
        table.caption = caption
        for row in rows:
            add_row(table, *(cell(row) for _, _, cell in columns))
        make_console().print(table)


def _at_least(min_users: int) -> str:
    return f"at least {min_users} user{'' if min_users == 1 else 's'}"


def _print_csv(rows: Sequence[BaseModel]) -> None:
    records = dump(rows)
    if not records:
        return
    flat: list[dict[str, Any]] = []
    for record in records:
        item: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, list):  # a histogram: one column per bucket
                width = 1 / len(value) if value else 1
                for i, count in enumerate(value):
                    item[f"{key}_{i * width:.1f}_{(i + 1) * width:.1f}"] = count
            else:
                item[key] = "" if value is None else value
        flat.append(item)
    writer = csv.DictWriter(sys.stdout, fieldnames=list(flat[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)


def _window(since: str) -> timedelta:
    """``--since`` as a timedelta, or a one-line usage error."""
    try:
        return parse_duration(since, "--since")
    except CliError as exc:
        fail(str(exc), exc.code)


def _sparkline(counts: Sequence[int]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    peak = max(counts, default=0)
    if peak == 0:
        return "·" * len(counts)
    return "".join("·" if c == 0 else bars[min(7, (c * 8 - 1) // peak)] for c in counts)


def _tool_columns() -> _Columns:
    def calls(r: ToolEffectiveness) -> str:
        return str(r.successes + r.failures)

    def latency(r: ToolEffectiveness) -> str:
        return f"{fmt_number(r.p50_duration_ms, 0)}/{fmt_number(r.p95_duration_ms, 0)}"

    def with_mean(users: int, mean: float | None) -> str:
        return f"{users} ({fmt_number(mean)})"

    return [
        ("tool", "left", lambda r: r.tool_name),
        ("users", "right", lambda r: str(r.users)),
        ("calls", "right", calls),
        ("success", "right", lambda r: fmt_percent(r.success_rate)),
        ("p50/p95 ms", "right", latency),
        ("affinity", "right", lambda r: with_mean(r.affinity_users, r.mean_affinity_confidence)),
        (
            "avoidance",
            "right",
            lambda r: with_mean(r.avoidance_users, r.mean_avoidance_confidence),
        ),
    ]


@analytics_app.command("tools")
def analytics_tools(
    since: SinceOption = "30d",
    min_users: MinUsersOption = 5,
    output: AnalyticsFormatOption = AnalyticsFormat.TABLE,
    plot: PlotOption = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Per tool: users, success rate, latency, and how many users prefer or avoid it."""
    window = _window(since)
    title = f"Tool effectiveness (last {since}, {_at_least(min_users)})"
    _analytics(
        lambda store: analytics.tool_effectiveness(store, since=window, min_users=min_users),
        url=url,
        schema=schema,
        output=output,
        title=title,
        columns=_tool_columns(),
        caption="affinity, avoidance: users whose memory holds a tool_affinity or "
        "tool_avoidance fact for the tool (their mean confidence)",
        plot=plot,
        draw=lambda rows, path: plots.plot_tool_effectiveness(rows, path, title=title),
    )


@analytics_app.command("entities")
def analytics_entities(
    since: SinceOption = "30d",
    min_users: MinUsersOption = 5,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many rows.")] = 100,
    output: AnalyticsFormatOption = AnalyticsFormat.TABLE,
    plot: PlotOption = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """The entities most users work with: accesses, and users with a fact about them."""
    window = _window(since)
    title = f"Entity popularity (last {since}, {_at_least(min_users)})"
    columns: list[tuple[str, str, Callable[[EntityPopularity], str]]] = [
        ("entity type", "left", lambda r: r.entity_type),
        ("entity id", "left", lambda r: r.entity_id),
        ("users", "right", lambda r: str(r.users)),
        ("accesses", "right", lambda r: str(r.accesses)),
        ("users with fact", "right", lambda r: str(r.fact_users)),
        ("mean confidence", "right", lambda r: fmt_number(r.mean_confidence)),
    ]
    _analytics(
        lambda store: analytics.entity_popularity(
            store, since=window, min_users=min_users, limit=limit
        ),
        url=url,
        schema=schema,
        output=output,
        title=title,
        columns=columns,
        plot=plot,
        draw=lambda rows, path: plots.plot_entity_popularity(rows, path, title=title),
    )


@analytics_app.command("domains")
def analytics_domains(
    since: SinceOption = "30d",
    min_users: MinUsersOption = 5,
    output: AnalyticsFormatOption = AnalyticsFormat.TABLE,
    plot: PlotOption = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Queries per day and domain (royalty, contract, …), with how many users asked."""
    window = _window(since)
    title = f"Domain trends (last {since}, {_at_least(min_users)})"
    _analytics(
        lambda store: analytics.domain_trends(store, since=window, min_users=min_users),
        url=url,
        schema=schema,
        output=output,
        title=title,
        columns=lambda rows: _domain_table(rows, title),
        plot=plot,
        draw=lambda rows, path: plots.plot_domain_trends(rows, path, title=title),
    )


def _domain_table(rows: Sequence[DomainTrend], title: str) -> Table:
    """One row per day, one column per domain: "queries (users)"."""
    domains = sorted({r.domain for r in rows})
    cells = {(r.day, r.domain): f"{r.queries} ({r.users})" for r in rows}
    table = new_table(
        f"{title}: queries (users) per day",
        [("day", "left"), *((domain, "right") for domain in domains)],
    )
    for day in sorted({r.day for r in rows}):
        add_row(table, day.isoformat(), *(cells.get((day, d), "") for d in domains))
    return table


@analytics_app.command("facts")
def analytics_facts(
    min_users: MinUsersOption = 5,
    output: AnalyticsFormatOption = AnalyticsFormat.TABLE,
    plot: PlotOption = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Active facts per category: how many, for how many users, and how confident."""
    title = f"Facts by category ({_at_least(min_users)})"
    columns: list[tuple[str, str, Callable[[FactSummary], str]]] = [
        ("category", "left", lambda r: r.category),
        ("facts", "right", lambda r: str(r.facts)),
        ("users", "right", lambda r: str(r.users)),
        ("mean confidence", "right", lambda r: fmt_number(r.mean_confidence)),
        ("confidence 0 → 1", "left", lambda r: _sparkline(r.histogram)),
    ]
    _analytics(
        lambda store: analytics.fact_summary(store, min_users=min_users),
        url=url,
        schema=schema,
        output=output,
        title=title,
        columns=columns,
        plot=plot,
        draw=lambda rows, path: plots.plot_fact_summary(rows, path, title=title),
    )
