"""Analytics: the usage rollup, fact indexes for aggregation, and the analytics views.

The rollup tables are backfilled from the observations already stored, so an upgrade
loses no history. The views read the rollup and the facts, never the raw observations;
``coda_memory.postgres.rollup`` describes the rollup and ``coda_memory.postgres.analytics``
the views.

Deploy order: upgrade, then run the new code. Observations that the old code commits
after the backfill's snapshot are stored but not rolled up.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"

#: Created CONCURRENTLY: the facts table of a live database may be large and busy.
FACT_INDEXES = {
    "ix_facts_category_subject": ["category", "subject"],
    "ix_facts_category_identity_id": ["category", "identity_id"],
}
FACT_INDEX_INCLUDE = ["confidence", "confidence_at", "ease_factor"]

#: Views, in dependency order.
VIEWS = (
    "analytics_window",
    "active_facts",
    "tool_effectiveness",
    "entity_popularity",
    "domain_trends",
    "fact_summary",
)
TABLES = (
    "tool_daily",
    "tool_durations",
    "tool_users",
    "entity_daily",
    "entity_users",
    "domain_daily",
    "domain_users",
)

# The rollup's duration histogram (coda_memory.postgres.rollup): bucket 0 is below
# 1 ms, then 4 buckets per doubling, capped at 127.
BUCKETS_PER_DOUBLING = 4
MAX_BUCKET = 127
MAX_KEY_CHARS = 200
#: The default decay (ExponentialDecay and AdaptiveDecay): base and expiry threshold.
DECAY_BASE = 0.95
EXPIRY_THRESHOLD = 0.1
HISTOGRAM_BUCKETS = 10

if TYPE_CHECKING:
    Query = sa.Select[*tuple[Any, ...]]


class _CreateView(ExecutableDDLElement):
    """``CREATE VIEW name AS query``; names are translated like any table's."""

    inherit_cache = False

    def __init__(self, view: sa.Table, query: Query) -> None:
        self.view = view
        self.query = query


class _CommentOnView(ExecutableDDLElement):
    """``COMMENT ON VIEW name IS 'text'``; the text is a constant of this migration."""

    inherit_cache = False

    def __init__(self, view: sa.Table, comment: str) -> None:
        self.view = view
        self.comment = comment


class _DropView(ExecutableDDLElement):
    """``DROP VIEW IF EXISTS name``."""

    inherit_cache = False

    def __init__(self, view: sa.Table) -> None:
        self.view = view


@compiles(_CreateView)
def _compile_create_view(element: _CreateView, compiler: Any, **kw: Any) -> str:
    query = compiler.sql_compiler.process(element.query, literal_binds=True)
    return f"CREATE VIEW {compiler.preparer.format_table(element.view)} AS {query}"


@compiles(_CommentOnView)
def _compile_comment(element: _CommentOnView, compiler: Any, **kw: Any) -> str:
    comment = compiler.sql_compiler.render_literal_value(element.comment, sa.String())
    return f"COMMENT ON VIEW {compiler.preparer.format_table(element.view)} IS {comment}"


@compiles(_DropView)
def _compile_drop_view(element: _DropView, compiler: Any, **kw: Any) -> str:
    return f"DROP VIEW IF EXISTS {compiler.preparer.format_table(element.view)}"


def _timestamp(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def _existing_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """The 0001 tables, as far as this migration reads them."""
    observations = sa.Table(
        "observations",
        metadata,
        sa.Column("identity_id", sa.Text()),
        sa.Column("type", sa.Text()),
        sa.Column("metadata", postgresql.JSONB()),
        _timestamp("created_at"),
        schema=SCHEMA,
    )
    facts = sa.Table(
        "facts",
        metadata,
        sa.Column("identity_id", sa.Text()),
        sa.Column("subject", sa.Text()),
        sa.Column("category", sa.Text()),
        sa.Column("content", sa.Text()),
        sa.Column("confidence", sa.Double()),
        sa.Column("reinforcement_count", sa.Integer()),
        _timestamp("last_reinforced_at"),
        _timestamp("confidence_at"),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.Column("ease_factor", sa.Double()),
        schema=SCHEMA,
    )
    return observations, facts


def _day(name: str = "day") -> sa.Column[Any]:
    return sa.Column(name, sa.Date(), nullable=False)


def _count(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.BigInteger(), nullable=False)


def _key(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.Text(), nullable=False)


def _shard() -> sa.Column[Any]:
    return sa.Column("shard", sa.SmallInteger(), nullable=False)


def _create_tables() -> dict[str, sa.Table]:
    # New and empty: their primary keys are built inside the transaction.
    def pk(name: str, *columns: str) -> sa.PrimaryKeyConstraint:
        return sa.PrimaryKeyConstraint(*columns, name=op.f(f"pk_{name}"))

    created = [
        op.create_table(
            "tool_daily",
            _day(),
            _key("tool_name"),
            _shard(),
            _count("successes"),
            _count("failures"),
            _count("latest_users"),
            pk("tool_daily", "day", "tool_name", "shard"),
            schema=SCHEMA,
        ),
        op.create_table(
            "tool_durations",
            _day(),
            _key("tool_name"),
            _shard(),
            sa.Column("bucket", sa.SmallInteger(), nullable=False),
            _count("calls"),
            pk("tool_durations", "day", "tool_name", "shard", "bucket"),
            schema=SCHEMA,
        ),
        op.create_table(
            "tool_users",
            _key("identity_id"),
            _key("tool_name"),
            _day("last_day"),
            sa.Column("previous_day", sa.Date(), nullable=True),
            pk("tool_users", "identity_id", "tool_name"),
            schema=SCHEMA,
        ),
        op.create_table(
            "entity_daily",
            _day(),
            _key("entity_type"),
            _key("entity_id"),
            _count("accesses"),
            _count("latest_users"),
            pk("entity_daily", "day", "entity_type", "entity_id"),
            schema=SCHEMA,
        ),
        op.create_table(
            "entity_users",
            _key("identity_id"),
            _key("entity_type"),
            _key("entity_id"),
            _day("last_day"),
            sa.Column("previous_day", sa.Date(), nullable=True),
            pk("entity_users", "identity_id", "entity_type", "entity_id"),
            schema=SCHEMA,
        ),
        op.create_table(
            "domain_daily",
            _day(),
            _key("domain"),
            _shard(),
            _count("queries"),
            _count("users"),
            pk("domain_daily", "day", "domain", "shard"),
            schema=SCHEMA,
        ),
        op.create_table(
            "domain_users",
            _key("identity_id"),
            _key("domain"),
            _day(),
            pk("domain_users", "identity_id", "domain", "day"),
            schema=SCHEMA,
        ),
    ]
    return {table.name: table for table in created}


# --- Backfill -------------------------------------------------------------------------


def _observed(
    observations: sa.Table, types: Sequence[str], extra: Sequence[Any] = (), **keys: Any
) -> Any:
    """Stored observations of ``types`` with usable keys, with their UTC day."""
    return (
        sa.select(
            observations.c.identity_id,
            observations.c.type,
            sa.cast(sa.func.timezone("UTC", observations.c.created_at), sa.Date).label("day"),
            *(value.label(name) for name, value in keys.items()),
            *extra,
        )
        .where(
            observations.c.type.in_(types),
            *(sa.func.length(value).between(1, MAX_KEY_CHARS) for value in keys.values()),
        )
        .subquery("observed")
    )


def _backfill_latest(observed: Any, users: sa.Table, daily: sa.Table, keys: list[str]) -> None:
    """Each identity's last day per key, then those identities counted on that day."""
    key_columns = [observed.c[k] for k in keys]
    op.execute(
        sa.insert(users).from_select(
            ["identity_id", *keys, "last_day"],
            sa.select(observed.c.identity_id, *key_columns, sa.func.max(observed.c.day)).group_by(
                observed.c.identity_id, *key_columns
            ),
        )
    )
    group = [users.c.last_day, *(users.c[k] for k in keys)]
    per_day = (
        sa.select(*group, sa.func.count().label("identities")).group_by(*group).subquery("per_day")
    )
    # Every last day is a day of use, so the backfilled daily row (shard 0) is there.
    op.execute(
        sa.update(daily)
        .values(latest_users=per_day.c.identities)
        .where(
            daily.c.day == per_day.c.last_day,
            *(daily.c[k] == per_day.c[k] for k in keys),
            *([daily.c.shard == 0] if "shard" in daily.c else []),
        )
    )


def _backfill(observations: sa.Table, tables: dict[str, sa.Table]) -> None:
    metadata = observations.c.metadata
    shard = sa.literal(0, sa.SmallInteger)

    # Tools: calls per day, the duration histogram, then the latest-day users.
    raw = metadata["durationMs"]
    # Clamped before the cast, so that no JSON number can fail it.
    clamped = sa.func.greatest(
        sa.func.least(sa.cast(raw, sa.Numeric), sa.literal(10**15, sa.BigInteger)), 0
    )
    duration = sa.case((sa.func.jsonb_typeof(raw) == "number", sa.cast(clamped, sa.Double)))
    doublings = sa.func.ln(duration) / math.log(2)
    # No ELSE: a missing duration has no bucket (least() would ignore the NULL).
    bucket = sa.cast(
        sa.case(
            (duration < 1, 0),
            (
                duration >= 1,
                sa.func.least(MAX_BUCKET, 1 + sa.func.floor(BUCKETS_PER_DOUBLING * doublings)),
            ),
        ),
        sa.SmallInteger,
    )
    tools = _observed(
        observations,
        ["tool_success", "tool_failure"],
        [bucket.label("bucket")],
        tool_name=metadata["toolName"].astext,
    )
    op.execute(
        sa.insert(tables["tool_daily"]).from_select(
            ["day", "tool_name", "shard", "successes", "failures", "latest_users"],
            sa.select(
                tools.c.day,
                tools.c.tool_name,
                shard,
                sa.func.count().filter(tools.c.type == "tool_success"),
                sa.func.count().filter(tools.c.type == "tool_failure"),
                sa.literal(0, sa.BigInteger),
            ).group_by(tools.c.day, tools.c.tool_name),
        )
    )
    op.execute(
        sa.insert(tables["tool_durations"]).from_select(
            ["day", "tool_name", "shard", "bucket", "calls"],
            sa.select(tools.c.day, tools.c.tool_name, shard, tools.c.bucket, sa.func.count())
            .where(tools.c.bucket.is_not(None))
            .group_by(tools.c.day, tools.c.tool_name, tools.c.bucket),
        )
    )
    _backfill_latest(tools, tables["tool_users"], tables["tool_daily"], ["tool_name"])

    # Entities: accesses per day, then the latest-day users.
    entities = _observed(
        observations,
        ["entity_access"],
        entity_type=metadata["entityType"].astext,
        entity_id=metadata["entityId"].astext,
    )
    keys = [entities.c.day, entities.c.entity_type, entities.c.entity_id]
    op.execute(
        sa.insert(tables["entity_daily"]).from_select(
            ["day", "entity_type", "entity_id", "accesses", "latest_users"],
            sa.select(*keys, sa.func.count(), sa.literal(0, sa.BigInteger)).group_by(*keys),
        )
    )
    _backfill_latest(
        entities, tables["entity_users"], tables["entity_daily"], ["entity_type", "entity_id"]
    )

    # Domains: the (identity, domain, day) rows, then queries and users per day.
    domains = _observed(observations, ["query_pattern"], domain=metadata["domain"].astext)
    users = tables["domain_users"]
    op.execute(
        sa.insert(users).from_select(
            ["identity_id", "domain", "day"],
            sa.select(domains.c.identity_id, domains.c.domain, domains.c.day).distinct(),
        )
    )
    per_day = (
        sa.select(users.c.day, users.c.domain, sa.func.count().label("users"))
        .group_by(users.c.day, users.c.domain)
        .subquery("per_day")
    )
    queries = (
        sa.select(domains.c.day, domains.c.domain, sa.func.count().label("queries"))
        .group_by(domains.c.day, domains.c.domain)
        .subquery("queries")
    )
    op.execute(
        sa.insert(tables["domain_daily"]).from_select(
            ["day", "domain", "shard", "queries", "users"],
            sa.select(
                queries.c.day, queries.c.domain, shard, queries.c.queries, per_day.c.users
            ).join_from(
                queries,
                per_day,
                sa.and_(per_day.c.day == queries.c.day, per_day.c.domain == queries.c.domain),
            ),
        )
    )


# --- Views ----------------------------------------------------------------------------

WINDOW_COMMENT = (
    "The instant and the window the analytics views use: at = now(), since = 30 days, "
    "start_day and end_day the UTC days of at - since and at (both included). A "
    "transaction may move them with SET LOCAL coda_memory.analytics_now = '<timestamptz>' "
    "and SET LOCAL coda_memory.analytics_window = '<interval>' (coda_memory.postgres.analytics "
    "does)."
)
ACTIVE_FACTS_COMMENT = (
    "Facts whose confidence at analytics_window.at is at least 0.1, with that "
    "effective_confidence = confidence * 0.95 ^ (days since confidence_at / "
    "coalesce(ease_factor, 1)): the default ExponentialDecay and AdaptiveDecay. A service "
    "configured with another base or threshold decays differently; that is not reflected."
)
TOOL_COMMENT = (
    "One row per tool used in the window (analytics_window, by default the last 30 days) "
    "or with an active affinity or avoidance fact. Usage comes from the rollup (tool_daily, "
    "tool_durations), which outlives raw observations: users = identities whose latest "
    "call falls in the window (the distinct users of a window ending today); success_rate "
    "= successes / calls; p50 and p95 durations are nearest-rank percentiles over calls "
    "with a durationMs, reported as the geometric middle of their log-scale bucket (four "
    "per doubling: within 9.1 %; 0.5 ms below 1 ms). affinity/avoidance columns: active "
    "facts now (active_facts), one per identity. No k-anonymity threshold: filter on users "
    "(coda_memory.postgres.analytics hides rows below min_users, default 5)."
)
ENTITY_COMMENT = (
    "Entities accessed in the window (analytics_window, by default the last 30 days), from "
    "the rollup (entity_daily): users = identities whose latest access falls in the window, "
    "accesses = accesses in it; fact_users and mean_confidence: active entity_frequency "
    "facts (active_facts). No k-anonymity threshold: filter on users."
)
DOMAIN_COMMENT = (
    "Queries and distinct users per UTC day and domain in the window (analytics_window, by "
    "default the last 30 days), from the rollup (domain_daily). No k-anonymity threshold: "
    "filter on users."
)
FACT_SUMMARY_COMMENT = (
    "Active facts (active_facts) per category: facts, users (distinct identities), "
    "mean effective confidence and a histogram of it in 10 buckets [0, 0.1) ... [0.9, 1] "
    "(the first is empty: facts below 0.1 are expired). No k-anonymity threshold: filter "
    "on users."
)


def _view(metadata: sa.MetaData, name: str, query: Query, comment: str) -> sa.Table:
    view = sa.Table(
        name,
        metadata,
        *(sa.Column(c.name, c.type) for c in query.selected_columns),
        schema=SCHEMA,
    )
    op.execute(_CreateView(view, query))
    op.execute(_CommentOnView(view, comment))
    return view


def _utc_day(instant: Any) -> Any:
    return sa.cast(sa.func.timezone("UTC", instant), sa.Date)


def _double(value: float) -> Any:
    return sa.cast(value, sa.Double)


def _setting(name: str) -> Any:
    return sa.func.nullif(sa.func.current_setting(name, sa.true()), "")


def _window_view(metadata: sa.MetaData) -> sa.Table:
    setting = sa.select(
        sa.func.coalesce(
            sa.cast(_setting("coda_memory.analytics_now"), sa.DateTime(timezone=True)),
            sa.func.now(),
        ).label("at"),
        sa.func.coalesce(
            sa.cast(_setting("coda_memory.analytics_window"), sa.Interval()),
            sa.cast(sa.literal("30 days", sa.Text), sa.Interval()),
        ).label("since"),
    ).subquery("setting")
    query = sa.select(
        setting.c.at,
        setting.c.since,
        _utc_day(setting.c.at - setting.c.since).label("start_day"),
        _utc_day(setting.c.at).label("end_day"),
    )
    return _view(metadata, "analytics_window", query, WINDOW_COMMENT)


def _window_value(window: sa.Table, name: str) -> Any:
    """One value of the window, as a scalar subquery: the planner computes it once (an
    InitPlan) instead of parsing the settings again for every row."""
    return sa.select(window.c[name]).scalar_subquery()


def _effective(facts: sa.Table, window: sa.Table) -> Any:
    """A fact's confidence at the window's instant, decayed from its anchor."""
    at = _window_value(window, "at")
    elapsed = sa.func.date_part("epoch", at - facts.c.confidence_at) / _double(86400)
    days = sa.func.greatest(_double(0), elapsed) / sa.func.coalesce(facts.c.ease_factor, _double(1))
    return facts.c.confidence * sa.func.power(_double(DECAY_BASE), days)


def _active_facts_view(metadata: sa.MetaData, facts: sa.Table, window: sa.Table) -> sa.Table:
    effective = _effective(facts, window)
    query = sa.select(*facts.c, effective.label("effective_confidence")).where(
        effective >= EXPIRY_THRESHOLD
    )
    return _view(metadata, "active_facts", query, ACTIVE_FACTS_COMMENT)


def _graded(
    facts: sa.Table, window: sa.Table, categories: Sequence[str] | None, key: str
) -> tuple[Any, Any]:
    """Facts of ``categories`` (None: all) with their effective confidence, in
    (category, ``key``) order, and the condition that keeps the active ones.

    Aggregating active_facts would compute the confidence once for its filter and again
    for every aggregate that reads it: about 0.1 us each, a second over a million facts.
    OFFSET 0 keeps the planner from merging this subquery into the query, so it computes
    the confidence once per fact; the ORDER BY is the index's, so it costs no sort and
    the aggregates above it stream.
    """
    graded = (
        sa.select(
            facts.c.category,
            facts.c[key],
            _effective(facts, window).label("confidence"),
        )
        .where(*([] if categories is None else [facts.c.category.in_(categories)]))
        .order_by(facts.c.category, facts.c[key])
        .offset(0)
        .subquery("graded")
    )
    return graded, graded.c.confidence >= EXPIRY_THRESHOLD


def _in_window(table: sa.Table, window: sa.Table) -> Any:
    return table.c.day.between(_window_value(window, "start_day"), _window_value(window, "end_day"))


def _total(column: Any) -> Any:
    return sa.cast(sa.func.sum(column), sa.BigInteger)


def _bucket_ms(bucket: Any) -> Any:
    """The duration a histogram bucket stands for: its geometric middle."""
    exponent = (sa.cast(bucket, sa.Double) - 0.5) / _double(BUCKETS_PER_DOUBLING)
    return sa.case((bucket == 0, _double(0.5)), else_=sa.func.power(_double(2), exponent))


def _tool_view(
    metadata: sa.MetaData, tables: dict[str, sa.Table], window: sa.Table, facts: sa.Table
) -> sa.Table:
    daily = tables["tool_daily"]
    # Calls and latest-day users in the window, summed over days and shards.
    usage = (
        sa.select(
            daily.c.tool_name,
            _total(daily.c.latest_users).label("users"),
            _total(daily.c.successes).label("successes"),
            _total(daily.c.failures).label("failures"),
        )
        .where(_in_window(daily, window))
        .group_by(daily.c.tool_name)
        .cte("usage")
    )
    # The window's duration histogram per tool, merged over days and shards.
    durations = tables["tool_durations"]
    histogram = (
        sa.select(
            durations.c.tool_name,
            durations.c.bucket,
            sa.func.sum(durations.c.calls).label("calls"),
        )
        .where(_in_window(durations, window))
        .group_by(durations.c.tool_name, durations.c.bucket)
        .subquery("histogram")
    )
    # Calls up to and including each bucket: a percentile is the first bucket whose
    # running count reaches its share of the calls.
    tool, bucket_calls = histogram.c.tool_name, sa.func.sum(histogram.c.calls)
    running = sa.select(
        tool,
        histogram.c.bucket,
        bucket_calls.over(partition_by=tool, order_by=histogram.c.bucket).label("calls"),
        bucket_calls.over(partition_by=tool).label("total"),
    ).subquery("running")
    percentiles = (
        sa.select(
            running.c.tool_name,
            *(
                sa.func.min(running.c.bucket)
                .filter(running.c.calls >= share * running.c.total)
                .label(name)
                for name, share in (("p50", 0.5), ("p95", 0.95))
            ),
        )
        .group_by(running.c.tool_name)
        .cte("percentiles")
    )
    # Active affinity and avoidance facts per subject.
    graded, active = _graded(facts, window, ["tool_affinity", "tool_avoidance"], "subject")
    subjects = (
        sa.select(
            graded.c.category,
            graded.c.subject,
            sa.func.count().label("users"),
            sa.func.avg(graded.c.confidence).label("confidence"),
        )
        .where(active)
        .group_by(graded.c.category, graded.c.subject)
        .subquery("subjects")
    )
    # One row per tool (subject = category:tool); each (category, tool) has one row
    # above, so max() just picks it.
    tool_name = sa.func.substr(subjects.c.subject, sa.func.length(subjects.c.category) + 2)
    affinity = subjects.c.category == "tool_affinity"
    avoidance = subjects.c.category == "tool_avoidance"
    opinions = (
        sa.select(
            tool_name.label("tool_name"),
            sa.func.max(subjects.c.users).filter(affinity).label("affinity_users"),
            sa.func.max(subjects.c.users).filter(avoidance).label("avoidance_users"),
            sa.func.max(subjects.c.confidence).filter(affinity).label("affinity"),
            sa.func.max(subjects.c.confidence).filter(avoidance).label("avoidance"),
        )
        .group_by(tool_name)
        .cte("opinions")
    )
    name = sa.func.coalesce(usage.c.tool_name, opinions.c.tool_name)
    successes = sa.func.coalesce(usage.c.successes, 0)
    failures = sa.func.coalesce(usage.c.failures, 0)
    calls = sa.func.nullif(successes + failures, 0)
    query = sa.select(
        name.label("tool_name"),
        sa.func.coalesce(usage.c.users, 0).label("users"),
        successes.label("successes"),
        failures.label("failures"),
        (sa.cast(successes, sa.Double) / sa.cast(calls, sa.Double)).label("success_rate"),
        _bucket_ms(percentiles.c.p50).label("p50_duration_ms"),
        _bucket_ms(percentiles.c.p95).label("p95_duration_ms"),
        sa.func.coalesce(opinions.c.affinity_users, 0).label("affinity_users"),
        sa.func.coalesce(opinions.c.avoidance_users, 0).label("avoidance_users"),
        opinions.c.affinity.label("mean_affinity_confidence"),
        opinions.c.avoidance.label("mean_avoidance_confidence"),
    ).select_from(
        usage.join(opinions, opinions.c.tool_name == usage.c.tool_name, full=True).outerjoin(
            percentiles, percentiles.c.tool_name == name
        )
    )
    return _view(metadata, "tool_effectiveness", query, TOOL_COMMENT)


def _entity_view(
    metadata: sa.MetaData, tables: dict[str, sa.Table], window: sa.Table, facts: sa.Table
) -> sa.Table:
    daily = tables["entity_daily"]
    key = [daily.c.entity_type, daily.c.entity_id]
    # Accesses and latest-day users in the window, per entity.
    usage = (
        sa.select(
            *key,
            _total(daily.c.latest_users).label("users"),
            _total(daily.c.accesses).label("accesses"),
        )
        .where(_in_window(daily, window))
        .group_by(*key)
        .cte("usage")
    )
    # Active entity facts per subject (entity_frequency:type:id).
    graded, active = _graded(facts, window, ["entity_frequency"], "subject")
    opinions = (
        sa.select(
            graded.c.subject,
            sa.func.count().label("fact_users"),
            sa.func.avg(graded.c.confidence).label("mean_confidence"),
        )
        .where(active)
        .group_by(graded.c.subject)
        .cte("opinions")
    )
    subject = "entity_frequency:" + usage.c.entity_type + ":" + usage.c.entity_id
    query = sa.select(
        usage.c.entity_type,
        usage.c.entity_id,
        usage.c.users,
        usage.c.accesses,
        sa.func.coalesce(opinions.c.fact_users, 0).label("fact_users"),
        opinions.c.mean_confidence,
    ).select_from(usage.outerjoin(opinions, opinions.c.subject == subject))
    return _view(metadata, "entity_popularity", query, ENTITY_COMMENT)


def _domain_view(metadata: sa.MetaData, tables: dict[str, sa.Table], window: sa.Table) -> sa.Table:
    daily = tables["domain_daily"]
    query = (
        sa.select(
            daily.c.day,
            daily.c.domain,
            _total(daily.c.queries).label("queries"),
            _total(daily.c.users).label("users"),
        )
        .where(_in_window(daily, window))
        .group_by(daily.c.day, daily.c.domain)
    )
    return _view(metadata, "domain_trends", query, DOMAIN_COMMENT)


def _fact_summary_view(metadata: sa.MetaData, facts: sa.Table, window: sa.Table) -> sa.Table:
    # In (category, identity_id) order: one pass, and the distinct count needs no sort.
    graded, active = _graded(facts, window, None, "identity_id")
    confidence = graded.c.confidence

    def bucket(b: int) -> Any:
        low = confidence >= b / HISTOGRAM_BUCKETS
        if b == HISTOGRAM_BUCKETS - 1:
            return low
        return sa.and_(low, confidence < (b + 1) / HISTOGRAM_BUCKETS)

    query = (
        sa.select(
            graded.c.category,
            sa.func.count().label("facts"),
            sa.func.count(sa.distinct(graded.c.identity_id)).label("users"),
            sa.func.avg(confidence).label("mean_confidence"),
            postgresql.array(
                [sa.func.count().filter(bucket(b)) for b in range(HISTOGRAM_BUCKETS)]
            ).label("histogram"),
        )
        .where(active)
        .group_by(graded.c.category)
    )
    return _view(metadata, "fact_summary", query, FACT_SUMMARY_COMMENT)


def _create_views(facts: sa.Table, tables: dict[str, sa.Table]) -> None:
    metadata = facts.metadata
    window = _window_view(metadata)
    _active_facts_view(metadata, facts, window)
    _tool_view(metadata, tables, window, facts)
    _entity_view(metadata, tables, window, facts)
    _domain_view(metadata, tables, window)
    _fact_summary_view(metadata, facts, window)


# --- Upgrade and downgrade ------------------------------------------------------------


def upgrade() -> None:
    # First, outside any transaction: CONCURRENTLY keeps the facts table writable while
    # the indexes build. An interrupted build leaves an invalid index behind, so one of
    # the same name is dropped first. Nothing of this revision is committed before.
    with op.get_context().autocommit_block():
        for name, columns in FACT_INDEXES.items():
            op.drop_index(
                name, "facts", schema=SCHEMA, postgresql_concurrently=True, if_exists=True
            )
            op.create_index(
                name,
                "facts",
                columns,
                schema=SCHEMA,
                postgresql_include=FACT_INDEX_INCLUDE,
                postgresql_concurrently=True,
            )
    # Then, in one transaction with the version bump: the rollup, its backfill, the views.
    tables = _create_tables()
    observations, facts = _existing_tables(sa.MetaData())
    _backfill(observations, tables)
    _create_views(facts, tables)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name in FACT_INDEXES:
            op.drop_index(
                name, "facts", schema=SCHEMA, postgresql_concurrently=True, if_exists=True
            )
    metadata = sa.MetaData()
    for name in reversed(VIEWS):
        op.execute(_DropView(sa.Table(name, metadata, schema=SCHEMA)))
    for name in TABLES:
        op.drop_table(name, schema=SCHEMA)
