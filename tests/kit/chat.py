"""A Chat Completions server for tests, on loopback, in a thread of the test process.

It speaks just enough of the protocol: it answers ``POST /v1/chat/completions`` with
scripted bodies, records every request body, and can fail, send a broken body, or hold a
request open to be cancelled. It listens on 127.0.0.1, on a port the system picks. The
adapter tests (``tests/adapters/test_adapter_openai.py``) and the command line's tests
(``tests/cli/test_cli.py``) both talk to it.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """A normal completion; ``reasoning`` adds ``reasoning_content`` to the message."""

    content: str | None
    id: str | None = "chatcmpl-1"
    reasoning: str | None = None
    choices: bool = True


@dataclass(frozen=True)
class Status:
    """An HTTP error with an OpenAI-style error body."""

    code: int
    message: str = "the model server fell over"


@dataclass(frozen=True)
class Malformed:
    """A 200 whose JSON body is cut off."""


@dataclass(frozen=True)
class PlainText:
    """A 200 that is not JSON at all."""


@dataclass(frozen=True)
class Hold:
    """Never answer; note when the client closes the connection."""


Mode = Reply | Status | Malformed | PlainText | Hold


def completion_body(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    body: dict[str, Any] = {
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "message": message}]
        if reply.choices
        else [],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    if reply.id is not None:
        body["id"] = reply.id
    return body


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog of 5 refuses concurrent runs' connections


class ChatServer:
    """A Chat Completions server for tests: scripted answers, recorded requests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.script: deque[Mode] = deque()
        self.responder: Callable[[dict[str, Any]], Mode] | None = None
        self.holding = threading.Event()
        self.hold_saw_close = threading.Event()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._http = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._http.chat = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.01,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def respond(self, *modes: Mode) -> None:
        self.script.extend(modes)

    def next_mode(self, body: dict[str, Any]) -> Mode:
        with self._lock:
            self.requests.append(body)
            if self.script:
                return self.script.popleft()
        if self.responder is not None:
            return self.responder(body)
        return Status(599, "the test scripted no answer for this request")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stopping.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        chat: ChatServer = self.server.chat  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        chat.paths.append(self.path)
        mode = chat.next_mode(body)
        try:
            if isinstance(mode, Hold):
                self._hold(chat)
            elif isinstance(mode, Reply):
                self._send(200, json.dumps(completion_body(mode, body.get("model", ""))))
            elif isinstance(mode, Status):
                error = {
                    "error": {
                        "message": mode.message,
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                self._send(mode.code, json.dumps(error))
            elif isinstance(mode, Malformed):
                self._send(200, '{"id": "chatcmpl-x", "object": "chat.completion", "choices": [')
            else:
                self._send(200, "hello, I am not JSON", content_type="text/plain")
        except OSError:
            self.close_connection = True  # the client went away; nothing to report

    def _send(self, code: int, text: str, *, content_type: str = "application/json") -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _hold(self, chat: ChatServer) -> None:
        chat.holding.set()
        self.close_connection = True
        while not chat.stopping.is_set():
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable:
                if self.connection.recv(1, socket.MSG_PEEK) == b"":
                    chat.hold_saw_close.set()
                return
