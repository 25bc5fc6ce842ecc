"""``pdproxy --help`` for a peer router's command line: each of its flags, and what pdproxy
makes of it."""

from __future__ import annotations

import textwrap

from .flags import ROUTERS, table
from .rules import rule_of

__all__ = ["describe"]

_KINDS = {"setting": "->", "note": "taken, no effect of its own:", "refuse": "refused:"}


def describe(router: str | None) -> str:
    """The help text for ``router``'s command lines (all routers' when None)."""
    if router is None:
        head = (
            "pdproxy takes the command lines of "
            + ", ".join(ROUTERS)
            + " with the program name changed (smg launch: pdproxy launch). A line is read as the first of them "
            "whose parser reads it; --as-router NAME says whose it is. Each flag becomes a pdproxy setting, is "
            "taken with a note saying why it has no effect of its own, or is refused with one line saying why.\n"
            "Per router: pdproxy --as-router NAME --help"
        )
        return "\n".join(textwrap.wrap(head, 100, replace_whitespace=False))
    flags = table(router)
    lines = [f"pdproxy, reading {router} {flags.version} command lines (--as-router {router}):", ""]
    for flag in flags.flags:
        rule = rule_of(router, flag.dest)
        says = "no rule" if rule is None else f"{_KINDS[rule.kind]} {rule.says}"
        spelled = ", ".join(flag.flags)
        lines += textwrap.wrap(f"{spelled}  {says}", 110, subsequent_indent="    ")
    return "\n".join(lines)
