"""Bench inputs of an op that declares none, read from the calls its frozen test made at the base.

The base gate records them in `calls.json` beside its baseline (profile/<op>-opt/gate/calls.json):

    {"schema": 1, "package": "fla", "calls": [{"fn": "<module>:<qualname>", "count": N,
      "args": [SPEC, ...], "kwargs": {"name": SPEC}}]}

SPEC is {"tensor": {"shape": [...], "dtype": "bfloat16", "requires_grad": true}}, {"value": <json>},
{"seq": [SPEC, ...], "kind": "tuple"|"list"} or {"opaque": "<type name>"}.

`declaration` (pure) turns the op's recorded calls into the worker's declaration (opdecl.normalize's
format): the calls are grouped by what they pass (the same arguments, ranks, dtypes and values), the
group holding the largest call (by elements of its tensors) is kept, and its largest calls of
distinct shapes become the cells, one named shape each (`call<index>_<shape of the first tensor>`).
Every dimension is a recorded size: nothing is varied, so the plan checks no unseen shapes for
such an op. A call that passes something the bench cannot rebuild (an opaque object, a sequence of
unlike items, more positional arguments than the signature names) is left out and counted.
A recorded `cu_seqlens` tensor of N+1 offsets makes the cell varlen: its values are not recorded,
so the cell packs N sequences of near-equal lengths over axis 1 of the first tensor argument."""

from __future__ import annotations

import json
from pathlib import Path

from flaloop.core.errors import UsageError
from flaloop.task.opdecl import SCHEMA

MAX_CELLS = 3
_INT = {"int64": "long", "long": "long", "int32": "int32"}
_FLOAT = ("bfloat16", "float16", "float32")
VARLEN = ("cu_seqlens", "cu_seqlens_cpu")


def read(path: Path) -> dict | None:
    """The recorded calls at `path`; None where there is no such file."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not readable JSON: {exc}", "run the gate at the base again to record it") from None
    return doc


def _of_op(fn: str, import_path: str, func_name: str) -> int:
    """How closely a recorded `module:qualname` names the op: 2 its own module, 1 a module of its
    package (where the function is defined, below where it is exported), 0 not it."""
    module, _, qual = fn.partition(":")
    if qual.rsplit(".", 1)[-1] != func_name:
        return 0
    if module == import_path:
        return 2
    return 1 if module.split(".")[0] == import_path.split(".")[0] else 0


def _arg(spec, dtype_main: str | None):
    """(kind, description) of one recorded argument: ("tensor", {...}), ("value", v), ("list", [..]), or
    ("opaque", why)."""
    if not isinstance(spec, dict):
        return "opaque", f"not a SPEC: {spec!r}"
    if "tensor" in spec:
        t = spec["tensor"]
        shape, dtype = t.get("shape"), str(t.get("dtype", ""))
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            return "opaque", f"a tensor of shape {shape!r}"
        if dtype in _INT:
            return "tensor", {"shape": shape, "dtype": _INT[dtype], "requires_grad": False}
        if dtype not in _FLOAT:
            return "opaque", f"a {dtype} tensor"
        return "tensor", {"shape": shape, "dtype": "default" if dtype == dtype_main else dtype,
                          "requires_grad": bool(t.get("requires_grad", False))}
    if "value" in spec:
        return "value", spec["value"]
    if "seq" in spec:
        items = [_arg(s, dtype_main) for s in spec["seq"]]
        if items and all(k == "tensor" for k, _ in items) and all(d == items[0][1] for _, d in items):
            return "list", {**items[0][1], "n": len(items)}
        if all(k == "value" for k, _ in items):
            return "value", [v for _, v in items]
        return "opaque", "a sequence of unlike items"
    return "opaque", f"an object of type {spec.get('opaque', '?')}"


def _main_dtype(call: dict) -> str | None:
    """The floating dtype most of the call's tensors have: the bench's --dtype stands in for it."""
    seen: dict[str, int] = {}

    def walk(s):
        if isinstance(s, dict) and "tensor" in s and str(s["tensor"].get("dtype")) in _FLOAT:
            seen[s["tensor"]["dtype"]] = seen.get(s["tensor"]["dtype"], 0) + 1
        elif isinstance(s, dict) and "seq" in s:
            for x in s["seq"]:
                walk(x)
    for s in [*call.get("args", []), *call.get("kwargs", {}).values()]:
        walk(s)
    return max(seen, key=lambda k: seen[k]) if seen else None


def _bind(call: dict, parameters: list[str]) -> tuple[dict | None, str | None]:
    """{name: (kind, desc)} of one call, or (None, why it cannot be rebuilt)."""
    args, kwargs = call.get("args") or [], call.get("kwargs") or {}
    if len(args) > len(parameters):
        return None, f"{len(args)} positional arguments, the signature names {len(parameters)}"
    main = _main_dtype(call)
    bound = {}
    for name, spec in [*zip(parameters, args, strict=False), *kwargs.items()]:
        kind, desc = _arg(spec, main)
        if kind == "opaque":
            return None, f"{name} is {desc}"
        bound[name] = (kind, desc)
    if not any(k in ("tensor", "list") for k, _ in bound.values()):
        return None, "no tensor argument"
    return bound, None


def _elements(bound: dict) -> int:
    n = 0
    for kind, d in bound.values():
        if kind in ("tensor", "list"):
            size = d.get("n", 1)
            for x in d["shape"]:
                size *= x
            n += size
    return n


def _group_key(bound: dict) -> str:
    return json.dumps({k: (kind, {**d, "shape": len(d["shape"])} if kind in ("tensor", "list") else d)
                       for k, (kind, d) in sorted(bound.items())}, sort_keys=True, default=repr)


def declaration(doc: dict, *, name: str, import_path: str, func_name: str, parameters: list[str],
                test_file: str | None = None, max_cells: int = MAX_CELLS) -> dict:
    """The worker's declaration of op `name` from a calls.json document; ValueError says why none."""
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("calls"), list):
        raise ValueError("not a calls.json of schema 1 (a dict with \"schema\": 1 and a list \"calls\")")
    calls = [(i, c) for i, c in enumerate(doc["calls"]) if isinstance(c, dict) and isinstance(c.get("fn"), str)]
    ranked = [(_of_op(c["fn"], import_path, func_name), i, c) for i, c in calls]
    best = max((r for r, _, _ in ranked), default=0)
    if best == 0:
        seen = sorted({c["fn"] for _, c in calls})
        raise ValueError(f"it records no call of {import_path}.{func_name}"
                         + (f" (it records {', '.join(seen[:6])}{' ...' if len(seen) > 6 else ''})" if seen else
                            " (it records no call at all)"))
    usable, skipped = [], {}
    for r, i, c in ranked:
        if r != best:
            continue
        bound, why = _bind(c, parameters)
        if bound is None:
            skipped[str(i)] = why
        else:
            usable.append((i, c, bound))
    if not usable:
        raise ValueError(f"none of its calls of {func_name} can be rebuilt: "
                         + "; ".join(f"call {i}: {w}" for i, w in list(skipped.items())[:3]))
    usable.sort(key=lambda x: (-_elements(x[2]), x[0]))
    key = _group_key(usable[0][2])
    chosen, shapes_seen = [], set()
    for i, c, bound in usable:
        sig = json.dumps({k: d.get("shape") if kind in ("tensor", "list") else None for k, (kind, d) in bound.items()},
                         sort_keys=True)
        if _group_key(bound) != key or sig in shapes_seen:
            continue
        shapes_seen.add(sig)
        chosen.append((i, c, bound))
        if len(chosen) == max_cells:
            break
    inputs, extra, shapes = {}, {}, {}
    for i, _c, bound in chosen:
        dims, first = {}, None
        for arg, (kind, d) in bound.items():
            if kind not in ("tensor", "list") or arg in VARLEN:
                continue
            first = first or d["shape"]
            lead = [d["n"]] if kind == "list" else []
            for ax, size in enumerate(lead + d["shape"]):
                dims[f"{arg}_{ax}"] = size
        if "cu_seqlens" in bound and bound["cu_seqlens"][0] == "tensor" and first and len(first) > 1:
            n, total = max(bound["cu_seqlens"][1]["shape"][0] - 1, 1), first[1]
            dims["seqlens"] = [total // n + (1 if j < total % n else 0) for j in range(n)]
        shapes[f"call{i}_{'x'.join(map(str, first or []))}"] = dims
    _i, _c, bound = chosen[0]
    for arg, (kind, d) in bound.items():
        if arg in VARLEN:
            continue
        if kind == "value":
            extra[arg] = d
            continue
        rank = len(d["shape"]) + (1 if kind == "list" else 0)
        inp = {"shape": [f"{arg}_{ax}" for ax in range(rank)], "dtype": d["dtype"], "requires_grad": d["requires_grad"]}
        if kind == "list":
            inp["unbind"] = 0
        if d["dtype"] in ("long", "int32"):
            inp["range"] = [0, 2]  # values are not recorded: small indices stay in range of any size
        inputs[arg] = inp
    dims_used = sorted({e for inp in inputs.values() for e in inp["shape"]})
    return {
        "schema": SCHEMA, "name": name, "import_path": import_path, "func_name": func_name, "test_file": test_file,
        "inputs": inputs, "extra_kwargs": extra, "shape_kwargs": {}, "output_is_tuple": None,
        "skip_backward": not any(d.get("requires_grad") for k, d in bound.values() if k in ("tensor", "list")),
        "category": "", "dim_constraints": None, "default_shapes": shapes, "backend_env": None, "dims": dims_used,
        "recorded": {"package": doc.get("package"), "calls": [i for i, _, _ in chosen],
                     "counts": [c.get("count", 1) for _, c, _ in chosen], "skipped": skipped},
    }
