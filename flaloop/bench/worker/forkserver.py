"""The fork server: imports torch and the target's third-party libraries once, then forks workers.

Importing FLA costs 16-19 s per process on the H200 machine, most of it in torch, torch._dynamo
and transformers, none of it the tree under test. A run needs several fresh processes (the
warm-up pair, one pair per round), so the server imports those libraries once and forks a child
per worker; each child then imports the registry and the op from its own tree, as a spawned
worker would. Nothing of either tree is imported here, and CUDA is never initialised here (a
forked child could not use it): `PYTORCH_NVML_BASED_CUDA_CHECK=1` keeps `torch.cuda.is_available()`
in preloaded libraries from initialising the driver.

Wire: a Unix SOCK_SEQPACKET socket (fd given by the orchestrator; message boundaries kept). Each request is one JSON message, a spawn
request also carries three fds (stdin, stdout, stderr of the child) by SCM_RIGHTS.
  {"cmd": "spawn", "argv": [...], "cwd": DIR, "env": {...}} -> {"ok": true, "pid": N} or {"ok": false, "error": ...}
  {"cmd": "status", "pid": N} -> {"ok": true, "returncode": int | null}   (null: still running)
EOF is the end: the server exits (its children watch their parent and exit too).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import threading
import time

MAX_MSG = 1 << 20


def _reap(exits: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def preload(names: list[str]) -> dict:
    t0 = time.perf_counter()
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - a library that fails to import alone is skipped
            failed[name] = f'{type(e).__name__}: {e}'[:200]
    return {'seconds': round(time.perf_counter() - t0, 3), 'failed': failed, 'n': len(names)}


def _child(req: dict, fds: list[int], sock: socket.socket, entry) -> None:
    """In the forked child: become a plain worker process on the given fds."""
    try:
        os.setsid()
        sock.close()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.update(req.get('env') or {})
        os.chdir(req.get('cwd') or '.')
        sys.stdin = open(0, encoding='utf-8', closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stderr = open(2, 'w', encoding='utf-8', buffering=1, closefd=False)  # noqa: SIM115
        proto_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        proto = os.fdopen(proto_fd, 'w', encoding='utf-8', buffering=1)
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


def serve(sock_fd: int, names: list[str], entry) -> int:
    os.environ.setdefault('PYTORCH_NVML_BASED_CUDA_CHECK', '1')
    info = preload(names)
    exits: dict[int, int] = {}
    sock = socket.socket(fileno=sock_fd)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    cuda = False
    torch = sys.modules.get('torch')
    if torch is not None:
        try:
            cuda = bool(torch.cuda.is_initialized())
        except Exception:
            cuda = False
    ready = {'ok': True, 'pid': os.getpid(), 'preload': info, 'threads': threads, 'cuda_initialized': cuda}
    sock.send(json.dumps(ready).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 3)
        except OSError:
            return 0
        if not msg:
            return 0
        _reap(exits)
        try:
            req = json.loads(msg.decode())
            if req.get('cmd') == 'spawn':
                if len(fds) != 3:
                    raise ValueError(f'spawn needs 3 fds, got {len(fds)}')
                alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
                if alive:
                    raise RuntimeError(f'threads are running in the fork server ({alive}): forking is unsafe')
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, sock, entry)
                reply = {'ok': True, 'pid': pid}
            elif req.get('cmd') == 'status':
                pid = int(req['pid'])
                reply = {'ok': True, 'returncode': exits.get(pid)}
            else:
                raise ValueError(f"unknown cmd {req.get('cmd')!r}")
        except Exception as e:  # noqa: BLE001
            reply = {'ok': False, 'error': f'{type(e).__name__}: {e}'}
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        sock.send(json.dumps(reply).encode())
