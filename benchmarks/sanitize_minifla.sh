#!/bin/bash
# flaloop sanitize on examples/minifla on the GPU machine: a read past the end and an uninitialized read
# planted in the forward kernel (the gate still green), then an honest edit under all four tools.
# Usage (repository root): bash benchmarks/sanitize_minifla.sh OUT_DIR
export PYTHONPATH=$PWD GIT_AUTHOR_NAME=b GIT_AUTHOR_EMAIL=b@l GIT_COMMITTER_NAME=b GIT_COMMITTER_EMAIL=b@l
O=${1:-/tmp/sanitize-out}; mkdir -p "$O"; D=/tmp/mf; rm -rf $D; cp -r examples/minifla $D; cd $D || exit 1
git init -q && git add -A && git commit -qm base
F="python3 -m flaloop"; K=minifla/ops/linear_attn/chunk.py; cp $K /tmp/k.orig
$F init chunk_linear_attn --shapes B2_T100_H2_D16 --modes fwd,fwdbwd --force > "$O/init.txt" 2>&1
step() {  # name, seconds, command...
  local n=$1 s=$2; shift 2; local t0=$(date +%s.%N)
  timeout "$s" "$@" > "$O/$n.json" 2> "$O/$n.err"; local rc=$?
  echo "$n: exit $rc in $(echo "$(date +%s.%N) - $t0" | bc) s" | tee -a "$O/times.txt"
}
plant() { python3 -c "
import sys; p='$K'; s=open(p).read(); old, new = sys.argv[1], sys.argv[2]
assert s.count(old) >= 1, old; open(p, 'w').write(s.replace(old, new, 1))" "$1" "$2"; }  # the first: the forward
Q="b_q = tl.load(q + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)"
# the row mask dropped: the last sequence's partial chunk reads past the end of q (its rows are never stored)
plant "$Q" "b_q = tl.load(q + r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)"
step oob-sanitize 60 $F sanitize chunk_linear_attn --tool memcheck --json
step oob-gate 60 $F gate chunk_linear_attn --json
cp /tmp/k.orig $K
S="b_o = b_o * scale"
# reads the output buffer (torch.empty) before it is written; clamped, so garbage never turns into NaN
plant "$S" "$S + 0 * tl.minimum(tl.maximum(tl.load(o + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32), -1.), 1.)"
step uninit-sanitize 60 $F sanitize chunk_linear_attn --tool initcheck --json
step uninit-gate 60 $F gate chunk_linear_attn --json
cp /tmp/k.orig $K
plant "$S" "b_o *= scale"
step honest-sanitize 120 $F sanitize chunk_linear_attn --json
cp -r profile/chunk_linear_attn-opt/sanitize "$O/sanitize-docs" 2>/dev/null
find "$O/sanitize-docs" -name "*.log" -size +200k -delete 2>/dev/null
exit 0
