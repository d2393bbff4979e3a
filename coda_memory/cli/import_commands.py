"""``coda-memory import-redis``: from the original Redis deployment to Postgres."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from coda_memory.cli.app import FormatOption, OutputFormat, SchemaOption, UrlOption, app
from coda_memory.cli.output import (
    add_row,
    identities_progress,
    make_console,
    new_table,
    note,
    print_json,
    printable,
)
from coda_memory.cli.runtime import (
    BUSY_EXIT_CODE,
    CliError,
    open_store,
    require_head,
    resolve_target,
    run,
)
from coda_memory.core.logs import masked_url
from coda_memory.postgres.schema import DEFAULT_SCHEMA

if TYPE_CHECKING:  # (imported when the command runs: the CLI starts without it)
    from coda_memory.migration import ImportSummary

#: Bad records listed one by one; past this many, the rest are only counted.
_LISTED_BAD = 50


def _checked_redis_url(redis_url: str) -> None:
    """A usage error for what redis-py would take and read wrongly or refuse vaguely
    (:func:`~coda_memory.redis.urls.check_redis_url`)."""
    from coda_memory.redis.urls import check_redis_url  # (the package needs redis-py)

    try:
        check_redis_url(redis_url)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None


def _checked_prefix(prefix: str) -> None:
    """A usage error for a key prefix that the import ledger, which keeps it as text,
    cannot hold (a NUL character, or bytes that are not UTF-8): the run, its dry run
    too, failed on it as if the store had, naming the driver's error."""
    if "\x00" in prefix or any("\ud800" <= c <= "\udfff" for c in prefix):
        raise CliError(
            f"invalid key prefix {printable(repr(prefix))} (--prefix, or the Redis URL's "
            "?prefix=): the import ledger keeps it as UTF-8 text, without NUL",
            code=2,
        )


@app.command("import-redis")
def import_redis(
    redis_url: Annotated[
        str, typer.Argument(help="The original deployment's Redis (redis://host:port/db).")
    ],
    prefix: Annotated[
        str | None,
        typer.Option(
            "--prefix",
            help="The key prefix the original server used (default: the URL's ?prefix=, "
            "else coda:memory:).",
        ),
    ] = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Read and validate Redis; write nothing.")
    ] = False,
    output: FormatOption = OutputFormat.TABLE,
) -> None:
    """Copy every identity's observations, facts and checkpoint from Redis into Postgres.

    One transaction per identity; a second run copies nothing, and a run stopped half-way
    resumes where it was. Observations the Redis checkpoint had consumed arrive consumed.
    Dates more than 5 minutes in the future are copied as now, and counted. Bad records are
    counted and listed by key, and never stop the copy.
    """
    try:
        from coda_memory.migration import IMPORT_SOCKET_TIMEOUT, ImportSummary
        from coda_memory.migration import import_redis as copy_all
        from coda_memory.redis import RedisStore
    except ModuleNotFoundError as missing:
        if missing.name != "redis":
            raise
        raise CliError(
            "import-redis needs the redis extra: pip install 'coda-memory[cli,redis]'"
        ) from None

    _checked_redis_url(redis_url)

    async def main() -> ImportSummary:
        try:
            source = RedisStore.from_url(
                redis_url, prefix=prefix, socket_timeout=IMPORT_SOCKET_TIMEOUT
            )
        except ValueError as exc:  # its message may hold the password: not shown
            raise CliError(
                f"invalid Redis URL {masked_url(redis_url)} (a password holding /, #, ? or @ "
                "must be percent-encoded)",
                code=2,
            ) from exc
        try:
            _checked_prefix(source.keys.prefix)
            try:
                await source.client.ping()
            except Exception as exc:
                raise CliError(
                    f"cannot connect to Redis at {masked_url(redis_url)}: {exc}"
                ) from exc
            progress = identities_progress("checking" if dry_run else "copying")
            task = progress.add_task("import", total=None)

            def advance(identity: str, done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            if dry_run:
                if url is not None:
                    # The target too, so that the dry run finds what would stop the real
                    # one before it begins: a server it cannot reach, a schema not
                    # migrated, a role that cannot see every identity's rows.
                    checked = resolve_target(url, schema)
                    async with open_store(checked) as store:
                        await require_head(store, checked, "import-redis")
                with progress:
                    return await copy_all(
                        source, None, now=_now, on_identity=advance, summary=partial
                    )
            target = resolve_target(url, schema)
            async with open_store(target) as store:
                await require_head(store, target, "import-redis")
                with progress:
                    return await copy_all(
                        source, store, now=_now, on_identity=advance, summary=partial
                    )
        except BaseException:
            # The identities copied before the store failed (or Ctrl-C) are in the
            # ledger: the next run skips them, and only counts their bad records.
            _list_bad(partial.bad, stderr=True)
            raise
        finally:
            await source.close()

    partial = ImportSummary()
    summary = run(main, schema)
    if summary.identities == 0:
        # A prefix without its closing ':' or the wrong database finds nothing, and a
        # copy of nothing looked like success.
        note(
            f"no identity found under the key prefix {printable(repr(summary.prefix))} in "
            f"{masked_url(redis_url)}: check --prefix (or the URL's ?prefix=) and the "
            "database number"
        )
    if output is OutputFormat.JSON:
        print_json(
            {
                "dry_run": dry_run,
                **{k: getattr(summary, k) for k in _COUNTS},
                "bad_records": [{"key": key, "reason": reason} for key, reason in summary.bad],
                "bad_records_earlier": summary.bad_earlier,
                "busy": summary.busy,
                "failed": summary.failed,
            }
        )
        _exit_for(summary)
        return
    title = "import-redis (dry run: nothing written)" if dry_run else "import-redis"
    table = new_table(title, [("", "left"), ("", "right")])
    table.show_header = False
    labels = {
        "identities": "identities in Redis",
        "copied": "identities checked" if dry_run else "identities copied",
        "skipped": "identities the ledger lists as copied from this prefix (skipped)",
        "observations": "observations",
        "consumed_observations": "  of which consumed by the Redis checkpoint",
        "facts": "facts",
        "fact_events": "fact events",
        "checkpoints": "checkpoints",
        "future_clamped": "records dated in the future (copied as now)",
    }
    for key, label in labels.items():
        add_row(table, label, f"{getattr(summary, key):,}")
    add_row(table, "bad records (left out)", f"{len(summary.bad):,}")
    if summary.bad_earlier:
        label = "bad records left out by earlier runs (--dry-run lists them)"
        add_row(table, label, f"{summary.bad_earlier:,}")
    add_row(table, "identities busy (not copied: run it again)", f"{len(summary.busy):,}")
    make_console().print(table)
    _list_bad(summary.bad)
    if summary.failed:
        # Left out whole: listed among the bad records as <prefix>*:<identity>.
        typer.echo(
            f"{len(summary.failed):,} identities left out whole (see the bad records "
            "above); the next run tries them again",
            err=True,
        )
    if summary.busy:
        shown = ", ".join(printable(label) for label in summary.busy[:_LISTED_BAD])
        more = (
            f" … and {len(summary.busy) - _LISTED_BAD:,} more"
            if len(summary.busy) > _LISTED_BAD
            else ""
        )
        typer.echo(
            f"busy (locked by live traffic; the next run copies them): {shown}{more}", err=True
        )
    _exit_for(summary)


def _exit_for(summary: ImportSummary) -> None:
    """Exit 1 when an identity was left out whole, else 3 when one was left busy."""
    if summary.failed:
        raise typer.Exit(1)
    if summary.busy:
        raise typer.Exit(BUSY_EXIT_CODE)


def _list_bad(bad: list[tuple[str, str]], *, stderr: bool = False) -> None:
    """The bad records, by key with the reason (the first :data:`_LISTED_BAD`)."""
    console = make_console(stderr=stderr)
    for key, reason in bad[:_LISTED_BAD]:
        console.print(
            f"bad record: {printable(key)}: {printable(reason)}", markup=False, highlight=False
        )
    if len(bad) > _LISTED_BAD:
        console.print(f"… and {len(bad) - _LISTED_BAD:,} more (see --format json)")


_COUNTS = (
    "identities",
    "copied",
    "skipped",
    "observations",
    "consumed_observations",
    "facts",
    "fact_events",
    "checkpoints",
    "future_clamped",
)


def _now() -> datetime:
    return datetime.now(UTC)
