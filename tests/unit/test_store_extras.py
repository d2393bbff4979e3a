"""The store capabilities the service looks up by name are the ones
:class:`coda_memory.ports.StoreExtras` declares, and the Postgres store has them all (mypy
checks their shapes through the assignment below)."""

from __future__ import annotations

import ast
import inspect

from coda_memory import service
from coda_memory.ports import StoreExtras
from coda_memory.postgres import PostgresStore

#: Checked by mypy: the Postgres store offers every extra, with its declared shape.
POSTGRES: type[StoreExtras] = PostgresStore


def _declared() -> set[str]:
    return {name for name in vars(StoreExtras) if not name.startswith("_")}


def _looked_up() -> set[str]:
    """The names the service's code passes to ``getattr`` on its store."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(service))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != "getattr" or len(node.args) < 2:
            continue
        target, name = node.args[0], node.args[1]
        on_store = (isinstance(target, ast.Attribute) and target.attr == "store") or (
            isinstance(target, ast.Name) and target.id == "store"
        )
        if on_store and isinstance(name, ast.Constant) and isinstance(name.value, str):
            names.add(name.value)
    return names


def test_the_service_looks_up_only_the_extras_the_port_declares() -> None:
    assert _looked_up() == _declared()
    assert "unchanged" in _declared()  # the parse found the lookups at all


def test_the_postgres_store_defines_every_extra() -> None:
    defined = set(dir(PostgresStore)) | set(inspect.signature(PostgresStore).parameters)
    instance_attributes = {"ingest_counts", "held_out"}  # set in __init__
    source = inspect.getsource(PostgresStore.__init__)
    assert all(f"self.{name} =" in source for name in instance_attributes)
    assert _declared() - instance_attributes <= defined
