"""The SQL loader: named parameters become $n by name, the schema is validated."""

from __future__ import annotations

import pytest

from coda_memory.postgres import sql


def test_parameters_are_numbered_in_order_of_first_use_and_casts_are_left_alone() -> None:
    query = sql.query("new_observations_since", "coda_memory")
    assert query.parameters == ("identity_id", "stored_snapshot")
    assert "$2::text::pg_snapshot" in query.text
    assert ":stored_snapshot" not in query.text and "--" not in query.text
    assert query.arguments(stored_snapshot="10:10:", identity_id="alice") == ["alice", "10:10:"]


def test_the_write_statement_binds_every_value_by_name() -> None:
    query = sql.query("consolidation_write", "coda_memory")
    assert len(query.parameters) == len(set(query.parameters)) == 8
    assert f"${len(query.parameters)}" in query.text
    values = {name: name for name in query.parameters}
    assert query.arguments_from(values) == list(query.parameters)


@pytest.mark.parametrize(
    "values",
    [{"identity_id": "alice"}, {"identity_id": "a", "stored_snapshot": "s", "extra": 1}],
    ids=["missing", "unknown"],
)
def test_a_missing_or_unknown_argument_is_refused(values: dict[str, object]) -> None:
    query = sql.query("new_observations_since", "coda_memory")
    with pytest.raises(ValueError, match=r"new_observations_since\.sql takes"):
        query.arguments_from(values)


def test_the_schema_is_quoted_after_validation() -> None:
    assert 'FROM "tenant_a".facts' in sql.query("stored_facts", "tenant_a").text
    with pytest.raises(ValueError, match="invalid schema name"):
        sql.query("stored_facts", 'x"; DROP TABLE facts; --')


def test_the_pending_predicate_is_written_once_and_shared() -> None:
    from coda_memory.postgres import maintenance

    predicate = sql.fragment("unconsumed", xid="o.xid", snapshot="cp.s")
    assert predicate.startswith("(o.xid >= pg_snapshot_xmin(cp.s) AND ")
    assert predicate in sql.query("peek", "coda_memory").text
    stored = sql.fragment("unconsumed", xid="o.xid", snapshot="$2::text::pg_snapshot")
    assert stored in sql.query("new_observations_since", "coda_memory").text
    checkpoint = "checkpoints.snapshot::pg_snapshot"
    scan = str(maintenance.pending_scan(None, 10))
    assert sql.fragment("unconsumed", xid="observations.xid", snapshot=checkpoint) in scan
