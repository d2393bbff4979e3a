"""An agent server on FastAPI with coda-memory: the integration in one file.

Run it (after ``coda-memory migrate``, or ``coda_memory.migrate(url)`` in a deploy step)::

    CODA_MEMORY_DATABASE_URL=postgresql://app@db/app uvicorn examples.fastapi_app:app

- The service is made in the lifespan, on the server's event loop, never at import time;
  leaving the lifespan closes it (stores what is queued, within a bound, and releases the
  pool).
- ``POST /chat/{identity_id}`` loads the user's memory first (consolidation included,
  within ``load_timeout``), puts it in the system prompt and uses the tool affinities to
  rank tools, then runs a stand-in tool loop whose every call is recorded with
  ``emit_observation`` (fire-and-forget: it never waits on the database).
- ``GET /memory/{identity_id}`` shows the facts; ``GET /stats`` the service's counters.

``MEMORY_LOAD_TIMEOUT`` (seconds, default 0.1) and ``MEMORY_CLOSE_TIMEOUT`` (seconds,
default 2: how long shutdown may spend storing what is queued; close() takes seconds
more when the database stops answering) are this example's own settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from coda_memory import (
    MemoryService,
    MemoryStats,
    ToolResult,
    ToolUse,
    entity_observations,
    query_pattern_observation,
    rank_tools,
    tool_observations,
)
from coda_memory.errors import ConnectionLost, StoreBusy

BASE_PROMPT = "You are an analyst's assistant for a music publisher."

#: The stand-in tool catalogue: name -> (keywords, implementation).
ACCOUNTS = {"acct-118": "Northwind Records", "acct-204": "Blue Harbor"}


def _get_account(arguments: dict[str, Any]) -> dict[str, Any]:
    account_id = str(arguments["id"])
    return {"id": account_id, "name": ACCOUNTS[account_id]}


def _run_royalty_report(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"account": arguments["id"], "royalty_cents": 1_250_000}


TOOLS = {
    "get_account": (("account", "acct"), _get_account),
    "run_royalty_report": (("royalty", "earn"), _run_royalty_report),
}


class ChatRequest(BaseModel):
    query: str
    session_id: str
    account_id: str = "acct-118"


class ChatResponse(BaseModel):
    system_prompt: str
    ranked_tools: list[str]
    called: list[str]


class FactView(BaseModel):
    subject: str
    confidence: float


def _search_catalog(query: str) -> dict[str, float]:
    """Keyword relevance, the host's own tool search."""
    words = query.lower()
    return {
        name: float(sum(keyword in words for keyword in keywords))
        for name, (keywords, _) in TOOLS.items()
    }


def _memory(request: Request) -> MemoryService:
    memory: MemoryService = request.app.state.memory
    return memory


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # coda-memory logs to the "coda_memory" logger, which has only a NullHandler, and
    # uvicorn configures its own loggers, not the root: without a handler of the app's,
    # a line such as "dropped 12 observation(s)" would go nowhere.
    logging.basicConfig(format="%(levelname)s: %(name)s: %(message)s")
    url = os.environ["CODA_MEMORY_DATABASE_URL"]
    timeout = float(os.environ.get("MEMORY_LOAD_TIMEOUT", "0.1"))
    memory = MemoryService.from_url(url, load_timeout=timeout)
    try:
        # Open the connections and prepare the statements before the first request. A
        # database that does not answer yet, or a table that a migration holds, must not
        # keep the agent from serving: memory then starts on first use, and loads answer
        # empty (or from the facts at hand) until it answers.
        try:
            await memory.start()
        except (ConnectionLost, StoreBusy) as error:
            logging.getLogger(__name__).warning("memory not warmed up: %s", error)
        app.state.memory = memory
        yield
    finally:
        # Store what is queued, within less than the platform's grace period before it
        # kills the process (docker stop: 10 s; Kubernetes: 30 s), so that a loss is
        # logged and counted rather than cut short. (close() alone waits up to 30 s.) With
        # the database no longer answering, close() takes up to 2 s past its timeout for
        # the batch under way, the consolidations it cancels and the calls in flight
        # together, and up to 2 s more for the pools (4.2 s in all in the example's test,
        # where a timeout of 8 s took 11 s).
        await memory.close(timeout=float(os.environ.get("MEMORY_CLOSE_TIMEOUT", "2")))


app = FastAPI(title="agent server with coda-memory", lifespan=lifespan)


@app.post("/chat/{identity_id}")
async def chat(identity_id: str, body: ChatRequest, request: Request) -> ChatResponse:
    memory = _memory(request)
    # 1. Before the model sees the prompt: consolidate and load, never raises.
    loaded = await memory.load_memory(identity_id)
    section = loaded.prompt_section
    system_prompt = f"{section}\n\n{BASE_PROMPT}" if section else BASE_PROMPT

    # 2. Tool search, with the user's affinities breaking ties.
    ranked = rank_tools(_search_catalog(body.query), loaded.tool_affinities)

    # 3. The tool loop (a model would choose; here every relevant tool runs once), and
    #    what happened goes to memory without waiting.
    if (query_obs := query_pattern_observation(body.query, session_id=body.session_id)) is not None:
        memory.emit_observation(identity_id, query_obs)
    called: list[str] = []
    for name, score in ranked:
        if score <= 0:
            continue
        use = ToolUse(id=f"t{len(called)}", name=name, input={"id": body.account_id})
        try:
            content: Any = TOOLS[name][1](use.input)
            result = ToolResult(tool_use_id=use.id, is_error=False, content=content)
        except KeyError as exc:
            result = ToolResult(tool_use_id=use.id, is_error=True, content=f"unknown {exc}")
        for obs in tool_observations([use], [result], {use.id: 12.0}, session_id=body.session_id):
            memory.emit_observation(identity_id, obs)
        if not result.is_error:
            for obs in entity_observations(name, result.content, session_id=body.session_id):
                memory.emit_observation(identity_id, obs)
        called.append(name)
    return ChatResponse(
        system_prompt=system_prompt, ranked_tools=[name for name, _ in ranked], called=called
    )


@app.get("/memory/{identity_id}")
async def facts(identity_id: str, request: Request) -> list[FactView]:
    found = await _memory(request).facts(identity_id)
    return [FactView(subject=f.subject, confidence=f.confidence) for f in found]


@app.get("/stats")
async def stats(request: Request) -> MemoryStats:
    return _memory(request).stats()
