"""A small simulated agent deployment, used by the demo and the benchmarks.

Users with different habits hold sessions over simulated weeks. Each session loads memory
(as an agent server does before calling the model), asks a question, searches the tool
catalogue with the memory's affinity boost, and calls tools whose results go through the
real emitters. Tools fail with per-user probabilities. Everything is driven by a seeded
random generator and a simulated clock: nothing in the output is written by hand.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from coda_memory.core.affinity import rank_tools
from coda_memory.core.emitters import (
    ToolResult,
    ToolUse,
    entity_observations,
    query_pattern_observation,
    tool_observations,
)
from coda_memory.core.model import LoadedMemory
from coda_memory.service import MemoryService

START = datetime(2026, 10, 1, 8, 0, tzinfo=UTC)

#: The tool catalogue: name -> description searched by keyword.
CATALOGUE: Mapping[str, str] = {
    "get_account": "look up an account by id: name, owner, territory, royalty terms",
    "search_snowflake_schema": "search warehouse tables and columns for revenue and royalty data",
    "get_products_by_isrc": "find products and releases for an ISRC recording code",
    "run_royalty_report": "run the royalty statement report for an account and period",
    "get_contract": "fetch a contract and its royalty rates for an account",
    "run_sql": "run an arbitrary SQL query on the warehouse for revenue numbers",
    "search_tools": "search the tool catalogue",
}

_WORD = re.compile(r"[a-z0-9]+")


def keyword_scores(query: str) -> dict[str, float]:
    """A stand-in for the host's tool search: words shared by query and description."""
    words = set(_WORD.findall(query.lower()))
    return {
        name: float(len(words & set(_WORD.findall(description))))
        for name, description in CATALOGUE.items()
        if name != "search_tools"
    }


def tool_result(tool: str, rng: random.Random) -> Any:
    """A plausible tool result, shaped as the real tools return them."""
    if tool == "get_account":
        account = rng.choice([("acct-118", "Northwind Records"), ("acct-204", "Blue Harbor")])
        return {"id": account[0], "name": account[1], "territory": "EU"}
    if tool == "search_snowflake_schema":
        tables = rng.sample(["ROYALTY_LINES", "REVENUE_DAILY", "CONTRACTS", "PRODUCTS"], 2)
        return {"tables": [{"name": t} for t in tables]}
    if tool == "get_products_by_isrc":
        return {"products": [{"id": "prod-7731", "title": "Night Drive (Remastered)"}]}
    return {"rows": rng.randint(1, 500)}


@dataclass(frozen=True)
class Persona:
    """One simulated user's habits."""

    identity_id: str
    questions: tuple[str, ...]
    #: Tools this user calls in a session, in order, when the search ranks them.
    tools: tuple[str, ...]
    #: Probability that a call of a tool fails for this user.
    failure_rates: Mapping[str, float] = field(default_factory=dict)
    #: Chance of holding a session on a given day.
    activity: float = 0.5
    #: Tools the user stops calling after this many days.
    stops_using: Mapping[str, int] = field(default_factory=dict)


PERSONAS: tuple[Persona, ...] = (
    Persona(
        "ana",
        ("what royalty did acct-118 earn last quarter?", "show the royalty statement"),
        ("get_account", "run_royalty_report", "search_snowflake_schema", "get_contract"),
        {"run_royalty_report": 0.1, "search_snowflake_schema": 0.05},
        activity=0.8,
        stops_using={"get_contract": 6},
    ),
    Persona(
        "ben",
        ("which products use this isrc?", "list products for the new release"),
        ("get_products_by_isrc", "get_account"),
        {"get_products_by_isrc": 0.05},
        activity=0.6,
    ),
    Persona(
        "chen",
        ("revenue by territory this month", "what was revenue yesterday?"),
        ("run_sql", "search_snowflake_schema"),
        {"run_sql": 0.7},
        activity=0.7,
    ),
    Persona(
        "dana",
        ("what are the contract terms for acct-204?", "contract renewal dates"),
        ("get_contract", "get_account"),
        {"get_contract": 0.15},
        activity=0.5,
    ),
    Persona(
        "eli",
        ("royalty and revenue overview", "account health check"),
        ("get_account", "run_sql", "run_royalty_report"),
        {"run_sql": 0.5, "run_royalty_report": 0.2},
        activity=0.4,
    ),
)


@dataclass
class SessionRecord:
    """What happened in one simulated session, for the demo to show."""

    persona: str
    day: int
    question: str
    memory: LoadedMemory
    tools_called: list[tuple[str, bool]]
    #: Wall-clock milliseconds the session's ``load_memory`` took.
    load_ms: float = 0.0


@dataclass
class SimulatedClock:
    """The simulation's clock; the service reads it for every "now"."""

    now: datetime = START

    def __call__(self) -> datetime:
        return self.now


async def run_session(
    service: MemoryService,
    clock: SimulatedClock,
    persona: Persona,
    day: int,
    session_index: int,
    rng: random.Random,
) -> SessionRecord:
    """One request of the agent server: load memory, search tools, call them, emit."""
    session_id = f"{persona.identity_id}-{session_index}"
    started = time.perf_counter()
    memory = await service.load_memory(persona.identity_id)
    load_ms = (time.perf_counter() - started) * 1000
    question = rng.choice(persona.questions)
    observation = query_pattern_observation(question, session_id=session_id)
    if observation is not None:
        service.emit_observation(persona.identity_id, observation)
    usable = [t for t in persona.tools if day < persona.stops_using.get(t, 10**6)]
    called: list[tuple[str, bool]] = []
    uses: list[ToolUse] = [ToolUse(id=f"{session_id}-search", name="search_tools", input={})]
    results: list[ToolResult] = [ToolResult(tool_use_id=f"{session_id}-search", content=[])]
    timings: dict[str, float] = {}
    for n, tool in enumerate(usable):
        clock.now += timedelta(seconds=rng.randint(5, 90))
        use_id = f"{session_id}-{n}"
        failed = rng.random() < persona.failure_rates.get(tool, 0.02)
        content: Any = {"error": f"{tool} timed out"} if failed else tool_result(tool, rng)
        uses.append(ToolUse(id=use_id, name=tool, input={"question": question}))
        results.append(ToolResult(tool_use_id=use_id, is_error=failed, content=content))
        timings[use_id] = round(rng.lognormvariate(5.0, 0.6) * (3 if failed else 1), 1)
        called.append((tool, not failed))
        if not failed:
            for obs in entity_observations(tool, content, session_id=session_id):
                service.emit_observation(persona.identity_id, obs)
    for obs in tool_observations(uses, results, timings, session_id=session_id):
        service.emit_observation(persona.identity_id, obs)
    return SessionRecord(persona.identity_id, day, question, memory, called, load_ms)


async def simulate(
    service: MemoryService,
    clock: SimulatedClock,
    *,
    days: int = 30,
    personas: tuple[Persona, ...] = PERSONAS,
    seed: int = 7,
    on_session: Callable[[SessionRecord], None] | None = None,
    start: datetime = START,
) -> list[SessionRecord]:
    """Run ``days`` simulated days of sessions from ``start``; returns every session's
    record (``day`` counts days from ``start``)."""
    rng = random.Random(seed)
    records: list[SessionRecord] = []
    counters = dict.fromkeys((p.identity_id for p in personas), 0)
    for day in range(days):
        for persona in personas:
            if rng.random() >= persona.activity:
                continue
            clock.now = start + timedelta(days=day, hours=rng.randint(0, 9))
            counters[persona.identity_id] += 1
            record = await run_session(
                service, clock, persona, day, counters[persona.identity_id], rng
            )
            records.append(record)
            if on_session is not None:
                on_session(record)
        await service.drain()
    return records


def ranking(
    query: str, memory: LoadedMemory
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The tool search ranking for ``query`` without and with the memory's affinity boost."""
    scores = keyword_scores(query)
    return rank_tools(scores, {}), rank_tools(scores, memory.tool_affinities)
