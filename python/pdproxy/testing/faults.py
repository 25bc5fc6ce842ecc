"""Fault injection for the mock engine.

A fault spec is a ``;``-separated list of knobs, given per process (``--fault``) or per
request (header ``x-mock-fault``, which overrides the process's knobs one by one)::

    status=503            answer with this HTTP status and an OpenAI error body
    hang                  accept the request and never send the response head
    drop_after=3          close the connection after 3 events (at once when not streaming)
    ttft_ms=200           wait this long before the first token (or before the status above)
    token_delay_ms=50     wait this long between tokens
    fragment=7            write each event in pieces of 7 bytes (tests that framing survives)
    no_id                 a prefill answer without its session handle (`id`, `cache_session_id`)
    stop_first            a vLLM prefill whose one token ends the answer (it returns null params)
    stall_body            announce the whole answer's length, send half of it, then go silent
    endless               an answer that never ends: an event (streams) or a piece of JSON text
                          every 10 ms, for as long as the client reads

A knob may be scoped to one role, for requests that reach both legs of a disaggregated
request: ``prefill.status=500``, ``decode.drop_after=2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FAULT_HEADER = "x-mock-fault"


class FaultSpecError(ValueError):
    """A fault spec that cannot be parsed."""


@dataclass(frozen=True)
class Faults:
    status: int | None = None
    hang: bool = False
    drop_after: int | None = None
    ttft_ms: float | None = None
    token_delay_ms: float | None = None
    fragment: int | None = None
    no_id: bool = False
    stop_first: bool = False
    stall_body: bool = False
    endless: bool = False

    def merged(self, override: Faults) -> Faults:
        """These knobs with every knob that ``override`` sets replaced."""
        changes = {
            f.name: getattr(override, f.name)
            for f in dataclasses.fields(override)
            # Identity, not equality: 0 is a knob's value (drop_after=0), not an unset knob.
            if getattr(override, f.name) is not None and getattr(override, f.name) is not False
        }
        return dataclasses.replace(self, **changes)


NO_FAULTS = Faults()

#: `mock-engine --fault`'s help: every knob, from the fields above.
FAULT_HELP = (
    "Faults for every request, as ;-separated knobs: "
    + ", ".join(f.name if f.default is False else f"{f.name}=N" for f in dataclasses.fields(Faults))
    + "; one role's only as prefill.KNOB or decode.KNOB. A request's x-mock-fault header overrides "
    "them knob by knob (pdproxy/testing/faults.py says what each does)."
)


ROLES = ("hybrid", "prefill", "decode")


def parse_faults(spec: str, role: str | None = None) -> Faults:
    """The knobs of ``spec`` that apply to an engine of ``role`` (all unscoped knobs, and
    those scoped to it)."""
    knobs: dict[str, object] = {}
    for item in spec.replace(",", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip().replace("-", "_")
        scope, dot, rest = name.partition(".")
        if dot:
            if scope not in ROLES:
                raise FaultSpecError(f"unknown role {scope!r} in fault knob {item!r}")
            if role is not None and scope != role:
                continue
            name = rest
        try:
            if name in ("hang", "no_id", "stop_first", "stall_body", "endless") and not value:
                knobs[name] = True
            elif name in ("status", "drop_after", "fragment"):
                knobs[name] = int(value)
            elif name in ("ttft_ms", "token_delay_ms"):
                knobs[name] = float(value)
            else:
                raise FaultSpecError(f"unknown fault knob {item!r}")
        except ValueError as e:
            if isinstance(e, FaultSpecError):
                raise
            raise FaultSpecError(f"bad value in fault knob {item!r}") from e
    status = knobs.get("status")
    if isinstance(status, int) and not 100 <= status <= 599:
        raise FaultSpecError(f"status must be an HTTP status, got {status}")
    fragment = knobs.get("fragment")
    if isinstance(fragment, int) and fragment < 1:
        raise FaultSpecError(f"fragment must be at least 1 byte, got {fragment}")
    return Faults(**knobs)  # type: ignore[arg-type]
