"""Chat Completions answers in the shapes real servers send, and a server that sends them.

Each builder returns one response body as a server of that family writes it (field
names, nesting, the extras it adds, what it leaves out), so the adapter is tested on the
bodies it will meet rather than on the SDK's idea of them:

* ``openai_body``: OpenAI's own API, with ``system_fingerprint``, ``service_tier``,
  ``message.refusal`` and ``annotations``, and usage with token details;
* ``vllm_body``: vLLM, whose message carries ``reasoning`` and whose choice adds
  ``stop_reason``;
* ``reasoning_content_body``: older vLLM and llama.cpp server, ``reasoning_content``
  instead, and llama.cpp's ``timings``;
* ``ollama_body``: Ollama, ``reasoning`` too, ``fp_ollama``, and an id drawn from a few
  hundred values, so ids repeat.

``BodyServer`` answers each ``POST /v1/chat/completions`` with the next scripted body,
as is, on 127.0.0.1 and a port the system picks, and records the request bodies.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Body = dict[str, Any]


def openai_body(
    content: str | None,
    *,
    id: str = "chatcmpl-AbC123",
    model: str = "gpt-4o-2024-08-06",
    finish_reason: str | None = "stop",
    refusal: str | None = None,
    prompt_tokens: int = 42,
    completion_tokens: int = 17,
    reasoning_tokens: int = 0,
) -> Body:
    return {
        "id": id,
        "object": "chat.completion",
        "created": 1_735_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": refusal,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": "fp_5f0c1d2e3a",
    }


def vllm_body(
    content: str | None,
    *,
    reasoning: str | None = None,
    id: str = "chatcmpl-9f2b7c41d0e34f6a",
    model: str = "Qwen/Qwen3-8B",
    finish_reason: str | None = "stop",
    prompt_tokens: int = 31,
    completion_tokens: int = 12,
) -> Body:
    return {
        "id": id,
        "object": "chat.completion",
        "created": 1_735_000_100,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning": reasoning,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def reasoning_content_body(
    content: str | None,
    *,
    reasoning_content: str | None = None,
    id: str = "chatcmpl-Yq3pQ0bWm8",
    model: str = "gpt-3.5-turbo",
    finish_reason: str | None = "stop",
) -> Body:
    message: Body = {"role": "assistant", "content": content}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    return {
        "choices": [{"finish_reason": finish_reason, "index": 0, "message": message}],
        "created": 1_735_000_200,
        "model": model,
        "system_fingerprint": "b5430-1ab2c3d4",
        "object": "chat.completion",
        "usage": {"completion_tokens": 9, "prompt_tokens": 27, "total_tokens": 36},
        "id": id,
        "timings": {"prompt_n": 27, "prompt_ms": 12.5, "predicted_n": 9, "predicted_ms": 80.1},
    }


def ollama_body(
    content: str | None,
    *,
    reasoning: str | None = None,
    id: str = "chatcmpl-417",
    model: str = "qwen3:8b",
    finish_reason: str | None = "stop",
) -> Body:
    message: Body = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return {
        "id": id,
        "object": "chat.completion",
        "created": 1_735_000_300,
        "model": model,
        "system_fingerprint": "fp_ollama",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 55, "completion_tokens": 8, "total_tokens": 63},
    }


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True


class BodyServer:
    """Answers each chat completion request with the next scripted body, as is."""

    def __init__(self) -> None:
        self.requests: list[Body] = []
        self.bodies: deque[Body] = deque()
        self._lock = threading.Lock()
        self._http = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._http.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.01,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def respond(self, *bodies: Body) -> None:
        self.bodies.extend(bodies)

    def next_body(self, request: Body) -> Body | None:
        with self._lock:
            self.requests.append(request)
            return self.bodies.popleft() if self.bodies else None

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        owner: BodyServer = self.server.owner  # type: ignore[attr-defined]
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        body = owner.next_body(request)
        if body is None:  # unscripted: an error the SDK raises, so the test sees it
            self._send(599, {"error": {"message": "no body scripted", "type": "server_error"}})
        else:
            self._send(200, body)

    def _send(self, code: int, body: Body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
