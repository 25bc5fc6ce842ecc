"""``pdproxy --worker-urls ...`` and ``pdproxy launch ...``: a peer router's command line,
program name changed, read into ``pdproxy serve`` arguments, said in a few lines on stderr,
then served."""

from __future__ import annotations

import sys

import click

from .flags import ROUTERS, table
from .help import describe
from .plan import Refused
from .takeover import NotRead, read, whose

__all__ = ["take_over"]

#: pdproxy's own words in a peer's command line: whose line it is, and two of `serve`'s.
AS_ROUTER = "--as-router"
PASSED_ON = ("--print-config", "--config")
_SECRET_SETTINGS = ("--node-api-key", "--admin-keys")


def _split(args: list[str]) -> tuple[str | None, list[str], list[str], bool]:
    """(the router named by --as-router, the peer's words, pdproxy serve's words, help asked)."""
    router, theirs, ours, wants_help = None, [], [], False
    words = iter(args)
    for word in words:
        name, eq, value = word.partition("=")
        if name == AS_ROUTER:
            router = value if eq else next(words, "")
            if router not in ROUTERS:
                raise click.UsageError(f"{AS_ROUTER} takes one of {', '.join(ROUTERS)}, got {router!r}")
        elif name in PASSED_ON:
            ours.append(word)
            if name == "--config" and not eq:
                ours.append(next(words, ""))
        elif word in ("-h", "--help"):
            wants_help = True
        else:
            theirs.append(word)
    return router, theirs, ours, wants_help


def _shown(args: list[str]) -> str:
    """The serve arguments as printed: key material hidden."""
    out = []
    for arg in args:
        name, _eq, value = arg.partition("=")
        if name in _SECRET_SETTINGS or (name == "--node" and ",api_key=" in value):
            arg = f"{name}=<hidden>"
        out.append(arg)
    return " ".join(out)


def take_over(args: list[str], default_router: str | None) -> None:
    """Reads ``args`` as a peer router's command line (``default_router``'s, unless
    --as-router says another or it is None: then the first router whose parser reads it) and
    serves what it asks; one line and exit status 2 for a line pdproxy does not take."""
    from pdproxy.cli import serve

    router, theirs, ours, wants_help = _split(args)
    if wants_help:
        click.echo(describe(router or default_router))
        return
    try:
        router = router or default_router or whose(theirs)
        plan = read(theirs, router)
    except (NotRead, Refused) as e:
        where = f" (as {router})" if router else ""
        click.echo(f"pdproxy{where}: {e}", err=True)
        sys.exit(2)
    flags = table(router)
    serve_args = plan.serve_args()
    click.echo(
        f"pdproxy: a {router} {flags.version} command line (say {AS_ROUTER} NAME to read it as another's: "
        f"{', '.join(r for r in ROUTERS if r != router)}), served as: pdproxy serve {_shown(serve_args)}",
        err=True,
    )
    for line in plan.notes:
        click.echo(f"pdproxy: note: {line}", err=True)
    serve.main(args=[*serve_args, *ours], prog_name="pdproxy serve")
