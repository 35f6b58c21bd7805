"""Deterministic input sets built from the registry's TensorSpecs: identical on both sides for a
seed, several sets rotated so that a cell's data exceeds the L2, never zeros."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F

from .op_import import signature
from .protocol import Skip

VALID_OVERRIDES = ('identity', 'l2norm', 'logsigmoid', 'sigmoid')
# NAME=neg:OTHER: the input is minus another one (as built, transform included), for ops whose
# domain ties two inputs together (FLA's DPLR tests draw b = -a, a l2-normalized)
NEG = 'neg:'
VALID_DTYPES = ('bfloat16', 'float16', 'float32')
VALID_MODES = ('fwd', 'fwdbwd')
MAX_SETS_CUDA = 4


def derive_seed(seed: int, set_index: int, salt: str = '') -> int:
    h = hashlib.sha256(f'flaloop:{int(seed)}:{int(set_index)}:{salt}'.encode()).digest()
    return int.from_bytes(h[:8], 'little') & ((1 << 63) - 1)


def iter_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)


def nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def nonfinite(t) -> int:
    if t.is_floating_point() or t.is_complex():
        return int((~torch.isfinite(t)).sum().item())
    return 0


def apply_override(name: str, t):
    if name not in VALID_OVERRIDES:
        raise ValueError(f'unknown override {name!r}; valid: {list(VALID_OVERRIDES)}')
    if not t.is_floating_point():
        raise ValueError(f'override {name!r} needs a floating tensor, got {t.dtype}')
    if name == 'identity':
        return t
    if name == 'l2norm':
        return F.normalize(t.float(), p=2.0, dim=-1).to(t.dtype)
    if name == 'sigmoid':
        return t.sigmoid()
    return F.logsigmoid(t)


def index_dtype_for(param):
    """int32 when the parameter's annotation or default says so, else long (FLA's convention)."""
    default = param.default
    if isinstance(default, torch.Tensor):
        return default.dtype
    ann = param.annotation
    text = ann if isinstance(ann, str) else repr(ann)
    if 'IntTensor' in text or 'int32' in text:
        return torch.int32
    return torch.long


class InputSet:
    __slots__ = ('index', 'gen', 'kwargs', 'leaves', 'do', 'nbytes')

    def __init__(self, index, gen, kwargs, leaves):
        self.index = index
        self.gen = gen
        self.kwargs = kwargs          # everything passed to fn(**kwargs)
        self.leaves = leaves          # [(name, leaf tensor requiring grad)]
        self.do = None                # upstream gradient (fwdbwd)
        self.nbytes = 0

    def tensors(self) -> list:
        """Every tensor a call reads: the inputs and the upstream gradient."""
        return list(iter_tensors(self.kwargs)) + ([self.do] if self.do is not None else [])


class CellSpec:
    """What `setup` asked for, validated against the op's registry entry."""

    def __init__(self, spec: dict, cfg, fn):
        if not isinstance(spec, dict):
            raise ValueError('setup needs "cell": {...}')
        self.cfg, self.fn = cfg, fn
        self.id = str(spec['id'])
        self.mode = spec.get('mode', 'fwd')
        if self.mode not in VALID_MODES:
            raise ValueError(f'mode must be one of {list(VALID_MODES)}, got {self.mode!r}')
        dtype_name = spec.get('dtype', 'bfloat16')
        if dtype_name not in VALID_DTYPES:
            raise ValueError(f'dtype must be one of {list(VALID_DTYPES)}, got {dtype_name!r}')
        self.dtype = getattr(torch, dtype_name)
        self.seed = int(spec.get('seed', 0))
        # a measuring round's own draw (the session picks it per round, the same for both sides):
        # other values of the same domain in every round; '' is the warm-up's draw
        self.draw = str(spec.get('draw') or '')
        self.overrides = dict(spec.get('inputs') or {})
        self.seqlens = spec.get('seqlens')
        self.shape = dict(spec.get('shape') or {})
        self.n_sets_req = spec.get('n_sets')

    def check(self) -> None:
        cfg = self.cfg
        if self.mode == 'fwdbwd' and getattr(cfg, 'skip_backward', False):
            raise Skip(f'op {cfg.name!r} has skip_backward=True (no fwdbwd)')
        for name in self.overrides:
            if name not in cfg.inputs:
                raise ValueError(f'override for unknown input {name!r}; inputs: {list(cfg.inputs)}')
        order = list(cfg.inputs)
        for name, tname in self.overrides.items():
            if tname.startswith(NEG):
                other = tname[len(NEG):]
                if other not in order or order.index(other) >= order.index(name):
                    raise ValueError(f'override {name}={tname}: {other!r} is not an input built before {name!r} '
                                     f'(in order: {order})')
            elif tname not in VALID_OVERRIDES:
                raise ValueError(f'unknown override {tname!r} for {name!r}; valid: {list(VALID_OVERRIDES)} '
                                 f'or {NEG}INPUT')
        if self.seqlens is not None:
            seqlens = [int(x) for x in self.seqlens]
            if not seqlens or any(x <= 0 for x in seqlens):
                raise ValueError(f'seqlens must be positive ints, got {self.seqlens!r}')
            sig = signature(self.fn)
            if sig is None or 'cu_seqlens' not in sig.parameters:
                raise Skip('op takes no cu_seqlens')
            if self.shape.get('B', 1) != 1:
                raise ValueError(f"varlen (seqlens) needs B == 1, got B={self.shape.get('B')}")
            total = sum(seqlens)
            if self.shape.get('T') not in (None, total):
                raise ValueError(f"T={self.shape['T']} != sum(seqlens)={total}")
            self.seqlens = seqlens
            self.shape['B'] = 1
            self.shape['T'] = total
        # a declared op needs the dimensions its expressions name; a registry's shape_fn takes B, T, H, D
        needed = cfg.dims if getattr(cfg, 'declared', False) else ('B', 'T', 'H', 'D')
        for dim in needed:
            if dim not in self.shape:
                raise ValueError(f'shape lacks {dim!r}: {self.shape}')
        constraints = getattr(cfg, 'dim_constraints', None)
        if constraints:
            for dim, allowed in constraints.items():
                val = self.shape.get(dim)
                if val is not None and val not in allowed:
                    raise Skip(f'op {cfg.name!r} requires {dim} in {list(allowed)}, got {val}')

    def dims(self):
        s = self.shape
        extra = {k: v for k, v in s.items() if k not in ('B', 'T', 'H', 'D')}
        return s.get('B'), s.get('T'), s.get('H'), s.get('D'), extra

    def tensor_dtype(self, name: str):
        if name == 'default':
            return self.dtype
        if name == 'long':
            return torch.long
        dt = getattr(torch, str(name), None)
        return dt if isinstance(dt, torch.dtype) else self.dtype

    def varlen_kwargs(self, device) -> dict:
        if self.seqlens is None:
            return {}
        params = signature(self.fn).parameters
        offsets = [0]
        for n in self.seqlens:
            offsets.append(offsets[-1] + n)
        kw = {'cu_seqlens': torch.tensor(offsets, dtype=index_dtype_for(params['cu_seqlens']), device=device)}
        if 'cu_seqlens_cpu' in params:  # lets FLA skip a device->host sync (and so be graph-capturable)
            kw['cu_seqlens_cpu'] = torch.tensor(offsets, dtype=index_dtype_for(params['cu_seqlens_cpu']))
        return kw

    def make_set(self, index: int, varlen_kw: dict, device) -> InputSet:
        cfg = self.cfg
        B, T, H, D, extra = self.dims()
        gen = torch.Generator(device=device)
        gen.manual_seed(derive_seed(self.seed, index, self.draw))
        inputs = {}
        for name, spec in cfg.inputs.items():
            # a declared input may take its value (`from`) or its shape (`like`) from one built before it
            source, like = getattr(spec, 'source', None), getattr(spec, 'like', None)
            dt = self.tensor_dtype(spec.dtype)
            if source is not None:
                t = inputs[source].detach().clone()
            else:
                shape = (tuple(inputs[like].shape) if like is not None
                         else tuple(int(x) for x in spec.shape_fn(B, T, H, D, **extra)))
                if not dt.is_floating_point:
                    lo, hi = getattr(spec, 'int_range', (0, 10))
                    t = torch.randint(int(lo), int(hi), shape, dtype=dt, device=device, generator=gen)
                else:
                    t = torch.randn(shape, dtype=dt, device=device, generator=gen)
            ov = self.overrides.get(name)
            if ov is not None and ov.startswith(NEG):
                t = -inputs[ov[len(NEG):]].detach().clone()
            elif ov is not None:
                t = apply_override(ov, t)
            elif spec.transform is not None:
                t = spec.transform(t)
            if spec.requires_grad and t.is_floating_point():
                t = t.requires_grad_(True)
            inputs[name] = t
        if cfg.post_init is not None:
            # post_init may use the global RNG
            torch.manual_seed(derive_seed(self.seed, index, 'post_init' + (f':{self.draw}' if self.draw else '')))
            cfg.post_init(inputs, **{k: v for k, v in dict(B=B, T=T, H=H, D=D).items() if v is not None}, **extra)
        kwargs = {**inputs, **(cfg.extra_kwargs or {}), **varlen_kw}
        leaves = []
        for name, v in inputs.items():
            items = [(name, v)] if isinstance(v, torch.Tensor) else (
                [(f'{name}.{i}', x) for i, x in enumerate(v)] if isinstance(v, (list, tuple)) else [])
            for lname, x in items:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf and x.is_floating_point():
                    leaves.append((lname, x))
        return InputSet(index, gen, kwargs, leaves)

    def choose_n_sets(self, set_bytes: int, is_cuda: bool, l2_bytes: int | None) -> int:
        if self.n_sets_req is not None:
            n = int(self.n_sets_req)
            if n < 1:
                raise ValueError(f'n_sets must be >= 1, got {n}')
            return n
        if not is_cuda:
            return 1
        return int(min(max(math.ceil(2 * (l2_bytes or 0) / max(set_bytes, 1)), 1), MAX_SETS_CUDA))
