"""The worker process: one side (base or candidate) of a paired benchmark, serving requests.

Commands (``WorkerServer.cmd_*``): hello, setup, probe, sample, eager, selfcheck, dump, compare, unshare,
release, quit; for a model cell (model.py) also trajectory and opshare.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import traceback

import torch

from . import integrity, probes, replay, timing
from .backends import served_within
from .cell import BuiltCell
from .model import ModelCell, ModelRefused
from .op_import import LAZY_RAN, apply_backend_env, import_op, load_registry, loaded_outside, source_file
from .outputs import compare_results, describe, load_dump, open_shared, save_dump, share
from .protocol import InitError, send, serve, short_error
from .tuning import dist_version, triton_version


def forked_with() -> frozenset:
    """The modules this process had when the fork server forked it (empty when spawned)."""
    return getattr(sys.modules.get(f'{__package__}.forkserver'), 'FORKED_WITH', frozenset())


def _of_tree(name: str, tree: str) -> bool:
    """Whether the loaded module `name` is, or stands in for, a module of `tree`."""
    f = getattr(sys.modules.get(name), '__file__', None)
    if not isinstance(f, str) or not os.path.isabs(f):
        return False
    if os.path.realpath(f).startswith(tree + os.sep):
        return True
    top = name.split('.')[0]
    return os.path.isfile(os.path.join(tree, top + '.py')) or os.path.isfile(os.path.join(tree, top, '__init__.py'))


class WorkerServer:
    def __init__(self, args):
        self.args = args
        self.side = args.side
        self.cells: dict[str, BuiltCell] = {}
        self.shared: dict = {}  # results another process maps through CUDA IPC (`dump` with share)
        self.held: dict = {}  # results a `dump` with hold keeps for this side's own `compare`
        self.init_error = None
        self.cfg = self.fn = self.mod = None
        self.device = None
        self.l2_bytes = None
        self.backend_note = None
        self.flush_l2 = None
        self.import_s = None
        # Before anything of the target runs: the identity of everything the timing path reaches.
        own = [m for n, m in sys.modules.items() if n.split('.')[0] == __package__]
        own_classes = [v for m in own for v in vars(m).values()
                       if isinstance(v, type) and getattr(v, '__module__', '').startswith(__package__)]
        self.watch = integrity.default_watch(own, own_classes)
        try:
            self._init()
        except Exception as e:
            self.init_error = (short_error(e), traceback.format_exc())
            self.log(f'[flaloop worker] init failed: {self.init_error[1]}')
        self.watch.check()

    @staticmethod
    def log(msg: str) -> None:
        try:
            sys.stderr.write(msg.rstrip('\n') + '\n')
            sys.stderr.flush()
        except Exception:
            pass

    def _init(self) -> None:
        a = self.args
        self.tree = os.path.realpath(a.tree)
        self.registry_file = os.path.realpath(a.registry)
        if not os.path.isdir(self.tree):
            raise FileNotFoundError(f'tree {self.tree} is not a directory')
        # a forked worker: nothing the fork server had imported may be a module of this tree: a copy
        # from the tree itself (stale), or one of the same name from elsewhere (another checkout on
        # PYTHONPATH) that would stand in for the tree's own
        early = [m for m in forked_with() if not m.startswith('_flaloop') and _of_tree(m, self.tree)]
        if early:
            raise RuntimeError(f'modules of the tree were loaded before the worker started: {sorted(early)[:5]}')
        if a.workdir:
            os.makedirs(a.workdir, exist_ok=True)
            os.chdir(a.workdir)
        sys.path.insert(0, self.tree)
        t0 = time.perf_counter()
        self.registry = load_registry(self.registry_file, self.tree)
        self.cfg = self.registry.get_op(a.op)
        self.backend_note = apply_backend_env(self.cfg, a.backend)
        dev = a.device or ('cuda' if torch.cuda.is_available() else 'cpu')
        if dev == 'cuda' and not torch.cuda.is_available():
            raise RuntimeError('--device cuda but torch.cuda.is_available() is False')
        self.device = torch.device(dev)
        if self.device.type == 'cpu' and 'OMP_NUM_THREADS' not in os.environ:
            # two workers share the host's cores: intra-op thread pools of both would fight for them
            # and turn every sample into a scheduler lottery (OMP_NUM_THREADS overrides this)
            torch.set_num_threads(1)
        if self.device.type == 'cuda':
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            self.l2_bytes = int(getattr(props, 'L2_cache_size', 0) or 0) or None
        self.flush_l2 = timing.L2Flush(self.device, self.l2_bytes)
        self.mod, self.fn = import_op(self.cfg, lean=a.import_mode == 'lean', tree=self.tree)
        self.import_s = time.perf_counter() - t0
        # What the imports built lives as long as the process: later collections (each `release`
        # runs one) skip it. On the H200 a warm 12-cell verify waited 9.3 s on releases before
        # this, 0.3-0.5 s after (docs/lab/2026-11-30-h200.md, R7).
        gc.freeze()

    # -- dispatch ---------------------------------------------------------------------------------------

    def handle(self, cmd, req: dict) -> dict:
        method = getattr(self, f'cmd_{cmd}', None) if isinstance(cmd, str) else None
        if method is None:
            valid = sorted(m[4:] for m in dir(self) if m.startswith('cmd_')) + ['quit']
            raise ValueError(f'unknown cmd {cmd!r}; valid: {valid}')
        if self.init_error is not None:
            raise InitError(f'worker init failed: {self.init_error[0]}', self.init_error[1])
        return method(req)

    def stamp(self) -> dict:
        """Rides on every reply: the timing-integrity violations seen so far (sticky)."""
        return {'integrity': list(self.watch.violations)} if self.watch.violations else {}

    def after_error(self) -> None:
        gc.collect()
        if self.device is not None and self.device.type == 'cuda':
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass

    def _cell(self, req: dict) -> BuiltCell:
        cid = req.get('cell')
        if isinstance(cid, dict):
            cid = cid.get('id')
        cell = self.cells.get(str(cid))
        if cell is None:
            raise KeyError(f'unknown cell {cid!r}; set up: {sorted(self.cells)}')
        return cell

    # -- commands ---------------------------------------------------------------------------------------

    def cmd_hello(self, req: dict) -> dict:
        dev = self.device
        if dev.type == 'cuda':
            # a context now: NVML lists only processes that hold one, and the session asks it who is
            # on the GPU right after this answer (on the H200 it named another user's job but not
            # workers that had none yet, so the GPU read as one whose process list is blind)
            torch.empty(1, device=dev)
            idx = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            device_name = props.name
            uuid = getattr(props, 'uuid', None)
            device_uuid = str(uuid) if uuid is not None else None
        else:
            device_name = platform.processor() or platform.machine() or 'cpu'
            device_uuid = None
        package = self.cfg.import_path.split('.')[0]
        forked = forked_with()
        return {
            'side': self.side,
            'op': self.cfg.name,
            'tree': self.tree,
            'registry': self.registry_file,
            'op_module_file': os.path.realpath(self.mod.__file__) if getattr(self.mod, '__file__', None) else None,
            'op_func_file': source_file(self.fn),
            'python': sys.executable,
            'torch': torch.__version__,
            'triton': triton_version(),
            'tilelang': dist_version('tilelang'),
            'cutlass': dist_version('nvidia-cutlass-dsl'),
            'device': dev.type,
            'device_name': device_name,
            'device_uuid': device_uuid,
            'l2_bytes': self.l2_bytes,
            'cuda_runtime': torch.version.cuda,
            'backend': self.backend_note,
            'pid': os.getpid(),
            'import_s': self.import_s,
            'import_mode': self.args.import_mode,
            'lazy_packages_ran': list(LAZY_RAN),
            'watched': len(self.watch),
            # third-party modules a fork server could import ahead next time (beyond what it had)
            'preload': [m for m in loaded_outside(self.tree, skip=forked) if m.split('.')[0] != package],
            'forked': bool(forked),
            'numeric_at_import': probes.numeric_settings(),
        }

    def cmd_setup(self, req: dict) -> dict:
        spec = req.get('cell')
        if not isinstance(spec, dict) or 'id' not in spec:
            raise ValueError('setup needs "cell": {"id": ..., "shape": {...}, ...}')
        cid = str(spec['id'])
        if cid in self.cells:
            self._release(cid)
        cell = ModelCell(self, spec) if spec.get('model') else BuiltCell(self, spec)
        try:
            reply = cell.build()
        except ModelRefused as e:  # a refusal of the model as asked, not a failure of the op
            return {'cell': cid, 'ok': False, 'model_refused': True, 'error': str(e)}
        self.cells[cid] = cell
        self.watch.check()
        return reply

    def cmd_probe(self, req: dict) -> dict:
        """The guard's probes on a set-up cell (see probes.py)."""
        cell = self._cell(req)
        t0 = time.perf_counter()
        reply = {'cell': cell.id, 'probes': probes.run_all(cell)}
        reply['seconds'] = time.perf_counter() - t0
        self.watch.check()
        return reply

    def cmd_sample(self, req: dict) -> dict:
        cell = self._cell(req)
        n = int(req.get('n', 1))
        self.watch.check()
        placement = int(req.get('placement', 0))
        # "keep": a call index the session drew; the first sample's results of that call stay for
        # `dump`/`compare` with "kept" (BuiltCell.sample)
        keep = req.get('keep')
        dev, wall = [], []
        for i in range(n):
            d, w = cell.sample(placement, keep=int(keep) if keep is not None and i == 0 else None)
            dev.append(d)
            wall.append(w)
        self.watch.check()
        reply = {'cell': cell.id, 'timer': cell.timer, 'k': cell.k, 'times_ms': dev, 'wall_ms': wall}
        if keep is not None:
            reply['kept'], reply['keep_s'] = sorted(cell.kept or {}), cell.keep_s
        return reply

    def cmd_selfcheck(self, req: dict) -> dict:
        """The cell's self-check after its timed samples (BuiltCell.self_check)."""
        cell = self._cell(req)
        self.watch.check()
        t0 = time.perf_counter()
        reply = {'cell': cell.id, **cell.self_check(float(req.get('tol', 1e-3)))}
        reply['seconds'] = time.perf_counter() - t0
        self.watch.check()
        return reply

    def cmd_eager(self, req: dict) -> dict:
        cell = self._cell(req)
        n = int(req.get('n', 1))
        self.watch.check()
        host, wall = [], []
        for _ in range(n):
            h, w = cell.eager_sample()
            host.append(h)
            wall.append(w)
        self.watch.check()
        return {'cell': cell.id, 'k': cell.k, 'host_ms': host, 'wall_ms': wall}

    def _model(self, req: dict) -> ModelCell:
        cell = self._cell(req)
        if not isinstance(cell, ModelCell):
            raise ValueError(f'cell {cell.id!r} is not a model cell')
        return cell

    def cmd_trajectory(self, req: dict) -> dict:
        """A fresh model of a model cell trained "steps" steps (ModelCell.trajectory)."""
        cell = self._model(req)
        t0 = time.perf_counter()
        out = cell.trajectory(int(req.get('steps', 20)), float(req.get('perturb', 0.0)), int(req.get('noise_seed', 0)))
        return {'cell': cell.id, **out, 'seconds': time.perf_counter() - t0}

    def cmd_opshare(self, req: dict) -> dict:
        """The op's share of a model cell's training step (ModelCell.opshare)."""
        cell = self._model(req)
        t0 = time.perf_counter()
        return {'cell': cell.id, **cell.opshare(int(req.get('reps', 3))), 'seconds': time.perf_counter() - t0}

    @staticmethod
    def _results(cell: BuiltCell, req: dict) -> dict:
        """Set 0's results, or with "mutated" its results on inputs changed in place (the guard's
        mutation probe: a candidate that caches by pointer returns stale values there), or with
        "kept" what a timed call left (no call here)."""
        if req.get('kept'):
            return _kept(cell)
        if req.get('mutated'):
            return cell.results_mutated()
        return {k: v.detach() for k, v in cell.results(cell.sets[0]).items()}

    def cmd_dump(self, req: dict) -> dict:
        """My results for the other side: with "share", as CUDA IPC handles that stay valid until
        `unshare` (or the next dump); else, or when they cannot be shared, written to "path". With
        "hold" (no path), kept here in memory for this side's own `compare` of the other side's dump:
        two dumps made at once without a file of this side's on disk."""
        cell = self._cell(req)
        path = req.get('path')
        if not path and not req.get('share') and not req.get('hold'):
            raise ValueError('dump needs "path" (or "share": true on a GPU, or "hold": true)')
        self._unshare()
        self.held.pop(cell.id, None)
        t0 = time.perf_counter()
        with served_within() as served:  # which backend this call ran on (the unseen shapes' coverage)
            res = self._results(cell, req)
        if req.get('hold'):
            if req.get('mutated') or req.get('kept'):
                raise ValueError('dump with "hold" keeps set 0\'s plain results only')
            self.held[cell.id] = res
            return {'cell': cell.id, 'held': True, **describe(res), 'backends': served,
                    'seconds': time.perf_counter() - t0}
        why = None
        if req.get('share'):
            try:
                payload, desc = share(res)
                self.shared = res
                return {'cell': cell.id, 'shared': payload, **desc, 'backends': served,
                        'seconds': time.perf_counter() - t0}
            except Exception as e:  # no IPC here (CPU tensors, an allocator without it): the file
                why = short_error(e)
                if not path:
                    raise
        return {'cell': cell.id, **save_dump(res, path), 'share_error': why, 'backends': served,
                'seconds': time.perf_counter() - t0}

    def cmd_compare(self, req: dict) -> dict:
        """Judge the other side's results: "subject" (a dump file) or "subject_shared" (IPC handles)
        against mine (a call now, set 0 or with "mutated" its mutated results; or what a `dump` with
        "hold" kept; or "ref", a dump file of mine made at once with the other's). Without a subject,
        "ref"/"shared" are the other side's and are compared with mine; with "kept", the other side's
        kept timed call against mine.

        Only the base judges: a candidate's process never holds, loads or is told the path of the
        base's results, so nothing it runs (its caller's stack frames, the garbage collector) can
        copy them, and no verdict is formed where it could be rewritten."""
        # two dumps of a replayed call (`replay`: "subject" and "ref") belong to no cell
        cell = (self._cell(req) if req.get('cell') is not None or not (req.get('subject') or req.get('subject_shared'))
                else None)
        if self.side != 'base':
            raise ValueError('compare runs in the base only: the candidate dumps its results and the base judges them')
        theirs_key = next((k for k in ('subject_shared', 'subject', 'shared', 'ref') if req.get(k)), None)
        if theirs_key is None:
            raise ValueError('compare needs the other side\'s results: "subject" (a dump file) or "subject_shared" '
                             '(its handles)')
        t0 = time.perf_counter()
        try:
            theirs = open_shared(req[theirs_key]) if theirs_key.endswith('shared') else load_dump(req[theirs_key])
        except Exception as e:  # handles this process cannot map: the session sends a file instead
            if not theirs_key.endswith('shared'):
                raise
            return {'cell': cell and cell.id, 'shared_error': short_error(e)}
        tol = float(req.get('tol', 1e-3))
        try:
            if req.get('kept'):  # the other side's timed call judged against mine
                out = compare_kept(theirs, _kept(cell), tol)
            elif theirs_key.startswith('subject'):
                mine = (load_dump(req['ref']) if req.get('ref') else
                        self.held.pop(cell.id, None) if cell and not req.get('mutated') and cell.id in self.held else
                        self._results(cell, req))
                out = compare_results(theirs, mine, tol)
            else:  # "ref"/"shared" without a subject: the other side's as the reference, mine as the subject
                out = compare_results(self._results(cell, req), theirs, tol)
        finally:
            del theirs  # unmaps the other side's memory
        return {'cell': cell and cell.id, **out, 'seconds': time.perf_counter() - t0}

    def cmd_replay(self, req: dict) -> dict:
        """One call built from "seed" and either "call" (a test's recorded call: fn, args, kwargs as
        SPECs) or "cell" with "options" (the registry's call on a cell spec, keyword options added),
        forward and, with "backward", backward through every output; the results written to "path"
        (worker/replay.py). A failure to build or to call is this command's error."""
        seed, backward = int(req.get('seed', 0)), bool(req.get('backward', True))
        builder = replay.Builder(self.device, seed, self.cfg, (req.get('cell') or {}).get('inputs') or req.get('inputs'))
        t0 = time.perf_counter()
        with served_within() as served:
            if req.get('call'):
                fn = replay.resolve(req['call']['fn'])
                args, kwargs = replay.build_test_call(fn, req['call'], builder)
            else:
                fn = self.fn
                args, kwargs = replay.build_option_call(self, req['cell'], req.get('options') or {}, builder)
            res = replay.run(fn, args, kwargs, builder, backward)
            if self.device.type == 'cuda':
                torch.cuda.synchronize()
        reply = {**save_dump(res, req['path']), 'backends': served, 'seconds': time.perf_counter() - t0}
        del res, args, kwargs, builder
        self.after_error()  # what the call allocated goes now: the next one may be larger
        return reply


    def _unshare(self) -> None:
        if self.shared:
            self.shared = {}
            if self.device is not None and self.device.type == 'cuda':
                torch.cuda.ipc_collect()  # blocks the other side held are freed now

    def cmd_unshare(self, req: dict) -> dict:
        had = bool(self.shared)
        self._unshare()
        return {'unshared': had}

    def _release(self, cid: str) -> bool:
        self._unshare()
        self.held.pop(cid, None)
        cell = self.cells.pop(cid, None)
        if cell is None:
            return False
        cell.graph = cell.static = cell.kept = None
        cell.sets, cell.extra, cell.extra_static = [], [], []
        del cell
        self.after_error()
        return True

    def cmd_release(self, req: dict) -> dict:
        cid = req.get('cell')
        if isinstance(cid, dict):
            cid = cid.get('id')
        return {'cell': cid, 'released': self._release(str(cid))}


def _kept(cell: BuiltCell) -> dict:
    if not cell.kept:
        raise ValueError(f'cell {cell.id}: no timed call was kept (a "sample" with "keep" comes first)')
    return cell.kept


def compare_kept(theirs: dict, mine: dict, tol: float) -> dict:
    """The other side's kept timed call against mine, on the input sets it kept ('s<i>:' names): a
    graph keeps every set's outputs, an eager call one set's. Nothing kept is no match."""
    sets = {name.split(':', 1)[0] for name in theirs}
    out = compare_results(theirs, {n: t for n, t in mine.items() if n.split(':', 1)[0] in sets}, tol)
    if not theirs:
        out['match'] = False
    out['sets'] = sorted(sets)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description='flaloop benchmark worker (JSON lines on stdin/stdout)')
    p.add_argument('--tree', required=True, help='source tree whose op is measured (put first on sys.path)')
    p.add_argument('--registry', required=True, help='path of the FLA-style registry.py')
    p.add_argument('--op', required=True, help='registry op name')
    p.add_argument('--side', required=True, choices=['base', 'cand'])
    p.add_argument('--device', choices=['cuda', 'cpu'], default=None, help='default: cuda when available')
    p.add_argument('--workdir', default=None, help='chdir here before importing the op')
    p.add_argument('--backend', default=None, help="op backend (OpConfig.backend_env key, or 'triton')")
    p.add_argument('--import-mode', choices=['full', 'lean'], default='full',
                   help="lean: the op's parent packages run their __init__ only when asked for a name")
    return p.parse_args(argv)


def main(proto, argv) -> int:
    args = parse_args(argv)
    worker = WorkerServer(args)
    try:
        return serve(worker, sys.stdin, proto)
    except BrokenPipeError:
        return 1


__all__ = ['WorkerServer', 'main', 'send']
