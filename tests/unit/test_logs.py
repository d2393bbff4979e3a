"""Log lines name identities by label, and building one never fails."""

from __future__ import annotations

import uuid

from coda_memory.core.logs import identity_label, short_error, without_identities


def test_an_identity_in_an_error_message_becomes_its_label() -> None:
    error = ValueError("no checkpoint for 'alice@example.com'")
    message = short_error(error, ("alice@example.com",))
    assert message == f"ValueError: no checkpoint for {identity_label('alice@example.com')}"
    assert "alice" not in message


def test_an_identity_that_is_no_string_leaves_the_message_as_it_is() -> None:
    identity = uuid.UUID(int=7)
    error = TypeError(f"invalid input {identity!r}")
    assert short_error(error, (identity, 42, None)) == f"TypeError: invalid input {identity!r}"  # type: ignore[arg-type]


def test_an_identity_inside_a_longer_word_is_left_alone() -> None:
    """Identity "cat" made "metadata.toolName is not in the tool catalog" read "… tool
    id:6a8b12bbalog"; a short identity garbled nearly every message."""
    reason = "metadata.toolName is not in the tool_catalog; cat wrote (cat) and 'cat'"
    label = identity_label("cat")
    assert without_identities(reason, ("cat",)) == (
        f"metadata.toolName is not in the tool_catalog; {label} wrote ({label}) and {label}"
    )
    assert short_error(ValueError("Key (identity_id)=(cat) exists"), ("cat",)) == (
        f"ValueError: Key (identity_id)=({label}) exists"
    )
