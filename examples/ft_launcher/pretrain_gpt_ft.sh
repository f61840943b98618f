#!/bin/bash
# In-job restarts with NVRx ft_launcher: run on every node (one process per node), for example by
# examples/slurm/pretrain_gpt_local_ckpt.sbatch with LAUNCHER=ft_launcher, or by hand on one node:
#
#   NPROC_PER_NODE=8 examples/ft_launcher/pretrain_gpt_ft.sh \
#       pretrain_gpt.py <model/data/training args> \
#       --save /shared/ckpt --load /shared/ckpt --non-persistent-ckpt-type local \
#       --non-persistent-local-ckpt-dir /local/ckpt --replication ...
#
# ft_launcher (a torchrun with fault tolerance) starts NPROC_PER_NODE workers. When a worker dies
# (a crash, a lost GPU, exit code 75 after the local checkpoint tier was marked bad) or hangs past
# a section timeout (ft_config.yaml), it stops the worker group on every node and starts it again,
# up to FT_MAX_RESTARTS times, without giving up the SLURM allocation. Each start resumes from the
# newest checkpoint: the local tier when it is complete and valid (a lost node's shards come from
# their replicas), otherwise the persistent tier (megatron/training_ext/local_tier/).
#
# Environment (all optional):
#   NPROC_PER_NODE   workers per node (default 8)
#   NNODES           nodes (default 1; "MIN:MAX" for elastic ranges)
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (default 127.0.0.1:29500; the first node)
#   RDZV_ID          rendezvous id shared by the nodes of one job (default: $SLURM_JOB_ID or "local")
#   FT_MAX_RESTARTS  in-job restarts before the launcher gives up (default 3)
#   FT_CONFIG        fault-tolerance settings (default: ft_config.yaml next to this script)
#   PYTHON           interpreter (default python)
# The first argument is the training script, the rest its arguments; --enable-ft-package is added
# so that Megatron reports its sections (setup/step/checkpointing) to the rank monitors.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ $# -lt 1 ]; then
  echo "usage: $0 TRAINING_SCRIPT [ARGS...]" >&2
  exit 2
fi
PYTHON=${PYTHON:-python}
FT_LAUNCHER=${FT_LAUNCHER:-$(command -v ft_launcher || echo "$(dirname "$(command -v "$PYTHON")")/ft_launcher")}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-local}}
FT_MAX_RESTARTS=${FT_MAX_RESTARTS:-3}
FT_CONFIG=${FT_CONFIG:-$here/ft_config.yaml}

# The persistent checkpoint directory (value of --save), for the launcher's progress tracking.
save_dir=""
prev=""
for a in "$@"; do
  [ "$prev" = "--save" ] && save_dir=$a
  prev=$a
done
progress=()
if [ -n "$save_dir" ]; then
  progress=(--ft-checkpoint-iteration-file "$save_dir/latest_checkpointed_iteration.txt")
fi

exec "$FT_LAUNCHER" \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
  --max-restarts "$FT_MAX_RESTARTS" \
  --ft-cfg-path "$FT_CONFIG" "${progress[@]}" \
  "$@" --enable-ft-package
