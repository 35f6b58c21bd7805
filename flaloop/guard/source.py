"""One Python file as the static rules see it: its AST, its scopes and what its names stand for.

The rules ask `qualify(node)` what an expression names, with import aliases resolved, so that
`import torch.backends.cuda as tbc; tbc.matmul.allow_tf32 = True`, `from torch.cuda import Event`,
`getattr(torch.backends.cuda.matmul, "allow_tf32")`, `m = torch.backends.cuda.matmul` and
`sys.modules["torch"]` all lead to the same dotted name. Bindings are per scope: a function's
parameters and local assignments shadow module-level names.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterator

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
SCOPES = (*FUNCS, ast.Module)
MODULE = "<module>"


def module_name(relpath: str) -> str:
    """Dotted module name of a repo-relative .py path (`a/b/__init__.py` -> `a.b`)."""
    parts = relpath[:-3].split("/") if relpath.endswith(".py") else relpath.split("/")
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


class Source:
    """A parsed file. `tree` is None (and `error` says why) when it does not parse."""

    def __init__(self, relpath: str, text: str, modname: str | None = None):
        self.path = relpath
        self.text = text
        self.modname = modname if modname is not None else module_name(relpath)
        self.is_package = relpath.endswith("__init__.py")
        self.error: str | None = None
        try:
            self.tree: ast.Module | None = ast.parse(text)
        except (SyntaxError, ValueError) as exc:
            self.tree, self.error = None, f"{type(exc).__name__}: {exc}"
            return
        self.nodes: list[ast.AST] = list(ast.walk(self.tree))  # walked once: every rule iterates it
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self._imports: list[tuple[ast.AST, str, str | None]] | None = None
        self._scope: dict[ast.AST, ast.AST] = {}
        # scope node -> {name: dotted name it stands for, or None when it is a plain local}
        self.bindings: dict[ast.AST, dict[str, str | None]] = {}
        self.int_constants: dict[str, int] = {}  # module-level NAME = <int literal>
        self.values: dict[tuple[ast.AST, str], list[ast.AST]] = {}  # (scope, name) -> values assigned to it
        # module-level NAME = "lit" / tl.constexpr("lit"), every binding (if/else branches included)
        self.str_constants: dict[str, list[tuple[ast.AST, str]]] = {}
        self._bind()

    # -- structure ----------------------------------------------------------------------------

    def walk(self) -> Iterator[ast.AST]:
        return iter(self.nodes) if self.tree else iter(())

    def scope_node(self, node: ast.AST) -> ast.AST:
        """The innermost function (or lambda) around `node`, else the module."""
        hit = self._scope.get(node)
        if hit is None:
            p = self.parent.get(node)
            while p is not None and not isinstance(p, SCOPES):
                p = self.parent.get(p)
            hit = self._scope[node] = p if p is not None else self.tree
        return hit

    def in_function(self, node: ast.AST) -> bool:
        return isinstance(self.scope_node(node), FUNCS)

    def qualname(self, node: ast.AST) -> str:
        """`Class.method`, `func.inner`, or MODULE: the scope a hit is counted in."""
        names = []
        p = node if isinstance(node, (*FUNCS, ast.ClassDef)) else self.parent.get(node)
        while p is not None:
            if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(p.name)
            elif isinstance(p, ast.Lambda):
                names.append("<lambda>")
            p = self.parent.get(p)
        return ".".join(reversed(names)) or MODULE

    def scopes(self) -> set[str]:
        """Every function and class qualname defined in the file, and MODULE."""
        return {MODULE} | {self.qualname(n) for n in self.walk()
                           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def module_level_names(self) -> set[str]:
        """Names the module binds at import time other than by importing (state, functions, classes)."""
        out: set[str] = set()
        for stmt in self.tree.body if self.tree else []:
            for node in _top_level(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        out.update(_target_names(t))
        return out

    def snippet(self, node: ast.AST, limit: int = 100) -> str:
        try:
            text = ast.unparse(node)
        except Exception:  # noqa: BLE001 - a cosmetic fallback
            text = type(node).__name__
        text = " ".join(text.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    # -- names --------------------------------------------------------------------------------

    def lookup(self, name: str, scope: ast.AST) -> tuple[bool, str | None]:
        """(found, dotted name) for `name` seen from `scope`, innermost binding first."""
        s: ast.AST | None = scope
        while s is not None:
            b = self.bindings.get(s)
            if b is not None and name in b:
                return True, b[name]
            s = None if isinstance(s, ast.Module) else self.scope_node(s)
        return False, None

    def qualify(self, node: ast.AST, scope: ast.AST | None = None) -> str | None:
        """The dotted name `node` stands for (`torch.backends.cuda.matmul.allow_tf32`), or None.

        Unbound names (builtins such as `id`, functions of this module) come back as themselves.
        """
        if self.tree is None:
            return None
        scope = scope if scope is not None else self.scope_node(node)
        if isinstance(node, ast.Name):
            found, dotted = self.lookup(node.id, scope)
            return dotted if found else node.id
        if isinstance(node, ast.Attribute):
            if node.attr == "__dict__":
                return self.qualify(node.value, scope)
            base = self.qualify(node.value, scope)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            fn = self.qualify(node.func, scope)
            args = node.args
            if fn in ("getattr", "builtins.getattr") and len(args) >= 2 and (lit := const_str(args[1])):
                base = self.qualify(args[0], scope)
                return f"{base}.{lit}" if base else None
            if fn in ("importlib.import_module", "__import__", "builtins.__import__") and args \
                    and (lit := const_str(args[0])):
                return lit
            if fn in ("vars", "builtins.vars") and len(args) == 1:
                return self.qualify(args[0], scope)
            return None
        if isinstance(node, ast.Subscript):
            key = const_str(node.slice)
            base = self.qualify(node.value, scope)
            if base == "sys.modules" and key:
                return key
            if key and isinstance(node.value, ast.Call) and base and \
                    self.qualify(node.value.func, scope) in ("vars", "builtins.vars"):
                return f"{base}.{key}"
            if key and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__" and base:
                return f"{base}.{key}"
            return None
        return None

    def assigned(self, name: ast.Name) -> list[ast.AST]:
        """The values assigned to `name` in the scope that binds it (`lo = a if c else torch.bfloat16`)."""
        s: ast.AST | None = self.scope_node(name)
        while s is not None:
            if name.id in self.bindings.get(s, {}):
                return self.values.get((s, name.id), [])
            s = None if isinstance(s, ast.Module) else self.scope_node(s)
        return []

    def call_name(self, call: ast.Call) -> str | None:
        return self.qualify(call.func)

    def _bind(self) -> None:
        module_b: dict[str, str | None] = {}
        self.bindings[self.tree] = module_b
        scopes = [n for n in self.nodes if isinstance(n, FUNCS)]
        for fn in scopes:
            b: dict[str, str | None] = {}
            a = fn.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    b[arg.arg] = None
            self.bindings[fn] = b
        # imports first (wherever they are), then plain locals, then aliases by assignment
        for node in self.nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                b = self.bindings[self.scope_node(node)]
                for alias in node.names:
                    if isinstance(node, ast.Import):
                        if alias.asname:
                            b[alias.asname] = alias.name
                        else:
                            b[alias.name.split(".")[0]] = alias.name.split(".")[0]
                    elif alias.name != "*":
                        mod = self.resolve_from(node)
                        b[alias.asname or alias.name] = f"{mod}.{alias.name}" if mod else alias.name
        globals_: dict[ast.AST, set[str]] = {}
        for node in self.nodes:
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                globals_.setdefault(self.scope_node(node), set()).update(node.names)
        assigns = []
        for node in self.nodes:
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
                assigns.append(node)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
                targets = [node.target]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
            elif isinstance(node, ast.comprehension):
                targets = [node.target]
            elif isinstance(node, ast.NamedExpr):
                targets = [node.target]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = self.scope_node(node)
                self.bindings[scope].setdefault(node.name, None)
                continue
            scope = self.scope_node(node)
            for t in targets:
                for name in _target_names(t):
                    if name not in globals_.get(scope, ()):
                        self.bindings[scope].setdefault(name, None)
        for node in assigns:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.values.setdefault((self.scope_node(node), t.id), []).append(node.value)
        for _ in range(3):  # aliases of aliases: m = torch.backends; mm = m.cuda.matmul
            for node in assigns:
                scope = self.scope_node(node)
                for t in node.targets:
                    pairs = [(t, node.value)]
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                            and len(t.elts) == len(node.value.elts):
                        pairs = list(zip(t.elts, node.value.elts, strict=True))
                    for tgt, val in pairs:
                        if isinstance(tgt, ast.Name):
                            dotted = self.qualify(val, scope)
                            if dotted and dotted != tgt.id:
                                b = self.bindings[self.tree if tgt.id in globals_.get(scope, ()) else scope]
                                b[tgt.id] = dotted
        for top in self.tree.body:
            for stmt in _top_level(top):
                if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                    continue
                name, value = stmt.targets[0].id, stmt.value
                if isinstance(value, ast.Call) and len(value.args) == 1 and \
                        (self.qualify(value.func, self.tree) or "").endswith("constexpr"):
                    value = value.args[0]
                if isinstance(value, ast.Constant) and type(value.value) is int and stmt in self.tree.body:
                    self.int_constants[name] = value.value
                elif isinstance(value, ast.Constant) and isinstance(value.value, str):
                    self.str_constants.setdefault(name, []).append((stmt, value.value))

    def resolve_from(self, node: ast.ImportFrom) -> str | None:
        """The absolute module of `from X import ...`, relative levels resolved against this file."""
        if not node.level:
            return node.module
        pkg = self.modname.split(".") if self.is_package else self.modname.split(".")[:-1]
        if node.level > 1:
            pkg = pkg[: len(pkg) - (node.level - 1)]
        return ".".join([*pkg, *([node.module] if node.module else [])]) or None

    def imported_modules(self) -> list[tuple[ast.AST, str, str | None]]:
        """(node, module, name) for every import: `import a.b` -> ('a.b', None), `from a import b` -> ('a', 'b')."""
        if self._imports is not None:
            return self._imports
        out: list[tuple[ast.AST, str, str | None]] = []
        for node in self.walk():
            if isinstance(node, ast.Import):
                out.extend((node, a.name, None) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = self.resolve_from(node)
                if mod:
                    out.extend((node, mod, a.name) for a in node.names)
        # importlib.import_module("x") / __import__("x") with a literal
        for node in self.walk():
            if isinstance(node, ast.Call) and node.args and (lit := const_str(node.args[0])) and \
                    self.qualify(node.func) in ("importlib.import_module", "__import__", "builtins.__import__"):
                out.append((node, lit, None))
        self._imports = out
        return out


def changed_lines(base: str, cand: str) -> set[int]:
    """1-based numbers of the candidate's lines that are added or changed relative to the base."""
    out: set[int] = set()
    sm = difflib.SequenceMatcher(None, base.splitlines(), cand.splitlines(), autojunk=False)
    for tag, _i1, _i2, j1, j2 in sm.get_opcodes():
        if tag in ("replace", "insert"):
            out.update(range(j1 + 1, j2 + 1))
    return out


def const_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _target_names(t: ast.AST) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _target_names(e)]
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return []


def _top_level(stmt: ast.stmt) -> Iterator[ast.AST]:
    """Statements that run at import time: the module body, including inside if/try/with blocks."""
    yield stmt
    if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(stmt, field, []) or []:
                if isinstance(child, ast.ExceptHandler):
                    for c in child.body:
                        yield from _top_level(c)
                else:
                    yield from _top_level(child)
