"""Observations from tool calls, entity accesses and user queries.

Pure functions that turn what a host application already has (Bedrock Converse style
tool-use and tool-result blocks, parsed tool results, the user's message) into
:class:`~coda_memory.core.model.NewObservation` values. ``created_at`` is left None: the
service stamps it. Nothing here raises on unexpected shapes of the data (blocks, results,
queries); it emits less instead. An option of the wrong type (``max_entities``) is a
TypeError naming it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from coda_memory.core.caps import DEFAULT_MAX_ENTITIES_PER_RESULT, CapCounter, LogThrottle
from coda_memory.core.model import NewObservation, ObservationType, is_identifier, is_tool_name
from coda_memory.core.sanitize import (
    MAX_ENTITY_NAME_CHARS,
    MAX_METADATA_INT,
    clean_text,
    quote_untrusted,
)
from coda_memory.core.untrusted import data_text, read_window

logger = logging.getLogger(__name__)

META_TOOLS: frozenset[str] = frozenset({"search_tools"})
MAX_ERROR_CHARS = 500
MAX_QUERY_CHARS = 500
#: How much of a query the domain patterns are matched on: its first characters (a
#: pasted log of a megabyte took 0.3 s of the caller's event loop to clean and match).
MAX_QUERY_MATCH_CHARS = 4_000
#: Bigger integers cannot be identifiers (200 characters) and are costly to print.
_MAX_ID_INT = 10**200

#: Tool results whose entities were capped in this process (``MemoryService.stats``).
_throttled = LogThrottle(logger)
ENTITY_CAP = CapCounter(_throttled, "entities per tool result capped")


class ToolUse(BaseModel):
    """A tool invocation requested by the model (a Converse ``toolUse`` block; the block as
    received, with ``toolUseId``, validates too)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(validation_alias=AliasChoices("id", "toolUseId"))
    name: str
    input: Any = None


class ToolResult(BaseModel):
    """The result of one tool invocation (a Converse ``toolResult`` block; the block as
    received, with ``toolUseId`` and ``status``, validates too: ``"error"`` is an error)."""

    model_config = ConfigDict(frozen=True)

    tool_use_id: str = Field(validation_alias=AliasChoices("tool_use_id", "toolUseId"))
    is_error: bool = False
    content: Any = None

    @model_validator(mode="before")
    @classmethod
    def _converse_status(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "status" in data and "is_error" not in data:
            return {**data, "is_error": data["status"] == "error"}
        return data


def _blocks(blocks: Iterable[Any], model: type[ToolUse] | type[ToolResult]) -> Iterator[Any]:
    """The blocks as models: a model as it is, a mapping (a block as received, or a
    content block that wraps one: ``{"toolUse": {…}}``) validated, anything that does not
    validate skipped; none when ``blocks`` is not iterable (a response's None)."""
    if not isinstance(blocks, Iterable):
        return
    wrapper = "toolUse" if model is ToolUse else "toolResult"
    for block in blocks:
        if isinstance(block, Mapping) and isinstance(block.get(wrapper), Mapping):
            block = block[wrapper]
        if isinstance(block, model):
            yield block
        elif isinstance(block, Mapping):
            try:
                yield model.model_validate(block)
            except ValidationError:
                continue


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)


def _compact_json(value: Any, max_chars: int) -> str:
    """``value`` as compact JSON, encoded only as far as its first ``max_chars``
    characters and a little more: an error result of 300,000 rows is not written out
    whole (a quarter of a second on the event loop) to keep 500 characters of it. What
    cannot be encoded gives the name of ``value``'s class, also when a value's ``str()``
    (the encoder's fallback) raises: it is the host's object, and it raised to the host."""
    parts: list[str] = []
    size = 0
    try:
        for part in _COMPACT.iterencode(
            _cut_strings(value, [max_chars], set(), read_window(max_chars))
        ):
            parts.append(part)
            size += len(part)
            if size > max_chars:
                break
    except Exception:
        return f"<{type(value).__name__}>"
    return "".join(parts)


def _cut_strings(value: Any, left: list[int], path: set[int], cut_at: int) -> Any:
    """``value`` as far as JSON encodes its first ``left[0]`` characters, its strings
    (keys too) cut to ``cut_at`` characters (more than the error's cleaning reads): the
    items of its containers past those characters are left out (each item is counted at
    the fewest characters it is encoded in). A string is encoded whole, as one part: a
    nested one of 50 MB held the event loop for a third of a second to keep 500
    characters. A container met again inside itself raises ValueError, as the encoder
    does."""
    if isinstance(value, str):
        left[0] -= len(value) + 2
        return value[:cut_at]
    left[0] -= 1  # (a container's opening bracket)
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) in path:
        raise ValueError("Circular reference detected")
    path.add(id(value))
    if isinstance(value, dict):
        cut: Any = {}
        for key, item in value.items():
            if left[0] < 0:
                break
            cut[_cut_strings(key, left, path, cut_at)] = _cut_strings(item, left, path, cut_at)
    else:
        cut = []
        for item in value:
            if left[0] < 0:
                break
            cut.append(_cut_strings(item, left, path, cut_at))
    path.discard(id(value))
    return cut


def _error_text(content: Any, depth: int = 0) -> str:
    if isinstance(content, str):
        return content
    if depth < 3 and isinstance(content, Mapping):
        for key in ("error", "message"):
            if key in content and content[key] is not None:
                return _error_text(content[key], depth + 1)
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and isinstance(block.get("text"), str):
                return str(block["text"])
    # Twice the cap: cleaning may remove some of it.
    return _compact_json(content, 2 * MAX_ERROR_CHARS)


def _duration(value: object) -> float | int | None:
    """``value`` as a ``durationMs`` the writer stores, else None: a finite float >= 0, or
    an int from 0 to :data:`~coda_memory.core.sanitize.MAX_METADATA_INT` (a larger one
    made the writer reject the whole observation, and one past a float's range raised
    OverflowError here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_METADATA_INT else None
    return value if math.isfinite(value) and value >= 0 else None


def tool_observations(
    tool_uses: Sequence[ToolUse | Mapping[str, Any]],
    tool_results: Sequence[ToolResult | Mapping[str, Any]],
    timings_ms: Mapping[str, float] | None,
    *,
    session_id: str | None = None,
    meta_tools: Collection[str] = META_TOOLS,
) -> list[NewObservation]:
    """One tool_success or tool_failure observation per tool use that has a result.

    Results are matched to uses by id (the first result for an id counts); uses
    without a result, meta tools and tools whose name does not match
    :data:`~coda_memory.core.model.TOOL_NAME_PATTERN` are skipped. ``durationMs`` comes
    from ``timings_ms[tool_use.id]`` and is omitted when absent or not a finite number
    >= 0 (an int past 2**63 - 1 too, which the writer would refuse). Failures carry
    ``error``: the text of the result (a string, ``error``/``message`` of a mapping, the
    first text block of a content list, else compact JSON), cleaned to one line of at
    most 500 characters.
    """
    results: dict[str, ToolResult] = {}
    for tool_result in _blocks(tool_results, ToolResult):
        results.setdefault(tool_result.tool_use_id, tool_result)
    if not isinstance(timings_ms, Mapping):
        timings_ms = {}
    observations: list[NewObservation] = []
    for use in _blocks(tool_uses, ToolUse):
        result = results.get(use.id)
        if result is None or use.name in meta_tools or not is_tool_name(use.name):
            continue
        metadata: dict[str, Any] = {"toolName": use.name}
        duration = _duration(timings_ms.get(use.id))
        if duration is not None:
            metadata["durationMs"] = duration
        if result.is_error:
            error = "" if result.content is None else _error_text(result.content)
            error = clean_text(error, MAX_ERROR_CHARS)
            if error:
                metadata["error"] = error
            content = f"{use.name} failed: {error}" if error else f"{use.name} failed"
            obs_type = ObservationType.TOOL_FAILURE
        else:
            timing = f" ({duration:.0f} ms)" if duration is not None else ""
            content = f"{use.name} succeeded{timing}"
            obs_type = ObservationType.TOOL_SUCCESS
        observations.append(
            NewObservation(type=obs_type, content=content, metadata=metadata, session_id=session_id)
        )
    return observations


@dataclass(frozen=True, slots=True)
class EntityRef:
    """An entity a tool result mentions."""

    entity_type: str
    entity_id: str
    entity_name: str | None = None


EntityExtractor = Callable[[Any], Iterable[EntityRef]]


#: A tool result given as JSON text longer than this (characters of a str, bytes of
#: bytes) is not parsed for entities, since a parse is whole or nothing: 7.7 MB held the
#: caller's event loop for 83 ms, and this much takes about 10 ms at most (dense
#: numbers), 2 ms as rows of records. One that starts as an object or array is counted
#: in :data:`ENTITY_CAP` (as a result whose entities went unread) and logged.
MAX_JSON_TEXT_CHARS = 250_000


def _parse_json(text: str | bytes | bytearray) -> Any:
    """``text`` parsed, or None when it is no JSON or longer than
    :data:`MAX_JSON_TEXT_CHARS`."""
    if len(text) > MAX_JSON_TEXT_CHARS:
        if _starts_as_json(text):
            ENTITY_CAP.hit(
                1, f"a result's JSON text is longer than {MAX_JSON_TEXT_CHARS:,}, not parsed"
            )
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _starts_as_json(text: str | bytes | bytearray) -> bool:
    """Whether ``text`` starts as a JSON object or array would."""
    return text[:64].lstrip()[:1] in ("{", "[", b"{", b"[")


def unwrap_result(result: Any) -> Any:
    """A tool result as data: JSON text is parsed (none longer than
    :data:`MAX_JSON_TEXT_CHARS`), and a Converse content-block list (``[{"json": ...}]``
    or ``[{"text": "<json>"}]``) yields its first JSON payload."""
    if isinstance(result, str | bytes | bytearray):
        return _parse_json(result)
    if isinstance(result, list) and result and isinstance(result[0], Mapping):
        if not any(key in result[0] for key in ("json", "text")):
            return result
        for block in result:
            if not isinstance(block, Mapping):
                continue
            if "json" in block:
                return block["json"]
            text = block.get("text")
            if isinstance(text, str):
                parsed = _parse_json(text)
                # The payload, or JSON text too long to parse: no entities then (a later
                # block, a caption say, is not the payload).
                if parsed is not None or (
                    len(text) > MAX_JSON_TEXT_CHARS and _starts_as_json(text)
                ):
                    return parsed
        return None
    return result


class EntityExtractors:
    """A registry of entity extractors by tool name; host applications add their own.

    Copy :data:`DEFAULT_ENTITY_EXTRACTORS` before extending it, unless changing the
    process-wide default is intended.
    """

    def __init__(self, extractors: Mapping[str, EntityExtractor] | None = None) -> None:
        self._extractors: dict[str, EntityExtractor] = dict(extractors or {})

    def register(self, tool_name: str, extractor: EntityExtractor) -> None:
        """Use ``extractor`` for ``tool_name``'s results, replacing any previous one."""
        self._extractors[tool_name] = extractor

    def unregister(self, tool_name: str) -> None:
        """Stop extracting entities from ``tool_name``; unknown names are ignored."""
        self._extractors.pop(tool_name, None)

    def __contains__(self, tool_name: object) -> bool:
        return tool_name in self._extractors

    def get(self, tool_name: str) -> EntityExtractor | None:
        """The extractor for ``tool_name``, if any."""
        return self._extractors.get(tool_name)

    def copy(self) -> EntityExtractors:
        """An independent registry with the same extractors."""
        return EntityExtractors(self._extractors)

    def extract(self, tool_name: str, result: Any) -> list[EntityRef]:
        """The entities in ``result``; [] for unknown tools, bad shapes or a failing
        extractor (logged at debug level, never raised)."""
        try:
            return list(self.refs(tool_name, result))
        except Exception as error:
            _extractor_failed(tool_name, error)
            return []

    def refs(self, tool_name: str, result: Any) -> Iterator[EntityRef]:
        """The entities in ``result`` as the extractor gives them, one at a time (for a
        caller that reads only some); raises what the extractor raises."""
        extractor = self._extractors.get(tool_name)
        if extractor is None:
            return
        for ref in extractor(unwrap_result(result)):
            if isinstance(ref, EntityRef):
                yield ref


def _extractor_failed(tool_name: str, error: Exception) -> None:
    # Extractors are host code run on untrusted data; memory is best-effort. The error's
    # text and traceback may quote that data: only its class is logged.
    # One line a second at most: a failing extractor fails on every result of its tool.
    _throttled.debug(
        "entity extractor failed",
        "entity extractor for %r failed (%s)",
        tool_name,
        type(error).__name__,
    )


def _entity_id(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < _MAX_ID_INT:
        return str(value)
    return None


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _mappings(data: Any, key: str) -> Iterator[Mapping[str, Any]]:
    items = data.get(key) if isinstance(data, Mapping) else None
    if isinstance(items, list):
        yield from (item for item in items if isinstance(item, Mapping))


def extract_account(data: Any) -> Iterator[EntityRef]:
    """``{"id": str | int, "name"?: str}`` → one ``account``."""
    if isinstance(data, Mapping) and (entity_id := _entity_id(data.get("id"))) is not None:
        yield EntityRef("account", entity_id, _optional_str(data.get("name")))


def extract_schema_tables(data: Any) -> Iterator[EntityRef]:
    """``{"tables": [{"name": str}, ...]}`` → one ``schema_table`` per table."""
    for table in _mappings(data, "tables"):
        name = table.get("name")
        if isinstance(name, str):
            yield EntityRef("schema_table", name, name)


def extract_products(data: Any) -> Iterator[EntityRef]:
    """``{"products": [{"id": str | int, "title"?: str}, ...]}`` → one ``product`` each."""
    for product in _mappings(data, "products"):
        if (entity_id := _entity_id(product.get("id"))) is not None:
            yield EntityRef("product", entity_id, _optional_str(product.get("title")))


DEFAULT_ENTITY_EXTRACTORS = EntityExtractors(
    {
        "get_account": extract_account,
        "search_snowflake_schema": extract_schema_tables,
        "get_products_by_isrc": extract_products,
    }
)


def entity_observations(
    tool_name: str,
    result: Any,
    *,
    session_id: str | None = None,
    extractors: EntityExtractors | None = None,
    max_entities: int | None = DEFAULT_MAX_ENTITIES_PER_RESULT,
) -> list[NewObservation]:
    """entity_access observations for the entities in one tool result.

    ``extractors`` defaults to :data:`DEFAULT_ENTITY_EXTRACTORS`. Entities whose type
    or id is not an identifier are skipped, as are repeats within the result. At most
    ``max_entities`` are taken (None: all), the first ones in the result's own order
    (its ranking), found among its first :data:`REFS_READ_PER_ENTITY` times
    ``max_entities`` references (at least :data:`MIN_REFS_READ`), and the result is read
    no further; a cap or a read bound that applies is counted in :data:`ENTITY_CAP`
    (``applied``; ``dropped`` counts one a result, the rest being unread) and logged. A
    result given as JSON text longer than :data:`MAX_JSON_TEXT_CHARS` is not parsed: it
    gives no entities (counted alike when it starts as an object or array).
    """
    if max_entities is not None and (
        isinstance(max_entities, bool) or not isinstance(max_entities, int) or max_entities < 0
    ):
        raise TypeError(f"max_entities must be a whole number or None, not {max_entities!r}")
    registry = DEFAULT_ENTITY_EXTRACTORS if extractors is None else extractors
    try:
        refs, unread = _capped_refs(registry.refs(tool_name, result), max_entities)
    except Exception as error:
        _extractor_failed(tool_name, error)
        return []
    capped = max_entities is not None and len(refs) > max_entities
    observations: list[NewObservation] = []
    for ref in refs[:max_entities]:
        metadata: dict[str, Any] = {"entityType": ref.entity_type, "entityId": ref.entity_id}
        raw_name = ref.entity_name if isinstance(ref.entity_name, str) else ""
        name = data_text(raw_name, MAX_ENTITY_NAME_CHARS)
        if name:
            metadata["entityName"] = name
        shown = quote_untrusted(name) if name else ref.entity_id
        observations.append(
            NewObservation(
                type=ObservationType.ENTITY_ACCESS,
                content=f"Accessed {ref.entity_type} {shown}",
                metadata=metadata,
                session_id=session_id,
            )
        )
    if capped:
        ENTITY_CAP.hit(1, f"{tool_name!r} gave more than {max_entities}, kept the first of them")
    elif unread:
        ENTITY_CAP.hit(
            1, f"{tool_name!r} gave more references than read, kept the entities among the first"
        )
    return observations


#: How many of a result's entity references are read at most, for each one taken
#: (:data:`MIN_REFS_READ` at least): repeats and references that are no identifiers
#: count too, so a result of 300,000 rows naming one product costs what one of a few
#: hundred does (read whole: 0.7 s of the caller's event loop).
REFS_READ_PER_ENTITY = 10
MIN_REFS_READ = 1_000


def _capped_refs(
    refs: Iterator[EntityRef], max_entities: int | None
) -> tuple[list[EntityRef], bool]:
    """The distinct entities of ``refs`` whose type and id are identifiers, in order: at
    most ``max_entities`` and one more when there are more (None: all), from the first
    :data:`REFS_READ_PER_ENTITY` times ``max_entities`` references (at least
    :data:`MIN_REFS_READ`); and whether references were left unread for that bound.
    The rest is not read: counting
    300,000 tables one by one held the event loop for most of a second."""
    kept: list[EntityRef] = []
    seen: set[tuple[str, str]] = set()
    limit = (
        None if max_entities is None else max(MIN_REFS_READ, REFS_READ_PER_ENTITY * max_entities)
    )
    read = 0
    for ref in refs:
        read += 1
        if limit is not None and read > limit:  # (one more tells whether there are more)
            break
        key = (ref.entity_type, ref.entity_id)
        if not (is_identifier(ref.entity_type) and is_identifier(ref.entity_id)) or key in seen:
            continue
        seen.add(key)
        kept.append(ref)
        if max_entities is not None and len(kept) > max_entities:
            break
    return kept, limit is not None and read > limit


def _domain_pattern(words: str) -> re.Pattern[str]:
    # Letters, not \b, bound the words: "royalty_report" and "accounts2024" match.
    return re.compile(rf"(?<![a-z])(?:{words})(?![a-z])", re.IGNORECASE)


#: Domain patterns in priority order: the first match names the query's domain.
DEFAULT_DOMAIN_PATTERNS: Mapping[str, re.Pattern[str]] = MappingProxyType(
    {
        "royalty": _domain_pattern("royalty|royalties"),
        "contract": _domain_pattern("contracts?"),
        "account": _domain_pattern("accounts?"),
        "product": _domain_pattern("products?|isrcs?"),
        "revenue": _domain_pattern("revenues?|earnings?"),
    }
)


def query_pattern_observation(
    query: str,
    *,
    session_id: str | None = None,
    patterns: Mapping[str, re.Pattern[str]] | None = None,
) -> NewObservation | None:
    """A query_pattern observation for the first domain (in ``patterns`` order) whose
    pattern matches the cleaned query (its first :data:`MAX_QUERY_MATCH_CHARS`
    characters); None for an empty or unmatched query.

    ``patterns`` defaults to :data:`DEFAULT_DOMAIN_PATTERNS`; domains that are not
    identifiers are skipped. ``patterns`` that is not a mapping (a list of patterns, one
    pattern), or one of whose values is no compiled pattern (a string not compiled), is
    a TypeError naming it, whatever the query.
    """
    if patterns is None:
        patterns = DEFAULT_DOMAIN_PATTERNS
    elif not isinstance(patterns, Mapping):
        # (Its .items() raised AttributeError, and only for a query that was a string.)
        raise TypeError(
            "patterns must be a mapping of domain to compiled pattern (or None), "
            f"not {type(patterns).__name__}"
        )
    else:
        for domain, pattern in patterns.items():
            # A compiled pattern, re's or regex's (one of no search was skipped: its
            # domain was never observed, and nothing said why).
            if not callable(getattr(pattern, "search", None)):
                raise TypeError(
                    f"patterns[{domain!r}] must be a compiled pattern (re.compile), "
                    f"not {type(pattern).__name__}"
                )
    if not isinstance(query, str):
        return None
    text = clean_text(query, MAX_QUERY_MATCH_CHARS)
    if not text:
        return None
    for domain, pattern in patterns.items():
        if is_identifier(domain) and pattern.search(text):
            return NewObservation(
                type=ObservationType.QUERY_PATTERN,
                content=f"Asked about {domain}",
                metadata={"domain": domain, "query": clean_text(text, MAX_QUERY_CHARS)},
                session_id=session_id,
            )
    return None
