"""Keep a host application's Alembic away from coda-memory's schema.

coda-memory migrates its own schema (``coda_memory`` by default) with its own Alembic
history and version table. A host application whose ``env.py`` sets
``include_schemas=True`` would otherwise reflect that schema during
``alembic revision --autogenerate`` or ``alembic check``, find tables its models do not
declare, and write ``op.drop_table(..., schema="coda_memory")`` for each. Pass these
hooks to the host's ``context.configure``::

    from coda_memory.alembic import exclude_schema, exclude_schema_objects

    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_schemas=True,
        include_name=exclude_schema(),            # never reflect coda_memory
        include_object=exclude_schema_objects(),  # nor compare anything placed there
    )

Both take the schema names to leave out (default: ``coda_memory``) and, as ``include=``,
a hook of the host's own to chain after ours.

This module is named ``alembic`` inside the ``coda_memory`` package; with absolute imports
(the only kind Python 3 has) ``import alembic`` still finds the real Alembic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name

#: Alembic's ``include_name`` signature: ``(name, type_, parent_names) -> bool``.
IncludeName = Callable[[str | None, str, Mapping[str, str | None]], bool]
#: Alembic's ``include_object`` signature:
#: ``(object, name, type_, reflected, compare_to) -> bool``.
IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def _schemas(schemas: tuple[str, ...]) -> frozenset[str]:
    return frozenset(validate_schema_name(s) for s in (schemas or (DEFAULT_SCHEMA,)))


def exclude_schema(*schemas: str, include: IncludeName | None = None) -> IncludeName:
    """An ``include_name`` hook that never reflects ``schemas`` (default ``coda_memory``),
    nor anything in them; every other name goes to ``include`` (default: kept)."""
    excluded = _schemas(schemas)

    def include_name(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
        if type_ == "schema" and name in excluded:
            return False
        if parent_names.get("schema_name") in excluded:
            return False
        return True if include is None else include(name, type_, parent_names)

    return include_name


def _schema_of(obj: Any) -> str | None:
    table = getattr(obj, "table", None)  # indexes, constraints and columns
    schema = getattr(table if table is not None else obj, "schema", None)
    return schema if isinstance(schema, str) else None


def exclude_schema_objects(*schemas: str, include: IncludeObject | None = None) -> IncludeObject:
    """An ``include_object`` hook that leaves out tables (and their columns, indexes and
    constraints) in ``schemas`` (default ``coda_memory``), whether reflected from the
    database or declared in a metadata the host imported."""
    excluded = _schemas(schemas)

    def include_object(
        obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        if _schema_of(obj) in excluded:
            return False
        if include is None:
            return True
        return include(obj, name, type_, reflected, compare_to)

    return include_object


__all__ = ["IncludeName", "IncludeObject", "exclude_schema", "exclude_schema_objects"]
