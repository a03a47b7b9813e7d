"""Chaos soak: seeded faults fired at chosen training steps, each job checked against its reference.

    bash run.sh chaos                               # every fault kind once (a few minutes on 2 cores)
    bash run.sh chaos --trials 40 --seed 7          # a long one; the seed reproduces every trial
    bash run.sh chaos --strategies fsdp --trials 10
    bash run.sh chaos --plan sigstop:ddp,async-in-flight:fsdp-async --ranks 1   # these trials, smallest jobs
    bash run.sh chaos --plan node-lost:fsdp,preempt:ddp --ranks 2   # two nodes of 2 ranks, one lost; a preemption
    bash run.sh chaos --nodes --ranks 1             # root: the --nodes kinds once each, on real nodes

Faults (FAULTS, one FaultKind each), each at a step drawn at random, never at a moment in time, so that it always lands
in training however fast the machine is: SIGKILL, SIGTERM (a preempted worker) or SIGSTOP (a hung
one: its peers' collectives time out, torchrun stops the job and restarts it) sent to a random
worker a random fraction of a step after the job completed that step; --crash-at-step on a random
rank; --crash-in-save; --crash-in-snapshot (halfway through a memory snapshot); two faults in one job (a crash, then a SIGKILL at a step drawn from those
left after the resume); the newest checkpoint damaged between two launches (damage-newest), or
unreadable only until the relaunch has chosen where to resume (transient-read); a crash while an
async save is in flight; a node lost whole (node-lost: an elastic job, --nnodes 1:2, of two torchrun
agents with --ranks workers each; one agent and its workers SIGKILLed, the other goes on alone); a
preemption (preempt: SIGTERM to the torchrun agent, which passes it on; the workers save the step in
progress and exit, and the job is launched again); the run folder lost (disk-lost: --archive to a
local S3 server, harness/s3server.py; a first launch killed whole once a checkpoint is archived, its
folder deleted: the job resumes from the archive). The first trials take every kind once, then
kinds are drawn at random. The --survivors strategies (ddp-survivors with a spare, fsdp-survivors with a
cold replacement) take the faults that kill or freeze a process: sigkill, sigstop, crash-at-step,
crash-in-save, crash-in-snapshot; and their own: two-at-once (two ranks SIGKILLed together, of 3),
spare-killed (the spare SIGKILLed, then a rank), replacement-killed (a rank SIGKILLed, then the
process that takes its place, as it joins), node-lost (two nodes of --ranks each, node 1 lost whole:
node 0's spare takes its ranks; those left to no spare wait for a new node 1, started with an empty
memory; the job keeps its size). Their trials also fail if a survivor's process started again.
With --nodes, the kinds on real nodes (harness/nodes.py; see "real nodes" below): a node killed whole,
cut off shorter and longer than --hang-timeout-s, node 0 (rank 0 and the job's store) cut off, a lossy
link, two nodes lost one after the other; for torchrun (c10d) and --survivors.

A trial passes when its fault fired, the job ended within its time bound after exactly the restarts
its fault causes, loaded no damaged checkpoint, kept the bytes of a checkpoint that was unreadable
for a while, and ended with the reference digest. After a node's loss the reference is the
uninterrupted job's checkpoint of the step the survivor resumed from, resumed at the survivor's size;
a preempted job must resume from the step it saved. rpc-async (the parameter server in async mode,
whose weights depend on arrival order) is checked by its guarantees instead of a digest
(async_problems); a trainer stopped there is not waited for: the job ends without it, its server
kills it, and the job exits 0 (torchrun's restart that follows trains nothing). Exit code 1 if any
trial failed.

Recovery time, per trial and as medians per kind (harness.metrics.phases): from the fault to the
first step trained after it, split into the wait until the new workers are launched (detection,
stopping, rendezvous; for a preemption also the save and the relaunch), their start (imports,
process group, model), the checkpoint load, the first step, and the steps trained again. The same
split of each reference's cold start (launch to first step) gives the ratio of the two.
"""
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.checkpoint import checkpoints, step_name  # noqa: E402
from common.config import Parser  # noqa: E402
from harness.launch import (STRATEGIES, children, finish, free_port, kill_node, problems, start,  # noqa: E402
                            survivors_job, torchrun, workers)
from harness.metrics import Watch, events, final_history, phases  # noqa: E402
from harness.nodes import Cluster, can_make_nodes, pids_in  # noqa: E402
from harness.s3server import BUCKET, S3Server  # noqa: E402

STEPS, SAVE_EVERY, BATCH = 48, 8, 24
# A fault at a drawn step needs training left after it, or the job may end before the watcher acts:
# faults are drawn at least MARGIN steps before the end (a tiny job's step takes a few ms here).
MARGIN = 16
# Dropout on: only the per-rank RNG saved in each checkpoint then makes a resumed job bitwise equal.
JOB_FLAGS = ["--steps", STEPS, "--save-every", SAVE_EVERY, "--dim", 64, "--layers", 2, "--heads", 4, "--seq-len", 32,
             "--batch-size", BATCH, "--log-every", 1000, "--dropout", 0.1]
# References keep every checkpoint: a job that lost a node is compared with one of them resumed.
KEEP_ALL = ["--keep", STEPS // SAVE_EVERY]
# torchrun sets OMP_NUM_THREADS=1 only for more than one process per node. A job of one process per
# node sums in other orders with more threads: where jobs of other shapes are compared, one thread.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# A hang is noticed when a peer's collective times out. ddp and fsdp shorten their collective timeout
# once training runs (--hang-timeout-s, or 20 steps' time); the parameter server has its RPC timeout.
# The rank whose collective timed out SIGKILLs its node's other workers (common.dist.fence_local_workers):
# torchrun would wait 30 s between its SIGTERM and its SIGKILL, the only signal a stopped process
# obeys. rpc's straggler timeout must stay below its RPC timeout. rpc-async waits for no trainer: it
# ends without a stopped one, after waiting the straggler timeout for its goodbye, and then kills it.
HANG_FLAGS = {"rpc": ["--timeout-s", 10, "--straggler-timeout", 8], "rpc-async": ["--straggler-timeout", 5]}
HANG_FLAGS_DEFAULT = ["--hang-timeout-s", 5]
# --survivors jobs (one node, the launcher's supervisor): a process lost costs only that process. They
# take the faults that kill or freeze a process; a SIGTERM to one of them stops the whole job (a preemption).
SURVIVORS = tuple(s for s in STRATEGIES if s.endswith("-survivors"))
# The parameter server neither reshards nor saves on SIGTERM: node-lost and preempt are for these.
DATA_PARALLEL = tuple(s for s in STRATEGIES if not s.startswith("rpc") and s not in SURVIVORS)
# ddp and fsdp snapshot every step into memory (tiers/snapshot.py): a process that dies costs them at
# most one step. The parameter server has no memory tier.
NO_MEMORY_TIER = {s: ["--snapshot-every", 0] for s in DATA_PARALLEL + SURVIVORS}
MARK = ".chaos-out"  # in --out: the folder is this runner's to empty, not the user's
POLL_S = 0.005  # how often a save's folder is looked at while waiting for its shards


@dataclass
class Reference:
    digest: str
    step_s: float  # median step time of rank 0
    total_s: float  # launch to exit
    run_dir: str
    cold: dict  # the launch to the first step, in the phases of harness.metrics.phases


@dataclass
class Trial:
    trial: int
    strategy: str
    kind: str
    processes: int
    expected_restarts: int
    command: str = ""
    fired: bool = False  # the fault happened: signal delivered during training, crash injected, file damaged
    fault_step: Optional[int] = None  # the step the (last) fault followed; async-in-flight: the save it hit
    restarts: Optional[int] = None  # torchrun restarts, from summary.json (--survivors: the group's generations)
    exit: Optional[int] = None
    hung: bool = False
    recovered: bool = False  # exit 0 with a summary
    digest_equal: bool = False
    async_ok: Optional[bool] = None  # rpc-async, instead of the digest: async_problems found nothing
    bad_loads: int = 0  # resumes from the damaged, hidden or torn checkpoint
    kept: Optional[bool] = None  # transient-read: the checkpoint's bytes are still on disk, under some name
    in_flight: Optional[bool] = None  # async-in-flight: the save had neither its save event nor its commit at the kill
    resumed_step: Optional[int] = None  # the step the job resumed from after the (last) fault
    # Recovery, from the (last) fault to the first step trained after it (harness.metrics.phases):
    recovery_s: Optional[float] = None
    detect_s: Optional[float] = None  # until the new workers' launch: detection, stopping, rendezvous
    restart_s: Optional[float] = None  # the workers' launch to their first metrics line
    load_s: Optional[float] = None  # the checkpoint load
    first_step_s: Optional[float] = None  # the 'start' event to the end of the first step
    replayed_steps: Optional[int] = None  # steps trained again
    replay_s: Optional[float] = None  # the 'start' event until the last step before the fault is trained again
    vs_cold_start: Optional[float] = None  # recovery_s over the reference's launch-to-first-step
    problems: list = field(default_factory=list)
    output_tail: str = ""
    passed: bool = False


# ----------------------------------------------------------------------------- a trial's job
@dataclass
class Hit:
    """A fault fired into a running job from outside."""
    time: float
    step: int  # the step completed then; async-in-flight: the step whose save it hit


class FaultMissed(Exception):
    """The fault could not be set up as planned: the trial fails with this problem and this output."""

    def __init__(self, problem, output):
        super().__init__(problem)
        self.problem, self.output = problem, output


@dataclass
class Job:
    """What the stages of one trial share: the job its fault kind prepares and fires into, and what it left."""
    trial: Trial
    script: str
    run_dir: Path
    rng: random.Random  # the trial's own: the same seed, the same draws in the same order, the same trial
    ref: Reference
    flags: list
    deadline: float
    crash_rank: int  # --crash-rank, where the kind crashes a rank
    crash_step: Optional[int] = None  # the step an injected crash follows (--crash-in-save: the save it dies in)
    damaged: Optional[int] = None  # the step of a checkpoint that must never be loaded: damaged, hidden or torn
    cmd: list = field(default_factory=list)  # torchrun's command line (node 0's) and environment
    env: dict = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None  # its torchrun agent (preempt: the relaunch's, once launched again)
    watch: Optional[Watch] = None
    hit: Optional[Hit] = None  # the (last) fault fired from outside, if one was
    lost: Optional[subprocess.Popen] = None  # node-lost: node 1's agent (--survivors: supervisor)
    relaunch: Optional[Callable] = None  # node-lost, --survivors without a spare: starts a new node 1
    # --nodes kinds (real nodes, harness/nodes.py): the Cluster, node k's launcher (k > 0; node 0's is proc),
    # boot(k) that starts node k (again), the nodes lost or left, the cut-off side's processes and when it was cut
    cluster: object = None
    nodes: dict = field(default_factory=dict)
    boot: Optional[Callable] = None
    gone: list = field(default_factory=list)
    left: list = field(default_factory=list)  # (node, exit code, output) of a node that left the job, cut off
    cut_pids: list = field(default_factory=list)
    cut_at: Optional[float] = None
    preempted: Optional[dict] = None  # preempt: the first launch's 'preempted' event
    hidden: Optional[Path] = None  # transient-read: the hidden checkpoint, its files' bytes, where they went back
    original: Optional[dict] = None
    place: Optional[Path] = None
    committed_at: Optional[float] = None  # async-in-flight: when the save it hit committed, if it did
    output: str = ""  # once it ended: its output, the events watched (no first launch's), its summary ({}: none)
    events: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- firing into a running job
def at_step(job, step, attempt, fault):
    """Once rank 0 has completed `step` in torchrun attempt `attempt`, wait a random fraction of a
    step, then call `fault()` (True if it fired). Returns its Hit, or None if the job was no longer
    training."""
    if job.watch.first("step", job.proc, job.deadline, attempt=attempt, min_step=step) is None:
        return None
    try:
        job.proc.wait(timeout=job.rng.uniform(0, job.ref.step_s))  # the fault's random moment within the next step
        return None
    except subprocess.TimeoutExpired:
        pass
    reached = job.watch.latest_step(attempt)
    if reached >= STEPS or not fault():  # training is over: the fault would not land in it
        return None
    return Hit(time.time(), reached)


def signal_at_step(job, sig, ranks, step, attempt):
    """at_step: send `sig` to the worker of a random rank from `ranks`. The worker is looked up once its
    attempt has started, before the step: reading /proc takes longer than a step of a small job."""
    rank = job.rng.choice(ranks)
    started = job.watch.first("start", job.proc, job.deadline, rank=rank, attempt=attempt)
    if started is None:
        return None
    # A --survivors job's processes are the launcher's, their ranks taken in the store: the start event names them.
    pid = started["pid"] if job.trial.strategy in SURVIVORS else workers(job.proc.pid, attempt).get(rank)

    def send():
        try:
            return pid is not None and os.kill(pid, sig) is None
        except ProcessLookupError:
            return False
    return at_step(job, step, attempt, send)


def kill_in_flight(job, saving):
    """SIGKILL a random worker while the async save of step `saving` is being written in the background:
    a shard of it on disk, its commit marker (.metadata) not yet. A save that commits before it is
    caught passes the fault on to the next save step. Returns its Hit, or None."""
    for step in range(saving, STEPS, SAVE_EVERY):
        folder = job.run_dir / "ckpt" / step_name(step)
        while job.proc.poll() is None and time.time() < job.deadline and not (folder / ".metadata").exists():
            if any(folder.glob("*.distcp")):  # written by the background thread, after the loop went on
                try:
                    os.kill(workers(job.proc.pid, 0)[job.rng.choice(range(job.trial.processes))], signal.SIGKILL)
                except (KeyError, ProcessLookupError):
                    return None
                return Hit(time.time(), step)
            time.sleep(POLL_S)  # polling the folder the save writes, not waiting for a moment
    return None


# ----------------------------------------------------------------------------- damaging checkpoints
def damage_newest(job):
    """Truncate the newest committed checkpoint, or delete one of its shard files: it must never be loaded."""
    job.damaged, path = checkpoints(job.run_dir / "ckpt")[0]
    target = path if path.is_file() else job.rng.choice(sorted(path.glob("*.distcp")))
    if path.is_dir() and job.rng.random() < 0.5:
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])


def hide_newest(job):
    """Make the newest committed checkpoint unreadable for a while (put_back undoes it): a .pt file is
    swapped for its first half, a DCP folder loses one shard. Its files' bytes are kept, by name."""
    job.damaged, path = checkpoints(job.run_dir / "ckpt")[0]
    if path.is_file():
        original = {"": path.read_bytes()}
        path.write_bytes(original[""][: len(original[""]) // 2])
    else:
        original = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
        (path / job.rng.choice(sorted(n for n in original if n.endswith(".distcp")))).unlink()
    job.hidden, job.original = path, original


def where_now(path):
    """A checkpoint's path now: its own, or the name the job moved it aside to, or None if it is gone."""
    if path.exists():
        return path
    aside = sorted(path.parent.glob(f"{path.name}*.unreadable-*"))
    return aside[-1] if aside else None


def put_back(path, original):
    """The hidden bytes become readable again, wherever the checkpoint is now. Returns that place."""
    now = where_now(path)
    if now is not None and now.is_file():
        now.write_bytes(original[""])
    elif now is not None:
        for name, data in original.items():
            if not (now / name).exists():
                (now / name).write_bytes(data)
    return now


def intact(place, original):
    if place is None or not place.exists():
        return False
    if place.is_file():
        return place.read_bytes() == original[""]
    return all((place / n).is_file() and (place / n).read_bytes() == data for n, data in original.items())


# ----------------------------------------------------------------------------- the fault kinds' stages
# Each takes the trial's Job. The draws from job.rng happen in the order the stages run: a seed
# reproduces the faults of every trial only while that order stays.

# prepare: before the launch
def shorten_hang_timeouts(job):
    """sigstop: timeouts that notice a hung worker in seconds, and the time they and torchrun's SIGKILL take."""
    job.flags += HANG_FLAGS.get(job.trial.strategy, HANG_FLAGS_DEFAULT)
    job.deadline += 60


def crash_at_step(latest):
    """--crash-at-step on a random rank, after a random step up to `latest`."""
    def prepare(job):
        job.crash_step = job.rng.randint(1, latest)
        job.flags += ["--crash-at-step", job.crash_step, "--crash-rank", job.crash_rank]
    return prepare


def crash_in_snapshot(job):
    """A crash halfway through a random step's memory snapshot, before its record: never restored."""
    job.crash_step = job.rng.randint(1, STEPS - 1)
    job.flags += ["--crash-in-snapshot", job.crash_step, "--crash-rank", job.crash_rank]


def crash_in_save(job):
    """A crash while a random save is written, before its commit: that checkpoint must never be loaded."""
    job.damaged = job.crash_step = job.rng.randrange(SAVE_EVERY, STEPS, SAVE_EVERY)
    job.flags += ["--crash-in-save", job.damaged]


def first_launch_crashes(then):
    """A first launch that dies with no restart left, after `then(job)` has done what it does to its
    newest checkpoint: the job proper is its relaunch. The memory tier is off: its snapshots, newer
    than the disk's newest checkpoint, would be loaded instead, and the disk's fallback go untested."""
    def prepare(job):
        job.flags += NO_MEMORY_TIER.get(job.trial.strategy, [])
        job.crash_step = job.rng.randint(2 * SAVE_EVERY, STEPS - 1)
        flags = [*job.flags, "--crash-at-step", job.crash_step]
        first = start(*torchrun(job.script, job.trial.processes, job.run_dir, flags, max_restarts=0),
                      log=f"{job.run_dir}-first.log")
        code, output, _ = finish(first, job.deadline)
        if code == 0 or "injected crash" not in output or not checkpoints(job.run_dir / "ckpt"):
            raise FaultMissed(f"the first launch did not crash as injected (exit {code})", output)
        then(job)
    return prepare


def lose_the_disk(job):
    """disk-lost (--archive, to the soak's S3 server): a first launch, killed whole (its uploader with it)
    once a checkpoint is archived and a step more trained; then its run folder is deleted. The job proper
    must resume from the archive. The memory tier is off: its snapshots would be loaded instead."""
    job.flags += [*NO_MEMORY_TIER.get(job.trial.strategy, []), "--archive", f"s3://{BUCKET}/{job.run_dir.name}"]
    first = start(*torchrun(job.script, job.trial.processes, job.run_dir, job.flags, max_restarts=0),
                  log=f"{job.run_dir}-first.log")
    watch = Watch(job.run_dir)
    archived = watch.first("archive", first, job.deadline)  # logged at the save after the upload
    if archived is not None and watch.first("step", first, job.deadline, min_step=watch.latest_step(0) + 1):
        os.killpg(first.pid, signal.SIGKILL)
    code, output, _ = finish(first, job.deadline)
    if archived is None or code == 0:
        raise FaultMissed("the first launch ended before it was killed with a checkpoint archived", output)
    job.crash_step = archived["step"]
    shutil.rmtree(job.run_dir)


def fetched_archived(job):
    """disk-lost: the job resumed from the archive, from a step no older than the one archived before the kill."""
    fetched = [e["step"] for e in job.events if e["event"] == "fetch"]
    return [] if fetched and fetched[0] >= job.crash_step else [f"fetched {fetched}, archived {job.crash_step}"]


# launch: (command, environment) of torchrun
def one_node(job):
    if job.trial.strategy in SURVIVORS:  # the launcher's supervisor, with the spares the flags ask for
        spares = int(job.flags[job.flags.index("--spares") + 1]) if "--spares" in job.flags else 0
        return survivors_job(job.script, job.trial.processes, job.run_dir, plain(job.flags), spares=spares)
    return torchrun(job.script, job.trial.processes, job.run_dir, job.flags)


def plain(flags):
    """A --survivors job's flags without its layout (--survivors, --spares N): its reference runs under torchrun."""
    flags = list(flags)
    if "--spares" in flags:
        del flags[flags.index("--spares"):flags.index("--spares") + 2]
    return [f for f in flags if f != "--survivors"]


def two_nodes(job):
    """node-lost: an elastic job of two agents of half the workers each. Node 1's agent starts here;
    node 0's, whose command is returned, holds the rendezvous store and survives. --survivors: two
    supervisors (two_survivor_nodes)."""
    if job.trial.strategy in SURVIVORS:
        return two_survivor_nodes(job)
    endpoint, rdzv_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]
    cmd, env = torchrun(job.script, job.trial.processes // 2, job.run_dir, job.flags, nnodes="1:2", endpoint=endpoint,
                        rdzv_id=rdzv_id, is_host=True, env=ONE_THREAD)
    job.lost = start(*torchrun(job.script, job.trial.processes // 2, job.run_dir, job.flags, nnodes="1:2",
                               endpoint=endpoint, rdzv_id=rdzv_id, is_host=False, env=ONE_THREAD),
                     log=f"{job.run_dir}-node1.log")
    return cmd, env


def two_survivor_nodes(job):
    """node-lost, --survivors: two nodes of half the ranks each, with the strategy's spares, each with a
    memory of its own; node 0's supervisor holds the job's store. Node 1 starts here; so, once it is
    lost, does a new node 1 when there is no spare to take its ranks (job.relaunch)."""
    endpoint, nproc, flags = f"localhost:{free_port()}", job.trial.processes // 2, plain(job.flags)
    spares = int(job.flags[job.flags.index("--spares") + 1]) if "--spares" in job.flags else 0
    flags += HANG_FLAGS_DEFAULT  # a node is found lost once silent for --hang-timeout-s

    def node(n, memory):
        return survivors_job(job.script, nproc, job.run_dir, [*flags, "--snapshot-dir", f"{job.run_dir}-{memory}"],
                             spares=spares, nnodes=2, node=n, endpoint=endpoint)
    job.lost = start(*node(1, "memory-1"), log=f"{job.run_dir}-node1.log")
    if spares < nproc:  # node 0's spares cannot take all of node 1's ranks
        job.relaunch = lambda: start(*node(1, "memory-1-new"), log=f"{job.run_dir}-node1-new.log")
    return node(0, "memory-0")


# fire: into the running job, from outside
def signal_worker(sig):
    """`sig` to a random worker, a random fraction of a step after a random step."""
    def fire(job):
        job.hit = signal_at_step(job, sig, range(job.trial.processes), job.rng.randint(1, STEPS - MARGIN), 0)
    return fire


def stop_worker(job):
    """SIGSTOP a random worker (a hung one). Sync rpc drops a stopped trainer by design (the digest then
    differs): its server is stopped. rpc-async ends without a stopped trainer, which its server kills
    at the end (rpc/ps.py). After step 6: ddp's and fsdp's collectives take --hang-timeout-s from their
    6th step on; a rank frozen before waits --timeout-s (300 s), longer than a trial."""
    strategy, nproc = job.trial.strategy, job.trial.processes
    victims = [0] if strategy == "rpc" else range(1, nproc) if strategy == "rpc-async" else range(nproc)
    job.hit = signal_at_step(job, signal.SIGSTOP, victims, job.rng.randint(6, STEPS - MARGIN), 0)


def kill_after_resume(job):
    """two-faults, the second: a SIGKILL at a step drawn from those the restart has left."""
    restart = job.watch.first("start", job.proc, job.deadline, attempt=1)
    if restart is not None:
        resumed = restart["resumed_from_step"] or 0
        job.hit = signal_at_step(job, signal.SIGKILL, range(job.trial.processes),
                                 job.rng.randint(resumed + 1, STEPS - MARGIN), 1)


def put_back_once_started(job):
    """transient-read: readable again once the relaunch has chosen where to resume."""
    if job.watch.first("start", job.proc, job.deadline, attempt=0) is not None:
        job.place = put_back(job.hidden, job.original)


def kill_a_save(job):
    """async-in-flight: kill_in_flight from a random save step on; then, once the restart has looked for
    a checkpoint, whether the save it hit had committed by then."""
    job.hit = kill_in_flight(job, job.rng.randrange(SAVE_EVERY, STEPS, SAVE_EVERY))
    if job.hit and job.watch.first("start", job.proc, job.deadline, attempt=1) is not None:
        marker = job.run_dir / "ckpt" / step_name(job.hit.step) / ".metadata"
        job.committed_at = marker.stat().st_mtime if marker.exists() else None


def lose_node(job):
    """node-lost: node 1 killed whole (fired if it had workers), after a step with a checkpoint before it;
    then, where a new node must take its place (job.relaunch), that node started."""
    job.hit = at_step(job, job.rng.randint(SAVE_EVERY + 1, STEPS - MARGIN), 0, lambda: bool(kill_node(job.lost)))
    if job.hit is None:
        kill_node(job.lost)  # the job ended first: no stray agent
    elif job.relaunch:
        job.lost = job.relaunch()


def node_lost_and_back(job):
    """node-lost: fired; a new node 1, if one was started, ended 0 (its output is added to the job's)."""
    if job.hit is None or not job.relaunch:
        return job.hit is not None
    code, output, _ = finish(job.lost, job.deadline)
    job.output += output
    return code == 0


def no_spare(job):
    """The processes of a --survivors job that hold no rank: spares, the supervisor's children that no
    rank's start event names (a forked one's /proc environ is the warm parent's: its FIRST_RANK is not
    there), but its warm parent (named ft-warm-parent)."""
    from harness.warm import NAME
    ranks = {e["pid"] for e in job.watch.poll() if e["event"] == "start"}
    spares = []
    for pid in set(children(job.proc.pid)) - ranks:
        with contextlib.suppress(OSError):  # ended meanwhile
            if Path(f"/proc/{pid}/comm").read_bytes().strip() != NAME:
                spares.append(pid)
    return spares


def kill_two(job):
    """two-at-once: SIGKILL two random ranks in the same moment, a random fraction of a step after a random step."""
    ranks = job.rng.sample(range(job.trial.processes), 2)
    started = [job.watch.first("start", job.proc, job.deadline, rank=r, attempt=0) for r in ranks]
    if None in started:
        return

    def kill_both():
        try:
            return all(os.kill(e["pid"], signal.SIGKILL) is None for e in started)
        except ProcessLookupError:
            return False
    job.hit = at_step(job, job.rng.randint(1, STEPS - MARGIN), 0, kill_both)


def kill_spare_then_rank(job):
    """spare-killed: SIGKILL the spare after a random step (its supervisor starts another, cold), then a
    random rank after a later one: a spare's death costs the ranks nothing, and the rank is replaced."""
    def kill_spare():
        spares = no_spare(job)
        return bool(spares) and os.kill(spares[0], signal.SIGKILL) is None
    first = at_step(job, job.rng.randint(1, STEPS // 2 - MARGIN), 0, kill_spare)
    if first is not None:
        job.hit = signal_at_step(job, signal.SIGKILL, range(job.trial.processes),
                                 job.rng.randint(first.step + 1, STEPS - MARGIN), 0)


def kill_the_replacement(job):
    """replacement-killed: SIGKILL a random rank after a random step, then the process that takes its
    place as soon as it says so ("slot S (pid P, how): takes rank R", before it joins the group)."""
    first = signal_at_step(job, signal.SIGKILL, range(job.trial.processes), job.rng.randint(6, STEPS - MARGIN), 0)
    if first is None:
        return
    taken = re.compile(r"slot \d+ \(pid (\d+), [a-z ]+\): takes rank \d+")
    while job.proc.poll() is None and time.time() < job.deadline:
        found = taken.search(job.proc.log.read_text(errors="replace"))
        if found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(found[1]), signal.SIGKILL)
                job.hit = Hit(time.time(), first.step)
            return
        time.sleep(POLL_S)  # polling the job's output for the line, not waiting for a moment


def preempt_agent(job):
    """SIGTERM to the agent, as a scheduler sends it; once the workers saved and exited, the job is
    launched again."""
    job.hit = at_step(job, job.rng.randint(1, STEPS - MARGIN), 0, lambda: job.proc.send_signal(signal.SIGTERM) is None)
    code, output, _ = finish(job.proc, job.deadline)
    job.preempted = next((e for e in job.watch.poll() if e["rank"] == 0 and e["event"] == "preempted"), None)
    if job.hit is None or code in (0, None) or job.preempted is None:
        raise FaultMissed(f"the first launch was not preempted (exit {code})", output)
    job.proc = start(job.cmd, job.env, log=f"{job.run_dir}-relaunch.log")


# fired: once the job ended, did the fault happen
def landed(job):
    return job.hit is not None


def crash_injected(job):
    return "injected crash" in job.output


def crash_injected_and_landed(job):
    return crash_injected(job) and landed(job)


def put_back_and_kept(job):
    """transient-read: fired once the bytes went back somewhere; `kept` if they are still all there."""
    job.trial.kept = intact(job.place, job.original)
    return job.place is not None


def killed_in_flight(job):
    """async-in-flight: the kill came after the save began, before its save event and its commit."""
    hit = job.hit
    saved = hit and any(e["rank"] == 0 and e["event"] == "save" and e["attempt"] == 0 and e["step"] == hit.step
                        and e["time"] < hit.time for e in job.events)
    job.trial.in_flight = bool(hit and not saved and (job.committed_at is None or job.committed_at > hit.time))
    return job.trial.in_flight


# checks and expected: the kind's own judgement of the finished job
def at_survivors_size(job):
    size = job.trial.processes // (1 if job.trial.strategy in SURVIVORS else 2)  # node 0's workers; --survivors: all
    if job.summary and job.summary["world_size"] != size:
        return [f"ended at world size {job.summary['world_size']}, not {size}"]
    return []


def resumed_alike(job):
    """node-lost: the reference's checkpoint of the step resumed from, resumed at the survivor's size
    (--survivors: the size stays; the reference itself)."""
    if job.trial.strategy in SURVIVORS:
        return job.ref.digest
    return resumed_reference(job.trial.strategy, job.ref, job.trial.processes // 2, job.trial.resumed_step,
                             f"{job.run_dir}-reference")


def no_step_lost(job):
    """preempt: the step in progress at the signal (or the next: see below) was saved, and resumed from."""
    preempted, wrong = job.preempted, []
    done = max((e["step"] for e in job.events if e["rank"] == 0 and e["event"] == "step"
                and e["time"] < preempted["signalled_at"]), default=0)
    # The ranks read the signal in a step's closing all-reduce, and rank 0 writes the step's event after
    # it: a signal that lands while a rank is in that all-reduce is read at the end of the next step.
    if not done <= preempted["step"] <= done + 2:
        wrong.append(f"saved step {preempted['step']} for a signal after step {done}")
    if job.trial.resumed_step != preempted["step"]:
        wrong.append(f"resumed from step {job.trial.resumed_step}, not the preempted {preempted['step']}")
    return wrong


# ----------------------------------------------------------------------------- real nodes (--nodes)
# The --nodes kinds run on real nodes (harness/nodes.py: a network namespace, address and /dev/shm a node;
# root). A node is cut off for less, then for more than --hang-timeout-s (5 s, HANG_FLAGS_DEFAULT): its
# link is down for that long at the switch. Its packets are lost at LOSS_PERCENT for LOSSY_S.
CUT_SHORT_S, CUT_LONG_S = 1, 15
LOSS_PERCENT, LOSSY_S = 20, 10


def on_nodes(job):
    """A job of the kind's nodes, --ranks processes each, launched as a cluster's nodes are: torchrun's
    agents at one c10d rendezvous on node 0's address (NNODES=1:N where the kind loses nodes for good:
    the others go on without them; else N:N, which waits for a node cut off to come back), or the
    --survivors supervisors, node 0 with the strategy's spares for every other node's ranks (none:
    a lost node is started again, with an empty memory). Nodes 1.. start here; node 0's command, in
    its namespaces, is returned."""
    kind, strategy = FAULTS[job.trial.kind], job.trial.strategy
    n = kind.nodes
    nproc = job.trial.processes // n
    job.cluster = Cluster(n)
    job.flags += HANG_FLAGS_DEFAULT  # a collective times out, a silent node is found lost, in 5 s
    job.deadline += 120
    spares = nproc * (n - 1) if "--spares" in job.flags else 0

    def command(k):
        if strategy in SURVIVORS:
            return survivors_job(job.script, nproc, job.run_dir, plain(job.flags), spares=spares if k == 0 else 0,
                                 nnodes=n, node=k, endpoint=job.cluster.endpoint)
        return torchrun(job.script, nproc, job.run_dir, job.flags, nnodes=f"{1 if kind.elastic else n}:{n}",
                        endpoint=job.cluster.endpoint, rdzv_id=job.cluster.tag, env=ONE_THREAD)

    def boot(k):
        cmd, env = command(k)
        return job.cluster.start(k, cmd, {**env, **ONE_THREAD}, f"{job.run_dir}-node{k}-{len(job.gone)}.log")
    job.boot = boot
    job.nodes = {k: boot(k) for k in range(1, n)}
    cmd, env = command(0)
    return job.cluster.wrap(0, cmd), {**env, **ONE_THREAD, **job.cluster.env(0)}


def replaced_if_needed(job, k):
    """A node lost or gone: --survivors with no spare to take its ranks start it again, empty; torchrun's
    elastic job goes on without it."""
    job.gone.append(k)
    lost = job.nodes.pop(k)
    with contextlib.suppress(subprocess.TimeoutExpired):
        lost.wait(timeout=1)  # killed whole: reaped; cut off and left: already finished
    if job.trial.strategy in SURVIVORS and "--spares" not in job.flags:
        job.nodes[k] = job.boot(k)


def kill_nodes(*order):
    """Node k killed whole (every process in its namespace SIGKILLed) after a random step with a
    checkpoint before it; each next one once the job trains again after the previous loss, two steps on."""
    def fire(job):
        step = job.rng.randint(SAVE_EVERY + 1, STEPS - MARGIN - 4 * len(order))
        for k in order:
            hit = at_step(job, step, None, lambda: bool(job.cluster.kill(k)))
            if hit is None:
                return
            job.hit = hit
            replaced_if_needed(job, k)
            if job.watch.until(lambda e: e["rank"] == 0 and e["event"] in ("start", "recovered")
                               and e["time"] > hit.time, job.proc, job.deadline) is None:
                return
            step = job.watch.latest_step() + 2
    return fire


def after_save(job, fault):
    """fault() just after rank 0 logged a random save (not the first, before the margin): a cut there
    meets the steps' collective timeout (--hang-timeout-s), not a save's (--timeout-s, which waits out a
    cut as it would a slow disk); the next save is SAVE_EVERY steps on. Returns its Hit, or None."""
    step = SAVE_EVERY * job.rng.randint(2, (STEPS - MARGIN) // SAVE_EVERY)
    if job.watch.first("save", job.proc, job.deadline, min_step=step) is None or not fault():
        return None
    return Hit(time.time(), job.watch.latest_step())


def cut_node(k, seconds):
    """Node k cut off (alive) for `seconds` after a random save (after_save), then healed. --survivors: where the cut
    outlasts the hang timeout, node 1 (cut off itself, or from node 0's store) must leave the job, exit 1;
    its processes' pids are kept (cut_pids), to check that none trained or saved after the cut."""
    def fire(job):
        def cut():
            job.cut_pids = pids_in(job.cluster.netns[1])
            job.cluster.cut(k)
            job.cut_at = time.time()
            return True
        job.hit = after_save(job, cut)
        if job.hit is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.proc.wait(timeout=seconds)  # the cut's length: the fault itself
        job.cluster.heal(k)
        if job.trial.strategy in SURVIVORS and seconds > HANG_FLAGS_DEFAULT[1]:
            code, output, _ = finish(job.nodes[1], job.deadline)
            job.left.append((1, code, output))
            replaced_if_needed(job, 1)
    return fire


def lossy_link(job):
    """LOSS_PERCENT of node 1's packets dropped, each way, from a random step for LOSSY_S seconds (in
    steps it could last minutes: at 20 % loss TCP's retransmissions back off, and a step can take 100 s)."""
    job.hit = at_step(job, job.rng.randint(SAVE_EVERY + 1, STEPS - MARGIN), None,
                      lambda: job.cluster.lossy(1, LOSS_PERCENT) is None)
    if job.hit is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.proc.wait(timeout=LOSSY_S)  # the loss's length: the fault itself
        job.cluster.lossy(1, 0)


def nodes_ended(job):
    """Once node 0 ended: every other node's launcher, which must exit 0 too (the job over), but a node
    that left, cut off: exit 1, saying so, and after the cut no step or save by its processes (at most
    one side trains and commits)."""
    wrong = []
    for k, proc in job.nodes.items():
        code, output, hung = finish(proc, job.deadline)
        job.output += output
        if code != 0 or hung:
            wrong.append(f"node {k} {'hung' if hung else f'exited {code}'}")
    for k, code, output in job.left:
        job.output += output
        if code != 1 or "this node leaves the job" not in output:
            wrong.append(f"node {k}, cut off, exited {code} without saying it leaves the job")
    late = given_up_wrote(job) if job.left else []
    if late:
        wrong.append(f"the side that left trained or saved after the cut (rank, event, step): {late}")
    if job.summary and job.summary["world_size"] != node_world(job):
        wrong.append(f"ended at world size {job.summary['world_size']}, not {node_world(job)}")
    return wrong


def given_up_wrote(job):
    """The steps and saves written by the processes of the side that left, after the cut (a second on: a
    step in flight may end): of each rank one of them held, until another process starts in it."""
    starts = [e for e in job.events if e["event"] == "start"]
    held = {e["rank"] for e in starts if e["pid"] in job.cut_pids}
    wrote = []
    for rank in held:
        taken = min((e["time"] for e in starts if e["rank"] == rank and e["pid"] not in job.cut_pids
                     and e["time"] > job.cut_at), default=float("inf"))
        wrote += [(rank, e["event"], e["step"]) for e in job.events if e["rank"] == rank
                  and e["event"] in ("step", "save") and job.cut_at + 1 < e["time"] < taken]
    return wrote


def node_world(job):
    """The world size a --nodes job ends with: its own, but an elastic torchrun job's without its lost nodes."""
    kind = FAULTS[job.trial.kind]
    lost = len(job.gone) if kind.elastic and job.trial.strategy not in SURVIVORS else 0
    return job.trial.processes // kind.nodes * (kind.nodes - lost)


def node_expected(job):
    """The reference's digest; after an elastic job lost nodes, the reference's checkpoints resumed at
    each smaller size in turn, from the steps the job resumed from (resumed_from)."""
    if node_world(job) == job.trial.processes:
        return job.ref.digest
    ref, nproc = job.ref, job.trial.processes // FAULTS[job.trial.kind].nodes
    for i, step in enumerate(resumed_from(job)):
        size = job.trial.processes - nproc * (i + 1)
        digest = resumed_reference(job.trial.strategy, ref, size, step, f"{job.run_dir}-reference-{i}")
        ref = dataclasses.replace(ref, digest=digest, run_dir=f"{job.run_dir}-reference-{i}")
    return ref.digest


def resumed_from(job):
    """The step each of an elastic job's restarts (attempts 1..) resumed from, by rank 0's start events."""
    starts = sorted((e for e in job.events if e["rank"] == 0 and e["event"] == "start" and e["attempt"] > 0),
                    key=lambda e: e["time"])
    return [e["resumed_from_step"] for e in starts]


# ----------------------------------------------------------------------------- the fault kinds
@dataclass
class FaultKind:
    """A kind of fault: the jobs it applies to, and its part in each stage of a trial (run_trial). A new
    kind is one entry of FAULTS, with its stage functions above."""
    name: str
    strategies: tuple = tuple(s for s in STRATEGIES if s not in SURVIVORS)  # those it applies to
    nodes: int = 1  # torchrun agents of --ranks workers each (a parameter server's job: one, see processes())
    min_ranks: int = 1  # workers per agent, whatever --ranks says
    restarts: int = 1  # torchrun restarts it causes (a job launched again counts from 0 again)
    restarts_on: dict = field(default_factory=dict)  # {strategy: restarts} where a strategy differs
    relaunch_timed: bool = False  # its relaunch is a recovery, timed from the fault (not after damage: no fault time)
    prepare: Callable = lambda job: None  # before the launch; FaultMissed if it could not
    launch: Callable = one_node
    fire: Callable = lambda job: None  # while the job runs; FaultMissed if it could not
    fired: Callable = landed  # once the job ended: did the fault happen
    checks: Callable = lambda job: []  # problems beyond those of every trial
    expected: Callable = lambda job: job.ref.digest  # the digest the job's summary must have
    lost_processes: bool = False  # a process dies and the node lives: the memory tier replays at most a step
    real_nodes: bool = False  # on real nodes (harness/nodes.py, root): a --nodes kind
    elastic: bool = False  # --nodes, torchrun: NNODES=1:N (the others go on without a lost node), not N:N


FAULTS = {kind.name: kind for kind in [
    FaultKind("sigkill", tuple(STRATEGIES), lost_processes=True, fire=signal_worker(signal.SIGKILL)),
    FaultKind("sigterm", lost_processes=True, fire=signal_worker(signal.SIGTERM)),  # a preempted worker
    # A hung worker, noticed only by a peer: its peers' collectives time out, torchrun restarts the job;
    # rpc-async ends without a stopped trainer, with no restart.
    FaultKind("sigstop", tuple(STRATEGIES), lost_processes=True, min_ranks=2, restarts_on={"rpc-async": 0},
              prepare=shorten_hang_timeouts, fire=stop_worker),
    FaultKind("crash-at-step", tuple(STRATEGIES), lost_processes=True, prepare=crash_at_step(STEPS - 1),
              fired=crash_injected),
    FaultKind("crash-in-save", tuple(STRATEGIES), lost_processes=True, prepare=crash_in_save, fired=crash_injected),
    FaultKind("crash-in-snapshot", DATA_PARALLEL + SURVIVORS, lost_processes=True, prepare=crash_in_snapshot,
              fired=crash_injected),
    # A crash, then a SIGKILL after the resume: the crash leaves room for the second fault.
    FaultKind("two-faults", lost_processes=True, restarts=2, prepare=crash_at_step(STEPS - 2 * MARGIN),
              fire=kill_after_resume, fired=crash_injected_and_landed),
    FaultKind("damage-newest", restarts=0, prepare=first_launch_crashes(then=damage_newest),
              fired=lambda job: True),  # damaged before the relaunch
    FaultKind("transient-read", restarts=0, prepare=first_launch_crashes(then=hide_newest),
              fire=put_back_once_started, fired=put_back_and_kept),
    # DDP's async write of a small job takes milliseconds: a SIGKILL from outside cannot be aimed into
    # it (tests/test_ddp.py kills it from inside, with --crash-in-save).
    FaultKind("async-in-flight", lost_processes=True, strategies=("fsdp-async",), fire=kill_a_save,
              fired=killed_in_flight),
    FaultKind("node-lost", strategies=DATA_PARALLEL + SURVIVORS, nodes=2, launch=two_nodes, fire=lose_node,
              fired=node_lost_and_back, checks=at_survivors_size, expected=resumed_alike),
    FaultKind("spare-killed", ("ddp-survivors",), lost_processes=True, fire=kill_spare_then_rank),
    FaultKind("two-at-once", SURVIVORS, lost_processes=True, min_ranks=3, restarts=2, fire=kill_two),
    FaultKind("replacement-killed", SURVIVORS, lost_processes=True, restarts=2, fire=kill_the_replacement),
    FaultKind("preempt", strategies=DATA_PARALLEL, restarts=0, relaunch_timed=True, fire=preempt_agent,
              checks=no_step_lost),
    FaultKind("disk-lost", restarts=0, prepare=lose_the_disk, fired=lambda job: True, checks=fetched_archived),
] + [FaultKind(name, DATA_PARALLEL + SURVIVORS, nodes=nodes, restarts=restarts, real_nodes=True, elastic=elastic,
               launch=on_nodes, fire=fire, checks=nodes_ended, expected=node_expected)
     for name, nodes, restarts, elastic, fire in [
         # (restarts: torchrun's, or the survivors' generations; None: any, a false alarm costs one)
         ("node-killed", 2, 1, True, kill_nodes(1)),
         ("node-cut-short", 2, 0, False, cut_node(1, CUT_SHORT_S)),  # TCP retransmits: nobody notices
         ("node-cut-long", 2, 1, False, cut_node(1, CUT_LONG_S)),
         ("node0-cut", 2, 1, False, cut_node(0, CUT_LONG_S)),  # rank 0 and the job's store cut off
         ("lossy-link", 2, None, False, lossy_link),
         ("two-nodes-lost", 3, 2, True, kill_nodes(2, 1)),  # one after the other
     ]]}
KINDS = [name for name, kind in FAULTS.items() if not kind.real_nodes]
NODE_KINDS = [name for name, kind in FAULTS.items() if kind.real_nodes]


def processes(strategy, kind, ranks):
    if strategy.startswith("rpc"):
        return max(3, ranks + 1)  # a server and at least two trainers
    return kind.nodes * max(kind.min_ranks, ranks)


# ----------------------------------------------------------------------------- one trial
def run_trial(t, strategy, kind, rng, out, ref, ranks):
    """Trial `t`: the kind prepares its job, the job is launched, the kind fires its fault into it, the
    job is waited for and judged."""
    script, strategy_flags = STRATEGIES[strategy]
    nproc = processes(strategy, kind, ranks)
    trial = Trial(t, strategy, kind.name, nproc, kind.restarts_on.get(strategy, kind.restarts))
    job = Job(trial, script, out / f"trial-{t:03d}-{strategy}-{kind.name}", rng, ref, [*JOB_FLAGS, *strategy_flags],
              deadline=time.time() + 4 * ref.total_s + 60, crash_rank=rng.randrange(nproc))  # drawn first, any kind
    try:
        kind.prepare(job)
        job.cmd, job.env = kind.launch(job)
        trial.command = " ".join(job.cmd)
        job.watch = Watch(job.run_dir, new_lines_only=True)  # not a first launch's (first_launch_crashes)
        job.proc = start(job.cmd, job.env, log=f"{job.run_dir}.log")
        kind.fire(job)
        code, job.output, trial.hung = finish(job.proc, job.deadline)
        job.events = job.watch.poll()
        return judge(job, kind, code)
    except FaultMissed as missed:
        trial.problems.append(missed.problem)
        trial.output_tail = missed.output[-3000:]
        return trial
    finally:
        if job.cluster:  # every node's processes, namespaces and files
            job.cluster.close()


def judge(job, kind, code):
    """The finished job against its reference: what every trial is checked for, the recovery in its
    phases, and the kind's own checks."""
    trial, ev, summary_path = job.trial, job.events, job.run_dir / "summary.json"
    job.summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else {}
    trial.exit, trial.recovered = code, bool(job.summary)
    # --survivors: no torchrun restart, a new generation of the group per lost process
    trial.restarts = job.summary.get("generation" if trial.strategy in SURVIVORS else "restarts")
    if trial.hung:
        trial.problems.append("hung")
    elif trial.strategy in SURVIVORS:
        trial.problems += survivors_problems(job, code)
    else:  # expected None: any count (a false alarm's restart)
        trial.problems += problems(job.run_dir, code, job.output, trial.restarts if trial.expected_restarts is None
                                   else trial.expected_restarts)
    # A checkpoint that must not be loaded is on disk; the memory tier may hold a whole snapshot of its step.
    from_disk = [e["step"] for e in ev if e["rank"] == 0 and e["event"] == "load" and e.get("source") != "memory"]
    trial.bad_loads = sum(job.damaged is not None and step == job.damaged for step in from_disk)
    trial.fired = kind.fired(job)
    trial.fault_step = job.hit.step if job.hit else job.crash_step

    trained_at = [e["time"] for e in ev if e["attempt"] == 0 and e["event"] in ("step", "save")]
    lost_at = [e["lost_at"] for e in ev if e["event"] == "recovered"]  # --survivors: no new attempt, a new generation
    if lost_at:
        trained_at = [t for t in trained_at if t < min(lost_at)]
    # The time of the fault; an injected crash's: attempt 0's last step or save.
    fault_at = job.hit.time if job.hit else max(trained_at, default=None)
    if fault_at and (trial.expected_restarts or kind.relaunch_timed):  # a relaunch after damage: no fault time
        after = [e for e in ev if e["rank"] == 0 and e["event"] in ("start", "recovered") and e["time"] > fault_at]
        trial.resumed_step = after[0].get("resumed_from_step", after[0].get("step")) if after else None
        split = phases(ev, fault_at)
        trial.recovery_s = split.get("total_s")
        for key in ("detect_s", "restart_s", "load_s", "first_step_s", "replayed_steps", "replay_s"):
            setattr(trial, key, split.get(key))
        cold_s = job.ref.cold.get("total_s")
        if trial.recovery_s and cold_s:
            trial.vs_cold_start = trial.recovery_s / cold_s

    trial.problems += kind.checks(job)
    if kind.lost_processes and trial.strategy in NO_MEMORY_TIER and (trial.replayed_steps or 0) > 1:
        trial.problems.append(f"replayed {trial.replayed_steps} steps: the memory tier loses at most one")
    trial.digest_equal = bool(job.summary) and job.summary.get("param_digest") == kind.expected(job)
    if trial.strategy == "rpc-async" and job.summary:  # arrival order decides its weights: its guarantees instead
        wrong = async_problems(events(job.run_dir), job.summary)
        trial.problems += wrong
        trial.async_ok = not wrong
    trial.passed = (trial.fired and trial.recovered and (trial.digest_equal or trial.async_ok) and not trial.bad_loads
                    and trial.kept is not False and not trial.problems)
    if not trial.passed:
        trial.output_tail = job.output[-3000:]
    return trial


def survivors_problems(job, code):
    """What is wrong with a finished --survivors job ([] if nothing): it must exit 0 with no Traceback,
    after one new generation per lost process (a lost node: one), and every rank but the lost ones
    must have kept its process (one start event, the pid of its recovered events)."""
    if code != 0 or not job.summary:
        return [f"exit code {code}" + ("" if job.summary else ", no summary")]
    wrong = ["a Traceback in the output"] if "Traceback" in job.output else []
    lost = job.trial.expected_restarts
    if lost is not None and job.summary.get("generation") != lost:
        wrong.append(f"generation {job.summary.get('generation')}, expected {lost}")
    may_restart = job.trial.processes // 2 if job.lost else lost or 0
    if job.cluster:  # --nodes: the ranks of the nodes lost or gone; on a lossy link, any fenced rank
        may_restart = job.trial.processes // FAULTS[job.trial.kind].nodes * len(job.gone)
        may_restart = job.trial.processes if lost is None else may_restart
    starts, held = {}, {}  # each rank's processes; the one that held it at each recovery
    for e in sorted(job.events, key=lambda e: e["time"]):
        if e["event"] == "start":
            starts.setdefault(e["rank"], []).append(e["pid"])
        elif e["event"] == "recovered" and e["pid"] != starts.get(e["rank"], [None])[-1]:
            held[e["rank"]] = e["pid"]
    restarted = [r for r, pids in starts.items() if len(pids) > 1]
    if len(restarted) > may_restart or held:
        wrong.append(f"ranks {restarted} started again: a survivor restarted (starts {starts})")
    return wrong


def async_problems(all_events, summary):
    """What breaks rpc/ps.py's async guarantees, from every launch's metrics ([] if nothing): each resume
    loaded the state its checkpoint's save had (weights and optimizer, by the digest the save recorded
    in the checkpoint and, unless killed between its commit and its event, in its save event); the
    final history has every update once; no (trainer, trainer step) was applied twice; none staler than
    the bound."""
    wrong = []
    saves = [e for e in all_events if e["rank"] == 0 and e["event"] == "save"]
    for load in (e for e in all_events if e["rank"] == 0 and e["event"] == "load"):
        saved = [e["digest"] for e in saves if e["step"] == load["step"] and e["time"] < load["time"]]
        if load["digest"] != load["saved_digest"] or saved[-1:] not in ([], [load["digest"]]):
            wrong.append(f"the resume from step {load['step']} loaded another state than its save had")
    history = final_history(all_events)
    applied = [(trainer, step) for update in history.values() for trainer, step, _ in update]
    stalest = max((step - 1 - version for step, update in history.items() for _, _, version in update), default=0)
    if sorted(history) != list(range(1, summary["steps"] + 1)):
        wrong.append(f"the final history has updates {sorted(history)}, not 1..{summary['steps']}")
    if len(applied) != len(set(applied)):
        wrong.append(f"{len(applied) - len(set(applied))} gradients applied twice")
    if stalest > summary["max_staleness"]:
        wrong.append(f"a gradient {stalest} updates stale applied, above --max-staleness {summary['max_staleness']}")
    return wrong


def reference(strategy, nproc, out):
    """The uninterrupted job that the trials of `strategy` with `nproc` processes are compared with."""
    script, extra = STRATEGIES[strategy]
    run_dir = out / f"reference-{strategy}-{nproc}"
    launched = time.time()
    proc = start(*torchrun(script, nproc, run_dir, [*JOB_FLAGS, *plain(extra), *KEEP_ALL]), log=f"{run_dir}.log")
    code, output, hung = finish(proc, launched + 600)
    wrong = ["no end after 600 s"] if hung else problems(run_dir, code, output, restarts=0)
    if wrong:  # every trial is compared with it: a reference that restarted or crashed proves nothing
        raise SystemExit(f"chaos: the reference {strategy} job ({nproc} processes) failed: {'; '.join(wrong)}\n"
                         f"{output[-3000:]}")
    ev = events(run_dir)
    step_s = statistics.median(e["step_s"] for e in ev if e["event"] == "step" and e["rank"] == 0)
    digest = json.loads((run_dir / "summary.json").read_text())["param_digest"]
    return Reference(digest, step_s, time.time() - launched, str(run_dir), phases(ev, launched))


def resumed_reference(strategy, ref, nproc, step, run_dir):
    """The digest that a job which went on with `nproc` processes from its checkpoint of `step` must
    end with: the reference's checkpoint of that step (none: a fresh start), resumed with `nproc`
    processes. None if that job fails."""
    script, extra = STRATEGIES[strategy]
    run_dir = Path(run_dir)
    if step is not None:
        saved = dict(checkpoints(Path(ref.run_dir) / "ckpt"))[step]
        (run_dir / "ckpt").mkdir(parents=True)
        (shutil.copytree if saved.is_dir() else shutil.copy2)(saved, run_dir / "ckpt" / saved.name)
    proc = start(*torchrun(script, nproc, run_dir, [*JOB_FLAGS, *extra, *KEEP_ALL], env=ONE_THREAD),
                 log=f"{run_dir}.log")
    code, output, hung = finish(proc, time.time() + 600)
    if hung or problems(run_dir, code, output, restarts=0):
        return None
    return json.loads((run_dir / "summary.json").read_text())["param_digest"]


# ----------------------------------------------------------------------------- the plan and the table
def drawn_plan(kinds, strategies, rng):
    """(strategy, kind) per trial, without end: first every kind once, in a seeded order, each on the
    applicable strategy with the fewest trials so far; then drawn at random. A trial's draw never
    depends on how many trials follow it."""
    pairs = [(k, [s for s in strategies if s in FAULTS[k].strategies]) for k in kinds]
    pairs = [(k, ss) for k, ss in pairs if ss]
    used = {s: 0 for s in strategies}
    for kind, choices in rng.sample(pairs, len(pairs)):
        strategy = min(choices, key=lambda s: (used[s], rng.random()))
        used[strategy] += 1
        yield strategy, kind
    while True:
        strategy = rng.choice(strategies)
        yield strategy, rng.choice([k for k, ss in pairs if strategy in ss])


def median_text(values, unit=" s", digits=1):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.{digits}f}{unit}" if values else "n/a"


def table(results, kinds):
    rows = []
    for kind in kinds:
        rs = [r for r in results if r.kind == kind]
        if rs:
            rows.append([kind, len(rs), sum(r.fired for r in rs), sum(r.recovered for r in rs),
                         sum(r.expected_restarts in (None, r.restarts) for r in rs),
                         sum(r.digest_equal or bool(r.async_ok) for r in rs),
                         sum(r.bad_loads for r in rs), sum(r.hung for r in rs), median_text(r.recovery_s for r in rs)])
    return tabulate(rows, headers=["fault", "jobs", "fired", "recovered", "restarts (survivors: generations) as expected",
                                   "digest == reference (rpc-async: its guarantees)",
                                   "damaged loaded", "hangs", "median recovery"])


PHASES = ["detect_s", "restart_s", "load_s", "first_step_s", "replay_s"]


def recovery_table(results, kinds, references):
    """Medians per fault kind of the recovery's phases (harness.metrics.phases), then each reference's
    cold start in the same phases: what a failure costs against a launch."""
    rows = []
    for kind in kinds:
        rs = [r for r in results if r.kind == kind and r.recovery_s is not None]
        if rs:
            rows.append([kind, len(rs), median_text(r.recovery_s for r in rs),
                         *(median_text(getattr(r, key) for r in rs) for key in PHASES),
                         median_text((r.replayed_steps for r in rs), unit="", digits=0),
                         median_text((r.vs_cold_start for r in rs), unit="", digits=2)])
    for (strategy, nproc), ref in references.items():
        rows.append([f"cold start: {strategy}, {nproc} processes", 1, median_text([ref.cold.get("total_s")]),
                     *(median_text([ref.cold.get(key)]) for key in PHASES), "", ""])
    return tabulate(rows, headers=["fault", "jobs", "recovery", "to workers' launch", "process start", "load",
                                   "first step", "replay", "steps replayed", "/ cold start"])


def soak(planned, args, out, log):
    """The references the trials of `planned` need, then the trials: (references, results)."""
    needed = sorted({(s, processes(s, FAULTS[k], args.ranks)) for s, k in planned})
    log(f"references: {', '.join(f'{s} ({n} processes)' for s, n in needed)} ...")
    with ThreadPoolExecutor(args.jobs) as pool:
        references = dict(zip(needed, pool.map(lambda sn: reference(*sn, out), needed)))

        def run_logged(t):
            strategy, kind = planned[t]
            log(f"trial {t}: {strategy}, {kind} ...")
            r = run_trial(t, strategy, FAULTS[kind], random.Random(f"{args.seed}:{t}"), out,
                          references[strategy, processes(strategy, FAULTS[kind], args.ranks)], args.ranks)
            log(f"trial {t}: {strategy}, {kind}: {'ok' if r.passed else 'FAILED'} (fired {r.fired} at step "
                f"{r.fault_step}, exit {r.exit}, restarts {r.restarts}, recovery "
                f"{r.recovery_s and round(r.recovery_s, 1)} s)")
            return r

        return references, list(pool.map(run_logged, range(len(planned))))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = Parser(prog="bash run.sh chaos", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=None, help="jobs with faults; the first ones take every kind once "
                                                             "(default: that many)")
    p.add_argument("--seed", type=int, default=0, help="reproduces the series of trials")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="from: " + ", ".join(STRATEGIES))
    p.add_argument("--kinds", default="", help="fault kinds, from: " + ", ".join(KINDS + NODE_KINDS))
    p.add_argument("--nodes", action="store_true", help="the kinds on real nodes (root): " + ", ".join(NODE_KINDS))
    p.add_argument("--plan", default="", help="KIND:STRATEGY,...: exactly these trials, instead of --trials drawn ones")
    p.add_argument("--ranks", type=int, default=2, help="processes of a data-parallel job (sigstop: at least 2; "
                                                        "rpc: a server and at least 2 trainers)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once (a sigstop trial mostly waits)")
    p.add_argument("--out", default="runs/chaos", help="folder for the jobs and results.json")
    args = p.parse_args(argv)
    strategies = args.strategies.split(",")
    kinds = args.kinds.split(",") if args.kinds else NODE_KINDS if args.nodes else KINDS
    args.trials = len(kinds) if args.trials is None else args.trials
    planned = [tuple(reversed(e.split(":", 1))) for e in args.plan.split(",")] if args.plan else []
    bad = [s for s in strategies + [s for s, _ in planned] if s not in STRATEGIES]
    bad += [k for k in kinds + [k for _, k in planned] if k not in FAULTS]
    bad += [f"{k}:{s}" for s, k in planned if s in STRATEGIES and k in FAULTS and s not in FAULTS[k].strategies]
    if bad:
        p.error(f"unknown or inapplicable: {', '.join(bad)}")
    if args.trials < 1 or args.jobs < 1 or args.ranks < 1 or BATCH % args.ranks:
        p.error(f"--trials and --jobs must be >= 1, --ranks must divide the batch of {BATCH}")
    real = [k for _, k in planned] if planned else kinds
    if any(FAULTS[k].real_nodes for k in real) and can_make_nodes():
        p.error(f"{', '.join(k for k in real if FAULTS[k].real_nodes)}: {can_make_nodes()}")
    if not planned:
        drawn = drawn_plan(kinds, strategies, random.Random(args.seed))
        planned = [next(drawn) for _ in range(args.trials)]
    for kind in (FAULTS[k] for k in sorted({k for _, k in planned}) if FAULTS[k].nodes > 1):  # --ranks a node, each size
        if any(BATCH % (n * args.ranks) for n in range(1, kind.nodes + 1)):
            p.error(f"{kind.name} runs {kind.nodes} nodes of --ranks processes: they must divide the batch of {BATCH}")
    out, started = Path(args.out).resolve(), time.time()
    if out.is_dir() and any(out.iterdir()) and not (out / MARK).exists():
        p.error(f"--out {args.out} holds files that chaos did not write: name a new or empty folder")
    subprocess.run(["rm", "-rf", str(out)], check=True)  # the previous soak's, as its mark says
    out.mkdir(parents=True)
    (out / MARK).write_text("written by bash run.sh chaos, which empties this folder when it runs again\n")

    def log(msg):
        print(f"[{time.time() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    store = S3Server(out / "s3") if any(k == "disk-lost" for _, k in planned) else None
    if store:  # --archive's store: a local S3 server, its variables for the jobs
        store.start()
        os.environ.update(store.env)
    try:
        references, results = soak(planned, args, out, log)
    finally:
        if store:
            store.stop()
    (out / "results.json").write_text(json.dumps({
        "seed": args.seed, "argv": argv, "trials": [dataclasses.asdict(r) for r in results],
        "references": [{"strategy": s, "processes": n, **dataclasses.asdict(ref)} for (s, n), ref in references.items()],
    }, indent=2) + "\n")
    print(f"chaos: {len(results)} trials, seed {args.seed}, {time.time() - started:.0f} s")
    print(table(results, list(FAULTS)))
    print(f"\nRecovery, median seconds from the fault (the phases: harness.metrics.phases)\n"
          f"{recovery_table(results, list(FAULTS), references)}")
    failed = [r for r in results if not r.passed]
    for r in failed:
        print(f"\nFAILED trial {r.trial} ({r.strategy}, {r.kind}): fired {r.fired}, {'; '.join(r.problems) or 'no problem'}"
              f", digest {'==' if r.digest_equal else '!='} reference, damaged loaded {r.bad_loads}, kept {r.kept}."
              f"\nReproduce: bash run.sh chaos {' '.join(argv)} (trial {r.trial}); its last command:\n{r.command}\n"
              f"{r.output_tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
