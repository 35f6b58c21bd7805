"""A model cell: one training step of a causal LM built from the tree's own model code.

The session sets it up like an op cell (`setup` with a "model" spec), samples it with the same
`sample` and `eager` commands (one sample: k training steps, forward + backward + optimizer
step), and asks it two things an op cell has no answer to:

  trajectory  a fresh model from the seed trained N steps on the seeded token stream: the loss
              and the gradient norm at each step; with "perturb", every call of the op in the
              model has its floating outputs moved by seeded noise of that relative RMS (the
              band an op tolerance allows, run on the base)
  opshare     the op's calls inside one step, captured and replayed alone (forward and backward):
              their device time beside the step's, the op's share of the step

The model's weights come from `torch.manual_seed(seed)` before the model is built, and each side
reports a digest of them: the session refuses a pair whose initial weights differ (a tree that
changed its model's init would otherwise be compared on other weights). The token stream is
drawn on the CPU from a generator seeded per step, so both sides and every run see the same
tokens.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import statistics
import sys
from contextlib import contextmanager

import torch

from . import timing

DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16, 'float32': torch.float32}


class ModelRefused(Exception):
    """The model cannot be built or run as asked (a missing class, a config it rejects)."""


def _sites(fn) -> list:
    """Every (module, attribute) that holds the op's function: the layers bind it at import."""
    out = []
    for mod in list(sys.modules.values()):
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        out += [(mod, name) for name, v in items if v is fn]
    return out


@contextmanager
def wrapped_op(fn, wrapper):
    """The op replaced by `wrapper(fn)` wherever a module holds it, for the block."""
    sites = _sites(fn)
    new = wrapper(fn)
    for mod, name in sites:
        setattr(mod, name, new)
    try:
        yield len(sites)
    finally:
        for mod, name in sites:
            setattr(mod, name, fn)


def _floats(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _floats(x)]
    return []


def _map(out, f):
    if isinstance(out, torch.Tensor):
        return f(out) if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_map(x, f) for x in out)
    return out


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


class ModelCell:
    def __init__(self, worker, spec: dict):
        self.worker = worker
        self.id = str(spec['id'])
        self.m = dict(spec['model'])
        self.device = worker.device
        self.dtype = DTYPES.get(self.m.get('dtype', 'bfloat16'))
        if self.dtype is None:
            raise ModelRefused(f"dtype {self.m.get('dtype')!r}: one of {sorted(DTYPES)}")
        self.seed = int(spec.get('seed', 0))
        self.k = spec.get('k')
        self.sample_ms = float(spec.get('sample_ms') or 0)
        self.timer = 'cuda_event' if self.device.type == 'cuda' else 'cpu'
        self.model = self.opt = None
        self.i = 0

    # -- building --

    def _classes(self):
        try:
            mod = importlib.import_module(self.m['module'])
        except Exception as e:
            raise ModelRefused(f"the model's module {self.m['module']} does not import: {type(e).__name__}: {e}") from e
        out = []
        for key in ('config_class', 'model_class'):
            cls = getattr(mod, self.m[key], None)
            if cls is None:
                raise ModelRefused(f"{self.m['module']} has no {self.m[key]}")
            out.append(cls)
        return out

    def new_model(self):
        config_cls, model_cls = self._classes()
        try:
            config = config_cls(**self.m.get('config', {}))
            torch.manual_seed(self.seed)
            model = model_cls(config)
        except Exception as e:
            raise ModelRefused(f"{self.m['model_class']} refuses the config {self.m.get('config')}: "
                               f"{type(e).__name__}: {e}") from e
        model = model.to(device=self.device, dtype=self.dtype)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=float(self.m.get('lr', 1e-3)))
        return model, opt

    def tokens(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randint(0, int(self.m['vocab_size']), (int(self.m['batch']), int(self.m['seq_len'])), generator=g)
        return x.to(self.device)

    def _step(self, model, opt, x) -> torch.Tensor:
        out = model(input_ids=x, labels=x)
        loss = out.loss if hasattr(out, 'loss') else out['loss']
        loss.backward()
        return loss

    def step(self) -> None:
        x = self.batches[self.i % len(self.batches)]
        self.i += 1
        self._step(self.model, self.opt, x)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def build(self) -> dict:
        try:
            return self._build()
        except torch.cuda.OutOfMemoryError as e:  # the model, its optimizer or a step: too big for this device
            self.release()
            raise ModelRefused(f"the model does not fit: {str(e).splitlines()[0]} (--set batch=, seq_len= or "
                               "config.* smaller)") from e

    def _build(self) -> dict:
        self.model, self.opt = self.new_model()
        digest = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
        self.batches = [self.tokens(i) for i in range(2)]
        for _ in range(int(self.m.get('warmup_steps', 2))):  # compile, autotune, the allocator's pools
            self.step()
        per_step = self._time(1)[0]
        if not self.k:
            self.k = max(1, round(self.sample_ms / per_step)) if self.sample_ms and per_step > 0 else 1
        return {'cell': self.id, 'ok': True, 'timer': self.timer, 'k': self.k, 'step_ms': per_step,
                'params': sum(p.numel() for p in self.model.parameters()), 'init_digest': digest.hexdigest()}

    # -- timing --

    def _time(self, n: int) -> tuple[float, float]:
        def run():
            for _ in range(n):
                self.step()
        if self.timer == 'cuda_event':
            dev, wall = timing.cuda_time_ms(run)
        else:
            t0 = timing.now()
            run()
            dev = wall = (timing.now() - t0) * 1e3
        return dev / n, wall / n

    def sample(self, placement: int = 0, keep: int | None = None) -> tuple[float, float]:
        # a step's correctness is the trajectory's question: no timed call is kept for a model cell
        if keep is not None:
            raise ValueError('a model cell keeps no timed call: the trajectory judges the steps')
        return self._time(self.k)

    def eager_sample(self) -> tuple[float, float]:
        t0 = timing.now()
        self.step()
        host = (timing.now() - t0) * 1e3
        if self.device.type == 'cuda':
            timing.device_sync()
        return host, (timing.now() - t0) * 1e3

    # -- the trajectory --

    def trajectory(self, steps: int, perturb: float = 0.0, noise_seed: int = 0) -> dict:
        model, opt = self.new_model()
        gen = torch.Generator(device=self.device).manual_seed(noise_seed)
        calls = [0]

        def wrapper(fn):
            def op(*a, **kw):
                calls[0] += 1
                out = fn(*a, **kw)
                if not perturb:
                    return out

                def moved(t):
                    rms = t.detach().float().pow(2).mean().sqrt()
                    noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
                    return t + (perturb * rms * noise).to(t.dtype)
                return _map(out, moved)
            return op

        losses, norms = [], []
        with wrapped_op(self.worker.fn, wrapper):
            for i in range(steps):
                loss = self._step(model, opt, self.tokens(1000 + i))
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach().float()))
                norms.append(float(norm))
        del model, opt
        return {'losses': losses, 'grad_norms': norms, 'op_calls': calls[0], 'perturb': perturb,
                'noise_seed': noise_seed}

    # -- the op's share of a step --

    def opshare(self, reps: int = 3) -> dict:
        captured = []

        def wrapper(fn):
            def op(*a, **kw):
                captured.append((_detached(a), _detached(kw)))
                return fn(*a, **kw)
            return op

        with wrapped_op(self.worker.fn, wrapper) as sites:
            self.step()
        if not captured:
            return {'calls': 0, 'sites': sites}
        fn = self.worker.fn

        def replay():
            for a, kw in captured:
                a, kw = _detached(a), _detached(kw)
                outs = [t for t in _floats(fn(*a, **kw)) if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

        op_ms = [self._timed(replay) for _ in range(reps)]
        step_ms = [self._time(1)[0] for _ in range(reps)]
        op, step = statistics.median(op_ms), statistics.median(step_ms)
        return {'calls': len(captured), 'sites': sites, 'op_ms': op, 'step_ms': step,
                'share': op / step if step > 0 else math.nan}

    def _timed(self, fn) -> float:
        if self.timer == 'cuda_event':
            return timing.cuda_time_ms(fn)[0]
        t0 = timing.now()
        fn()
        return (timing.now() - t0) * 1e3

    def release(self) -> None:
        self.model = self.opt = None
        self.batches = []
