"""Outputs by name, their differences, and results compared across processes (base vs candidate).

One side's results reach the other either as a file (`save_dump`/`load_dump`: any device) or, on
a GPU, as CUDA IPC handles (`share`/`open_shared`): the other process maps the same device memory,
and nothing is copied to the host. On the H200 the file cost up to 2.7 s a side on the largest fwdbwd
cells (about 1 GB of outputs and gradients by their shapes), twice a cell: 36 s of a warm 12-cell
verify, against 0.6 s with the handles (docs/lab/2026-11-30-h200.md, R7).
"""

from __future__ import annotations

import base64
import io
import math
import os
import pickle

import torch

from .inputs import nonfinite


def flatten_outputs(out, res: dict) -> None:
    """out0, out1, ... for the tensors of the output tuple (out{i}.{j} one level down)."""
    items = out if isinstance(out, (list, tuple)) else (out,)
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            res[f'out{i}'] = x
        elif isinstance(x, (list, tuple)):
            for j, y in enumerate(x):
                if isinstance(y, torch.Tensor):
                    res[f'out{i}.{j}'] = y


def diff_stats(a, b) -> tuple[float, float]:
    """(relative RMS error rms(a-b)/rms(b), max |a-b|) in fp32 over positions finite on both sides; 0/0 = 0."""
    a = a.detach().float()
    b = b.detach().float()
    if a.numel() == 0:
        return 0.0, 0.0
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not bool(fin.all()):
        a, b = a[fin], b[fin]
        if a.numel() == 0:
            return 0.0, 0.0
    d = a - b
    num = float(torch.linalg.vector_norm(d))
    den = float(torch.linalg.vector_norm(b))
    max_abs = float(d.abs().max())
    if num == 0.0:
        return 0.0, max_abs
    if den == 0.0:
        return math.inf, max_abs
    return num / den, max_abs


def same_bits(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a == b) | both_nan).all())
    return bool(torch.equal(a, b))


def max_rel_diff(x: dict, y: dict) -> float:
    """Largest relative RMS difference between two result dicts with the same names (inf if not)."""
    if set(x) != set(y):
        return math.inf
    worst = 0.0
    for name, a in x.items():
        b = y[name]
        if a.shape != b.shape:
            return math.inf
        if a.is_floating_point():
            worst = max(worst, diff_stats(a, b)[0])
        elif not torch.equal(a, b):
            return math.inf
    return worst


def plain(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor, detached: what crosses to the other side is data, never a class of the
    target's (the base loads a dump with weights_only, and the subclass is the probes' to judge)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().as_subclass(torch.Tensor)


def save_dump(tensors: dict, path: str) -> dict:
    tensors = {name: plain(t).to('cpu', copy=True).contiguous() for name, t in tensors.items()}
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f'{path}.tmp{os.getpid()}'
    torch.save(tensors, tmp)
    os.replace(tmp, path)
    return {'path': path, **describe(tensors)}


def load_dump(path: str) -> dict:
    ref = torch.load(path, map_location='cpu', weights_only=True)
    if not isinstance(ref, dict):
        raise ValueError(f'{path} does not hold a dump dict')
    return ref


def share(tensors: dict) -> tuple[str, dict]:
    """(payload, description) of CUDA tensors another process on this GPU can map (`open_shared`).
    The caller keeps the tensors alive until the other side is done with them."""
    from torch.multiprocessing.reductions import reduce_tensor

    items = {}
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f'{name} is on {t.device}, not a GPU: CUDA IPC cannot share it')
        items[name] = reduce_tensor(plain(t))
    payload = base64.b64encode(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)).decode('ascii')
    return payload, describe(tensors)


class _SharedUnpickler(pickle.Unpickler):
    """Only what `share` writes: torch's CUDA tensor rebuilder, tensor and storage classes, dtypes."""

    ALLOWED = {('torch.multiprocessing.reductions', 'rebuild_cuda_tensor'), ('torch', 'Tensor'),
               ('torch', 'Size'), ('torch', 'device'), ('torch', 'UntypedStorage'), ('torch', 'TypedStorage'),
               ('torch.storage', 'UntypedStorage'), ('torch.storage', 'TypedStorage')}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f'shared results may not name {module}.{name}')


def open_shared(payload: str) -> dict:
    """The other side's tensors, mapped from its device memory (read only by convention)."""
    items = _SharedUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out = {}
    for name, (fn, args) in items.items():
        if fn is not rebuild_cuda_tensor:
            raise ValueError(f'{name}: not a shared CUDA tensor')
        out[name] = fn(*args)
    return out


def describe(tensors: dict) -> dict:
    return {
        'names': list(tensors),
        'shapes': {k: list(v.shape) for k, v in tensors.items()},
        'dtypes': {k: str(v.dtype).replace('torch.', '') for k, v in tensors.items()},
        'nonfinite': {k: nonfinite(v) for k, v in tensors.items()},
    }


def compare_results(mine: dict, ref: dict, tol: float) -> dict:
    """Compare my results with the other side's: per tensor shapes, rel-RMS, non-finite."""
    names = list(mine) + [k for k in ref if k not in mine]
    tensors = {}
    match = True
    for name in names:
        a, b = mine.get(name), ref.get(name)
        entry = {
            'shape': list(a.shape) if a is not None else None,
            'shape_ref': list(b.shape) if isinstance(b, torch.Tensor) else None,
            'dtype': str(a.dtype).replace('torch.', '') if a is not None else None,
            'dtype_ref': str(b.dtype).replace('torch.', '') if isinstance(b, torch.Tensor) else None,
            'nonfinite_self': nonfinite(a) if a is not None else None,
            'nonfinite_ref': nonfinite(b) if isinstance(b, torch.Tensor) else None,
            'rel_rms': None,
            'max_abs': None,
            'missing': None,
        }
        if a is None:
            entry['missing'] = 'self'
        elif not isinstance(b, torch.Tensor):
            entry['missing'] = 'ref'
        elif tuple(a.shape) == tuple(b.shape):
            rel, mx = diff_stats(a, b.to(a.device))
            entry['rel_rms'], entry['max_abs'] = rel, mx
        ok = (entry['missing'] is None and entry['shape'] == entry['shape_ref']
              and entry['rel_rms'] is not None and entry['rel_rms'] <= tol
              and entry['nonfinite_self'] == 0 and entry['nonfinite_ref'] == 0)
        entry['match'] = ok
        match = match and ok
        tensors[name] = entry
    return {'match': match, 'tol': tol, 'tensors': tensors}
