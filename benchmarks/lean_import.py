#!/usr/bin/env python3
"""Time the lean import of an op (`flaloop bench --import lean`) and the real one, each in a fresh
process, and say which of the tree's package __init__ files the lean one still ran.

    python benchmarks/lean_import.py TREE IMPORT_PATH FUNC      # e.g. .fla fla.ops.delta_rule chunk_delta_rule
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time, types
tree, path, func, lean = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "lean"
sys.path.insert(0, tree)
from flaloop.inside.worker import op_import
t0 = time.perf_counter()
try:
    op_import.import_op(types.SimpleNamespace(import_path=path, func_name=func, name=func), lean=lean, tree=tree)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
top = path.split(".")[0]
print(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "error": error, "lazy_ran": op_import.LAZY_RAN,
                  "modules": sum(1 for m in sys.modules if m == top or m.startswith(top + "."))}))
"""


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tree = str(Path(argv[0]).resolve())
    for mode in ("lean", "full"):
        p = subprocess.run([sys.executable, "-c", CHILD, tree, argv[1], argv[2], mode], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            doc = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            doc = {"error": (p.stderr or p.stdout)[-500:]}
        print(f"{mode}: {json.dumps(doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
