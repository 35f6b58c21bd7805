"""Rules about the op reaching outside itself: the harness, the process, the driver, the environment.

concurrency, timer-patch, lib-patch, introspection, driver-l2, env-write, env-read, tensor-subclass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from flaloop.guard.findings import WARN
from flaloop.guard.rules.check import FileContext, Hit
from flaloop.guard.rules.numeric import NUMERIC_ENV, PRECISION_KNOBS, RELAX_FLAGS
from flaloop.guard.rules.walk import (
    ENVIRON,
    MUTATORS,
    attribute_writes,
    env_write_nodes,
    env_writes,
    is_docstring,
    method_name,
    outermost_chains,
    targets,
)
from flaloop.guard.source import Source, const_str


def _under(dotted: str, prefixes: tuple[str, ...]) -> str | None:
    """The prefix `dotted` lies under (segment-wise; a prefix ending in '*' matches any continuation)."""
    for p in prefixes:
        if p.endswith("*") and dotted.startswith(p[:-1]):
            return p[:-1]
        if dotted == p or dotted.startswith(p + "."):
            return p
    return None


# -- concurrency ----------------------------------------------------------------------------------

CONCURRENCY = ("torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.ExternalStream", "torch.cuda.set_stream",
               "torch.cuda.streams", "torch.cuda.StreamContext", "torch.Stream", "torch.cpu.Stream",
               "threading", "_thread", "concurrent", "multiprocessing", "torch.multiprocessing", "subprocess",
               "os.fork", "os.forkpty", "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp", "os.spawn*",
               "os.exec*", "os.register_at_fork", "pty", "asyncio", "atexit", "signal", "sched", "weakref.finalize",
               "torch.jit.fork", "torch.jit._fork", "torch.futures")
HARMLESS_SYNC = frozenset({"threading.Lock", "threading.RLock", "threading.get_ident", "threading.local"})


def check_concurrency(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "concurrency"
    for node, dotted in outermost_chains(src):  # uses, however imported (an import alone does nothing)
        if (p := _under(dotted, CONCURRENCY)) and dotted not in HARMLESS_SYNC:
            yield Hit(rule, f"use:{p}", node, f"`{src.snippet(src.parent.get(node) or node)}` uses {dotted}")


# -- timer-patch and lib-patch --------------------------------------------------------------------

# a write under these roots changes what the harness times or what the reference computes
PATCH_BLOCK = ("torch", "time", "timeit", "triton", "pytest", "_pytest", "numpy", "unittest", "builtins",
               "__builtins__", "sys", "gc", "inspect", "importlib", "os", "math", "functools", "operator",
               "threading", "flaloop")
# documented configuration objects: a warning, not a block
LIB_CONFIG = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config", "torch.backends",
              "torch.cuda.matmul", "triton.knobs", "triton.config")
CHECKER_NAMES = frozenset({"assert_close", "allclose", "isclose", "elapsed_time", "synchronize", "perf_counter",
                           "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "do_bench",
                           "do_bench_cudagraph", "get_err_ratio", "get_abs_err"})
TIMER_CLASSES = ("torch.cuda.Event", "torch.Event", "torch.cuda.CUDAGraph", "torch.cuda.Stream")
MOCK = ("unittest.mock.patch", "mock.patch", "pytest.MonkeyPatch", "_pytest.monkeypatch")


def _frozen_module(ctx: FileContext, dotted: str) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        f = ctx.resolve(".".join(parts[:i]), None)
        if f and f in ctx.frozen:
            return f
    return None


def _written_name(node: ast.AST) -> str | None:
    """The attribute name an assignment or setattr writes, whatever the object."""
    for t in targets(node):
        if isinstance(t, ast.Attribute):
            return t.attr
    if isinstance(node, ast.Call):  # setattr(obj, "name", v) / obj.__setattr__("name", v)
        names = [const_str(a) for a in node.args[:2]]
        return next((n for n in names if n), None)
    return None


def check_patches(src: Source, ctx: FileContext) -> Iterator[Hit]:
    for node, dotted, _value in attribute_writes(src):
        if not dotted and _written_name(node) in CHECKER_NAMES:  # type(Event()).elapsed_time = f
            yield Hit("timer-patch", f"patch:?.{_written_name(node)}", node,
                      f"`{src.snippet(node)}` replaces a {_written_name(node)} method")
            continue
        if not dotted or "." not in dotted:
            continue
        last = dotted.rsplit(".", 1)[-1]
        root = dotted.split(".")[0]
        if last in RELAX_FLAGS + PRECISION_KNOBS or dotted in ENVIRON:
            continue  # numeric-tf32 / env-write
        frozen = _frozen_module(ctx, dotted) if root == ctx.package else None
        if last in CHECKER_NAMES or frozen or (root in PATCH_BLOCK and not _under(dotted, LIB_CONFIG)):
            why = f" (a module the gate freezes: {frozen})" if frozen else ""
            yield Hit("timer-patch", f"patch:{dotted}", node, f"`{src.snippet(node)}` replaces {dotted}{why}")
        elif root != ctx.package:
            yield Hit("lib-patch", f"patch:{dotted}", node, f"`{src.snippet(node)}` sets {dotted}")
    for node in src.walk():
        for t in targets(node):  # sys.modules[...] = fake, __builtins__[...] = f
            if isinstance(t, ast.Subscript) and (src.qualify(t.value) == "sys.modules" or
                                                 (isinstance(t.value, ast.Name) and t.value.id == "__builtins__")):
                yield Hit("timer-patch", f"patch:{src.snippet(t.value)}", node,
                          f"`{src.snippet(node)}` replaces a module or builtin for every importer")
        if isinstance(node, ast.Call):
            fn = src.call_name(node) or ""
            if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and \
                    src.qualify(node.func.value) == "sys.modules":
                yield Hit("timer-patch", "patch:sys.modules", node, f"`{src.snippet(node)}` edits sys.modules")
            elif _under(fn, MOCK):
                yield Hit("timer-patch", f"patch:{fn}", node, f"`{src.snippet(node)}` monkeypatches")
            elif fn in ("type", "builtins.type") and len(node.args) == 3 and isinstance(node.args[2], ast.Dict):
                names = {const_str(k) for k in node.args[2].keys} & CHECKER_NAMES
                if names:
                    yield Hit("timer-patch", f"def:{min(names)}", node, f"`{src.snippet(node)}` builds a class "
                                                                        f"with {', '.join(sorted(names))}")
        elif isinstance(node, ast.ClassDef):
            for b in node.bases:
                if p := _under(src.qualify(b) or "", TIMER_CLASSES):
                    yield Hit("timer-patch", f"subclass:{p}", node, f"class {node.name}({src.snippet(b)})")
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in CHECKER_NAMES:
                    yield Hit("timer-patch", f"def:{item.name}", item,
                              f"{node.name}.{item.name}() defined: a timer or checker method installed on a class")


# -- introspection --------------------------------------------------------------------------------

INTROSPECT = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe", "sys._current_frames",
              "sys.settrace", "sys.setprofile", "sys.gettrace", "sys.getprofile", "sys.argv", "sys.orig_argv",
              "sys.monitoring", "inspect.stack", "inspect.currentframe", "inspect.getouterframes",
              "inspect.getinnerframes", "inspect.trace", "inspect.getframeinfo", "traceback.extract_stack",
              "traceback.walk_stack", "traceback.format_stack", "traceback.print_stack", "threading.settrace",
              "threading.setprofile", "os.getppid", "psutil", "__main__")
FRAME_ATTRS = frozenset({"f_back", "f_locals", "f_globals", "f_builtins", "f_code", "gi_frame", "cr_frame", "tb_frame"})
HARNESS_STRINGS = frozenset({"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_VERSION", "pytest", "_pytest"})


def check_introspection(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "introspection"
    for node, dotted in outermost_chains(src):
        parent = src.parent.get(node)
        if p := _under(dotted, INTROSPECT):
            yield Hit(rule, f"use:{p}", node, f"`{src.snippet(parent or node)}` uses {dotted}")
        elif dotted == "sys.modules" or dotted.startswith("sys.modules."):
            written = (isinstance(parent, ast.Subscript) and not isinstance(parent.ctx, ast.Load)) or \
                dotted.rsplit(".", 1)[-1] in MUTATORS
            if not written:
                yield Hit(rule, "use:sys.modules", node,
                          f"`{src.snippet(parent or node)}` looks at which modules are loaded")
        if isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS:
            yield Hit(rule, f"frame:{node.attr}", node, f"`{src.snippet(node)}` walks stack frames")
    for node in src.walk():
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not is_docstring(src, node):
            v = node.value
            if v in HARNESS_STRINGS or "flaloop" in v.lower() or v.startswith("/proc/"):
                yield Hit(rule, f"string:{v[:40]}", node,
                          f"`{src.snippet(src.parent.get(node) or node)}` looks for the test or benchmark harness")


# -- driver-l2 ------------------------------------------------------------------------------------

DRIVER = ("ctypes", "cuda.bindings", "cuda.cudart", "cuda.cuda", "cuda.core", "pycuda", "cupy", "torch.cuda.cudart",
          "nvidia.cuda_runtime", "cuda")
L2_TOKENS = ("accessPolicyWindow", "access_policy_window", "PersistingL2", "persisting_l2",
             "cudaLimitPersistingL2CacheSize", "CU_LIMIT_PERSISTING_L2_CACHE_SIZE", "cudaStreamSetAttribute",
             "cuStreamSetAttribute", "cudaStreamAttributeAccessPolicyWindow", "cudaAccessProperty", "hitRatio",
             "hitProp", "cudaCtxResetPersistingL2Cache", "cudaDeviceSetLimit", "cuCtxSetLimit",
             "cudaGraphKernelNodeSetAttribute", "libcuda", "libcudart")


def l2_tokens(text: str) -> list[str]:
    return [t for t in L2_TOKENS if t in text]


def check_driver(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "driver-l2"
    for node, dotted in outermost_chains(src):
        if p := _under(dotted, DRIVER):
            yield Hit(rule, f"use:{p}", node, f"`{src.snippet(src.parent.get(node) or node)}` uses {dotted}")
    for node in src.walk():
        text = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.arg if isinstance(node, ast.keyword) else \
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and not is_docstring(src, node) else None
        for tok in l2_tokens(text or ""):
            yield Hit(rule, f"token:{tok}", node, f"`{src.snippet(node)}`: {tok} (L2 residency or device limits)")


# -- env-write, env-read --------------------------------------------------------------------------

def _env_read_key(src: Source, node: ast.AST) -> str | None:
    parent = src.parent.get(node)
    if isinstance(parent, ast.Subscript):
        return const_str(parent.slice)
    if isinstance(parent, ast.Call) and parent.args:
        return const_str(parent.args[0])
    if isinstance(parent, ast.Compare):
        return const_str(parent.left)
    return None


def check_env(src: Source, ctx: FileContext) -> Iterator[Hit]:
    for node, key in env_writes(src):
        if key not in NUMERIC_ENV:
            yield Hit("env-write", f"env:{key or '?'}", node, f"`{src.snippet(node)}` writes the environment"
                      + (f" ({key})" if key else ""))
    if not ctx.op_code:
        return
    inside_writes = env_write_nodes(src)
    for node, dotted in outermost_chains(src):
        if id(node) in inside_writes or not src.in_function(node):
            continue
        if dotted in ENVIRON or dotted.startswith(tuple(e + "." for e in ENVIRON)) or \
                dotted in ("os.getenv", "os.getenvb"):
            key = _env_read_key(src, node)
            yield Hit("env-read", f"read:{key or '?'}", node,
                      f"`{src.snippet(src.parent.get(node) or node)}` reads the environment at call time",
                      severity=WARN)


# -- tensor-subclass ------------------------------------------------------------------------------

SUBCLASS_BASES = ("torch.Tensor", "torch._C._TensorBase", "torch._C.TensorBase",
                  "torch.utils._python_dispatch.TorchDispatchMode", "torch.overrides.TorchFunctionMode",
                  "torch.overrides.TorchFunctionMode")
SUBCLASS_CALLS = frozenset({"_make_subclass", "_make_wrapper_subclass", "as_subclass"})


def check_subclass(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "tensor-subclass"
    for node in src.walk():
        if isinstance(node, ast.ClassDef):
            for b in node.bases:
                if p := _under(src.qualify(b) or "", SUBCLASS_BASES):
                    yield Hit(rule, f"subclass:{p}", node, f"class {node.name}({src.snippet(b)})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name in ("__torch_function__", "__torch_dispatch__"):
            yield Hit(rule, f"def:{node.name}", node, f"{node.name} defined: calls on these tensors are intercepted")
        elif isinstance(node, ast.Call) and method_name(node.func) in SUBCLASS_CALLS:
            yield Hit(rule, f"call:{method_name(node.func)}", node, f"`{src.snippet(node)}`")


# -- dynamic-code ---------------------------------------------------------------------------------

DYNAMIC = frozenset({"exec", "eval", "compile", "builtins.exec", "builtins.eval", "builtins.compile", "marshal.loads",
                     "pickle.loads", "pickle.load", "dill.loads", "cloudpickle.loads", "types.FunctionType",
                     "types.CodeType", "runpy.run_path", "runpy.run_module"})
IMPORTERS = ("importlib.import_module", "__import__", "builtins.__import__")


def check_dynamic(src: Source, ctx: FileContext) -> Iterator[Hit]:
    for node in src.walk():
        if not isinstance(node, ast.Call):
            continue
        fn = src.call_name(node) or ""
        if fn in DYNAMIC:
            yield Hit("dynamic-code", f"call:{fn}", node, f"`{src.snippet(node)}` runs code the audit cannot read")
        elif fn in IMPORTERS and not (node.args and const_str(node.args[0])):
            yield Hit("dynamic-code", f"import:{fn}", node, f"`{src.snippet(node)}` imports a module named at run time")


CHECKS = [check_dynamic, check_concurrency, check_patches, check_introspection, check_driver, check_env, check_subclass]
