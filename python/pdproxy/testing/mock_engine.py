"""An OpenAI-compatible stand-in for a GPU inference server (LMDeploy api_server shape).

It serves ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not,
with ``usage``, ``finish_reason`` and ``data: [DONE]``), ``/health`` and ``/terminate`` as
LMDeploy does (and ``/health_generate`` when it plays SGLang), and a few ``/mock/*`` endpoints
that let tests observe and steer it: what it received, how many streams the client abandoned,
its health state. Output is deterministic (see ``generation``) and faults are injectable per
process or per request (see ``faults``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn, NotRequired, TypedDict

import aiohttp
from aiohttp import web

from pdproxy._json_types import JsonObject, JsonValue, loads

from . import distserve, engine_metrics, vllm_fields
from .batching import ContinuousBatcher, EngineModel, PromptTooLong
from .distserve import KvLedger, Links
from .engine_metrics import EngineFigures
from .faults import FAULT_HEADER, NO_FAULTS, Faults, FaultSpecError, parse_faults
from .generation import count_tokens, generate, prompt_text, token_id
from .kv_publisher import KvEventPublisher
from .mock_settings import MockSettings
from .tokens import TOKEN_BYTES, block_hashes, render_prompt
from .tokens import count_tokens as sim_tokens
from .vllm_sglang import Rendezvous, check_vllm_prefill_shape, vllm_remote_path

__all__ = ["MockEngine", "MockSettings", "build_app"]

HEALTH_STATES = ("healthy", "sleeping", "unhealthy", "initializing")
#: How many received requests `/mock/requests` remembers.
RECORD_LIMIT = 256


class MockRecord(TypedDict):
    """A received inference request, as ``/mock/requests`` tells it."""

    path: str
    #: Names lower-cased.
    headers: dict[str, str]
    #: The body as parsed (None: not JSON).
    body: JsonValue
    #: Of every byte of the response body, once it was sent in full.
    sent_sha256: str | None


class SimulationStats(TypedDict):
    """The simulated engine (``--simulate``): its batch, KV cache and counts."""

    running: int
    waiting: int
    kv_usage: float
    kv_cached_blocks: int
    kv_evicted_blocks: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    finished: int
    #: Seconds its steps ran late (a machine too busy to keep the simulated time).
    late_s: float


class MockStats(TypedDict):
    """``/mock/stats``: what the engine has seen."""

    model: str
    role: str
    health: str
    requests: int
    completed: int
    disconnected: int
    active: int
    peak_active: int
    #: ``POST /flush_cache`` and ``POST /reset_prefix_cache`` calls answered.
    flushes: int
    simulation: NotRequired[SimulationStats]


class Usage(TypedDict):
    """OpenAI's ``usage`` of an answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[dict[str, int]]


@dataclass
class MockState:
    """What the engine has seen; read by tests through ``/mock/stats`` and ``/mock/requests``."""

    settings: MockSettings
    faults: Faults
    health: str = "healthy"
    #: vLLM's sleep mode (POST /sleep, /wake_up): /health still answers 200, /metrics says so.
    asleep: bool = False
    requests: int = 0
    completed: int = 0
    #: Health probes answered (``/health``), whatever the answer.
    health_checks: int = 0
    disconnected: int = 0
    active: int = 0
    #: The most generation requests ever served at once (what a proxy's cap must bound).
    peak_active: int = 0
    records: collections.deque[MockRecord] = field(default_factory=lambda: collections.deque(maxlen=RECORD_LIMIT))
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    terminated: asyncio.Event = field(default_factory=asyncio.Event)
    ledger: KvLedger = field(default_factory=lambda: KvLedger(64))
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    #: vLLM decodes that read the prefill's KV; decode requests that computed the prompt themselves.
    vllm_remote: int = 0
    #: The prompt tokens of those reads, which its /metrics counts as `external_kv_transfer`.
    transferred_tokens: int = 0
    local_prefills: int = 0
    links: Links = field(default_factory=Links)
    #: Process-wide switches set through /mock/config (calls that carry no request header).
    engine_info_status: int = 200
    #: What /v1/models answers (an engine still loading, or one behind a broken route).
    models_status: int = 200
    #: How /health and /v1/models answer: `json` (as engines do), `garbage` (200, bytes that are
    #: not UTF-8), or `huge` (200, a valid answer padded to HUGE_ANSWER bytes).
    health_body: str = "json"
    models_body: str = "json"
    #: What /metrics answers: its status, and `prometheus` (the engine's figures), `foreign`
    #: (200, Prometheus text without any engine's figures) or `huge` (200, METRICS_HUGE bytes).
    metrics_status: int = 200
    metrics_body: str = "prometheus"
    client: aiohttp.ClientSession | None = None
    #: The serving-engine simulation (``--simulate``).
    batcher: ContinuousBatcher | None = None
    #: The simulated engine's KV events (``--kv-events``).
    kv_events: KvEventPublisher | None = None
    flushes: int = 0

    def figures(self) -> EngineFigures:
        """What the engine reports on /metrics now."""
        s = self.settings
        b = self.batcher
        if b is None:
            return EngineFigures(
                model=s.model,
                running=self.active,
                waiting=0,
                kv_usage=0.0,
                kv_blocks=s.kv_blocks,
                kv_block_tokens=s.kv_block_tokens,
                prompt_tokens=0,
                cached_tokens=0,
                generation_tokens=0,
                last_hit_rate=0.0,
                asleep=self.asleep,
                transferred_tokens=self.transferred_tokens,
            )
        return EngineFigures(
            model=s.model,
            running=len(b.running),
            waiting=b.queued,
            kv_usage=b.cache.usage(),
            kv_blocks=s.kv_blocks,
            kv_block_tokens=s.kv_block_tokens,
            prompt_tokens=b.counters.prompt_tokens,
            cached_tokens=b.counters.cached_tokens,
            generation_tokens=b.counters.generation_tokens,
            last_hit_rate=b.counters.last_hit_rate,
            asleep=self.asleep,
            transferred_tokens=self.transferred_tokens,
        )

    def flush_cache(self) -> None:
        """Empties the simulated prefix cache (``ContinuousBatcher.flush``: nothing cached before
        is found again; running requests keep their blocks; counters go on) and counts it."""
        self.flushes += 1
        if self.batcher is not None:
            self.batcher.flush()

    def stats(self) -> MockStats:
        out = MockStats(
            model=self.settings.model,
            role=self.settings.role,
            health=self.health,
            requests=self.requests,
            completed=self.completed,
            disconnected=self.disconnected,
            active=self.active,
            peak_active=self.peak_active,
            flushes=self.flushes,
        )
        if self.batcher is not None:
            b = self.batcher
            out["simulation"] = SimulationStats(
                running=len(b.running),
                waiting=len(b.waiting),
                kv_usage=b.cache.usage(),
                kv_cached_blocks=b.cache.cached,
                kv_evicted_blocks=b.cache.evicted,
                prompt_tokens=b.counters.prompt_tokens,
                cached_tokens=b.counters.cached_tokens,
                generation_tokens=b.counters.generation_tokens,
                finished=b.counters.finished,
                late_s=round(b.counters.late_s, 4),
            )
        return out


STATE: web.AppKey[MockState] = web.AppKey("state", MockState)


def _error(status: int, message: str, code: str, type: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _sse(obj: Mapping[str, object] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


class _Completion:
    """One request being answered: its shape (chat or text) and the pieces of every chunk."""

    def __init__(self, state: MockState, body: JsonObject, chat: bool, forced_tokens: int | None = None) -> None:
        self.chat = chat
        #: Playing vLLM: its answers' extra fields, and finish_reason on the last token's chunk.
        self.vllm = state.settings.metrics_dialect == "vllm"
        #: Whether usage says how many prompt tokens were cached (vLLM only when asked to).
        self.details = not self.vllm or state.settings.prompt_tokens_details
        self._finished = False
        self.model = body.get("model") or state.settings.model
        self.created = int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{next(state.ids)}"
        asked = body.get("max_completion_tokens") if chat else None
        if asked is None:
            asked = body.get("max_tokens")
        prompt = prompt_text(body)
        if asked is not None and (not isinstance(asked, int) or asked < 0):
            raise ValueError("max_tokens must be a non-negative integer")
        #: What the request asked for (vLLM refuses more than the context holds).
        self.asked = asked
        # A prefill engine makes one token whatever was asked.
        max_tokens = forced_tokens if forced_tokens is not None else asked
        self.tokens, self.finish_reason = generate(prompt, max_tokens, ignore_eos=bool(body.get("ignore_eos")))
        self.prompt_tokens = count_tokens(prompt)
        self.usage = Usage(
            prompt_tokens=count_tokens(prompt),
            completion_tokens=len(self.tokens),
            total_tokens=count_tokens(prompt) + len(self.tokens),
        )
        #: A preserved prefill session's handle fields (DistServe, vLLM), merged into the answer.
        self.handle: dict[str, object] | None = None
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        # Chunks are built from fixed prefixes so a benchmark measures the proxy, not json.dumps.
        self._prefix = (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
            f'"model":{json.dumps(self.model)},"choices":[{{"index":0,'
        ).encode()

    def token_event(self, token: str, first: bool, last: bool = False) -> bytes:
        text = json.dumps(token)
        if self.vllm:
            return self._vllm_token_event(text, first, last)
        if self.chat:
            role = '"role":"assistant",' if first else ""
            delta = f'"delta":{{{role}"content":{text}}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        else:
            delta = f'"text":{text},"logprobs":null,"finish_reason":null}}]}}\n\n'
        return self._prefix + delta.encode()

    def _vllm_token_event(self, text: str, first: bool, last: bool) -> bytes:
        """vLLM's chunks: a chat stream opens with the role and empty content; the last token's
        chunk carries the finish reason (no empty chunk after it)."""
        out = b""
        finish = f'"{self.finish_reason}"' if last else "null"
        self._finished = last
        if self.chat:
            if first:
                role = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
                out = self._prefix + f"{role}{vllm_fields.ROLE_CHUNK_TOP}}}\n\n".encode()
            extra = vllm_fields.CHAT_LAST if last else vllm_fields.CHAT_TOKEN
            delta = f'"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{finish}{extra}}}]}}\n\n'
        else:
            delta = f'"text":{text},"logprobs":null,"finish_reason":{finish}{vllm_fields.TEXT_TOKEN}}}]}}\n\n'
        return out + self._prefix + delta.encode()

    def final_events(self) -> bytes:
        empty = '"delta":{}' if self.chat else '"text":""'
        out = b""
        if not self._finished:
            out = self._prefix + f'{empty},"logprobs":null,"finish_reason":"{self.finish_reason}"}}]}}\n\n'.encode()
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            usage: dict[str, object] = {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage,
            }
            if self.vllm:
                usage["system_fingerprint"] = vllm_fields.FINGERPRINT
            out += _sse(usage)
        return out + b"data: [DONE]\n\n"

    def whole(self) -> dict[str, object]:
        text = "".join(self.tokens)
        if self.chat:
            choice: dict[str, object] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=self.finish_reason)
        whole: dict[str, object] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }
        if self.vllm:
            self._vllm_whole(whole, choice)
        if self.handle is not None:
            whole.update(self.handle)
        return whole

    def _vllm_whole(self, whole: dict[str, object], choice: dict[str, object]) -> None:
        whole.update(vllm_fields.ANSWER)
        whole["usage"] = {"prompt_tokens_details": None, **self.usage, **vllm_fields.USAGE}
        if self.chat:
            whole.update(vllm_fields.CHAT_ANSWER)
            choice.update(vllm_fields.CHAT_CHOICE)
            message = choice["message"]
            assert isinstance(message, dict)
            message.update(vllm_fields.MESSAGE)
        else:
            choice.update(vllm_fields.COMPLETION_CHOICE)


def _vllm_too_long(state: MockState, completion: _Completion) -> web.Response | None:
    """vLLM's 400 for a request its context cannot hold (prompt and max_tokens)."""
    limit = state.settings.max_model_len
    asked = completion.asked if isinstance(completion.asked, int) else 0
    if not completion.vllm or completion.prompt_tokens + asked <= limit:
        return None
    message = (
        f"This model's maximum context length is {limit} tokens. However, you requested {asked} output tokens "
        f"and your prompt contains {completion.prompt_tokens} input tokens."
    )
    return web.json_response(vllm_fields.error(400, message, "max_tokens"), status=400)


async def _sleep_ms(ms: float | None) -> None:
    if ms:
        await asyncio.sleep(ms / 1000)


def _request_faults(state: MockState, request: web.Request) -> Faults:
    spec = request.headers.get(FAULT_HEADER)
    return state.faults.merged(parse_faults(spec, state.settings.role)) if spec else state.faults


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    state.requests += 1
    raw = await request.read()
    try:
        body = loads(raw)
    except ValueError:
        body = None
    record = MockRecord(
        path=request.path,
        headers={name.lower(): value for name, value in request.headers.items()},
        body=body,
        sent_sha256=None,
    )
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
    state.peak_active = max(state.peak_active, state.active)
    completed = False
    try:
        if faults.hang:
            await asyncio.Event().wait()  # until the client goes away
        if faults.status is not None:
            # A failure can take time to come (ttft_ms): the other PD leg is then in flight.
            if faults.ttft_ms is not None:
                await _sleep_ms(faults.ttft_ms)
            completed = True
            return _error(faults.status, f"injected fault: status {faults.status}", "mock_fault", "server_error")
        preserve = state.settings.role == "prefill" and bool(body.get("preserve_cache"))
        if preserve:
            state.ledger.shape_errors.extend(distserve.check_prefill_shape(body, chat))
        kv = body.get("kv_transfer_params")
        vllm_prefill = state.settings.role == "prefill" and isinstance(kv, dict) and kv.get("do_remote_decode") is True
        if vllm_prefill:
            had_max_completion = b'"max_completion_tokens"' in raw
            state.ledger.shape_errors.extend(check_vllm_prefill_shape(body, had_max_completion))
        if state.settings.role == "prefill" and "bootstrap_room" in body:
            rooms = _rooms(body)
            if rooms is None:
                completed = True
                return _error(400, "bootstrap_room must be an integer or a list of integers", "invalid_request")
            if not await state.rendezvous.prefill(rooms, state.settings.bootstrap_timeout_ms / 1000):
                completed = True
                return _error(500, "no decode joined the bootstrap room in time", "bootstrap_timeout", "server_error")
        try:
            completion = _Completion(state, body, chat, forced_tokens=1 if state.settings.role == "prefill" else None)
        except ValueError as e:
            completed = True
            return _error(400, str(e), "invalid_request")
        too_long = _vllm_too_long(state, completion)
        if too_long is not None:
            completed = True
            return too_long
        if state.batcher is not None and state.settings.role == "hybrid":
            simulated = await _simulated(request, state.batcher, body, completion, faults, record)
            completed = simulated is not None
            return simulated if simulated is not None else web.Response()
        # Decode takes the prefill's KV when it starts generating: before answering when not
        # streaming, after the response head when streaming (as the engines do).
        migrating = state.settings.role == "decode" and (
            "migration_request" in body or "kv_transfer_params" in body or "bootstrap_room" in body
        )
        if state.settings.role == "decode" and not migrating:
            state.local_prefills += 1
        if migrating and not body.get("stream"):
            refusal = await _start_decode(state, body, completion, request)
            if refusal is not None:
                completed = True
                return refusal
        ttft = faults.ttft_ms if faults.ttft_ms is not None else state.settings.ttft_ms
        delay = faults.token_delay_ms if faults.token_delay_ms is not None else state.settings.token_delay_ms
        if faults.endless:
            await _endless(request, bool(body.get("stream")))
        if body.get("stream"):
            migrate = (lambda: _start_decode(state, body, completion, request)) if migrating else None
            response = await _stream(request, completion, ttft, delay, faults, record, migrate)
        else:
            if faults.stall_body:
                await _stalled(request, json.dumps(completion.whole()).encode())
            if faults.drop_after is not None:
                _drop_connection(request)
                return web.Response()
            await _sleep_ms(ttft)
            await _sleep_ms(delay * max(0, len(completion.tokens) - 1))
            if preserve and completion.tokens:
                # Preserved only once the prefill finished: an aborted prefill keeps nothing.
                _preserve(state, completion, body, chat, faults)
            if vllm_prefill and completion.tokens:
                _vllm_params(state, completion, request, faults)
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


async def _stalled(request: web.Request, payload: bytes) -> NoReturn:
    """Announces the whole answer, sends half of it, and goes silent until the client leaves."""
    response = web.StreamResponse(headers={"content-type": "application/json"})
    response.content_length = len(payload)
    await response.prepare(request)
    await response.write(payload[: len(payload) // 2])
    await asyncio.Event().wait()
    raise AssertionError("unreachable: waits until the client leaves")


async def _endless(request: web.Request, stream: bool) -> NoReturn:
    """An answer that never ends, for as long as the client reads it."""
    content_type = "text/event-stream" if stream else "application/json"
    response = web.StreamResponse(headers={"content-type": content_type})
    await response.prepare(request)
    piece = b'data: {"choices": [{"delta": {"content": " more"}}]}\n\n' if stream else b'"more text", '
    if not stream:
        await response.write(b'{"endless": [')
    while True:
        await response.write(piece * 16)
        await asyncio.sleep(0.01)


async def _stream(
    request: web.Request,
    completion: _Completion,
    ttft: float,
    delay: float,
    faults: Faults,
    record: MockRecord,
    migrate: Callable[[], Awaitable[web.Response | None]] | None = None,
) -> web.StreamResponse | None:
    """Streams the answer; returns None when a fault (or a refused migration) cut it short."""
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
    if migrate is not None and (refusal := await migrate()) is not None:
        await response.write(b"data: " + refusal.body + b"\n\n")  # type: ignore[operator]
        await response.write_eof()
        return None
    for i, token in enumerate(completion.tokens):
        if faults.drop_after is not None and i >= faults.drop_after:
            _drop_connection(request)
            return None
        if i:
            await _sleep_ms(delay)
        await write(completion.token_event(token, first=i == 0, last=i == len(completion.tokens) - 1))
    if faults.drop_after == len(completion.tokens):
        _drop_connection(request)
        return None
    await write(completion.final_events())
    await response.write_eof()
    record["sent_sha256"] = digest.hexdigest()
    return response


async def _simulated(
    request: web.Request,
    batcher: ContinuousBatcher,
    body: JsonObject,
    completion: _Completion,
    faults: Faults,
    record: MockRecord,
) -> web.StreamResponse | None:
    """Serves the request through the simulated engine: it waits for the batch and the KV cache,
    its first token comes once its uncached prompt is prefilled, then one token per step.
    Returns None when a fault cut the stream short."""
    prompt = render_prompt(body)
    answer = "".join(completion.tokens)
    hashes = block_hashes(prompt + answer, batcher.model.kv_block_tokens)
    publisher = request.app[STATE].kv_events
    if publisher is not None:
        publisher.name_blocks(hashes, (prompt + answer).encode())
    full_prompt_blocks = len(prompt.encode()) // (batcher.model.kv_block_tokens * TOKEN_BYTES)
    tokens = len(completion.tokens)
    job = batcher.submit(hashes[:full_prompt_blocks], hashes[full_prompt_blocks:], sim_tokens(prompt), tokens)
    if isinstance(job.error, PromptTooLong):
        return _error(400, str(job.error), "context_length_exceeded")
    try:
        response: web.StreamResponse | None = None
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
            await response.prepare(request)
        digest = hashlib.sha256()
        sent = 0
        while True:
            if response is None:
                sent = job.produced
            elif sent < job.produced:
                cut = faults.drop_after
                end = job.produced if cut is None else min(job.produced, cut)
                if end > sent:
                    events = b"".join(
                        completion.token_event(completion.tokens[i], first=i == 0, last=i == tokens - 1)
                        for i in range(sent, end)
                    )
                    digest.update(events)
                    await response.write(events)
                    sent = end
                if cut is not None and sent >= cut and (job.produced > sent or job.finished):
                    _drop_connection(request)
                    return None
            if job.finished and sent >= job.produced:
                break
            await job.next_tokens()
        completion.usage["prompt_tokens"] = job.prompt_tokens
        completion.usage["total_tokens"] = job.prompt_tokens + tokens
        if completion.details:
            completion.usage["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens}
        if response is None:
            payload = json.dumps(completion.whole()).encode()
            record["sent_sha256"] = hashlib.sha256(payload).hexdigest()
            return web.Response(body=payload, content_type="application/json")
        final = completion.final_events()
        digest.update(final)
        await response.write(final)
        await response.write_eof()
        record["sent_sha256"] = digest.hexdigest()
        return response
    finally:
        batcher.cancel(job)


def _preserve(state: MockState, completion: _Completion, body: JsonObject, chat: bool, faults: Faults) -> None:
    session = state.ledger.preserve(completion.prompt_tokens, token_id(completion.tokens[0]))
    handle = {} if faults.no_id else distserve.prefill_id(state.settings.id_format, session, body, chat, completion.id)
    completion.handle = {**handle, "cache_block_ids": session.blocks, "remote_token_ids": [session.token_id]}


def _vllm_params(state: MockState, completion: _Completion, request: web.Request, faults: Faults) -> None:
    """A vLLM prefill keeps its KV and says where to read it, unless its token ended the
    answer (then it frees at once and answers null params)."""
    if faults.stop_first:
        completion.finish_reason = "stop"
        completion.handle = {"kv_transfer_params": None}
        return
    session = state.ledger.preserve(completion.prompt_tokens, token_id(completion.tokens[0]))
    host, _, port = request.host.rpartition(":")
    completion.handle = {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": session.blocks,
            "remote_engine_id": f"mock-{port}",
            "remote_request_id": f"vllm-{session.id}",
            "remote_host": host,
            "remote_port": int(port),
            "tp_size": state.settings.tp_size,
        }
    }


async def _start_decode(
    state: MockState, body: JsonObject, completion: _Completion, request: web.Request
) -> web.Response | None:
    """A decode's first step in each protocol: LMDeploy migration, vLLM KV read, SGLang room."""
    if "migration_request" in body:
        return await _migrate(state, body, completion)
    if state.client is None:
        state.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    if "bootstrap_room" in body:
        return await _sglang_join(state, body, request)
    params = body.get("kv_transfer_params")
    if not vllm_remote_path(params) or not isinstance(params, dict):
        state.local_prefills += 1  # vLLM recomputes the prompt without a word
        return None
    read = {"remote_request_id": params["remote_request_id"], "block_ids": params["remote_block_ids"]}
    url = f"http://{params['remote_host']}:{params['remote_port']}/mock/vllm_read"
    failed = await _read_peer_kv(state, url, read, "KV load failed", "kv_load_failed")
    if failed is None:
        state.vllm_remote += 1
        state.transferred_tokens += completion.prompt_tokens
    return failed


async def _read_peer_kv(
    state: MockState, url: str, read: Mapping[str, object], failure: str, code: str
) -> web.Response | None:
    """Reads a prefill engine's KV blocks as the real transfer would: None once read, else the
    engine's 500 (recorded in the ledger as a migration error)."""
    assert state.client is not None
    try:
        async with state.client.post(url, json=read) as r:
            refused = (await r.json()).get("error")
    except (aiohttp.ClientError, TimeoutError) as e:
        refused = f"prefill engine unreachable: {type(e).__name__}"
    if refused:
        state.ledger.migration_errors.append(refused)
        return _error(500, f"{failure}: {refused}", code, "server_error")
    return None


async def _sglang_join(state: MockState, body: JsonObject, request: web.Request) -> web.Response | None:
    """Joins every room of the request at the prefill's bootstrap address, all at once (the
    prefill transfers once all its rooms are joined)."""
    rooms = _rooms(body)
    if rooms is None:
        return _error(400, "bootstrap_room must be an integer or a list of integers", "invalid_request")
    hosts = body.get("bootstrap_host")
    ports = body.get("bootstrap_port")
    client = state.client
    assert client is not None

    async def join(i: int, room: int) -> bool:
        host = hosts[i] if isinstance(hosts, list) else hosts
        port = ports[i] if isinstance(ports, list) else ports
        if port is None:  # SGLang: the decode assumes its own bootstrap port
            port = request.host.rpartition(":")[2]
        try:
            async with client.post(f"http://{host}:{port}/mock/sglang_join", json={"room": room}) as r:
                return bool((await r.json()).get("ok"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    joined = await asyncio.gather(*(join(i, room) for i, room in enumerate(rooms)))
    if not all(joined):
        state.ledger.migration_errors.append(f"rooms {rooms}: no transfer from the prefill")
        return _error(500, "the KV transfer did not arrive", "transfer_failed", "server_error")
    return None


def _rooms(body: JsonObject) -> list[int] | None:
    """SGLang's ``bootstrap_room``: one room, or one per item of a batch (None: not rooms)."""
    given = body["bootstrap_room"]
    rooms = given if isinstance(given, list) else [given]
    numbers = [room for room in rooms if isinstance(room, int) and not isinstance(room, bool)]
    return numbers if len(numbers) == len(rooms) else None


async def _migrate(state: MockState, body: JsonObject, completion: _Completion) -> web.Response | None:
    """Decode's side of a migration: check the request, read the prefill session (and free it,
    as the real engine's ZMQ message does), and check that the first token is prefill's."""
    errors = distserve.check_decode_shape(body)
    state.ledger.shape_errors.extend(errors)
    migration = body.get("migration_request")
    if errors or not isinstance(migration, dict):
        return _error(400, "; ".join(errors) or "bad migration_request", "invalid_request")
    if migration.get("is_dummy_prefill"):
        return None
    peer, protocol = migration["remote_engine_id"], migration["protocol"]
    # check_decode_shape refuses anything else.
    assert isinstance(peer, str)
    assert isinstance(protocol, int)
    if peer not in state.links.connected:
        state.ledger.migration_errors.append(f"no p2p connection to {peer}")
        return _error(500, f"no p2p connection to {peer}", "migration_failed", "server_error")
    if distserve.PROTOCOLS[protocol] != state.links.transport[peer]["protocol"]:
        error = f"migration over {distserve.PROTOCOLS[protocol]}, but the link to {peer} is not"
        state.ledger.migration_errors.append(error)
        return _error(500, error, "migration_failed", "server_error")
    if state.client is None:
        state.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    read = {
        "session_id": migration["remote_session_id"],
        "block_ids": migration["remote_block_ids"],
        "token_id": migration["remote_token_id"],
        "by": "decode",
    }
    failed = await _read_peer_kv(state, f"{peer}/mock/migrate", read, "migration failed", "migration_failed")
    if failed is not None:
        return failed
    if completion.tokens and token_id(completion.tokens[0]) != migration["remote_token_id"]:
        state.ledger.migration_errors.append("the first decoded token is not prefill's token")
    return None


def _drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def _models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.models_status != 200:
        return _error(state.models_status, "/v1/models failed (injected)", "mock_fault", "server_error")
    model = state.settings.model
    card = {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "pdproxy-mock",
        "root": model,
        "parent": None,
        "max_model_len": state.settings.max_model_len,
        "permission": [vllm_fields.permission(model, 0)],
    }
    return await _misbehaving(request, request.app[STATE].models_body, {"object": "list", "data": [card]}, 200)


async def _health(request: web.Request) -> web.StreamResponse:
    # LMDeploy's shape: 200 for healthy/sleeping, 503 otherwise.
    state = request.app[STATE]
    state.health_checks += 1
    status = 200 if state.health in ("healthy", "sleeping") else 503
    payload = {"status": state.health, "message": f"engine is {state.health}"}
    return await _misbehaving(request, state.health_body, payload, status)


async def _sleep(request: web.Request) -> web.Response:
    """vLLM's ``POST /sleep?level=N`` (its dev mode): asleep until ``POST /wake_up``."""
    request.app[STATE].asleep = True
    return web.json_response({"status": "sleeping", "level": int(request.query.get("level", "1"))})


async def _wake_up(request: web.Request) -> web.Response:
    request.app[STATE].asleep = False
    return web.json_response({"status": "awake", "tags": None})


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE].asleep})


async def _health_generate(request: web.Request) -> web.Response:
    """SGLang's ``GET /health_generate``: 200 (no body) when the engine can generate, 503 when it
    cannot; a process-wide injected status is what its generation answers."""
    state = request.app[STATE]
    if state.health != "healthy":
        return _error(503, f"the engine is {state.health}", "engine_unavailable", "service_unavailable")
    if state.faults.status is not None:
        status = state.faults.status
        return _error(status, f"injected fault: status {status}", "mock_fault", "server_error")
    return web.Response()


#: The size of a `huge` answer (a misbehaving node's).
HUGE_ANSWER = 64 << 20


async def _misbehaving(
    request: web.Request, how: str, payload: Mapping[str, object], status: int
) -> web.StreamResponse:
    """A JSON answer, or a misbehaving node's version of it (see MockState.health_body)."""
    if how == "garbage":
        return web.Response(body=b"\xff\xfe\xfd not utf-8 \x80", status=status, content_type="application/json")
    if how != "huge":
        return web.json_response(payload, status=status)
    response = web.StreamResponse(status=status, headers={"content-type": "application/json"})
    response.content_length = HUGE_ANSWER
    await response.prepare(request)
    head = json.dumps(payload)[:-1].encode() + b', "padding": "'
    piece = b"x" * (1 << 20)
    sent = len(head)
    await response.write(head)
    while sent + len(piece) < HUGE_ANSWER - 2:
        await response.write(piece)
        sent += len(piece)
    await response.write(b"x" * (HUGE_ANSWER - 2 - sent) + b'"}')
    return response


async def _terminate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.settings.allow_terminate:
        return _error(400, "terminate is not allowed: start the engine with --allow-terminate", "terminate_not_allowed")
    state.terminated.set()
    return web.Response()


async def _mock_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats())


async def _flush_cache(request: web.Request) -> web.Response:
    """SGLang's ``POST /flush_cache``: the prefix cache emptied (``MockState.flush_cache``)."""
    request.app[STATE].flush_cache()
    return web.Response(text="Cache flushed.\n")


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's ``POST /reset_prefix_cache`` (served in its dev mode): the prefix cache emptied
    (``MockState.flush_cache``), an empty 200. vLLM would refuse, or with
    ``reset_running_requests`` preempt, requests holding blocks; these keep theirs, unshared."""
    request.app[STATE].flush_cache()
    return web.Response()


async def _mock_requests(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[STATE].records))


async def _start_kv_events(app: web.Application) -> None:
    state = app[STATE]
    assert state.batcher is not None
    settings = state.settings
    publisher = KvEventPublisher(
        settings.kv_events,
        settings.kv_events_replay or None,
        model=state.batcher.model,
        dialect=settings.kv_events_dialect,
    )
    publisher.start()
    state.kv_events = publisher
    state.batcher.cache.observer = publisher


async def _mock_kv_events(request: web.Request) -> web.Response:
    """The KV events' knobs: ``{"drop": N}``, ``{"lose": N}``, ``{"restart": true}`` (see
    ``kv_publisher``); answers what was published."""
    state = request.app[STATE]
    if state.kv_events is None:
        return _error(404, "this engine publishes no KV events (--kv-events)", "not_found")
    try:
        knobs = await request.json()
    except ValueError:
        knobs = {}
    if not isinstance(knobs, dict):
        return _error(400, "a JSON object of knobs", "invalid_request_error")
    publisher = state.kv_events
    if isinstance(knobs.get("drop"), int):
        publisher.drop(knobs["drop"])
    if isinstance(knobs.get("lose"), int):
        publisher.lose(knobs["lose"])
    if knobs.get("restart") is True:
        publisher.restart()
    return web.json_response({**publisher.config(), "published": publisher.published})


async def _mock_reset(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.requests = state.completed = state.disconnected = 0
    state.peak_active = state.active
    state.records.clear()
    if state.batcher is not None:
        state.batcher.reset()
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


async def _engine_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine_info_status != 200:
        return _error(state.engine_info_status, "engine_info failed (injected)", "mock_fault", "server_error")
    state.links.record("engine_info", "")
    body = distserve.engine_info(state.settings.tp_size, state.settings.block_size)
    return web.Response(text=body, content_type="application/json")


async def _json_body(request: web.Request) -> JsonObject:
    try:
        body: JsonValue = await request.json()
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}


def _integer(body: JsonObject, name: str) -> int:
    """An integer a mock engine sent another (-1 when it is missing or not a number)."""
    value = body.get(name, -1)
    return int(value) if isinstance(value, int | float | str) else -1


def _list(body: JsonObject, name: str) -> list[JsonValue]:
    value = body.get(name)
    return value if isinstance(value, list) else []


async def _p2p_initialize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    peer = str(body.get("remote_engine_id"))
    state.links.record("p2p_initialize", peer)
    transport, wrong = distserve.check_transport(body)
    if transport is None:
        return _error(422, f"p2p_initialize: {wrong}", "invalid_request")  # FastAPI's validation status
    state.links.initialized.add(peer)
    state.links.transport[peer] = transport
    host = request.host.rsplit(":", 1)[0]
    endpoint = {"protocol": body["protocol"], "endpoint_info": f"{transport['protocol'].lower()}-{peer}"}
    return web.json_response(
        {
            "status": distserve.STATUS_SUCCESS,
            "engine_endpoint_info": {"zmq_address": f"tcp://{host}:{50000 + len(state.links.initialized)}"},
            "kvtransfer_endpoint_info": [endpoint],
        }
    )


async def _p2p_connect(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    peer = str(body.get("remote_engine_id"))
    state.links.record("p2p_connect", peer)
    if peer not in state.links.initialized:
        # LMDeploy raises KeyError here: a 500.
        return web.Response(status=500, text="Internal Server Error")
    protocol = body.get("protocol")
    if not isinstance(protocol, int) or distserve.PROTOCOLS.get(protocol) != state.links.transport[peer]["protocol"]:
        # The engine connects with the backend p2p_initialize set up for that protocol, or fails.
        return web.Response(status=500, text="Internal Server Error")
    state.links.connected.add(peer)
    return web.json_response({"status": distserve.STATUS_SUCCESS})


async def _p2p_drop_connect(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    peer = str(body.get("remote_engine_id"))
    state.links.record("p2p_drop_connect", peer)
    state.links.connected.discard(peer)
    state.links.initialized.discard(peer)
    state.links.transport.pop(peer, None)
    return web.json_response({"success": True})


async def _free_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    session_id = body.get("remote_session_id")
    if isinstance(session_id, int):
        state.ledger.free(session_id, "proxy")
    return web.json_response({"status": "SUCCESS"})  # always, as LMDeploy does


async def _mock_migrate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    error = state.ledger.migrate(
        _integer(body, "session_id"), _list(body, "block_ids"), _integer(body, "token_id"), "decode"
    )
    return web.json_response({"error": error})


async def _mock_vllm_read(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    raw_id = str(body.get("remote_request_id", ""))
    session_id = int(raw_id.removeprefix("vllm-")) if raw_id.removeprefix("vllm-").isdigit() else -1
    error = state.ledger.read(session_id, _list(body, "block_ids"), "decode")
    return web.json_response({"error": error})


async def _mock_sglang_join(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    ok = await state.rendezvous.join(_integer(body, "room"), state.settings.bootstrap_timeout_ms / 1000)
    return web.json_response({"ok": ok})


async def _server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    port = int(request.host.rpartition(":")[2] or 0)
    return web.json_response(
        {
            "disaggregation_mode": None if state.settings.role == "hybrid" else state.settings.role,
            "disaggregation_bootstrap_port": port,  # the mock serves its bootstrap endpoints itself
            "served_model_name": state.settings.model,
            "tp_size": state.settings.tp_size,
            **({"kv_events_config": state.kv_events.config()} if state.kv_events is not None else {}),
        }
    )


async def _mock_ledger(request: web.Request) -> web.Response:
    state = request.app[STATE]
    extra = {
        "links": state.links.log,
        "connected": sorted(state.links.connected),
        "transport": state.links.transport,
        "rendezvous": state.rendezvous.report(),
        "vllm_remote": state.vllm_remote,
        "local_prefills": state.local_prefills,
    }
    return web.json_response({**state.ledger.report(), **extra})


async def _mock_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    for name in ("engine_info_status", "models_status", "metrics_status"):
        if name in body:
            setattr(state, name, _integer(body, name))
    if "metrics_body" in body:
        shape = body["metrics_body"]
        if not isinstance(shape, str) or shape not in METRICS_SHAPES:
            return _error(400, f"metrics_body must be one of {', '.join(METRICS_SHAPES)}", "invalid_request")
        state.metrics_body = shape
    for knob in ("health_body", "models_body"):
        if knob in body:
            if body[knob] not in ANSWER_SHAPES:
                return _error(400, f"{knob} must be one of {', '.join(ANSWER_SHAPES)}", "invalid_request")
            setattr(state, knob, body[knob])
    config = {
        "engine_info_status": state.engine_info_status,
        "models_status": state.models_status,
        "metrics_status": state.metrics_status,
        "metrics_body": state.metrics_body,
    }
    return web.json_response({**config, "health_body": state.health_body, "models_body": state.models_body})


#: How a misbehaving node may answer /health and /v1/models (see MockState.health_body).
ANSWER_SHAPES = ("json", "garbage", "huge")


#: How a misbehaving engine may answer /metrics (see MockState.metrics_body), and the size of a
#: `huge` answer.
METRICS_SHAPES = ("prometheus", "foreign", "huge")
METRICS_HUGE = 8 << 20


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics_status != 200:
        return _error(state.metrics_status, "/metrics failed (injected)", "mock_fault", "server_error")
    if state.metrics_body == "foreign":
        text = b"# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n"
    elif state.metrics_body == "huge":
        text = b"# padding\n" * (METRICS_HUGE // 10)
    else:
        text = engine_metrics.render(state.settings.metrics_dialect, state.figures())
    return web.Response(body=text, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})


def engine_model(settings: MockSettings) -> EngineModel:
    """The simulated engine's time model, from the settings."""
    return EngineModel(
        kv_blocks=settings.kv_blocks,
        kv_block_tokens=settings.kv_block_tokens,
        max_batch=settings.max_batch,
        max_step_tokens=settings.max_step_tokens,
        prefill_ms_per_token=settings.prefill_ms_per_token,
        decode_step_ms=settings.decode_step_ms,
        decode_step_ms_per_seq=settings.decode_step_ms_per_seq,
    )


def build_app(settings: MockSettings) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    faults = parse_faults(settings.fault, settings.role) if settings.fault else NO_FAULTS
    app[STATE] = MockState(settings=settings, faults=faults, ledger=KvLedger(settings.block_size))
    if settings.simulate:
        app[STATE].batcher = ContinuousBatcher(engine_model(settings))
    if settings.kv_events:  # with simulate, as the settings check
        app.on_startup.append(_start_kv_events)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _inference(request, chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _inference(request, chat=False)

    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", _health)
    if settings.metrics_dialect == "sglang":  # vLLM and LMDeploy have no such route
        app.router.add_get("/health_generate", _health_generate)
    if settings.metrics_dialect == "vllm":  # its sleep mode (dev mode routes)
        app.router.add_post("/sleep", _sleep)
        app.router.add_post("/wake_up", _wake_up)
        app.router.add_get("/is_sleeping", _is_sleeping)
    app.router.add_get("/terminate", _terminate)
    app.router.add_get("/mock/stats", _mock_stats)
    app.router.add_post("/flush_cache", _flush_cache)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/mock/requests", _mock_requests)
    app.router.add_post("/mock/reset", _mock_reset)
    app.router.add_post("/mock/health", _mock_health)
    app.router.add_get("/distserve/engine_info", _engine_info)
    app.router.add_post("/distserve/p2p_initialize", _p2p_initialize)
    app.router.add_post("/distserve/p2p_connect", _p2p_connect)
    app.router.add_post("/distserve/p2p_drop_connect", _p2p_drop_connect)
    app.router.add_post("/distserve/free_cache", _free_cache)
    app.router.add_post("/mock/migrate", _mock_migrate)
    app.router.add_get("/mock/ledger", _mock_ledger)
    app.router.add_post("/mock/vllm_read", _mock_vllm_read)
    app.router.add_post("/mock/sglang_join", _mock_sglang_join)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_post("/mock/config", _mock_config)
    app.router.add_post("/mock/kv_events", _mock_kv_events)
    app.router.add_get("/metrics", _metrics)

    async def close_client(app: web.Application) -> None:
        client = app[STATE].client
        if client is not None:
            await client.close()
        batcher = app[STATE].batcher
        if batcher is not None:
            await batcher.aclose()
        publisher = app[STATE].kv_events
        if publisher is not None:
            await publisher.aclose()

    app.on_cleanup.append(close_client)
    return app


class MockEngine:
    """A mock engine served on a real socket in the running event loop::

    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        ...  # engine.url is http://127.0.0.1:<port>
    """

    def __init__(self, settings: MockSettings | None = None, **overrides: object) -> None:
        base = settings or MockSettings(port=0)
        self.settings = MockSettings.of(overrides, base) if overrides else base
        self.app = build_app(self.settings)
        self._runner: web.AppRunner | None = None
        self.port = self.settings.port

    @property
    def state(self) -> MockState:
        return self.app[STATE]

    @property
    def url(self) -> str:
        scheme = "https" if self.settings.ssl_certfile else "http"
        return f"{scheme}://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its handler at once, as a real
        # engine aborts the request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        tls = None
        if self.settings.ssl_certfile:  # as an api_server started with --ssl
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.settings.ssl_certfile, self.settings.ssl_keyfile)
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, backlog=1024, ssl_context=tls)
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
