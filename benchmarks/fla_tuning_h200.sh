#!/usr/bin/env bash
# Does autotuning noise bias an A/A? On the GPU machine, with a real FLA checkout: A/A of
# chunk_delta_rule on SHAPE (default B8_T2048_H32_D256, the cell that read the candidate ~1%
# faster in two A/A runs) first with --independent-tuning (each side autotunes by itself), then
# with flaloop's default (a kernel whose source is unchanged is tuned once and shared).
# Prints both summaries, with the kernels whose tuned config differed between the sides.
# Usage (device): FLA=.fla OUT=dir [SHAPE=...] [GPU=0] bash benchmarks/fla_tuning_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/flaloop-out}
FLA_SRC=${FLA:-.fla}
SHAPE=${SHAPE:-B8_T2048_H32_D256}
OP=chunk_delta_rule
PAIRS=${PAIRS:-"--min-pairs 16 --max-pairs 200 --cell-seconds 20"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${GPU:-0}
export FLALOOP_TRITON_CACHE_DIR=${FLALOOP_TRITON_CACHE_DIR:-/tmp/tc-tuning}
rm -rf "$FLALOOP_TRITON_CACHE_DIR"
FLA=/tmp/fla-tuning
rm -rf "$FLA" && cp -a "$FLA_SRC" "$FLA" && rm -rf "$FLA/profile"
python3 -m flaloop init "$OP" --repo "$FLA" --target 1.1x --input k=l2norm --input q=l2norm --shapes "$SHAPE" \
  > "$OUT/tuning_init.txt" 2>&1
for run in independent shared; do
  extra=(); [[ $run == independent ]] && extra=(--independent-tuning)
  t0=$(date +%s)
  python3 -m flaloop bench "$OP" --repo "$FLA" --aa --json $PAIRS "${extra[@]}" > "$OUT/aa_$run.json" 2> "$OUT/aa_$run.err"
  echo "A/A $run: exit $? in $(( $(date +%s) - t0 ))s"
done
python3 benchmarks/summarize_runs.py aa="$OUT/aa_independent.json" aa="$OUT/aa_shared.json" | tee "$OUT/tuning_summary.txt"
rm -rf "$FLA"
