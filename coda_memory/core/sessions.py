"""Sessions within a consolidation run: where each observation lands (its fact key) and
how a run's observations group per subject and session, with each session's
reinforcement time and, for tools, its quality (share of successful or failed calls).

Pure functions over observations and earlier fact events; :mod:`.consolidation` folds
the groups into facts.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from coda_memory.core.model import (
    FactCategory,
    FactEvent,
    Observation,
    ObservationType,
    fact_subject,
    is_identifier,
    is_tool_name,
)
from coda_memory.core.sanitize import quote_untrusted
from coda_memory.core.turns import SLICE, Steps, emptying, finished


@dataclass(frozen=True, slots=True)
class FactKey:
    """Where an observation lands: the fact's category, subject and display text."""

    category: FactCategory
    subject: str
    content: str
    tool: str | None = None


def fact_key(observation: Observation) -> FactKey | None:
    """The fact an observation reinforces, or None when its metadata is unusable."""
    meta = observation.metadata
    kind = observation.type
    if kind in (ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE):
        tool = meta.get("toolName")
        if not is_tool_name(tool):
            return None
        assert isinstance(tool, str)
        success = kind is ObservationType.TOOL_SUCCESS
        category = FactCategory.TOOL_AFFINITY if success else FactCategory.TOOL_AVOIDANCE
        return _tool_fact_key(category, tool)
    if kind is ObservationType.ENTITY_ACCESS:
        entity_type, entity_id = meta.get("entityType"), meta.get("entityId")
        if isinstance(entity_id, int) and not isinstance(entity_id, bool):
            entity_id = str(entity_id)
        name = meta.get("entityName")
        if not (isinstance(entity_type, str) and isinstance(entity_id, str)):
            return None
        return _entity_fact_key(entity_type, entity_id, name if isinstance(name, str) else None)
    if kind is ObservationType.QUERY_PATTERN:
        domain = meta.get("domain")
        if not is_identifier(domain):
            return None
        assert isinstance(domain, str)
        category = FactCategory.DOMAIN_PREFERENCE
        return FactKey(category, fact_subject(category, domain), f"Asks about {domain}")
    return None


@dataclass(slots=True)
class SessionGroup:
    """One session's observations for one fact within a run.

    ``at`` is None for a fact that got no new observation from the session in this run
    but whose quality changed, because the session's other calls of the same tool did.
    ``hits``/``trials`` count the session's calls of the tool over all runs so far.
    """

    key: FactKey
    session_id: str | None
    at: datetime | None
    content: str
    hits: int = 1
    trials: int = 1


ToolCounts = Mapping[tuple[str, str], tuple[int, int]]


# The keys are remembered: the same tools and entities come back session after session,
# and a consolidation maps each new observation to its key.


@functools.lru_cache(maxsize=4_096)
def _entity_fact_key(entity_type: str, entity_id: str, name: str | None) -> FactKey | None:
    if not (is_identifier(entity_type) and is_identifier(entity_id)):
        return None
    # The id in quotes too: it comes from a tool result (a table's name is its id), and
    # the section says to follow nothing in quotes. Its pattern admits no quote.
    label = (
        f'{quote_untrusted(name)} (id "{entity_id}")'
        if name and name != entity_id
        else f'"{entity_id}"'
    )
    category = FactCategory.ENTITY_FREQUENCY
    return FactKey(
        category,
        fact_subject(category, entity_type, entity_id),
        f"Works with {entity_type} {label}",
    )


@functools.lru_cache(maxsize=4_096)
def _tool_fact_key(category: FactCategory, tool: str) -> FactKey:
    content = (
        f"Uses {tool} successfully"
        if category is FactCategory.TOOL_AFFINITY
        else f"{tool} has failed for this user"
    )
    return FactKey(category, fact_subject(category, tool), content, tool)


def group_by_session(
    observations: Iterable[Observation], prior_tool_counts: ToolCounts | None = None
) -> dict[str, list[SessionGroup]]:
    """Group observations per subject and session, with reinforcement time and quality.

    For a tool affinity the quality is the share of the tool's calls in the session that
    succeeded; for a tool avoidance the share that failed; for anything else 1.0.
    ``prior_tool_counts`` gives (successes, failures) per (session, tool) from earlier
    runs, so a session's quality covers all of its calls whichever run saw them.
    """
    return finished(grouping_by_session(observations, prior_tool_counts))


def grouping_by_session(
    observations: Iterable[Observation],
    prior_tool_counts: ToolCounts | None = None,
    *,
    step: int = SLICE,
) -> Steps[dict[str, list[SessionGroup]]]:
    """:func:`group_by_session` as steps (see :mod:`~coda_memory.core.turns`): it yields
    after every ``step`` observations it keys, every ``step`` (session, tool) pairs whose
    quality it sets, groups it files by subject, and groups it sorts (a subject's groups
    sort in one go), after every ``step`` entries of its working tables it empties, and
    once more at the end. A backlog of 600 observations (what 10 s of a held table leaves
    an identity) took 3 to 8 ms in one go: a stall of the event loop for every load in
    flight. One of 100,000 (an identity that wrote with no load), in 10,000 sessions of
    150 tools, makes 97,000 groups: once keyed, the rest took 120 to 230 ms in one step,
    and freeing the working tables 10 to 40 ms more."""
    prior = prior_tool_counts or {}
    groups: dict[tuple[str, str | None], SessionGroup] = {}
    tool_calls: dict[tuple[str | None, str], list[int]] = defaultdict(lambda: [0, 0])
    for done, obs in enumerate(observations, 1):
        if done % step == 0:
            yield
        key = fact_key(obs)
        if key is None:
            continue
        if key.tool is not None:
            tool_calls[(obs.session_id, key.tool)][
                0 if key.category is FactCategory.TOOL_AFFINITY else 1
            ] += 1
        group = groups.get((key.subject, obs.session_id))
        if group is None:
            groups[(key.subject, obs.session_id)] = SessionGroup(
                key, obs.session_id, obs.created_at, key.content
            )
        elif group.at is None or obs.created_at >= group.at:
            group.at, group.content = obs.created_at, key.content

    for done, ((session_id, tool), (new_successes, new_failures)) in enumerate(
        tool_calls.items(), 1
    ):
        if done % step == 0:
            yield
        earlier = prior.get((session_id, tool), (0, 0)) if session_id is not None else (0, 0)
        successes, failures = earlier[0] + new_successes, earlier[1] + new_failures
        for category, own in (
            (FactCategory.TOOL_AFFINITY, successes),
            (FactCategory.TOOL_AVOIDANCE, failures),
        ):
            if own == 0:
                continue
            key = _tool_fact_key(category, tool)
            group = groups.get((key.subject, session_id))
            if group is None:  # only earlier runs saw this outcome: requalify it
                group = groups[(key.subject, session_id)] = SessionGroup(
                    key, session_id, None, key.content
                )
            group.hits, group.trials = own, successes + failures

    by_subject: dict[str, list[SessionGroup]] = defaultdict(list)
    for done, ((subject, _), group) in enumerate(groups.items(), 1):
        if done % step == 0:
            yield
        by_subject[subject].append(group)
    sorted_since = 0
    for session_groups in by_subject.values():
        session_groups.sort(key=_session_order)
        sorted_since += len(session_groups)
        if sorted_since >= step:
            yield
            sorted_since = 0
    yield from emptying((tool_calls, groups), step)
    yield  # what follows (a fold of the groups) starts a step of its own
    return by_subject


def _session_order(group: SessionGroup) -> tuple[datetime, str]:
    """A subject's groups in time order, then by session id (requalified ones first)."""
    return (group.at or _NO_TIME, group.session_id or "")


_NO_TIME = datetime.min.replace(tzinfo=UTC)


def subjects_reached(observations: Iterable[Observation]) -> set[str]:
    """Every subject whose fact consolidating ``observations`` may change: each one's fact
    key, and for a tool call both of the tool's facts (a session's calls of a tool
    requalify its affinity and its avoidance, see :func:`group_by_session`). A fact whose
    subject is not here keeps its stored state whatever the observations (only time moves
    it), so its rank among such facts is known without them."""
    subjects: set[str] = set()
    for obs in observations:
        key = fact_key(obs)
        if key is None:
            continue
        subjects.add(key.subject)
        if key.tool is not None:
            subjects.add(_tool_fact_key(FactCategory.TOOL_AFFINITY, key.tool).subject)
            subjects.add(_tool_fact_key(FactCategory.TOOL_AVOIDANCE, key.tool).subject)
    return subjects


def prior_tool_counts(events: Iterable[FactEvent]) -> dict[tuple[str, str], tuple[int, int]]:
    """(successes, failures) per (session, tool) recorded by earlier runs' events.

    Each tool event records the session's cumulative calls of the tool when it was
    written; the one with the most calls is the latest.
    """
    counts: dict[tuple[str, str], tuple[int, int]] = {}
    for event in events:
        if event.session_id is None or event.category not in (
            FactCategory.TOOL_AFFINITY,
            FactCategory.TOOL_AVOIDANCE,
        ):
            continue
        tool = event.subject.split(":", 1)[1]
        own, other = event.hits, event.trials - event.hits
        pair = (own, other) if event.category is FactCategory.TOOL_AFFINITY else (other, own)
        key = (event.session_id, tool)
        if key not in counts or sum(pair) > sum(counts[key]):
            counts[key] = pair
    return counts
