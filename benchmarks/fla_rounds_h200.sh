#!/usr/bin/env bash
# How large is the per-process offset of one cell, and do fresh-process rounds expose it? On the
# GPU machine with a real FLA checkout: A/A of chunk_delta_rule on SHAPE/MODES with ROUNDS rounds,
# cut short (SIGINT, so the run record is still written) after LIMIT_S seconds.
# Usage (device): OUT=dir [SHAPE=B8_T2048_H32_D256] [MODES=fwd] [ROUNDS=4] [LIMIT_S=150] bash benchmarks/fla_rounds_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/flaloop-out}
SHAPE=${SHAPE:-B8_T2048_H32_D256}
OP=chunk_delta_rule
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLALOOP_TRITON_CACHE_DIR=${FLALOOP_TRITON_CACHE_DIR:-/tmp/tc-rounds}
FLA=/tmp/fla-rounds
rm -rf "$FLA" && cp -a "${FLA_SRC:-.fla}" "$FLA" && rm -rf "$FLA/profile"
python3 -m flaloop init "$OP" --repo "$FLA" --target 1.1x --input k=l2norm --input q=l2norm --shapes "$SHAPE" \
  > "$OUT/rounds_init.txt" 2>&1
timeout -s INT -k 15 "${LIMIT_S:-150}" python3 -m flaloop bench "$OP" --repo "$FLA" --aa --json --modes "${MODES:-fwd}" \
  --rounds "${ROUNDS:-4}" --min-pairs 24 --max-pairs 40 --cell-seconds 40 > "$OUT/aa_rounds.json" 2> "$OUT/aa_rounds.err"
echo "bench exit $?"
# cut short: stdout holds {"ok": false, "error": "interrupted", "record": PATH}; use the record
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if "cells" in d else 1)' "$OUT/aa_rounds.json" 2>/dev/null \
  || cp "$(ls -t "$FLA"/profile/$OP-opt/runs/*/record.json | head -n 1)" "$OUT/aa_rounds.json"
python3 - "$OUT/aa_rounds.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("interrupted:", d.get("interrupted"), "wall:", d.get("wall_s"))
for c in d["cells"]:
    est = c.get("estimate") or {}
    print(c["cell"]["id"], c["status"], c.get("verdict"), "pooled", est.get("speedup"), "disagree", c.get("rounds_disagree"))
    for r in c.get("rounds") or []:
        print(f"  round {r['round']}: {r['n_pairs']} pairs, A/A bias {(1 / r['speedup'] - 1) * 100:+.3f}% "
              f"[{(1 / r['ci_high'] - 1) * 100:+.3f}, {(1 / r['ci_low'] - 1) * 100:+.3f}]")
    for rnd in sorted({p["round"] for p in c["pairs"]}):
        rs = [p["cand_ms"] / p["base_ms"] for p in c["pairs"] if p["round"] == rnd]
        print(f"  round {rnd + 1} ratios:", " ".join(f"{x:.4f}" for x in rs))
PY
rm -rf "$FLA"
