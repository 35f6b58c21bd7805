"""An op's bench inputs declared in flaloop.toml: checked and normalized here (pure), built by the
bench worker (inside/worker/declared.py) from the JSON this module writes.

    [ops.NAME]
    import_path = "pkg.ops.mod"               # required
    func_name = "fn"                          # default: NAME
    test_file = "tests/ops/test_mod.py"
    output_is_tuple = true                    # the op returns (out, ...); false: a bare tensor
    skip_backward = false                     # true: forward only
    category = "gate"                         # the roofline's family, as a registry's category
    extra_kwargs = { scale = 0.125 }          # constant keyword arguments
    shape_kwargs = { chunk_size = "T // 4" }  # keyword arguments computed from the cell's dimensions
    dim_constraints = { D = [64, 128] }       # other values of a dimension are skipped
    backend_env = { gluon = "FLA_X_GLUON" }   # --backend NAME sets that variable

    [ops.NAME.shapes]                         # named shapes; default: the registry's SHAPE_CONFIGS
    B2_T64_H2_D16 = { B = 2, T = 64, H = 2, D = 16 }
    T96_packed = { H = 2, D = 16, seqlens = [32, 64] }   # a varlen cell: B = 1, T = sum, cu_seqlens

    [ops.NAME.inputs]                         # keyword arguments, built in this order
    q = { shape = "B, T, H, D" }              # a shape: expressions over the dimensions
    g = { shape = "B, T, H", transform = ["logsigmoid", "clamp_min:-5"] }
    w = { shape = ["H"], dtype = "float32", requires_grad = false }
    b = { from = "q", transform = "neg" }     # tied: minus q, as built (its shape too)
    o = { like = "q" }                        # tied: q's shape, its own values
    idx = { shape = "B, T", dtype = "long", range = [0, 8] }
    res = { shape = "L, B, T, D", unbind = 0 } # a list of L tensors [B, T, D]

An op that declares inputs is benched from this declaration, registry or not. One that declares
none takes its inputs from its registry entry, else from the calls its frozen test made at the base
(task/opcalls.py)."""

from __future__ import annotations

import ast
import re

from flaloop import inside
from flaloop.core.errors import UsageError

CONFIG_FILE = "flaloop.toml"
SCHEMA = 1
DTYPES = ("default", "bfloat16", "float16", "float32", "long", "int32", "int64")
INPUT_KEYS = {"shape": (str, list), "like": (str,), "from": (str,), "dtype": (str,), "requires_grad": (bool,),
              "transform": (str, list), "range": (list,), "unbind": (int,)}
OP_KEYS = {"output_is_tuple": bool, "skip_backward": bool, "category": str, "extra_kwargs": dict,
           "shape_kwargs": dict, "dim_constraints": dict, "backend_env": dict, "shapes": dict, "inputs": dict}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
_CALLS = ("max", "min", "cdiv")
EXAMPLE = ('[ops.{op}.inputs]\nq = {{ shape = "B, T, H, D" }}\ng = {{ shape = "B, T, H", transform = "logsigmoid" }}')


def _worker_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """DECLARED_TRANSFORMS and PARAM_TRANSFORMS of inside/worker/declared.py, read from its source."""
    tree = ast.parse((inside.WORKER / "declared.py").read_text())
    found = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if getattr(t, "id", None) in ("DECLARED_TRANSFORMS", "PARAM_TRANSFORMS")}
    return tuple(found["DECLARED_TRANSFORMS"]), tuple(found["PARAM_TRANSFORMS"])


TRANSFORMS, PARAM_TRANSFORMS = _worker_names()


def _bad(where: str, what: str, hint: str) -> UsageError:
    return UsageError(f"{CONFIG_FILE}: {where} {what}", hint)


# -- shape expressions ----------------------------------------------------------------------------

def _expr(node: ast.AST, text: str):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return [_BINOPS[type(node.op)], _expr(node.left, text), _expr(node.right, text)]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return ["neg", _expr(node.operand, text)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS
            and not node.keywords and len(node.args) >= 2 and (node.func.id != "cdiv" or len(node.args) == 2)):
        return [node.func.id, *(_expr(a, text) for a in node.args)]
    raise ValueError(f"{ast.unparse(node)!r} is not an int, a dimension, + - * // %, max(), min() or cdiv(a, b)")


def parse_expr(text) -> object:
    """One dimension's expression, parsed: an int, a dimension's name, or [operator, operand, ...]."""
    if type(text) is int:
        return text
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is neither an expression nor an int")
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"{text!r} does not parse ({exc.msg})") from None
    return _expr(node, text)


def parse_shape(value) -> list:
    """A shape: "B, T, H * D" or ["B", "T", "H * D"] (or ints); a list of parsed expressions."""
    if isinstance(value, str):
        try:
            node = ast.parse(value.strip() or "()", mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"{value!r} does not parse ({exc.msg})") from None
        items = node.elts if isinstance(node, ast.Tuple) else [node]
        return [_expr(n, value) for n in items]
    return [parse_expr(v) for v in value]


def names_in(expr) -> set[str]:
    if isinstance(expr, str):
        return {expr}
    if isinstance(expr, list):
        return set().union(*(names_in(a) for a in expr[1:])) if len(expr) > 1 else set()
    return set()


def render(expr) -> str:
    if isinstance(expr, list):
        op, *args = expr
        if op == "neg":
            return f"-{render(args[0])}"
        if op in _CALLS:
            return f"{op}({', '.join(render(a) for a in args)})"
        return f"({render(args[0])} {op} {render(args[1])})"
    return str(expr)


# -- transforms -----------------------------------------------------------------------------------

def parse_transform(value) -> list[list]:
    """"logsigmoid" or ["sigmoid", "scale:-0.6", "clamp:-0.6:-1e-6"] -> [["sigmoid"], ["scale", -0.6], ...]."""
    steps = [value] if isinstance(value, str) else list(value)
    out = []
    for step in steps:
        if not isinstance(step, str):
            raise ValueError(f"{step!r} is not a transform name")
        name, _, arg = step.partition(":")
        if name in TRANSFORMS and not arg:
            out.append([name])
        elif name in PARAM_TRANSFORMS and arg:
            out.append([name, _number(step, arg)])
        elif name == "clamp" and arg.count(":") == 1:
            lo, hi = arg.split(":")
            out += [["clamp_min", _number(step, lo)], ["clamp_max", _number(step, hi)]]
        else:
            raise ValueError(f"unknown transform {step!r}")
    return out


def _number(step: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{step!r}: {text!r} is not a number") from None


TRANSFORM_HELP = (", ".join(TRANSFORMS) + "; with a number: " + ", ".join(f"{p}:X" for p in PARAM_TRANSFORMS)
                  + ", clamp:LO:HI; a list chains them in order")


# -- the declaration ------------------------------------------------------------------------------

def declares_inputs(entry: dict) -> bool:
    return "inputs" in entry


def normalize(name: str, entry: dict, registry_shapes: dict | None = None) -> dict:
    """The worker's JSON for [ops.NAME] of flaloop.toml, or a UsageError naming the key and the fix.
    `registry_shapes`: the registry's SHAPE_CONFIGS, the shapes of an op that names none."""
    where = f"[ops.{name}]"
    for key, typ in OP_KEYS.items():
        if key in entry and not isinstance(entry[key], typ):
            raise _bad(f"{where} {key}", f"must be a {typ.__name__}, not {type(entry[key]).__name__}",
                       f"see the op schema in docs/COMMANDS.md, under `flaloop init` (`{CONFIG_FILE}`)")
    raw_inputs = entry.get("inputs") or {}
    if not raw_inputs:
        raise _bad(f"{where} inputs", "declares no input",
                   "declare each tensor argument, e.g.\n" + EXAMPLE.format(op=name))
    inputs: dict[str, dict] = {}
    used: set[str] = set()
    for arg, raw in raw_inputs.items():
        key = f"[ops.{name}.inputs] {arg}"
        if not isinstance(raw, dict):
            raise _bad(key, f"must be a table, not {type(raw).__name__} ({raw!r})",
                       f'e.g. {arg} = {{ shape = "B, T, H, D" }}')
        unknown = sorted(set(raw) - set(INPUT_KEYS))
        if unknown:
            raise _bad(key, f"has unknown key(s) {', '.join(unknown)}", f"known: {', '.join(INPUT_KEYS)}")
        for k, types in INPUT_KEYS.items():
            if k in raw and not isinstance(raw[k], types):
                raise _bad(f"{key}.{k}", f"must be {' or '.join(t.__name__ for t in types)}, not {raw[k]!r}",
                           f"see the op schema in docs/COMMANDS.md, under `flaloop init` (`{CONFIG_FILE}`)")
        sources = [k for k in ("shape", "like", "from") if k in raw]
        if len(sources) != 1:
            raise _bad(key, "needs exactly one of shape, like, from" + (f" (has {', '.join(sources)})" if sources else ""),
                       f'e.g. {arg} = {{ shape = "B, T, H, D" }}, or {{ like = "q" }} (q\'s shape), '
                       f'or {{ from = "q", transform = "neg" }} (minus q)')
        out = {"dtype": raw.get("dtype", "default"), "requires_grad": raw.get("requires_grad", True)}
        if out["dtype"] not in DTYPES:
            raise _bad(f"{key}.dtype", f"{out['dtype']!r} is not one of {', '.join(DTYPES)}", 'e.g. dtype = "float32"')
        if "shape" in raw:
            try:
                out["shape"] = parse_shape(raw["shape"])
            except ValueError as exc:
                raise _bad(f"{key}.shape", f"does not parse: {exc}",
                           'a shape is expressions over the dimensions, e.g. shape = "B, T, H * D"') from None
            used |= set().union(*(names_in(e) for e in out["shape"])) if out["shape"] else set()
        for tie in ("like", "from"):
            if tie in raw:
                if raw[tie] not in inputs:
                    raise _bad(f"{key}.{tie}", f"names {raw[tie]!r}, not an input declared before {arg!r}",
                               f"declare it above {arg} (inputs are built in order: {', '.join(inputs) or 'none yet'})")
                out[tie] = raw[tie]
        if "transform" in raw:
            try:
                out["transform"] = parse_transform(raw["transform"])
            except ValueError as exc:
                raise _bad(f"{key}.transform", str(exc), f"known: {TRANSFORM_HELP}") from None
        if "range" in raw:
            rng = raw["range"]
            if len(rng) != 2 or not all(type(v) is int for v in rng) or rng[0] >= rng[1]:
                raise _bad(f"{key}.range", f"{rng!r} is not [low, high) of ints", "e.g. range = [0, 8]")
            out["range"] = rng
        if "unbind" in raw:
            out["unbind"] = raw["unbind"]
        inputs[arg] = out
    shape_kwargs = {}
    for kw, text in (entry.get("shape_kwargs") or {}).items():
        try:
            shape_kwargs[kw] = parse_expr(text)
        except ValueError as exc:
            raise _bad(f"{where} shape_kwargs.{kw}", f"does not parse: {exc}", 'e.g. shape_kwargs = { chunk_size = "T // 4" }') from None
        used |= names_in(shape_kwargs[kw])
    shapes = _shapes(name, entry.get("shapes"), registry_shapes)
    for shape_name, dims in shapes.items():
        have = set(dims) | ({"B", "T"} if "seqlens" in dims else set())
        missing = sorted(used - have)
        if missing:
            where_, what = ((f"[ops.{name}.shapes] {shape_name}", "lacks") if entry.get("shapes") else
                            (f"[ops.{name}.shapes]", f"is not given, and the registry's shape {shape_name} lacks"))
            raise _bad(where_, f"{what} {', '.join(missing)}, which the inputs' shapes use",
                       f"give every named shape every dimension the inputs use, e.g.\n[ops.{name}.shapes]\n"
                       f"small = {{ {', '.join(f'{d} = 16' for d in sorted(used))} }}")
    constraints = entry.get("dim_constraints") or {}
    for dim, allowed in constraints.items():
        if not isinstance(allowed, list) or not all(type(v) is int for v in allowed):
            raise _bad(f"{where} dim_constraints.{dim}", f"must list ints, not {allowed!r}", "e.g. dim_constraints = { D = [64, 128] }")
    for kw in entry.get("extra_kwargs") or {}:
        if kw in inputs or kw in shape_kwargs:
            raise _bad(f"{where} extra_kwargs.{kw}", "is also an input or a shape_kwargs key", "keep one of them")
    return {
        "schema": SCHEMA, "name": name, "import_path": entry["import_path"],
        "func_name": entry.get("func_name", name), "test_file": entry.get("test_file"), "inputs": inputs,
        "extra_kwargs": dict(entry.get("extra_kwargs") or {}), "shape_kwargs": shape_kwargs,
        "output_is_tuple": entry.get("output_is_tuple", True), "skip_backward": entry.get("skip_backward", False),
        "category": entry.get("category", ""), "dim_constraints": constraints or None,
        "default_shapes": shapes if entry.get("shapes") else None, "backend_env": entry.get("backend_env"),
        "dims": sorted(used),
    }


def _shapes(name: str, declared: dict | None, registry_shapes: dict | None) -> dict:
    if declared is None:
        if not registry_shapes:
            raise _bad(f"[ops.{name}.shapes]", "is not given, and the repo has no registry SHAPE_CONFIGS to use",
                       f"name the shapes to bench, e.g.\n[ops.{name}.shapes]\nB2_T64_H2_D16 = {{ B = 2, T = 64, H = 2, D = 16 }}")
        return {k: dict(v) for k, v in registry_shapes.items()}
    if not declared:
        raise _bad(f"[ops.{name}.shapes]", "names no shape", "e.g. B2_T64_H2_D16 = { B = 2, T = 64, H = 2, D = 16 }")
    out = {}
    for shape_name, dims in declared.items():
        key = f"[ops.{name}.shapes] {shape_name}"
        if not isinstance(dims, dict) or not dims:
            raise _bad(key, f"must be a table of dimensions, not {dims!r}", "e.g. { B = 2, T = 64, H = 2, D = 16 }")
        for dim, v in dims.items():
            if dim == "seqlens":
                if not isinstance(v, list) or not v or not all(type(x) is int and x > 0 for x in v):
                    raise _bad(f"{key}.seqlens", f"must list positive ints, not {v!r}", "e.g. seqlens = [32, 64]")
            elif not _NAME.fullmatch(dim) or type(v) is not int or v < 1:
                raise _bad(f"{key}.{dim}", f"must be a positive int, not {v!r}", f"e.g. {dim} = 64")
        if "seqlens" in dims and dims.get("B", 1) != 1:
            raise _bad(f"{key}.B", "must be 1 (or absent) beside seqlens: a packed batch is one sequence of them",
                       "drop B")
        if "seqlens" in dims and dims.get("T", sum(dims["seqlens"])) != sum(dims["seqlens"]):
            raise _bad(f"{key}.T", f"is not sum(seqlens) = {sum(dims['seqlens'])}", "drop T")
        out[shape_name] = dict(dims)
    return out


def registry_view(decl: dict) -> dict:
    """The declaration in the form of the target query's registry entry (what the contract, the
    unseen draw and the roofline read of an op)."""
    inputs = {}
    for arg, d in decl["inputs"].items():
        if "shape" in d and d["shape"] and all(isinstance(e, str) and len(e) == 1 for e in d["shape"]):
            shape = "shape_" + "".join(d["shape"])  # the registry helpers' names, as the roofline knows them
        else:
            shape = ("like " + d["like"]) if "like" in d else ("from " + d["from"]) if "from" in d else \
                ", ".join(render(e) for e in d["shape"])
        inputs[arg] = {"shape_fn": shape, "dtype": d["dtype"], "requires_grad": d["requires_grad"],
                       "transform": "+".join(":".join(map(str, s)) for s in d.get("transform", [])) or None}
    return {"name": decl["name"], "import_path": decl["import_path"], "func_name": decl["func_name"],
            "test_file": decl.get("test_file"), "category": decl.get("category", ""), "inputs": inputs,
            "extra_kwargs": {k: repr(v) for k, v in decl["extra_kwargs"].items()},
            "output_is_tuple": decl["output_is_tuple"], "skip_backward": decl["skip_backward"], "post_init": None,
            "dim_constraints": decl.get("dim_constraints"), "default_shapes": decl.get("default_shapes"),
            "backend_env": decl.get("backend_env"), "declared": True}
