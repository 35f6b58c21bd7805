"""Registry of benchmarkable ops: how to build each op's inputs, and at which shapes.

A benchmark runner never hard-codes an op.  It looks the op up here by name, builds
its inputs with :func:`generate_inputs`, imports ``config.import_path`` and calls
``getattr(module, config.func_name or config.name)(**inputs, **config.extra_kwargs)``.
The op's correctness gate is its pytest file, ``tests/ops/test_<last segment of
import_path>.py`` unless ``test_file`` says otherwise.

This module imports only torch, never ``minifla``: listing ops and building inputs
must work even when the package under test is broken.

How to add an op
----------------
1. Describe every tensor argument with a :class:`TensorSpec`.  ``shape_fn`` maps the
   benchmark's ``(B, T, H, D)`` (plus any extra shape keys) to the tensor's shape; use
   the ``shape_*`` helpers below or write your own.  ``dtype='default'`` follows the
   benchmark dtype; ``'float32'`` and ``'long'`` pin it.  ``transform`` post-processes
   the random tensor (e.g. ``sigmoid_transform`` for a gate in (0, 1)).  Inputs that
   must not receive gradients get ``requires_grad=False``.
2. Register an :class:`OpConfig`::

       register_op(OpConfig(
           name='chunk_my_op',                    # the function's name, and the registry key
           import_path='minifla.ops.my_op',       # module that exports it
           inputs={
               'q': TensorSpec(shape_BTHD),
               'k': TensorSpec(shape_BTHD),
               'v': TensorSpec(shape_BTHD),
               'g': TensorSpec(shape_BTH, transform=sigmoid_transform),
           },
           extra_kwargs={'scale': 0.125},         # constant keyword arguments
           category='gated',
       ))

   Use ``func_name`` when the function's name differs from ``name``,
   ``output_is_tuple=False`` when the op returns a bare tensor, ``skip_backward=True``
   for forward-only ops, ``dim_constraints={'D': [64, 128]}`` to skip unsupported
   shapes, ``default_shapes`` for ops whose shapes are not B/T/H/D, ``post_init`` to
   fix up inputs after creation, ``test_file`` when the gate is not at the derived
   path, and ``backend_env`` to map a ``--backend`` name to the environment variable
   that selects it.
3. Check it: ``python -c "from benchmarks.ops.registry import get_op, generate_inputs;
   print(generate_inputs(get_op('chunk_my_op'), 1, 64, 2, 32, device='cpu').keys())"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Shape helpers: (B, T, H, D, **extra) -> shape tuple
# ---------------------------------------------------------------------------

def shape_BTHD(B, T, H, D, **kw):
    """Per-head activations such as q, k, v: [B, T, H, D]."""
    return (B, T, H, D)


def shape_BTH(B, T, H, D, **kw):
    """One scalar per (token, head), e.g. a gate or beta: [B, T, H]."""
    return (B, T, H)


def shape_BTD(B, T, H, D, **kw):
    """Heads flattened into the hidden size: [B, T, H*D]."""
    return (B, T, H * D)


def shape_BHDD(B, T, H, D, **kw):
    """A recurrent state per (sequence, head): [B, H, D, D]."""
    return (B, H, D, D)


def shape_H(B, T, H, D, **kw):
    return (H,)


def shape_HD(B, T, H, D, **kw):
    return (H, D)


def shape_D(B, T, H, D, **kw):
    return (D,)


# ---------------------------------------------------------------------------
# Transforms applied to a freshly drawn random tensor
# ---------------------------------------------------------------------------

def sigmoid_transform(t: torch.Tensor) -> torch.Tensor:
    return t.sigmoid()


def logsigmoid_transform(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.logsigmoid(t)


def l2norm_transform(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(t, p=2, dim=-1)


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------

@dataclass
class TensorSpec:
    """How to create one input tensor.

    Args:
        shape_fn: ``(B, T, H, D, **extra) -> tuple`` giving the shape.
        requires_grad: make the tensor a leaf that requires grad (floating dtypes only).
        dtype: ``'default'`` (the benchmark's dtype), ``'float32'`` or ``'long'``.
        transform: applied to the random tensor before ``requires_grad`` is set.
    """
    shape_fn: Callable
    requires_grad: bool = True
    dtype: str = 'default'
    transform: Callable | None = None


@dataclass
class OpConfig:
    """One registry entry.

    Args:
        name: registry key and display name; also the function name unless ``func_name``.
        import_path: module exporting the function, e.g. ``'minifla.ops.linear_attn'``.
        inputs: argument name -> :class:`TensorSpec`, in call order.
        func_name: function attribute to call when it differs from ``name``.
        extra_kwargs: constant keyword arguments for every call.
        output_is_tuple: the op returns a tuple whose first item is the output to backprop.
        skip_backward: benchmark the forward pass only.
        post_init: ``post_init(inputs, B=, T=, H=, D=, **extra)`` may edit the inputs in place.
        category: free-form grouping label for reports.
        dim_constraints: e.g. ``{'D': [64, 128]}``; other shapes raise ValueError in
            :func:`generate_inputs` and should be skipped.
        default_shapes: shape configs to use instead of :data:`SHAPE_CONFIGS`.
        test_file: pytest gate, relative to the repo root; None derives
            ``tests/ops/test_<last segment of import_path>.py``.
        backend_env: ``--backend`` name -> environment variable that enables it.
    """
    name: str
    import_path: str
    inputs: dict[str, TensorSpec]
    func_name: str | None = None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    output_is_tuple: bool = True
    skip_backward: bool = False
    post_init: Callable | None = None
    category: str = ''
    dim_constraints: dict | None = None
    default_shapes: dict[str, dict[str, int]] | None = None
    test_file: str | None = None
    backend_env: dict[str, str] | None = None


# ---------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------

_REGISTRY: dict[str, OpConfig] = {}


def register_op(config: OpConfig) -> None:
    """Add (or replace) an op."""
    if config.name in _REGISTRY:
        logger.warning("op %r registered twice; keeping the later entry", config.name)
    _REGISTRY[config.name] = config


def get_op(name: str) -> OpConfig:
    """Look an op up by name; KeyError lists what is registered."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"op {name!r} is not registered; available: {', '.join(list_ops()) or '(none)'}") from None


def list_ops() -> list[str]:
    """Names of all registered ops, sorted."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------
# Shapes: the small ones run under TRITON_INTERPRET=1 on a CPU in well under a
# second; the large ones are for timing on a GPU.
# ---------------------------------------------------------------------------

SHAPE_CONFIGS: dict[str, dict[str, int]] = {
    # CPU-friendly
    'B1_T64_H2_D32':     {'B': 1, 'T': 64,   'H': 2,  'D': 32},
    'B2_T100_H2_D16':    {'B': 2, 'T': 100,  'H': 2,  'D': 16},
    # GPU-sized
    'B8_T1024_H8_D64':   {'B': 8, 'T': 1024, 'H': 8,  'D': 64},
    'B4_T2048_H16_D64':  {'B': 4, 'T': 2048, 'H': 16, 'D': 64},
    'B2_T4096_H16_D128': {'B': 2, 'T': 4096, 'H': 16, 'D': 128},
}


# ---------------------------------------------------------------------------
# Input factory
# ---------------------------------------------------------------------------

_DTYPES = {'float32': torch.float32, 'long': torch.long}


def generate_inputs(
    config: OpConfig,
    B: int,
    T: int,
    H: int,
    D: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = 'cuda',
    **extra_shape_kw,
) -> dict[str, torch.Tensor]:
    """Build the keyword arguments (tensors only) for one call of ``config``'s op.

    Raises ValueError when the shape violates ``config.dim_constraints``; callers skip it.
    ``extra_kwargs`` are not included: pass them separately.
    """
    dims = {'B': B, 'T': T, 'H': H, 'D': D, **extra_shape_kw}
    for dim, allowed in (config.dim_constraints or {}).items():
        if dim in dims and dims[dim] not in allowed:
            raise ValueError(f"op {config.name!r} needs {dim} in {list(allowed)}, got {dims[dim]}")

    inputs: dict[str, torch.Tensor] = {}
    for arg, spec in config.inputs.items():
        shape = tuple(spec.shape_fn(B, T, H, D, **extra_shape_kw))
        tensor_dtype = dtype if spec.dtype == 'default' else _DTYPES.get(spec.dtype)
        if tensor_dtype is None:
            raise ValueError(f"{config.name}.{arg}: unknown TensorSpec dtype {spec.dtype!r}")
        if tensor_dtype == torch.long:
            t = torch.randint(0, 16, shape, dtype=torch.long, device=device)
        else:
            t = torch.randn(shape, dtype=tensor_dtype, device=device)
        if spec.transform is not None:
            t = spec.transform(t)
        if spec.requires_grad and t.is_floating_point():
            t = t.detach().requires_grad_(True)
        inputs[arg] = t

    if config.post_init is not None:
        config.post_init(inputs, B=B, T=T, H=H, D=D, **extra_shape_kw)
    return inputs


# ===========================================================================
# Registered ops
# ===========================================================================

_QKV = {
    'q': TensorSpec(shape_BTHD),
    'k': TensorSpec(shape_BTHD),
    'v': TensorSpec(shape_BTHD),
}

register_op(OpConfig(
    name='chunk_linear_attn',
    import_path='minifla.ops.linear_attn',
    inputs=dict(_QKV),
    category='simple_qkv',
))

# The same op one timestep at a time: the chunk test's reference, and an op of its own.
register_op(OpConfig(
    name='fused_recurrent_linear_attn',
    import_path='minifla.ops.linear_attn',
    inputs=dict(_QKV),
    category='simple_qkv',
    test_file='tests/ops/test_linear_attn.py',
))
