"""``coda-memory replay``: how well memory predicts the next session, on an events file or
on the observations a deployment has stored."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from coda_memory.cli.app import (
    FormatOption,
    OutputFormat,
    PlotOption,
    SchemaOption,
    UrlOption,
    app,
)
from coda_memory.cli.output import (
    add_row,
    checked_plot_path,
    draw_plot,
    make_console,
    new_table,
    note,
)
from coda_memory.cli.runtime import (
    CliError,
    StoreOptions,
    Target,
    check_database_url,
    describe,
    fail,
    run,
    run_on_store,
)
from coda_memory.core.logs import masked_url
from coda_memory.core.model import MAX_SPAN
from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name
from coda_memory.postgres.store import PostgresStore
from coda_memory.replay import (
    Event,
    StoreNotScratch,
    build_timeline,
    observation_event,
    plot_reliability,
    read_events,
)
from coda_memory.replay.report import HEADER, rows, values
from coda_memory.replay.suite import Comparison, compare
from coda_memory.replay.tuning import FAMILIES
from coda_memory.stores import REDIS_SCHEMES, SCHEMES, checked_scheme, shown_scheme


def _stored_events(url: str | None, schema: str) -> list[Event]:
    async def work(store: PostgresStore, target: Target) -> list[Event]:
        observations = await store.every_observation()
        return [e for o in observations if (e := observation_event(o)) is not None]

    return run_on_store(url, schema, work, prepare=lambda: StoreOptions(reads_only=True))


def _check_redis_store(url: str) -> None:
    """A usage error, before any event is read, for a Redis URL that redis-py would read
    wrongly or refuse (it failed with exit 1 once every event was read). Without the
    redis extra, making the store says that it is needed."""
    try:
        from coda_memory.redis.urls import check_redis_url  # (the package needs redis-py)
    except ModuleNotFoundError:
        return
    try:
        check_redis_url(url)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--store") from None


def _file_events(path: Path) -> list[Event]:
    try:
        return read_events(path)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc


@app.command()
def replay(
    events: Annotated[
        Path | None,
        typer.Option(
            "--events",
            help="An events file (.jsonl or .csv: identity, time, kind, subject[, session]). "
            "Without it, the observations stored in the database are replayed.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
    store: Annotated[
        str,
        typer.Option(
            "--store",
            help=(
                "The store the replay writes to: memory:// or an empty schema, database"
                " or prefix; never the live one."
            ),
        ),
    ] = "memory://",
    store_schema: Annotated[
        str | None,
        typer.Option(
            "--store-schema",
            help="The schema of a Postgres --store (default: coda_memory): a migrated, empty "
            "one; --schema names the schema the observations are read from.",
        ),
    ] = None,
    split: Annotated[
        float,
        typer.Option("--split", help="Share of the timeline to fit on; the rest is held out."),
    ] = 0.7,
    horizon: Annotated[
        float, typer.Option("--horizon-days", help="Calibration: used again within N days.")
    ] = 30.0,
    sample: Annotated[
        int | None,
        typer.Option("--sample", min=1, help="Score this many identities, drawn at random."),
    ] = None,
    min_sessions: Annotated[
        int,
        typer.Option(
            "--min-sessions", min=1, help="Score only identities with this many sessions."
        ),
    ] = 2,
    tune: Annotated[
        bool, typer.Option("--tune", help="Also search each strategy's constants on the fit.")
    ] = False,
    plot: PlotOption = None,
    output: FormatOption = OutputFormat.TABLE,
) -> None:
    """Replay events through a MemoryService with a simulated clock and score every decay
    strategy against the baselines: hit@5 and NDCG@10 of the next session, Brier score and
    log-loss of confidence, facts held. Figures are on the held-out period."""
    if not 0.0 < split < 1.0:
        raise typer.BadParameter("--split must be between 0 and 1")
    if not 0.0 < horizon <= MAX_SPAN.days:
        raise typer.BadParameter(
            f"--horizon-days must be a positive number of days, at most {MAX_SPAN.days:,}"
        )
    checked_plot_path(plot)
    # Before the events are read (a long file, or the database's observations).
    try:
        scheme = checked_scheme(store)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--store") from None
    if scheme == "null":
        raise typer.BadParameter(
            "null:// keeps nothing: the replay would score nothing", param_hint="--store"
        )
    if scheme not in SCHEMES:
        raise typer.BadParameter(
            f"unsupported memory URL scheme ({shown_scheme(store)}): use memory://, "
            "postgresql://… or redis://…",
            param_hint="--store",
        )
    store_options: dict[str, Any] = {}
    if scheme in ("postgresql", "postgres"):
        try:  # what the driver would refuse only on connecting, after every event was read
            check_database_url(store)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--store") from None
        if store_schema is not None:
            try:
                store_options["schema"] = validate_schema_name(store_schema)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--store-schema") from None
    elif store_schema is not None:
        raise typer.BadParameter(
            "only a Postgres --store has a schema (a Redis one takes ?prefix=)",
            param_hint="--store-schema",
        )
    elif scheme in REDIS_SCHEMES:
        _check_redis_store(store)
    stream = _file_events(events) if events is not None else _stored_events(url, schema)
    if not stream:
        fail("no events to replay")
    try:
        timeline = build_timeline(
            stream, split=split, horizon_days=horizon, sample=sample, min_sessions=min_sessions
        )
    except ValueError as exc:
        fail(str(exc))

    async def main() -> Comparison:
        try:
            return await compare(
                timeline, families=FAMILIES, tuned=tune, url=store, **store_options
            )
        except StoreNotScratch as exc:  # the command line named the wrong store: usage
            raise CliError(f"--store: {exc}", code=2) from exc
        except ValueError as exc:
            raise CliError(str(exc)) from exc
        except Exception as exc:  # the events are read: what fails now is the store
            raise CliError(
                f"the replay's store {masked_url(store)} failed: {describe(exc)}"
            ) from exc

    comparison = run(main)
    # The held-out sessions scored (not an identity's first, which nothing predicts).
    held_out = comparison.baselines[0].test.ranking.sessions
    if output is OutputFormat.JSON:
        table = values(comparison.results())
        typer.echo(
            json.dumps(
                {
                    "events": len(stream),
                    "sessions": len(timeline.sessions),
                    "held_out_sessions": held_out,
                    "split_at": timeline.split_at.isoformat(),
                    "scored_identities": len(timeline.scored),
                    "results": [dict(zip(HEADER, row, strict=True)) for row in table],
                    "presets": [
                        {"strategy": s, "constants": c, "better_held_out": b}
                        for s, c, b in comparison.presets()
                    ],
                },
                indent=2,
            )
        )
    else:
        title = (
            f"{len(stream):,} events, {len(timeline.sessions):,} sessions; "
            f"{len(timeline.scored):,} identities scored; held out from "
            f"{timeline.split_at:%Y-%m-%d}"
        )
        listing = new_table(
            title, [(h, "left" if i == 0 else "right") for i, h in enumerate(HEADER)]
        )
        for row in rows(comparison.results()):
            add_row(listing, *row)
        make_console().print(listing)
        for strategy, constants, better in comparison.presets():
            verdict = "better" if better else "not better"
            note(f"tuned {strategy} ({constants}): {verdict} than the seed's on held-out NDCG@10")
    if plot is not None:
        target = plot

        def draw() -> Path:
            try:
                plot_reliability(comparison.results(), target)
            except ImportError as exc:
                raise CliError(
                    "plots need the plot extra: pip install 'coda-memory[plot]'"
                ) from exc
            return target

        draw_plot(draw)
    # The sessions calibrated are those scored: not an identity's first, nor an unscored
    # identity's.
    firsts: dict[str, object] = {}
    for session in timeline.sessions:
        firsts.setdefault(session.identity, session)
    if math.isnan(comparison.baselines[0].test.ranking.hit_at_5):
        note("no session was scored in the held-out period (too few sessions per identity?)")
    elif not any(
        timeline.held_out(s) and timeline.seen_through_horizon(s) and s is not firsts[s.identity]
        for s in timeline.sessions
        if s.identity in timeline.scored
    ):
        note(
            f"no held-out session scored starts {horizon:g} days (--horizon-days) before the "
            "events end, so nothing is calibrated: give a shorter horizon, or more days"
        )
