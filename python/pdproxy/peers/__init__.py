"""Taking over from the routers people run today: the command lines of the SGLang gateway
(``python -m sglang_router.launch_router``, ``smg launch``), ``vllm-router`` and LMDeploy's
``lmdeploy-router`` start pdproxy with the same workers, modes and settings, program name
changed only (``pdproxy --worker-urls ...``, ``pdproxy launch ...`` for SMG).

Each router's flags are read as its own parser reads them (``flags``: tables made from dumps of
those parsers); each flag becomes a pdproxy setting, or is taken with a note that says why it has
no effect of its own, or is refused with one line that says why (``rules``); never ignored."""

from .flags import ROUTERS, table
from .plan import Plan, Refused, Worker
from .takeover import NotRead, read, whose

__all__ = ["ROUTERS", "NotRead", "Plan", "Refused", "Worker", "read", "table", "whose"]
