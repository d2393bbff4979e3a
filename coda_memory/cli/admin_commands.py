"""Commands over the whole store: migrate, demo, consolidate, prune, stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer

from coda_memory.cli.app import (
    DecayName,
    DecayOption,
    FormatOption,
    LockWaitOption,
    OutputFormat,
    SchemaOption,
    UrlOption,
    app,
    checked_identity,
    decay_strategy,
)
from coda_memory.cli.output import (
    add_row,
    fmt_bytes,
    identities_progress,
    make_console,
    new_table,
    note,
    print_json,
)
from coda_memory.cli.runtime import (
    BUSY_EXIT_CODE,
    DEFAULT_LOCK_WAIT,
    CliError,
    StoreOptions,
    Target,
    check_reachable,
    checked_schema,
    describe,
    fail,
    head_label,
    parse_duration,
    require_identity,
    require_revision,
    require_writable,
    resolve_target,
    run,
    run_on_store,
)
from coda_memory.errors import SchemaNotMigrated, StoreBusy
from coda_memory.postgres import maintenance
from coda_memory.postgres.connection import INSUFFICIENT_PRIVILEGE, LOCK_NOT_AVAILABLE, sqlstate
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore
from coda_memory.service import MAX_DURATION, MemoryService


@app.command()
def migrate(
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    sql: Annotated[
        bool,
        typer.Option(
            "--sql",
            help="Print the DDL that creates the schema from scratch (or, with --from, "
            "upgrades it), for review, without connecting to any database.",
        ),
    ] = False,
    start: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="REVISION",
            help="With --sql: the DDL that upgrades a schema at this revision (what "
            "'coda-memory migrate' or 'stats' printed for it, such as 0017) to head.",
        ),
    ] = None,
) -> None:
    """Create or upgrade coda-memory's tables, then print the schema's revision."""
    if start is not None and not sql:
        fail("--from goes with --sql (the DDL of an upgrade, for review)", 2)
    if sql:
        from coda_memory.postgres.migrate import migration_sql, revisions

        if start is not None and start not in (known := revisions()):
            # (Alembic's own messages for "", "a:b" and the like are a traceback or a
            # word about unpacking.)
            fail(
                f"--from {start!r}: not a revision of this coda-memory ({known[0]} to {known[-1]})",
                2,
            )
        text = migration_sql(schema=checked_schema(schema), start=start)
        typer.echo(text, nl=False)
        if schema == "public" and start is None:  # (from a revision: it is there already)
            _note_public_version_table()
        return

    async def work(store: PostgresStore, target: Target) -> str | None:
        from coda_memory.postgres.migrate import migrate_async

        try:
            await migrate_async(target.url, schema=target.schema)
        except Exception as exc:
            if sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
                raise
            # (The hint every other command gives, about analysts and grants, misleads.)
            raise CliError(
                f"{describe(exc, target.schema)} (migrate creates the schema, its tables and "
                "their policies: run it as the role that is to own them, one with CREATE on "
                "the database or the schema's owner; then coda-memory grant app ROLE gives "
                "the service's role what it needs)"
            ) from exc
        return await maintenance.schema_revision(store)

    revision = run_on_store(url, schema, work, prepare=lambda: StoreOptions(migrated=False))
    typer.echo(f"schema {schema} is at revision {revision} ({head_label(revision)})")


def _note_public_version_table() -> None:
    """Offline there is no search path to ask (see the migrations' env.py), but public is
    on every role's by default: a DBA who runs the DDL should know what ``migrate`` would
    have refused."""
    note(
        "note: this DDL creates coda-memory's Alembic version table in public, where a host "
        "application's Alembic looks for its own (its first upgrade would then fail on a "
        "revision it does not know); coda-memory migrate refuses a first migration there: "
        "use a schema of coda-memory's own"
    )


@app.command()
def demo(
    url: UrlOption = None,
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the demo's charts.", file_okay=False)
    ] = Path("coda-memory-demo"),
    days: Annotated[
        int, typer.Option("--days", min=1, max=120, hidden=True, help="Simulated days.")
    ] = 30,
) -> None:
    """A simulated month of agent sessions with memory at work (a fresh schema each run)."""
    from coda_memory.cli.demo.demo import DEMO_SCHEMA, run_demo

    started = time.perf_counter()
    try:  # before the month is simulated, not after: a directory it cannot write
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot write {out}: {exc.strerror or type(exc).__name__}", param_hint="--out"
        ) from None
    console = make_console()
    if not console.is_terminal:
        console.width = 100  # piped to a file: the width the output is written for

    async def main() -> None:
        target = resolve_target(url, DEMO_SCHEMA, announce=False)
        await check_reachable(target)
        await run_demo(target, out=out, days=days, console=console, started=started)

    run(main, DEMO_SCHEMA)


@app.command()
def consolidate(
    identity: Annotated[
        str | None,
        typer.Argument(help="The identity to consolidate (or --all).", callback=checked_identity),
    ] = None,
    all_identities: Annotated[
        bool, typer.Option("--all", help="Every identity with pending observations.")
    ] = False,
    workers: Annotated[
        int, typer.Option("--workers", "-w", min=1, max=64, help="Concurrent consolidations.")
    ] = 4,
    lock_wait: Annotated[
        str,
        typer.Option(
            "--lock-wait",
            help="How long to wait for an identity that live traffic is consolidating "
            "before retrying (3 attempts, then it is reported as busy), and for a table "
            "that another transaction holds locked.",
        ),
    ] = "5s",
    retention: Annotated[
        str, typer.Option("--retention", help="Keep consumed observations this long.")
    ] = "7d",
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    decay: DecayOption = DecayName.EXPONENTIAL,
) -> None:
    """Consolidate pending observations into facts, now.

    Each identity is consolidated atomically and idempotently, exactly as load_memory
    does, so this is safe beside live traffic and resumable: after an interruption,
    run it again and it carries on with what is still pending. An identity that live
    traffic is consolidating holds a row lock; this waits for it (--lock-wait), retries,
    and reports the identity as busy if it is still locked. Exit 1 if any identity failed,
    else 3 if any was busy (nothing is lost: run it again later), else 0.
    """
    if (identity is None) == (not all_identities):
        fail("give either an IDENTITY or --all", 2)

    keep = timedelta()

    def prepare() -> StoreOptions:
        nonlocal keep
        keep = parse_duration(retention, "--retention", at_most=MAX_DURATION)
        return StoreOptions(pool_size=workers)

    async def work(store: PostgresStore, target: Target) -> _Summary:
        await require_writable(store)
        service = MemoryService(store, decay=decay_strategy(decay), retention=keep)
        if identity is not None:
            await require_identity(store, identity)
            identities = [identity]
        else:
            with make_console(stderr=True).status("finding identities with pending observations"):
                identities = await maintenance.pending_identities(store)
        try:
            summary = await _consolidate_each(service, identities, workers, target.schema)
            if summary.consolidated:
                # Durable before the run reports them: they commit asynchronously.
                await maintenance.settle_consolidations(store)
            return summary
        finally:
            await service.close()

    summary = run_on_store(url, schema, work, prepare=prepare, lock_wait=lock_wait)
    _print_summary(summary, all_identities)
    if summary.failed:
        raise typer.Exit(1)
    if summary.busy:
        raise typer.Exit(BUSY_EXIT_CODE)


@dataclass
class _Summary:
    identities: int
    consolidated: int = 0
    facts: int = 0
    busy: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    #: A table missing from the schema: every identity would fail the same way.
    missing: SchemaNotMigrated | None = None


def _is_lock_timeout(exc: BaseException) -> bool:
    # StoreBusy: a table held past the lock wait kept the consolidation's first read out
    # (see "Tables held" in the README), and it consolidated nothing.
    return isinstance(exc, StoreBusy) or sqlstate(exc) == LOCK_NOT_AVAILABLE


async def _consolidate_each(
    service: MemoryService, identities: Sequence[str], workers: int, schema: str
) -> _Summary:
    summary = _Summary(identities=len(identities))
    if not identities:
        return summary
    queue = iter(identities)
    progress = identities_progress("consolidating")
    task = progress.add_task("consolidating", total=len(identities))

    async def worker() -> None:
        for identity_id in queue:  # one iterator shared by the workers
            if summary.missing is not None:
                return
            for attempt in range(3):
                try:
                    facts = await service.consolidate(identity_id)
                except SchemaNotMigrated as exc:
                    summary.missing = exc
                except Exception as exc:
                    if _is_lock_timeout(exc) and attempt < 2:
                        continue
                    if _is_lock_timeout(exc):
                        summary.busy.append(identity_id)
                    else:
                        summary.failed.append((identity_id, describe(exc, schema)))
                else:
                    summary.consolidated += 1
                    summary.facts += len(facts)
                break
            progress.advance(task)

    with progress:
        await asyncio.gather(*(worker() for _ in range(min(workers, len(identities)))))
    if summary.missing is not None:
        raise summary.missing
    return summary


def _print_summary(summary: _Summary, all_identities: bool) -> None:
    if all_identities and summary.identities == 0:
        typer.echo("nothing to consolidate: no identity has pending observations")
        return
    busy, failed = summary.busy, summary.failed
    typer.echo(
        f"consolidated {summary.consolidated} of {summary.identities} identities: "
        f"{summary.facts} active facts, {len(failed)} failed, {len(busy)} busy"
    )
    for identity_id in busy[:10]:
        typer.echo(f"  busy (still locked by live traffic, rerun later): {identity_id!r}", err=True)
    if len(busy) > 10:
        typer.echo(f"  … and {len(busy) - 10} more busy", err=True)
    for identity_id, reason in failed[:10]:
        typer.echo(f"  failed: {identity_id!r}: {reason}", err=True)
    if len(failed) > 10:
        typer.echo(f"  … and {len(failed) - 10} more failures", err=True)


@app.command()
def prune(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Delete consumed observations older than this.")
    ] = "7d",
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, max=10_000, help="Identities per transaction.")
    ] = 100,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Delete old observations that consolidation has already consumed.

    Rollups owed by appends that met a locked rollup table are folded first.
    Observations not yet consolidated are never deleted, however old (nor those whose
    rollup is still owed). Identities are
    pruned in batches of their own short transactions; an identity being consolidated
    at that moment is skipped (its consolidation prunes it anyway).
    """

    age = timedelta()

    def prepare() -> None:
        nonlocal age
        age = parse_duration(older_than, "--older-than")

    async def work(store: PostgresStore, target: Target) -> maintenance.PruneOutcome:
        # It folds the owed rollups first (migrations 0006 and 0008).
        await require_revision(store, target, "prune", "0008")
        await require_writable(store)
        total = await maintenance.count_checkpointed(store)
        progress = identities_progress("pruning")
        task = progress.add_task("pruning", total=total)
        with progress:
            return await maintenance.prune_consolidated(
                store,
                before=datetime.now(UTC) - age,
                batch_size=batch_size,
                on_batch=lambda visited, _: progress.advance(task, visited),
            )

    outcome = run_on_store(url, schema, work, prepare=prepare, lock_wait=lock_wait)
    busy = f", {outcome.busy} busy (skipped)" if outcome.busy else ""
    if outcome.owed_folded:
        typer.echo(f"folded {outcome.owed_folded} owed rollups first")
    typer.echo(
        f"pruned {outcome.deleted} consolidated observations older than {older_than} "
        f"({outcome.identities} identities{busy})"
    )


@app.command()
def stats(
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    output: FormatOption = OutputFormat.TABLE,
    lock_wait: LockWaitOption = DEFAULT_LOCK_WAIT,
) -> None:
    """Identities, observations (and how many are pending), facts, events, sizes."""

    result = run_on_store(
        url,
        schema,
        lambda store, _: maintenance.store_stats(store),
        prepare=lambda: StoreOptions(reads_only=True),
        lock_wait=lock_wait,
    )
    if output is OutputFormat.JSON:
        print_json(result.model_dump(mode="json"))
        return
    table = new_table(f"coda-memory in schema {result.schema_name}", [("", "left"), ("", "right")])
    table.show_header = False
    add_row(table, "schema revision", f"{result.revision} ({head_label(result.revision)})")
    add_row(table, "identities", f"{result.identities:,}")
    add_row(table, "observations", f"{result.observations:,}")
    add_row(table, "  pending (not consolidated)", f"{result.pending_observations:,}")
    add_row(table, "facts", f"{result.facts:,}")
    add_row(table, "fact events", f"{result.fact_events:,}")
    for name, size in result.table_bytes.items():
        add_row(table, f"size of {name}", fmt_bytes(size))
    make_console().print(table)
