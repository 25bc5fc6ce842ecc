"""The peer routers' flag tables (``flags/<router>.json``, written by
``scripts/peer_flag_tables.py`` from dumps of their own parsers) and an argparse parser built
from one, which reads a command line as that router's parser does: the same option strings,
nargs, actions, types and choices, and argparse's prefix abbreviations (``--worker`` for
``--worker-urls``), which every one of them allows."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

__all__ = ["ROUTERS", "Flag", "FlagTable", "table"]

#: The routers whose command lines pdproxy reads, in the order a line is tried when it does
#: not say whose it is (``--as-router``): the SGLang gateway's Python launcher first (the most
#: used), SMG last (``pdproxy launch`` names it; its parser reads most of the others' lines).
ROUTERS = ("sglang-router", "vllm-router", "lmdeploy-router", "smg")

#: A value's type by the name a table gives it (None: argparse keeps the text).
_TYPES: dict[str | None, type[int] | type[float] | type[str]] = {"int": int, "float": float, "str": str, None: str}


@dataclass(frozen=True)
class Flag:
    """One option of a peer's parser."""

    flags: tuple[str, ...]
    dest: str
    action: str
    nargs: int | str | None
    type: str | None
    default: object
    choices: tuple[object, ...] | None
    const: object

    @property
    def name(self) -> str:
        """How pdproxy names it in what it prints: its first long spelling."""
        return next((f for f in self.flags if f.startswith("--") and not f.startswith("--no-")), self.flags[0])

    @property
    def takes_value(self) -> bool:
        return self.action not in ("store_true", "store_false", "store_const", "count", "boolean_optional")


class FlagTable:
    """A router's flags, and a parser that reads its command lines."""

    def __init__(self, router: str, version: str, prog: str, flags: list[Flag]) -> None:
        self.router = router
        self.version = version
        self.prog = prog
        self.flags = flags
        self.by_dest = {flag.dest: flag for flag in flags}

    def parser(self, kind: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
        """An argparse parser (of class ``kind``) reading as the router's; every default is left
        out, so that the namespace holds only what the command line gave."""
        parser = kind(
            prog=self.prog, add_help=False, allow_abbrev=True, argument_default=argparse.SUPPRESS, exit_on_error=False
        )
        for flag in self.flags:
            if flag.action == "boolean_optional":
                names = [f for f in flag.flags if not f.startswith("--no-")]
                parser.add_argument(*names, dest=flag.dest, action=argparse.BooleanOptionalAction)
            elif flag.action == "store_const":
                parser.add_argument(*flag.flags, dest=flag.dest, action="store_const", const=flag.const)
            elif not flag.takes_value:
                parser.add_argument(*flag.flags, dest=flag.dest, action=flag.action)
            else:
                parser.add_argument(
                    *flag.flags,
                    dest=flag.dest,
                    action=flag.action,
                    nargs=flag.nargs,
                    type=_TYPES[flag.type],
                    choices=flag.choices,
                )
        return parser


@cache
def table(router: str) -> FlagTable:
    """The flag table of ``router`` (one of ``ROUTERS``)."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; pdproxy reads the command lines of {', '.join(ROUTERS)}")
    data = json.loads(resources.files(__package__).joinpath("flags", f"{router}.json").read_text())
    flags = [
        Flag(
            tuple(o["flags"]),
            o["dest"],
            o["action"],
            o["nargs"],
            o["type"],
            o["default"],
            tuple(o["choices"]) if o["choices"] is not None else None,
            o["const"],
        )
        for o in data["options"]
    ]
    return FlagTable(data["router"], data["version"], data["prog"], flags)
