"""The bench's pure parts, in-process: pairs below the clock floor or throttled are dropped.
`flaloop bench` and `flaloop verify` as a user meets them are in tests/e2e/test_bench.py."""

from __future__ import annotations


def test_pairs_below_the_clock_floor_or_throttled_are_dropped():
    from flaloop.bench.evidence import ClockReading
    from flaloop.bench.model import BenchConfig
    from flaloop.bench.sampling import drop_reason

    cfg = BenchConfig()
    full = ClockReading(1980, 1980, 3201, 0, 40, 300.0)
    slow = ClockReading(1300, 1980, 3201, 0, 40, 300.0)
    hot = ClockReading(1980, 1980, 3201, 0x20, 85, 700.0)  # SW thermal slowdown
    idle_bit = ClockReading(1980, 1980, 3201, 0x1, 40, 300.0)  # "GPU idle" is not a throttle
    assert drop_reason(cfg, full, full) is None
    assert drop_reason(cfg, idle_bit, full) is None
    assert "SM clock 1300 MHz" in drop_reason(cfg, full, slow)
    assert drop_reason(cfg, hot, full) == "throttled: sw_thermal_slowdown (0x20)"
    assert drop_reason(cfg, None, None) is None  # CPU: no clock evidence, nothing dropped
