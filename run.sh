#!/usr/bin/env bash
# Fault-tolerant distributed training, reference scripts.
#
#   bash run.sh ddp|fsdp|rpc NPROC [script flags]   train under torchrun, restarting failed workers
#   bash run.sh test [pytest args]                  the test suite (CPU, gloo, real torchrun)
#   bash run.sh compare NPROC [--quick] [flags]      measured DDP / FSDP / parameter-server table
#   bash run.sh chaos [--trials N] [--seed S]        random faults, each job checked against its reference
#
# Multi-node: NNODES, NODE_RANK, RDZV_ENDPOINT (host:port of the first node), RDZV_ID; MAX_RESTARTS.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  echo "usage: bash run.sh ddp|fsdp|rpc NPROC [script flags]  |  bash run.sh test [pytest args]" \
       " |  bash run.sh compare NPROC [flags]  |  bash run.sh chaos [flags]" >&2
  exit 2
}

# The current interpreter if it has what requirements.txt lists, else a .venv made once for it.
python_with_requirements() {
  local check="import torch, numpy, tabulate, pytest, yaml; from torch.distributed.fsdp import fully_shard"
  for py in .venv/bin/python "${PYTHON:-python3}"; do
    if [ -x "$(command -v "$py")" ] && "$py" -c "$check" 2>/dev/null; then PY=$py; return; fi
  done
  echo "run.sh: installing requirements.txt into .venv (first run only)" >&2
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
  PY=.venv/bin/python
}

mode=${1:-}
[ $# -gt 0 ] && shift
case "$mode" in
  ddp) script=ddp/train.py ;;
  fsdp) script=fsdp/train.py ;;
  rpc) script=rpc/ps.py ;;
  test) python_with_requirements; exec "$PY" -m pytest tests "$@" ;;
  compare) python_with_requirements; exec "$PY" -m common.compare "$@" ;;
  chaos) python_with_requirements; exec "$PY" -m common.chaos "$@" ;;
  *) usage ;;
esac

nproc=${1:-}
[[ $nproc =~ ^[1-9][0-9]*$ ]] || usage
shift
python_with_requirements
nnodes=${NNODES:-1}

# Check the flags once, here, before torchrun starts workers that would each fail and be retried.
"$PY" -m common.config "$script" $((nproc * nnodes)) "$@"

# torchrun shares its rendezvous store with the workers by default; after a restart the new
# process group can then read the failed attempt's addresses and fail to connect or hang
# (pytorch issues 135712, 167288). A store of the workers' own makes restarts reliable.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
node_rank=()
[ -n "${NODE_RANK:-}" ] && node_rank=(--node-rank "$NODE_RANK")
exec "$PY" -m torch.distributed.run \
  --nnodes "$nnodes" "${node_rank[@]}" --nproc-per-node "$nproc" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:-localhost:0}" --rdzv-id "${RDZV_ID:-$mode}" \
  "$script" "$@"
