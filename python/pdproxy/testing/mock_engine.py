"""An OpenAI-compatible stand-in for a GPU inference server (LMDeploy api_server shape).

It serves ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not,
with ``usage``, ``finish_reason`` and ``data: [DONE]``), ``/health`` and ``/terminate`` as
LMDeploy does, and a few ``/mock/*`` endpoints that let tests observe and steer it: what it
received, how many streams the client abandoned, its health state. Output is deterministic
(see ``generation``) and faults are injectable per process or per request (see ``faults``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .faults import FAULT_HEADER, NO_FAULTS, Faults, FaultSpecError, parse_faults
from .generation import count_tokens, generate, prompt_text

__all__ = ["MockEngine", "MockSettings", "build_app"]

ROLES = ("hybrid", "prefill", "decode")
HEALTH_STATES = ("healthy", "sleeping", "unhealthy", "initializing")
#: How many received requests `/mock/requests` remembers.
RECORD_LIMIT = 256


@dataclass(frozen=True, kw_only=True)
class MockSettings:
    """Every default of the mock engine lives here (`pdproxy mock-engine --help`)."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8001, metadata={"help": "Port to listen on (0: any free port)."})
    model: str = field(default="mock-model", metadata={"help": "Model name served."})
    role: str = field(default="hybrid", metadata={"help": "Engine role: hybrid, prefill or decode."})
    ttft_ms: float = field(default=0.0, metadata={"help": "Milliseconds before the first token."})
    token_delay_ms: float = field(default=0.0, metadata={"help": "Milliseconds between tokens."})
    fault: str = field(default="", metadata={"help": "Process-wide fault knobs, e.g. 'status=503' (see faults)."})
    allow_terminate: bool = field(
        default=False, metadata={"help": "Let GET /terminate stop the engine (LMDeploy's --allow-terminate-by-client)."}
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        parse_faults(self.fault)  # fail at startup, not per request


@dataclass
class MockState:
    """What the engine has seen; read by tests through ``/mock/stats`` and ``/mock/requests``."""

    settings: MockSettings
    faults: Faults
    health: str = "healthy"
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    active: int = 0
    records: collections.deque[dict[str, Any]] = field(default_factory=lambda: collections.deque(maxlen=RECORD_LIMIT))
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    terminated: asyncio.Event = field(default_factory=asyncio.Event)

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.settings.model,
            "role": self.settings.role,
            "health": self.health,
            "requests": self.requests,
            "completed": self.completed,
            "disconnected": self.disconnected,
            "active": self.active,
        }


STATE: web.AppKey[MockState] = web.AppKey("state", MockState)


def _error(status: int, message: str, code: str, type: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


class _Completion:
    """One request being answered: its shape (chat or text) and the pieces of every chunk."""

    def __init__(self, state: MockState, body: dict[str, Any], chat: bool) -> None:
        self.chat = chat
        self.model = body.get("model") or state.settings.model
        self.created = int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{next(state.ids)}"
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        prompt = prompt_text(body)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError("max_tokens must be a non-negative integer")
        self.tokens, self.finish_reason = generate(prompt, max_tokens, ignore_eos=bool(body.get("ignore_eos")))
        self.usage: dict[str, int] = {
            "prompt_tokens": count_tokens(prompt),
            "completion_tokens": len(self.tokens),
            "total_tokens": count_tokens(prompt) + len(self.tokens),
        }
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        # Chunks are built from fixed prefixes so a benchmark measures the proxy, not json.dumps.
        self._prefix = (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
            f'"model":{json.dumps(self.model)},"choices":[{{"index":0,'
        ).encode()

    def token_event(self, token: str, first: bool) -> bytes:
        text = json.dumps(token)
        if self.chat:
            role = '"role":"assistant",' if first else ""
            delta = f'"delta":{{{role}"content":{text}}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        else:
            delta = f'"text":{text},"logprobs":null,"finish_reason":null}}]}}\n\n'
        return self._prefix + delta.encode()

    def final_events(self) -> bytes:
        empty = '"delta":{}' if self.chat else '"text":""'
        out = self._prefix + f'{empty},"logprobs":null,"finish_reason":"{self.finish_reason}"}}]}}\n\n'.encode()
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            usage: dict[str, Any] = {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage,
            }
            out += _sse(usage)
        return out + b"data: [DONE]\n\n"

    def whole(self) -> dict[str, Any]:
        text = "".join(self.tokens)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=self.finish_reason)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }


async def _sleep_ms(ms: float | None) -> None:
    if ms:
        await asyncio.sleep(ms / 1000)


def _request_faults(state: MockState, request: web.Request) -> Faults:
    spec = request.headers.get(FAULT_HEADER)
    return state.faults.merged(parse_faults(spec)) if spec else state.faults


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    state.requests += 1
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    record: dict[str, Any] = {
        "path": request.path,
        "headers": {name.lower(): value for name, value in request.headers.items()},
        "body": body,
        "sent_sha256": None,  # of every byte of the response body, once it was sent in full
    }
    state.records.append(record)
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object", "invalid_request")
    try:
        faults = _request_faults(state, request)
    except FaultSpecError as e:
        return _error(400, str(e), "invalid_fault")
    if state.health == "sleeping":
        return _error(503, "the engine is sleeping", "engine_sleeping", "service_unavailable")
    if body.get("model") not in (None, state.settings.model):
        return _error(404, f"The model `{body.get('model')}` does not exist.", "model_not_found")
    if chat and not isinstance(body.get("messages"), list):
        return _error(400, "`messages` must be a list", "invalid_request")
    if not chat and "prompt" not in body:
        return _error(400, "`prompt` is required", "invalid_request")

    state.active += 1
    completed = False
    try:
        if faults.hang:
            await asyncio.Event().wait()  # until the client goes away
        if faults.status is not None:
            completed = True
            return _error(faults.status, f"injected fault: status {faults.status}", "mock_fault", "server_error")
        try:
            completion = _Completion(state, body, chat)
        except ValueError as e:
            completed = True
            return _error(400, str(e), "invalid_request")
        ttft = faults.ttft_ms if faults.ttft_ms is not None else state.settings.ttft_ms
        delay = faults.token_delay_ms if faults.token_delay_ms is not None else state.settings.token_delay_ms
        if body.get("stream"):
            response = await _stream(request, completion, ttft, delay, faults, record)
        else:
            if faults.drop_after is not None:
                _drop_connection(request)
                return web.Response()
            await _sleep_ms(ttft)
            await _sleep_ms(delay * max(0, len(completion.tokens) - 1))
            payload = json.dumps(completion.whole()).encode()
            record["sent_sha256"] = hashlib.sha256(payload).hexdigest()
            response = web.Response(body=payload, content_type="application/json")
        completed = response is not None
        return response if response is not None else web.Response()
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away: aiohttp cancels the handler (handler_cancellation) or the
        # write fails. Either way the engine has stopped working on this request.
        raise
    finally:
        state.active -= 1
        if completed:
            state.completed += 1
        else:
            state.disconnected += 1


async def _stream(
    request: web.Request,
    completion: _Completion,
    ttft: float,
    delay: float,
    faults: Faults,
    record: dict[str, Any],
) -> web.StreamResponse | None:
    """Streams the answer; returns None when a fault cut it short."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
    await response.prepare(request)
    digest = hashlib.sha256()

    async def write(data: bytes) -> None:
        digest.update(data)
        if faults.fragment is None:
            await response.write(data)
            return
        for start in range(0, len(data), faults.fragment):
            await response.write(data[start : start + faults.fragment])
            await asyncio.sleep(0)  # let each piece leave as its own segment

    await _sleep_ms(ttft)
    for i, token in enumerate(completion.tokens):
        if faults.drop_after is not None and i >= faults.drop_after:
            _drop_connection(request)
            return None
        if i:
            await _sleep_ms(delay)
        await write(completion.token_event(token, first=i == 0))
    if faults.drop_after == len(completion.tokens):
        _drop_connection(request)
        return None
    await write(completion.final_events())
    await response.write_eof()
    record["sent_sha256"] = digest.hexdigest()
    return response


def _drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def _models(request: web.Request) -> web.Response:
    model = request.app[STATE].settings.model
    card = {"id": model, "object": "model", "created": 0, "owned_by": "pdproxy-mock", "root": model, "parent": None}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    # LMDeploy's shape: 200 for healthy/sleeping, 503 otherwise.
    health = request.app[STATE].health
    status = 200 if health in ("healthy", "sleeping") else 503
    return web.json_response({"status": health, "message": f"engine is {health}"}, status=status)


async def _terminate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.settings.allow_terminate:
        return _error(400, "terminate is not allowed: start the engine with --allow-terminate", "terminate_not_allowed")
    state.terminated.set()
    return web.Response()


async def _mock_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats())


async def _mock_requests(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[STATE].records))


async def _mock_reset(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.requests = state.completed = state.disconnected = 0
    state.records.clear()
    return web.json_response(state.stats())


async def _mock_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        wanted = (await request.json())["status"]
    except (ValueError, KeyError, TypeError):
        wanted = None
    if wanted not in HEALTH_STATES:
        return _error(400, f"status must be one of {', '.join(HEALTH_STATES)}", "invalid_request")
    state.health = wanted
    return web.json_response(state.stats())


def build_app(settings: MockSettings) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[STATE] = MockState(settings=settings, faults=parse_faults(settings.fault) if settings.fault else NO_FAULTS)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _inference(request, chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _inference(request, chat=False)

    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/terminate", _terminate)
    app.router.add_get("/mock/stats", _mock_stats)
    app.router.add_get("/mock/requests", _mock_requests)
    app.router.add_post("/mock/reset", _mock_reset)
    app.router.add_post("/mock/health", _mock_health)
    return app


class MockEngine:
    """A mock engine served on a real socket in the running event loop::

    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        ...  # engine.url is http://127.0.0.1:<port>
    """

    def __init__(self, settings: MockSettings | None = None, **overrides: Any) -> None:
        base = settings or MockSettings(port=0)
        self.settings = dataclasses.replace(base, **overrides) if overrides else base
        self.app = build_app(self.settings)
        self._runner: web.AppRunner | None = None
        self.port = self.settings.port

    @property
    def state(self) -> MockState:
        return self.app[STATE]

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its handler at once, as a real
        # engine aborts the request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port, also when port=0

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MockEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        """Serves until ``/terminate`` is called (when allowed) or the task is cancelled."""
        await self.start()
        try:
            await self.state.terminated.wait()
            await asyncio.sleep(0.05)  # let the /terminate response go out
        finally:
            await self.stop()
