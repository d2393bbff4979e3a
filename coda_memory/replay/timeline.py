"""Events grouped into sessions, split into a fitting and a held-out period."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from coda_memory.replay.events import Event, fact_subject


@dataclass(frozen=True)
class Session:
    """One identity's session: its events, and the facts they reinforce."""

    identity: str
    key: str
    start: datetime
    events: tuple[Event, ...]
    subjects: frozenset[str]


@dataclass
class Timeline:
    """The sessions of an event stream in order of start, and what is scored.

    ``split`` is the share of the timeline (by time, first to last event) used to fit; the
    sessions starting later are held out. A session is scored when its identity is among
    ``scored`` and had a session before. ``horizon`` is the calibration window: a fact's
    confidence at a session's start is taken as the probability that its subject is used
    in one of the identity's sessions starting within ``horizon`` from then.
    """

    sessions: list[Session]
    split_at: datetime
    horizon: timedelta
    scored: frozenset[str]
    #: The last event's time (None: the last session's start).
    ends_at: datetime | None = None
    _uses: dict[tuple[str, str], list[datetime]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for session in self.sessions:
            for subject in session.subjects:
                self._uses.setdefault((session.identity, subject), []).append(session.start)

    def used_within(self, identity: str, subject: str, start: datetime) -> bool:
        """Whether ``identity`` uses ``subject`` in a session starting within the horizon."""
        times = self._uses.get((identity, subject))
        if not times:
            return False
        index = bisect.bisect_left(times, start)
        return index < len(times) and times[index] - start < self.horizon

    def held_out(self, session: Session) -> bool:
        return session.start >= self.split_at

    def seen_through_horizon(self, session: Session) -> bool:
        """Whether the data runs a whole horizon past ``session``'s start: nearer its
        end, whether a subject is used again within the horizon is not known (taken as
        not used, it made confidence look over-confident). Calibration leaves such
        sessions out; their ranking counts."""
        end = self.ends_at if self.ends_at is not None else self.sessions[-1].start
        return end - session.start >= self.horizon

    def in_time_order(self) -> list[tuple[datetime, Session, Event | None]]:
        """Each session's start (with no event: the instant it is scored) and each of its
        events, in time order; at one instant, sessions start before events happen. A
        session scored at its start sees only what happened before it: the events of an
        earlier session that go on after it starts (sessions that overlap, a session id
        used again days later) come after, where sending each session whole before the
        next one starts gave its prediction what the earlier session did later."""
        steps: list[tuple[datetime, int, int, int, Session, Event | None]] = []
        for order, session in enumerate(self.sessions):
            steps.append((session.start, 0, order, -1, session, None))
            for position, event in enumerate(session.events):
                steps.append((event.time, 1, order, position, session, event))
        steps.sort(key=lambda step: step[:4])
        return [(at, session, event) for at, _, _, _, session, event in steps]

    def identities(self) -> list[str]:
        return sorted({s.identity for s in self.sessions})


def build_timeline(
    events: Sequence[Event],
    *,
    split: float = 0.7,
    horizon_days: float = 30.0,
    sample: int | None = None,
    min_sessions: int = 2,
    seed: int = 13,
) -> Timeline:
    """Sessions of ``events`` (in time order), the split instant, and the scored identities.

    ``sample`` scores that many identities drawn at random (with ``seed``) among those with
    at least ``min_sessions`` sessions; None scores every such identity.
    """
    if not events:
        raise ValueError("no events to replay")
    if not 0.0 < split < 1.0:
        raise ValueError("split must be in (0, 1)")
    ordered = sorted(events, key=lambda e: e.time)
    groups: dict[tuple[str, str], list[Event]] = {}
    for event in ordered:
        groups.setdefault((event.identity, event.session_key), []).append(event)
    sessions: list[Session] = []
    for (identity, key), members in groups.items():
        subjects = frozenset(s for e in members if (s := fact_subject(e)) is not None)
        sessions.append(Session(identity, key, members[0].time, tuple(members), subjects))
    sessions.sort(key=lambda s: (s.start, s.identity, s.key))
    first, last = ordered[0].time, ordered[-1].time
    counts: dict[str, int] = {}
    for session in sessions:
        counts[session.identity] = counts.get(session.identity, 0) + 1
    eligible = sorted(i for i, n in counts.items() if n >= min_sessions)
    if sample is not None and sample < len(eligible):
        eligible = sorted(random.Random(seed).sample(eligible, sample))
    return Timeline(
        sessions=sessions,
        split_at=first + (last - first) * split,
        horizon=timedelta(days=horizon_days),
        scored=frozenset(eligible),
        ends_at=last,
    )
