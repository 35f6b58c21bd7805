#!/usr/bin/env bash
# Issue 3's A/A and planted slowdown on all 12 chunk_delta_rule cells within one device call: the
# six shapes split over the two GPUs of an nvidia-h200-x2, one lane each (own FLA copy, own
# Triton cache), so that the cold compile of FLA's kernels for the bench shapes (~430 s on one
# GPU) takes about half the wall time. In the foreground; results in $OUT.
# Usage (device, .fla carried): bash benchmarks/h200_split.sh    [LANE_S=520 AA_MAX_S=420]
set -uo pipefail
OUT=${OUT:-/tmp/flaloop-out}
LANE_S=${LANE_S:-520}
AA_MAX_S=${AA_MAX_S:-420}
WORK=/tmp/flaloop-split
SHAPES0="B1_T8192_H96_D128 B4_T4096_H64_D128 B4_T2048_H16_D128"
SHAPES1="B2_T16384_H16_D128 B8_T2048_H32_D256 B8_T1024_H8_D64"
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/machine.txt"
ngpu=$(nvidia-smi -L | wc -l)
for lane in 0 1; do
  gpu=$(( ngpu >= 2 ? lane : 0 ))
  shapes=SHAPES$lane
  rm -rf "/tmp/fla-s$lane" /tmp/tc-s$lane && cp -a .fla "/tmp/fla-s$lane" && rm -rf "/tmp/fla-s$lane/profile"
  CUDA_VISIBLE_DEVICES=$gpu FLALOOP_TRITON_CACHE_DIR=/tmp/tc-s$lane OUT=$WORK/lane$lane FLA=/tmp/fla-s$lane \
    SHAPES="${!shapes}" PHASES="aa slow" DEADLINE_S=$LANE_S AA_MAX_S=$AA_MAX_S \
    bash benchmarks/fla_bench_h200.sh > "$WORK/lane$lane.log" 2>&1 &
  (( ngpu >= 2 )) || wait
done
wait
python3 benchmarks/summarize_runs.py aa="$WORK/lane0/aa.json,$WORK/lane1/aa.json" \
  slower="$WORK/lane0/slow.json,$WORK/lane1/slow.json" > "$OUT/summary.txt" 2>&1
grep -h "exit" "$WORK"/lane*.log >> "$OUT/summary.txt"
tar -czf "$OUT/results.tgz" -C "$WORK" --exclude='*.orig' .
cat "$OUT/machine.txt" "$OUT/summary.txt"
