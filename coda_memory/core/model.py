"""The domain model: observations, facts, fact events and what `load_memory` returns.

Pure data, no I/O. Datetimes are always tz-aware UTC once inside a model.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: Tool names, entity types, entity ids and domains must match this pattern:
#: letters, digits and ``_ . : - / @``, 1 to 200 characters.
IDENTIFIER_PATTERN = re.compile(r"[A-Za-z0-9_.:\-/@]{1,200}")


def is_identifier(value: object) -> bool:
    """True when ``value`` is a string matching :data:`IDENTIFIER_PATTERN`."""
    return isinstance(value, str) and IDENTIFIER_PATTERN.fullmatch(value) is not None


#: Tool names are narrower: letters, digits and ``_ . -``, 1 to 128 characters (what the
#: Converse, OpenAI, Anthropic and MCP tool APIs accept), so no name reads as
#: ``SYSTEM:…`` or as a URL.
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")

#: The largest 32-bit integer (a Postgres ``integer``): the bound of every count, size and
#: millisecond timeout that a store keeps or binds as one.
MAX_INT32 = 2**31 - 1
#: The largest reinforcement count a fact holds: a reinforcement past it keeps the count
#: there.
MAX_REINFORCEMENT_COUNT = MAX_INT32
#: The longest span of time the library takes (retention, clock skew, analytics windows):
#: instants that far from now are still dates and timestamps (much longer ones failed
#: with "timestamp out of range" or OverflowError).
MAX_SPAN = timedelta(days=36_500)
#: How far past now an observation's ``created_at`` may be: a later one is stored as made
#: now (a service's default ``max_clock_skew``; the Redis import's, for facts' times too).
DEFAULT_MAX_CLOCK_SKEW = timedelta(minutes=5)


def is_tool_name(value: object) -> bool:
    """True when ``value`` is a string matching :data:`TOOL_NAME_PATTERN`."""
    return isinstance(value, str) and TOOL_NAME_PATTERN.fullmatch(value) is not None


def as_utc(value: datetime) -> datetime:
    """Return ``value`` as tz-aware UTC; a naive datetime is refused."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("datetimes must be timezone-aware (naive datetimes are ambiguous)")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31 23:00 at UTC-5 is past year 9999 in UTC
        raise ValueError("datetimes must be within years 1 to 9999 in UTC") from None


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]


class ObservationType(StrEnum):
    """What kind of event an observation records."""

    TOOL_SUCCESS = "tool_success"
    TOOL_FAILURE = "tool_failure"
    ENTITY_ACCESS = "entity_access"
    QUERY_PATTERN = "query_pattern"


class FactCategory(StrEnum):
    """Classification of a consolidated fact."""

    TOOL_AFFINITY = "tool_affinity"
    TOOL_AVOIDANCE = "tool_avoidance"
    ENTITY_FREQUENCY = "entity_frequency"
    DOMAIN_PREFERENCE = "domain_preference"
    FAILURE_PATTERN = "failure_pattern"


class NewObservation(BaseModel):
    """An observation as the host application emits it.

    ``created_at`` of None means "now by the service clock" at emit time.
    Metadata keys follow the design: ``toolName``, ``durationMs``, ``error``,
    ``entityType``, ``entityId``, ``entityName``, ``domain``, ``query``.
    """

    model_config = ConfigDict(frozen=True)

    type: ObservationType
    content: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    session_id: str | None = None
    created_at: UtcDatetime | None = None


class Observation(BaseModel):
    """The stored form of an observation."""

    model_config = ConfigDict(frozen=True)

    id: int
    identity_id: str
    type: ObservationType
    content: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    session_id: str | None = None
    created_at: UtcDatetime


class Fact(BaseModel):
    """A durable belief about one identity, derived from observations.

    ``confidence`` is the value at ``confidence_at`` (None: at ``last_reinforced_at``);
    the confidence seen at any instant is ``decay.decayed(fact, instant)``.
    """

    model_config = ConfigDict(frozen=True)

    id: str
    identity_id: str
    category: FactCategory
    subject: str
    content: str
    confidence: float
    reinforcement_count: int
    last_reinforced_at: UtcDatetime
    created_at: UtcDatetime
    updated_at: UtcDatetime
    ease_factor: float | None = None
    confidence_at: UtcDatetime | None = None

    @property
    def anchor(self) -> datetime:
        """The instant ``confidence`` refers to."""
        return self.confidence_at if self.confidence_at is not None else self.last_reinforced_at


def fact_id(subject: str) -> str:
    """The deterministic fact id for a subject."""
    return f"fact:{subject}"


class FactEventKind(StrEnum):
    """What happened to a fact; the history answers "why does the agent think this?"."""

    CREATED = "created"
    REINFORCED = "reinforced"
    #: A session that already reinforced the fact sent a later observation for it, so the
    #: session's reinforcement moved to that later time (still one reinforcement).
    EXTENDED = "extended"
    EXPIRED = "expired"


class FactEvent(BaseModel):
    """One entry of a fact's history.

    For CREATED/REINFORCED/EXTENDED events ``confidence_before``, ``ease_before`` and
    ``count_before`` are the fact's state just before the session's reinforcement (None
    when the fact did not exist), so a later observation of the same session can redo
    the reinforcement at its later time. ``hits``/``trials`` are the session's
    observations behind the quality (successes or failures out of the tool's calls).
    """

    model_config = ConfigDict(frozen=True)

    identity_id: str
    subject: str
    category: FactCategory
    kind: FactEventKind
    session_id: str | None
    at: UtcDatetime
    confidence_before: float | None
    confidence_after: float | None
    count_before: int | None
    count_after: int | None
    ease_before: float | None = None
    ease_after: float | None = None
    quality: float | None = None
    hits: int = 0
    trials: int = 0


class LoadedMemory(BaseModel):
    """What `MemoryService.load_memory` returns: facts, the prompt section, affinities."""

    model_config = ConfigDict(frozen=True)

    facts: list[Fact] = Field(default_factory=list)
    prompt_section: str = ""
    tool_affinities: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def empty(cls) -> LoadedMemory:
        return cls()


def fact_subject(category: FactCategory, *parts: str) -> str:
    """Build a subject such as ``tool_affinity:get_account``."""
    return ":".join((category, *parts))  # a StrEnum member is its value


M = TypeVar("M", bound=BaseModel)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many acyclic models at once.

    Thousands of new objects would otherwise trigger full collections whose cost grows
    with the whole heap, making a large identity's consolidation superlinear in its facts.
    Nothing built inside may form reference cycles; no ``await`` may happen inside.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: One "fields set" per frozen model class, shared by its trusted instances: every field
#: is given, and pydantic changes a frozen model's set only on copies of it.
_ALL_FIELDS: dict[type[BaseModel], set[str]] = {}


def _fields_set(cls: type[BaseModel], values: dict[str, Any]) -> set[str]:
    shared = _ALL_FIELDS.get(cls)
    if shared is None:
        if not cls.model_config.get("frozen"):
            return set(values)
        shared = _ALL_FIELDS.setdefault(cls, set(cls.model_fields))
    return shared


def trusted(cls: type[M], **values: Any) -> M:
    """A model from values that are already valid (rows we wrote, copies of models),
    without validation: the hot paths build thousands of these. Every field must be given.
    """
    return trusted_from(cls, values)


#: The setters of the slots every pydantic model has (``BaseModel.__slots__``): through
#: them a set skips the attribute lookup that ``object.__setattr__`` makes.
_SLOTS = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
_set_dict, _set_fields_set, _set_extra, _set_private = (vars(BaseModel)[n].__set__ for n in _SLOTS)


def trusted_from(cls: type[M], values: dict[str, Any]) -> M:
    """:func:`trusted` with the values in a dict, which the model keeps (not copied)."""
    model = cls.__new__(cls)
    _set_dict(model, values)
    _set_fields_set(model, _fields_set(cls, values))
    _set_extra(model, None)
    _set_private(model, None)
    return model


def replaced(model: M, **changes: Any) -> M:
    """``model`` with ``changes``, like ``model.model_copy(update=changes)`` (which does not
    validate either) at a third of its cost: consolidation copies every fact it
    reinforces. The changes must be valid values of their fields."""
    values = model.__dict__.copy()
    values.update(changes)
    return trusted_from(type(model), values)


def with_confidence(fact: Fact, confidence: float, at: datetime) -> Fact:
    """``fact`` with ``confidence`` at ``at``: a view of it at that instant. The cheapest
    copy of a fact (a dict copy, no validation), since loads build one per fact."""
    values = fact.__dict__.copy()
    values["confidence"] = confidence
    values["confidence_at"] = at
    return trusted_fact(values)


def trusted_fact(values: dict[str, Any]) -> Fact:
    """:func:`trusted_from` for a :class:`Fact` (the dict holds every field and is kept),
    at a third of its cost: loads build one per fact."""
    fact = _new_fact(Fact)
    _set_dict(fact, values)
    _set_fields_set(fact, _FACT_FIELDS)
    _set_extra(fact, None)
    _set_private(fact, None)
    return fact


_new_fact = Fact.__new__
_FACT_FIELDS = _ALL_FIELDS.setdefault(Fact, set(Fact.model_fields))
