"""One bench worker process driven through its pipes, as the orchestrator does, on a tiny fake
target written to tmp dirs (a registry in FLA's interface and a pure-torch op package): `make_tree`,
`Driver` (spawned, or forked by a warm fork server), `cell`."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from flaloop.inside import WORKER as WORKER_PKG

WORKER = WORKER_PKG / '__main__.py'
TIMEOUT_S = 60

REGISTRY = '''
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F


def shape_BTHD(B, T, H, D, **kw):
    return (B, T, H, D)


def shape_BTH(B, T, H, D, **kw):
    return (B, T, H)


@dataclass
class TensorSpec:
    shape_fn: Callable
    requires_grad: bool = True
    dtype: str = 'default'
    transform: Callable | None = None


@dataclass
class OpConfig:
    name: str
    import_path: str
    inputs: dict
    func_name: str | None = None
    extra_kwargs: dict = field(default_factory=dict)
    output_is_tuple: bool = True
    skip_backward: bool = False
    post_init: Callable | None = None
    category: str = ''
    dim_constraints: dict | None = None
    default_shapes: dict | None = None
    test_file: str | None = None
    backend_env: dict | None = None


_REGISTRY = {}


def register_op(config):
    _REGISTRY[config.name] = config


def get_op(name):
    if name not in _REGISTRY:
        raise KeyError(f"Op '{name}' not registered. Available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_ops():
    return sorted(_REGISTRY)


def _post(inputs, B, T, H, D, **kw):
    inputs['g'] = (torch.rand_like(inputs['g']) - 2.0).requires_grad_(True)


_qkv = {'q': TensorSpec(shape_BTHD), 'k': TensorSpec(shape_BTHD), 'v': TensorSpec(shape_BTHD)}

register_op(OpConfig(name='toy_op', import_path='toyop.ops.scale', inputs=dict(_qkv),
                     extra_kwargs={'scale': 0.5}))
register_op(OpConfig(name='toy_gate', import_path='toyop.ops.scale', func_name='toy_gate',
                     inputs={**_qkv, 'g': TensorSpec(shape_BTH, transform=F.logsigmoid)},
                     post_init=_post))
register_op(OpConfig(name='toy_ident', import_path='toyop.ops.scale', output_is_tuple=False,
                     inputs={'x': TensorSpec(shape_BTHD, requires_grad=False)}))
register_op(OpConfig(name='toy_varlen', import_path='toyop.ops.scale', inputs={'x': TensorSpec(shape_BTHD)}))
register_op(OpConfig(name='toy_nobwd', import_path='toyop.ops.scale', func_name='toy_ident',
                     output_is_tuple=False, skip_backward=True, dim_constraints={'D': [4, 8]},
                     inputs={'x': TensorSpec(shape_BTHD, requires_grad=False)}))
'''

OP = '''
import os

import torch

FACTOR = 1.0
NAN = False
EXTRA = False


def toy_op(q, k, v, scale=None, cu_seqlens=None):
    print('noise from toy_op on stdout')   # must not break the protocol
    os.write(1, b'raw fd-1 noise\\n')
    o = (q * k).sum(-1, keepdim=True) * v * (scale if scale is not None else 1.0) * FACTOR
    if NAN:
        o = o.clone()
        o.view(-1)[0] = float('nan')
    if EXTRA:
        return o, None, o.sum()
    return o, None


def toy_gate(q, k, v, g, cu_seqlens=None):
    return (q * k).sum(-1, keepdim=True) * v * g.exp().unsqueeze(-1), None


def toy_ident(x):
    return x.clone()


def toy_varlen(x, cu_seqlens: torch.LongTensor | None = None):
    assert cu_seqlens is not None
    return x * 2.0, cu_seqlens.clone()
'''


def make_tree(root: Path, **consts) -> Path:
    """A fake target tree: benchmarks/ops/registry.py and the package toyop.ops.scale."""
    (root / 'benchmarks' / 'ops').mkdir(parents=True)
    (root / 'benchmarks' / 'ops' / 'registry.py').write_text(REGISTRY)
    pkg = root / 'toyop' / 'ops' / 'scale'
    pkg.mkdir(parents=True)
    (root / 'toyop' / '__init__.py').write_text('')
    (root / 'toyop' / 'ops' / '__init__.py').write_text('')
    src = OP
    for name, value in consts.items():
        src = src.replace(f'{name} = ', f'{name} = {value!r}  # was ', 1)
    (pkg / '__init__.py').write_text(src)
    return root


PRELOAD = ['torch', 'triton', 'triton.language']  # what a bench's fork server preloads for a Triton op


def fork_server(env: dict):
    """A connection to a warm flaloop fork server for `env` (the first call starts it; the suite's
    conftest stops this test run's servers at its end)."""
    from flaloop.bench import forkservers

    server = forkservers.ForkServer.connect(sys.executable, env, PRELOAD)
    if server is None:
        forkservers.start(sys.executable, env, PRELOAD)
        server = forkservers.ForkServer.connect(sys.executable, env, PRELOAD)
    if server is None:
        k = forkservers.key(sys.executable, env, PRELOAD)
        said = [p.read_text()[-2000:] for p in (forkservers.socket_path(k, ext) for ext in ('log', 'failed')) if p.exists()]
        raise AssertionError(f'no fork server came up: {said}')
    return server


class Forked:
    """A forked worker (flaloop.bench.forkservers.ForkedProc) as much like a Popen as these tests use."""

    def __init__(self, server, forked):
        from flaloop.bench.forkservers import ForkedProc

        proc = ForkedProc(server, *forked)
        self.proc, self.pid, self.stdin, self.stdout = proc, proc.pid, proc.stdin, proc.stdout

    @property
    def returncode(self):
        return self.proc.poll()

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout=None):
        code = self.proc.wait(TIMEOUT_S if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired('forked worker', timeout)
        return code

    def kill(self):
        self.proc.kill()


class Driver:
    """Drive one worker process through its pipes: spawned, or with `forked` forked by a warm fork
    server as a bench's workers are by default (many workers then share one import of torch)."""

    def __init__(self, tree: Path, op: str, side: str, workdir: Path | None = None, device: str = 'cpu',
                 forked: bool = False):
        registry = tree / 'benchmarks' / 'ops' / 'registry.py'
        self.errpath = tree / f'worker-{side}-{op}-{device}.err'
        self.err = open(self.errpath, 'w')
        args = ['--tree', str(tree), '--registry', str(registry), '--op', op, '--side', side, '--device', device]
        if workdir is not None:
            args += ['--workdir', str(workdir)]
        env = dict(os.environ, OMP_NUM_THREADS='1')
        if forked:
            server = fork_server(env)
            self.p = Forked(server, server.spawn(args, tree, env, self.err))
        else:
            self.p = subprocess.Popen([sys.executable, '-u', str(WORKER), *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.n = 0

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr(self) -> str:
        self.err.flush()
        return self.errpath.read_text()[-4000:]

    def raw(self, text: str) -> dict:
        self.p.stdin.write(text)
        self.p.stdin.flush()
        try:
            line = self.lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f'no reply to {text!r}; stderr:\n{self.stderr()}') from None
        assert line is not None, f'worker closed stdout; stderr:\n{self.stderr()}'
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f'protocol line is not JSON: {line!r}') from None

    def req(self, cmd: str, **kw) -> dict:
        self.n += 1
        reply = self.raw(json.dumps({'cmd': cmd, 'id': self.n, **kw}) + '\n')
        assert reply.get('id') == self.n, reply
        return reply

    def ok(self, cmd: str, **kw) -> dict:
        reply = self.req(cmd, **kw)
        assert reply['ok'] is True, f"{reply.get('error')}\n{reply.get('traceback')}\nstderr:\n{self.stderr()}"
        return reply

    def close(self):
        if self.p.poll() is None:
            try:
                if not self.p.stdin.closed:
                    self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.err.close()


def cell(cid='c', mode='fwd', dtype='float32', seed=0, shape=None, **kw) -> dict:
    c = {'id': cid, 'shape': shape or {'B': 2, 'T': 8, 'H': 2, 'D': 4}, 'mode': mode, 'dtype': dtype,
         'seed': seed, 'inputs': {}, 'seqlens': None, 'k': None, 'timer': 'auto', 'sample_ms': 0.2}
    c.update(kw)
    return c
