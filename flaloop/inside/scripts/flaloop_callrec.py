"""pytest plugin loaded into the gate's pytest at the base (`-p flaloop_callrec`); never imports flaloop.

It records every call the frozen test makes into the op's package: which function
(module:qualname) and the arguments' structure (tensors: shape, dtype, requires_grad, never
values; other values when JSON-able), deduplicated with counts. Only the outermost call counts, and only
one made from outside the package: what the package calls of itself is not the test's call. A call
that returns no tensor (a helper, an assert_close of the package's) is left out: a replay would
have nothing to compare. The bench replays a sample of them, base
against candidate in separate processes (flaloop/bench/replay.py), so a judge loosened inside the
test process cannot carry a wrong kernel past the bench.

Armed by FLALOOP_CALLREC_DIR (a directory: each process, xdist workers too, writes
calls-<pid>.json there at the end) and FLALOOP_GATE_PACKAGE (the op's top-level package).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import types

import pytest

MAX_SEQ = 64  # a longer list or tuple is recorded as opaque: a replay could not build it sensibly
_state = threading.local()
_calls: dict[str, int] = {}
_wrapped: dict[int, object] = {}  # id(original) -> wrapper
_originals: set[int] = set()


def _package() -> str:
    return os.environ.get("FLALOOP_GATE_PACKAGE", "")


def _in_package(modname) -> bool:
    pkg = _package()
    return isinstance(modname, str) and bool(pkg) and (modname == pkg or modname.startswith(pkg + "."))


def spec_of(x):
    """The argument's structure: tensors by shape, dtype and requires_grad; JSON values as such."""
    if x is None or isinstance(x, (bool, str)):
        return {"value": x}
    if isinstance(x, int):
        return {"value": int(x)}
    if isinstance(x, float):
        return {"value": x} if math.isfinite(x) else {"opaque": "float"}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return {"tensor": {"shape": [int(n) for n in x.shape], "dtype": str(x.dtype).replace("torch.", ""),
                           "requires_grad": bool(x.requires_grad)}}
    if isinstance(x, (list, tuple)) and len(x) <= MAX_SEQ:
        return {"seq": [spec_of(y) for y in x], "kind": "tuple" if isinstance(x, tuple) else "list"}
    return {"opaque": type(x).__name__}


def _has_tensor(x, depth: int = 0) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)) and depth < 2:
        return any(_has_tensor(y, depth + 1) for y in x)
    return False


def _record(fn, args, kwargs) -> str | None:
    try:
        return json.dumps({"fn": f"{fn.__module__}:{fn.__qualname__}", "args": [spec_of(a) for a in args],
                           "kwargs": {k: spec_of(v) for k, v in kwargs.items()}}, sort_keys=True)
    except Exception:  # noqa: BLE001 - recording never changes what the test does
        return None


def _wrap(fn):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if _compiling():  # inside torch.compile's trace: nothing it cannot trace (fullgraph=True fails on it)
            return fn(*args, **kwargs)
        depth = getattr(_state, "depth", 0)
        # the package calling itself is no test call: from inside an outer call (depth), or from
        # code autograd runs later (a backward the package defines calls its own kernels' launcher)
        key = _record(fn, args, kwargs) if depth == 0 and not _in_package(
            sys._getframe(1).f_globals.get("__name__")) else None
        _state.depth = depth + 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _state.depth = depth
        # a call that returns no tensor (a helper, the test's own judge) has nothing to compare
        if key is not None and _has_tensor(out):
            _calls[key] = _calls.get(key, 0) + 1
        return out

    recorded.__flaloop_recorded__ = True
    return recorded


def _patch_module(mod) -> None:
    """Every plain function of the package this module binds, replaced by its recording wrapper."""
    try:
        items = list(vars(mod).items())
    except TypeError:
        return
    for name, value in items:
        if not isinstance(value, types.FunctionType) or getattr(value, "__flaloop_recorded__", False):
            continue
        if not _in_package(getattr(value, "__module__", None)):
            continue
        wrapper = _wrapped.get(id(value))
        if wrapper is None:
            wrapper = _wrapped[id(value)] = _wrap(value)
            _originals.add(id(value))
        try:
            setattr(mod, name, wrapper)
        except (AttributeError, TypeError):
            continue


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


_seen_modules = [0]


def _patch(test_modules) -> None:
    if len(sys.modules) == _seen_modules[0]:  # no module imported since the last pass
        return
    _seen_modules[0] = len(sys.modules)
    for name, mod in list(sys.modules.items()):
        if _in_package(name) and mod is not None:
            _patch_module(mod)
    for mod in test_modules:
        _patch_module(mod)


def _test_modules(session) -> list:
    mods = []
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and mod not in mods:
            mods.append(mod)
    return mods


def _armed() -> bool:
    return bool(os.environ.get("FLALOOP_CALLREC_DIR")) and bool(_package())


def pytest_collection_finish(session):
    if _armed():
        session.config._flaloop_callrec_mods = _test_modules(session)
        _patch(session.config._flaloop_callrec_mods)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # a package module a test imported late binds the original functions: patched before each test
    if _armed():
        _patch(getattr(item.config, "_flaloop_callrec_mods", []))


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("FLALOOP_CALLREC_DIR")
    if not _armed() or not _calls:
        return
    calls = []
    for key, count in _calls.items():
        c = json.loads(key)
        calls.append({"fn": c["fn"], "count": count, "args": c["args"], "kwargs": c["kwargs"]})
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"calls-{os.getpid()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"schema": 1, "package": _package(), "calls": calls}, fh)
    os.replace(path + ".tmp", path)
