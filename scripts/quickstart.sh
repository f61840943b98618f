#!/usr/bin/env bash
# Quick start: environment, a real corpus, and a 2-rank CPU training run with persistent and local
# (replicated) checkpoints, one rank's local checkpoint lost and recovered from its replica, the
# local checkpoint written after the recovery verified.
#   scripts/quickstart.sh [WORKDIR]      (default: ./runs/quickstart)
# Prints a few lines of what happened; the full output of every step is in WORKDIR/*.log.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$repo/runs/quickstart}
py="$repo/.venv/bin/python"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$work"; mkdir -p "$work"; cd "$work"
work=$(pwd)
step() { printf '  %-10s %s\n' "$1" "$2"; }
fail() { echo "quickstart: $1 failed, see $work/$2"; tail -20 "$2"; exit 1; }

echo "quick start: 2 CPU ranks (gloo), GPT with 2 layers, hidden 64; work directory $work"
[ -f "$repo/.venv/.megatron-setup-stamp" ] || echo "  (setting up $repo/.venv first: ~3 min)"
"$repo/scripts/setup.sh" > setup.log 2>&1 || fail "setup" setup.log
step setup "$(tail -1 setup.log | sed 's/^setup: //')"
stdlib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
"$py" "$repo/tools/preprocess_data.py" --input "$stdlib" --pattern '*.py' --output-prefix data/stdlib \
  --tokenizer-type ByteLevelTokenizer --append-eod --workers 2 --no-progress > preprocess.log 2>&1 \
  || fail "preprocessing" preprocess.log
step corpus "$(sed -n 's/^preprocess_data: wrote \(.*\)\.bin\/\.idx: \(.*\)$/\1: \2/p' preprocess.log) (the installed Python's *.py files as UTF-8 bytes; $(sed -n 's/^preprocess_data: skipped .*, \([0-9]*\) binary.*/\1/p' preprocess.log) binary files skipped)"

port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
train() {
  local name=$1; shift
  "$py" -m torch.distributed.run --nproc-per-node 2 --master-port "$(port)" "$repo/pretrain_gpt.py" --cpu \
    --data-path data/stdlib_text_document --split 98,1,1 --tokenizer-type NullTokenizer --vocab-size 257 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --train-iters 20 --eval-iters 0 --eval-interval 1000 \
    --log-interval 1 --save ckpt --load ckpt --save-interval 10 --ckpt-format torch_dist \
    --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir local --non-persistent-save-interval 4 \
    --replication --replication-jump 1 --replication-factor 2 --loss-log losses.jsonl --tensorboard-dir tb "$@" > "$name.log" 2>&1 \
    || fail "training ($name)" "$name.log"
}
losses() {  # "iterations A-B, lm loss X -> Y" from the loss log
  "$py" - "$1" "$2" <<'PY'
import json, sys
a, b = int(sys.argv[1]), int(sys.argv[2])
rows = {r["iteration"]: r for r in map(json.loads, open("losses.jsonl"))}
missing = [i for i in range(a, b + 1) if i not in rows]
assert not missing, f"iterations {missing} were not trained"
print(f"iterations {a}-{b}, lm loss {rows[a]['lm loss (decimal)']:.3f} -> {rows[b]['lm loss (decimal)']:.3f}")
PY
}

train part1 --exit-interval 12
tracker=$(cat ckpt/latest_checkpointed_iteration.txt)
[ "$tracker" = 12 ] || fail "the planned exit at 12 (persistent checkpoint $tracker, expected 12)" part1.log
step trained "$(losses 1 12); persistent checkpoints 10 and 12 (ckpt/; the planned exit saves one), local checkpoints every 4 (local/<rank>/, each shard replicated on the other rank), stopped at 12"
n=$(find local/1 -type f | wc -l)
rm -rf local/1
step lost "rank 1's local checkpoint directory local/1/ ($n files: its iteration-12 shard and its replica of rank 0's)"
train part2
for r in 0 1; do
  line=$(grep -m1 "^\[local-tier\] rank $r: local checkpoint at iteration 12" part2.log || true)
  [ -n "$line" ] || fail "recovery (no [local-tier] line for rank $r)" part2.log
  step "$([ "$r" = 0 ] && echo recovered || echo '')" "${line#\[local-tier\] }"
done
grep -q "^\[local-tier\] rank 1: .*repaired from rank 0's replica" part2.log \
  || fail "recovery (rank 1 was not repaired from rank 0's replica)" part2.log
line=$(grep -m1 "^\[resume-proof\] iteration 12: .* equal to the saved state (local tier " part2.log || true)
[ -n "$line" ] || fail "resume proof (the state loaded from the local tier at iteration 12 is not proven equal to the saved one)" part2.log
step proven "${line#\[resume-proof\] }"
step trained "$(losses 13 20); local checkpoint 16 on both ranks, persistent checkpoint 20"
"$py" "$repo/tools/verify_checkpoint.py" --local-dir local --json verify.json --no-progress > verify.log 2>&1 \
  || fail "verification" verify.log
newest=$("$py" -c 'import json; print(json.load(open("verify.json"))["newest_complete_iteration"])')
[ "$newest" = 16 ] || fail "verification (newest complete local iteration $newest, expected 16)" verify.log
step verified "local checkpoint 16 (written after the recovery): every shard's primary and its replica agree (tools/verify_checkpoint.py)"
step finished "checkpoints: $work/ckpt (persistent), $work/local/<rank> (local); losses: $work/losses.jsonl"
ls tb/events.out.tfevents.* > /dev/null 2>&1 || fail "TensorBoard (no event file in $work/tb)" part2.log
step "" "TensorBoard: $work/tb (view: $py -m tensorboard.main --logdir $work/tb)"
"$py" "$repo/tools/plot_losses.py" losses.jsonl --label "quick start" -o losses.png \
  --title "quick start: rank 1's local checkpoint lost at 12, recovered from its replica" > plot.log 2>&1 \
  || fail "plotting the losses" plot.log
step "" "loss curves: $work/losses.png ($(sed -n 's/^quick start: [0-9]* launch(es), //p' plot.log); tools/plot_losses.py)"
step "" "full logs: $work/{setup,preprocess,part1,part2,verify,plot}.log"
