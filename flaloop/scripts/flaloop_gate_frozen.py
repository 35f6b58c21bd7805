"""A frozen file's code as its source on disk says, for flaloop_gate_integrity; never imports flaloop.

Loaded by path from flaloop_gate_plugin before any target import, like its caller.
"""

from __future__ import annotations

import ast
import builtins
import types

_compile = builtins.compile
_isinstance = builtins.isinstance
_getattr = builtins.getattr


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Equal bytecode, names and constants, nested code objects compared the same way (line
    numbers and file names aside)."""
    if a is b:
        return True
    for attr in ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount",
                 "co_posonlyargcount", "co_kwonlyargcount", "co_flags", "co_name"):
        if _getattr(a, attr) != _getattr(b, attr):
            return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts, strict=True):
        if _isinstance(x, types.CodeType) or _isinstance(y, types.CodeType):
            if not (_isinstance(x, types.CodeType) and _isinstance(y, types.CodeType) and same_code(x, y)):
                return False
        elif type(x) is not type(y) or (x != y and repr(x) != repr(y)):
            return False
    return True


def codes(code: types.CodeType, out: dict) -> dict:
    """Every code object under `code`, by qualified name."""
    out.setdefault(_getattr(code, "co_qualname", code.co_name), []).append(code)
    for c in code.co_consts:
        if _isinstance(c, types.CodeType):
            codes(c, out)
    return out


class FrozenFile:
    """A frozen module's source as read before any target code ran, and what it defines."""

    def __init__(self, path: str, source: bytes):
        self.path, self.source = path, source
        self.tree = ast.parse(source)
        self.variants: list[dict] | None = None  # qualname -> [code], per legitimate compilation
        top = self.tree.body
        self.defs = {n.name for n in _top_nodes(top) if _isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef))}
        assigned: dict[str, int] = {}
        for n in _top_nodes(top):
            for t in _targets(n):
                assigned[t] = assigned.get(t, 0) + 1
        globals_decl = {name for n in ast.walk(self.tree) if _isinstance(n, ast.Global) for name in n.names}
        self.bound = set(assigned) | {name for n in ast.walk(self.tree) if _isinstance(n, ast.Global)
                                      for name in n.names}
        self.constants = {}
        for n in _top_nodes(top):
            if _isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                names = _targets(n)
                if len(names) == 1 and assigned.get(names[0]) == 1 and names[0] not in globals_decl \
                        and names[0] not in self.defs:
                    self.constants[names[0]] = n.value
        self.imports = []  # (local name, module, attribute or None)
        for n in _top_nodes(top):
            if _isinstance(n, ast.ImportFrom) and n.module is not None or _isinstance(n, ast.ImportFrom) and n.level:
                for a in n.names:
                    if a.name != "*" and assigned.get(a.asname or a.name) == 1:
                        self.imports.append((a.asname or a.name, ("." * n.level) + (n.module or ""), a.name))
            elif _isinstance(n, ast.Import):
                for a in n.names:
                    local = a.asname or a.name.split(".")[0]
                    if assigned.get(local) == 1:
                        self.imports.append((local, a.name if a.asname else a.name.split(".")[0], None))

    def compiled(self, config) -> list[dict]:
        """The file compiled plainly, and as pytest's assertion rewriter would (test files, conftests)."""
        if self.variants is None:
            self.variants = [codes(_compile(self.source, self.path, "exec", dont_inherit=True), {})]
            try:
                from _pytest.assertion.rewrite import rewrite_asserts
                tree = ast.parse(self.source)
                rewrite_asserts(tree, self.source, self.path, config)
                self.variants.append(codes(_compile(tree, self.path, "exec", dont_inherit=True), {}))
            except Exception:  # noqa: BLE001 - no rewriter: the plain compilation is the only legitimate one
                pass
        return self.variants


def _top_nodes(body):
    """Module-level statements, also those inside top-level if/try blocks."""
    for n in body:
        if _isinstance(n, (ast.If, ast.Try)):
            yield from _top_nodes(n.body)
            yield from _top_nodes(getattr(n, "orelse", []))
            for h in getattr(n, "handlers", []):
                yield from _top_nodes(h.body)
            yield from _top_nodes(getattr(n, "finalbody", []))
        else:
            yield n


def _targets(n) -> list[str]:
    if _isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [n.name]
    if _isinstance(n, ast.Assign):
        return [x.id for t in n.targets for x in ast.walk(t) if _isinstance(x, ast.Name)]
    if _isinstance(n, (ast.AnnAssign, ast.AugAssign)):
        return [n.target.id] if _isinstance(n.target, ast.Name) else []
    if _isinstance(n, ast.ImportFrom):
        return [a.asname or a.name for a in n.names]
    if _isinstance(n, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in n.names]
    return []
