"""Log lines name identities by label, and building one never fails."""

from __future__ import annotations

import uuid

from coda_memory.core.logs import identity_label, short_error


def test_an_identity_in_an_error_message_becomes_its_label() -> None:
    error = ValueError("no checkpoint for 'alice@example.com'")
    message = short_error(error, ("alice@example.com",))
    assert message == f"ValueError: no checkpoint for {identity_label('alice@example.com')}"
    assert "alice" not in message


def test_an_identity_that_is_no_string_leaves_the_message_as_it_is() -> None:
    identity = uuid.UUID(int=7)
    error = TypeError(f"invalid input {identity!r}")
    assert short_error(error, (identity, 42, None)) == f"TypeError: invalid input {identity!r}"  # type: ignore[arg-type]
