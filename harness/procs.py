"""The harness's process helpers: a free port, a child that dies with its parent, a job started in a
session of its own and waited for, the process tree read from /proc, a node lost whole. A leaf: it
imports nothing of the harness, so the launcher, the supervisor, the warm parent, the runners and the
tests all take these from here without a circle of imports. It imports no torch."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.stop import STOP_FILE  # (imports no torch)

REPO = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def dies_with_parent(cmd, number):
    """`cmd`, started so that the kernel sends it the signal `number` when this process dies (PR_SET_PDEATHSIG,
    which lasts through exec), set by the child itself before it execs `cmd`: between fork and exec
    (preexec_fn) is unsafe in a process with threads. A child whose parent died first never starts."""
    start = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, int(sys.argv[1])); "
             "os.getppid() == int(sys.argv[2]) or sys.exit(1); os.execv(sys.argv[3], sys.argv[3:])")
    return [sys.executable, "-c", start, str(int(number)), str(os.getpid()), *map(str, cmd)]


def exit_code(returncode, env):
    """A finished job's exit status: the code of a deliberate stop, if a worker left one in the stop
    file of `env` (torchrun itself then exits 0), else torchrun's. A relaunch may reuse `env`."""
    path = env.get(STOP_FILE)  # None: a job not launched by harness.launch.torchrun() (run.sh, say)
    if not path or not os.path.exists(path):
        return returncode
    code = int(Path(path).read_text())
    os.unlink(path)
    return code


def start(cmd, env, log):
    """Start a job in a session of its own (so that a hung one can be killed whole), its output going
    to the file `log`: a pipe nobody reads while the job runs would fill up and stall it."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log, proc.env = Path(log), env
    return proc


def finish(proc, deadline):
    """Wait for a job from start() until the deadline; one still running then is hung: kill its whole
    process group (a SIGSTOPped worker included). Returns (exit code or None, output, hung); the
    code of a deliberate stop, not torchrun's 0 (exit_code())."""
    try:
        proc.wait(timeout=max(1, deadline - time.time()))
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        hung = True
    code = exit_code(proc.returncode, proc.env)
    return None if hung else code, proc.log.read_text(errors="replace"), hung


def children(parent):
    """{pid: the environment it started with} of the processes whose parent is `parent`."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found[int(proc.name)] = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0")
                                             if "=" in v)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def workers(agent_pid, attempt=None):
    """{rank: pid} of the workers torchrun's agent runs in `attempt` (its children, by their environment;
    attempt None: whatever their attempt)."""
    return {int(env["RANK"]): pid for pid, env in children(agent_pid).items()
            if "RANK" in env and (attempt is None or env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt))}


def kill_node(agent):
    """Lose a node whole, as a power cut would: SIGKILL its launcher (torchrun's agent, or a --survivors
    supervisor: a process from start()) and the workers it runs. They are found first: both start them
    in sessions of their own, so killing the launcher's process group alone would leave them training.
    Returns their pids."""
    found, todo = [], [agent.pid]
    while todo:  # every descendant (under run.sh: harness.launch, then the launcher, then its workers)
        kids = list(children(todo.pop()))
        found += kids
        todo += kids
    for kill, pid in [(os.killpg, agent.pid), *((os.kill, pid) for pid in found)]:
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile
            pass
    agent.wait()
    return found
