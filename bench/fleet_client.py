"""The fleet benchmark's client: open-loop arrivals from a trace, every answer streamed.

Each conversation starts at its time in the trace whatever happens to the others (open loop);
within a conversation a turn is sent a think time after the previous answer arrived, with the
real answer in its history (so the prompt is what the engine's KV cache may hold). Turns that
would start after the arrival window are not sent. Per request it records the time to the first
token (the first event with content), the whole time, the tokens, the prompt and cached tokens
the engine reports (``usage``), and how late it was sent (``lag``: the client keeps up when it
stays near zero).

The trace's events (an engine's cache flushed, an engine restarted) are fired at their times on
the fleet's control port (the oracle's, ``fleet_engines.py``), whichever router the traffic goes
through; the client notes the requests each engine had received then and ``EVENT_WINDOW``
seconds later, to tell the share of the traffic the engine got back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from fleet_workloads import Conversation, Event, Trace

#: Seconds after an event over which the engine's share of the traffic, and the first tokens of
#: the requests sent meanwhile, are looked at.
EVENT_WINDOW = 4.0


@dataclass
class Outcome:
    conversation: int
    turn: int
    #: When the request was due and when it went out, seconds from the start of the run.
    due: float
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Fired:
    """An event as fired: when (seconds from the start), and the requests each engine had
    received then and ``EVENT_WINDOW`` seconds later (None: not known, see ``error``)."""

    event: Event
    sent: float
    requests: list[int] | None = None
    requests_later: list[int] | None = None
    error: str | None = None


@dataclass
class Played:
    outcomes: list[Outcome]
    fired: list[Fired]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, object], out: Outcome, t0: float) -> str:
    """Sends one request and reads its stream; returns the answer's text."""
    loop = asyncio.get_running_loop()
    pieces: list[str] = []
    buffer = b""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            out.error = f"HTTP {response.status}"
            await response.read()
            return ""
        async for chunk in response.content.iter_any():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                data = event.strip().removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                try:
                    message = json.loads(data)
                except ValueError:
                    continue
                if "error" in message:
                    out.error = "error event"
                    continue
                for choice in message.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if out.ttft is None:
                            out.ttft = loop.time() - t0 - out.sent
                        pieces.append(content)
                        out.tokens += 1
                usage = message.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out.e2e = loop.time() - t0 - out.sent
    return "".join(pieces)


async def _converse(
    session: aiohttp.ClientSession,
    urls: Iterator[str],
    model: str,
    index: int,
    conversation: Conversation,
    t0: float,
    window: float,
    outcomes: list[Outcome],
) -> None:
    loop = asyncio.get_running_loop()
    answers: list[str] = []
    due = conversation.start
    for turn in range(len(conversation.turns)):
        if due >= window:
            return
        await asyncio.sleep(max(0.0, t0 + due - loop.time()))
        out = Outcome(index, turn, due=due, sent=loop.time() - t0)
        outcomes.append(out)
        try:
            answer = await _stream(session, next(urls), conversation.body(model, answers), out, t0)
        except (aiohttp.ClientError, TimeoutError) as e:
            out.error = type(e).__name__
            answer = ""
        except asyncio.CancelledError:
            out.error = "not finished"
            raise
        answers.append(answer)
        if turn + 1 < len(conversation.turns):
            due = loop.time() - t0 + conversation.think[turn + 1]


async def _received(session: aiohttp.ClientSession, control: str) -> list[int]:
    """The requests each engine has received (its ``/mock/stats``), in the fleet's order."""
    async with session.get(control + "/fleet/stats") as r:
        r.raise_for_status()
        return [int(engine["requests"]) for engine in (await r.json()).values()]


async def _fire(session: aiohttp.ClientSession, control: str, event: Event, t0: float, out: list[Fired]) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + event.at - loop.time()))
    fired = Fired(event, sent=loop.time() - t0)
    out.append(fired)
    try:
        async with session.post(f"{control}/fleet/{event.kind}", params={"engine": str(event.engine)}) as r:
            r.raise_for_status()
            fired.requests = [int(n) for n in (await r.json())["requests"]]
        await asyncio.sleep(max(0.0, t0 + fired.sent + EVENT_WINDOW - loop.time()))
        fired.requests_later = await _received(session, control)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
        fired.error = f"{type(e).__name__}: {e}"


async def run(
    url: str | list[str], model: str, trace: Trace, window: float, drain: float, control: str | None = None
) -> Played:
    """Plays ``trace`` against ``url`` (the base URL of a router; several: replicas of one, each
    request sent to the next in turn) for ``window`` seconds of arrivals, then waits up to
    ``drain`` seconds for the answers still coming. Its events go to ``control``, the fleet's
    control port (needed when the trace has any)."""
    if trace.events and control is None:
        raise ValueError(f"{trace.workload}: its events need the fleet's control port")
    outcomes: list[Outcome] = []
    fired: list[Fired] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=window + drain)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        urls = [url] if isinstance(url, str) else url
        endpoints = itertools.cycle([u + "/v1/chat/completions" for u in urls])
        tasks = [
            asyncio.create_task(_converse(session, endpoints, model, i, c, t0, window, outcomes))
            for i, c in enumerate(trace.conversations)
        ]
        if control is not None:
            tasks += [asyncio.create_task(_fire(session, control, e, t0, fired)) for e in trace.events]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + window + drain - loop.time()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return Played(outcomes, fired)
