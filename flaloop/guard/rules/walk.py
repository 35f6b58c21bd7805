"""Shapes of code several rules look for: writes to attributes and to the environment, name chains."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from flaloop.guard.source import Source, const_str

SETATTR = ("setattr", "builtins.setattr", "object.__setattr__", "type.__setattr__",
           "delattr", "builtins.delattr", "object.__delattr__", "type.__delattr__")
# methods that change the container (or tensor) they are called on
MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add",
                      "discard", "remove", "appendleft", "extendleft", "put", "put_nowait", "__setitem__",
                      "__delitem__", "__setattr__", "__ior__"})
ENVIRON = ("os.environ", "os.environb")


def is_docstring(src: Source, node: ast.AST) -> bool:
    return isinstance(src.parent.get(node), ast.Expr) and isinstance(node, ast.Constant)


def statement(src: Source, node: ast.AST) -> ast.AST:
    """The statement that contains `node` (for messages)."""
    p = node
    while p is not None and not isinstance(p, ast.stmt):
        p = src.parent.get(p)
    return p if p is not None else node


def outermost_chains(src: Source) -> Iterator[tuple[ast.AST, str]]:
    """(node, dotted) for each Name/Attribute chain that is not itself the base of a longer chain."""
    for node in src.walk():
        if not isinstance(node, (ast.Name, ast.Attribute)):
            continue
        parent = src.parent.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            continue
        dotted = src.qualify(node)
        if dotted:
            yield node, dotted


def targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out: list[ast.AST] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target] if getattr(node, "value", None) is not None or isinstance(node, ast.AugAssign) else []
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def attribute_writes(src: Source) -> Iterator[tuple[ast.AST, str | None, ast.AST | None]]:
    """(node, dotted target, value) for every attribute set or deleted, in any spelling.

    `a.b.c = v`, `a.b.c += v`, `del a.b.c`, `setattr(a.b, "c", v)`, `object.__setattr__(a.b, "c", v)`,
    `a.b.__setattr__("c", v)`, `vars(a.b)["c"] = v`, `a.b.__dict__["c"] = v`.
    """
    for node in src.walk():
        value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else None
        for t in targets(node):
            if isinstance(t, ast.Attribute):
                yield node, src.qualify(t), value
            elif isinstance(t, ast.Subscript) and const_str(t.slice) and _is_namespace(src, t.value):
                yield node, src.qualify(t), value
        if isinstance(node, ast.Call) and len(node.args) >= 2 and (name := const_str(node.args[1])):
            fn = src.call_name(node)
            if fn in SETATTR:
                base = src.qualify(node.args[0])
                yield node, f"{base}.{name}" if base else None, node.args[2] if len(node.args) > 2 else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("__setattr__", "__delattr__") and node.args and (name := const_str(node.args[0])):
            base = src.qualify(node.func.value)
            yield node, f"{base}.{name}" if base else None, node.args[1] if len(node.args) > 1 else None


def _is_namespace(src: Source, node: ast.AST) -> bool:
    """`vars(x)` or `x.__dict__`: a subscript store into it is an attribute write."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return True
    return isinstance(node, ast.Call) and src.call_name(node) in ("vars", "builtins.vars")


def _env_keys(src: Source, call: ast.Call) -> list[str | None]:
    keys: list[str | None] = [k.arg for k in call.keywords if k.arg]
    for a in call.args[:1]:
        if isinstance(a, ast.Dict):
            keys.extend(const_str(k) for k in a.keys)
        else:
            keys.append(const_str(a))
    return keys or [None]


def env_writes(src: Source) -> Iterator[tuple[ast.AST, str | None]]:
    """(node, variable name or None) for every write to the process environment."""
    for node in src.walk():
        for t in targets(node):
            if isinstance(t, ast.Subscript) and src.qualify(t.value) in ENVIRON:
                yield node, const_str(t.slice)
            elif src.qualify(t) in ENVIRON:  # os.environ = {...} / os.environ |= {...}
                yield node, None
        if not isinstance(node, ast.Call):
            continue
        fn = src.call_name(node) or ""
        if fn in ("os.putenv", "os.unsetenv"):
            yield node, const_str(node.args[0]) if node.args else None
        elif isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and \
                src.qualify(node.func.value) in ENVIRON:
            for key in _env_keys(src, node):
                yield node, key


def env_write_nodes(src: Source) -> set[int]:
    """ids of every node inside an environment write (reads inside them are not reads)."""
    out: set[int] = set()
    for node, _ in env_writes(src):
        out.update(id(n) for n in ast.walk(node))
    return out


def root_name(node: ast.AST) -> ast.Name | None:
    """`a` of `a.b[c].d`."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def method_name(func: ast.AST) -> str | None:
    """The attribute a call invokes: `x.data_ptr()` and `getattr(x, "data_ptr")()` both give data_ptr."""
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "getattr" \
            and len(func.args) >= 2:
        return const_str(func.args[1])
    return None
