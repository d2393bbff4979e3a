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

from redis.asyncio.client import Pipeline
from redis.exceptions import (
    ExecAbortError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from coda_memory.errors import StoreBusy
from coda_memory.redis.store import (
    RedisStore,
    _error_code,
    _of_the_identity,
    _raise_server_state,
    _script_refused_by_acl,
)


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


#: How Redis 6.2 replies to a script that met an error (scripting.c: the error handler
#: puts the script's place before the error, and luaPushError puts it again, with a
#: space, before an error the server raised for the command), as redis-py raises it.
_SHA = "f_6b1bf486c81ceb7edf3c093f4c48582e38c0e791"


def _redis6(error: str) -> ResponseError:
    """The error redis-py raises for Redis 6.2's reply ``-ERR Error running script …``."""
    from redis._parsers.base import BaseParser

    raised = BaseParser.parse_error(f"ERR Error running script (call to {_SHA}): {error}")  # type: ignore[no-untyped-call]
    assert type(raised) is ResponseError
    return raised


#: (Where the server refused the command itself, the place is there twice.)
PLACE = "@user_script:24: @user_script: 24: "
READONLY_6 = f"{PLACE}-READONLY You can't write against a read only replica."
OOM_6 = f"{PLACE}-OOM command not allowed when used memory > 'maxmemory'."
NOREPLICAS_6 = f"{PLACE}-NOREPLICAS Not enough good replicas to write."
MISCONF_6 = (
    "@user_script:24: @user_script: 24: -MISCONF Redis is configured to save RDB snapshots,"
    " but it is currently not able to persist on disk."
)
CANT_RUN_6 = (
    "@user_script:30: @user_script: 30: The user executing the script can't run this"
    " command or subcommand"
)
CANT_ACCESS_6 = (
    "@user_script:30: @user_script: 30: The user executing the script can't access at"
    " least one of the keys mentioned in the command arguments"
)
WRONGTYPE_6 = "@user_script:15: WRONGTYPE Operation against a key holding the wrong kind of value"
LUA_6 = "@user_script:12: user_script:12: attempt to compare nil with number"


@pytest.mark.parametrize(
    ("error", "code", "the_identitys"),
    [
        (READONLY_6, "READONLY", False),
        (OOM_6, "OOM", False),
        (NOREPLICAS_6, "NOREPLICAS", False),
        (MISCONF_6, "MISCONF", False),
        (CANT_RUN_6, "NOPERM", True),
        (CANT_ACCESS_6, "NOPERM", True),
        (WRONGTYPE_6, "WRONGTYPE", True),
        (LUA_6, "ERR", True),
    ],
)
def test_redis_6s_wrapped_script_errors_are_read_by_the_error_they_wrap(
    error: str, code: str, the_identitys: bool
) -> None:
    """Redis 6 wraps what a script met in an ERR: a replica's, a full server's or a failed
    save's refusal of the append script was blamed on each identity (ERR), and its rows
    refused for good, where Redis 7's is retried."""
    wrapped = _redis6(error)
    assert _error_code(wrapped) == code
    assert _of_the_identity(wrapped) is the_identitys


@pytest.mark.parametrize(
    ("error", "raised"),
    [(READONLY_6, ReadOnlyError), (OOM_6, OutOfMemoryError), (NOREPLICAS_6, StoreBusy)],
)
def test_redis_6s_wrapped_errors_of_the_servers_state_are_raised_as_redis_7s(
    error: str, raised: type[Exception]
) -> None:
    """A wrapped READONLY is raised as redis-py's ReadOnlyError, which the store makes a
    ConnectionLost that leaves the pool's idle connections (for the primary of the
    moment), and OOM as redis-py's OutOfMemoryError, as Redis 7's are."""
    with pytest.raises(raised) as caught:
        _raise_server_state(_redis6(error))
    if raised is StoreBusy:
        assert "NOREPLICAS" in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        _redis6(CANT_RUN_6),
        # Redis 7.0, and 7.2 and Valkey.
        ResponseError(
            "The user executing the script can't run this command or subcommand script: "
            f"{_SHA[2:]}, on @user_script:30."
        ),
        ResponseError("ACL failure in script: this user has no permissions to run the 'unlink'"),
    ],
)
def test_a_scripts_command_refused_by_the_acl_is_recognised_in_every_servers_words(
    error: ResponseError,
) -> None:
    assert _script_refused_by_acl(error)
    assert _error_code(error) == "NOPERM"


_MISCONF = "MISCONF Redis is configured to save RDB snapshots"


@pytest.mark.parametrize(
    ("identity", "server_error", "code"),
    [
        ("bob ACL failure in script", _MISCONF, "MISCONF"),
        ("ACL failure in script", "NOREPLICAS Not enough good replicas to write.", "NOREPLICAS"),
        ("bob caused error: WRONGTYPE", _MISCONF, "MISCONF"),
    ],
)
def test_a_queued_refusal_is_read_by_the_servers_error_not_the_command_it_quotes(
    identity: str, server_error: str, code: str
) -> None:
    """redis-py quotes the refused command, keys and all, in the error it raises for a
    transaction aborted as it was queued: an identity (or any argument) holding the words
    of an ACL refusal or of another error took the server's MISCONF for the identity's
    own error, and its rows were refused for good instead of the batch retried."""
    error = ResponseError(server_error)
    command = ["EVALSHA", _SHA[2:], 5, f"coda:memory:state:{identity}", "x"]
    Pipeline.annotate_exception(None, error, 1, command)  # type: ignore[arg-type]
    assert identity in str(error)  # the identity is quoted
    assert _error_code(error) == code
    assert not _of_the_identity(error)
