"""Switches of threads forced where CPython could make them: after each call a method
makes (see :func:`switches_after_calls`).

CPython hands the GIL to another thread at a call's end (and a loop's jump back, a
function's start), never between two plain instructions. A test traces a method
instruction by instruction and runs what "another thread" would at every such point
that follows a call.
"""

from __future__ import annotations

import dis
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

#: The instructions that call (3.11's to 3.13's).
_CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION_EX"})


@contextmanager
def switches_after_calls(method: Callable[..., Any], switch: Callable[[], None]) -> Iterator[None]:
    """Run ``switch`` inside ``method`` after each call it makes, as another thread that
    the GIL was handed to there would run."""
    code = method.__code__
    if sys.version_info >= (3, 12):
        with _monitored_after_calls(code, switch):
            yield
        return

    #: The last instruction each traced frame ran.
    frame_state: dict[int, int] = {}

    def local_with_state(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            previous = frame_state.get(id(frame))
            if previous is not None and dis.opname[code.co_code[previous]] in _CALLS:
                switch()
            frame_state[id(frame)] = frame.f_lasti
        return local_with_state

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        frame_state.pop(id(frame), None)
        return local_with_state

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(before)


@contextmanager
def _monitored_after_calls(code: Any, switch: Callable[[], None]) -> Iterator[None]:
    """:func:`switches_after_calls` by ``sys.monitoring`` (3.12 on, where a trace
    function's opcode events reach a code object only from its next call on): events
    of ``code`` alone, every instruction, the first of each call starting afresh; in
    the thread that set them alone, as a trace function is (the events of a code object
    reach every thread that runs it, and "another thread" may run it for real)."""
    monitoring: Any = getattr(sys, "monitoring")  # noqa: B009  (3.12 on)
    tool = next(t for t in range(6) if monitoring.get_tool(t) is None)
    events = monitoring.events
    previous: list[int | None] = [None]
    thread = threading.get_ident()

    def started(_code: Any, _offset: int) -> None:
        if threading.get_ident() == thread:
            previous[0] = None

    def instruction(_code: Any, offset: int) -> None:
        if threading.get_ident() != thread:
            return
        last = previous[0]
        if last is not None and dis.opname[code.co_code[last]] in _CALLS:
            switch()
        previous[0] = offset

    monitoring.use_tool_id(tool, "switches_after_calls")
    try:
        monitoring.register_callback(tool, events.PY_START, started)
        monitoring.register_callback(tool, events.INSTRUCTION, instruction)
        monitoring.set_local_events(tool, code, events.PY_START | events.INSTRUCTION)
        yield
    finally:
        monitoring.set_local_events(tool, code, 0)
        monitoring.register_callback(tool, events.PY_START, None)
        monitoring.register_callback(tool, events.INSTRUCTION, None)
        monitoring.free_tool_id(tool)
