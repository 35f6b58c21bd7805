"""The op's keyword options nobody calls: which to draw, their values, and the combinations.

A kernel wrong only behind a keyword option the registry's call never sets (an initial state, the
final state's gradient, a normalization, a gate bound) passes the differential on the bench's cells
and on the unseen shapes: both call the op the registry's way. The unseen-shape draw therefore
also draws options (pure, the orchestrator's: plain data in the plan):

- an option is a parameter of the op's public signature with a default, that the registry neither
  builds (its inputs) nor fixes (its extra_kwargs), and is no offsets tensor (varlen is the unseen
  draw's own): a bool (False, True); an enum (a `Literal[...]` annotation: its values); an optional
  tensor (default None, and a tensor by its annotation, its docstring or the tests' calls); any other
  value with the values the tests passed (flaloop/task/testcalls.py) beside its default;
- an optional tensor needs a shape: each of its dimensions is taken from the tests' own calls of the
  op where they pin it (a dimension of one of the registry's inputs, or the number of sequences
  `len(cu_seqlens) - 1`, the same in every such call), separately for packed (varlen) calls and
  others; else from the shape its docstring gives (`[N, H, K, V]`: letters of the shape's dimensions,
  N the number of sequences); else the option is left out and the plan says why;
- the combinations: every option at its other values at once, each option alone away from its
  default, the combinations the tests use, then seeded others, at most n (BenchConfig.unseen_options),
  each paired with one of the unseen shapes in turn and run forward and backward through every output.
"""

from __future__ import annotations

import ast
import itertools
import random
import re

from flaloop.task import testcalls

OFFSETS = ("cu_seqlens", "offsets", "seq_offsets", "cu_seqlens_cpu")
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
MAX_VALUES = 4  # a value option's values: its default and up to three the tests passed
TENSOR = "tensor"  # an optional tensor given (its SPEC is built per shape)


def _is_offsets(name: str) -> bool:
    return name in OFFSETS or name.endswith("seqlens") or name.endswith("offsets")


def bind(call: dict, params: list[dict]) -> dict:
    """{parameter name: SPEC} of a recorded call (positional arguments named by the signature)."""
    names = [p["name"] for p in params if str(p.get("kind")) in POSITIONAL]
    out = {(names[i] if i < len(names) else f"arg{i}"): a for i, a in enumerate(call.get("args") or [])}
    out.update(call.get("kwargs") or {})
    return out


def op_calls(doc: dict | None, params: list[dict], package: str, func_name: str) -> list[dict]:
    return [bind(c, params) for c in (doc or {}).get("calls") or [] if testcalls.is_op(c["fn"], package, func_name)]


def _literal(annotation: str | None) -> list | None:
    m = re.search(r"Literal\[(.*?)\]", annotation or "")
    if not m:
        return None
    try:
        vals = ast.literal_eval(f"[{m.group(1)}]")
    except (ValueError, SyntaxError):
        return None
    return [v for v in vals if isinstance(v, (bool, int, float, str))] or None


def _default(p: dict):
    try:
        return ast.literal_eval(p["default"]) if p.get("default") is not None else None
    except (ValueError, SyntaxError):
        return p["default"]


def find(params: list[dict], entry: dict, calls: list[dict]) -> tuple[list[dict], list[dict]]:
    """(options, left_out): each option {"name", "kind", "default", "values"}; each parameter left
    out with the reason."""
    registry = set((entry or {}).get("inputs") or {}) | set((entry or {}).get("extra_kwargs") or {})
    opts, left = [], []
    for p in params:
        name, ann, doc = p["name"], str(p.get("annotation") or ""), str(p.get("doc") or "")
        if p.get("default") is None or name in registry or _is_offsets(name) or "VAR_" in str(p.get("kind")):
            continue
        default = _default(p)
        passed = [c[name] for c in calls if name in c]
        tensors = [s for s in passed if "tensor" in s]
        lit = _literal(ann)
        if isinstance(default, bool) or ann in ("bool", "'bool'"):
            opts.append({"name": name, "kind": "bool", "default": default, "values": [False, True]})
        elif lit:
            opts.append({"name": name, "kind": "enum", "default": default,
                         "values": list(dict.fromkeys([default, *lit]))})
        elif default is None and (tensors or "Tensor" in ann or "Tensor" in doc):
            opts.append({"name": name, "kind": TENSOR, "default": None, "values": [None, TENSOR]})
        elif isinstance(default, (int, float, str, type(None))):
            seen = [s["value"] for s in passed if "value" in s and isinstance(s["value"], (bool, int, float, str))]
            values = list(dict.fromkeys([default, *seen]))[:MAX_VALUES]
            if len(values) > 1:
                opts.append({"name": name, "kind": "value", "default": default, "values": values})
            else:
                left.append({"name": name, "why": "no value but its default is known (the tests pass none)"})
        else:
            left.append({"name": name, "why": f"its default {p.get('default')} is no value flaloop can vary"})
    return opts, left


def _terms(name: str, calls: list[dict], prefer: list[str]) -> list | None:
    """Each dimension of the optional tensor `name` as a term of the other arguments' shapes that
    holds in most of `calls` ({"param", "axis", "add"}), or None where none does."""
    having = [c for c in calls if "tensor" in c.get(name, {})]
    if not having:
        return None
    rank = {len(c[name]["tensor"]["shape"]) for c in having}
    if len(rank) != 1:
        return None
    terms = []
    order = {p: i for i, p in enumerate(prefer)}
    for axis in range(rank.pop()):
        votes: dict[tuple, int] = {}
        for c in having:
            size = c[name]["tensor"]["shape"][axis]
            cand = set()
            for other, s in c.items():
                if other == name or "tensor" not in s:
                    continue
                shape = s["tensor"]["shape"]
                cand |= {(other, b, 0) for b, n in enumerate(shape) if n == size}
                if _is_offsets(other) and len(shape) == 1 and shape[0] - 1 == size:
                    cand.add((other, 0, -1))
            for t in cand:
                votes[t] = votes.get(t, 0) + 1
        # the term that holds in most calls: a call the op refuses (a test of its input checks)
        # passes a tensor of a wrong shape on purpose, and must not veto the others
        need = len(having) // 2 + 1
        ok = [t for t, v in votes.items() if v >= need]
        if not ok:
            return None
        best = min(ok, key=lambda t: (-votes[t], order.get(t[0], len(order)), t[2] != 0, t[1]))
        terms.append({"param": best[0], "axis": best[1], "add": best[2]})
    return terms


def doc_shape(doc: str | None) -> list[str] | None:
    """The bracketed shape a parameter's docstring gives (`[N, H, K, V]`), as letters."""
    m = re.search(r"\[\s*([A-Za-z](?:\s*,\s*[A-Za-z])*)\s*\]", doc or "")
    return [x.strip() for x in m.group(1).split(",")] if m else None


def tensor_rule(opt: dict, param: dict, calls: list[dict], entry: dict, dtype: str) -> dict:
    """How to build an optional tensor: terms per kind of call (packed or not), the docstring's
    letters, its dtype and whether it requires grad (as the tests passed it, else by its dtype)."""
    name = opt["name"]
    prefer = list((entry or {}).get("inputs") or {})
    varlen = [c for c in calls if any(_is_offsets(k) and "tensor" in v for k, v in c.items())]
    plain = [c for c in calls if c not in varlen]
    specs = [c[name]["tensor"] for c in calls if "tensor" in c.get(name, {})]
    return {"plain": _terms(name, plain, prefer), "varlen": _terms(name, varlen, prefer),
            "doc": doc_shape(param.get("doc")), "dtype": specs[0]["dtype"] if specs else dtype,
            "requires_grad": specs[0]["requires_grad"] if specs else True,
            "from": "the tests' calls" if specs else "the docstring"}


def shape_for(rule: dict, shape: dict, seqlens: list | None) -> list | None:
    """The optional tensor's shape on an unseen shape: the tests' terms, else the docstring's letters."""
    terms = rule.get("varlen" if seqlens else "plain")
    if terms:
        return terms
    letters = rule.get("doc")
    if not letters:
        return None
    dims = {**shape, "K": shape.get("K", shape.get("D")), "V": shape.get("V", shape.get("D")),
            "N": len(seqlens) if seqlens else shape.get("B")}
    if any(dims.get(x) is None for x in letters):
        return None
    return [int(dims[x]) for x in letters]


def combos(opts: list[dict], calls: list[dict], n: int, seed: int) -> list[dict]:
    """At most n combinations ({name: value}, value TENSOR for an optional tensor given), none all
    defaults: all options away from their default at once, each alone at its first other value, the
    tests' own, each alone at its other values, then seeded others. Each says whether a test calls it
    (`tests`)."""
    if not opts or n <= 0:
        return []
    names = [o["name"] for o in opts]
    default = {o["name"]: o["default"] for o in opts}

    def value_of(o, c):
        s = c.get(o["name"])
        if s is None:
            return o["default"]
        return TENSOR if "tensor" in s else s.get("value", o["default"])

    used = [{o["name"]: value_of(o, c) for o in opts} for c in calls]
    other = {o["name"]: next(v for v in o["values"] if v != o["default"]) for o in opts}
    alone = [{**default, o["name"]: v} for o in opts for v in o["values"] if v != o["default"]]
    firsts = [{**default, o["name"]: other[o["name"]]} for o in opts]
    todo = [other, *firsts, *used, *alone]
    rng = random.Random(f"flaloop-options:{int(seed)}")
    space = list(itertools.islice(itertools.product(*[o["values"] for o in opts]), 4096))
    rng.shuffle(space)
    todo += [dict(zip(names, vals, strict=True)) for vals in space]
    out: list[dict] = []
    for c in todo:
        if c != default and c not in [x["options"] for x in out]:
            out.append({"options": c, "tests": c in used})
        if len(out) >= n:
            break
    return out


def plan(cfg, params: list[dict], entry: dict, doc: dict | None, shapes: list[dict], *, package: str,
         func_name: str) -> dict:
    """The options drawn and their combinations, each on an unseen shape (plain data for the plan)."""
    out = {"n": cfg.unseen_options, "params": [], "left_out": [], "combos": [], "off": None}
    if cfg.unseen_options <= 0:
        out["off"] = "--unseen-options 0"
        return out
    if not shapes:
        out["off"] = "no unseen shapes to call them on"
        return out
    calls = op_calls(doc, params, package, func_name)
    opts, out["left_out"] = find(params, entry, calls)
    by_name = {p["name"]: p for p in params}
    rules = {o["name"]: tensor_rule(o, by_name[o["name"]], calls, entry, cfg.dtype) for o in opts if o["kind"] == TENSOR}
    for name, rule in list(rules.items()):
        if not (rule["plain"] or rule["varlen"] or rule["doc"]):
            out["left_out"].append({"name": name, "why": "no shape for it: the tests never pass it and its "
                                                         "docstring gives none"})
            opts = [o for o in opts if o["name"] != name]
            rules.pop(name)
    out["params"] = [{**o, **({"rule": rules[o["name"]]} if o["name"] in rules else {})} for o in opts]
    if not opts:
        out["off"] = "the op has no keyword option to vary"
        return out
    for i, c in enumerate(combos(opts, calls, cfg.unseen_options, cfg.unseen_seed)):
        shp = shapes[i % len(shapes)]
        out["combos"].append({"shape": shp, **c})
    return out


def wire_options(combo: dict, params: list[dict]) -> tuple[dict | None, str | None]:
    """{name: SPEC} for the worker (an optional tensor's shape resolved for the combo's shape), or
    (None, why) when one cannot be built here."""
    rules = {p["name"]: p.get("rule") for p in params}
    shp = combo["shape"]
    out = {}
    for name, v in combo["options"].items():
        if v != TENSOR:
            out[name] = {"value": v}
            continue
        rule = rules.get(name) or {}
        shape = shape_for(rule, shp["shape"], shp.get("seqlens"))
        if shape is None:
            return None, (f"no shape for {name} on a {'packed' if shp.get('seqlens') else 'plain'} call: the tests "
                          f"pass it only on the other kind and its docstring gives none")
        out[name] = {"tensor": {"shape": shape, "dtype": rule.get("dtype"), "requires_grad": rule.get("requires_grad")}}
    return out, None


def label(combo: dict) -> str:
    """initial_state=tensor,output_final_state=True on B1-T17-H3-D24."""
    opts = ",".join(f"{k}={v}" for k, v in combo["options"].items())
    return f"{opts} on {combo['shape']['name']}"
