"""Inside the gate's pytest: what the frozen test runs and what pytest reports are the originals.

Loaded by flaloop_gate_plugin before any conftest or target import; never imports flaloop.
The candidate's code shares this process with the frozen test, so it could change what the test
executes without touching a file. `Integrity` takes, before that code can run, the identities of
the library namespaces the test judges with (torch, numpy, math, builtins, pytest, pluggy, this
plugin) and compiles every frozen file afresh from disk; `check()` then reports each difference
the tree made (`Change`), by route:

  rebind       a name of a checked namespace (a module's or class's attribute) is another object
  code-swap    a function's `__code__`, defaults or closure cells replaced
  frozen-code  a function or class of a frozen module whose code is not its file's on disk
  frozen-value a constant of a frozen module that is not what its source evaluates to
  import-swap  a name a frozen module imported is not the object of the module it names
  sys-modules  a frozen module's `sys.modules` entry is not the module loaded from its file
  report-hook  a hook implementation, a plugin or pluggy's hook caller added or removed by the tree
  torch-mode   a torch function or dispatch mode left on the stack, a trace function set
  test-item    a collected test's function or parameters changed after collection

A change is the frozen files' own (their fixtures, their `monkeypatch`) when the new object is
defined in a frozen file, or was set by `MonkeyPatch` called from one; those are not reported.
"""

from __future__ import annotations

import builtins
import functools
import os
import sys
import time
import types

# loaded by path beside this file by flaloop_gate_plugin, before this module
from flaloop_gate_frozen import FrozenFile, Unknown, codes, evaluate, origin, same_code
from flaloop_gate_frozen import unwrap as _unwrap

MISSING = object()
# Namespaces whose objects the frozen test judges or reports with; submodules named here only.
LIB_MODULES = ("builtins", "math", "operator", "functools", "torch", "torch.testing", "torch.testing._comparison",
               "torch.nn.functional", "torch.functional", "torch.autograd", "torch.autograd.function",
               "torch.linalg", "torch.special", "torch.fft", "torch._tensor", "numpy", "numpy.testing",
               "unittest.mock")
LIB_PREFIXES = ("pytest", "_pytest", "pluggy", "xdist", "flaloop_gate_plugin", "flaloop_gate_integrity",
                "flaloop_gate_frozen", "flaloop_lifeline")
# Entries pytest itself rewrites while it runs (the assertion plugin binds its comparison hooks
# per test; the capture plugin swaps streams): their values, not their code, change.
VOLATILE = {("_pytest.assertion.util", "_reprcompare"), ("_pytest.assertion.util", "_assertion_pass"),
            ("_pytest.assertion.util", "_config"), ("builtins", "_"), ("_pytest.assertion.rewrite", "_config"),
            ("flaloop_lifeline", "_armed")}
# Names the interpreter itself adds to a class, as an empty dict, the first time they are read:
# `cls.__annotations__` on a class that has none (Python 3.11 and 3.12 both store it), which any
# library that inspects annotations does. On the H200 an unchanged FLA tree read red when one
# appeared on collections.abc.Sized, whose later base in a library class's MRO already had one.
MATERIALIZED = ("__annotations__",)
# pytest's packages, one library for `_library_own`: pytest sets state on its own classes and
# modules while it runs (the debugger's config, legacy ini readers).
RUNNER_PACKAGES = ("_pytest", "pytest", "pluggy", "xdist", "execnet")
_compile = builtins.compile
_isinstance = builtins.isinstance
_getattr = builtins.getattr


class Change(dict):
    """One difference: route, what changed, and where the new object's code lives."""

    def __init__(self, route: str, what: str, origin: str | None, setter: str | None = None):
        super().__init__(route=route, what=what, origin=origin, setter=setter)


class Integrity:
    """The snapshot taken before the tree's code runs, and the checks against it."""

    def __init__(self, tree_root: str, frozen: list[str]):
        self.root = tree_root.rstrip(os.sep)
        self.real_root = os.path.realpath(self.root)
        self.env = dict(os.environ)
        self.frozen: dict[str, FrozenFile] = {}
        for rel in frozen:
            if rel.endswith(".py"):
                path = os.path.join(self.root, rel)
                try:
                    with open(path, "rb") as fh:
                        self.frozen[os.path.realpath(path)] = FrozenFile(path, fh.read())
                except (OSError, SyntaxError, ValueError):
                    continue
        self.entries: dict[tuple, object] = {}     # (namespace, name) -> object
        self.spaces: dict[str, object] = {}        # namespace label -> module or class
        self.funcs: dict[int, tuple] = {}          # id -> (label, func, code, defaults, kwdefaults, cells)
        self.modules: dict[str, object] = {}       # module name -> module object at the snapshot
        self.plugins: dict[int, object] = {}
        self.impls: set[tuple] = set()
        self.hookexec = None
        self.setters: dict[tuple, str] = {}        # (id(obj), name) -> file that set it through MonkeyPatch/audit
        self.reported: set[tuple] = set()
        self.audit_changes: list[Change] = []
        self.items: dict[str, tuple] = {}
        self.constants: dict[tuple, object] = {}   # (file, name) -> expected value
        self.checks = 0
        self.seconds = 0.0  # spent in check(), and in the snapshot
        self.config = None
        self.library_codes: dict[str, dict] = {}
        self._real: dict[str, str] = {}
        self.by_space: dict[str, list] | None = None  # label -> [(name, object)], built at the first check
        self._module_files: dict[str, str | None] = {}
        self._definers: dict[tuple, FrozenFile | None] = {}
        self._home_dirs: dict[str, list[str]] = {}
        self.class_keys: dict[str, tuple] = {}     # label -> (class, its own names, the MRO)
        self.builtin_names = {k for k in vars(builtins) if not k.startswith("__")}

    # -- where code lives ---------------------------------------------------------------------

    def in_tree(self, path: str | None) -> bool:
        if not path:
            return False
        p = os.path.abspath(path)
        return p.startswith(self.root + os.sep) or os.path.realpath(p).startswith(self.real_root + os.sep)

    def is_frozen(self, path: str | None) -> bool:
        return _isinstance(path, str) and bool(path) and self.realpath(path) in self.frozen

    def rel(self, path: str | None) -> str | None:
        if not path:
            return None
        for r in (self.root, self.real_root):
            if os.path.abspath(path).startswith(r + os.sep):
                return os.path.abspath(path)[len(r) + 1:]
        return path

    def setter_file(self) -> str | None:
        """The nearest caller inside the tree (past pytest's monkeypatch, mock and this file)."""
        f = sys._getframe(1)
        while f is not None:
            fn = f.f_code.co_filename
            if self.in_tree(fn):
                return fn
            f = f.f_back
        return None

    # -- the snapshot -------------------------------------------------------------------------

    def snapshot_libraries(self) -> None:
        for name in LIB_MODULES:
            if name not in sys.modules:
                try:
                    __import__(name)
                except Exception:  # noqa: BLE001 - a library the target lacks judges nothing there
                    continue
        self._wrap_monkeypatch()
        t0 = time.perf_counter()
        mods = [m for m in LIB_MODULES if m in sys.modules]
        mods += sorted(m for m in list(sys.modules) if m.split(".")[0] in LIB_PREFIXES)
        for name in mods:
            self._take_module(name, sys.modules[name])
        sys.addaudithook(self._audit)
        self.seconds += time.perf_counter() - t0

    def _take_module(self, name: str, mod) -> None:
        if not _isinstance(mod, types.ModuleType) or name in self.modules:
            return
        self.modules[name] = mod
        self.spaces[name] = mod
        for k, v in list(vars(mod).items()):
            if (name, k) in VOLATILE:
                continue
            self.entries[(name, k)] = v
            self._take_func(f"{name}.{k}", v)
            if _isinstance(v, type) and (v.__module__ or "").split(".")[0] in {m.split(".")[0] for m in
                                                                                 LIB_MODULES + LIB_PREFIXES}:
                self._take_class(v)

    def _take_class(self, cls: type) -> None:
        for klass in cls.__mro__:
            label = f"{klass.__module__}.{klass.__qualname__}"
            if klass is object or label in self.spaces:
                continue
            self.spaces[label] = klass
            self.class_keys[label] = (klass, set(vars(klass)), cls.__mro__)
            for k, v in list(vars(klass).items()):
                if k in ("__dict__", "__weakref__", "__doc__", "__abstractmethods__", "_abc_impl"):
                    continue
                self.entries[(label, k)] = v
                self._take_func(f"{label}.{k}", v)

    def _take_func(self, label: str, v) -> None:
        for f in (v, _unwrap(v)):
            if _isinstance(f, types.FunctionType) and id(f) not in self.funcs:
                self.funcs[id(f)] = (label, f, f.__code__, f.__defaults__, dict(f.__kwdefaults__ or {}),
                                     tuple(_cell(c) for c in (f.__closure__ or ())))

    def _wrap_monkeypatch(self) -> None:
        """Remember which file set an attribute through MonkeyPatch: the frozen files' own patches."""
        try:
            from _pytest.monkeypatch import MonkeyPatch
        except ImportError:
            return
        setattr_, setitem = MonkeyPatch.setattr, MonkeyPatch.setitem
        me = self

        @functools.wraps(setattr_)
        def patched_setattr(mp, target, name=MISSING, value=MISSING, raising=True):
            args = [target] + [a for a in (name, value) if a is not MISSING]
            setattr_(mp, *args, raising=raising)
            if value is MISSING and _isinstance(target, str):  # "pkg.mod.attr", value
                mod, _, attr = target.rpartition(".")
                obj = sys.modules.get(mod)
                key = (id(obj), attr)
            else:
                key = (id(target), name)
            me.setters[key] = me.setter_file() or ""

        @functools.wraps(setitem)
        def patched_setitem(mp, dic, name, value):
            setitem(mp, dic, name, value)
            me.setters[(id(dic), name)] = me.setter_file() or ""

        MonkeyPatch.setattr, MonkeyPatch.setitem = patched_setattr, patched_setitem

    def snapshot_hooks(self, pluginmanager) -> None:
        self.pm = pluginmanager
        for p in pluginmanager.get_plugins():
            self.plugins[id(p)] = p
        for hc in vars(pluginmanager.hook).values():
            for impl in _getattr(hc, "get_hookimpls", lambda: [])():
                self.impls.add((hc.name, id(impl.plugin), impl.function))
        self.hookexec = _getattr(pluginmanager, "_inner_hookexec", None)

    def _audit(self, event: str, args) -> None:
        if event != "object.__setattr__" or len(args) < 2 or args[1] not in ("__code__", "__defaults__",
                                                                               "__kwdefaults__"):
            return
        target = args[0]
        watched = id(target) in self.funcs or self.is_frozen(_getattr(_getattr(target, "__code__", None),
                                                                      "co_filename", None))
        if not watched:
            return
        setter = self.setter_file()
        if self.is_frozen(setter):
            return
        name = f"{_getattr(target, '__module__', '?')}.{_getattr(target, '__qualname__', '?')}.{args[1]}"
        self.audit_changes.append(Change("code-swap", name, self.rel(origin(args[2]) if len(args) > 2 else None),
                                         self.rel(setter)))

    # -- the checks ---------------------------------------------------------------------------

    def _legit(self, obj, key: tuple | None = None) -> bool:
        if self.is_frozen(origin(obj)):
            return True
        return key is not None and self.is_frozen(self.setters.get(key))

    def check(self, config=None, items=None) -> list[Change]:
        """Every change not yet reported; each is reported once."""
        t0 = time.perf_counter()
        try:
            return self._check(config, items)
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self, config, items) -> list[Change]:
        self.checks += 1
        out = list(self.audit_changes)
        self.audit_changes.clear()
        out += self._check_entries()
        out += self._check_funcs()
        out += self._check_frozen(config)
        out += self._check_hooks()
        out += self._check_torch()
        if items is not None:
            out += self._check_items(items, config)
        fresh = []
        for c in out:
            key = (c["route"], c["what"])
            if key not in self.reported:
                self.reported.add(key)
                fresh.append(c)
        return fresh

    def _library_own(self, label: str, old, cur) -> bool:
        """A change a library makes to itself (pytest setting its debugger's config, torch.compile
        wrapping torch.manual_seed): its code, and every function it wraps or closes over, lives in
        that library's own files and is what they compile to; in pytest's namespaces a plain value
        where no code was, too."""
        top = label.split(".")[0]
        if origin(cur) is None:
            return top in RUNNER_PACKAGES and not callable(old) and not _isinstance(old, type)
        homes = self._homes(top)
        seen, todo = set(), [cur]
        while todo:
            f = _unwrap(todo.pop())
            if id(f) in seen:
                continue
            seen.add(id(f))
            code = _getattr(f, "__code__", None)
            if not _isinstance(code, types.CodeType):
                if self.in_tree(origin(f)):
                    return False
                continue
            path = self.realpath(code.co_filename)
            if len(seen) > 20 or self.in_tree(path) or not any(path.startswith(h) for h in homes) \
                    or not self._code_in_file(code):
                return False
            wrapped = _getattr(f, "__dict__", {}).get("__wrapped__")
            todo += [wrapped] if wrapped is not None else []
            todo += [c for c in (_cell(x) for x in (f.__closure__ or ())) if callable(c)]
        return True

    def blame(self, obj) -> str | None:
        """The tree file behind `obj`, looking through what it wraps or closes over (a library's
        decorator around the candidate's function); else where its own code lives."""
        todo, seen = [obj], set()
        while todo and len(seen) < 20:
            f = _unwrap(todo.pop())
            if id(f) in seen:
                continue
            seen.add(id(f))
            if self.in_tree(origin(f)):
                return self.rel(origin(f))
            wrapped = _getattr(f, "__dict__", {}).get("__wrapped__") if _isinstance(f, types.FunctionType) else None
            todo += [wrapped] if wrapped is not None else []
            todo += [c for c in (_cell(x) for x in (_getattr(f, "__closure__", None) or ())) if callable(c)]
        return self.rel(origin(obj))

    def _homes(self, top: str) -> list[str]:
        """The directories of a namespace's own library (pytest's packages count as one)."""
        if top not in self._home_dirs:
            dirs = []
            for t in RUNNER_PACKAGES if top in RUNNER_PACKAGES else (top,):
                f = _getattr(sys.modules.get(t), "__file__", None)
                if _isinstance(f, str):
                    dirs.append(os.path.dirname(os.path.realpath(f)) + os.sep)
            if top in ("builtins", "math", "operator", "functools", "unittest"):
                dirs.append(os.path.dirname(os.path.realpath(os.__file__)) + os.sep)
            self._home_dirs[top] = dirs
        return self._home_dirs[top]

    def _code_in_file(self, code: types.CodeType) -> bool:
        """`code` is compiled from the file it names (a file name can be given to compile())."""
        path = code.co_filename
        if path not in self.library_codes:
            try:
                with open(path, "rb") as fh:
                    self.library_codes[path] = codes(_compile(fh.read(), path, "exec", dont_inherit=True), {})
            except (OSError, SyntaxError, ValueError):
                self.library_codes[path] = {}
        q = _getattr(code, "co_qualname", code.co_name)
        return any(same_code(code, c) for c in self.library_codes[path].get(q, []))

    def _check_entries(self) -> list[Change]:
        out = []
        if self.by_space is None:
            self.by_space = {}
            for (label, name), old in self.entries.items():
                self.by_space.setdefault(label, []).append((name, old))
        changed = []
        for label, pairs in self.by_space.items():
            ns = vars(self.spaces[label])
            changed += [(label, name, old, ns.get(name, MISSING)) for name, old in pairs
                        if ns.get(name, MISSING) is not old]
        for label, name, old, cur in changed:
            space = self.spaces[label]
            if cur is not MISSING and (self._legit(cur, (id(space), name)) or self._library_own(label, old, cur)):
                continue
            what = f"{label}.{name}" + (" deleted" if cur is MISSING else "")
            out.append(Change("rebind", what, self.blame(cur) if cur is not MISSING else None,
                              self.rel(self.setters.get((id(space), name)))))
        for label, (klass, keys, mro) in self.class_keys.items():
            own = vars(klass)
            if len(own) == len(keys) and own.keys() == keys:
                continue
            for name in set(own) - keys:  # a new name that hides a base class's method
                cur = own[name]
                if name in MATERIALIZED and _isinstance(cur, dict) and not cur:
                    continue
                if any(name in vars(b) for b in mro[mro.index(klass) + 1:] if b is not object) \
                        and not self._legit(cur, (id(klass), name)) and not self._library_own(label, None, cur):
                    out.append(Change("rebind", f"{label}.{name} (over its base class's)", self.blame(cur),
                                      self.rel(self.setters.get((id(klass), name)))))
        return out

    def _check_funcs(self) -> list[Change]:
        out = []
        for label, f, code, defaults, kwdefaults, cells in self.funcs.values():
            if f.__code__ is not code:
                if not self.is_frozen(f.__code__.co_filename):
                    out.append(Change("code-swap", f"{label}.__code__", self.rel(f.__code__.co_filename)))
            elif f.__defaults__ is not defaults or dict(f.__kwdefaults__ or {}) != kwdefaults:
                out.append(Change("code-swap", f"{label} defaults", None))
            elif tuple(_cell(c) for c in (f.__closure__ or ())) != cells:
                changed = [c for c, old in zip(f.__closure__ or (), cells, strict=False) if _cell(c) is not old]
                if not all(self._legit(_cell(c)) for c in changed):
                    out.append(Change("code-swap", f"{label} closure",
                                      self.rel(origin(_cell(changed[0]))) if changed else None))
        return out

    def realpath(self, path: str) -> str:
        """os.path.realpath, remembered: every check resolves every module's file."""
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return real

    def _frozen_modules(self) -> list[tuple[str, object, FrozenFile]]:
        out = []
        for name, mod in list(sys.modules.items()):
            f = _getattr(mod, "__file__", None) if _isinstance(mod, types.ModuleType) else None
            if _isinstance(f, str) and self.realpath(f) in self.frozen:
                out.append((name, mod, self.frozen[self.realpath(f)]))
        return out

    def _check_frozen(self, config) -> list[Change]:
        out = []
        seen = set()
        for name, mod, ff in self._frozen_modules():
            seen.add(ff.path)
            out += self._check_module(name, mod, ff, config)
        out += self._check_sys_modules()
        return out

    def _module_file(self, modname: str) -> str | None:
        """The frozen file a module name resolves to in the tree, without asking sys.modules."""
        if modname not in self._module_files:
            self._module_files[modname] = self._find_module_file(modname)
        return self._module_files[modname]

    def _find_module_file(self, modname: str) -> str | None:
        parts = modname.split(".")
        for cand in (os.path.join(self.real_root, *parts) + ".py",
                     os.path.join(self.real_root, *parts, "__init__.py")):
            if cand in self.frozen:
                return cand
        for rp in self.frozen:  # test dirs that pytest imports by their own rootdir-relative name
            if rp.endswith(os.sep + os.path.join(*parts) + ".py") and len(parts) == 1:
                return rp
        return None

    def _check_sys_modules(self) -> list[Change]:
        out = []
        for name, mod in list(sys.modules.items()):
            f = self._module_file(name) if "." in name else None
            if f is None or mod is None:
                continue
            live = _getattr(mod, "__file__", None)
            if not _isinstance(live, str) or self.realpath(live) != f:
                out.append(Change("sys-modules", f"sys.modules[{name!r}]", self.rel(origin(mod) or live)))
        return out

    def _check_module(self, name: str, mod, ff: FrozenFile, config) -> list[Change]:
        out = []
        ns = vars(mod)
        variants = ff.compiled(config)
        rel = self.rel(ff.path)
        for d in ff.defs:
            live = ns.get(d, MISSING)
            if live is MISSING:
                out.append(Change("frozen-code", f"{rel}: {d} deleted", None))
                continue
            bad = self._code_differs(live, d, variants)
            if bad:
                out.append(Change("frozen-code", f"{rel}: {bad}", self.rel(origin(live))))
        for const, node in ff.constants.items():
            key = (ff.path, const)
            if key not in self.constants:
                try:
                    self.constants[key] = self._eval(node, ff)
                except Unknown:
                    self.constants[key] = MISSING
            want = self.constants[key]
            if want is MISSING:
                continue
            live = ns.get(const, MISSING)
            try:
                same = type(live) is type(want) and live == want
            except Exception:  # noqa: BLE001 - a value that cannot be compared is not the constant
                same = False
            if not same and not (key[1] and self.is_frozen(self.setters.get((id(mod), const)))):
                out.append(Change("frozen-value", f"{rel}: {const} = {_short(live)}, the file says {_short(want)}",
                                  self.rel(self.setters.get((id(mod), const)))))
        bound = ff.bound
        for k in [k for k in ns if k in self.builtin_names and k not in bound]:
            if not self._legit(ns[k], (id(mod), k)):
                out.append(Change("rebind", f"{rel}: builtin {k} shadowed", self.rel(origin(ns[k]))))
        pkg = name if hasattr(mod, "__path__") else name.rpartition(".")[0]
        for local, src, attr in ff.imports:
            out += self._check_import(rel, pkg, ns, local, src, attr, config)
        return out

    def _code_differs(self, live, qualname: str, variants: list[dict]) -> str | None:
        """What of `live` (a function or class of a frozen file) is not the file's code, or None."""
        f = _unwrap(live, through=lambda w: not self.in_tree(w.__code__.co_filename))
        if _isinstance(f, types.FunctionType):
            q = _getattr(f.__code__, "co_qualname", f.__name__)
            if q != qualname or not any(any(same_code(f.__code__, c) for c in v.get(q, [])) for v in variants):
                return f"{qualname} is not the code of the file"
            return None
        if _isinstance(f, type):
            if f.__qualname__ != qualname:
                return f"{qualname} is another class ({f.__module__}.{f.__qualname__})"
            for k, v in vars(f).items():
                g = _unwrap(v)
                if _isinstance(g, types.FunctionType):
                    q = _getattr(g.__code__, "co_qualname", "")
                    if not any(any(same_code(g.__code__, c) for c in var.get(q, [])) for var in variants):
                        return f"{qualname}.{k} is not the code of the file"
            return None
        # a decorator's object that keeps no function (a C wrapper): where its code lives
        return None if not self.in_tree(origin(f)) or self.is_frozen(origin(f)) else \
            f"{qualname} is an object of {self.rel(origin(f))}"

    @staticmethod
    def _resolve(pkg: str, src: str) -> str:
        """An import's absolute module name; `pkg` is the importing module's package."""
        if not src.startswith("."):
            return src
        level = len(src) - len(src.lstrip("."))
        base = pkg.rsplit(".", level - 1)[0] if level > 1 else pkg
        rest = src[level:]
        return f"{base}.{rest}" if rest else base

    def _check_import(self, rel, pkg, ns, local, src, attr, config) -> list[Change]:
        src = self._resolve(pkg, src)
        live = ns.get(local, MISSING)
        if live is MISSING:
            return []
        path = self._module_file(src)
        if path is not None:
            ff = self.frozen[path]
            if attr is None:
                f = _getattr(live, "__file__", None)
                if not f or os.path.realpath(f) != path:
                    return [Change("import-swap", f"{rel}: {local} is not the module {src}", self.rel(origin(live)))]
                return []
            if attr in ff.defs:
                bad = self._code_differs(live, attr, ff.compiled(config))
                return [Change("import-swap", f"{rel}: {local} (from {src}) {bad}", self.rel(origin(live)))] \
                    if bad else []
            owner = sys.modules.get(src)
            if owner is None or _getattr(owner, "__file__", None) is None or \
                    os.path.realpath(owner.__file__) != path or vars(owner).get(attr, MISSING) is not live:
                if not self._legit(live):
                    return [Change("import-swap", f"{rel}: {local} is not {src}.{attr}", self.rel(origin(live)))]
            return []
        definer = self._defined_under(src, attr) if attr else None
        if definer is not None:  # a frozen reference re-exported by a package the candidate may edit
            bad = self._code_differs(live, attr, definer.compiled(config))
            return [Change("import-swap", f"{rel}: {local} (from {src}) {bad}", self.rel(origin(live)))] \
                if bad else []
        if src in self.modules:
            want = self.modules[src] if attr is None else self.entries.get((src, attr), MISSING)
            if attr is None and src.split(".")[0] != src:
                return []
            if want is not MISSING and live is not want and not self._legit(live):
                what = f"{rel}: {local} is not {src}" + (f".{attr}" if attr else "")
                return [Change("import-swap", what, self.rel(origin(live)))]
        return []

    def _defined_under(self, package: str, name: str) -> FrozenFile | None:
        """The one frozen file inside `package`'s directory that defines `name` (FLA's tests import
        their reference, `fused_recurrent_*`, from the op's package), or None."""
        key = (package, name)
        if key not in self._definers:
            d = os.path.join(self.real_root, *package.split(".")) + os.sep
            found = [ff for p, ff in self.frozen.items() if p.startswith(d) and name in ff.defs]
            self._definers[key] = found[0] if len(found) == 1 else None
        return self._definers[key]

    def _eval(self, node, ff: FrozenFile):
        """A frozen constant's value from its source (`flaloop_gate_frozen.evaluate`): names of the
        snapshot's modules and their attributes, the file's constants known so far, the
        environment as it stood at load."""

        def name(n: str):
            for local, src, attr in ff.imports:
                if local == n and attr is None and src in self.modules:
                    return self.modules[src]
                if local == n and attr is not None and (src, attr) in self.entries:
                    return self.entries[(src, attr)]
            if self.constants.get((ff.path, n), MISSING) is not MISSING:
                return self.constants[(ff.path, n)]
            raise Unknown(n)

        def attribute(base, attr: str):
            label = next((k for k, m in self.modules.items() if m is base), None)
            if label and (label, attr) in self.entries:
                return self.entries[(label, attr)]
            raise Unknown(attr)

        return evaluate(node, name, attribute, self.env)

    def _check_hooks(self) -> list[Change]:
        pm = _getattr(self, "pm", None)
        if pm is None:
            return []
        out = []
        for p in pm.get_plugins():
            if id(p) in self.plugins:
                continue
            f = origin(p) if not _isinstance(p, types.ModuleType) else _getattr(p, "__file__", None)
            if self.in_tree(f) and not self.is_frozen(f):
                out.append(Change("report-hook", f"plugin {pm.get_name(p)!r} registered", self.rel(f)))
        present = set()
        for hc in list(vars(pm.hook).values()):
            get = _getattr(hc, "get_hookimpls", None)
            if get is None:
                continue
            for impl in get():
                key = (hc.name, id(impl.plugin), impl.function)
                present.add(key)
                if key in self.impls:
                    continue
                f = origin(impl.function)
                if (self.in_tree(f) and not self.is_frozen(f)) or f is None:
                    kind = "hookwrapper" if impl.hookwrapper or _getattr(impl, "wrapper", False) else "hook"
                    out.append(Change("report-hook", f"{kind} {hc.name} added", self.rel(f)))
        for name, pid, func in self.impls:
            if (name, pid, func) not in present and any(id(p) == pid for p in pm.get_plugins()):
                out.append(Change("report-hook", f"hook {name} of a plugin removed", None))
        if _getattr(pm, "_inner_hookexec", None) is not self.hookexec:
            out.append(Change("report-hook", "pluggy's hook caller replaced",
                              self.rel(origin(_getattr(pm, "_inner_hookexec", None)))))
        return out

    def _check_torch(self) -> list[Change]:
        out = []
        torch = self.modules.get("torch")
        if torch is not None:
            C = _getattr(torch, "_C", None)
            for fn, what in (("_len_torch_function_stack", "a torch function mode"),
                             ("_len_torch_dispatch_stack", "a torch dispatch mode")):
                n = _getattr(C, fn, None)
                try:
                    if n is not None and n() > 0:
                        out.append(Change("torch-mode", f"{what} is on the stack", None))
                except Exception:  # noqa: BLE001 - this torch cannot tell
                    pass
        for get, what in ((sys.gettrace, "sys.settrace"), (sys.getprofile, "sys.setprofile")):
            t = get()
            f = origin(t) if t is not None else None
            if t is not None and self.in_tree(f) and not self.is_frozen(f):
                out.append(Change("torch-mode", f"{what} function set", self.rel(f)))
        return out

    def remember_items(self, items) -> None:
        for item in items:
            cs = _getattr(item, "callspec", None)
            self.items[item.nodeid] = (_getattr(item, "obj", None), repr(sorted((cs.params if cs else {}).items())))

    def _check_items(self, items, config) -> list[Change]:
        out = []
        for item in items:
            old = self.items.get(item.nodeid)
            if old is None:
                continue
            cs = _getattr(item, "callspec", None)
            if repr(sorted((cs.params if cs else {}).items())) != old[1]:
                out.append(Change("test-item", f"{item.nodeid}: parameters changed", None))
            if "runtest" in vars(item) or _getattr(item, "obj", None) is not old[0]:
                live = vars(item).get("runtest", _getattr(item, "obj", None))
                out.append(Change("test-item", f"{item.nodeid}: the function run changed", self.rel(origin(live))))
            for fdefs in (_getattr(_getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}).values():
                for fd in fdefs:
                    f = origin(fd.func)
                    if self.is_frozen(f):
                        ff = self.frozen[os.path.realpath(f)]
                        q = _getattr(_unwrap(fd.func), "__qualname__", "")
                        if self._code_differs(fd.func, q, ff.compiled(config)):
                            out.append(Change("test-item", f"fixture {fd.argname} is not the code of its file",
                                              self.rel(f)))
                    elif self.in_tree(f):
                        out.append(Change("test-item", f"fixture {fd.argname} comes from the tree", self.rel(f)))
        return out


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:
        return MISSING


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."
