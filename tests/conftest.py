"""Helpers for the end-to-end tests: launch the real torchrun, read what the scripts wrote."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.dist import free_port  # noqa: E402

# A small, fast job: most of a test's time is process start-up (import torch), not training.
SMALL = ["--steps", "16", "--save-every", "4", "--dim", "32", "--layers", "2", "--heads", "2",
         "--seq-len", "16", "--batch-size", "12", "--log-every", "100"]


def torchrun(script, nproc, run_dir, *flags, max_restarts=3, timeout=240, check=True, nnodes=1, env=None):
    """Run `script` under torchrun with its own free rendezvous port; returns the CompletedProcess.

    With check=True a non-zero exit fails the test and shows the job's output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
           f"--rdzv-id={uuid.uuid4().hex[:8]}", str(REPO / script), "--run-dir", str(run_dir), *map(str, flags)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_sh(*args, timeout=120, env=None):
    """`bash run.sh ARGS` as a user would type it."""
    return subprocess.run(["bash", str(REPO / "run.sh"), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir, rank=0, event=None):
    lines = (Path(run_dir) / f"metrics-rank{rank}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r for r in rows if event is None or r["event"] == event]


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank DDP job that crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("ddp-reference")
    torchrun("ddp/train.py", 2, run_dir, *SMALL)
    return run_dir


@pytest.fixture(scope="session")
def fsdp_four_ranks(tmp_path_factory):
    """The uninterrupted 4-rank FSDP job (SMALL: 16 steps; checkpoints 8, 12 and 16 kept), for the
    resharding and two-node tests. SMALL's global batch of 12 splits over 4, 3 and 2 ranks."""
    run_dir = tmp_path_factory.mktemp("fsdp-4-ranks")
    torchrun("fsdp/train.py", 4, run_dir, *SMALL)
    return run_dir
