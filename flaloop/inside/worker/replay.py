"""One call of the target's package, built from a structure and a seed, run forward and backward.

Two kinds of call (the warm-up's differential beyond the registry's call, bench/replay.py):

- a test's own call, as the gate's recorder saw it at the base (flaloop/task/testcalls.py): the
  function by module:qualname, each argument as a SPEC (a tensor's shape, dtype and requires_grad;
  a value; a sequence of SPECs). Fresh values from the seed: floating tensors normal, through the
  registry's transform where the parameter's name is an input the registry describes (a gate in
  log space, a normalized key) or the contract's --input override; offsets tensors (`cu_seqlens`
  and the like) rising from 0 to the packed length in distinct steps; boolean tensors all True.
  An integer tensor of another kind has values flaloop cannot know: the call is refused.
- the registry's call on a cell spec with keyword options added (the op's options nobody calls):
  the registry's inputs for the shape, then each option's SPEC; an optional tensor's shape may be
  given as terms of the built inputs' shapes ({"param": "q", "axis": 0, "add": 0}).

Both sides build the same values from the same seed. The call runs with autograd; the backward
goes through every floating output that has a gradient, each with its own seeded cotangent, and
the results are the outputs and the gradients of every input that requires grad.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from .inputs import NEG, CellSpec, apply_override, iter_tensors
from .outputs import flatten_outputs

OFFSET_NAMES = ('cu_seqlens', 'offsets', 'seq_offsets', 'cu_seqlens_cpu', 'cu_seqlens_k', 'cu_seqlens_q')


def resolve(fn_name: str):
    """The function `module:qualname` names (the module imported, the qualname walked)."""
    mod_name, _, qual = fn_name.partition(':')
    obj = importlib.import_module(mod_name)
    for part in qual.split('.'):
        if part == '<locals>':
            raise ValueError(f'{fn_name} is a local function: it cannot be called from outside')
        obj = getattr(obj, part)
    return inspect.unwrap(obj) if getattr(obj, '__flaloop_recorded__', False) else obj


def is_offsets(name: str | None, spec: dict) -> bool:
    t = spec.get('tensor') or {}
    return bool(name) and len(t.get('shape') or []) == 1 and 'int' in str(t.get('dtype')) and (
        name in OFFSET_NAMES or name.endswith('seqlens') or name.endswith('offsets'))


class Builder:
    """Seeded values for SPECs, identical on both sides for the same seed and order."""

    def __init__(self, device, seed: int, cfg=None, overrides: dict | None = None):
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.cfg = cfg
        self.overrides = {k: v for k, v in (overrides or {}).items() if not str(v).startswith(NEG)}
        self.leaves: list[tuple[str, torch.Tensor]] = []

    def tensor(self, name: str, t: dict, packed: int | None = None) -> torch.Tensor:
        shape = [int(n) for n in t['shape']]
        dtype = getattr(torch, str(t['dtype']), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f'{name}: unknown dtype {t["dtype"]!r}')
        device = torch.device('cpu') if name.endswith('_cpu') else self.device
        if dtype == torch.bool:
            return torch.ones(shape, dtype=dtype, device=device)
        if not (dtype.is_floating_point or dtype.is_complex):
            if is_offsets(name, {'tensor': t}):
                return self.offsets(name, shape[0] - 1, packed, dtype, device)
            raise ValueError(f'{name}: an integer tensor {dtype}{shape} whose values flaloop cannot draw')
        x = torch.randn(shape, dtype=torch.float32, device=self.device, generator=self.gen).to(dtype)
        spec = (getattr(self.cfg, 'inputs', None) or {}).get(name.split('.')[0])
        if name in self.overrides:
            x = apply_override(self.overrides[name], x)
        elif spec is not None and getattr(spec, 'transform', None) is not None:
            x = spec.transform(x).to(dtype)
        x = x.to(device)
        if t.get('requires_grad') and x.is_floating_point():
            x = x.detach().requires_grad_(True)
            self.leaves.append((name, x))
        return x

    def offsets(self, name, n: int, packed: int | None, dtype, device) -> torch.Tensor:
        if n < 1 or packed is None or packed < n:
            raise ValueError(f'{name}: {n} sequences cannot be packed into a length of {packed}')
        g = torch.Generator(device='cpu')
        g.manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=self.gen, device=self.device).item()))
        cuts = (torch.randperm(packed - 1, generator=g)[:n - 1] + 1).sort().values.tolist() if n > 1 else []
        return torch.tensor([0, *cuts, packed], dtype=dtype, device=device)

    def value(self, name: str, spec: dict, packed: int | None = None):
        if 'tensor' in spec:
            return self.tensor(name, spec['tensor'], packed)
        if 'value' in spec:
            return spec['value']
        if 'seq' in spec:
            items = [self.value(f'{name}.{i}', s, packed) for i, s in enumerate(spec['seq'])]
            return tuple(items) if spec.get('kind') == 'tuple' else items
        raise ValueError(f'{name}: a {spec.get("opaque", "value")} the test passed cannot be rebuilt')


def _names(fn, n_args: int, kwargs: dict) -> list[str]:
    """The parameter name of each positional argument (arg<i> where the signature does not say)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f'arg{i}' for i in range(n_args)]


def _packed_length(specs: dict[str, dict]) -> int | None:
    """The packed length T of a varlen call: dim 1 of the tensors whose batch dim is 1 (FLA's [B, T, ...])."""
    lengths = [s['tensor']['shape'][1] for s in specs.values()
               if 'tensor' in s and len(s['tensor']['shape']) >= 2 and s['tensor']['shape'][0] == 1]
    return max(set(lengths), key=lengths.count) if lengths else None


def build_test_call(fn, call: dict, builder: Builder) -> tuple[list, dict]:
    args, kwargs = call.get('args') or [], call.get('kwargs') or {}
    names = _names(fn, len(args), kwargs)
    named = {**dict(zip(names, args, strict=True)), **kwargs}
    packed = _packed_length(named)
    # offsets last: their values depend on the others' shapes only, never on the generator's order
    order = sorted(named, key=lambda n: is_offsets(n, named[n]))
    built = {n: builder.value(n, named[n], packed) for n in order}
    return [built[n] for n in names], {k: built[k] for k in kwargs}


def resolve_shape(shape: list, kwargs: dict) -> list[int]:
    """An option tensor's shape: ints, or terms {"param", "axis", "add"} of the built inputs' shapes."""
    out = []
    for d in shape:
        if isinstance(d, dict):
            t = kwargs.get(d['param'])
            if not isinstance(t, torch.Tensor) or t.dim() <= int(d['axis']):
                raise ValueError(f'no {d["param"]} axis {d["axis"]} to take a dimension from')
            out.append(int(t.shape[int(d['axis'])]) + int(d.get('add', 0)))
        else:
            out.append(int(d))
    return out


def build_option_call(worker, cell: dict, options: dict, builder: Builder) -> tuple[list, dict]:
    """The registry's inputs for a cell spec (as a bench cell builds them), then each option."""
    spec = CellSpec(cell, worker.cfg, worker.fn)
    spec.check()
    s = spec.make_set(0, spec.varlen_kwargs(worker.device), worker.device)
    kwargs = dict(s.kwargs)
    builder.leaves.extend(s.leaves)
    for name, o in options.items():
        if 'tensor' in o:
            t = dict(o['tensor'])
            t['shape'] = resolve_shape(t['shape'], kwargs)
            o = {'tensor': t}
        kwargs[name] = builder.value(name, o)
    return [], kwargs


def run(fn, args: list, kwargs: dict, builder: Builder, backward: bool) -> dict:
    """Outputs (out0, out1, out1.0, ...) and, with `backward`, the gradients of every input that
    requires grad (grad_<name>) after a backward through every floating output that has one."""
    res: dict = {}
    if not backward or not builder.leaves:
        with torch.no_grad():
            out = fn(*args, **kwargs)
        flatten_outputs(out, res)
        return {k: v.detach() for k, v in res.items()}
    out = fn(*args, **kwargs)
    flatten_outputs(out, res)
    outs = [t for t in iter_tensors(out) if t.is_floating_point() and t.requires_grad]
    if outs:
        grads = [torch.randn(t.shape, dtype=torch.float32, device=builder.device, generator=builder.gen)
                 .to(device=t.device, dtype=t.dtype) for t in outs]
        torch.autograd.backward(outs, grads)
    for name, leaf in builder.leaves:
        if leaf.grad is not None:
            res[f'grad_{name}'] = leaf.grad
    return {k: v.detach() for k, v in res.items()}
