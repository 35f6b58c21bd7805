#!/usr/bin/env bash
# flaloop's paired benchmark on a real FLA checkout, on the GPU machine (issue 3's evidence):
#   1. A/A on chunk_delta_rule, every registry shape x fwd/fwdbwd, keys l2-normalised (valid inputs):
#      goal |bias| <= 0.25% per cell and no FASTER/SLOWER verdict;
#   2. a planted ~1% slowdown (an extra elementwise pass over the output in the candidate's
#      working tree; never committed): goal SLOWER on every cell;
#   3. wall time of `flaloop verify` against FLA's `python -m benchmarks.ops.verify --base` on
#      the same op in the same run.
# Usage (device): FLA=.fla OUT=dir DEADLINE_S=540 SHAPES="..." PHASES="aa slow verify" bash benchmarks/fla_bench_h200.sh
# Every phase runs under what is left of DEADLINE_S, so a short lease still returns results.
# PHASES picks the phases (default all three): benchmarks/h200_session.sh runs aa+slow on one GPU
# and verify on the other. VERIFY_ARGS is passed to `flaloop verify` (default: --workers 4).
set -uo pipefail
OUT=${OUT:-/tmp/flaloop-out}
FLA=${FLA:-.fla}
OP=chunk_delta_rule
DEADLINE_S=${DEADLINE_S:-540}
SHAPES=${SHAPES:-"B1_T8192_H96_D128 B2_T16384_H16_D128 B4_T2048_H16_D128 B4_T4096_H64_D128 B8_T2048_H32_D256 B8_T1024_H8_D64"}
PAIRS=${PAIRS:-"--min-pairs 16 --max-pairs 200 --cell-seconds 20"}
PHASES=${PHASES:-"aa slow verify"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export FLALOOP_TRITON_CACHE_DIR=${FLALOOP_TRITON_CACHE_DIR:-/tmp/flaloop-triton-cache}
export TRITON_CACHE_DIR=$FLALOOP_TRITON_CACHE_DIR
t_start=$(date +%s)
left() { local l=$(( DEADLINE_S - ($(date +%s) - t_start) )); echo $(( l > 1 ? l : 1 )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # at most $1 seconds, within the deadline
# A phase cut short by its timeout gets SIGINT: flaloop then still writes its run record, which
# stands in for the result (stdout then holds only {"ok": false, "error": "interrupted", "record": ...}).
from_record() {  # from_record JSON KIND: when JSON holds no result, the run record it names (or the newest of KIND)
  local rec
  rec=$(python3 - "$1" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    d = {}
print("keep" if "cells" in d or "bench" in d else d.get("record") or "")
PY
)
  [[ $rec == keep ]] && return
  [[ -n $rec ]] || rec=$(ls -t "$FLA"/profile/$OP-opt/runs/*-"$2"/record.json 2>/dev/null | head -n 1)
  [[ -n $rec ]] && cp "$rec" "$1" && echo "(cut short: using $rec)"
}
shape_args=(); for s in $SHAPES; do shape_args+=(--shapes "$s"); done

python3 -m flaloop init "$OP" --repo "$FLA" --force --target 1.1x --input k=l2norm --input q=l2norm \
  "${shape_args[@]}" > "$OUT/bench_init.txt" 2>&1

if has aa; then
echo "== A/A ($(left)s left)"
t0=$(date +%s)
timeout -s INT -k 30 "$(cap "${AA_MAX_S:-100000}")" python3 -m flaloop bench "$OP" --repo "$FLA" --aa --json $PAIRS \
  > "$OUT/aa.json" 2> "$OUT/aa.err"
echo "aa exit $? in $(( $(date +%s) - t0 ))s"
from_record "$OUT/aa.json" aa
fi

if has slow; then
echo "== planted slowdown ($(left)s left)"
chunk="$FLA/fla/ops/delta_rule/chunk.py"
cp "$chunk" "$OUT/chunk.py.orig"
python3 - "$chunk" <<'PY'
import re, sys
p = sys.argv[1]; s = open(p).read()
# an extra elementwise pass over the forward output: o <- o * 1 (same values, one more kernel)
new, n = re.subn(r"(\n(\s+)return o, final_state\n)", r"\n\2o = o.mul(1.0)\1", s, count=1)
assert n == 1, "could not find `return o, final_state` in chunk.py"
open(p, "w").write(new)
PY
t0=$(date +%s)
timeout -s INT -k 30 "$(left)" python3 -m flaloop bench "$OP" --repo "$FLA" --json $PAIRS > "$OUT/slow.json" 2> "$OUT/slow.err"
echo "slowdown bench exit $? in $(( $(date +%s) - t0 ))s"
from_record "$OUT/slow.json" bench
cp "$OUT/chunk.py.orig" "$chunk"
fi

if has verify; then
# The same scope on both sides: the full gate, then every registry shape x fwd/fwdbwd against HEAD.
echo "== verify: flaloop vs FLA ($(left)s left; $(find "$TRITON_CACHE_DIR" -type f 2>/dev/null | wc -l) files in $TRITON_CACHE_DIR)"
t0=$(date +%s)
timeout -s INT -k 30 "$(left)" python3 -m flaloop verify "$OP" --repo "$FLA" --base HEAD --json ${VERIFY_ARGS:---workers 4} $PAIRS \
  > "$OUT/verify_flaloop.json" 2> "$OUT/verify_flaloop.err"
echo "flaloop verify exit $? in $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
(cd "$FLA" && PYTHONPATH=. timeout "$(left)" python3 -m benchmarks.ops.verify --op "$OP" --base HEAD \
  > "$OUT/verify_fla.txt" 2>&1)
echo "FLA verify exit $? in $(( $(date +%s) - t0 ))s"
fi
python3 benchmarks/summarize_runs.py aa="$OUT"/aa.json slower="$OUT"/slow.json "$OUT"/verify_flaloop.json \
  | tee "$OUT/bench_summary.txt"
