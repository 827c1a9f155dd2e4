"""A stand-in model server: deterministic, OpenAI-compatible ``/v1/chat/completions``.

No model runs here. The server follows a scripted ``Plan`` and answers from it alone:

- The answer to a request is step ``n`` of the plan, where ``n`` is the number of
  assistant messages in the request's ``messages`` (so the same history always gets
  the same answer, and a branch that continues a history gets the next step). Past the
  end of the plan, the last step is repeated.
- A **steering hint** is a user or system message containing ``hint: KEY`` (case
  insensitive) for a KEY of ``plan.variants``. From the point where the (last) hint
  message appears, the plan's remaining steps are replaced by that variant's steps.
- A step is a tool call (``finish_reason: tool_calls``, call id ``call_<n>``) or an
  answer; ``{last_tool}`` in an answer is replaced by the content of the last tool
  message, ``{tool:NAME}`` by the last result of a call to tool NAME (so an answer shows
  which tool results the history it was given holds).
- ``stream: true`` is answered as server-sent events (``chat.completion.chunk``
  objects, then ``data: [DONE]``).
- With ``api_key`` set, a request without ``Authorization: Bearer <api_key>`` gets 401
  with an error message that quotes the key it received, as some real APIs do (tests use
  it to check that the egress proxy scrubs a reflected secret).
- ``GET /download?bytes=N`` returns N bytes (at most 1 GiB), for throughput benchmarks.

Every request is recorded (``StandinModel.requests``): method, path, headers, JSON body.
Run it alone: ``python -m forkd.engine.egress.standin --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_BODY = 1 << 20
MAX_DOWNLOAD = 1 << 30
_HINT_RE = re.compile(r"hint:\s*([^\n]+)", re.IGNORECASE)
_TOOL_RE = re.compile(r"\{tool:([A-Za-z0-9_-]{1,64})\}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class Answer:
    text: str


Step = ToolCall | Answer


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    variants: Mapping[str, tuple[Step, ...]] = field(default_factory=dict)

    def next_step(self, messages: Sequence[Mapping[str, Any]]) -> Step:
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        steps = self.steps
        hint = self._hint(messages)
        if hint is not None:
            key, at = hint
            steps = self.steps[:at] + self.variants[key]
        return steps[min(turns, len(steps) - 1)]

    def _hint(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, int] | None:
        """(variant key, assistant turns before it) of the last hint message, or None."""
        found = None
        turns = 0
        for m in messages:
            if m.get("role") == "assistant":
                turns += 1
            content = m.get("content")
            if m.get("role") in ("user", "system") and isinstance(content, str):
                for match in _HINT_RE.finditer(content):
                    key = match.group(1).strip().strip(".\"'").lower()
                    if key in self.variants:
                        found = (key, turns)
        return found

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Plan:
        """``{"steps": [STEP…], "variants": {KEY: [STEP…]}}``; STEP is
        ``{"tool": NAME, "arguments": {…}}`` or ``{"answer": TEXT}``."""

        def steps(items: Sequence[Mapping[str, Any]]) -> tuple[Step, ...]:
            out: list[Step] = []
            for item in items:
                if "tool" in item:
                    out.append(ToolCall(str(item["tool"]), dict(item.get("arguments", {}))))
                else:
                    out.append(Answer(str(item["answer"])))
            if not out:
                raise ValueError("a plan needs at least one step")
            return tuple(out)

        variants = {str(k).lower(): steps(v) for k, v in doc.get("variants", {}).items()}
        return cls(steps(doc["steps"]), variants)


# The travel planner of recipes/langgraph-react (its tools: attractions, weather, budget).
# Two steps run before the demo's branch; each hint then continues differently, and every
# answer quotes tool results, including the day-one forecast fetched before the branch.
TRAVEL_PLAN = Plan(
    steps=(
        ToolCall("attractions", {"city": "Kyoto"}),
        ToolCall("weather", {"city": "Kyoto", "day": 1}),
        ToolCall("budget", {"city": "Kyoto", "days": 3}),
        Answer(
            "Day one in Kyoto:\n- morning: Fushimi Inari shrine\n- noon: Nishiki market\n"
            "- afternoon: Kinkaku-ji\n- evening: Gion at dusk\n"
            "Weather: {tool:weather}\nCost: {tool:budget}"
        ),
    ),
    variants={
        "deep culture": (
            ToolCall("attractions", {"city": "Kyoto", "theme": "temples and tea"}),
            Answer(
                "Day one, deep culture:\n- 06:00 Fushimi Inari before the crowds\n"
                "- 10:00 Kiyomizu-dera\n- 14:00 a tea ceremony in Gion\n"
                "- 17:00 Ryoan-ji rock garden\nWeather: {tool:weather}\n"
                "From: {tool:attractions}"
            ),
        ),
        "minimalist": (
            Answer(
                "Day one, minimalist:\n- morning: the Philosopher's Path, on foot\n"
                "- afternoon: Ginkaku-ji, then nothing\n- evening: an early night\n"
                "Weather: {tool:weather}"
            ),
        ),
        "budget": (
            ToolCall("budget", {"city": "Kyoto", "days": 1, "limit_usd": 60}),
            Answer(
                "Day one under $60:\n- Fushimi Inari (free)\n- a bento lunch\n"
                "- the Kamo riverbank at sunset\nWeather: {tool:weather}\n"
                "Cost: {tool:budget}"
            ),
        ),
    },
)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # names in lower case
    body: Any


def completion(
    step: Step, messages: Sequence[Mapping[str, Any]], model: str, n: int
) -> dict[str, Any]:
    """The chat.completion object for ``step``."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if isinstance(step, ToolCall):
        message["tool_calls"] = [_tool_call(step, n)]
        finish = "tool_calls"
    else:
        message["content"] = fill(step.text, messages)
        finish = "stop"
    return {
        "id": f"chatcmpl-standin-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(messages),
            "completion_tokens": 1,
            "total_tokens": 1 + len(messages),
        },
    }


def _tool_call(step: ToolCall, n: int) -> dict[str, Any]:
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {
            "name": step.name,
            "arguments": json.dumps(dict(step.arguments), sort_keys=True),
        },
    }


def fill(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` with ``{last_tool}`` replaced by the last tool message's content and
    ``{tool:NAME}`` by the content of the last result of a call to tool NAME ("" if none)."""
    text = text.replace("{last_tool}", _last_tool(messages))
    return _TOOL_RE.sub(lambda m: _tool_result(messages, m.group(1)), text)


def _last_tool(messages: Sequence[Mapping[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "tool":
            return str(m.get("content", ""))
    return ""


def _tool_result(messages: Sequence[Mapping[str, Any]], name: str) -> str:
    """The content of the last tool message answering a call to ``name``."""
    names: dict[str, str] = {}
    found = ""
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                names[str(call.get("id"))] = str(fn.get("name"))
        if m.get("role") == "tool" and names.get(str(m.get("tool_call_id"))) == name:
            found = str(m.get("content", ""))
    return found


def chunks(done: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat.completion.chunk objects that stream ``done``."""
    choice = done["choices"][0]
    message = choice["message"]
    base = {k: done[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": 0, **message["tool_calls"][0]}]
    return [
        base | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        base | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
    ]


class StandinModel:
    """The stand-in server on ``host:port`` (0: any free port), HTTPS when ``tls`` is given."""

    def __init__(
        self,
        plan: Plan = TRAVEL_PLAN,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.plan = plan
        self.api_key = api_key
        self.host = host
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._server = _Server((host, port), _handler_for(self), tls)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        scheme = "https" if self._server.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def completions(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.path == "/v1/chat/completions"]

    def record(self, request: RecordedRequest) -> int:
        with self._lock:
            self.requests.append(request)
            return len(self.requests)

    def start(self) -> StandinModel:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> StandinModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None,
    ) -> None:
        self.tls = tls
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:  # the handshake runs in the request's thread
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # a client that went away is not the server's problem


def _handler_for(model: StandinModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall between head and body

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            model.record(
                RecordedRequest(
                    "GET", url.path, {k.lower(): v for k, v in self.headers.items()}, None
                )
            )
            if url.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
            elif url.path == "/download":
                self._download(url.query)
            else:
                self._json(404, _error(f"no route {url.path}", "not_found"))

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY:
                self._json(413, _error("the body is over 1 MiB", "invalid_request_error"))
                return
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                body = None
            n = model.record(
                RecordedRequest(
                    "POST", url.path, {k.lower(): v for k, v in self.headers.items()}, body
                )
            )
            if url.path != "/v1/chat/completions":
                self._json(404, _error(f"no route {url.path}", "not_found"))
                return
            if model.api_key is not None and not self._authorized():
                return
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                self._json(
                    400,
                    _error("the body must be JSON with a messages list", "invalid_request_error"),
                )
                return
            messages = [m for m in body["messages"] if isinstance(m, dict)]
            done = completion(
                model.plan.next_step(messages), messages, str(body.get("model", "standin")), n
            )
            if body.get("stream"):
                self._stream(done)
            else:
                self._json(200, done)

        def _authorized(self) -> bool:
            got = self.headers.get("Authorization", "")
            if got == f"Bearer {model.api_key}":
                return True
            key = got.removeprefix("Bearer ")
            self._json(401, _error(f"Incorrect API key provided: {key}.", "invalid_api_key"))
            return False

        def _json(self, status: int, doc: Any) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, done: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks(done):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

        def _download(self, query: str) -> None:
            try:
                size = int(parse_qs(query).get("bytes", ["0"])[0])
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_DOWNLOAD:
                self._json(400, _error("bytes must be 0 to 1 GiB", "invalid_request_error"))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            block = bytes(range(256)) * 256
            while size > 0:
                piece = block[: min(size, len(block))]
                self.wfile.write(piece)
                size -= len(piece)

    return Handler


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": code, "code": code, "param": None}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="forkd's stand-in chat-completions server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--plan", help="a plan as JSON (see Plan.from_json); default: travel")
    parser.add_argument("--cert", help="PEM certificate chain + key file: serve HTTPS")
    parser.add_argument("--api-key", help="require Authorization: Bearer API_KEY")
    args = parser.parse_args(argv)
    plan = TRAVEL_PLAN
    if args.plan:
        with open(args.plan, encoding="utf-8") as f:
            plan = Plan.from_json(json.load(f))
    tls = None
    if args.cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.cert)
    server = StandinModel(plan, args.api_key, tls, args.host, args.port)
    print(f"stand-in model server on {server.url}", flush=True)
    server._server.serve_forever()


if __name__ == "__main__":
    main()
