"""numeric-tf32 and numeric-narrow: speed bought with precision."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from flaloop.guard.rules.check import FileContext, Hit
from flaloop.guard.rules.walk import attribute_writes, is_docstring, statement
from flaloop.guard.source import Source, const_str

# process-wide switches that let fp32 matmuls and reductions run in lower precision
RELAX_FLAGS = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
PRECISION_KNOBS = ("fp32_precision", "fp32_default")  # torch.backends.*.fp32_precision, triton.knobs.language
NUMERIC_ENV = frozenset({"TRITON_F32_DEFAULT", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"})
STRICT_VALUES = (False, 0, "ieee", "highest", "none")
NARROW_NAMES = {"bfloat16", "float16", "half", "bf16", "fp16", "HalfTensor", "BFloat16Tensor"}
DTYPE_KEYWORDS = ("dtype", "out_dtype", "acc_dtype", "accum_dtype", "cast_inputs")
AUTOCAST = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
            "torch.amp.autocast_mode.autocast")


def _literal(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else ...


def _relaxing(value: ast.AST | None) -> bool:
    """A flag set to something other than a literal strict value (a variable counts: it may be True)."""
    v = _literal(value)
    return v is ... or v not in STRICT_VALUES


def check_tf32(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "numeric-tf32"
    used: set[str] = set()  # module constants passed as a dot's input_precision
    for node, dotted, value in attribute_writes(src):
        if not dotted:
            continue
        last = dotted.rsplit(".", 1)[-1]
        if last in RELAX_FLAGS + PRECISION_KNOBS and _relaxing(value):
            yield Hit(rule, f"flag:{last}", node, f"`{src.snippet(node)}` sets {dotted}")
    for node in src.walk():
        # the variable's name anywhere (a write in any spelling: [..] =, setdefault, update, putenv, a dict)
        name = node.value if isinstance(node, ast.Constant) else node.arg if isinstance(node, ast.keyword) else None
        if name in NUMERIC_ENV and not is_docstring(src, node):
            yield Hit(rule, f"env:{name}", node, f"`{src.snippet(statement(src, node))}` sets {name} "
                                                  "(fp32 dots run as TF32)")
        if not isinstance(node, ast.Call):
            continue
        fn = src.call_name(node) or ""
        if fn.endswith("set_float32_matmul_precision"):
            arg = node.args[0] if node.args else next((k.value for k in node.keywords), None)
            if _relaxing(arg):
                yield Hit(rule, "call:set_float32_matmul_precision", node, f"`{src.snippet(node)}`")
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if fn.rsplit(".", 1)[-1] == "dot" and len(node.args) >= 4:  # tl.dot(a, b, acc, input_precision, allow_tf32)
            kw.setdefault("input_precision", node.args[3])
            if len(node.args) >= 5:
                kw.setdefault("allow_tf32", node.args[4])
        if "input_precision" in kw and _relaxing(kw["input_precision"]):
            arg = kw["input_precision"]
            lit = const_str(arg)
            named = src.str_constants.get(arg.id, []) if isinstance(arg, ast.Name) else []
            if lit:
                yield Hit(rule, f"dot:input_precision={lit}", node, f"`{src.snippet(node)}`: input_precision {lit!r}")
            elif named:
                used.add(arg.id)  # judged where the constant is set, below
            else:
                yield Hit(rule, "dot:input_precision=?", node, f"`{src.snippet(node)}`: input_precision is not a "
                          "literal (cannot tell it is 'ieee')", severity="warn")
        if "allow_tf32" in kw and _relaxing(kw["allow_tf32"]):
            yield Hit(rule, "dot:allow_tf32", node, f"`{src.snippet(node)}`: allow_tf32")
    for name in sorted(used):
        for stmt, value in src.str_constants[name]:
            if _relaxing(ast.Constant(value)):
                yield Hit(rule, f"precision-const:{name}={value}", stmt,
                          f"`{src.snippet(stmt)}`: tl.dot calls take input_precision {value!r} from {name}")


def narrow_dtype(src: Source, node: ast.AST | None) -> str | None:
    """`torch.bfloat16`, `tl.float16`, `torch.float8_e4m3fn`... as a dotted name, else None."""
    if node is None:
        return None
    dotted = src.qualify(node) or ""
    if not dotted.startswith(("torch.", "triton.language.")):
        return None
    last = dotted.rsplit(".", 1)[-1]
    return dotted if last in NARROW_NAMES or last.startswith("float8") else None


def _method(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def check_narrow(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "numeric-narrow"
    for node in src.walk():
        if not isinstance(node, ast.Call):
            continue
        fn = src.call_name(node) or ""
        method = _method(node)
        if method in ("to", "type") or fn.endswith("language.cast"):
            # any narrow dtype inside the arguments, or in what a variable argument was assigned:
            # `.to(torch.bfloat16)`, `.to(dtype=lo)`, `.to(q.dtype if c else torch.bfloat16)`, `dt = ...; .to(dt)`
            args = [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]
            seen = [n for a in args for n in ast.walk(a)]
            seen += [n for name in seen if isinstance(name, ast.Name) for v in src.assigned(name) for n in ast.walk(v)]
            dtypes = [narrow_dtype(src, n) for n in seen]
            dt = next((d for d in dtypes if d), None)
            if dt:
                outer = src.parent.get(node)
                trip = isinstance(outer, ast.Attribute) and outer.attr in ("to", "type") and outer.value is node
                yield Hit(rule, f"cast:{dt}", node,
                          f"`{src.snippet(src.parent.get(outer) if trip else node)}`: "
                          + (f"round trip through {dt}" if trip else f"cast to {dt}"))
            continue
        if method in ("half", "bfloat16") and not node.args:
            yield Hit(rule, f"cast:{method}", node, f"`{src.snippet(node)}`: cast to {method}")
            continue
        if fn in AUTOCAST or fn.endswith(".custom_fwd") and any(k.arg == "cast_inputs" for k in node.keywords):
            yield Hit(rule, f"autocast:{fn}", node, f"`{src.snippet(node)}`: autocast lowers matmul precision")
            continue
        if fn.endswith("set_default_dtype") and node.args and narrow_dtype(src, node.args[0]):
            yield Hit(rule, "default-dtype", node, f"`{src.snippet(node)}`")
            continue
        for k in node.keywords:
            if k.arg in DTYPE_KEYWORDS and (dt := narrow_dtype(src, k.value)):
                what = "accumulator" if fn.endswith(("language.zeros", "language.full")) else k.arg
                yield Hit(rule, f"{k.arg}:{dt}", node, f"`{src.snippet(node)}`: {what} in {dt}")
    for node in src.walk():  # `with torch.autocast(...)` as a decorator or context without a call
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if not isinstance(d, ast.Call) and (src.qualify(d) or "") in AUTOCAST:
                    yield Hit(rule, "autocast", d, f"@{src.snippet(d)}")


CHECKS = [check_tf32, check_narrow]
