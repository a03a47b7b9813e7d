"""Helpers for the end-to-end tests: launch the real torchrun, read what the scripts wrote."""
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import parse_config  # noqa: E402
from harness import launch, procs  # noqa: E402
from harness.metrics import Watch  # noqa: E402

# A small, fast job: most of a test's time is process start-up (import torch), not training.
SMALL = ["--steps", "16", "--save-every", "4", "--dim", "32", "--layers", "2", "--heads", "2",
         "--seq-len", "16", "--batch-size", "12", "--log-every", "100"]
# With dropout, a resume is bitwise only if each rank's saved RNG state is restored: crash tests use it.
DROPOUT = ["--dropout", "0.1"]


def torchrun(script, nproc, run_dir, *flags, restarts=0, max_restarts=3, timeout=240, check=True, env=None,
             faults=""):
    """Run `script` under torchrun (harness/launch.py: a free rendezvous port of its own, the restart-safe
    environment); returns the CompletedProcess, whose returncode is a deliberate stop's code if a worker
    left one (torchrun itself exits 0 then: common.stop.stop). `faults`: the job's FT_FAULTS, the test
    faults it asks for (tiers/faults.py), e.g. "crash-at-step=10,rank=1".

    With check=True the job must exit 0 after exactly `restarts` torchrun restarts (as its summary.json
    counts them), and with restarts=0 print no Traceback: torchrun's restarts would otherwise hide a
    crash behind the right digest. A test that injects a crash says how many restarts it causes."""
    cmd, env = launch.torchrun(script, nproc, run_dir, flags, max_restarts=max_restarts,
                               env={**(env or {}), "FT_FAULTS": faults})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    proc.returncode = procs.exit_code(proc.returncode, env)  # a deliberate stop's code, as run.sh reports it
    if check:
        wrong = launch.problems(run_dir, proc.returncode, proc.stdout + proc.stderr, restarts)
        assert not wrong, f"{' '.join(cmd)}\n{'; '.join(wrong)}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def torchrun_meanwhile(script, nproc, run_dir, *flags, timeout=240):
    """torchrun() (no fault, no restart), started now and checked by the call it returns, with torchrun()'s
    checks, which then returns its output: a test runs its reference so while its own job waits (a lease to
    lapse, a cut to be noticed)."""
    cmd, env = launch.torchrun(script, nproc, run_dir, flags, env={"FT_FAULTS": ""})
    proc = procs.start(cmd, env, Path(run_dir).parent / f"{Path(run_dir).name}.log")

    def done():
        code, output, hung = procs.finish(proc, time.time() + timeout)
        wrong = launch.problems(run_dir, code, output, 0)
        assert not hung and not wrong, f"{' '.join(cmd)}\n{'; '.join(wrong)}\n{output[-6000:]}"
        return output
    return done


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
def no_snapshots_left_behind(tmp_path_factory):
    """A job that stops for good (exit 2 or 3, a crash with no restart left) leaves its memory snapshots
    for a restart that the tests never make: remove the folders in /dev/shm of this session's run
    folders (another session's, or another job's, are not this one's to remove)."""
    yield
    from tiers.snapshot import default_dir
    for folder, _, _ in os.walk(tmp_path_factory.getbasetemp()):
        if default_dir(folder):
            shutil.rmtree(default_dir(folder), ignore_errors=True)


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank DDP job (with DROPOUT) that crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("ddp-reference")
    torchrun("ddp/train.py", 2, run_dir, *SMALL, *DROPOUT)
    return run_dir


# A job long enough to be signalled, or to lose a node, while it trains: 100 steps (over a second) after
# step 20, its first save at step 60.
LONG = [*SMALL, *DROPOUT, "--steps", "120", "--save-every", "60"]


@pytest.fixture(scope="session")
def ddp_long_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank DDP job of LONG, for the preemption and replaced-node tests."""
    run_dir = tmp_path_factory.mktemp("ddp-long-reference")
    torchrun("ddp/train.py", 2, run_dir, *LONG)
    return run_dir


PEAK_TFLOPS = 0.5  # a bf16 peak for the CPU, so that fsdp_reference logs MFU as on a GPU


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory):
    """The run folder of the uninterrupted 2-rank FSDP job (SMALL, DROPOUT) that crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("fsdp-reference")
    torchrun("fsdp/train.py", 2, run_dir, *SMALL, *DROPOUT, env={"PEAK_TFLOPS": str(PEAK_TFLOPS)})
    return run_dir


FOUR_RANKS_ARCHIVE = "fsdp-4-ranks"  # the prefix of fsdp_four_ranks's archive in the s3 fixture's bucket


@pytest.fixture(scope="session")
def fsdp_four_ranks(tmp_path_factory, s3):
    """The uninterrupted 4-rank FSDP job (SMALL: 16 steps; checkpoints 8, 12 and 16 kept), for the
    resharding and two-node tests. SMALL's global batch of 12 splits over 4, 3 and 2 ranks. Its saves
    are async, archived (to FOUR_RANKS_ARCHIVE) and a light series every 8 steps: test_archive.py's
    FSDP test (none of these changes the weights)."""
    run_dir = tmp_path_factory.mktemp("fsdp-4-ranks")
    torchrun("fsdp/train.py", 4, run_dir, *SMALL, "--async-save", "--archive", f"s3://ckpt/{FOUR_RANKS_ARCHIVE}",
             "--light-every", 8, env=s3.env)
    return run_dir


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A local S3 server (harness/s3server.py: SeaweedFS's weed mini, keys required) for --archive; each
    test archives under a prefix of its own in its bucket."""
    from harness.s3server import S3Server
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def cluster():
    """Two real nodes on this machine (harness/nodes.py: a network namespace and a /dev/shm each), removed
    when the test ends, however it ends. They need root, as CI has: elsewhere (only there) the test is
    skipped, saying why; as root, what they need and the machine lacks is installed, or the test fails."""
    from harness.nodes import Cluster, can_make_nodes
    if can_make_nodes():
        pytest.skip(can_make_nodes())
    with Cluster(2) as made:
        yield made


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


# ----------------------------------------------------------------------------- what a job listens on
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # as /proc/net says


def descendants(root):
    """The pids below process `root` (its children, theirs, ...), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    found, more = set(), {root}
    while more:
        more = {pid for pid, parent in parents.items() if parent in more} - found
        found |= more
    return found


def listening(root):
    """{(address in /proc/net/tcp's hex, port)} that process `root` and all its descendants listen on."""
    pids = {root, *descendants(root)}
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
            except OSError:
                continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


def named_on_the_network(cmd, folder):
    """`cmd` in a mount namespace of its own (as root) whose /etc/hosts maps this host's name to its
    network address, as many cloud hosts do (this machine and CI map it to 127.0.0.1): what binds to
    the address the name resolves to is then seen listening beyond the loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 9))  # no packet is sent: the route picks the address
        address = s.getsockname()[0]
    assert not address.startswith("127."), "this machine has no network address to map its name to"
    hosts = Path(folder) / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
    return ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *map(str, cmd)]
