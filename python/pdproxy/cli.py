"""The `pdproxy` command: `serve` and `mock-engine`.

Options are generated from the settings' pydantic models, so every option has exactly one
default (in `config/settings.py` / `testing/mock_settings.py`), and each of `serve`'s one `PDPROXY_*`
environment variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict, TypeVar

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from . import __version__
from ._json_types import JsonObject, JsonValue, loads
from .config.checks import checked
from .config.settings import (
    ENV_PREFIX,
    GROUPS,
    Settings,
    SettingsGroup,
    flat_name,
    load_toml,
    setting_flag,
    setting_kind,
)
from .errors import ConfigError
from .fleet.node_record import NodeAttributes, configured_nodes

F = TypeVar("F", bound=Callable[..., object])


class _Shown(TypedDict):
    """How an option shows in ``--help``."""

    help: str
    envvar: list[str] | None
    show_envvar: bool


@dataclass(frozen=True)
class Option:
    """One setting as the command line takes it."""

    name: str
    kind: type
    default: object
    help: str
    #: Its flag, then LMDeploy's spellings of it.
    flags: tuple[str, ...]
    env_aliases: tuple[str, ...]
    #: The title of the group `--help` shows it under.
    section: str
    #: What `--help` shows as its default, when not the default itself ("": nothing).
    shown_default: str | None = None


def options_of(cls: type[BaseModel]) -> list[Option]:
    """The options of a pydantic settings model, one per setting, by its flat name: the mock
    engine's, or ``Settings``'s, whose fields are groups of settings (each shown under its
    group's title)."""
    section = cls.title if issubclass(cls, SettingsGroup) else ""
    out: list[Option] = []
    for field_name, info in cls.model_fields.items():
        group = info.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):  # settings.health and the like
            out += options_of(group)
            continue
        name = flat_name(field_name, info)  # health_interval, for settings.health.interval
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        aliases = tuple(str(a) for a in extra.get("aliases") or ())  # type: ignore[union-attr]
        env_aliases = tuple(str(a) for a in extra.get("env_aliases") or ())  # type: ignore[union-attr]
        shown = extra.get("shown_default")
        out.append(
            Option(
                name,
                setting_kind(info),
                info.default,
                info.description or "",
                (setting_flag(name, info), *aliases),
                env_aliases,
                section,
                None if shown is None else str(shown),
            )
        )
    return out


def settings_options(cls: type[BaseModel], envvar_prefix: str | None) -> Callable[[F], F]:
    """Adds one click option per setting of ``cls``."""

    def decorate(fn: F) -> F:
        for option in reversed(options_of(cls)):
            envvars = [f"{envvar_prefix}{option.name.upper()}"] if envvar_prefix else []
            envvars += option.env_aliases
            flags, default = (*option.flags, option.name), option.default
            shown = _Shown(help=option.help, envvar=envvars or None, show_envvar=bool(envvars))
            if option.kind is bool:
                decorator = click.option(*flags, is_flag=True, default=default, **shown)
            elif option.kind is tuple:
                decorator = click.option(*flags, multiple=True, type=str, default=default, **shown)
            else:
                decorator = click.option(*flags, type=option.kind, default=default, **shown)
            fn = decorator(fn)
        return fn

    return decorate


class _HelpFormatter(click.HelpFormatter):
    """Help whose words are never split: a flag (``--node-dns``) or an example
    (``role=prefill,model=qwen``) stays whole on one line, even when it overflows."""

    def write_dl(self, rows: typing.Iterable[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        width = min(max((len(term) for term, _ in rows), default=0), col_max)
        text_width = max((self.width or 80) - self.current_indent - width - col_spacing, 20)
        wrapper = textwrap.TextWrapper(text_width, break_long_words=False, break_on_hyphens=False)
        indent = " " * self.current_indent
        for term, text in rows:
            lines = wrapper.wrap(text) or [""]
            if len(term) > width:  # a long term: its text starts on the next line
                self.write(f"{indent}{term}\n")
                lines_at = [" " * (width + col_spacing) + line for line in lines]
            else:
                lines_at = [term.ljust(width + col_spacing) + lines[0]]
                lines_at += [" " * (width + col_spacing) + line for line in lines[1:]]
            self.write("".join(f"{indent}{line.rstrip()}\n" for line in lines_at))


class _Context(click.Context):
    formatter_class = _HelpFormatter


def _default_text(option: Option) -> str | None:
    """A setting's default as a user would type it, or None when there is none to show (an
    empty value or an unset marker, which the option's help explains)."""
    value = option.default
    if option.shown_default is not None:
        return option.shown_default or None
    if value is None or value is False or (isinstance(value, str | tuple) and not value):
        return None
    if value is True:
        return "on"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class SettingsCommand(click.Command):
    """`pdproxy serve`: its help grouped by the settings' groups, and multi-valued options that
    take several values after one flag as LMDeploy's (``--api-keys k1 k2``) as well as the flag
    repeated."""

    context_class = _Context

    def settings_class(self) -> type[BaseModel]:
        """The settings whose options the command takes."""
        return Settings

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        options = options_of(self.settings_class())
        greedy = {flag for option in options if option.kind is tuple for flag in option.flags}
        return super().parse_args(ctx, spread_values(args, greedy))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        options = {option.name: option for option in options_of(self.settings_class())}
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            option = options.get(param.name or "")
            if option is not None:
                record = (record[0], _help_of(option, param))
            groups.setdefault(option.section if option else "", []).append(record)
        for title in dict.fromkeys(("", *(group.title for group in GROUPS))):  # each title once, in order
            if groups.get(title):
                with formatter.section(title or "Options"):
                    formatter.write_dl(groups[title])


def _help_of(option: Option, param: click.Parameter) -> str:
    envvar = param.envvar
    envvars = [str(v) for v in envvar] if isinstance(envvar, list | tuple) else [str(envvar)] if envvar else []
    extra = [f"env var: {', '.join(envvars)}"] if envvars else []
    default = _default_text(option)
    if default is not None:
        extra.append(f"default: {default}")
    return f"{option.help}  [{'; '.join(extra)}]" if extra else option.help


class MockEngineCommand(SettingsCommand):
    """`pdproxy mock-engine`: its options are the mock engine's settings."""

    def settings_class(self) -> type[BaseModel]:
        from .testing.mock_settings import MockSettings

        return MockSettings


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


class _Command(click.Command):
    context_class = _Context


class _Group(click.Group):
    context_class = _Context
    command_class = _Command


_Group.group_class = _Group  # its subgroups are its kind too


class _Main(_Group):
    """`pdproxy`: its commands, and a peer router's command line given to it whole
    (``pdproxy --worker-urls ...``), which the hidden ``takeover`` command reads."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("--") and args[0] not in ("--help", "--version"):
            args = ["takeover", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pdproxy")
def main() -> None:
    """pdproxy: a proxy and router for fleets of OpenAI-compatible LLM inference servers.

    The command lines of sglang-router, smg (smg launch), vllm-router and lmdeploy-router also
    start it, program name changed: pdproxy --worker-urls ... (see pdproxy --as-router NAME --help).
    """


_PEER_LINE = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@main.command("takeover", hidden=True, context_settings=_PEER_LINE)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def takeover(args: tuple[str, ...]) -> None:
    """A peer router's command line, program name changed."""
    from .peers.command import take_over

    take_over(list(args), None)


@main.command("launch", context_settings=_PEER_LINE)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(args: tuple[str, ...]) -> None:
    """An `smg launch` command line, program name changed: pdproxy launch --worker-urls ..."""
    from .peers.command import take_over

    take_over(list(args), "smg")


def _keys_on_the_command_line(context: click.Context, settings: Settings) -> list[tuple[str, str]]:
    """The flags given on the command line that carry key material, each with where to give it instead."""
    given = {
        name
        for name in ("api_keys", "admin_keys", "otlp_headers", "nodes")
        if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    }
    found = [
        (f"--{name.replace('_', '-')}", f"--{name.replace('_', '-')}-file or PDPROXY_{name.upper()}")
        for name in ("api_keys", "admin_keys")
        if name in given
    ]
    if "otlp_headers" in given:
        found.append(("--otlp-header", "OTEL_EXPORTER_OTLP_HEADERS or PDPROXY_OTLP_HEADERS"))
    if "nodes" in given and any("api_key=" in node for node in settings.routing.nodes):
        found.append(("--node ...,api_key=", "a --config file (mode 0600) or PDPROXY_NODES"))
    return found


@main.command(cls=SettingsCommand)
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
def serve(print_config: bool, **options: object) -> None:
    """Serve the OpenAI API, routing each request to one of the nodes."""
    from .server.serve import serve as run

    for name, value in options.items():
        if isinstance(value, list):
            options[name] = tuple(value)
    try:
        settings = checked(Settings(**options))
    except ConfigError as e:
        click.echo(f"pdproxy: {e}", err=True)  # one line, before anything is served
        sys.exit(2)
    for flag, instead in _keys_on_the_command_line(click.get_current_context(), settings):
        click.echo(
            f"pdproxy: warning: keys given with {flag} on the command line are visible to every user of this "
            f"machine (ps); use {instead} instead",
            err=True,
        )
    if print_config:
        shown = settings.redacted()
        shown["nodes"] = [record.redacted() for record in configured_nodes(settings)]  # their keys hidden
        click.echo(json.dumps(shown))
        return
    try:
        status = run(settings)
    except ConfigError as e:
        click.echo(f"pdproxy: {e}", err=True)
        sys.exit(1)
    sys.exit(status)


def _mock_settings_options(fn: F) -> F:
    from .testing.mock_settings import MockSettings

    return settings_options(MockSettings, None)(fn)


@main.command("mock-engine", cls=MockEngineCommand)
@_mock_settings_options
@click.option(
    "--count",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="Engines served by this one process, on ports PORT, PORT+1, ... (many nodes for little memory).",
)
def mock_engine(count: int, **options: object) -> None:
    """Run a mock OpenAI-compatible inference engine (no GPU) for demos, tests and benchmarks."""
    import uvloop

    from .testing.mock_engine import MockEngine
    from .testing.mock_settings import MockSettings

    try:
        settings = MockSettings.of(options)
    except ConfigError as e:
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


def _admin_call(url: str, path: str, key: str | None, payload: object = None) -> JsonObject:
    """One call to a running proxy's management API (blocking; this is a CLI): its answer."""
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
            answer = loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise click.ClickException(f"{path}: {e.code} {message}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason}") from None
    if not isinstance(answer, dict):
        raise click.ClickException(f"{path}: the proxy's answer is not a JSON object")
    return answer


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


def _items(value: JsonValue) -> list[JsonValue]:
    """A JSON list's items (none when it is not a list)."""
    return value if isinstance(value, list) else []


def _p50(latencies: list[float]) -> str:
    if not latencies:
        return "-"
    ordered = sorted(latencies)
    return f"{ordered[len(ordered) // 2] * 1000:.0f} ms"


def render_status(nodes: JsonObject) -> str:
    """The node table `pdproxy status` prints (``nodes``: ``/nodes/status``'s answer)."""
    header = ("NODE", "ROLE", "STATE", "CIRCUIT", "MODELS", "IN FLIGHT", "P50", "OK", "FAILED")
    rows = [header]
    for url, node in sorted(nodes.items()):
        n = node if isinstance(node, dict) else {}
        rows.append(
            (
                url,
                str(n.get("role_name", n.get("role"))),
                str(n.get("state", "?")),
                str(n.get("circuit", "-")),
                ",".join(str(m) for m in _items(n.get("models"))) or "*",
                str(n.get("unfinished", 0)),
                _p50([float(s) for s in _items(n.get("latency")) if isinstance(s, int | float)]),
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


def _attribute_shape(info: FieldInfo) -> type:
    """How the command line takes a node attribute: list (repeated), dict (KEY=VALUE, repeated)
    or its scalar type."""
    kind: object = info.annotation
    if isinstance(kind, types.UnionType):  # `float | None`: the value's own type
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    shape = typing.get_origin(kind) or kind
    if not isinstance(shape, type):
        raise TypeError(f"node attribute {info.title or info}: no command-line form for {kind!r}")
    return shape


def node_attribute_options(fn: F) -> F:
    """One option per attribute of a node record (``NodeAttributes``): a list's repeats
    (``--model``), a map's takes ``KEY=VALUE`` (``--label``)."""
    for name, info in reversed(NodeAttributes.model_fields.items()):
        shape = _attribute_shape(info)
        several = shape in (list, dict)
        flag = "--" + (name.removesuffix("s") if several else name).replace("_", "-")
        if several:
            metavar = "KEY=VALUE" if shape is dict else None
            option = click.option(flag, f"node_{name}", multiple=True, metavar=metavar, help=info.description)
        else:
            option = click.option(flag, f"node_{name}", type=shape, default=None, help=info.description)
        fn = option(fn)
    return fn


def _repeated(value: object) -> tuple[str, ...]:
    """The values of an option that repeats (click gives them as a tuple)."""
    return tuple(str(v) for v in value) if isinstance(value, tuple) else ()


@nodes.command("add")
@click.argument("node_url")
@_URL
@_KEY
@node_attribute_options
def nodes_add(node_url: str, url: str, key: str | None, **attributes: object) -> None:
    """Register NODE_URL with the proxy (what it does not say, the node's record leaves at its
    default; without --model the proxy asks the node)."""
    payload: dict[str, object] = {"url": node_url}
    for name, info in NodeAttributes.model_fields.items():
        value = attributes[f"node_{name}"]
        shape = _attribute_shape(info)
        if shape is dict:
            pairs = [item.partition("=") for item in _repeated(value)]
            if any(not sep for _, sep, _ in pairs):
                raise click.BadParameter("must read KEY=VALUE", param_hint=f"--{name.removesuffix('s')}")
            value = {k: v for k, _, v in pairs}
        elif shape is list:
            value = list(_repeated(value))
        if value:
            payload[name] = value
        elif value is not None and shape not in (list, dict):
            payload[name] = value  # a zero or an empty text is still what was asked
    answer = _admin_call(url, "/nodes/add", key, payload)
    click.echo(f"{'added' if answer['created'] else 'updated'} {answer['url']}")
    if answer.get("models_unknown"):
        click.echo(
            f"pdproxy: but the node did not tell its models: {answer['models_unknown']}; it takes no traffic "
            "until it does (asked again in the background; `pdproxy status` shows its MODELS as * till then)",
            err=True,
        )
        sys.exit(1)


@nodes.command("remove")
@click.argument("node_url")
@_URL
@_KEY
def nodes_remove(node_url: str, url: str, key: str | None) -> None:
    """Remove NODE_URL from the proxy."""
    answer = _admin_call(url, "/nodes/remove", key, {"url": node_url})
    click.echo(f"removed {answer['url']}")
