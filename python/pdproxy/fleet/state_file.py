"""The state file: registered nodes saved across restarts. Written whole to a temporary file
and renamed over the old one, so a crash never leaves half a file; readable by its owner only,
since it may hold nodes' API keys."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdproxy._json_types import JsonObject, loads

log = logging.getLogger("pdproxy.state")

VERSION = 1


def save(path: str, nodes: Sequence[Mapping[str, object]]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "nodes": nodes}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str) -> list[JsonObject]:
    """The saved nodes; none when the file does not exist. A damaged file is reported and
    ignored rather than keeping the proxy from starting."""
    try:
        data = loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.error("state file %s cannot be read (%s); starting without saved nodes", path, e)
        return []
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        log.error("state file %s has no node list; starting without saved nodes", path)
        return []
    return [n for n in nodes if isinstance(n, dict) and isinstance(n.get("url"), str)]
