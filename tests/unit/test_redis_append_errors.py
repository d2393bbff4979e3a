"""Which errors of an append batch's scripts are one identity's, and which the server's.

An error of the server's state (a replica, maxmemory, too few replicas, a failed save, a
script cache emptied) is met by every identity alike: the batch is retried whole under
its key. Any other fails one identity's script alone, and only its rows are refused:
retried, such an error (a Lua error on what something else wrote in its keys) held every
identity's observations back for good; refused one by one, an error of the server's state
quoted for a command refused as it was queued refused every identity in turn.
"""

from __future__ import annotations

import pytest

pytest.importorskip("redis")

from redis.exceptions import ExecAbortError, NoPermissionError, NoScriptError, ResponseError

from coda_memory.errors import StoreBusy
from coda_memory.redis.store import RedisStore, _of_the_identity


@pytest.mark.parametrize(
    ("error", "the_identitys"),
    [
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), True),
        (NoPermissionError("this user has no permissions to access one of the keys"), True),
        (ResponseError("The user executing the script can't access at least one key"), True),
        (ResponseError("ERR user_script:12: attempt to compare nil with number"), True),
        (ResponseError("Command # 2 (EVALSHA x) of pipeline caused error: WRONGTYPE x"), True),
        (ResponseError("MISCONF Redis is configured to save RDB snapshots"), False),
        (ResponseError("Command # 1 (EVALSHA x) of pipeline caused error: MISCONF Redis"), False),
        (ResponseError("Command # 1 (EVALSHA x) of pipeline caused error: ('MISCONF R',)"), False),
        (ResponseError("Command # 2 (EVALSHA x) of pipeline caused error: ('NOREPLICAS',)"), False),
        (ResponseError("NOREPLICAS Not enough good replicas to write."), False),
        (ResponseError("BUSY Redis is busy running a script."), False),
        (NoScriptError("No matching script. Please use EVAL."), False),
    ],
)
def test_an_append_error_is_one_identitys_unless_it_is_of_the_servers_state(
    error: Exception, the_identitys: bool
) -> None:
    assert _of_the_identity(error) is the_identitys


class _TransactionBusy:
    """A connection of its own whose ``EXEC`` is refused as redis-py before 7 raises it
    (no ``status_code``): the server ran a script of another client for long."""

    connection = None

    async def execute_command(self, command: str) -> object:
        if command == "EXEC":
            raise ExecAbortError(
                "Transaction discarded because of: -BUSY Redis is busy running a script."
            )
        return b"OK"

    async def aclose(self) -> None:
        return None


async def test_an_exec_aborted_for_the_servers_state_is_busy_whatever_redis_py_says() -> None:
    """The check of MULTI/EXEC made an EXECABORT that quoted no NOPERM an AccessDenied on
    redis-py 5 and 6, whose errors carry no code: the writer rejected the batch for good
    where the server was busy for a moment."""
    import redis.asyncio as aioredis

    store = RedisStore(aioredis.Redis())
    store.client.client = _TransactionBusy  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreBusy):
        await store._check_transactions()
    await store.close()
