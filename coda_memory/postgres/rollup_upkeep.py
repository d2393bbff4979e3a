"""Rollup upkeep outside the append path: forgetting an identity's per-identity rows
(and its place in the user counters, after folding its owed rollups), and rebuilding the whole
rollup from the stored observations (see :mod:`.rollup` for the design, and
:mod:`.rollup_owed` for owed rollups)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Table, delete, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement
from sqlalchemy.sql.dml import Insert

from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.rollup import (
    add_to_daily,
    connection_shard,
    domain_rollup,
    entity_rollup,
    tool_rollup,
)
from coda_memory.postgres.rollup_batch import KIND_DOMAINS, KIND_ENTITIES, KIND_TOOLS
from coda_memory.postgres.rollup_owed import fold_owed
from coda_memory.postgres.schema import (
    domain_daily,
    domain_users,
    entity_daily,
    entity_users,
    rollup_owed,
    tool_daily,
    tool_durations,
    tool_users,
)
from coda_memory.postgres.sql import in_schema


def _forget_latest(
    identity_id: str, users: Table, daily: Table, keys: Sequence[str], shard: int | None
) -> Insert:
    """Delete the identity's latest-day rows and take it out of their daily counters."""
    gone = (
        delete(users)
        .where(users.c.identity_id == identity_id)
        .returning(users.c.last_day.label("day"), *(users.c[k] for k in keys))
        .cte("gone")
    )
    counts = [c.name for c in daily.c if c.name not in {"day", "shard", *keys}]
    changes = select(
        gone.c.day,
        *(gone.c[k] for k in keys),
        *(literal(-1 if name == "latest_users" else 0, BigInteger).label(name) for name in counts),
    ).subquery("changes")
    return add_to_daily(daily, changes, keys, counts, shard)


def _forget_domains(identity_id: str, shard: int) -> Insert:
    gone = (
        delete(domain_users)
        .where(domain_users.c.identity_id == identity_id)
        .returning(domain_users.c.day, domain_users.c.domain)
        .cte("gone")
    )
    changes = select(
        gone.c.day,
        gone.c.domain,
        literal(0, BigInteger).label("queries"),
        literal(-1, BigInteger).label("users"),
    ).subquery("changes")
    return add_to_daily(domain_daily, changes, ["domain"], ["queries", "users"], shard)


#: The rollup tables a forget writes itself, in the order an append's rollup locks them.
_FORGET_WRITES = (tool_users, tool_daily, entity_users, entity_daily, domain_users, domain_daily)


@functools.cache
def _lock_forget_writes(schema: str) -> str:
    """``LOCK TABLE`` of :data:`_FORGET_WRITES` in the mode their writes take anyway (ROW
    EXCLUSIVE: no writer waits for another on it), under the forget's own lock wait."""
    names = ", ".join(f"{{schema}}.{table.name}" for table in _FORGET_WRITES)
    return in_schema(f"LOCK TABLE {names} IN ROW EXCLUSIVE MODE", schema)


async def _lock_in_key_order(
    conn: AsyncConnection, users: Table, identity_id: str, keys: Sequence[str]
) -> None:
    """Lock the identity's rows of ``users`` in key order, the order an append upserts
    them in: a ``DELETE`` takes them in the order they lie on disk, and deadlocked with
    the appends of another process that updated two of them the other way round."""
    await conn.execute(
        select(literal(1))
        .select_from(users)
        .where(users.c.identity_id == identity_id)
        .order_by(*(users.c[k] for k in keys))
        .with_for_update()
    )


async def forget_identity(conn: AsyncConnection, schema: str, identity_id: str) -> None:
    """Delete the identity's per-identity rollup rows and its place in the user counts;
    the anonymous call, access and query counts stay. Call it before the identity's
    observations are deleted: its owed rollups are folded first, so that those counts
    include its calls too; the records a lock still keeps from folding (a rollup table
    locked right then, ``tool_durations``, which only the folding writes) are deleted
    unfolded, and their counts lost. The tables the forget writes itself it locks first,
    waiting as long as the forget's lock timeout lets it: the folding then finds them
    taken (it waits 50 ms at most for a lock), and a lock held on one of them makes the
    forget wait, or fail whole, rather than lose the owed counts.

    The locks are taken in the order a folding append takes them, so that the two never
    wait for each other in a circle: the tables (a mode no append's conflicts with), the
    identity's owed records (waiting for a folder that holds some to commit), then, one
    kind of rollup after the other (tools, entities, domains, as an append's statements
    go), its per-identity rows of that kind in key order (see :func:`_lock_in_key_order`)
    and then the shared daily rows of that kind (the folding's, and the forget's own).
    Its rows of every kind locked before any daily row, the forget deadlocked with an
    append that held a daily row of tools and waited for the identity's row of entities
    (the forget failed with ``deadlock detected``)."""
    shard = await connection_shard(conn)
    driver = await driver_connection(conn)
    await driver.execute(_lock_forget_writes(schema))
    owed = (
        await conn.execute(
            select(literal(1))
            .select_from(rollup_owed)
            .where(rollup_owed.c.identity_id == identity_id)
            .with_for_update()
        )
    ).all()
    tool_keys, entity_keys = ["tool_name"], ["entity_type", "entity_id"]
    # Each kind: its per-identity table and key, and the statement that forgets its rows.
    kinds = (
        (
            KIND_TOOLS,
            tool_users,
            tool_keys,
            _forget_latest(identity_id, tool_users, tool_daily, tool_keys, shard),
        ),
        (
            KIND_ENTITIES,
            entity_users,
            entity_keys,
            _forget_latest(identity_id, entity_users, entity_daily, entity_keys, None),
        ),
        (KIND_DOMAINS, domain_users, ["domain", "day"], _forget_domains(identity_id, shard)),
    )
    for kind, users, keys, forget in kinds:
        await _lock_in_key_order(conn, users, identity_id, keys)
        if owed:
            # Every record at once (they stay until deleted below), this kind only.
            await fold_owed(
                driver, schema, shard, limit=len(owed), identity_id=identity_id, kinds=kind
            )
        await conn.execute(forget)
    await conn.execute(delete(rollup_owed).where(rollup_owed.c.identity_id == identity_id))


class _Truncate(ExecutableDDLElement):
    """``TRUNCATE`` of tables, named like any table (``schema_translate_map`` applies)."""

    inherit_cache = False

    def __init__(self, *tables: Table) -> None:
        self.tables = tables


@compiles(_Truncate)
def _compile_truncate(element: _Truncate, compiler: Any, **kw: Any) -> str:
    return "TRUNCATE " + ", ".join(compiler.preparer.format_table(t) for t in element.tables)


ROLLUP_TABLES = (
    tool_daily,
    tool_durations,
    tool_users,
    entity_daily,
    entity_users,
    domain_daily,
    domain_users,
)


async def rebuild(conn: AsyncConnection) -> None:
    """Empty the rollup and fold every stored observation into it, in the transaction
    ``conn`` is in (the caller commits). History older than the stored observations is
    lost. Owed rollups are dropped too: their rows are among those recomputed. Appends
    meanwhile owe their rollup (they wait for the transaction to record it), so their
    rows, which it cannot see, are folded once it committed."""
    shard = await connection_shard(conn)
    await conn.execute(_Truncate(*ROLLUP_TABLES, rollup_owed))
    await conn.execute(tool_rollup(None, shard))
    await conn.execute(entity_rollup(None))
    await conn.execute(domain_rollup(None, shard))
