
from dataclasses import dataclass, field

import torch


def shape_BTHD(B, T, H, D, **kw):
    return (B, T, H, D)


def neg_abs(t):
    return -t.abs() - 0.1


@dataclass
class TensorSpec:
    shape_fn: object
    requires_grad: bool = True
    dtype: str = 'default'
    transform: object = None


@dataclass
class OpConfig:
    name: str
    import_path: str
    inputs: dict
    func_name: str = None
    extra_kwargs: dict = field(default_factory=dict)
    output_is_tuple: bool = True
    skip_backward: bool = False
    post_init: object = None
    category: str = ''
    dim_constraints: dict = None
    default_shapes: dict = None
    test_file: str = None
    backend_env: dict = None


SHAPE_CONFIGS = {
    'B2_T64_H2_D16': {'B': 2, 'T': 64, 'H': 2, 'D': 16},
    'B1_T128_H2_D32': {'B': 1, 'T': 128, 'H': 2, 'D': 32},
}
_REGISTRY = {}


def register_op(config):
    _REGISTRY[config.name] = config


def get_op(name):
    return _REGISTRY[name]


def list_ops():
    return sorted(_REGISTRY)


register_op(OpConfig(
    name='toy_attn', import_path='toyop.ops.toy',
    inputs={'q': TensorSpec(shape_BTHD), 'k': TensorSpec(shape_BTHD), 'v': TensorSpec(shape_BTHD)},
))
register_op(OpConfig(
    name='toy_log', import_path='toyop.ops.toy', func_name='toy_log',
    inputs={'q': TensorSpec(shape_BTHD, transform=neg_abs)}, test_file='tests/ops/test_toy.py',
))
