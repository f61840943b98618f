#!/usr/bin/env bash
# Quick start: environment, a real corpus, and a 2-rank CPU training run with persistent and local
# (replicated) checkpoints, one rank's local checkpoint lost and recovered from its replica.
#   scripts/quickstart.sh [WORKDIR]      (default: ./runs/quickstart)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$repo/runs/quickstart}
"$repo/scripts/setup.sh"
py="$repo/.venv/bin/python"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$work"; mkdir -p "$work"; cd "$work"

echo "== corpus: the installed Python's standard library sources, byte-level tokens"
stdlib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
"$py" "$repo/tools/preprocess_data.py" --input "$stdlib" --pattern '*.py' --output-prefix data/stdlib --no-progress

port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
train() {
  local name=$1; shift
  "$py" -m torch.distributed.run --nproc-per-node 2 --master-port "$(port)" "$repo/pretrain_gpt.py" --cpu \
    --data-path data/stdlib --split 98,1,1 --tokenizer-type NullTokenizer --vocab-size 257 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --train-iters 20 --eval-iters 0 --eval-interval 1000 \
    --log-interval 1 --save ckpt --load ckpt --save-interval 10 --ckpt-format torch_dist \
    --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir local --non-persistent-save-interval 5 \
    --replication --replication-jump 1 --replication-factor 2 --loss-log losses.jsonl "$@" > "$name.log" 2>&1 \
    || { tail -40 "$name.log"; echo "quickstart: training failed, see $work/$name.log"; exit 1; }
}
echo "== train iterations 1-15 (persistent checkpoint at 10, local checkpoints at 5 and 15)"
train part1 --exit-interval 15
echo "== lose rank 1's local checkpoint directory: $work/local/1"
rm -rf local/1
echo "== resume: rank 1 recovers iteration 15 from its replica on rank 0, trains to 20"
train part2
echo "== what each rank's start used (validated local tier, docs/local-tier.md)"
grep '^\[local-tier\] rank [0-9]*: local checkpoint at iteration 15' part2.log || true
"$py" - <<'PY'
import json
rows = [json.loads(l) for l in open("losses.jsonl")]
print(f"{'iteration':>9}  {'lm loss':>10}  {'grad norm':>9}")
for r in rows:
    print(f"{r['iteration']:>9}  {r['lm loss (decimal)']:>10.6f}  {r['grad norm (decimal)']:>9.4f}")
assert [r["iteration"] for r in rows] == list(range(1, 21)), "the resumed run did not start at 16"
PY
echo "== checkpoints: persistent (torch_dist) $work/ckpt, local (per rank, with replicas) $work/local"
ls ckpt local/*
