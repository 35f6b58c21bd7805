"""What Triton's autotuners chose. Imports nothing: it reads modules already loaded."""

from __future__ import annotations

import sys


def _autotuners() -> dict:
    """Every Triton autotuner the loaded code defines at module level, by qualified name.

    Decorators nest (``@triton.heuristics`` over ``@triton.autotune``, ...): each module global is
    followed down its ``.fn`` chain to the Autotuner, if any.  Triton's own modules and torch's
    are skipped; nothing is imported here that was not loaded already.
    """
    at_mod = sys.modules.get('triton.runtime.autotuner')
    Autotuner = getattr(at_mod, 'Autotuner', None)
    KernelInterface = getattr(sys.modules.get('triton.runtime.jit'), 'KernelInterface', None)
    if Autotuner is None or KernelInterface is None:
        return {}
    found = {}
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.split('.')[0] in ('triton', 'torch', '_flaloop_worker'):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, obj in items:
            # Only Triton's own wrappers are followed: getattr on an arbitrary global (a lazy
            # module, a proxy) can import things or raise.
            o = obj
            try:
                for _ in range(6):
                    if isinstance(o, Autotuner):
                        found.setdefault(f'{modname}.{attr}', o)
                        break
                    if not isinstance(o, KernelInterface):
                        break
                    o = getattr(o, 'fn', None)
            except Exception:
                continue
    return found


def tuning_snapshot() -> dict:
    """{kernel: {tuning key: chosen config}} for every autotuner that has chosen something."""
    snap = {}
    for name, tuner in _autotuners().items():
        cache = getattr(tuner, 'cache', None) or {}
        if cache:
            snap[name] = {repr(key): str(cfg) for key, cfg in list(cache.items())}
    return snap


def tuning_added(before: dict, after: dict) -> dict:
    """The (kernel, key) choices present in `after` but not in `before`."""
    out = {}
    for name, choices in after.items():
        new = {k: v for k, v in choices.items() if k not in before.get(name, {})}
        if new:
            out[name] = new
    return out


def triton_version() -> str | None:
    mod = sys.modules.get('triton')
    v = getattr(mod, '__version__', None) if mod is not None else None
    if v:
        return str(v)
    try:
        from importlib.metadata import version
        return version('triton')
    except Exception:
        return None


def dist_version(dist: str) -> str | None:
    """Installed version of a distribution, read from its metadata (never imported)."""
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None
