"""``GET /dashboard``: one self-contained page (no build step, no external assets) that shows
the nodes, their health, load, latency, their engines' own figures and the PD links, refreshed every second from
``GET /dashboard/data``. With admin keys, open it as ``/dashboard#key=KEY``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from pdproxy.fleet.fleet import NodeStatusRow
    from pdproxy.pd import PdStatus
    from pdproxy.server.supervisor import Supervisor

#: The page, shipped next to this module.
PAGE = (Path(__file__).parent / "dashboard.html").read_bytes()


class DashboardData(TypedDict):
    """What the page shows, read each second."""

    time: float
    #: As ``/nodes/status`` shows them.
    nodes: dict[str, NodeStatusRow]
    queued: int
    in_flight: int
    draining: bool
    pd: PdStatus | None


def data(app: Supervisor) -> DashboardData:
    fleet = app.fleet
    pd = fleet.pd.status() if fleet is not None and fleet.pd is not None else None
    return DashboardData(
        time=time.time(),
        nodes=fleet.status() if fleet is not None else {},
        queued=app.router.queued if app.router is not None else 0,
        in_flight=app.in_flight,
        draining=app.draining,
        pd=pd,
    )
