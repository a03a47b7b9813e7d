"""Helpers for the end-to-end tests: launch the real torchrun, read what the scripts wrote."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import parse_config  # noqa: E402
from harness import launch  # noqa: E402
from harness.metrics import Watch  # noqa: E402

# A small, fast job: most of a test's time is process start-up (import torch), not training.
SMALL = ["--steps", "16", "--save-every", "4", "--dim", "32", "--layers", "2", "--heads", "2",
         "--seq-len", "16", "--batch-size", "12", "--log-every", "100"]
# With dropout, a resume is bitwise only if each rank's saved RNG state is restored: crash tests use it.
DROPOUT = ["--dropout", "0.1"]


def torchrun(script, nproc, run_dir, *flags, restarts=0, max_restarts=3, timeout=240, check=True, env=None):
    """Run `script` under torchrun (harness/launch.py: a free rendezvous port of its own, the restart-safe
    environment); returns the CompletedProcess, whose returncode is a deliberate stop's code if a worker
    left one (torchrun itself exits 0 then: common.config.stop).

    With check=True the job must exit 0 after exactly `restarts` torchrun restarts (as its summary.json
    counts them), and with restarts=0 print no Traceback: torchrun's restarts would otherwise hide a
    crash behind the right digest. A test that injects a crash says how many restarts it causes."""
    cmd, env = launch.torchrun(script, nproc, run_dir, flags, max_restarts=max_restarts, env=env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    proc.returncode = launch.exit_code(proc.returncode, env)  # a deliberate stop's code, as run.sh reports it
    if check:
        wrong = launch.problems(run_dir, proc.returncode, proc.stdout + proc.stderr, restarts)
        assert not wrong, f"{' '.join(cmd)}\n{'; '.join(wrong)}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
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


@pytest.fixture(scope="session", autouse=True)
def no_snapshots_left_behind():
    """A job that stops for good (exit 2 or 3, a crash with no restart left) leaves its memory snapshots
    for a restart that the tests never make: remove the folders this session's jobs made in /dev/shm."""
    before = set(Path("/dev/shm").glob(f"snapshots-{os.getuid()}-*"))
    yield
    for folder in set(Path("/dev/shm").glob(f"snapshots-{os.getuid()}-*")) - before:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank DDP job (with DROPOUT) that crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("ddp-reference")
    torchrun("ddp/train.py", 2, run_dir, *SMALL, *DROPOUT)
    return run_dir


PEAK_TFLOPS = 0.5  # a bf16 peak for the CPU, so that fsdp_reference logs MFU as on a GPU


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank FSDP job (SMALL, DROPOUT) that crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("fsdp-reference")
    torchrun("fsdp/train.py", 2, run_dir, *SMALL, *DROPOUT, env={"PEAK_TFLOPS": str(PEAK_TFLOPS)})
    return run_dir


@pytest.fixture(scope="session")
def fsdp_four_ranks(tmp_path_factory):
    """The uninterrupted 4-rank FSDP job (SMALL: 16 steps; checkpoints 8, 12 and 16 kept), for the
    resharding and two-node tests. SMALL's global batch of 12 splits over 4, 3 and 2 ranks."""
    run_dir = tmp_path_factory.mktemp("fsdp-4-ranks")
    torchrun("fsdp/train.py", 4, run_dir, *SMALL)
    return run_dir


def wait_for_step(run_dir, step, proc, rank=0):
    """Watch rank `rank`'s metrics until it has completed `step`: its step event, or None if the job ended
    first (a fault meant for that step then never fires, and the test must fail, not pass)."""
    return Watch(run_dir).first("step", proc, rank=rank, min_step=step)


def refused(script, *argv, code=2):
    """The one line (newline included) that `script`'s flag check prints as it refuses `argv`, before any
    worker starts (run.sh's preflight, and each worker at its start), asserting its exit code."""
    module = launch.load_script(REPO / script)  # loaded afresh: each flag's help is read from its source
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr):
        parse_config(module.Config, module.check, [*map(str, argv)], presets=getattr(module, "PRESETS", None))
    err = stderr.getvalue()
    assert exit_.value.code == code and err.count("\n") == 1, (exit_.value.code, err)
    return err
