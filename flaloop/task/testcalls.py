"""The frozen test's own calls into the op's package, recorded when the gate runs at the base.

The gate's plugin `inside/scripts/flaloop_callrec.py` writes one file per pytest process; `merge` makes
them one document, `calls.json` beside the gate's results (`profile/<op>-opt/gate/calls.json`):

    {"schema": 1, "package": "<pkg>",
     "calls": [{"fn": "<module>:<qualname>", "count": N, "args": [SPEC, ...], "kwargs": {"name": SPEC}}]}

SPEC is `{"tensor": {"shape", "dtype", "requires_grad"}}`, `{"value": <json>}`,
`{"seq": [SPEC, ...], "kind": "tuple"|"list"}` or `{"opaque": "<type name>"}`. Beside those keys
the document says where it was recorded (`base_commit`, `test_file`), so that a later bench of the
same contract finds it and one of another base is not mistaken for it.

Recorded at the base only: a candidate's process could forge what it records, as it can forge the
gate itself. The bench replays a seeded `sample` of them, base against candidate in separate
workers (bench/replay.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from flaloop.core import fsutil
from flaloop.core.workspace import Workspace

SCHEMA = 1


def key(call: dict) -> str:
    return json.dumps({"fn": call["fn"], "args": call.get("args") or [], "kwargs": call.get("kwargs") or {}},
                      sort_keys=True)


def merge(parts: list[dict], package: str) -> dict:
    """One document from the per-process files: the same call (function and structure) once, its
    counts summed; ordered by function, then the most frequent first."""
    counts: dict[str, int] = {}
    for part in parts:
        for call in part.get("calls") or []:
            if isinstance(call, dict) and isinstance(call.get("fn"), str):
                k = key(call)
                counts[k] = counts.get(k, 0) + int(call.get("count") or 1)
    calls = []
    for k, n in counts.items():
        c = json.loads(k)
        calls.append({"fn": c["fn"], "count": n, "args": c["args"], "kwargs": c["kwargs"]})
    calls.sort(key=lambda c: (c["fn"], -c["count"], key(c)))
    return {"schema": SCHEMA, "package": package, "calls": calls}


def collect(out_dir: Path, package: str) -> dict | None:
    """The merged document of what the recorder wrote into `out_dir` (None: nothing recorded)."""
    parts = []
    for f in sorted(Path(out_dir).glob("calls-*.json")):
        try:
            parts.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    doc = merge(parts, package)
    return doc if doc["calls"] else None


def store(workspace: Workspace | Path, doc: dict, *, base_commit: str, test_file: str) -> Path:
    return fsutil.atomic_write_json(Workspace.of(workspace).gate_calls, {**doc, "base_commit": base_commit, "test_file": test_file})


def load(workspace: Workspace | Path, test_file: str) -> dict | None:
    """The recorded calls of this test file (None when none were recorded, or for another test file)."""
    doc = fsutil.read_json_cache(Workspace.of(workspace).gate_calls)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("calls"), list):
        return None
    if doc.get("test_file") not in (None, test_file):
        return None
    return doc


def is_op(fn: str, package: str, func_name: str) -> bool:
    """Whether `module:qualname` names the op's own function (defined in any module of its package)."""
    mod, _, qual = fn.partition(":")
    return qual == func_name and (mod == package or mod.startswith(package + "."))


def sample(doc: dict | None, n: int, seed: int, *, package: str, func_name: str) -> list[dict]:
    """A seeded sample of n recorded calls, spread over the functions called: in turns, the op's own
    function first, then the others in a seeded order, each turn the next of its calls in a seeded
    order. Each call keeps its index in the document (`index`), so the record names it exactly."""
    if not doc or n <= 0:
        return []
    rng = random.Random(f"flaloop-testcalls:{int(seed)}")
    by_fn: dict[str, list[tuple[int, dict]]] = {}
    for i, c in enumerate(doc.get("calls") or []):
        by_fn.setdefault(c["fn"], []).append((i, c))
    fns = sorted(by_fn)
    rng.shuffle(fns)
    fns.sort(key=lambda f: not is_op(f, package, func_name))  # stable: the op's own first
    queues = {f: rng.sample(by_fn[f], len(by_fn[f])) for f in fns}
    out: list[dict] = []
    while len(out) < n and any(queues.values()):
        for f in fns:
            if queues[f] and len(out) < n:
                i, c = queues[f].pop(0)
                out.append({**c, "index": i})
    return out


def describe(call: dict) -> str:
    """fn(q=bfloat16[1, 64, 2, 32], scale=0.5): a call as a person reads it."""
    def one(s: dict) -> str:
        if "tensor" in s:
            t = s["tensor"]
            return f"{t['dtype']}[{', '.join(map(str, t['shape']))}]" + ("+grad" if t.get("requires_grad") else "")
        if "value" in s:
            return repr(s["value"])
        if "seq" in s:
            inner = ", ".join(one(x) for x in s["seq"])
            return f"({inner})" if s.get("kind") == "tuple" else f"[{inner}]"
        return f"<{s.get('opaque')}>"

    parts = [one(a) for a in call.get("args") or []] + [f"{k}={one(v)}" for k, v in (call.get("kwargs") or {}).items()]
    return f"{call['fn'].partition(':')[2] or call['fn']}({', '.join(parts)})"
