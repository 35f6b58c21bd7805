#!/usr/bin/env bash
# flaloop's gate on a real FLA checkout, on the GPU machine: list, init, then the full gate of
# chunk_delta_rule twice (cold: empty Triton cache and no baseline; warm: both kept).
# Usage (device): FLA=.fla OUT=/some/dir [GATE_ARGS="--workers 4"] bash benchmarks/fla_gate_h200.sh
# GATE_ARGS defaults to 4 pytest-xdist workers on the one GPU: a cold FLA gate is bound by
# Triton compiling and autotuning, which then runs in 4 processes at once.
set -uo pipefail
OUT=${OUT:-/tmp/flaloop-out}
FLA=${FLA:-.fla}
OP=${OP:-chunk_delta_rule}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/flaloop-triton-cache}
export PYTHONUNBUFFERED=1
rm -rf "$TRITON_CACHE_DIR" "$FLA/profile/$OP-opt"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$OUT/machine.txt"
python3 -m flaloop list --repo "$FLA" | tee "$OUT/list.txt"
python3 -m flaloop init "$OP" --repo "$FLA" --target 1.1x --input k=l2norm | tee "$OUT/init.txt"
for phase in cold warm; do
  start=$(date +%s.%N)
  python3 -m flaloop gate "$OP" --repo "$FLA" --json --timeout "${GATE_TIMEOUT:-900}" ${GATE_ARGS:---workers 4} \
    > "$OUT/gate_$phase.json" 2> "$OUT/gate_$phase.err"
  rc=$?
  end=$(date +%s.%N)
  python3 - "$OUT/gate_$phase.json" "$phase" "$rc" "$start" "$end" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
path, phase, rc, t0, t1 = sys.argv[1:]
d = json.load(open(path))
c = d.get("counts") or {}
b = d.get("baseline") or {}
print(f"{phase}: exit {rc} green={d.get('green')} wall {float(t1)-float(t0):.1f}s "
      f"(baseline at base: {b.get('wall_s')}s{' cached' if b.get('cached') else ''}; "
      f"candidate pytest {c.get('time_s')}s) passed={c.get('passed')} failed={c.get('failed')} "
      f"skipped={c.get('skipped')} selected={c.get('selected')} findings={[f['kind'] for f in d.get('findings', [])]}")
PY
done
cp "$FLA/profile/$OP-opt/contract.json" "$OUT/contract.json" 2>/dev/null
tail -n 30 "$OUT/gate_cold.err"
