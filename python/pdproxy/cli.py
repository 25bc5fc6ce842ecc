"""The `pdproxy` command: `serve` and `mock-engine`.

Options are generated from the settings dataclasses, so every option has exactly one
default (in `config.py` / `testing/mock_engine.py`) and one `PDPROXY_*` environment variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
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
            envvar = f"{envvar_prefix}{f.name.upper()}" if envvar_prefix else None
            common: dict[str, Any] = {
                "help": f.metadata.get("help"),
                "envvar": envvar,
                "show_envvar": envvar is not None,
            }
            flags = (_flag(f), *f.metadata.get("aliases", ()))
            if kind is bool:
                option = click.option(*flags, f.name, is_flag=True, default=f.default, show_default=True, **common)
            elif kind is tuple:
                option = click.option(*flags, f.name, multiple=True, type=str, **common)
            else:
                option = click.option(*flags, f.name, type=kind, default=f.default, show_default=True, **common)
            fn = option(fn)
        return fn

    return decorate


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


@main.command()
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
        raise click.UsageError(str(e)) from e
    if print_config:
        click.echo(json.dumps(settings.redacted()))
        return
    try:
        run(settings)
    except ConfigError as e:
        click.echo(f"pdproxy: {e}", err=True)
        sys.exit(1)


def _mock_settings_options(fn: F) -> F:
    from .testing.mock_engine import MockSettings

    return settings_options(MockSettings, None)(fn)


@main.command("mock-engine")
@_mock_settings_options
def mock_engine(**options: Any) -> None:
    """Run a mock OpenAI-compatible inference engine (no GPU) for demos, tests and benchmarks."""
    import uvloop

    from .testing.mock_engine import MockEngine, MockSettings

    try:
        settings = MockSettings(**options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    engine = MockEngine(settings)
    click.echo(
        f"mock engine: serving {settings.model} ({settings.role}) on http://{settings.host}:{settings.port}", err=True
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(engine.serve_forever())
