"""Where code lives, and a frozen file's code and constants as its source on disk says, for
flaloop_gate_integrity; never imports flaloop.

Loaded by path from flaloop_gate_plugin before any target import, like its caller.
"""

from __future__ import annotations

import ast
import builtins
import functools
import sys
import types

_compile = builtins.compile
_isinstance = builtins.isinstance
_getattr = builtins.getattr


def unwrap(obj, through=None):
    """The function under partials, method wrappers and triton's JIT objects (or obj). A
    `functools.wraps` wrapper is a function of its own: it is looked through only where
    `through(wrapper)` says so (a library's decorator), never by default."""
    for _ in range(12):
        if _isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif _isinstance(obj, functools.partial):
            obj = obj.func
        elif _isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif _isinstance(obj, property):
            obj = obj.fget
        elif _isinstance(obj, types.FunctionType) and "__wrapped__" in _getattr(obj, "__dict__", {}) \
                and through is not None and through(obj):
            obj = obj.__dict__["__wrapped__"]
        elif not _isinstance(obj, (types.FunctionType, type)) and _isinstance(_getattr(obj, "fn", None),
                                                                                  types.FunctionType):
            obj = obj.fn  # triton.jit, autotune and heuristics keep the function as .fn
        else:
            break
    return obj


def origin(obj) -> str | None:
    """The file of the code behind `obj`: a function's, a class's module's, a code object's."""
    obj = unwrap(obj)
    if _isinstance(obj, types.CodeType):
        return obj.co_filename
    code = _getattr(obj, "__code__", None)
    if _isinstance(code, types.CodeType):
        return code.co_filename
    cls = obj if _isinstance(obj, type) else type(obj)
    mod = sys.modules.get(_getattr(cls, "__module__", "") or "")
    f = _getattr(mod, "__file__", None)
    if f and cls.__module__ not in ("builtins",):
        return f
    return None


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


class Unknown(Exception):
    """A constant whose value its source does not state on its own."""


def evaluate(node, name, attribute, env: dict[str, str]):
    """The value of a constant's expression: literals and containers of them, `name(id)` and
    `attribute(obj, attr)` for what the caller knows, arithmetic and equality on those, and
    `os.environ.get` / `os.getenv` read from `env`. Unknown for anything else."""
    def ev(n):
        return evaluate(n, name, attribute, env)

    if _isinstance(node, ast.Constant):
        return node.value
    if _isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](ev(e) for e in node.elts)
    if _isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Unknown("**")
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values, strict=True)}
    if _isinstance(node, ast.Name):
        return name(node.id)
    if _isinstance(node, ast.Attribute):
        base = ev(node.value)
        if _isinstance(base, types.ModuleType):
            return attribute(base, node.attr)
        raise Unknown(node.attr)
    if _isinstance(node, ast.UnaryOp) and _isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
        v = ev(node.operand)
        return -v if _isinstance(node.op, ast.USub) else (+v if _isinstance(node.op, ast.UAdd) else not v)
    if _isinstance(node, ast.BinOp) and _isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = ev(node.left), ev(node.right)
        if not all(_isinstance(x, (int, float)) and not _isinstance(x, bool) for x in (a, b)) or \
                (_isinstance(node.op, ast.Div) and b == 0):
            raise Unknown("arithmetic")
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.Div: a / b if b else 0.0}[type(node.op)]
    if _isinstance(node, ast.Compare) and len(node.ops) == 1 and _isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
        a, b = ev(node.left), ev(node.comparators[0])
        return (a == b) if _isinstance(node.ops[0], ast.Eq) else (a != b)
    if _isinstance(node, ast.Call) and not node.keywords and 1 <= len(node.args) <= 2 \
            and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
        return env.get(*[ev(a) for a in node.args])
    raise Unknown(type(node).__name__)
