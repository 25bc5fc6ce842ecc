"""Reading a peer router's command line: whose it is, what its parser reads, and the plan of
pdproxy settings it comes to."""

from __future__ import annotations

import argparse
from typing import NoReturn

from .flags import ROUTERS, table
from .plan import Plan, Refused
from .rules import POLICIES, rule_of

__all__ = ["NotRead", "read"]


class NotRead(Exception):
    """The command line is not one pdproxy can take: the one line that says why."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises where it would print and exit."""

    def error(self, message: str) -> NoReturn:
        raise NotRead(f"{self.prog}: error: {message}")


def _parse(router: str, argv: list[str]) -> dict[str, object]:
    """What ``router``'s parser reads from ``argv`` (only what the line gave). Raises ``NotRead``."""
    parser = table(router).parser(_Parser)
    try:
        namespace, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise NotRead(f"{parser.prog}: error: {e}") from None
    if extra:
        raise NotRead(f"{parser.prog}: error: unrecognized arguments: {' '.join(extra)}")
    return vars(namespace)


def whose(argv: list[str]) -> str:
    """The first router (in ``ROUTERS`` order) whose parser reads ``argv``. Raises ``NotRead``
    with the first one's complaint when none does."""
    first: NotRead | None = None
    for router in ROUTERS:
        try:
            _parse(router, argv)
        except NotRead as e:
            first = first or e
            continue
        return router
    assert first is not None
    raise NotRead(f"{first} (no router's parser reads this line: {', '.join(ROUTERS)})")


def read(argv: list[str], router: str) -> Plan:
    """The plan of ``router``'s command line ``argv``. Raises ``NotRead`` (the parser's
    complaint) or ``Refused`` (a flag pdproxy does not take)."""
    given = _parse(router, argv)
    flags = table(router)
    plan = Plan(router, given)
    for dest, value in given.items():
        flag = flags.by_dest[dest].name
        rule = rule_of(router, dest)
        if rule is None or rule.apply is None:
            raise Refused(flag, "pdproxy has no meaning for it")
        rule.apply(plan, flag, value)
    _their_defaults(plan)
    _pd(plan)
    _policies(plan)
    return plan


def _their_defaults(plan: Plan) -> None:
    """Where clients and scrapers reach the router: its own defaults, as it would bind."""
    flags = table(plan.router).by_dest
    for dest, setting in (
        ("host", "host"),
        ("port", "port"),
        ("prometheus_port", "metrics_port"),
        ("prometheus_host", "metrics_host"),
    ):
        flag = flags.get(dest)
        if dest not in plan.given and flag is not None and flag.default is not None:
            plan.set(setting, flag.default)


def _pd(plan: Plan) -> None:
    roles = {worker.role for worker in plan.workers}
    if plan.pd_protocol is None:
        if roles - {"hybrid"}:
            pd_flag = next(
                (f.name for f in table(plan.router).flags if f.dest.endswith("pd_disaggregation")),
                "--pd-disaggregation",
            )
            raise Refused("--prefill/--decode", f"name prefill and decode workers with {pd_flag}")
        return
    plan.set("serving_strategy", "DistServe")
    plan.set("pd_protocol", plan.pd_protocol)
    if "hybrid" in roles:
        raise Refused("--worker-urls", "in prefill/decode mode name the workers with --prefill and --decode")


def _policies(plan: Plan) -> None:
    for role, name in plan.policies.items():
        ours, why = POLICIES[name]
        plan.set(role, ours)
        if ours != name:
            plan.note(f"--{role.replace('_', '-')} {name}", f"routed with pdproxy's {ours}: {why}")
