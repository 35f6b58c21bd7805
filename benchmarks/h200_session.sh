#!/usr/bin/env bash
# All of flaloop's H200 evidence for issues 2 and 3 in one lease, spread over two GPUs when the
# machine has them (nvidia-h200-x2), run in the background so that it outlives one device call:
#   lane A (GPU 0): fla_gate_h200.sh (list, init, full gate cold then warm), then the
#                   `flaloop verify` vs FLA `benchmarks.ops.verify --base HEAD` timing, both on
#                   the Triton cache lane B's A/A has filled for the bench shapes (two GPUs);
#   lane B (GPU 1): fla_bench_h200.sh's A/A and planted slowdown on a copy of the checkout
#                   (the slowdown edits chunk.py, which lane A's gate must not see), then the
#                   GPU-only tests.
# With one GPU the lanes run one after the other. Each lane has its own Triton cache, so the
# "cold" gate really compiles everything.
# Usage (device, with .fla carried):
#   bash benchmarks/h200_session.sh start            # launches the lanes and returns
#   bash benchmarks/h200_session.sh wait SECONDS     # waits for the lanes (or SECONDS), packs $OUT
# Results: $OUT/results.tgz (everything), $OUT/summary.txt (the figures), $OUT/progress.txt.
set -uo pipefail
WORK=${WORK:-/tmp/flaloop-h200}
LANE_S=${LANE_S:-1380}  # each lane's own deadline, seconds from `start`
cmd=${1:-}

lane_a() {
  export CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/tc-a FLALOOP_TRITON_CACHE_DIR=/tmp/tc-a
  OUT=$WORK/gate FLA=.fla GATE_TIMEOUT=600 GATE_ARGS="--workers 6" bash benchmarks/fla_gate_h200.sh
  # The verify comparison wants both tools on a warm Triton cache: with two GPUs, wait (at most
  # 420 s) for lane B's A/A to have compiled and tuned every bench cell, then share its cache.
  if [[ ${SHARE_B_CACHE:-0} == 1 ]]; then
    local w=0
    until grep -q '^aa exit' "$WORK/lane_b.log" 2>/dev/null || (( w >= 420 )); do sleep 5; w=$(( w + 5 )); done
    echo "waited ${w}s for lane B's A/A"
    cp -an /tmp/tc-a/. /tmp/tc-b/  # the gate's kernels too (cache entries are content-addressed)
    export FLALOOP_TRITON_CACHE_DIR=/tmp/tc-b
  fi
  local left=$(( LANE_S - ($(date +%s) - $(cat "$WORK/t0")) ))
  OUT=$WORK/verify FLA=.fla PHASES=verify DEADLINE_S=$left bash benchmarks/fla_bench_h200.sh
}

lane_b() {
  local gpu=$1
  export CUDA_VISIBLE_DEVICES=$gpu FLALOOP_TRITON_CACHE_DIR=/tmp/tc-b
  rm -rf /tmp/fla-b && cp -a .fla /tmp/fla-b && rm -rf /tmp/fla-b/profile
  local left=$(( LANE_S - 120 - ($(date +%s) - $(cat "$WORK/t0")) ))
  OUT=$WORK/bench FLA=/tmp/fla-b PHASES="aa slow" DEADLINE_S=$left AA_MAX_S=$(( left / 2 + 60 )) bash benchmarks/fla_bench_h200.sh
  left=$(( LANE_S - ($(date +%s) - $(cat "$WORK/t0")) ))
  if (( left > 60 )); then
    mkdir -p "$WORK/selftest"
    timeout "$left" bash benchmarks/gpu_selftest.sh > "$WORK/selftest/pytest.txt" 2>&1
    echo "gpu selftest exit $?" >> "$WORK/selftest/pytest.txt"
  fi
}

pack() {
  mkdir -p "$OUT"
  {
    cat "$WORK/gate/machine.txt" "$WORK/gate/summary.txt" 2>/dev/null
    for f in bench/bench_summary.txt verify/bench_summary.txt; do
      [[ -f $WORK/$f ]] && { echo "== $f"; cat "$WORK/$f"; }
    done
    tail -n 3 "$WORK/selftest/pytest.txt" 2>/dev/null
  } > "$OUT/summary.txt"
  cp "$WORK/progress.txt" "$OUT/progress.txt" 2>/dev/null
  tar -czf "$OUT/results.tgz" -C "$WORK" --exclude='*.orig' . 2>/dev/null
}

case $cmd in
  start)
    rm -rf "$WORK" /tmp/tc-a /tmp/tc-b && mkdir -p "$WORK"
    date +%s > "$WORK/t0"
    export PYTHONUNBUFFERED=1
    ngpu=$(nvidia-smi -L | wc -l)
    if (( ngpu >= 2 )); then
      setsid bash -c "$(declare -f lane_a); WORK=$WORK LANE_S=$LANE_S SHARE_B_CACHE=1 lane_a > $WORK/lane_a.log 2>&1; touch $WORK/a.done" </dev/null &
      setsid bash -c "$(declare -f lane_b); WORK=$WORK LANE_S=$LANE_S lane_b 1 > $WORK/lane_b.log 2>&1; touch $WORK/b.done" </dev/null &
    else
      setsid bash -c "$(declare -f lane_a lane_b); WORK=$WORK LANE_S=$LANE_S; lane_a > $WORK/lane_a.log 2>&1; touch $WORK/a.done; lane_b 0 > $WORK/lane_b.log 2>&1; touch $WORK/b.done" </dev/null &
    fi
    echo "started on $ngpu GPU(s); work in $WORK"
    ;;
  wait)
    limit=${2:-540}
    t=$(date +%s)
    while (( $(date +%s) - t < limit )) && ! [[ -f $WORK/a.done && -f $WORK/b.done ]]; do
      {
        echo "--- $(( $(date +%s) - $(cat "$WORK/t0") ))s since start"
        tail -n 2 "$WORK/lane_a.log" "$WORK/lane_b.log" 2>/dev/null
        for f in gate/gate_cold.err gate/gate_warm.err bench/aa.err bench/slow.err verify/verify_flaloop.err; do
          [[ -f $WORK/$f ]] && echo "$f: $(tail -c 300 "$WORK/$f" | tr '\r' '\n' | tail -n 1)"
        done
      } > "$WORK/progress.txt"
      sleep 10
    done
    pack
    cat "$WORK/progress.txt" "$OUT/summary.txt"
    [[ -f $WORK/a.done && -f $WORK/b.done ]] && echo "ALL DONE" || echo "STILL RUNNING"
    ;;
  *)
    echo "usage: $0 start | wait SECONDS" >&2
    exit 2
    ;;
esac
