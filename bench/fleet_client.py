"""The fleet benchmark's client: open-loop arrivals from a trace, every answer streamed.

Each conversation starts at its time in the trace whatever happens to the others (open loop);
within a conversation a turn is sent a think time after the previous answer arrived, with the
real answer in its history (so the prompt is what the engine's KV cache may hold). Turns that
would start after the arrival window are not sent. Per request it records the time to the first
token (the first event with content), the whole time, the tokens, the prompt and cached tokens
the engine reports (``usage``), and how late it was sent (``lag``: the client keeps up when it
stays near zero).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from fleet_workloads import Conversation, Trace


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
    url: str,
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
            answer = await _stream(session, url, conversation.body(model, answers), out, t0)
        except (aiohttp.ClientError, TimeoutError) as e:
            out.error = type(e).__name__
            answer = ""
        except asyncio.CancelledError:
            out.error = "not finished"
            raise
        answers.append(answer)
        if turn + 1 < len(conversation.turns):
            due = loop.time() - t0 + conversation.think[turn + 1]


async def run(url: str, model: str, trace: Trace, window: float, drain: float) -> list[Outcome]:
    """Plays ``trace`` against ``url`` (the base URL of a router) for ``window`` seconds of
    arrivals, then waits up to ``drain`` seconds for the answers still coming."""
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=window + drain)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        endpoint = url + "/v1/chat/completions"
        tasks = [
            asyncio.create_task(_converse(session, endpoint, model, i, c, t0, window, outcomes))
            for i, c in enumerate(trace.conversations)
        ]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + window + drain - loop.time()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outcomes
