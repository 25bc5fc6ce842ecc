"""The `pdproxy` command: `serve` and `mock-engine`.

Options are generated from the settings dataclasses, so every option has exactly one
default (in `config.py` / `testing/mock_engine.py`) and one `PDPROXY_*` environment variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from . import __version__
from .config import ENV_PREFIX, Settings, field_type, load_toml
from .errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def _flag(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def settings_options(cls: type, envvar_prefix: str | None) -> Callable[[F], F]:
    """Adds one click option per field of the settings dataclass ``cls``."""

    def decorate(fn: F) -> F:
        for f in reversed(dataclasses.fields(cls)):
            kind = field_type(f)
            envvars = [f"{envvar_prefix}{f.name.upper()}"] if envvar_prefix else []
            envvars += f.metadata.get("env_aliases", ())
            common: dict[str, Any] = {
                "help": f.metadata.get("help"),
                "envvar": envvars or None,
                "show_envvar": bool(envvars),
            }
            flags = (_flag(f), *f.metadata.get("aliases", ()))
            if kind is bool:
                option = click.option(*flags, f.name, is_flag=True, default=f.default, show_default=True, **common)
            elif kind is tuple:
                default = f.default if f.default is not dataclasses.MISSING else ()
                option = click.option(*flags, f.name, multiple=True, type=str, default=default, **common)
            else:
                option = click.option(*flags, f.name, type=kind, default=f.default, show_default=True, **common)
            fn = option(fn)
        return fn

    return decorate


#: `pdproxy serve --help` shows the options in these groups (a setting's `section`), in this order.
SECTIONS = {
    "server": "Serving",
    "proxy": "Routing, limits and timeouts",
    "pd": "Prefill/decode disaggregation (--serving-strategy DistServe)",
    "security": "Keys, TLS and CORS",
    "health": "Health checks",
    "tenants": "Tenants: per-key limits, priorities and usage",
    "tracing": "Tracing (OpenTelemetry, OTLP/HTTP)",
}


class SettingsCommand(click.Command):
    """`pdproxy serve`: its help grouped by section, and multi-valued options that take several
    values after one flag as LMDeploy's (``--api-keys k1 k2``) as well as the flag repeated."""

    def __init__(self, *args: Any, settings: type, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fields = dataclasses.fields(settings)
        self.sections = {f.name: f.metadata.get("section", "proxy") for f in fields}
        self.greedy = {flag for f in fields if field_type(f) is tuple for flag in (_flag(f), *f.metadata["aliases"])}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_values(args, self.greedy))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(self.sections.get(param.name or "", ""), []).append(record)
        for section, title in (("", "Options"), *SECTIONS.items()):
            if groups.get(section):
                with formatter.section(title):
                    formatter.write_dl(groups[section])


def spread_values(args: list[str], greedy: set[str]) -> list[str]:
    """``--flag a b`` becomes ``--flag a --flag b`` for the ``greedy`` flags, read as LMDeploy's
    argparse reads them: the words up to the next option (none: no value, as LMDeploy allows
    for ``--api-keys``; a value that starts with a dash is given as ``--flag=-value``). The
    command takes no arguments, so a word that is not an option belongs to the flag before it."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out.extend(args[i - 1 :])
            break
        if arg not in greedy:
            out.append(arg)
            continue
        while i < len(args) and not args[i].startswith("-"):
            out += [arg, args[i]]
            i += 1
    return out


def _load_config(ctx: click.Context, _param: click.Parameter, path: str | None) -> None:
    """Eager --config: the file's values become defaults, below CLI and environment."""
    if path is None:
        return
    try:
        values = load_toml(path)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from e
    ctx.default_map = {**(ctx.default_map or {}), **values}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pdproxy")
def main() -> None:
    """pdproxy: a proxy and router for fleets of OpenAI-compatible LLM inference servers."""


@main.command(cls=SettingsCommand, settings=Settings)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    envvar=f"{ENV_PREFIX}CONFIG",
    show_envvar=True,
    help="TOML file of settings (keys are the option names with underscores).",
)
@click.option("--print-config", is_flag=True, help="Print the effective settings as JSON and exit.")
@settings_options(Settings, ENV_PREFIX)
def serve(print_config: bool, **options: Any) -> None:
    """Serve the OpenAI API, routing each request to one of the nodes."""
    from .serve import serve as run

    for name, value in options.items():
        if isinstance(value, list):
            options[name] = tuple(value)
    try:
        settings = Settings(**options)
    except ConfigError as e:
        click.echo(f"pdproxy: {e}", err=True)  # one line, before anything is served
        sys.exit(2)
    context = click.get_current_context()
    for name in ("api_keys", "admin_keys"):
        if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            click.echo(
                f"pdproxy: warning: keys given with {flag} on the command line are visible to every user of this "
                f"machine (ps); use {flag}-file or the environment (PDPROXY_{name.upper()}) instead",
                err=True,
            )
    if print_config:
        click.echo(json.dumps(settings.redacted()))
        return
    try:
        status = run(settings)
    except ConfigError as e:
        click.echo(f"pdproxy: {e}", err=True)
        sys.exit(1)
    sys.exit(status)


def _mock_settings_options(fn: F) -> F:
    from .testing.mock_engine import MockSettings

    return settings_options(MockSettings, None)(fn)


@main.command("mock-engine")
@_mock_settings_options
@click.option(
    "--count",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="Engines served by this one process, on ports PORT, PORT+1, ... (many nodes for little memory).",
)
def mock_engine(count: int, **options: Any) -> None:
    """Run a mock OpenAI-compatible inference engine (no GPU) for demos, tests and benchmarks."""
    import uvloop

    from .testing.mock_engine import MockEngine, MockSettings

    try:
        settings = MockSettings(**options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    ports = [settings.port + i if settings.port else 0 for i in range(count)]
    engines = [MockEngine(settings, port=port) for port in ports]

    async def serve() -> None:
        try:
            for engine in engines:  # every port is bound before anything is announced
                await engine.start()
            for engine in engines:
                click.echo(f"mock engine: serving {settings.model} ({settings.role}) on {engine.url}", err=True)
            await engines[0].state.terminated.wait()  # /terminate, when allowed
            await asyncio.sleep(0.05)  # let its answer go out
        finally:
            for engine in engines:
                await engine.stop()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, contextlib.suppress(KeyboardInterrupt):
            runner.run(serve())
    except OSError as e:  # the port is taken, or the address is not this host's
        reason = os.strerror(e.errno).lower() if e.errno else str(e)
        click.echo(f"pdproxy mock-engine: cannot listen on {settings.host}:{settings.port}: {reason}", err=True)
        sys.exit(1)


def _admin_call(url: str, path: str, key: str | None, payload: object = None) -> Any:
    """One call to a running proxy's management API (blocking; this is a CLI)."""
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, headers=headers, method="POST" if data else "GET"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise click.ClickException(f"{path}: {e.code} {message}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason}") from None


_URL = click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    envvar=f"{ENV_PREFIX}URL",
    show_envvar=True,
    help="The proxy to talk to.",
)
_KEY = click.option(
    "--key",
    default=None,
    envvar=f"{ENV_PREFIX}ADMIN_KEY",
    show_envvar=True,
    help="Admin (or API) key of the proxy, if it has keys.",
)


def _p50(latencies: list[float]) -> str:
    if not latencies:
        return "-"
    ordered = sorted(latencies)
    return f"{ordered[len(ordered) // 2] * 1000:.0f} ms"


def render_status(nodes: dict[str, dict[str, Any]]) -> str:
    """The node table `pdproxy status` prints."""
    header = ("NODE", "ROLE", "STATE", "CIRCUIT", "MODELS", "IN FLIGHT", "P50", "OK", "FAILED")
    rows = [header]
    for url, n in sorted(nodes.items()):
        rows.append(
            (
                url,
                str(n.get("role_name", n.get("role"))),
                str(n.get("state", "?")),
                str(n.get("circuit", "-")),
                ",".join(n.get("models") or []) or "*",
                str(n.get("unfinished", 0)),
                _p50(n.get("latency") or []),
                str(n.get("succeeded", "-")),
                str(n.get("failed", "-")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


@main.command()
@_URL
@_KEY
@click.option("--watch", type=float, default=None, help="Refresh every this many seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw /nodes/status JSON.")
def status(url: str, key: str | None, watch: float | None, as_json: bool) -> None:
    """Show the nodes of a running proxy: role, health, models, load, latency, errors."""
    import time

    while True:
        nodes = _admin_call(url, "/nodes/status", key)
        text = json.dumps(nodes, indent=1) if as_json else render_status(nodes)
        if watch:
            click.clear()
        click.echo(text)
        if not watch:
            return
        time.sleep(watch)


@main.group()
def nodes() -> None:
    """Add or remove nodes of a running proxy."""


@nodes.command("add")
@click.argument("node_url")
@_URL
@_KEY
@click.option("--model", "models", multiple=True, help="A model the node serves (default: ask the node).")
@click.option("--role", default="hybrid", show_default=True, help="hybrid, prefill or decode (or 1, 2, 3).")
@click.option("--speed", type=float, default=None, help="Relative throughput (random and min_expected_latency).")
@click.option("--max-concurrency", type=int, default=None, help="Hard cap on the node's requests in flight.")
@click.option("--api-key", "node_api_key", default=None, help="Key the proxy sends to the node (Bearer).")
@click.option("--lease-ttl", type=float, default=None, help="Seconds until it lapses unless registered again.")
@click.option("--bootstrap-port", type=int, default=None, help="SGLang prefill nodes: their bootstrap port.")
def nodes_add(
    node_url: str,
    url: str,
    key: str | None,
    models: tuple[str, ...],
    role: str,
    speed: float | None,
    max_concurrency: int | None,
    node_api_key: str | None,
    lease_ttl: float | None,
    bootstrap_port: int | None,
) -> None:
    """Register NODE_URL with the proxy."""
    status: dict[str, Any] = {"role": role, "speed": speed}
    if models:
        status["models"] = list(models)
    payload: dict[str, Any] = {"url": node_url, "status": status}
    extra = {
        "max_concurrency": max_concurrency,
        "api_key": node_api_key,
        "lease_ttl": lease_ttl,
        "bootstrap_port": bootstrap_port,
    }
    payload.update({name: value for name, value in extra.items() if value is not None})
    answer = _admin_call(url, "/nodes/add", key, payload)
    click.echo(f"{'added' if answer['created'] else 'updated'} {answer['url']}")


@nodes.command("remove")
@click.argument("node_url")
@_URL
@_KEY
def nodes_remove(node_url: str, url: str, key: str | None) -> None:
    """Remove NODE_URL from the proxy."""
    answer = _admin_call(url, "/nodes/remove", key, {"url": node_url})
    click.echo(f"removed {answer['url']}")
