"""Named SQL: one statement per ``.sql`` file in this package, read once.

A file holds one statement, formatted one clause per line, with a comment on each CTE
saying why it exists. Three kinds of placeholder appear in it:

* ``{schema}``, the store's schema: replaced by the quoted identifier, after
  :func:`~coda_memory.postgres.schema.validate_schema_name` accepted it (never a value);
* ``{fragment(name=value, …)}``, the expression (or a CTE's statement) in
  ``fragments/fragment.sql`` with its ``{name}`` placeholders replaced, in parentheses:
  a predicate, or a write, that several statements share is written once;
* ``:name``, a parameter. :class:`Query` numbers the names in order of first use, as
  asyncpg's ``$1, $2, …``, and builds the argument list from a mapping by name, so no
  value is ever matched to a position by hand.

Lines that start with ``--`` are comments and are not sent to the server. Most files run
through :func:`query` on the driver; the idempotency keys' (``ingest_*``) run through
SQLAlchemy's ``text()`` instead (:mod:`~coda_memory.postgres.batch_keys`), and the rollup's
statements are built with SQLAlchemy Core in :mod:`~coda_memory.postgres.rollup`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from coda_memory.postgres.schema import validate_schema_name

#: ``:name``, but not the second colon of a ``::type`` cast.
_PARAMETER = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")
_COMMENT = re.compile(r"^\s*--.*$\n?", re.MULTILINE)
#: ``{name(key=value, …)}``; values contain no braces or parentheses.
_FRAGMENT = re.compile(r"\{(\w+)\(([^{}()]*)\)\}")


@functools.cache
def source(name: str) -> str:
    """The text of ``name``.sql as written (comments and placeholders included)."""
    return resources.files(__package__).joinpath(f"{name}.sql").read_text(encoding="utf-8")


def strip_comments(sql: str) -> str:
    """``sql`` without its comment lines (those that start with ``--``)."""
    return _COMMENT.sub("", sql)


def fragment(name: str, **values: str) -> str:
    """``fragments/name.sql`` in parentheses, its ``{key}`` placeholders replaced by
    ``values`` (SQL expressions of the including statement, never outside values)."""
    text = " ".join(
        line.strip() for line in strip_comments(source(f"fragments/{name}")).strip().split("\n")
    )
    for key, value in values.items():
        text = text.replace(f"{{{key}}}", value)
    return f"({text})"


def _expand(sql: str) -> str:
    def include(match: re.Match[str]) -> str:
        pairs = (item.split("=", 1) for item in match.group(2).split(", "))
        return fragment(match.group(1), **{key.strip(): value.strip() for key, value in pairs})

    return _FRAGMENT.sub(include, sql)


def in_schema(sql: str, schema: str) -> str:
    """``sql`` with ``{schema}`` replaced by the quoted, validated schema name."""
    return sql.replace("{schema}", f'"{validate_schema_name(schema)}"')


@dataclass(frozen=True, slots=True)
class Query:
    """One named statement for one schema, in asyncpg's ``$n`` form."""

    name: str
    #: The statement as sent to the server.
    text: str
    #: The parameters' names: ``parameters[n - 1]`` binds ``$n``.
    parameters: tuple[str, ...]

    def arguments(self, **values: Any) -> list[Any]:
        """The positional arguments for :attr:`text`, from ``values`` by name."""
        return self.arguments_from(values)

    def arguments_from(self, values: Mapping[str, Any]) -> list[Any]:
        """As :meth:`arguments`; every parameter must be given, and nothing else."""
        if values.keys() != set(self.parameters):
            raise ValueError(
                f"{self.name}.sql takes {sorted(self.parameters)}, given {sorted(values)}"
            )
        return [values[name] for name in self.parameters]


@functools.cache
def query(name: str, schema: str) -> Query:
    """``name``.sql for ``schema``, with its ``:name`` parameters numbered (cached)."""
    text = in_schema(_expand(strip_comments(source(name))), schema).strip()
    parameters: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in parameters:
            parameters.append(match.group(1))
        return f"${parameters.index(match.group(1)) + 1}"

    return Query(name, _PARAMETER.sub(number, text), tuple(parameters))
