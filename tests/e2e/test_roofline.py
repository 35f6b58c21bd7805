"""The GPU ceilings measured once by the real step script, then read from the cache. The formulas
against hand computations are in tests/unit/test_roofline.py."""

from __future__ import annotations

import json
import sys

from flaloop.bench import roofline

# -- hand computations, two shapes per family ---------------------------------------------------


# -- ceilings ------------------------------------------------------------------------------------

def test_ceilings_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = roofline.ceilings_for(sys.executable, None)
    path = tmp_path / "flaloop" / "ceilings-cpu.json"
    assert path.is_file()
    assert first.device == "cpu" and first.bandwidth_gbs > 0 and first.peak_tflops > 0
    assert first.gemm_dtype == "float32"
    # the cache is what a second call reads: plant a value no machine measures
    data = json.loads(path.read_text())
    data["bandwidth_gbs"] = 12345.0
    path.write_text(json.dumps(data))
    assert roofline.ceilings_for(sys.executable, None).bandwidth_gbs == 12345.0
    assert roofline.cache_path("GPU-ab/12").name == "ceilings-GPU-ab_12.json"


