"""cache-memo and shape-branch: work skipped across calls, and code for exactly the measured shape."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from flaloop.guard.findings import WARN
from flaloop.guard.rules.check import FileContext, Hit
from flaloop.guard.rules.walk import MUTATORS, method_name, outermost_chains, root_name, statement, targets
from flaloop.guard.source import Source, const_str

IDENTITY = frozenset({"data_ptr", "untyped_storage", "storage", "_cdata", "__cuda_array_interface__",
                      "__array_interface__", "unsafe_ptr"})
MEMO_NAMES = frozenset({"lru_cache", "cache", "cached_property", "tensor_cache", "memoize", "memoized", "cached"})
FACTORIES = frozenset({"empty", "zeros", "ones", "full", "rand", "randn", "randint", "tensor", "as_tensor",
                       "arange", "linspace", "eye", "empty_like", "zeros_like", "ones_like", "full_like",
                       "empty_strided", "from_numpy"})
GRAPHS = ("torch.cuda.CUDAGraph", "torch.cuda.graph", "torch.cuda.graphs", "torch.cuda.make_graphed_callables",
          "torch.cuda.graph_pool_handle")
SHAPE_NAMES = frozenset({"B", "T", "H", "K", "V", "D", "N", "L", "S", "HV"})
SHAPE_RE = re.compile(r"(?i)(^|_)(seq_?lens?|seqlens?|max_?len|len|length|batch|n?heads?|head_?dim|"
                      r"tokens|num_tokens|numel|shape)(_|$)")
TENSOR_LIKE = frozenset({"q", "k", "v", "x", "cu_seqlens", "offsets", "indices"})
EXACT_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


# -- cache-memo -----------------------------------------------------------------------------------

def _memo(dotted: str) -> bool:
    """functools.lru_cache / cache, cachetools, FLA's tensor_cache...: a memoising decorator."""
    return dotted.rsplit(".", 1)[-1] in MEMO_NAMES or dotted.startswith("cachetools.")


CONTAINERS = frozenset({"dict", "list", "set", "collections.OrderedDict", "collections.defaultdict",
                        "collections.deque", "collections.Counter", "weakref.WeakKeyDictionary",
                        "weakref.WeakValueDictionary"})


def _mutable(src: Source, node: ast.AST) -> bool:
    if isinstance(node, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(node, ast.Call) and (src.call_name(node) or "") in CONTAINERS


def _takes_tensors(fn: ast.FunctionDef | ast.AsyncFunctionDef, ctx: FileContext) -> bool:
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
        ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if "Tensor" in ann or (not ann and arg.arg in ctx.tensor_names):
            return True
    return False


def _module_state(src: Source, name: str, scope: ast.AST) -> bool:
    """`name`, seen from `scope`, is module-level state (not a local, a parameter or an import alias)."""
    s: ast.AST | None = scope
    while s is not None:
        b = src.bindings.get(s, {})
        if name in b:
            return s is src.tree and b[name] is None
        s = None if isinstance(s, ast.Module) else src.scope_node(s)
    return False


def check_cache(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "cache-memo"
    if not ctx.op_code:
        return
    state = src.module_level_names()
    defs = {n.name: n for n in src.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in src.walk():
        if isinstance(node, ast.Call):
            m = method_name(node.func)
            fn = src.call_name(node) or ""
            if m in IDENTITY and not (isinstance(src.parent.get(node), ast.BinOp)
                                      and isinstance(src.parent[node].op, ast.Mod)):  # alignment checks are fine
                yield Hit(rule, f"identity:{m}", node, f"`{src.snippet(node)}`: tensor identity as a key")
            elif fn in ("id", "builtins.id"):
                yield Hit(rule, "identity:id", node, f"`{src.snippet(node)}`: object identity as a key")
            elif _memo(fn) and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in defs and _takes_tensors(defs[node.args[0].id], ctx):
                yield Hit(rule, f"memo:{node.args[0].id}", node, f"`{src.snippet(node)}` memoises a function of tensors")
            elif isinstance(node.func, ast.Call) and _memo(src.call_name(node.func) or "") \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in defs \
                    and _takes_tensors(defs[node.args[0].id], ctx):
                yield Hit(rule, f"memo:{node.args[0].id}", node, f"`{src.snippet(node)}` memoises a function of tensors")
            elif fn.startswith(GRAPHS) or (fn == "torch.compile" and any(
                    k.arg == "mode" and (const_str(k.value) or "") in ("reduce-overhead", "max-autotune")
                    for k in node.keywords)):
                yield Hit(rule, f"graph:{fn}", node, f"`{src.snippet(node)}`: the op captures and replays a CUDA graph")
            elif not src.in_function(node) and fn.startswith("torch.") and fn.rsplit(".", 1)[-1] in FACTORIES:
                yield Hit(rule, f"module-tensor:{fn}", node,
                          f"`{src.snippet(node)}`: a tensor made at import time and kept in the module")
            elif not src.in_function(node) and isinstance(node.func, ast.Subscript):
                yield Hit(rule, "import-time-launch", node,
                          f"`{src.snippet(node)}`: a kernel launched at import time, outside every timed call")
            if src.in_function(node) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr in MUTATORS or (node.func.attr.endswith("_") and not node.func.attr.startswith("_"))):
                r = root_name(node.func.value)
                if r is not None and r.id in state and _module_state(src, r.id, src.scope_node(node)):
                    yield Hit(rule, f"mutate:{r.id}", node,
                              f"`{src.snippet(node)}` changes module-level {r.id} at call time")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                dotted = src.qualify(d.func if isinstance(d, ast.Call) else d) or ""
                if dotted and _memo(dotted) and _takes_tensors(node, ctx):
                    yield Hit(rule, f"memo:{node.name}", d, f"@{src.snippet(d)} on {node.name}(), which takes tensors")
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None and _mutable(src, default):
                    yield Hit(rule, f"default:{node.name}", default,
                              f"{node.name}(..., {src.snippet(default)}): a mutable default outlives the call (a cache)")
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None \
                        and _mutable(src, stmt.value) and not src.snippet(stmt).startswith("__"):
                    yield Hit(rule, f"class-state:{node.name}", stmt,
                              f"`{src.snippet(stmt)}` in class {node.name}: a container shared by every call")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            kind = "global" if isinstance(node, ast.Global) else "nonlocal"
            yield Hit(rule, f"{kind}:{','.join(sorted(node.names))}", node,
                      f"`{src.snippet(node)}`: state kept across calls (a call counter or a cache)")
        elif src.in_function(node):
            for t in targets(node):
                r = root_name(t) if isinstance(t, (ast.Attribute, ast.Subscript)) else None
                if r is not None and r.id in state and _module_state(src, r.id, src.scope_node(node)):
                    yield Hit(rule, f"mutate:{r.id}", node,
                              f"`{src.snippet(node)}` changes module-level {r.id} at call time")
    for node, dotted in outermost_chains(src):
        if dotted.startswith("weakref."):
            yield Hit(rule, "weakref", node, f"`{src.snippet(node)}`: a weak-reference cache")
        elif isinstance(node, ast.Attribute) and node.attr in ("_cdata", "__cuda_array_interface__") and \
                not isinstance(src.parent.get(node), ast.Call):
            yield Hit(rule, f"identity:{node.attr}", node, f"`{src.snippet(node)}`: tensor identity as a key")


# -- shape-branch ---------------------------------------------------------------------------------

def _shape_derived(src: Source) -> set[str]:
    """Names assigned from shapes anywhere in the file (`B, T, H, K = q.shape`, `T = q.size(1)`)."""
    out: set[str] = set()
    for node in src.walk():
        if isinstance(node, ast.Assign) and _mentions_shape(src, node.value, frozenset(), direct=True):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.add(n.id)
    return out


def _mentions_shape(src: Source, node: ast.AST, names: frozenset[str] | set[str], direct: bool = False) -> bool:
    """Whether `node` reads a size: `.shape`, `.size()`, `.numel()`, `len(q)`, or (unless `direct`) a name
    that holds one (B, T, seq_len, or one assigned from a shape in this file). Ranks (`len(x.shape)`,
    `x.ndim`, `x.dim()`) are not sizes."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Call) and src.call_name(n) == "len" and n.args:
            arg = n.args[0]
            if isinstance(arg, ast.Attribute) and arg.attr == "shape":
                continue  # a rank
            last = arg.attr if isinstance(arg, ast.Attribute) else arg.id if isinstance(arg, ast.Name) else ""
            if last in TENSOR_LIKE or SHAPE_RE.search(last):
                return True
        elif isinstance(n, ast.Attribute) and n.attr == "shape":
            return True
        elif isinstance(n, ast.Call) and method_name(n.func) in ("size", "numel"):
            return True
        elif not direct and isinstance(n, ast.Name) and (n.id in SHAPE_NAMES or n.id in names or SHAPE_RE.search(n.id)):
            return True
        todo.extend(ast.iter_child_nodes(n))
    return False


def _ints(src: Source, node: ast.AST) -> set[int]:
    """The integer value(s) a literal stands for: 64, -1, SHORT (a module constant), (64, 100), 32 * 2."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return {node.value}
    if isinstance(node, ast.Name) and node.id in src.int_constants:
        return {src.int_constants[node.id]}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {v for e in node.elts for v in _ints(src, e)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return {-v for v in _ints(src, node.operand)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add, ast.Sub, ast.Pow, ast.LShift)):
        left, right = _ints(src, node.left), _ints(src, node.right)
        if len(left) == 1 and len(right) == 1:
            a, b = left.pop(), right.pop()
            op = node.op
            return {a * b if isinstance(op, ast.Mult) else a + b if isinstance(op, ast.Add) else
                    a - b if isinstance(op, ast.Sub) else a ** b if isinstance(op, ast.Pow) else a << b}
    return set()


def _input_check(src: Source, node: ast.AST) -> bool:
    """`assert K <= 256` or `if K > 256: raise ...`: validating inputs is not special-casing them."""
    stmt = statement(src, node)
    return isinstance(stmt, ast.Assert) or (isinstance(stmt, ast.If) and all(isinstance(b, ast.Raise) for b in stmt.body))


def check_shape_branch(src: Source, ctx: FileContext) -> Iterator[Hit]:
    rule = "shape-branch"
    if not ctx.op_code or not ctx.shape_literals:
        return
    derived = _shape_derived(src)
    for node in src.walk():
        if isinstance(node, ast.Compare) and not _input_check(src, node):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                a, b = operands[i], operands[i + 1]
                for lit, other in ((a, b), (b, a)):
                    hit = _ints(src, lit) & ctx.shape_literals
                    if hit and not _ints(src, other) and _mentions_shape(src, other, derived):
                        exact = isinstance(op, EXACT_OPS)
                        yield Hit(rule, f"cmp:{src.snippet(node)}", node,
                                  f"`{src.snippet(node)}` compares a shape with {sorted(hit)}, "
                                  f"a value the tests or the benchmark use"
                                  + ("" if exact else " (a range: use `flaloop dispatch` for measured buckets)"),
                                  severity=None if exact else WARN)
                        break
        elif isinstance(node, ast.Match) and _mentions_shape(src, node.subject, derived):
            for case in node.cases:
                vals = {v for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)
                        for v in _ints(src, p.value)}
                if vals & ctx.shape_literals:
                    yield Hit(rule, f"match:{src.snippet(case.pattern)}", case.pattern,
                              f"`case {src.snippet(case.pattern)}` on a shape the tests or the benchmark use")


CHECKS = [check_cache, check_shape_branch]
