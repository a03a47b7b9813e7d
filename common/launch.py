"""The one torchrun command line of the runners (compare, chaos) and the tests, and the check every
finished job gets.

torchrun shares its rendezvous store with the workers by default; after a restart the new process
group can then read the failed attempt's addresses and fail to connect or hang (pytorch issues
135712, 167288). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, read by the agent, gives the workers a store
of their own, so every launch here sets it.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from common.dist import free_port

REPO = Path(__file__).resolve().parents[1]


def torchrun(script, nproc, run_dir, flags=(), nnodes=1, max_restarts=3, endpoint=None, rdzv_id=None, env=None):
    """(command, environment) running `script --run-dir run_dir flags` under torchrun. The rendezvous
    is on a free port of this machine, unless the agents of one job on several nodes share `endpoint`
    (host:port) and `rdzv_id`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint or f'localhost:{free_port()}'}", f"--rdzv-id={rdzv_id or uuid.uuid4().hex[:8]}",
           str(REPO / script), "--run-dir", str(run_dir), *map(str, flags)]
    return cmd, {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}


def start(cmd, env, log):
    """Start a job in a session of its own (so that a hung one can be killed whole), its output going
    to the file `log`: a pipe nobody reads while the job runs would fill up and stall it."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = Path(log)
    return proc


def finish(proc, deadline):
    """Wait for a job from start() until the deadline; one still running then is hung: kill its whole
    process group (a SIGSTOPped worker included). Returns (exit code or None, output, hung)."""
    try:
        proc.wait(timeout=max(1, deadline - time.time()))
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        hung = True
    return None if hung else proc.returncode, proc.log.read_text(errors="replace"), hung


def problems(run_dir, code, output, restarts=0):
    """What is wrong with a finished job that should have exited 0 after exactly `restarts` torchrun
    restarts ([] if nothing). torchrun's restarts hide failures: a job that crashed and resumed still
    ends with the right digest. So the count in summary.json must be the expected one, and a job
    expected to run clean must print no Traceback. A job with restarts may print some: when a worker
    dies, its peers' collectives fail with a Traceback before the agent stops them."""
    if code != 0:
        return [f"exit code {code}"]
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return ["exit 0 without a summary.json"]
    found, wrong = json.loads(path.read_text())["restarts"], []
    if found != restarts:
        wrong.append(f"{found} torchrun restarts, expected {restarts}")
    if restarts == 0 and "Traceback" in output:
        wrong.append("a Traceback in the output of a job that should have run clean")
    return wrong


def workers(agent_pid, attempt):
    """{rank: pid} of the workers torchrun's agent runs in `attempt` (its children, by their environment)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
            if env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
                found[int(env["RANK"])] = int(proc.name)
        except (OSError, ValueError, KeyError, IndexError):  # gone meanwhile, or not a worker
            continue
    return found
