"""Commands about one identity: facts, prompt, history, forget, and the label of its log
lines."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Literal

import typer
from rich.table import Table
from rich.text import Text

from coda_memory.cli.app import (
    LOG_KEY_VARIABLE,
    DecayName,
    DecayOption,
    FormatOption,
    IdentityArgument,
    LockWaitOption,
    OutputFormat,
    PlotOption,
    SchemaOption,
    UrlOption,
    app,
    checked_identity,
    checked_subject,
    decay_strategy,
)
from coda_memory.cli.output import (
    add_row,
    checked_plot_path,
    draw_plot,
    dump,
    fmt_number,
    fmt_time,
    make_console,
    new_table,
    note,
    print_json,
    printable,
)
from coda_memory.cli.runtime import (
    DEFAULT_LOCK_WAIT,
    CliError,
    StoreOptions,
    Target,
    fail,
    require_identity,
    require_revision,
    require_writable,
    run_on_store,
)
from coda_memory.core.logs import identity_label
from coda_memory.core.model import Fact, FactEvent, FactEventKind
from coda_memory.core.prompt import format_memory_section
from coda_memory.ports import Forgotten
from coda_memory.postgres import maintenance
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore
from coda_memory.service import MemoryService


def _reads_only() -> StoreOptions:
    """The store of a command that only reads: the role's statement_timeout applies."""
    return StoreOptions(reads_only=True)


@app.command()
def facts(
    identity: IdentityArgument,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    decay: DecayOption = DecayName.EXPONENTIAL,
    output: FormatOption = OutputFormat.TABLE,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
) -> None:
    """The identity's active facts, with their confidence now."""

    async def work(store: PostgresStore, target: Target) -> tuple[list[Fact], int]:
        await require_identity(store, identity)
        service = MemoryService(store, decay=decay_strategy(decay))
        return await service.facts(identity), await maintenance.pending_observations(
            store, identity
        )

    active, pending = run_on_store(url, schema, work, prepare=_reads_only, lock_wait=lock_wait)
    if output is OutputFormat.JSON:
        print_json(dump(active))
        return
    ranked = sorted(active, key=lambda f: (-f.confidence, f.subject))
    console = make_console()
    # On a narrow terminal the content goes under the subject, and the category (the
    # subject's prefix) goes.
    wide = console.width >= 140
    columns = [("subject", "left"), ("category", "left")] if wide else [("subject", "left")]
    columns += [("confidence", "right"), ("reinforced", "right"), ("last reinforced", "left")]
    table = new_table(f"Facts of {identity!r} (confidence now)", [*columns, ("content", "left")])
    if not wide:
        table.columns.pop()
        table.columns[0].header = "subject / content"
    for fact in ranked:
        numbers = [
            fmt_number(fact.confidence),
            str(fact.reinforcement_count),
            fmt_time(fact.last_reinforced_at),
        ]
        if wide:
            add_row(table, fact.subject, fact.category.value, *numbers, fact.content)
        else:
            cell = Text(printable(fact.subject))
            cell.append("\n" + printable(fact.content), style="dim")
            add_row(table, cell, *numbers)
    if ranked:
        console.print(table)
    else:
        typer.echo(f"{identity!r} has no active facts")
    if pending:
        note(f"{pending} observations are not consolidated yet: coda-memory consolidate …")


@app.command()
def prompt(
    identity: IdentityArgument,
    budget: Annotated[int, typer.Option("--budget", min=1, help="Token budget.")] = 300,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    decay: DecayOption = DecayName.EXPONENTIAL,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
) -> None:
    """The memory section the agent gets in its system prompt, exactly (no consolidation)."""

    async def work(store: PostgresStore, target: Target) -> tuple[str, int]:
        await require_identity(store, identity)
        service = MemoryService(store, decay=decay_strategy(decay))
        facts = await service.facts(identity)
        return format_memory_section(facts, budget), len(facts)

    section, facts = run_on_store(url, schema, work, prepare=_reads_only, lock_wait=lock_wait)
    if section:
        typer.echo(section)
    elif facts:
        note(
            f"{identity!r} has {facts} active fact{'' if facts == 1 else 's'}, but a budget of "
            f"{budget} tokens holds not even the section's framing: the memory section is empty"
        )
    else:
        note(f"{identity!r} has no active facts: the memory section is empty")


@app.command()
def history(
    identity: IdentityArgument,
    subject: Annotated[
        str | None,
        typer.Argument(
            help="One fact's subject, e.g. tool_affinity:run_sql.", callback=checked_subject
        ),
    ] = None,
    plot: PlotOption = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    decay: DecayOption = DecayName.EXPONENTIAL,
    output: FormatOption = OutputFormat.TABLE,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
) -> None:
    """Why the facts exist: every create, reinforce, extend and expire, in order.

    With --plot (and a SUBJECT), draw the fact's confidence over time.
    """
    if plot is not None and subject is None:
        fail("--plot needs a SUBJECT (one fact)", 2)

    async def work(store: PostgresStore, target: Target) -> list[FactEvent]:
        await require_identity(store, identity)
        events = await store.history(identity, subject)
        if subject is not None and not events:
            raise CliError(f"unknown subject for {identity!r}: {subject!r}")
        return events

    def prepare() -> StoreOptions:
        checked_plot_path(plot)
        return StoreOptions(reads_only=True)

    events = run_on_store(url, schema, work, prepare=prepare, lock_wait=lock_wait)
    if plot is not None:
        from coda_memory.cli.demo.plots import plot_fact_history

        draw_plot(
            lambda: plot_fact_history(
                events,
                decay_strategy(decay),
                plot,
                until=datetime.now(UTC),
                title=f"{subject} for {identity!r}",
            )
        )
    if output is OutputFormat.JSON:
        print_json(dump(events))
        return
    if not events:
        typer.echo(f"{identity!r} has no fact history")
        return
    threshold = decay_strategy(decay).expiry_threshold
    make_console().print(_history_table(identity, subject, events, threshold))


def _change(before: float | None, after: float | None, digits: int = 2) -> str:
    return f"{fmt_number(before, digits)} → {fmt_number(after, digits)}"


def _history_table(
    identity: str, subject: str | None, events: Sequence[FactEvent], threshold: float
) -> Table:
    columns = [("time (UTC)", "left"), ("event", "left")]
    if subject is None:
        columns.append(("subject", "left"))
    columns += [
        ("session", "left"),
        ("confidence", "left"),
        ("count", "left"),
        ("quality", "right"),
    ]
    title = f"History of {subject} for {identity!r}" if subject else f"History of {identity!r}"
    table = new_table(title, columns)
    for event in events:
        quality = (
            ""
            if event.kind is FactEventKind.EXPIRED or event.quality is None
            else f"{event.quality:.2f} ({event.hits}/{event.trials})"
        )
        cells = [fmt_time(event.at), event.kind.value]
        if subject is None:
            cells.append(event.subject)
        count = f"{event.count_before or '-'} → {event.count_after or '-'}"
        # An expiry is dated when the confidence crossed the threshold; its recorded
        # confidence is the one the consolidation that noticed it computed, later.
        change = (
            f"fell below {threshold:g}"
            if event.kind is FactEventKind.EXPIRED
            else _change(event.confidence_before, event.confidence_after)
        )
        cells += [event.session_id or "", change, count, quality]
        add_row(table, *cells)
    return table


@app.command()
def forget(
    identity: IdentityArgument,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    if_exists: Annotated[
        bool,
        typer.Option(
            "--if-exists",
            help="An identity with nothing stored is not an error (exit 0): for erasure "
            "lists run again after an interruption.",
        ),
    ] = False,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Erase everything about an identity: observations, facts, history, checkpoint, its
    own rollup rows, owed rollups and import ledger, and its place in the distinct-user
    counts (the call, query and access counts stay)."""
    if not yes and not stdin_is_interactive():
        fail("refusing to forget without confirmation: stdin is not a terminal; pass --yes", 2)

    async def work(
        store: PostgresStore, target: Target
    ) -> Forgotten | Literal["absent", "declined"]:
        # It erases the identity's owed rollups too (migrations 0006 and 0008).
        await require_revision(store, target, "forget", "0008")
        await require_writable(store)
        if not await maintenance.identity_anywhere(store, identity):
            if if_exists:
                return "absent"
            raise CliError(f"unknown identity: {identity!r}")
        question = (
            f"Erase every observation, fact, fact event, checkpoint and rollup row of "
            f"{identity!r} in {target.display} (schema {target.schema})?"
        )
        if not yes and not typer.confirm(question, default=False):
            return "declined"
        return await store.forget(identity)

    forgotten = run_on_store(url, schema, work, lock_wait=lock_wait)
    if forgotten == "absent":
        typer.echo(f"nothing to forget: {identity!r} has nothing stored")
    elif forgotten == "declined":
        fail("not confirmed: nothing was erased")
    else:
        typer.echo(
            f"forgot {identity!r}: {forgotten.observations:,} observations, "
            f"{forgotten.facts:,} facts, {forgotten.fact_events:,} fact events"
        )


def stdin_is_interactive() -> bool:
    """True when a person can answer a confirmation prompt."""
    return sys.stdin is not None and sys.stdin.isatty()


def _checked_identities(values: list[str]) -> list[str]:
    for value in values:
        checked_identity(value)
    return values


@app.command()
def label(
    identities: Annotated[
        list[str],
        typer.Argument(help="The identity (user) ids.", callback=_checked_identities),
    ],
) -> None:
    """Print the label that log lines give each identity (id:<12 hex digits>), under the
    key in $CODA_MEMORY_LOG_KEY: the services' key (set_log_key), to find a user's lines."""
    if not os.environ.get(LOG_KEY_VARIABLE):
        raise CliError(
            f"${LOG_KEY_VARIABLE} is not set: give it the key the services pass to "
            "set_log_key() (without one, a process labels identities under a random key "
            "of its own, and no label made here would match a log line)",
            code=2,
        )
    for identity in identities:
        # Escaped: a tab or a line break would break the lines' format, and an escape
        # sequence reach the terminal.
        typer.echo(f"{identity_label(identity)}\t{printable(identity)}")
