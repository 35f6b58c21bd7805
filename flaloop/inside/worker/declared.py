"""An op declared in flaloop.toml rather than in the target's registry: the declaration arrives as
JSON (flaloop/task/opdecl.py checked and normalized it on the orchestrator) and is turned here into an
object shaped like a registry's OpConfig, so that the rest of the worker builds, calls and checks
its cells exactly as it does a registry op's.

Shape expressions arrive parsed: an int, a dimension's name, or [operator, operand, ...]."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

# The transforms a declaration may chain; flaloop/task/opdecl.py reads these two names from this
# source (the orchestrator never imports the worker), so they stay literal tuples.
DECLARED_TRANSFORMS = ('identity', 'sigmoid', 'logsigmoid', 'l2norm', 'neg', 'abs', 'exp', 'tanh', 'softplus')
PARAM_TRANSFORMS = ('scale', 'add', 'clamp_min', 'clamp_max')
EXPR_OPS = ('+', '-', '*', '//', '%', 'neg', 'max', 'min', 'cdiv')


def evaluate(expr, dims: dict) -> int:
    if isinstance(expr, bool):
        raise ValueError(f'not a shape expression: {expr!r}')
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        if expr not in dims:
            raise ValueError(f'the shape has no dimension {expr!r}: {dims}')
        return int(dims[expr])
    op, *args = expr
    vals = [evaluate(a, dims) for a in args]
    if op == 'neg':
        return -vals[0]
    if op == 'max':
        return max(vals)
    if op == 'min':
        return min(vals)
    a, b = vals
    if op == '+':
        return a + b
    if op == '-':
        return a - b
    if op == '*':
        return a * b
    if op == '//':
        return a // b
    if op == '%':
        return a % b
    if op == 'cdiv':
        return -(-a // b)
    raise ValueError(f'unknown operator {op!r} in a shape expression')


def _one(step, t):
    name, arg = step[0], (step[1] if len(step) > 1 else None)
    if name == 'identity':
        return t
    if name == 'sigmoid':
        return t.sigmoid()
    if name == 'logsigmoid':
        return F.logsigmoid(t)
    if name == 'l2norm':
        return F.normalize(t.float(), p=2.0, dim=-1).to(t.dtype)
    if name == 'neg':
        return -t
    if name == 'abs':
        return t.abs()
    if name == 'exp':
        return t.exp()
    if name == 'tanh':
        return t.tanh()
    if name == 'softplus':
        return F.softplus(t)
    if name == 'scale':
        return t * float(arg)
    if name == 'add':
        return t + float(arg)
    if name == 'clamp_min':
        return t.clamp_min(float(arg))
    if name == 'clamp_max':
        return t.clamp_max(float(arg))
    raise ValueError(f'unknown transform {name!r}; valid: {list(DECLARED_TRANSFORMS + PARAM_TRANSFORMS)}')


def chain(steps):
    """The transform of a list of steps ([name] or [name, number]), applied in order; None for none."""
    if not steps:
        return None

    def transform(t):
        for step in steps:
            t = _one(step, t)
        return t
    transform.__name__ = '+'.join(':'.join(map(str, s)) for s in steps)
    return transform


class DeclaredInput:
    """One input: TensorSpec's fields, plus what only a declaration says (its ties, its int range)."""

    def __init__(self, d: dict):
        self.shape = d.get('shape')
        self.like = d.get('like')          # shape of another input built before this one
        self.source = d.get('from')        # value of another input (a detached copy), then transforms
        self.requires_grad = bool(d.get('requires_grad', True))
        self.dtype = d.get('dtype', 'default')
        self.transform = chain(d.get('transform'))
        self.int_range = tuple(d.get('range') or (0, 10))
        self.unbind = d.get('unbind')

    def shape_fn(self, B=None, T=None, H=None, D=None, **extra):
        dims = {k: v for k, v in dict(B=B, T=T, H=H, D=D, **extra).items() if v is not None}
        return tuple(evaluate(e, dims) for e in self.shape)


class DeclaredOp:
    """Has the attributes of a registry OpConfig that the worker reads."""

    declared = True

    def __init__(self, d: dict):
        self.name = d['name']
        self.import_path = d['import_path']
        self.func_name = d.get('func_name') or d['name']
        self.inputs = {k: DeclaredInput(v) for k, v in d['inputs'].items()}
        self.extra_kwargs = dict(d.get('extra_kwargs') or {})
        self.shape_kwargs = dict(d.get('shape_kwargs') or {})
        tup = d.get('output_is_tuple', True)
        self.output_is_tuple = None if tup is None else bool(tup)  # None: decided by what it returns
        self.skip_backward = bool(d.get('skip_backward', False))
        self.category = d.get('category', '')
        self.dim_constraints = d.get('dim_constraints')
        self.default_shapes = d.get('default_shapes')
        self.test_file = d.get('test_file')
        self.backend_env = d.get('backend_env')
        self.dims = list(d.get('dims') or [])
        needs_post = self.shape_kwargs or any(s.unbind is not None for s in self.inputs.values())
        self.post_init = self._post_init if needs_post else None

    def _post_init(self, inputs, **dims):
        for name, spec in self.inputs.items():
            t = inputs[name]
            if spec.unbind is not None and isinstance(t, torch.Tensor):  # a list of tensors, e.g. residuals
                grad = t.requires_grad
                inputs[name] = [x.detach().clone().requires_grad_(grad) for x in t.unbind(int(spec.unbind))]
        for key, expr in self.shape_kwargs.items():
            inputs[key] = evaluate(expr, dims)


class DeclaredRegistry:
    """What the worker asks a registry module for: get_op, list_ops."""

    def __init__(self, doc: dict):
        self.op = DeclaredOp(doc)

    def get_op(self, name: str) -> DeclaredOp:
        if name != self.op.name:
            raise KeyError(f'op {name!r} is not the one declared here ({self.op.name!r})')
        return self.op

    def list_ops(self) -> list[str]:
        return [self.op.name]


def load(path: str) -> DeclaredRegistry:
    with open(path, encoding='utf-8') as fh:
        return DeclaredRegistry(json.load(fh))
