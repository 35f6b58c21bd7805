"""The fork server: imports torch and the target's third-party libraries once, then forks workers.

Importing FLA costs 16-19 s per process on the H200 machine, most of it in torch, torch._dynamo
and transformers, none of it the tree under test. A run needs several fresh processes (the
warm-up pair, one pair per round), and a loop runs dozens of benches, so a server imports those
libraries once and forks a child per worker; each child then imports the registry and the op
from its own tree, as a spawned worker would. Nothing of either tree is imported here, and CUDA
is never initialised here (a forked child could not use it): `PYTORCH_NVML_BASED_CUDA_CHECK=1`
keeps `torch.cuda.is_available()` in preloaded libraries from initialising the driver.

The server outlives the run that started it (flaloop/bench/forkservers.py starts it detached and
keys its socket by everything its imports depend on): it listens on a Unix SOCK_SEQPACKET socket
at PATH, serves any number of connections in one thread (a fork with a thread running is unsafe,
so there is none), and exits after IDLE seconds without a connection, when its socket file is
removed or replaced, on `exit`, or when a file of a module it imported changed on disk (checked
at every connection: a stale library is never forked).

Wire: one JSON message a request; a spawn request also carries three fds (stdin, stdout, stderr
of the child) by SCM_RIGHTS. On connect the server first sends its greeting:
  {"ok": true, "pid": N, "key": KEY, "preload": {...}, "cuda_initialized": false, "tops": [...]}  (or ok false)
      (tops: the top-level names of the modules it holds, which a forked child finds imported)
  {"cmd": "spawn", "argv": [...], "cwd": DIR, "env": {...}} -> {"ok": true, "pid": N} or {"ok": false, "error": ...}
      (env is the child's whole environment; argv `--pytest ARGS...` makes the child the gate's
      `python -m pytest ARGS...` (run_pytest), `--script PATH ARGS...` a `python PATH ARGS...`
      (run_script: the op query), any other argv a benchmark worker)
  {"cmd": "status", "pid": N} -> {"ok": true, "returncode": int | null}   (null: still running)
  {"cmd": "exit"} -> {"ok": true}, then the server exits
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import socket
import sys
import threading
import time

MAX_MSG = 1 << 20
KEEP_EXITS = 4096
FORKED_WITH: frozenset = frozenset()  # in a forked child: the modules it was forked with


def _reap(exits: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)
        while len(exits) > KEEP_EXITS:
            exits.pop(next(iter(exits)))


def preload(names: list[str]) -> dict:
    t0 = time.perf_counter()
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - a library that fails to import alone is skipped
            failed[name] = f'{type(e).__name__}: {e}'[:200]
    return {'seconds': round(time.perf_counter() - t0, 3), 'failed': failed, 'n': len(names)}


def _stamps() -> dict[str, tuple[int, int]]:
    """mtime and size of every file a loaded module came from."""
    out = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, '__file__', None)
        if isinstance(f, str) and f not in out:
            try:
                st = os.stat(f)
            except OSError:
                continue
            out[f] = (st.st_mtime_ns, st.st_size)
    return out


def _stale(stamps: dict[str, tuple[int, int]]) -> str | None:
    for f, stamp in stamps.items():
        try:
            st = os.stat(f)
        except OSError:
            return f'{f} is gone'
        if (st.st_mtime_ns, st.st_size) != stamp:
            return f'{f} changed'
    return None


def _child(req: dict, fds: list[int], close: list[socket.socket], entry) -> None:
    """In the forked child: become a plain worker process on the given fds."""
    try:
        os.setsid()
        for s in close:
            s.close()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = req.get('env')
        if isinstance(env, dict):
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in env.items()})
        os.chdir(req.get('cwd') or '.')
        sys.stdin = open(0, encoding='utf-8', closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stderr = open(2, 'w', encoding='utf-8', buffering=1, closefd=False)  # noqa: SIM115
        proto_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        proto = os.fdopen(proto_fd, 'w', encoding='utf-8', buffering=1)
        global FORKED_WITH
        FORKED_WITH = frozenset(sys.modules)
        code = entry(proto, list(req['argv']))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        code = 1
    try:
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def run_pytest(args: list[str]) -> int:
    """In a forked child: `python -m pytest ARGS` as a fresh interpreter started in this directory
    with this environment would run it, but with the server's libraries already imported.

    sys.path becomes what that interpreter would have: the working directory, then PYTHONPATH,
    then the interpreter's own entries (the server's, without its script's directory). Whether a
    name the server imported would have come from the tree instead is the orchestrator's check,
    made before it asks for the fork (flaloop/task/pytest_run.py)."""
    here = os.path.dirname(os.path.realpath(__file__))
    front = [os.getcwd()] + [os.path.abspath(p) for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    rest = [p for p in sys.path if p and os.path.realpath(p) != here and p not in front]
    sys.path[:] = front + rest
    importlib.invalidate_caches()
    sys.argv = ['pytest', *args]
    import runpy
    runpy.run_module('pytest', run_name='__main__', alter_sys=True)  # raises SystemExit with pytest's code
    return 0


def run_script(args: list[str]) -> int:
    """In a forked child: `python SCRIPT ARGS` as a fresh interpreter started with this environment
    would run it, but with the server's libraries already imported: sys.path becomes the script's
    directory, then PYTHONPATH, then the interpreter's own entries (as for run_pytest, the
    orchestrator has checked that nothing in front shadows what the server imported)."""
    script = os.path.realpath(args[0])
    here = os.path.dirname(os.path.realpath(__file__))
    front = [os.path.dirname(script)] + [os.path.abspath(p) for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    rest = [p for p in sys.path if p and os.path.realpath(p) != here and p not in front]
    sys.path[:] = front + rest
    importlib.invalidate_caches()
    sys.argv = [script, *args[1:]]
    import runpy
    runpy.run_path(script, run_name='__main__')  # a script that calls sys.exit raises SystemExit with its code
    return 0


def _note_failure(failed: str, why: str) -> None:
    """A server that cannot serve for this key leaves the reason beside its socket: no run starts
    another one for the key until `flaloop clean` removes it."""
    try:
        with open(failed, 'w', encoding='utf-8') as f:
            f.write(why + '\n')
    except OSError:
        pass


def _ident(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def serve(path: str, names: list[str], entry, *, key: str, idle_s: float) -> int:
    os.environ.setdefault('PYTORCH_NVML_BASED_CUDA_CHECK', '1')
    info = preload(names)
    stamps = _stamps()
    torch = sys.modules.get('torch')
    cuda = False
    if torch is not None:
        try:
            cuda = bool(torch.cuda.is_initialized())
        except Exception:
            cuda = False
    failed = f'{path[:-len(".sock")]}.failed' if path.endswith('.sock') else f'{path}.failed'
    starting = f'{path[:-len(".sock")]}.starting' if path.endswith('.sock') else f'{path}.starting'
    if cuda:  # children could not use the GPU: say so once, for this key, and serve nothing
        _note_failure(failed, 'a preloaded library initialised CUDA in the fork server')
        _unlink(starting)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f'{path}.{os.getpid()}'
    try:
        listener.bind(tmp)
        os.chmod(tmp, 0o600)
        listener.listen(64)
        os.replace(tmp, path)  # the socket appears only once the server can serve it
    except OSError as e:
        _note_failure(failed, f'cannot listen on {path}: {e}')
        return 1
    finally:
        _unlink(starting)  # listening, or never will: no run need wait for it any more
    me = _ident(path)
    ready = {'ok': True, 'pid': os.getpid(), 'key': key, 'preload': info, 'cuda_initialized': False,
             'modules': len(stamps), 'tops': sorted({name.split('.')[0] for name in sys.modules})}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    conns: list[socket.socket] = []
    exits: dict[int, int] = {}
    last = time.monotonic()
    try:
        while True:
            events = sel.select(timeout=1.0)
            _reap(exits)
            if conns:
                last = time.monotonic()
            elif time.monotonic() - last > idle_s or _ident(path) != me:
                return 0
            for k, _ in events:
                if k.fileobj is listener:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue
                    why = _stale(stamps)
                    try:
                        conn.send(json.dumps({**ready, 'ok': why is None, 'error': why}).encode())
                    except OSError:  # a client that gave up waiting
                        conn.close()
                        continue
                    if why is not None:
                        conn.close()
                        return 0
                    conns.append(conn)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = k.fileobj
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 3)
                except OSError:
                    msg, fds = b'', []
                if not msg:
                    sel.unregister(conn)
                    conns.remove(conn)
                    conn.close()
                    continue
                reply, leave = _handle(msg, fds, exits, [listener, *conns], entry)
                try:
                    conn.send(json.dumps(reply).encode())
                except OSError:
                    pass
                if leave:
                    return 0
    finally:
        if _ident(path) == me:
            try:
                os.unlink(path)
            except OSError:
                pass


def _handle(msg: bytes, fds: list[int], exits: dict, sockets: list[socket.socket], entry) -> tuple[dict, bool]:
    try:
        req = json.loads(msg.decode())
        cmd = req.get('cmd')
        if cmd == 'spawn':
            if len(fds) != 3:
                raise ValueError(f'spawn needs 3 fds, got {len(fds)}')
            alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            if alive:
                raise RuntimeError(f'threads are running in the fork server ({alive}): forking is unsafe')
            pid = os.fork()
            if pid == 0:
                _child(req, fds, sockets, entry)
            return {'ok': True, 'pid': pid}, False
        if cmd == 'status':
            _reap(exits)
            return {'ok': True, 'returncode': exits.get(int(req['pid']))}, False
        if cmd == 'exit':
            return {'ok': True}, True
        raise ValueError(f'unknown cmd {cmd!r}')
    except Exception as e:  # noqa: BLE001
        return {'ok': False, 'error': f'{type(e).__name__}: {e}'}, False
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
