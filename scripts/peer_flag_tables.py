#!/usr/bin/env python3
"""Write the peer routers' flag tables that `pdproxy` reads their command lines with
(python/pdproxy/peers/flags/<router>.json) from the dumps of their own parsers
(tests/fixtures/peer_parsers/<router>-<version>.json, made by scripts/peer_parsers.py).

A table keeps what reading a command line needs (option strings, dest, action, nargs, value
type, default, choices, the parser's prog) and nothing else: no help text. Run it after
regenerating a dump; tests/peers/test_peer_cli.py checks the tables match the dumps.

    python scripts/peer_flag_tables.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DUMPS = ROOT / "tests" / "fixtures" / "peer_parsers"
TABLES = ROOT / "python" / "pdproxy" / "peers" / "flags"

#: The value types a table names; a peer's own converter (a lambda, a CSV parser) reads as text.
TYPES = {"int": "int", "float": "float", "str": "str"}
#: argparse actions by the name a table gives them.
ACTIONS = {"store", "store_true", "store_false", "store_const", "append", "extend", "count", "help"}


def dumps() -> dict[str, Path]:
    """The dump of each router: the newest version's file."""
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in DUMPS.glob("*.json"):
        match = re.fullmatch(r"(.+)-(\d+(?:\.\d+)*)", path.stem)
        if match is None:
            continue
        router, version = match.group(1), tuple(int(p) for p in match.group(2).split("."))
        if router not in found or version > found[router][0]:
            found[router] = (version, path)
    return {router: path for router, (_, path) in sorted(found.items())}


def option(entry: dict[str, object]) -> dict[str, object]:
    """One option as a table keeps it."""
    action = str(entry["action"])
    if action == "BooleanOptionalAction":
        action = "boolean_optional"
    elif action not in ACTIONS:
        raise SystemExit(f"peer_flag_tables: unknown argparse action {action!r} of {entry['option_strings']}")
    kind = entry["type"]
    return {
        "flags": entry["option_strings"],
        "dest": entry["dest"],
        "action": action,
        "nargs": entry["nargs"] if action not in ("store_true", "store_false", "boolean_optional", "help") else 0,
        "type": TYPES.get(str(kind), "str") if kind is not None else None,
        "default": entry["default"],
        "choices": entry["choices"],
        "const": entry["const"],
    }


def table(path: Path) -> dict[str, object]:
    dump = json.loads(path.read_text())
    parser = dump["parser"]
    version = dump.get("distribution", {}).get("version") or path.stem.rsplit("-", 1)[1]
    return {
        "router": dump["router"],
        "version": version,
        "from": f"tests/fixtures/peer_parsers/{path.name}",
        "prog": parser["prog"],
        "options": [option(entry) for entry in parser["options"] if entry["action"] != "help"],
    }


def main() -> int:
    TABLES.mkdir(parents=True, exist_ok=True)
    for router, path in dumps().items():
        out = TABLES / f"{router}.json"
        out.write_text(json.dumps(table(path), indent=1, sort_keys=True) + "\n")
        print(f"peer_flag_tables: {out.relative_to(ROOT)} from {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
