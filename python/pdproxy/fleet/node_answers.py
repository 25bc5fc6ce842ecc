"""Reading what a node answers the control plane (``/health``, ``/v1/models``, handshakes):
never more than a bound, so a broken or hostile node cannot make the proxy hold its answer."""

from __future__ import annotations

import aiohttp

from pdproxy._json_types import JsonValue, loads
from pdproxy.errors import AnswerTooLarge

#: Largest answer read from a node's control endpoints.
ANSWER_LIMIT = 1 << 20


async def read_limited(response: aiohttp.ClientResponse, limit: int = ANSWER_LIMIT) -> bytes:
    """The answer's body, refused once it grows past ``limit`` bytes (what was read is dropped)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise AnswerTooLarge(f"the answer is too large ({declared} bytes, at most {limit} are read)")
    body = await response.content.read(limit + 1)
    if len(body) > limit:
        raise AnswerTooLarge(f"the answer is too large (more than {limit} bytes)")
    return body


async def read_json(response: aiohttp.ClientResponse, limit: int = ANSWER_LIMIT) -> JsonValue:
    """The answer as JSON (``None`` when it is not JSON); raises ``AnswerTooLarge``."""
    body = await read_limited(response, limit)
    try:
        return loads(body.decode("utf-8", errors="replace")) if body.strip() else None
    except ValueError:
        return None
