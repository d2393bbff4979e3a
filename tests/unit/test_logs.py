"""Log lines name identities by label, and building one never fails."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import coda_memory
from coda_memory.core import logs
from coda_memory.core.caps import LogThrottle
from coda_memory.core.logs import identity_label, short_error, without_identities
from tests.thread_switches import switches_after_calls


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


@pytest.fixture
def restored_key() -> Iterator[None]:
    """The process's label key as it was, after a test that sets its own."""
    kept = logs._LabelKey.value
    yield
    logs._LabelKey.value = kept


def _labels_of_a_fresh_process(identities: list[str], key: str | None) -> list[str]:
    """The labels that a new interpreter gives ``identities``, given ``key`` (None: none)."""
    code = (
        "import json, sys\n"
        "import coda_memory\n"
        "from coda_memory.core.logs import identity_label\n"
        "if sys.argv[2]: coda_memory.set_log_key(sys.argv[2])\n"
        "print(json.dumps([identity_label(i) for i in json.loads(sys.argv[1])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(identities), key or ""],
        capture_output=True,
        text=True,
        check=True,
    )
    labels: list[str] = json.loads(out.stdout)
    return labels


def test_a_message_that_names_no_identity_costs_no_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rejection's reason goes through without_identities, before the throttle drops
    its line: a pattern compiled for each identity not in it (36 us with identities of
    their own, ten times the validation's cost) made a flood of rejected observations of
    many users cost the writer's event loop most of its time."""
    subs: list[str] = []
    real_sub = re.sub

    def counted_sub(pattern: Any, *args: Any, **kwargs: Any) -> Any:
        subs.append(str(pattern))
        return real_sub(pattern, *args, **kwargs)

    monkeypatch.setattr(re, "sub", counted_sub)
    reason = "metadata.durationMs is not a number"
    for n in range(100):
        assert without_identities(reason, (f"user-{n}@example.com",)) == reason
    assert subs == []
    # Still replaced where it is, bare or quoted as repr() quotes it.
    label = identity_label("a'b\\n")
    assert without_identities("for 'x' and \"a'b\\\\n\"", ("x", "a'b\\n")) == (
        f"for {identity_label('x')} and {label}"
    )


def test_a_label_needs_the_key_a_list_of_candidate_ids_does_not_reveal_it() -> None:
    """An unkeyed hash of a few bytes let anyone with a list of candidate ids (e-mail
    addresses, numeric ids) find the one behind a label: the hash has a key now."""
    identity = "alice@example.com"
    label = identity_label(identity)
    assert re.fullmatch(r"id:[0-9a-f]{12}", label)
    assert label == identity_label(identity), "a label is stable within a process"
    # What anyone could compute without the key is not the label.
    for size in (4, 6, 8):
        unkeyed = hashlib.blake2b(identity.encode(), digest_size=size).hexdigest()
        assert unkeyed not in label
    # Without set_log_key, each process draws its own key.
    first = _labels_of_a_fresh_process([identity, "bob"], None)
    second = _labels_of_a_fresh_process([identity, "bob"], None)
    assert first != second
    assert first[0] != first[1]


def test_the_same_log_key_gives_the_same_labels_in_every_process() -> None:
    identities = ["alice@example.com", "42"]
    first = _labels_of_a_fresh_process(identities, "operators-secret")
    assert first == _labels_of_a_fresh_process(identities, "operators-secret")
    assert first != _labels_of_a_fresh_process(identities, "another-secret")
    assert all(re.fullmatch(r"id:[0-9a-f]{12}", label) for label in first)


@pytest.mark.usefixtures("restored_key")
def test_set_log_key_takes_str_or_bytes_and_refuses_no_secret() -> None:
    coda_memory.set_log_key("operators-secret")
    keyed = identity_label("alice")
    coda_memory.set_log_key(b"operators-secret")
    assert identity_label("alice") == keyed
    coda_memory.set_log_key(None)
    assert identity_label("alice") != keyed
    with pytest.raises(ValueError, match="empty"):
        coda_memory.set_log_key("")
    with pytest.raises(TypeError, match="str or bytes, not int"):
        coda_memory.set_log_key(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("message", "logged"),
    [
        (
            'invalid input syntax for type double precision: "acct-118 Northwind"',
            'invalid input syntax for type double precision: "<value>"',
        ),
        (
            'value "99999999999" is out of range for type integer',
            'value "<value>" is out of range for type integer',
        ),
        ('malformed array literal: "{Northwind"', 'malformed array literal: "<value>"'),
        (
            '"1e999" is out of range for type double precision',
            '"<value>" is out of range for type double precision',
        ),
        ('invalid value "Northwind" for "YYYY"', 'invalid value "<value>" for "YYYY"'),
        ('time zone "Acct/118" not recognized', 'time zone "<value>" not recognized'),
        # A value with a line break: its first line ends inside the quotes.
        (
            'invalid input syntax for type double precision: "acct-118\nNorthwind"',
            'invalid input syntax for type double precision: "<value>"',
        ),
        ('value "118\n" is out of range for type integer', 'value "<value>"'),
        # A value that holds a quote.
        (
            'value "1"18" is out of range for type integer',
            'value "<value>" is out of range for type integer',
        ),
        ('invalid value "ab"c', 'invalid value "<value>"'),
        ('time zone "Acct"118" not recognized', 'time zone "<value>" not recognized'),
        # asyncpg's reason quotes the value again.
        (
            "invalid input for query argument $1: 'Northwind' (invalid UUID 'Northwind': x)",
            "invalid input for query argument $1: <value> (invalid UUID '<value>': x)",
        ),
        # The names a message quotes elsewhere are the schema's, and stay.
        (
            'duplicate key value violates unique constraint "pk_facts"',
            'duplicate key value violates unique constraint "pk_facts"',
        ),
    ],
)
def test_a_value_the_server_quotes_in_its_message_is_not_logged(message: str, logged: str) -> None:
    """The server quotes the value it refused, a tenant's data perhaps (a host's trigger or
    constraint on the tables): a warning of a failed append said it whole."""
    import asyncpg

    from coda_memory.postgres.connection import error_reason

    error = asyncpg.exceptions.DataError(message)
    assert short_error(error) == f"DataError: {logged}"
    assert error_reason(error) == logged


class _Kept(logging.Handler):
    """The records logged, from any thread."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _AnnouncedLock:
    """The throttle's lock, which says when a thread finds it held: that thread waits
    for it from then on (see :func:`test_a_throttle_keeps_its_limit_and_count_across_threads`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Each waiting thread's event, by thread id.
        self.blocked: dict[int, threading.Event] = {}

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            blocked = self.blocked.get(threading.get_ident())  # (none for the test's own)
            if blocked is not None:
                blocked.set()
            self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_a_throttle_keeps_its_limit_and_count_across_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer logs what emits of any thread meet (a full queue, a rejection), through
    one throttle: a switch of threads inside a line's check let another thread's line
    of the cause through in the same interval (two lines where one was allowed), and an
    increment of the held count read before the other thread's and written after it
    lost that one from the count the next line gives. Another thread logs at every
    point after a call where the GIL could pass to it."""
    handler = _Kept()
    records = handler.records
    logger = logging.getLogger("coda_memory.test.threads")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    throttle = LogThrottle(logger, 1.0, clock=lambda: 100.0)
    lock = _AnnouncedLock()
    monkeypatch.setattr(throttle, "_lock", lock, raising=False)
    threads: list[threading.Thread] = []
    main = threading.get_ident()

    def log_from_another_thread() -> None:
        if threading.get_ident() != main or len(threads) >= 20:
            return
        done_or_blocked = threading.Event()

        def run() -> None:
            lock.blocked[threading.get_ident()] = done_or_blocked
            throttle.warning("queue full", "coda-memory: dropped")
            done_or_blocked.set()

        thread = threading.Thread(target=run)
        threads.append(thread)
        thread.start()
        assert done_or_blocked.wait(10), "the other thread neither ran nor waited"

    try:
        with switches_after_calls(LogThrottle._log, log_from_another_thread):
            for _ in range(3):
                throttle.warning("queue full", "coda-memory: dropped")
        for thread in threads:
            thread.join(10)
        assert threads and not any(thread.is_alive() for thread in threads)
        lines = [record.getMessage() for record in records]
        assert lines == ["coda-memory: dropped"], "one line in the interval"
        throttle.flush()
        held = records[-1].args
        assert isinstance(held, tuple)
        assert held[0] == 3 + len(threads) - 1, "every line is counted, once"
    finally:
        logger.removeHandler(handler)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1")
def test_a_signal_handler_that_logs_through_the_throttle_as_it_checks_a_line_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A signal's handler (one that emits, meeting a full queue) runs in the main thread
    between two of its steps, while a line of it is checked: its own line is checked
    too, where it waited for ever for the check it interrupted."""
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        if reads == 2:  # within the second line's check
            signal.raise_signal(signal.SIGUSR1)
        return time.monotonic()

    throttle = LogThrottle(logging.getLogger("coda_memory.test.signal"), clock=clock)
    previous = signal.signal(signal.SIGUSR1, lambda *_: throttle.warning("c", "handler"))
    faulthandler.dump_traceback_later(10, exit=True)  # (a hang ends the run)
    try:
        with caplog.at_level(logging.WARNING, logger="coda_memory.test.signal"):
            throttle.warning("a", "first")
            throttle.warning("b", "second")
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGUSR1, previous)
    assert sorted(r.getMessage() for r in caplog.records) == ["first", "handler", "second"]
