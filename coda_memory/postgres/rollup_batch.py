"""The rollup statements of an appended batch: compiled once per schema, run through the
driver inside the append's transaction (see :mod:`.rollup` for the design), or later for
a transaction whose rollup was owed (:mod:`.rollup_owed`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Insert

from coda_memory.core.model import ObservationType
from coda_memory.postgres.rollup import TOOL_TYPES, domain_rollup, entity_rollup, tool_rollup
from coda_memory.postgres.schema import schema_translate_map


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A rollup statement compiled once: its SQL and its positional parameters, whose
    values are the ones it was built with except the ``identities`` and ``shard``."""

    sql: str
    names: tuple[str, ...]
    values: dict[str, Any]

    def arguments(
        self, identities: list[str], shard: int, xids: list[int] | None = None
    ) -> list[Any]:
        given: dict[str, Any] = {"identities": identities, "shard": shard}
        if xids is not None:
            given["xids"] = xids
        return [given[n] if n in given else self.values[n] for n in self.names]


def _compile(statement: Insert, schema: str) -> _Compiled:
    compiled = statement.compile(
        dialect=_DIALECT,
        schema_translate_map=schema_translate_map(schema),
        render_schema_translate=True,
        compile_kwargs={"render_postcompile": True},
    )
    assert compiled.positiontup is not None
    return _Compiled(compiled.string, tuple(compiled.positiontup), dict(compiled.params))


_DIALECT = asyncpg_dialect()  # type: ignore[no-untyped-call]


#: The rollups a batch feeds, one bit each (``rollup_owed.kinds``).
KIND_TOOLS, KIND_ENTITIES, KIND_DOMAINS = 1, 2, 4


def kinds_of(stored: Sequence[tuple[str, str]]) -> int:
    """The rollups that rows given as (identity_id, type) feed, as ``KIND_*`` bits."""
    types = {observation_type for _, observation_type in stored}
    kinds = KIND_TOOLS if types.intersection(TOOL_TYPES) else 0
    if ObservationType.ENTITY_ACCESS in types:
        kinds |= KIND_ENTITIES
    if ObservationType.QUERY_PATTERN in types:
        kinds |= KIND_DOMAINS
    return kinds


@lru_cache(maxsize=16)
def batch_statements(schema: str) -> tuple[_Compiled, _Compiled, _Compiled]:
    """The tool, entity and domain rollup statements of a batch, compiled once per schema
    (building them costs more than running them)."""
    return (
        _compile(tool_rollup([], 0), schema),
        _compile(entity_rollup([]), schema),
        _compile(domain_rollup([], 0), schema),
    )


@lru_cache(maxsize=16)
def owed_statements(schema: str) -> tuple[_Compiled, _Compiled, _Compiled]:
    """As :func:`batch_statements`, for the rows of an earlier transaction (``xid``)."""
    return (
        _compile(tool_rollup([], 0, owed=True), schema),
        _compile(entity_rollup([], owed=True), schema),
        _compile(domain_rollup([], 0, owed=True), schema),
    )


#: The kinds of rollup in the order every writer (and ``forget``) takes their tables.
_KINDS = (KIND_TOOLS, KIND_ENTITIES, KIND_DOMAINS)


async def _run(
    driver: Any,
    statements: tuple[_Compiled, _Compiled, _Compiled],
    kinds: int,
    identities: list[str],
    shard: int,
) -> None:
    for kind, statement in zip(_KINDS, statements, strict=True):
        if kinds & kind:
            await driver.execute(statement.sql, *statement.arguments(identities, shard))


async def write_rollup(
    driver: Any, schema: str, shard: int, stored: Sequence[tuple[str, str]]
) -> None:
    """Fold the rows this transaction stored, given as (identity_id, type), into the
    rollup, through ``driver`` (asyncpg, inside the transaction); one statement per kind
    of observation present."""
    identities = sorted({identity_id for identity_id, _ in stored})
    await _run(driver, batch_statements(schema), kinds_of(stored), identities, shard)


async def fold_rollup(
    driver: Any, schema: str, shard: int, owed: Sequence[tuple[str, int, int]]
) -> None:
    """Fold the rows of the owed records given as (identity_id, xid, kinds), of one or
    many earlier transactions, into the kinds of rollup each owes: one statement per kind,
    for every record that owes it (the transaction must be allowed to read those rows:
    see :mod:`.rollup_owed`)."""
    for kind, statement in zip(_KINDS, owed_statements(schema), strict=True):
        pairs = [(identity_id, xid) for identity_id, xid, kinds in owed if kinds & kind]
        if pairs:
            identities = [identity_id for identity_id, _ in pairs]
            xids = [xid for _, xid in pairs]
            await driver.execute(statement.sql, *statement.arguments(identities, shard, xids))


async def write_rollup_part(
    conn: AsyncConnection, shard: int, stored: Sequence[tuple[str, str]], ids: Sequence[int]
) -> None:
    """:func:`write_rollup` for part of a batch being bisected: the rows given by
    ``ids`` only, when the transaction stored other rows of the same identities too."""
    types = {observation_type for _, observation_type in stored}
    identities = sorted({identity_id for identity_id, _ in stored})
    if types.intersection(TOOL_TYPES):
        await conn.execute(tool_rollup(identities, shard, ids))
    if ObservationType.ENTITY_ACCESS in types:
        await conn.execute(entity_rollup(identities, ids))
    if ObservationType.QUERY_PATTERN in types:
        await conn.execute(domain_rollup(identities, shard, ids))
