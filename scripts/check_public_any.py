"""Fails, naming each one, when a public signature of pdproxy mentions ``typing.Any``.

mypy --strict accepts an explicit ``Any``; this check keeps it out of what other code and
users see. Public means a name without a leading underscore (``__init__`` and other dunders
count as public), in a module or a class whose own name is public too, in every module of the
package, the data plane's stub (``_pdproxy.pyi``) included. Checked: each public function's
and method's annotations, and each public module-level alias or annotated variable and class
field (a signature could hide ``Any`` behind one, as ``Scope = dict[str, Any]`` did). String
annotations are parsed and checked too. Function bodies are not: a private detail may still
need ``Any`` where a library leaves something untyped.

Usage: python scripts/check_public_any.py [PACKAGE_DIR]   (default: python/pdproxy)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

DEFAULT_PACKAGE = Path(__file__).resolve().parent.parent / "python" / "pdproxy"
TYPING_MODULES = ("typing", "typing_extensions")


def is_public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def any_names(module: ast.Module) -> set[str]:
    """The names ``typing.Any`` goes by in ``module`` (``Any``, or what it was imported as)."""
    names: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.module in TYPING_MODULES:
            names.update(alias.asname or alias.name for alias in node.names if alias.name == "Any")
    return names


def mentions_any(expression: ast.expr | None, names: set[str]) -> bool:
    """Whether a type expression uses ``Any`` (by one of ``names``, or as ``typing.Any``)."""
    if expression is None:
        return False
    for node in ast.walk(expression):
        if isinstance(node, ast.Name) and node.id in names:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                parsed = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue  # a plain string (a TypeVar's name, a docstring), not an annotation
            if mentions_any(parsed, names):
                return True
    return False


def signature_annotations(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.expr | None]:
    arguments = function.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
        yield argument.annotation
    for variadic in (arguments.vararg, arguments.kwarg):
        if variadic is not None:
            yield variadic.annotation
    yield function.returns


def public_uses(body: list[ast.stmt], names: set[str], scope: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each public definition in ``body`` whose types mention ``Any``;
    classes are entered, functions are not."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if is_public(node.name) and any(mentions_any(a, names) for a in signature_annotations(node)):
                yield node.lineno, f"{scope}{node.name}"
        elif isinstance(node, ast.ClassDef):
            if is_public(node.name):
                yield from public_uses(node.body, names, f"{scope}{node.name}.")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if is_public(node.target.id) and (mentions_any(node.annotation, names) or mentions_any(node.value, names)):
                yield node.lineno, f"{scope}{node.target.id}"
        elif isinstance(node, ast.Assign) and not scope:  # module-level aliases and type variables
            targets = [t.id for t in node.targets if isinstance(t, ast.Name) and is_public(t.id)]
            if targets and mentions_any(node.value, names):
                yield node.lineno, targets[0]


def violations(package: Path) -> list[str]:
    found = []
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.pyi")]):
        module = ast.parse(path.read_text(), filename=str(path))
        names = any_names(module)
        found += [f"{path}:{line}: {name}" for line, name in public_uses(module.body, names, "")]
    return found


def main() -> int:
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PACKAGE
    found = violations(package)
    for violation in found:
        print(f"{violation}: typing.Any in a public signature", file=sys.stderr)
    if found:
        print(f"{len(found)} public signature(s) mention Any; give them precise types", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
