"""The wire: one JSON object per line on stdin, one JSON reply per line on a private copy of stdout.

Request: ``{"cmd": NAME, "id": ANY (optional, echoed), ...}``.
Reply:   ``{"ok": true, "cmd": NAME, "id": ..., ...}`` or
         ``{"ok": false, "cmd": NAME, "id": ..., "error": "short message", "traceback": "..."}``;
         an error that means "this cell cannot run here" starts with ``"skip:"`` (and ``"skip": true``);
         one the op's own code raised at the cell's first calls has ``"refused": true`` and ``"where"``.
Floats that are NaN or infinite are sent as ``null`` (strict JSON). EOF on stdin or ``quit``
exits 0. An exception in one command never kills the worker.

The real stdout is reserved for replies (``__main__`` duplicates its fd before anything else
runs and points fd 1 and ``sys.stdout`` at stderr), so prints from the op, Triton or CUDA cannot
corrupt the stream. The orchestrator must drain stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

from .backends import backend_snapshot

# Bound before the target is imported: the replies carry the times, so the encoder that writes
# them is part of the timing path (integrity.py also watches the json modules).
_dumps = json.dumps
_loads = json.loads


class Skip(Exception):
    """The cell cannot run for this op (constraint, no backward, no varlen): reply error 'skip: ...'."""


class OpRefused(Exception):
    """The op's own code refused the cell at its first calls: a `raise` or `assert` statement in the
    target's tree (FLA: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for
    gated chunk_bwd_dqkwg"), not a fault, a compile error or a flaloop bug. `where` is file:line."""

    def __init__(self, msg: str, where: str):
        super().__init__(msg)
        self.where = where


def refusal(exc: BaseException, tree: str) -> OpRefused | None:
    """`exc` as an OpRefused when the statement that raised it is a `raise` or `assert` in a file
    under `tree`; None otherwise. Judged on the innermost frame and its source line: an error torch
    or Triton raise from inside a call the op's code makes (a CUDA fault, out of memory, a shape
    mismatch) has a call, not a `raise`, on that line, and one raised in a library has its frame
    outside the tree."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or isinstance(exc, MemoryError) or 'out of memory' in str(exc).lower():
        return None
    last = frames[-1]
    path = os.path.realpath(last.filename)
    root = os.path.realpath(tree) + os.sep
    line = (last.line or '').strip()
    if not path.startswith(root) or not (line.startswith('raise') or line.startswith('assert')):
        return None
    return OpRefused(short_error(exc), f'{path[len(root):]}:{last.lineno}')


class InitError(Exception):
    """The worker could not import its registry/op; every command but quit answers with this."""

    def __init__(self, msg: str, tb: str):
        super().__init__(msg)
        self.tb = tb


def jsonable(obj):
    """Strict-JSON copy of obj: NaN/inf floats -> None, tuples -> lists, unknown -> str."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    try:  # numpy / torch scalars
        return jsonable(obj.item())
    except Exception:
        return str(obj)


def send(out, obj) -> None:
    out.write(_dumps(jsonable(obj), allow_nan=False, separators=(',', ':')) + '\n')
    out.flush()


def short_error(exc: BaseException, limit: int = 1000) -> str:
    msg = f'{type(exc).__name__}: {exc}'
    return msg if len(msg) <= limit else msg[: limit - 3] + '...'


def _exit_now() -> None:
    """Leave without the interpreter's finalization: a worker has nothing left to save. Closing a
    pair sat in 3.3-3.8 s gaps between rounds of the H200 timeline (2026-11-30), on the critical path
    of every bench; finalizing torch, Triton and a CUDA context is the likely bulk of it (not yet
    timed alone). The driver frees the context on exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing to do about a closed stream now
            pass
    os._exit(0)


def _backends() -> dict:
    """What the target's backend registries served or declined up to a failure (a refusal that says
    "install X" where X is installed and declined the call reads otherwise with this beside it)."""
    try:
        return backend_snapshot()
    except Exception:
        return {}


def serve(worker, stdin, proto) -> int:
    """Answer requests until EOF or quit; `worker.handle(cmd, req)` does the work."""
    while True:
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        rid = cmd = None
        try:
            req = _loads(line)
            if not isinstance(req, dict):
                raise ValueError('request is not a JSON object')
            rid, cmd = req.get('id'), req.get('cmd')
        except Exception as e:
            send(proto, {'ok': False, 'error': f'bad request: {short_error(e)}', 'traceback': ''})
            continue
        if cmd == 'quit':
            send(proto, {'ok': True, 'cmd': 'quit', 'id': rid})
            _exit_now()
        try:
            reply = {'ok': True, **worker.handle(cmd, req)}
        except Skip as e:
            reply = {'ok': False, 'skip': True, 'error': f'skip: {e}', 'traceback': traceback.format_exc()}
        except OpRefused as e:
            reply = {'ok': False, 'refused': True, 'where': e.where, 'error': str(e), 'traceback': traceback.format_exc(),
                     'backends': _backends()}
        except InitError as e:
            reply = {'ok': False, 'error': str(e), 'traceback': e.tb}
        except Exception as e:
            reply = {'ok': False, 'error': short_error(e), 'traceback': traceback.format_exc(), 'backends': _backends()}
            worker.log(f'[flaloop worker] {cmd!r} failed:\n{reply["traceback"]}')
            worker.after_error()
        reply['cmd'] = cmd
        reply['id'] = rid
        reply.update(worker.stamp())
        send(proto, reply)
