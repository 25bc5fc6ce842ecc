#!/usr/bin/env python3
"""The module dependency graph of the Rust crate under rust/src, and a check that it has no circle.

Each module (a file, or a folder with its mod.rs) is mapped to the `crate::...` paths its code
names: `use crate::...` trees, `crate::a::b` and `super::...` paths in code, and a folder's own
`use child::...` lines (which resolve the re-exports others reach through the folder). An edge is
kept at the granularity that shows the architecture: between top-level modules, and between the
sub-modules of one folder (a module reaching into its own parent or child is not an edge).

    python3 scripts/module_graph.py            # exit 1 and print every circle, if any
    python3 scripts/module_graph.py --print    # also print the graph

Standard library only (Python 3.11).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

Path_ = tuple[str, ...]


@dataclass
class Module:
    path: Path_  # ("crate", "a", "b")
    file: Path
    children: dict[str, Module] = field(default_factory=dict)
    # Names this module's `use` lines bring in, to the full paths they stand for (re-exports).
    aliases: dict[str, Path_] = field(default_factory=dict)
    refs: set[Path_] = field(default_factory=set)


def strip(text: str) -> str:
    """The source without comments, string and char literals (kept as blanks), lifetimes intact."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            out.append(" ")
        elif m := re.compile(r'b?r(#*)"').match(text, i):
            if i and (text[i - 1].isalnum() or text[i - 1] == "_"):
                out.append(c)
                i += 1
                continue
            end = text.find('"' + m.group(1), m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and (m := re.compile(r"'(\\(u\{[0-9a-fA-F]+\}|x..|.)|[^\\'])'").match(text, i)):
            out.append("' '")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


MOD_DECL = re.compile(r"\bmod\s+(\w+)\s*([;{])")
USE = re.compile(r"\buse\s+([^;]+);")
PATH = re.compile(r"\b(crate|super|self)((?:\s*::\s*\w+)+)")


def expand_use(tree: str) -> list[tuple[Path_, str]]:
    """`a::{b::C, d as E, f::*}` -> [(a::b::C, "C"), (a::d, "E"), (a::f, "*")]."""
    tokens = re.findall(r"::|[{},*]|\w+", tree)
    out: list[tuple[Path_, str]] = []
    pos = 0

    def tree_at(prefix: Path_) -> None:
        nonlocal pos
        segs = list(prefix)
        while pos < len(tokens):
            tok = tokens[pos]
            if tok == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos] != "}":
                    if tokens[pos] == ",":
                        pos += 1
                        continue
                    tree_at(tuple(segs))
                pos += 1
                return
            if tok == "*":
                pos += 1
                out.append((tuple(segs), "*"))
                return
            if tok in (",", "}"):
                break
            if tok != "::":
                segs.append(tok)
            pos += 1
            if pos < len(tokens) and tokens[pos] == "as":
                out.append((strip_self(segs), tokens[pos + 1]))
                pos += 2
                return
        segs_t = strip_self(segs)
        if segs_t:
            out.append((segs_t, segs_t[-1]))

    tree_at(())
    return out


def strip_self(segs: list[str]) -> Path_:
    """`a::b::{self}` names `a::b`."""
    return tuple(segs[:-1]) if len(segs) > 1 and segs[-1] == "self" else tuple(segs)


def load(src: Path) -> dict[Path_, Module]:
    modules: dict[Path_, Module] = {}

    def visit(path: Path_, file: Path) -> Module:
        module = Module(path, file)
        modules[path] = module
        text = strip(file.read_text())
        own_dir = file.parent if file.name in ("mod.rs", "lib.rs") else file.parent / file.stem
        scan(module, text, own_dir)
        return module

    def scan(module: Module, text: str, own_dir: Path) -> None:
        # Inline modules (`mod tests { ... }`) belong to their file's module; `super` inside
        # one names the file's module, so the stack of them is tracked by brace depth.
        inline: list[int] = []  # brace depths at which an inline module opened
        depth = 0
        tokens = re.compile(
            r"#\[cfg\(test\)\]|[{};]|\bmod\s+\w+\s*[;{]|\buse\s+[^;]+;|\b(?:crate|super|self)(?:\s*::\s*\w+)+"
        )
        # Test code (`#[cfg(test)]` items: test modules, helpers) is left out: what a test
        # builds its fixtures with is not a dependency of the code.
        skip_from: int | None = None  # brace depth the skipped item started at
        pending_test = False
        for m in tokens.finditer(text):
            tok = m.group(0)
            if tok == "#[cfg(test)]":
                pending_test = True
                continue
            if pending_test:
                pending_test = False
                if tok == ";" or (tok.startswith(("mod", "use")) and tok.endswith(";")):
                    continue  # `#[cfg(test)] mod tests;` or a test-only `use`: skipped whole
                skip_from = depth
            if skip_from is not None:
                if tok == "{":
                    depth += 1
                elif tok == "}":
                    depth -= 1
                    if depth == skip_from:
                        skip_from = None
                elif tok == ";" and depth == skip_from:
                    skip_from = None
                elif tok.startswith("mod") and tok.endswith("{"):
                    depth += 1
                continue
            if tok == ";":
                continue
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                if inline and inline[-1] == depth:
                    inline.pop()
            elif tok.startswith("mod"):
                decl = MOD_DECL.match(tok)
                assert decl
                name, end = decl.groups()
                if end == ";" and not inline:
                    file = own_dir / f"{name}.rs"
                    if not file.exists():
                        file = own_dir / name / "mod.rs"
                    module.children[name] = visit((*module.path, name), file)
                elif end == "{":
                    inline.append(depth)
                    depth += 1
            elif tok.startswith("use"):
                for segs, name in expand_use(USE.match(tok).group(1)):  # type: ignore[union-attr]
                    full = resolve(module, segs, len(inline))
                    if full is None:
                        continue
                    module.refs.add(full)
                    if name != "*" and not inline:
                        module.aliases[name] = full
            else:
                segs = tuple(s.strip() for s in tok.split("::"))
                full = resolve(module, segs, len(inline))
                if full is not None:
                    module.refs.add(full)

    def resolve(module: Module, segs: Path_, inline_depth: int) -> Path_ | None:
        if not segs:
            return None
        if segs[0] == "crate":
            return segs
        if segs[0] in ("super", "self"):
            base = list(module.path)
            i = 0
            while i < len(segs) and segs[i] in ("super", "self"):
                if segs[i] == "super":
                    if inline_depth:
                        inline_depth -= 1  # leaves an inline module: still this file's module
                    elif len(base) > 1:
                        base.pop()
                i += 1
            return tuple(base) + segs[i:]
        # A folder's `use child::...` (2018 paths): the child module declared here. Children are
        # declared before use in every file here; one not seen yet is an external crate.
        declared_here = module.file.name in ("mod.rs", "lib.rs") and (module.file.parent / f"{segs[0]}.rs").exists()
        if segs[0] in module.children or declared_here:
            return module.path + segs
        return None

    visit(("crate",), src / "lib.rs")
    return modules


def module_of(modules: dict[Path_, Module], target: Path_, seen: frozenset[Path_] = frozenset()) -> Path_:
    """The module a path lands in, following re-exports (`pub use child::Item`) down."""
    for cut in range(len(target), 0, -1):
        head = target[:cut]
        if head in modules:
            if cut < len(target):
                alias = modules[head].aliases.get(target[cut])
                if alias and alias not in seen and alias != target:
                    return module_of(modules, alias + target[cut + 1 :], seen | {target})
            return head
    return target[:1]


def graph(modules: dict[Path_, Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path, module in modules.items():
        if len(path) < 2:
            continue
        edges.setdefault("::".join(path[1:]), set())
        for ref in module.refs:
            target = module_of(modules, ref)
            common = 0
            while common < min(len(path), len(target)) and path[common] == target[common]:
                common += 1
            if common < len(path) and common < len(target):
                a, b = path[: common + 1], target[: common + 1]
                if len(a) > 1 and b in modules:
                    edges.setdefault("::".join(a[1:]), set()).add("::".join(b[1:]))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each with one circle in it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, set())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def circle_in(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One shortest circle through the component's first module."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, set()) & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent / "rust" / "src")
    parser.add_argument("--print", action="store_true", help="print the graph: each module and what it uses")
    args = parser.parse_args()
    edges = graph(load(args.src))
    if args.print:
        for name in sorted(edges):
            print(f"{name} -> {', '.join(sorted(edges[name])) or '-'}")
    found = cycles(edges)
    for component in found:
        print("circle: " + " -> ".join(circle_in(component, edges)), file=sys.stderr)
        print(f"  (all of: {', '.join(component)})", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
