"""Timing integrity: what the timing path reaches, fixed before the target's code runs.

A candidate that wraps `torch.cuda.Event.elapsed_time` in its package `__init__` read FASTER
1.25x on an H200 before this existed. Two defences, both set up before the target is imported:

* the worker's timers call function objects bound at import of `timing.py` (never looked up
  again), so a later patch of a module or class attribute does not reach them;
* `Watch` records the identity of every callable attribute of the modules and classes the timing
  path and the reply encoder reach (torch, torch._C, torch.cuda and its Event/Stream/CUDAGraph,
  torch.Tensor, time, json, math, builtins, and the worker's own modules and classes), and of each
  Python function's code object. `check()` names every attribute replaced, removed or (on
  classes) added since. The worker checks after the import, after every setup and around every
  sample; a violation is sticky and rides on every later reply. The session blocks the run when
  the candidate shows a violation the base does not.

Plain data attributes (flags, counters, caches) are not watched: they change legitimately (torch
flips `torch.cuda._initialized`), and the numeric ones are compared across sides by the probes.
"""

from __future__ import annotations

import builtins
import json
import json.encoder
import math
import sys
import time
import types

_FUNC = (types.FunctionType,)


def _watchable(v) -> bool:
    return callable(v) or isinstance(v, (type, types.ModuleType))


def _code_of(v):
    return getattr(v, '__code__', None) if isinstance(v, _FUNC) else None


def _where(v) -> str:
    """Where a replacement object was defined, for the message."""
    f = getattr(getattr(v, '__code__', None), 'co_filename', None)
    if f is None:
        mod = getattr(v, '__module__', None)
        f = getattr(sys.modules.get(mod or ''), '__file__', None) if mod else None
    return f' (now defined in {f})' if f else ''


class Watch:
    def __init__(self):
        self._attrs: list[tuple[str, object, str, object, object]] = []  # (key, owner, attr, object, code)
        self._class_keys: dict[str, tuple[type, frozenset]] = {}
        self._targets: list[tuple[str, object, bool]] = []
        self.violations: list[str] = []

    def take(self, modules, classes) -> Watch:
        for m in modules:
            if m is not None:
                self._targets.append((m.__name__, m, False))
        seen = set()
        for c in classes:
            for k in c.__mro__:
                if k is object or k in seen or not hasattr(k, '__dict__') or k.__module__ == 'builtins':
                    continue
                seen.add(k)
                self._targets.append((f'{k.__module__}.{k.__qualname__}', k, True))
        for name, obj, is_class in self._targets:
            items = list(vars(obj).items())
            if is_class:
                self._class_keys[name] = (obj, frozenset(vars(obj)))
            for attr, v in items:
                if _watchable(v):
                    # keep the objects themselves: their ids then cannot be reused
                    self._attrs.append((f'{name}.{attr}', obj, attr, v, _code_of(v)))
        return self

    def check(self) -> list[str]:
        """New violations since the last check (all of them are kept in `violations`)."""
        found = []
        for name, obj, is_class in self._targets:
            ns = vars(obj)
            prefix = name + '.'
            if is_class:
                _, keys = self._class_keys[name]
                for attr in ns.keys() - keys:
                    if _watchable(ns[attr]):
                        found.append(f'{prefix}{attr} was added{_where(ns[attr])}')
        for key, obj, attr, v, code in self._attrs:
            now = vars(obj).get(attr, _MISSING)
            if now is _MISSING:
                found.append(f'{key} was removed')
            elif now is not v:
                found.append(f'{key} was replaced{_where(now)}')
            elif code is not None and getattr(v, '__code__', None) is not code:
                found.append(f'{key} had its code replaced{_where(v)}')
        new = [f for f in found if f not in self.violations]
        self.violations.extend(new)
        return new

    def __len__(self) -> int:
        return len(self._attrs)


_MISSING = object()


def default_watch(own_modules, own_classes) -> Watch:
    """The watch the worker takes right after importing torch, before the registry and the op."""
    import torch.cuda.graphs
    import torch.cuda.streams

    modules = [builtins, time, json, json.encoder, math, torch, torch._C, torch.cuda, torch.cuda.streams,
               torch.cuda.graphs, *own_modules]
    classes = [torch.Tensor, torch.cuda.Event, torch.cuda.Stream, torch.cuda.CUDAGraph,
               json.encoder.JSONEncoder, *own_classes]
    return Watch().take(modules, classes)
