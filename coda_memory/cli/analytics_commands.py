"""``coda-memory analytics``: cross-user tables, JSON, CSV and charts."""

from __future__ import annotations

import csv
import functools
import inspect
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.table import Table

from coda_memory.cli.app import (
    AnalyticsFormat,
    LockWaitOption,
    PlotOption,
    SchemaOption,
    UrlOption,
    analytics_app,
)
from coda_memory.cli.demo import plots
from coda_memory.cli.output import (
    add_row,
    checked_plot_path,
    csv_cell,
    draw_plot,
    dump,
    fmt_count,
    fmt_number,
    fmt_percent,
    make_console,
    new_table,
    note,
    print_json,
)
from coda_memory.cli.runtime import (
    DEFAULT_LOCK_WAIT,
    StoreOptions,
    fail,
    parse_duration,
    run_on_store,
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
    typer.Option(
        "--min-users",
        min=1,
        max=analytics.MAX_COUNT,
        help="Leave out rows behind fewer users (k-anonymity).",
    ),
]
AnalyticsFormatOption = Annotated[
    AnalyticsFormat, typer.Option("--format", "-f", help="Output format.")
]


@dataclass(frozen=True)
class AnalyticsQuery:
    """The options every analytics command takes."""

    #: ``--since``, of the commands over a time window (None for the others).
    since: str | None
    min_users: int
    output: AnalyticsFormat
    plot: Path | None
    lock_wait: str
    url: str | None
    schema: str

    def window(self) -> timedelta:
        """``--since`` as a timedelta, or a one-line usage error (before any database
        work): a positive duration of at most 100 years."""
        assert self.since is not None, "a command without --since has no window"
        window = parse_duration(self.since, "--since", at_most=analytics.MAX_WINDOW)
        if window % timedelta(days=1):
            fail(
                f"invalid duration {self.since!r} for --since: analytics count whole UTC "
                "days, so give a number of days or weeks (e.g. 30d, 2w)",
                2,
            )
        return window

    def at_least(self) -> str:
        """``--min-users`` for titles: "at least 5 users"."""
        return f"at least {self.min_users} user{'' if self.min_users == 1 else 's'}"


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


#: The shared options, in the order ``--help`` lists them: the command's own options go
#: between the leading and the trailing ones.
_LEADING = (_option("since", SinceOption, "30d"), _option("min_users", MinUsersOption, 5))
_TRAILING = (
    _option("output", AnalyticsFormatOption, AnalyticsFormat.TABLE),
    _option("plot", PlotOption, None),
    _option("lock_wait", LockWaitOption, DEFAULT_LOCK_WAIT),
    _option("url", UrlOption, None),
    _option("schema", SchemaOption, DEFAULT_SCHEMA),
)


def analytics_command(
    name: str, *, windowed: bool = True
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``command(query, **own_options)`` as ``coda-memory analytics NAME`` with the
    shared options (without ``--since`` unless ``windowed``) around its own."""

    def register(command: Callable[..., None]) -> Callable[..., None]:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in list(inspect.signature(command, eval_str=True).parameters.values())[1:]
        ]
        leading = _LEADING if windowed else _LEADING[1:]
        shared = {p.name for p in (*leading, *_TRAILING)}

        @functools.wraps(command)
        def cli(**options: Any) -> None:
            query = AnalyticsQuery(
                since=options.pop("since", None),
                **{key: options.pop(key) for key in shared - {"since"}},
            )
            command(query, **options)

        parameters = [*leading, *own, *_TRAILING]
        cli.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        cli.__annotations__ = {p.name: p.annotation for p in parameters}
        analytics_app.command(name)(cli)
        return cli

    return register


_Columns = Sequence[tuple[str, str, Callable[[Any], str]]]


def _analytics(
    fetch: Callable[[PostgresStore], Coroutine[Any, Any, Sequence[BaseModel]]],
    query: AnalyticsQuery,
    *,
    model: type[BaseModel],
    title: str,
    columns: _Columns | Callable[[Sequence[Any]], Table],
    draw: Callable[[Sequence[Any], Path], Path],
    caption: str | None = None,
) -> None:
    plot, output = query.plot, query.output

    def prepare() -> StoreOptions:
        checked_plot_path(plot)
        # An analyst's role reads the aggregate views, not every identity's rows.
        # It only reads: a statement_timeout that a DBA set on the role still applies.
        return StoreOptions(across=False, reads_only=True)

    rows = run_on_store(
        query.url,
        query.schema,
        lambda store, _: fetch(store),
        prepare=prepare,
        lock_wait=query.lock_wait,
    )
    if plot is not None and not rows:
        note(f"no rows: no chart written to {plot}")
    elif plot is not None:
        draw_plot(lambda: draw(rows, plot))
    if output is AnalyticsFormat.JSON:
        print_json(dump(rows))
    elif output is AnalyticsFormat.CSV:
        _print_csv(rows, model)
    elif not rows:
        longer = "a longer --since or " if query.since is not None else ""
        typer.echo(
            f"{title}: no rows (try {longer}a lower --min-users; an analyst role sees no "
            "group below the database's floor, analytics_floor.min_users)"
        )
    elif callable(columns):
        make_console().print(columns(rows))
    else:
        table = new_table(title, [(header, justify) for header, justify, _ in columns])
        table.caption = caption
        for row in rows:
            add_row(table, *(cell(row) for _, _, cell in columns))
        make_console().print(table)


def _bucket_columns(key: str, buckets: int) -> list[str]:
    """A histogram's columns, one per bucket: ``histogram_0.0_0.1``, …"""
    width = 1 / buckets
    return [f"{key}_{i * width:.1f}_{(i + 1) * width:.1f}" for i in range(buckets)]


def _csv_columns(model: type[BaseModel]) -> list[str]:
    """The CSV's header: the model's fields, a histogram's as one column per bucket."""
    columns: list[str] = []
    for name, field in model.model_fields.items():
        if field.annotation == list[int | None]:  # (None: a bucket under the floor)
            columns += _bucket_columns(name, analytics.HISTOGRAM_BUCKETS)
        else:
            columns.append(name)
    return columns


def _print_csv(rows: Sequence[BaseModel], model: type[BaseModel]) -> None:
    """The rows as CSV, with the header even when there are none."""
    flat: list[dict[str, Any]] = []
    for record in dump(rows):
        item: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, list):  # a histogram: one column per bucket
                cells = ["" if v is None else csv_cell(v) for v in value]
                item.update(zip(_bucket_columns(key, len(value)), cells, strict=True))
            else:
                item[key] = "" if value is None else csv_cell(value)
        flat.append(item)
    writer = csv.DictWriter(sys.stdout, fieldnames=_csv_columns(model), lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)


def _sparkline(buckets: Sequence[int | None]) -> str:
    """One bar per bucket; ``?`` for one withheld (fewer facts than the database's floor)."""
    bars = "▁▂▃▄▅▆▇█"
    peak = max((c for c in buckets if c is not None), default=0)
    return "".join(
        "?" if c is None else "·" if c == 0 else bars[min(7, (c * 8 - 1) // peak)] for c in buckets
    )


def _tool_columns() -> _Columns:
    def calls(r: ToolEffectiveness) -> str:
        return str(r.successes + r.failures)

    def latency(r: ToolEffectiveness) -> str:
        return f"{fmt_number(r.p50_duration_ms, 0)}/{fmt_number(r.p95_duration_ms, 0)}"

    def with_mean(users: int | None, mean: float | None) -> str:
        # (No count: fewer identities than the database's floor, for an analyst role.)
        return f"{fmt_count(users)} ({fmt_number(mean)})"

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


@analytics_command("tools")
def analytics_tools(query: AnalyticsQuery) -> None:
    """Per tool: users, success rate, latency, and how many users prefer or avoid it."""
    window = query.window()
    title = f"Tool effectiveness (last {query.since}, {query.at_least()})"
    _analytics(
        lambda store: analytics.tool_effectiveness(store, since=window, min_users=query.min_users),
        query,
        model=analytics.ToolEffectiveness,
        title=title,
        columns=_tool_columns(),
        caption="affinity, avoidance: users whose memory holds a tool_affinity or "
        "tool_avoidance fact for the tool (their mean confidence)",
        draw=lambda rows, path: plots.plot_tool_effectiveness(rows, path, title=title),
    )


@analytics_command("entities")
def analytics_entities(
    query: AnalyticsQuery,
    limit: Annotated[
        int,
        typer.Option("--limit", min=1, max=analytics.MAX_COUNT, help="At most this many rows."),
    ] = 100,
) -> None:
    """The entities most users work with: accesses, and users with a fact about them."""
    window = query.window()
    title = f"Entity popularity (last {query.since}, {query.at_least()})"
    columns: list[tuple[str, str, Callable[[EntityPopularity], str]]] = [
        ("entity type", "left", lambda r: r.entity_type),
        ("entity id", "left", lambda r: r.entity_id),
        ("users", "right", lambda r: str(r.users)),
        ("accesses", "right", lambda r: str(r.accesses)),
        ("users with fact", "right", lambda r: fmt_count(r.fact_users)),
        ("mean confidence", "right", lambda r: fmt_number(r.mean_confidence)),
    ]
    _analytics(
        lambda store: analytics.entity_popularity(
            store, since=window, min_users=query.min_users, limit=limit
        ),
        query,
        model=analytics.EntityPopularity,
        title=title,
        columns=columns,
        draw=lambda rows, path: plots.plot_entity_popularity(rows, path, title=title),
    )


@analytics_command("domains")
def analytics_domains(query: AnalyticsQuery) -> None:
    """Queries per day and domain (royalty, contract, …), with how many users asked."""
    window = query.window()
    title = f"Domain trends (last {query.since}, {query.at_least()})"
    _analytics(
        lambda store: analytics.domain_trends(store, since=window, min_users=query.min_users),
        query,
        model=analytics.DomainTrend,
        title=title,
        columns=lambda rows: _domain_table(rows, title),
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


@analytics_command("facts", windowed=False)
def analytics_facts(query: AnalyticsQuery) -> None:
    """Active facts per category: how many, for how many users, and how confident."""
    title = f"Facts by category ({query.at_least()})"
    columns: list[tuple[str, str, Callable[[FactSummary], str]]] = [
        ("category", "left", lambda r: r.category),
        ("facts", "right", lambda r: str(r.facts)),
        ("users", "right", lambda r: str(r.users)),
        ("mean confidence", "right", lambda r: fmt_number(r.mean_confidence)),
        ("confidence 0 → 1", "left", lambda r: _sparkline(r.histogram)),
    ]
    _analytics(
        lambda store: analytics.fact_summary(store, min_users=query.min_users),
        query,
        model=analytics.FactSummary,
        title=title,
        columns=columns,
        draw=lambda rows, path: plots.plot_fact_summary(rows, path, title=title),
    )
