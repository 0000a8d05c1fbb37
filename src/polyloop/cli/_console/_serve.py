"""Serving the console with Hypercorn, under asyncio or Trio as the command runs."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import anyio
from hypercorn.config import Config
from starlette.applications import Starlette

from polyloop.cli._common import CliError


@dataclass(frozen=True, slots=True)
class Listener:
    """A socket bound and listening, and the address people open."""

    fd: int
    url: str


def listen(host: str, port: int) -> Listener:
    """Bind ``host:port`` now, so that a port in use is one clear error and port 0 gets
    a free port whose number can be printed. Blocking: call it in a worker thread."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CliError(f"cannot listen on {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return Listener(sock.detach(), f"http://{shown}:{bound_port}/")


async def serve(app: Starlette, listener: Listener, backend: str) -> None:
    """Serve ``app`` on the listener's socket until cancelled (Ctrl-C), under ``backend``
    (the one the command runs on)."""
    config = Config()
    config.bind = [f"fd://{listener.fd}"]
    config.loglevel = "WARNING"  # the command prints the address itself
    config.accesslog = None
    config.graceful_timeout = 1.0  # live pages hold streams open: do not wait on them
    # A trigger that never fires keeps Hypercorn from taking over the signals: Ctrl-C
    # ends the command as it ends every other one (status 130).
    never = anyio.Event().wait
    if backend == "trio":
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, config, shutdown_trigger=never)  # type: ignore[arg-type]
        # Under Trio, Hypercorn ends quietly on Ctrl-C, the only way it ends here:
        # the command reports it as an interruption, as under asyncio.
        raise KeyboardInterrupt
    from hypercorn.asyncio import serve as asyncio_serve

    await asyncio_serve(app, config, shutdown_trigger=never)  # type: ignore[arg-type]
