"""Which ops a change touches: the pull-request check's `--ops changed`.

An op's code is the module that defines its function, the package module it is imported from
(`import_path`), and every module of the target package those import, directly or through
others: an import closure read from the source with `ast` (nothing is imported). A package's
`__init__.py` counts only where it is imported by name, not as the parent of every module below
it: FLA's `fla/__init__.py` imports every layer and model, which would make every op depend on
every file. The closure is taken at the head and at the base (a file the change deletes was the
base's code); an op is touched when the diff between them names any file of either closure.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from flaloop.core.errors import UsageError

Reader = Callable[[str], str | None]  # repo-relative path -> its text, None when absent


def _module_file(module: str, read: Reader) -> str | None:
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if read(rel) is not None:
            return rel
    return None


def _package_of(rel: str) -> str:
    """The dotted package a file's relative imports start from (`a/b/__init__.py` and `a/b/c.py`: a.b)."""
    return ".".join(rel[:-3].split("/")[:-1])


def _resolve(rel: str, level: int, module: str | None) -> str:
    parts = _package_of(rel).split(".") if _package_of(rel) else []
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, *([module] if module else [])])


def _defining_file(rel: str, name: str, read: Reader, depth: int = 0) -> str:
    """The file that defines `name`, following `from X import name` re-exports from `rel`."""
    try:
        tree = ast.parse(read(rel) or "")
    except (SyntaxError, ValueError):
        return rel
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return rel
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return rel
    if depth > 8:
        return rel
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            orig = next(a.name for a in node.names if (a.asname or a.name) == name)
            mod = _resolve(rel, node.level, node.module) if node.level else (node.module or "")
            f = _module_file(mod, read)
            if f is not None:
                return _defining_file(f, orig, read, depth + 1)
    return rel


def _imports(rel: str, text: str, package: str) -> list[str]:
    """Modules of `package` that a file imports (absolute and relative), as dotted names; for
    `from m import a`, also `m.a` (it may be a submodule)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(rel, node.level, node.module) if node.level else (node.module or "")
            if not mod:
                continue
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names if a.name != "*"]
    return [m for m in out if m == package or m.startswith(package + ".")]


def op_files(import_path: str, func_name: str, read: Reader) -> set[str]:
    """The files of an op's code within its package (see the module doc): the module it is imported
    from, and the import closure of the module that defines its function."""
    package = import_path.split(".")[0]
    entry = _module_file(import_path, read)
    if entry is None:
        return set()
    start = _defining_file(entry, func_name, read)
    seen: set[str] = {entry}
    todo = [start]
    if start == entry:
        seen.discard(entry)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        text = read(rel) or ""
        for mod in _imports(rel, text, package):
            f = _module_file(mod, read)
            if f is not None and f not in seen:
                todo.append(f)
    return seen


def reader(root: Path) -> Reader:
    def read(rel: str) -> str | None:
        p = root / rel
        try:
            return p.read_text(errors="replace") if p.is_file() else None
        except OSError:
            return None

    return read


def touched(ops: dict[str, tuple[str, str]], changed: set[str], readers: list[Reader]) -> dict[str, list[str]]:
    """{op: the changed files of its code} for every op (name -> (import path, function)) the change touches."""
    out = {}
    for op, (import_path, func_name) in ops.items():
        files: set[str] = set()
        for read in readers:
            files |= op_files(import_path, func_name, read)
        hit = sorted(files & changed)
        if hit:
            out[op] = hit
    return out


def parse_ops(spec: str, known: list[str]) -> list[str] | None:
    """`--ops`: "changed" (None: work it out from the diff), "all", or a comma list of known ops."""
    spec = spec.strip()
    if spec == "changed":
        return None
    if spec == "all":
        return list(known)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UsageError(f"--ops {spec!r}: {'unknown op(s) ' + ', '.join(unknown) if unknown else 'names no op'}",
                         f"use changed, all, or a comma list of: {', '.join(known)}")
    return names
