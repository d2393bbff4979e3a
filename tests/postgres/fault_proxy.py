"""A loopback TCP proxy between a client and Postgres that loses what a client can't see.

It parses the client's side of the wire protocol (a startup packet, then typed messages)
and, on connections it picks, acts once the client sends a simple-query ``COMMIT``:

* ``cut``: forward the ``COMMIT`` to the server, then close both sockets without
  relaying the answer. The server commits (or not); the client can't know which.
* ``blackhole``: forward nothing more in either direction, but keep both sockets open,
  so the client waits for an answer that never comes.

With ``hold_terminate`` set, a client's Terminate message (a graceful close) is
swallowed the same way: the client waits for a close that the server never makes.

The client must not ask for TLS (``ssl=False``): the proxy reads plain messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sqlalchemy.engine import make_url

#: What to do at the n-th COMMIT (counted over every connection, from 1): None
#: (forward it), "cut" or "blackhole".
Decision = Callable[[int], str | None]


@dataclass
class FaultProxy:
    """Listens on 127.0.0.1 and forwards to ``target``; ``decide(n)`` picks what happens
    at the n-th COMMIT."""

    target_host: str
    target_port: int
    decide: Decision
    #: The server's Unix socket directory, when it listens on one instead of TCP.
    socket_dir: str | None = None
    #: Swallow every Terminate from now on (see above).
    hold_terminate: bool = False
    #: Awaited after a COMMIT to cut was forwarded, before the sockets close.
    before_cut: Callable[[], Awaitable[None]] | None = None
    cuts: int = 0
    blackholes: int = 0
    #: Terminates swallowed.
    held_terminates: int = 0
    commits: int = 0
    _server: asyncio.Server | None = None
    _held: list[asyncio.StreamWriter] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def in_front_of(
        cls,
        url: str,
        decide: Decision,
        *,
        before_cut: Callable[[], Awaitable[None]] | None = None,
    ) -> FaultProxy:
        """A proxy to the server of ``url`` (SQLAlchemy's): its TCP address, or the
        directory of its Unix socket, which a server on one (the embedded one) names in
        the query."""
        target = make_url(url)
        socket_dir = target.query.get("host")
        return cls(
            target.host or "127.0.0.1",
            target.port or 5432,
            decide,
            socket_dir=socket_dir if isinstance(socket_dir, str) else None,
            before_cut=before_cut,
        )

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._held:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            if self.socket_dir is not None:
                server_r, server_w = await asyncio.open_unix_connection(
                    f"{self.socket_dir}/.s.PGSQL.{self.target_port}"
                )
            else:
                server_r, server_w = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
        except OSError:
            client_w.close()
            return
        state = {"stopped": False}
        upstream = asyncio.create_task(self._client_to_server(client_r, server_w, client_w, state))
        downstream = asyncio.create_task(self._pipe(server_r, client_w, state))
        for task in (upstream, downstream):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, bool]
    ) -> None:
        with contextlib.suppress(Exception):
            while not state["stopped"]:
                data = await reader.read(65536)
                if not data or state["stopped"]:
                    break
                writer.write(data)
                await writer.drain()
        if not state.get("held"):
            with contextlib.suppress(Exception):
                writer.close()

    async def _client_to_server(
        self,
        reader: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
        client_w: asyncio.StreamWriter,
        state: dict[str, bool],
    ) -> None:
        try:
            # The startup packet: a length, then the rest; no type byte.
            head = await reader.readexactly(4)
            (length,) = struct.unpack("!I", head)
            server_w.write(head + await reader.readexactly(length - 4))
            while True:
                kind = await reader.readexactly(1)
                size = await reader.readexactly(4)
                (length,) = struct.unpack("!I", size)
                body = await reader.readexactly(length - 4)
                message = kind + size + body
                is_commit = kind == b"Q" and body.strip(b"\x00; \n").upper() == b"COMMIT"
                fault = None
                if is_commit:
                    self.commits += 1
                    fault = self.decide(self.commits)
                held = kind == b"X" and self.hold_terminate
                if held or (fault == "blackhole" and is_commit):
                    # Swallow the message and everything after it; keep the sockets open.
                    if held:
                        self.held_terminates += 1
                    else:
                        self.blackholes += 1
                    state["stopped"] = state["held"] = True
                    self._held.extend([client_w, server_w])
                    while await reader.read(65536):
                        pass
                    return
                if fault == "cut" and is_commit:
                    # Nothing of the server's answer reaches the client from now on.
                    state["stopped"] = True
                server_w.write(message)
                await server_w.drain()
                if fault == "cut" and is_commit:
                    self.cuts += 1
                    if self.before_cut is not None:
                        await self.before_cut()
                    # close() sends what is buffered (the COMMIT) before the FIN.
                    server_w.close()
                    client_w.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if not state.get("held"):
                with contextlib.suppress(Exception):
                    server_w.close()
                with contextlib.suppress(Exception):
                    client_w.close()
