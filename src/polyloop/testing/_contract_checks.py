"""Checks the seam contracts share: plain parameters, and cancellation that goes through."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

# Key names that hold a credential. Parameters go into every run's snapshot, which the
# store keeps and ``polyloop show`` prints, so a credential there would leak.
CREDENTIAL_KEYS = frozenset(
    {
        "api_key",
        "apikey",
        "access_token",
        "auth_token",
        "authorization",
        "bearer",
        "client_secret",
        "password",
        "passwd",
        "secret",
        "secret_key",
    }
)

# How long a call that should be cancelled may take to notice before the test gives up.
GIVE_UP_AFTER = 10.0


def assert_plain_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as a dict, after checking that strict JSON carries it back unchanged."""
    assert isinstance(params, Mapping), f"parameters() returned {type(params).__name__}"
    copied = dict(params)
    assert all(isinstance(key, str) for key in copied), "parameter names must be strings"
    text = json.dumps(copied, allow_nan=False)
    assert json.loads(text) == copied, "parameters() must be plain JSON"
    return copied


def credential_keys(value: object, path: str = "parameters") -> list[str]:
    """Where in ``value`` a key is named like a credential."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if str(key).lower().replace("-", "_") in CREDENTIAL_KEYS:
                found.append(f"{path}[{key!r}]")
            found += credential_keys(item, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found += credential_keys(item, f"{path}[{index}]")
    return found


async def assert_cancelled_before_start(call: Callable[[], Awaitable[object]]) -> None:
    """A call made in a cancelled scope ends by the cancellation, or returns at once.

    A call that awaits anything meets the cancellation and must let it out, to be
    caught by the scope; a call that awaits nothing may finish. No other exception may
    stand in for the cancellation.
    """
    with anyio.fail_after(GIVE_UP_AFTER), anyio.CancelScope() as scope:
        scope.cancel()
        await call()


async def assert_cancelled_in_flight(call: Callable[[], Awaitable[object]]) -> None:
    """A call cancelled while it waits lets the cancellation out, and returns nothing."""
    finished = False
    with anyio.fail_after(GIVE_UP_AFTER):
        with anyio.move_on_after(0.2) as scope:
            await call()
            finished = True
    assert not finished, (
        "the call returned although it was cancelled while it waited "
        "(or it never waited: the slow fixture's calls must wait until cancelled)"
    )
    assert scope.cancelled_caught, "the cancellation did not reach the scope that cancelled"
