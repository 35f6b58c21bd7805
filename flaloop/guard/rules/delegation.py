"""ref-call and vendor-compute: the op handing its work to someone else's code."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from flaloop.guard.rules.check import FileContext, Hit
from flaloop.guard.rules.walk import method_name, outermost_chains
from flaloop.guard.source import Source

TEST_MODULES = ("torch.testing", "numpy.testing", "pytest", "_pytest", "unittest", "hypothesis")
VENDOR_CALLS = frozenset({
    "torch.matmul", "torch.mm", "torch.bmm", "torch.baddbmm", "torch.addmm", "torch.addbmm", "torch.addmv",
    "torch.mv", "torch.einsum", "torch.tensordot", "torch.inner", "torch.outer", "torch.chain_matmul",
    "torch.nn.functional.linear", "torch.nn.functional.bilinear", "torch.nn.functional.scaled_dot_product_attention",
    "torch._scaled_mm", "torch._int_mm", "torch.nn.Linear", "torch.Tensor.matmul", "einops.einsum",
    "opt_einsum.contract", "torch.nn.attention.flex_attention.flex_attention", "torch.compile",
})
# Libraries of ready-made kernels. `cutlass` alone is not one: since CUTLASS 4 it is the CuTe DSL, a
# language the op's own kernels are written in (`cutlass.cute`); its prebuilt GEMMs are reached
# through the older CUTLASS Python interface (`cutlass.op`, `cutlass.emit`, now `cutlass_cppgen`).
# Matched as whole module names, except the first: any module whose name starts with it
# (FlashAttention 3 is `flash_attn_interface`, xformers' kernels `xformers.ops`).
VENDOR_NAME_STARTS = ("flash_attn", "xformers")
VENDOR_LIBRARIES = ("flashinfer", "quack", "cutlass.op", "cutlass.emit", "cutlass_cppgen", "cutlass_library")
VENDOR_PREFIXES = ("torch.linalg.", "torch.ops.aten.", "torch._C._nn.")
VENDOR_METHODS = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "mv", "__matmul__", "__rmatmul__"})
# The decorators that make a function a kernel the op compiles itself, per language FLA ships.
KERNEL_DECORATORS = {
    "Triton": ("triton.jit", "triton.autotune", "triton.heuristics", "triton.language.jit"),
    "Gluon": ("triton.experimental.gluon.jit", "triton.experimental.gluon.language.jit"),
    "CuTe DSL": ("cutlass.cute.kernel", "cutlass.cute.jit"),
    "TileLang": ("tilelang.jit", "tilelang.lazy_jit", "tilelang.language.prim_func"),
}


def _testy(dotted: str) -> bool:
    """A test module, a naive reference, or pytest-like machinery."""
    if any(dotted == m or dotted.startswith(m + ".") for m in TEST_MODULES):
        return True
    return any(seg in ("naive", "tests", "conftest") or seg.startswith(("naive_", "test_")) or seg.endswith("_test")
               for seg in dotted.split("."))


def check_ref_call(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "ref-call"
    if not ctx.op_code:
        return
    for node, mod, name in src.imported_modules():
        full = f"{mod}.{name}" if name else mod
        if _testy(full):
            yield Hit(rule, f"import:{full}", node, f"`{src.snippet(node)}` imports {full} into the op")
            continue
        f = ctx.resolve(mod, name)
        if f and f in ctx.references:
            yield Hit(rule, f"import:{full}", node,
                      f"`{src.snippet(node)}` imports from {f}, which the gate uses as its reference "
                      f"({ctx.references[f]})")
    for node, dotted in outermost_chains(src):
        if not isinstance(getattr(node, "ctx", None), ast.Load):
            continue
        last = dotted.rsplit(".", 1)[-1]
        ref = _reference_file(dotted, ctx) if dotted.startswith(ctx.package + ".") else None
        if ref:
            yield Hit(rule, f"ref:{dotted}", node, f"`{src.snippet(src.parent.get(node) or node)}` uses {dotted}, "
                                                  f"defined in {ref}, which the gate uses as its reference")
        elif last.startswith("naive"):
            yield Hit(rule, f"ref:{last}", node, f"`{src.snippet(src.parent.get(node) or node)}` uses {dotted}")
        elif dotted.startswith(("torch.testing.", "numpy.testing.")):
            yield Hit(rule, f"ref:{dotted}", node, f"`{src.snippet(node)}` uses {dotted} in the op")
    for node in src.walk():  # getattr(module, "naive_x")
        if isinstance(node, ast.Call) and (m := method_name(node)) and m.startswith("naive") \
                and not isinstance(node.func, ast.Attribute):
            yield Hit(rule, f"ref:{m}", node, f"`{src.snippet(node)}` calls {m}")


def _reference_file(dotted: str, ctx: FileContext) -> str | None:
    """The frozen reference file that defines `pkg.mod.name` (through re-exports), if any."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        f = ctx.resolve(".".join(parts[:i]), parts[i])
        if f:
            return f if f in ctx.references else None
    return None


def _within(dotted: str, names: tuple[str, ...]) -> bool:
    return any(dotted == n or dotted.startswith(n + ".") for n in names)


def kernel_languages(src: Source) -> set[str]:
    """The languages of KERNEL_DECORATORS that this file defines kernels in."""
    found = set()
    for node in src.walk():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                dotted = src.qualify(d.func if isinstance(d, ast.Call) else d) or ""
                found.update(lang for lang, decorators in KERNEL_DECORATORS.items() if _within(dotted, decorators))
    return found


def has_own_kernels(src: Source) -> bool:
    return bool(kernel_languages(src))


def vendor_library(dotted: str) -> bool:
    """Whether a module or a name in one is a library of ready-made kernels."""
    return dotted.startswith(VENDOR_NAME_STARTS) or _within(dotted, VENDOR_LIBRARIES)


def check_vendor(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "vendor-compute"
    if not (ctx.op_code and ctx.kernel_base):
        return
    for node in src.walk():
        if isinstance(node, ast.Call):
            dotted = src.call_name(node) or ""
            if dotted in VENDOR_CALLS or dotted.startswith(VENDOR_PREFIXES) or vendor_library(dotted) \
                    or "cublas" in dotted.lower():
                yield Hit(rule, f"call:{dotted}", node, f"`{src.snippet(node)}` computes with {dotted}")
            elif not dotted and method_name(node.func) in VENDOR_METHODS:
                yield Hit(rule, f"method:{method_name(node.func)}", node,
                          f"`{src.snippet(node)}` computes with Tensor.{method_name(node.func)}")
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult):
            yield Hit(rule, "op:@", node, f"`{src.snippet(node)}` computes with the @ operator (a library GEMM)")
    for node in src.walk():  # @torch.compile
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if not isinstance(d, ast.Call) and src.qualify(d) in VENDOR_CALLS:
                    yield Hit(rule, f"call:{src.qualify(d)}", d, f"@{src.snippet(d)} on {node.name}()")
    for node, mod, name in src.imported_modules():
        full = f"{mod}.{name}" if name else mod
        if vendor_library(full):
            yield Hit(rule, f"import:{full}", node, f"`{src.snippet(node)}` imports a vendor kernel library")


CHECKS = [check_ref_call, check_vendor]
