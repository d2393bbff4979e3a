"""The replay's event format: who did what, when, on which subject.

One event per line, JSON lines (``.jsonl``) or CSV with a header (``.csv``)::

    {"identity": "ana", "time": "2026-11-02T09:14:00Z", "kind": "entity_access",
     "subject": "account:acct-118", "session": "ana-42"}

``kind`` is an observation type: ``tool_success`` and ``tool_failure`` (``subject`` is the
tool name), ``entity_access`` (``subject`` is ``type:id``) or ``query_pattern``
(``subject`` is the domain). ``time`` is ISO-8601 with a zone (a naive time is UTC).
``session`` is optional: without it, an identity's events of one UTC day are one session.
Subjects must match :data:`~coda_memory.core.model.IDENTIFIER_PATTERN`.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from coda_memory.core.consolidation import fact_key
from coda_memory.core.model import NewObservation, Observation, ObservationType, is_identifier
from coda_memory.core.sanitize import (
    MAX_SESSION_CHARS,
    ObservationRejected,
    check_identity,
    has_nul_or_surrogate,
)

FIELDS = ("identity", "time", "kind", "subject", "session")


@dataclass(frozen=True, slots=True)
class Event:
    """One thing an identity did: ``kind`` on ``subject`` at ``time``."""

    identity: str
    time: datetime
    kind: ObservationType
    subject: str
    session: str | None = None

    @property
    def session_key(self) -> str:
        """The session the event belongs to: its own, or the identity's UTC day."""
        return self.session if self.session else self.time.astimezone(UTC).date().isoformat()


def _metadata(kind: ObservationType, subject: str) -> dict[str, Any]:
    if kind in (ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE):
        return {"toolName": subject}
    if kind is ObservationType.ENTITY_ACCESS:
        entity_type, _, entity_id = subject.partition(":")
        return {"entityType": entity_type, "entityId": entity_id}
    return {"domain": subject}


def event_observation(event: Event, session_id: str) -> NewObservation:
    """The observation an agent server would have emitted for ``event``."""
    return NewObservation(
        type=event.kind,
        content=event.subject,
        metadata=_metadata(event.kind, event.subject),
        session_id=session_id,
        created_at=event.time,
    )


def fact_subject(event: Event) -> str | None:
    """The subject of the fact ``event`` reinforces (None: it reinforces none)."""
    return _fact_subject(event.kind, event.subject)


@functools.lru_cache(maxsize=65_536)
def _fact_subject(kind: ObservationType, subject: str) -> str | None:
    observation = Observation(
        id=0,
        identity_id="-",
        type=kind,
        content="",
        metadata=_metadata(kind, subject),
        created_at=datetime(2000, 1, 1, tzinfo=UTC),
    )
    key = fact_key(observation)
    return None if key is None else key.subject


def observation_event(observation: Observation) -> Event | None:
    """The event of a stored observation (None when its metadata names no subject)."""
    meta = observation.metadata
    kind = observation.type
    subject: object
    if kind in (ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE):
        subject = meta.get("toolName")
    elif kind is ObservationType.ENTITY_ACCESS:
        subject = f"{meta.get('entityType')}:{meta.get('entityId')}"
    else:
        subject = meta.get("domain")
    if not isinstance(subject, str) or not all(is_identifier(p) for p in subject.split(":", 1)):
        return None
    return Event(
        observation.identity_id, observation.created_at, kind, subject, observation.session_id
    )


#: The first and last instants a datetime holds, which the service refuses as a date.
_EDGES = (datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC))


def parse_time(text: str) -> datetime:
    """``text`` as an aware datetime; ValueError for a time the service refuses: one
    that is no date in UTC (before year 1 or after 9999 once its offset is taken off) or
    the first or last instant a datetime holds."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    value = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{text!r} is out of the range of dates in UTC") from None
    if utc in _EDGES:
        raise ValueError(f"{text!r} is the first or last instant of a datetime")
    return value


def event_from_mapping(row: dict[str, Any], where: str) -> Event:
    """An event from one parsed line; ``where`` names the line in errors."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: not an event (a {type(row).__name__}, not an object)")
    # A JSON null, or a CSV line short of a field: read as text, it was the string "None".
    missing = [name for name in FIELDS[:4] if name in row and row[name] is None]
    if missing:
        raise ValueError(f"{where}: not an event (no {', '.join(missing)})")
    try:
        identity, subject = str(row["identity"]), str(row["subject"])
        kind = ObservationType(row["kind"])
        time = parse_time(str(row["time"]))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{where}: not an event ({exc})") from exc
    if not identity or not all(is_identifier(part) for part in subject.split(":", 1)):
        raise ValueError(f"{where}: bad identity or subject {subject!r}")
    session = row.get("session")
    # (Not "or None": a JSON session 0 was read as none, its events the day's session.)
    session = None if session is None or session == "" else str(session)
    # What the service would reject (its writer drops it with a log line): memory would
    # then score nothing, while the baselines score the event.
    try:
        check_identity(identity)
    except ObservationRejected as exc:
        raise ValueError(f"{where}: the service refuses the identity ({exc})") from None
    if session is not None and (len(session) > MAX_SESSION_CHARS or has_nul_or_surrogate(session)):
        raise ValueError(
            f"{where}: the service refuses the session (longer than {MAX_SESSION_CHARS} "
            "characters, or holding NUL or a lone surrogate)"
        )
    event = Event(identity, time, kind, subject, session)
    if fact_subject(event) is None:
        # Its session was scored on nothing it used, for every method alike.
        raise ValueError(f"{where}: the service keeps no fact of it ({_NO_FACT[kind]})")
    return event


#: Why an event that passed the identifier rule reinforces no fact, by kind.
_NO_FACT = {
    ObservationType.TOOL_SUCCESS: "a tool name is 1 to 128 of A-Z, a-z, 0-9 and _.-",
    ObservationType.TOOL_FAILURE: "a tool name is 1 to 128 of A-Z, a-z, 0-9 and _.-",
    ObservationType.ENTITY_ACCESS: "an entity is type:id",
    ObservationType.QUERY_PATTERN: "a domain follows the identifier rule",
}


def read_events(path: Path) -> list[Event]:
    """The events of a ``.jsonl`` or ``.csv`` file, in time order. ValueError, naming the
    file (and the line), for anything that is not such a file."""
    events: list[Event] = []
    try:
        # utf-8-sig: a byte order mark (Excel's "CSV UTF-8" writes one) was read as part
        # of the first column's name, and every line lacked an identity.
        with path.open(encoding="utf-8-sig", newline="") as file:
            if path.suffix.lower() == ".csv":
                for number, row in enumerate(csv.DictReader(file), start=2):
                    events.append(event_from_mapping(dict(row), f"{path}:{number}"))
            else:
                for number, line in enumerate(file, start=1):
                    if line.strip():
                        events.append(
                            event_from_mapping(_json(line, path, number), f"{path}:{number}")
                        )
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except csv.Error as exc:
        raise ValueError(f"{path}: not a CSV file ({exc})") from exc
    events.sort(key=lambda e: e.time)
    return events


def _json(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc


def event_record(event: Event) -> dict[str, str]:
    record = {
        "identity": event.identity,
        "time": event.time.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "kind": event.kind.value,
        "subject": event.subject,
    }
    if event.session:
        record["session"] = event.session
    return record


def write_events(path: Path, events: Iterable[Event]) -> None:
    """Write ``events`` as JSON lines (or CSV when ``path`` ends in ``.csv``)."""
    with path.open("w", encoding="utf-8", newline="") as file:
        if path.suffix.lower() == ".csv":
            writer = csv.DictWriter(file, fieldnames=FIELDS)
            writer.writeheader()
            for event in events:
                writer.writerow(event_record(event))
        else:
            for event in events:
                file.write(json.dumps(event_record(event)) + "\n")


def by_identity(events: Iterable[Event]) -> Iterator[tuple[str, list[Event]]]:
    groups: dict[str, list[Event]] = {}
    for event in events:
        groups.setdefault(event.identity, []).append(event)
    yield from groups.items()
