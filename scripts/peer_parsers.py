#!/usr/bin/env python3
"""Dump the command-line parsers of the peer routers pdproxy takes over from.

Run it with the python of a virtual environment that has the peer's package
installed (one venv per peer; nothing of pdproxy is imported)::

    bench/.peers/smg-venv/bin/python scripts/peer_parsers.py --router smg   # scripts/peer_venvs.sh makes it
    .../bin/python scripts/peer_parsers.py --router smg --parse -- --policy cache_aware
    .../bin/python scripts/peer_parsers.py --router smg --examples

Modes:

``(default)``  every option of the parser the router's own ``launch`` entry
               point builds (option strings, dest, type, default, choices,
               nargs, action kind, help, argument group), positionals, the
               top-level CLI's subcommands, the config object's fields, and
               secondary parsers (the ``--router-`` prefixed variant).
``--parse``    parse a command line with the router's own entry-point
               function (``parse_router_args``, which ends in
               ``RouterArgs.from_cli_args``) and print the argparse namespace
               and the config object it produced.
``--examples`` pull the example command lines out of the package's own text
               (the README in the dist-info METADATA, the launcher's
               ``--help`` description, help strings and docstrings) and parse
               each one as ``--parse`` does.  For a peer laid in from its
               repository (no wheel: lmdeploy-router), the docs its source
               record lists take the README's place.

Only the standard library and the peer package are used.  The parser is
captured, not rebuilt: the router's ``parse_router_args`` is called with
``ArgumentParser.parse_known_args`` patched to hand back the parser it was
called on, so the dump is the very object the router's entry point builds.
Defaults that the peer reads from the environment (e.g. ``ATP_*``,
``REDIS_URL``) depend on the caller's environment; run under ``env -i`` for
stable output.  The dump lists which of those variables were set.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import importlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import platform
import re
import shlex
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

JSON = Any  # what json.dump takes
SCHEMA = 1

# What each peer ships and which entry points reach its router parser.
# ``launch``: the module whose ``parse_router_args(argv)`` builds the parser,
# parses, and returns the config object (RouterArgs.from_cli_args).
# ``prog``: the program name sys.argv[0] is set to while the parser is built
# (argparse takes ``prog`` from it).
# ``heads``: regexes for the start of a shell command that hands its remaining
# words to that parser, with how the program is run.
ROUTERS: dict[str, dict[str, Any]] = {
    "sglang-router": {
        "dist": "sglang-router",
        "package": "sglang_router",
        "launch": "sglang_router.launch_router",
        "args_module": "sglang_router.router_args",
        "cli": "sglang_router.cli",
        "cli_launch_subcommand": "launch",
        "prog": "sglang-router",
        # choices the Rust extension lists in hash-map order (differs run to run)
        "unordered_choices": ["tool_call_parser", "reasoning_parser"],
        "entry_points_to_parser": [
            "python -m sglang_router.launch_router ARGS (launch_router.main -> parse_router_args(sys.argv[1:]))",
            "smg launch ARGS / amg launch ARGS / sglang-router launch ARGS"
            " (sglang_router.cli.main: create_parser().parse_known_args, then parse_router_args(unknown))",
        ],
        # launch_server adds RouterArgs with the router- prefix next to
        # sglang's ServerArgs (needs sglang itself, not installed here).
        "prefixed_variant": (
            "sglang_router.launch_server.main:"
            " RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)"
        ),
        "heads": [
            (r"python3? -m sglang_router\.launch_router\b", "python launcher"),
            (r"(?:smg|amg|sglang-router) launch\b", "python cli"),
            (r"\./target/release/(?:sgl-model-gateway|smg|amg)\b", "rust binary"),
            (r"cargo run --release --", "rust binary (cargo run)"),
        ],
    },
    "smg": {
        "dist": "smg",
        "package": "smg",
        "launch": "smg.launch_router",
        "args_module": "smg.router_args",
        "cli": "smg.cli",
        "cli_launch_subcommand": "launch",
        "prog": "smg",
        "unordered_choices": ["tool_call_parser", "reasoning_parser"],
        "entry_points_to_parser": [
            "smg launch ARGS (smg.cli.main: create_parser().parse_known_args, then parse_router_args(unknown))",
            "python -m smg.launch_router ARGS (launch_router.main -> parse_router_args(sys.argv[1:]))",
        ],
        "prefixed_variant": (
            "smg.serve.parse_serve_args pass 1: add_serve_args +"
            " RouterArgs.add_cli_args(pre_parser, use_router_prefix=True, exclude_host_port=True)"
        ),
        "serve_module": "smg.serve",
        "heads": [
            (r"python3? -m smg\.launch_router\b", "python launcher"),
            (r"smg launch\b", "python cli"),
            (r"\./target/release/smg\b", "rust binary"),
        ],
    },
    "vllm-router": {
        "dist": "vllm-router",
        "package": "vllm_router",
        "launch": "vllm_router.launch_router",
        "args_module": "vllm_router.router_args",
        "cli": None,
        "prog": "vllm-router",
        "entry_points_to_parser": [
            "vllm-router ARGS (console script vllm_router.launch_router:main -> parse_router_args(sys.argv[1:]))",
            "python -m vllm_router.launch_router ARGS",
        ],
        "prefixed_variant": (
            "RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)"
            " (no entry point of this package calls it)"
        ),
        "heads": [
            (r"python3? -m vllm_router\.launch_router\b", "python launcher"),
            (r"\./target/release/vllm-router\b", "rust binary"),
            (r"cargo run --release --", "rust binary (cargo run)"),
            (r"vllm-router\b", "python launcher (console script)"),
        ],
    },
    # Not on PyPI as of this writing (pip finds no distribution): the package is
    # lmdeploy/router/py_src/lmdeploy_router in InternLM/lmdeploy, laid into a
    # venv from that source with a hand-written dist-info whose ``source_record``
    # file names the repository, the commit of each file and the docs to read
    # examples from (tests/fixtures/peer_parsers/README.md says how).  A real
    # wheel, once there is one, has no such file and is read like the others.
    "lmdeploy-router": {
        "dist": "lmdeploy-router",
        "package": "lmdeploy_router",
        "launch": "lmdeploy_router.launch_router",
        "args_module": "lmdeploy_router.router_args",
        "cli": None,
        "prog": "lmdeploy-router",
        "source_record": "source.json",
        "entry_points_to_parser": [
            "lmdeploy-router ARGS"
            " (console script lmdeploy_router.launch_router:main -> parse_router_args(sys.argv[1:]))",
            "python -m lmdeploy_router.launch_router ARGS",
        ],
        "prefixed_variant": (
            "RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)"
            " (no entry point of this package calls it)"
        ),
        "heads": [
            (r"python3? -m lmdeploy_router\.launch_router\b", "python launcher"),
            (r"\./target/release/lmdeploy-router\b", "rust binary"),
            # their docs: export LMDEPLOY_ROUTER_BIN="${CARGO_TARGET_DIR}/release/lmdeploy-router"
            (r'(?:setsid )?"?\$\{LMDEPLOY_ROUTER_BIN\}"?', "rust binary (LMDEPLOY_ROUTER_BIN, the release build)"),
            (r"cargo run --release --bin lmdeploy-router --(?=\s|$)", "rust binary (cargo run)"),
            (r"cargo run --release --(?=\s|$)", "rust binary (cargo run)"),
            (r"lmdeploy-router-bin(?![\w-])", "rust binary (lmdeploy-router-bin, shipped in the wheel)"),
            (r"lmdeploy-router(?![\w-])", "python launcher (console script)"),
        ],
    },
}


# --------------------------------------------------------------------------
# JSON helpers
# --------------------------------------------------------------------------


def jsonable(value: object) -> JSON:
    """A JSON-safe rendering of a parser default, namespace value or config."""
    if value is argparse.SUPPRESS:
        return "==SUPPRESS=="
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return repr(value)
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    if isinstance(value, argparse.Namespace):
        return {k: jsonable(v) for k, v in sorted(vars(value).items())}
    if callable(value):
        return {"callable": getattr(value, "__qualname__", repr(value))}
    return {"repr": repr(value)}


#: Keys whose values are the peers' own prose (help texts, descriptions): facts are kept, their
#: words are not.
PROSE = frozenset({"help", "help_expanded", "description", "summary", "epilog", "usage"})


def facts_only(obj: JSON) -> JSON:
    if isinstance(obj, dict):
        return {k: facts_only(v) for k, v in obj.items() if k not in PROSE}
    if isinstance(obj, list):
        return [facts_only(v) for v in obj]
    return obj


def emit(obj: JSON) -> None:
    json.dump(facts_only(obj), sys.stdout, indent=1, ensure_ascii=False, sort_keys=True)
    sys.stdout.write("\n")


# --------------------------------------------------------------------------
# Capturing the parser the router builds
# --------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser captured")
        self.parser = parser


ParseKnownArgs = Callable[..., tuple[argparse.Namespace, list[str]]]
Hook = Callable[[ParseKnownArgs, argparse.ArgumentParser, Any, Any], tuple[argparse.Namespace, list[str]]]


@contextlib.contextmanager
def _patched_parse_known_args(hook: Hook) -> Iterator[None]:
    original: ParseKnownArgs = argparse.ArgumentParser.parse_known_args

    def patched(
        self: argparse.ArgumentParser, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return hook(original, self, args, namespace)

    argparse.ArgumentParser.parse_known_args = patched  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign,assignment]


def capture_parser(func: Callable[..., object], *args: object) -> argparse.ArgumentParser:
    """Call ``func(*args)`` and return the parser of its first parse call."""

    def hook(
        _original: ParseKnownArgs, parser: argparse.ArgumentParser, _args: Any, _namespace: Any
    ) -> tuple[argparse.Namespace, list[str]]:
        raise _Captured(parser)

    with _patched_parse_known_args(hook):
        try:
            func(*args)
        except _Captured as captured:
            return captured.parser
    raise RuntimeError(f"{func.__qualname__} returned without parsing")


@contextlib.contextmanager
def program_name(prog: str) -> Iterator[None]:
    saved = sys.argv
    sys.argv = [prog]
    try:
        yield
    finally:
        sys.argv = saved


# --------------------------------------------------------------------------
# Describing a parser
# --------------------------------------------------------------------------


def _action_kind(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    for name, cls in parser._registries.get("action", {}).items():
        if name is not None and type(action) is cls:
            return str(name)
    return type(action).__name__


def _type_name(kind: object) -> str | None:
    if kind is None:
        return None
    if isinstance(kind, str):  # a registered type name
        return kind
    if isinstance(kind, argparse.FileType):
        return f"FileType({kind._mode!r})"
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", None) or repr(kind)
    if module in (None, "builtins"):
        return name
    return f"{module}.{name}"


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    if not action.help or action.help is argparse.SUPPRESS or "%" not in action.help:
        return None
    try:
        return parser._get_formatter()._expand_help(action)
    except Exception as exc:  # a help string with a stray %
        return f"<could not expand: {exc}>"


def describe_action(parser: argparse.ArgumentParser, action: argparse.Action, where: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "action": _action_kind(parser, action),
        "type": _type_name(action.type),
        "nargs": action.nargs,
        "default": jsonable(action.default),
        "const": jsonable(action.const),
        "choices": None if action.choices is None else jsonable(list(action.choices)),
        "required": action.required,
        "metavar": jsonable(action.metavar),
        "help": None if action.help is argparse.SUPPRESS else action.help,
        "help_suppressed": action.help is argparse.SUPPRESS,
        "group": where.get("group"),
    }
    expanded = _expanded_help(parser, action)
    if expanded is not None and expanded != action.help:
        entry["help_expanded"] = expanded
    if "mutually_exclusive_group" in where:
        entry["mutually_exclusive_group"] = where["mutually_exclusive_group"]
    if isinstance(action, argparse._SubParsersAction):
        entry["choices"] = sorted(action.choices)
    return entry


def describe_parser(
    parser: argparse.ArgumentParser, *, recurse: bool = True, unordered_choices: tuple[str, ...] = ()
) -> dict[str, Any]:
    groups: list[dict[str, Any]] = []
    where: dict[int, dict[str, Any]] = {}
    for group in parser._action_groups:
        groups.append(
            {
                "title": group.title,
                "description": group.description,
                "dests": [a.dest for a in group._group_actions],
            }
        )
        for action in group._group_actions:
            where.setdefault(id(action), {})["group"] = group.title
    mutex = []
    for index, group in enumerate(parser._mutually_exclusive_groups):
        mutex.append({"index": index, "required": group.required, "dests": [a.dest for a in group._group_actions]})
        for action in group._group_actions:
            where.setdefault(id(action), {})["mutually_exclusive_group"] = index

    options: list[dict[str, Any]] = []
    positionals: list[dict[str, Any]] = []
    subcommands: list[dict[str, Any]] = []
    for action in parser._actions:
        entry = describe_action(parser, action, where.get(id(action), {}))
        if action.dest in unordered_choices and entry["choices"] is not None:
            entry["choices"] = sorted(entry["choices"])
            entry["choices_order"] = "sorted here: the peer builds this list in hash order"
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                item: dict[str, Any] = {"name": name, "help": helps.get(name), "aliases_of": None}
                if recurse:
                    item["parser"] = describe_parser(sub)
                subcommands.append(item)
            # aliases map several names to one parser object
            first_name: dict[int, str] = {}
            for item, sub in zip(subcommands, action.choices.values(), strict=True):
                if id(sub) in first_name:
                    item["aliases_of"] = first_name[id(sub)]
                else:
                    first_name[id(sub)] = item["name"]
            entry["subcommand_dest"] = action.dest
            positionals.append(entry)
        elif action.option_strings:
            options.append(entry)
        else:
            positionals.append(entry)

    return {
        "prog": parser.prog,
        "usage": parser.usage,
        "description": parser.description,
        "epilog": parser.epilog,
        "formatter_class": _type_name(parser.formatter_class),
        "prefix_chars": parser.prefix_chars,
        "fromfile_prefix_chars": parser.fromfile_prefix_chars,
        "allow_abbrev": parser.allow_abbrev,
        "add_help": parser.add_help,
        "conflict_handler": parser.conflict_handler,
        "exit_on_error": getattr(parser, "exit_on_error", True),
        "argument_default": jsonable(parser.argument_default),
        "set_defaults": jsonable(parser._defaults),
        "groups": groups,
        "mutually_exclusive_groups": mutex,
        "options": options,
        "positionals": positionals,
        "subcommands": subcommands,
        "counts": {
            "options": len(options),
            "options_without_help_flag": len([o for o in options if o["action"] != "help"]),
            "option_strings": sum(len(o["option_strings"]) for o in options),
            "options_with_aliases": len([o for o in options if len(o["option_strings"]) > 1]),
            "positionals": len(positionals),
            "subcommands": len(subcommands),
            "by_group": {g["title"]: len(g["dests"]) for g in groups},
            "by_action": _tally(o["action"] for o in options),
        },
    }


def _tally(items: Iterator[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def compact_options(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    where: dict[int, str | None] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            where[id(action)] = group.title
    return [
        {
            "option_strings": list(a.option_strings),
            "dest": a.dest,
            "action": _action_kind(parser, a),
            "default": jsonable(a.default),
            "group": where.get(id(a)),
        }
        for a in parser._actions
        if a.option_strings
    ]


# --------------------------------------------------------------------------
# Loading a peer
# --------------------------------------------------------------------------


class PeerMissing(Exception):
    pass


class Peer:
    def __init__(self, name: str):
        self.name = name
        self.spec = ROUTERS[name]
        try:
            self.dist = importlib.metadata.distribution(self.spec["dist"])
        except importlib.metadata.PackageNotFoundError as exc:
            raise PeerMissing(f"distribution {self.spec['dist']!r} is not installed in {sys.prefix}") from exc
        # The peer's import-time log lines (e.g. "Rust Router is not installed")
        # go to stderr, never into the JSON on stdout.
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
        self.launch = importlib.import_module(self.spec["launch"])
        self.args_module = importlib.import_module(self.spec["args_module"])
        self.RouterArgs = self.args_module.RouterArgs
        # A peer laid in from its repository rather than installed from a wheel:
        # the dist-info's record says where each file came from, and the package
        # sits at record["path"] under a copy of the repository's tree.
        self.source: dict[str, Any] | None = None
        self.source_root: str | None = None
        record = self.spec.get("source_record")
        text = self.dist.read_text(record) if record else None
        if text:
            self.source = json.loads(text)
            package_dir = os.path.dirname(importlib.import_module(self.spec["package"]).__file__ or "")
            suffix = "/" + self.source["path"].strip("/")
            if not package_dir.endswith(suffix):
                raise PeerMissing(f"{self.spec['package']} is at {package_dir}, not under {self.source['path']}")
            self.source_root = package_dir[: -len(suffix)]

    @property
    def version(self) -> str:
        return self.dist.version

    def site_relative(self, path: str | None) -> str | None:
        if not path:
            return path
        if self.source_root and path.startswith(self.source_root + "/"):
            return path[len(self.source_root) + 1 :]  # the path in the peer's repository
        for base in sys.path:
            if base and path.startswith(base.rstrip("/") + "/"):
                return path[len(base.rstrip("/")) + 1 :]
        return path

    def docs(self) -> Iterator[tuple[str, str]]:
        """(path in the repository, text) of each doc the source record lists."""
        if self.source is None or self.source_root is None:
            return
        for path in self.source.get("docs", {}):
            with open(os.path.join(self.source_root, path), encoding="utf-8") as f:
                yield path, f.read()

    def build_launch_parser(self) -> argparse.ArgumentParser:
        with program_name(self.spec["prog"]):
            return capture_parser(self.launch.parse_router_args, [])

    def build_cli_parser(self) -> argparse.ArgumentParser | None:
        if not self.spec.get("cli"):
            return None
        cli = importlib.import_module(self.spec["cli"])
        with program_name(self.spec["prog"]):
            parser: argparse.ArgumentParser = cli.create_parser()
        return parser

    def build_prefixed_parser(self) -> argparse.ArgumentParser:
        serve_name = self.spec.get("serve_module")
        if serve_name:
            serve = importlib.import_module(serve_name)
            with program_name(self.spec["prog"]):
                return capture_parser(serve.parse_serve_args, [])
        with program_name(self.spec["prog"]):
            parser = argparse.ArgumentParser()
            self.RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
        return parser

    def env_names(self) -> list[str]:
        names = set()
        for module in (self.args_module, self.launch):
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                continue
            names.update(re.findall(r"os\.(?:getenv|environ\.get)\(\s*['\"]([A-Za-z0-9_]+)['\"]", source))
            names.update(re.findall(r"os\.environ\[\s*['\"]([A-Za-z0-9_]+)['\"]\s*\]", source))
        return sorted(names)

    # ---- parsing -------------------------------------------------------

    def parse(self, argv: list[str]) -> dict[str, Any]:
        """Parse ``argv`` with the router's own ``parse_router_args``."""
        namespaces: list[argparse.Namespace] = []

        def hook(
            original: ParseKnownArgs, parser: argparse.ArgumentParser, args: Any, namespace: Any
        ) -> tuple[argparse.Namespace, list[str]]:
            result = original(parser, args, namespace)
            namespaces.append(result[0])
            return result

        logs = _LogCapture()
        stderr = io.StringIO()
        out: dict[str, Any] = {"argv": list(argv)}
        root = logging.getLogger()
        root.addHandler(logs)
        try:
            with program_name(self.spec["prog"]), contextlib.redirect_stderr(stderr):
                with _patched_parse_known_args(hook):
                    try:
                        config = self.launch.parse_router_args(list(argv))
                    except SystemExit as exc:
                        out.update(ok=False, stage="argparse", exit_code=exc.code)
                        config = None
                    except Exception as exc:  # from_cli_args rejecting a value
                        out.update(ok=False, stage="from_cli_args", error=f"{type(exc).__name__}: {exc}")
                        config = None
                if config is not None:
                    out["ok"] = True
                    out["config_type"] = f"{type(config).__module__}.{type(config).__qualname__}"
                    validate = getattr(config, "_validate_router_args", None)
                    if validate is not None:
                        # launch_router() calls this before building the Rust router
                        try:
                            validate()
                            out["validate_router_args"] = {"ok": True}
                        except Exception as exc:
                            out["validate_router_args"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            root.removeHandler(logs)
        if namespaces:
            out["namespace"] = jsonable(namespaces[-1])
        if config is not None:
            out["config"] = jsonable(config)
        errors = [line for line in stderr.getvalue().splitlines() if ": error: " in line]
        if errors:
            # argparse's own message, without the (long) usage text before it
            out["error"] = errors[-1]
        if logs.records:
            out["log"] = logs.records
        return out


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}")


# --------------------------------------------------------------------------
# Dump
# --------------------------------------------------------------------------


def config_fields(peer: Peer, launch_parser: argparse.ArgumentParser) -> dict[str, Any]:
    fields = []
    for f in dataclasses.fields(peer.RouterArgs):
        if f.default is not dataclasses.MISSING:
            default = jsonable(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = jsonable(f.default_factory())
        else:
            default = "<required>"
        if isinstance(f.type, str):
            annotation = f.type
        elif isinstance(f.type, (types.GenericAlias, types.UnionType)):
            annotation = repr(f.type)  # list[str], str | None: as written (smg's are strings already)
        else:
            annotation = _type_name(f.type) or repr(f.type)
        fields.append({"name": f.name, "type": annotation, "default": default})
    dests = {a.dest for a in launch_parser._actions if a.option_strings and a.dest != "help"}
    names = {f["name"] for f in fields}
    return {
        "class": f"{peer.RouterArgs.__module__}.{peer.RouterArgs.__qualname__}",
        "built_by": f"{peer.RouterArgs.__qualname__}.from_cli_args(namespace, use_router_prefix=False)",
        "fields": fields,
        "parser_dests_not_fields": sorted(dests - names),
        "fields_not_parser_dests": sorted(names - dests),
    }


def dump(peer: Peer) -> dict[str, Any]:
    launch_parser = peer.build_launch_parser()
    env_names = peer.env_names()
    out = {
        "schema": SCHEMA,
        "router": peer.name,
        "distribution": {
            "name": peer.dist.metadata["Name"],
            "version": peer.version,
            "summary": peer.dist.metadata["Summary"],
            "console_scripts": sorted(
                f"{ep.name} = {ep.value}" for ep in peer.dist.entry_points if ep.group == "console_scripts"
            ),
        },
        "python": platform.python_version(),
        "modules": {
            "launch": peer.site_relative(getattr(peer.launch, "__file__", None)),
            "router_args": peer.site_relative(getattr(peer.args_module, "__file__", None)),
        },
        "entry_points_to_parser": peer.spec["entry_points_to_parser"],
        "how_built": (
            f"argparse: {peer.spec['launch']}.parse_router_args(argv) makes"
            " argparse.ArgumentParser(description=..., formatter_class=CustomHelpFormatter),"
            " calls RouterArgs.add_cli_args(parser, use_router_prefix=False),"
            " then RouterArgs.from_cli_args(parser.parse_args(argv)).  Captured at its parse call."
        ),
        "environment": {
            "read_by_parser_modules": env_names,
            "set_during_dump": sorted(n for n in env_names if n in os.environ),
        },
        "parser": describe_parser(launch_parser, unordered_choices=tuple(peer.spec.get("unordered_choices", ()))),
        "config_object": config_fields(peer, launch_parser),
    }
    if peer.source is not None:
        out["source"] = {
            **peer.source,
            "note": (
                "not a distribution from a package index: the package's files were laid into the venv"
                " from this repository at these commits, with a dist-info written by hand (its version"
                " from version.py, its console script from pyproject.toml)"
            ),
        }
    cli_parser = peer.build_cli_parser()
    if cli_parser is not None:
        out["cli"] = {
            "module": peer.spec["cli"],
            "note": (
                f"create_parser() only routes: the '{peer.spec['cli_launch_subcommand']}' subparser is"
                " add_help=False and empty; main() calls parse_known_args and hands the unknown"
                " words to parse_router_args. --version/-V/--version-verbose are handled before parsing."
            ),
            "parser": describe_parser(cli_parser),
        }
    try:
        prefixed = peer.build_prefixed_parser()
        out["router_prefixed_variant"] = {
            "how_built": peer.spec["prefixed_variant"],
            "options": compact_options(prefixed),
        }
    except Exception as exc:
        out["router_prefixed_variant"] = {"how_built": peer.spec["prefixed_variant"], "error": repr(exc)}
    return out


# --------------------------------------------------------------------------
# Examples from the package's own text
# --------------------------------------------------------------------------

_CONT = re.compile(r"\s*\\\s*(#.*)?$")
#: A word where the shell takes over from the program: a redirection, a pipe, a list or background
#: operator (their docs start the router as ``... > router.log 2>&1 < /dev/null &``).
_SHELL_OPERATOR = re.compile(r"\d*(?:>>?|<)(?:&\d+)?|&&?|\|\|?|;")


def _text_sources(
    peer: Peer, launch_parser: argparse.ArgumentParser, repo_docs: Sequence[tuple[str, Path]] = ()
) -> Iterator[tuple[str, str, bool]]:
    """(source label, text, only_fenced_code) for each piece of package text, then each file of
    ``repo_docs`` (label, path): the router's repository documents lines its package does not."""
    yield from _package_sources(peer, launch_parser)
    for label, path in repo_docs:
        yield label, path.read_text(), path.suffix == ".md"


def _package_sources(peer: Peer, launch_parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, bool]]:
    if peer.source is not None:
        # laid in from the repository: its docs, by their paths there (the
        # hand-written METADATA carries no README)
        for path, text in peer.docs():
            yield path, text, True
    else:
        meta = peer.dist.read_text("METADATA") or ""
        dist_info = f"{peer.dist.metadata['Name'].replace('-', '_')}-{peer.version}.dist-info/METADATA"
        yield f"{dist_info} (README)", meta, True
    launch_file = peer.site_relative(peer.launch.__file__)
    if launch_parser.description:
        yield f"{launch_file}: parse_router_args description (--help text)", launch_parser.description, False
    args_file = peer.site_relative(peer.args_module.__file__)
    for action in launch_parser._actions:
        if isinstance(action.help, str) and "--" in action.help:
            flag = action.option_strings[0] if action.option_strings else action.dest
            yield f"{args_file}: help of {flag}", action.help, False
    for name, member in inspect.getmembers(peer.RouterArgs):
        doc = getattr(member, "__doc__", None) if callable(member) else None
        if doc and "--" in doc and name != "__init__":
            yield f"{args_file}: RouterArgs.{name} docstring", inspect.cleandoc(doc), False


def _fenced_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced code block."""
    lines = text.splitlines()
    inside, start = False, 0
    block: list[str] = []
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            if inside:
                yield start, block
                inside, block = False, []
            else:
                inside, start, block = True, number + 1, []
            continue
        if inside and line.rstrip().endswith("```"):
            # a closing fence at the end of a code line (vllm-router's README has one)
            block.append(line.rstrip()[:-3])
            yield start, block
            inside, block = False, []
            continue
        if inside:
            block.append(line)
    if inside and block:
        yield start, block


def _commands(lines: list[str], first_line: int) -> Iterator[tuple[int, str, list[str]]]:
    """Join backslash continuations; yield (line number, command, notes)."""
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i
        notes = []
        parts = []
        while True:
            match = _CONT.search(line)
            if match and i + 1 < len(lines) and lines[i + 1].strip():
                if match.group(1):
                    notes.append(
                        "a continuation backslash is followed by a comment in the source; a shell"
                        " would end the command there, read here as the docs intend"
                    )
                parts.append(line[: match.start()])
                i += 1
                line = lines[i]
                continue
            if match:
                parts.append(line[: match.start()])
                notes.append("the last continuation backslash runs into a blank line or the end of the block")
            else:
                parts.append(line)
            break
        yield first_line + start, " ".join(p.strip() for p in parts), sorted(set(notes))
        i += 1


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in after.items() if k not in before or before[k] != v}


def extract_examples(peer: Peer, repo_docs: Sequence[tuple[str, Path]] = ()) -> list[dict[str, Any]]:
    launch_parser = peer.build_launch_parser()
    heads = [(re.compile(r"^\s*" + pattern), kind) for pattern, kind in peer.spec["heads"]]
    found: list[dict[str, Any]] = []
    by_argv: dict[tuple[str, ...], dict[str, Any]] = {}
    baseline = peer.parse([])

    def add(source: str, command: str, notes: list[str]) -> None:
        command = command.strip()
        if not command or command.startswith("#"):
            return
        launcher_kind: str | None = None
        launcher_words: list[str] = []
        for regex, kind in heads:
            match = regex.match(command)
            if match:
                launcher_kind, launcher_words = kind, shlex.split(match.group(0))
                break
        if launcher_kind is None:
            if not command.startswith("--"):
                return
            launcher_kind = "fragment (flags only, no program)"
        try:
            argv = shlex.split(command, comments=True)
        except ValueError:
            return
        tail = next((i for i, w in enumerate(argv) if _SHELL_OPERATOR.fullmatch(w)), None)
        if tail is not None:
            notes = [*notes, f"the shell's {' '.join(argv[tail:])!r} after the command is not the router's: dropped"]
            argv = argv[:tail]
        rest = argv[len(launcher_words) :]
        if not rest or any(re.fullmatch(r"\[.*\]|ARGS|\.\.\.|…", w) for w in rest):
            return  # a usage placeholder, not an example
        if rest in (["--version"], ["-V"], ["--version-verbose"]):
            return  # answered before (Python CLI) or outside (Rust binary) the router parser
        if rest in (["--help"], ["-h"]):
            return  # argparse prints the usage and exits: no configuration to record
        key = tuple(argv)
        if key in by_argv:
            by_argv[key].setdefault("also_found_in", []).append(source)
            return
        entry: dict[str, Any] = {
            "source": source,
            "argv": argv,
            "launcher": launcher_words,
            "launcher_kind": launcher_kind,
        }
        if notes:
            entry["notes"] = notes
        if launcher_kind.startswith("rust"):
            entry.setdefault("notes", []).append(
                "a line for the Rust binary (clap); parsed here with the Python launcher's parser"
            )
        parsed = peer.parse(rest)
        # Beside the full config, what this line changed from an empty command
        # line; the namespace is kept only as that difference (its defaults are
        # in the dump).
        namespace = parsed.pop("namespace", None)
        if namespace is not None:
            parsed["namespace_changed"] = _changed(baseline.get("namespace", {}), namespace)
        if "config" in parsed:
            parsed["config_changed"] = _changed(baseline.get("config", {}), parsed["config"])
        entry["parsed"] = parsed
        by_argv[key] = entry
        found.append(entry)

    for source, text, fenced_only in _text_sources(peer, launch_parser, repo_docs):
        if fenced_only:
            for start, block in _fenced_blocks(text):
                for number, command, notes in _commands(block, start):
                    add(f"{source} line {number}", command, notes)
            continue
        lines = text.splitlines()
        for number, command, notes in _commands(lines, 1):
            # "Example: --flag ..." inside a help string or a docstring line
            piece = command
            match = re.search(r"(?:Example|Examples|e\.g\.)\s*:?\s*(--\S.*)$", piece)
            if match and not any(r.match(piece) for r, _ in heads):
                piece = match.group(1)
            add(f"{source} line {number}", piece, notes)
    return found


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after --parse belongs to the peer's parser, verbatim (argparse
    # itself would eat a "--" or reject the peer's flags, so split here).
    words = None
    if "--parse" in argv:
        at = argv.index("--parse")
        argv, words = [*argv[:at], "--parse"], argv[at + 1 :]
        if words[:1] == ["--"]:
            words = words[1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, choices=sorted(ROUTERS))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--parse",
        action="store_true",
        help="parse the words after --parse (a leading -- is dropped) with the router's own parser; must come last",
    )
    mode.add_argument("--examples", action="store_true", help="extract and parse the package's example command lines")
    parser.add_argument(
        "--repo-doc",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="with --examples: a file of the router's repository to take lines from too (a README, the Rust "
        "binary's main.rs), labelled LABEL (repo@commit:path); .md files give their fenced code only",
    )
    args = parser.parse_args(argv)
    repo_docs = []
    for item in args.repo_doc:
        label, _, path = item.partition("=")
        if not path:
            parser.error(f"--repo-doc takes LABEL=PATH, got {item!r}")
        repo_docs.append((label, Path(path)))

    try:
        peer = Peer(args.router)
    except PeerMissing as exc:
        emit({"router": args.router, "error": str(exc), "python": sys.executable})
        return 3

    if args.parse:
        assert words is not None
        result = peer.parse(words)
        result = {"router": peer.name, "version": peer.version, **result}
        emit(result)
        return 0 if result.get("ok") else 1
    if args.examples:
        emit(extract_examples(peer, repo_docs))
        return 0
    emit(dump(peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
