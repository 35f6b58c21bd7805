"""Which backend served the op's calls, where the target dispatches between backends (FLA's
`fla.ops.backends`: per operation a registry of backends, each tried in priority order with its
verifier, the op's own code when none takes the call). Imports nothing: it reads modules already
loaded, as tuning.py does.

FLA's registry remembers, per process, each (operation, function, backend) that served a call or
whose verifier rejected one (`BackendRegistry._logged`, keys `op:func:backend` and
`op:func:backend:fail`); a fresh worker process starts with none. So the snapshot taken after a
cell's setup is what served every call of this process so far, and the base's and the candidate's,
taken after the same cells in the same order, are comparable. What it cannot see: a function that
no backend took (the op's own code ran) leaves no key, which is why the registered backends are
listed too. The two sides' snapshots are compared on the orchestrator's side
(guard/dynamic.backend_differences). `served_within` says what served the calls of one block
alone (the warm-up's unseen shapes: did they run the backend the cells ran?).
"""

from __future__ import annotations

import contextlib
import sys


def _registries() -> dict:
    """Every backend registry of the loaded code: {operation: registry}, found through a module
    global named `BackendRegistry` whose `_registries` is a dict (FLA's shape; duck-typed)."""
    found: dict = {}
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.split('.')[0] in ('torch', 'triton', '_flaloop_worker'):
            continue
        try:  # not every entry of sys.modules is a plain module: one may raise on any attribute
            cls = vars(mod).get('BackendRegistry')
            regs = vars(cls).get('_registries') if isinstance(cls, type) else None
        except Exception:
            continue
        if isinstance(regs, dict):
            for op, reg in list(regs.items()):
                found.setdefault(str(op), reg)
    return found


def backend_snapshot() -> dict:
    """{operation: {"registered": {backend type: the environment variable that switches it, or
    None}, "served": ["func -> backend"], "rejected": ["func -> backend"]}} for every registry that
    has backends; {} when the target has none."""
    out = {}
    for op, reg in sorted(_registries().items()):
        try:
            registered = {str(t): (str(getattr(b, 'env_var', None)) if getattr(b, 'env_var', None) else None)
                          for t, b in dict(getattr(reg, '_backends', None) or {}).items()}
            logged = sorted(str(k) for k in (getattr(reg, '_logged', None) or ()))
        except Exception:
            continue
        served, rejected = [], []
        for key in logged:
            parts = key.split(':')
            if len(parts) >= 3 and parts[0] == op:
                (rejected if parts[-1] == 'fail' else served).append(f'{parts[1]} -> {parts[2]}')
        if registered or served:
            out[op] = {'registered': registered, 'served': served, 'rejected': rejected}
    return out


@contextlib.contextmanager
def served_within():
    """A snapshot, filled in on leaving the block, of what served (or rejected) the calls made inside
    it alone. FLA logs each (function, backend) once a process, so the registries' logs are emptied
    for the block and given back their earlier keys after it (the process-wide snapshot is unchanged)."""
    saved = {}
    for op, reg in _registries().items():
        log = getattr(reg, '_logged', None)
        if isinstance(log, set):
            saved[op] = (log, set(log))
            log.clear()
    got: dict = {}
    try:
        yield got
    finally:
        got.update(backend_snapshot())
        for log, keys in saved.values():
            log.update(keys)
