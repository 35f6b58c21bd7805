"""What importing flaloop does to its own process: numpy's BLAS held to one thread, and nothing
of that left in the environment its children inherit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os, subprocess, sys
{imports}
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OPENBLAS_NUM_THREADS'))"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({{"threads": len(os.listdir("/proc/self/task")), "numpy": "numpy" in sys.modules,
                  "env": os.environ.get("OPENBLAS_NUM_THREADS"), "child": child}}))
"""


# what OpenBLAS reads for its thread count (`make test` sets the first and the last for the suite)
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def probe(imports: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_flaloop_loads_numpy_with_one_blas_thread_and_leaves_the_environment_as_it_was():
    plain = probe("import numpy")
    if (os.cpu_count() or 1) > 1 and sys.platform == "linux":
        assert plain["threads"] > 1  # what the import holds back: OpenBLAS's thread per core
    ours = probe("import flaloop")
    assert ours == {"threads": 1, "numpy": True, "env": None, "child": "None"}
    kept = probe("import flaloop", OPENBLAS_NUM_THREADS="2")  # the user's own setting stands
    assert kept["env"] == "2" and kept["child"] == "2"
