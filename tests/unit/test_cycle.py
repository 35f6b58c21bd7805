"""Cycle time without losing trust, in-process: the gate's plan over several GPUs keeps one for the
bench, and the lean check compares the kernels one call launches. Gate reuse, quick benches and a red
gate withdrawing the bench beside it are in tests/e2e/test_cycle.py."""

from __future__ import annotations

from flaloop.cli.measure import GateOptions, gate_plan


def test_gate_plan_spreads_the_gate_over_the_gpus_and_keeps_one_for_the_bench(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert gate_plan(GateOptions()) == (24, ["2", "3", "5"], None)  # 8 a GPU
    assert gate_plan(GateOptions(), for_verify=True) == (16, ["2", "3"], "5")
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert gate_plan(GateOptions()) == (6, ["2", "3", "5"], None)  # one per two cores
    assert gate_plan(GateOptions(workers=3, gpus="0,1"), for_verify=True) == (3, ["0"], "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # one GPU: the workers share it (a cold gate is compile-bound), the bench comes after the gate
    assert gate_plan(GateOptions(), for_verify=True) == (6, None, None)
    assert gate_plan(GateOptions(workers=2)) == (2, None, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gate_plan(GateOptions()) == (0, None, None)  # no GPU: as asked, none by default


def test_the_lean_check_compares_the_kernels_one_call_launches():
    from flaloop.guard.dynamic import lean_kernels

    real = {"triton_launches": {"chunk_fwd_kernel_o": 1, "fused_fast_path": 1}, "kernels": {"chunk_fwd_kernel_o": 1}}
    same = {"triton_launches": dict(real["triton_launches"]), "kernels": dict(real["kernels"])}
    assert lean_kernels("cand", "c/fwd", same, real) == []
    # the real import registered a fused path that the lean one never saw: another dispatch
    lean = {"triton_launches": {"chunk_fwd_kernel_o": 2}, "kernels": {"chunk_fwd_kernel_o": 1}}
    [f] = lean_kernels("cand", "c/fwd", lean, real)
    assert f.rule == "lean-import-differs" and f.blocking
    assert "only with the real import ['fused_fast_path']" in f.message and "other counts ['chunk_fwd_kernel_o']" in f.message
    assert lean_kernels("cand", "c/fwd", None, real) == []  # probes off: nothing to compare
