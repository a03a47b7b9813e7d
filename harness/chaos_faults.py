"""The chaos soak's fault kinds (harness/chaos.py runs them): the jobs they are fired into and the
references those are compared with, how each kind fires into a running job or damages its checkpoints,
and FAULTS, the table of kinds (chaos_nodes.py appends the kinds on real nodes).

A kind is a FaultKind: its part in each stage of a trial (chaos_judge.run_trial), which all share the
trial's Job: prepare before the launch, launch, fire while the job runs; once it ended, fired (did the
fault happen), its own checks and the digest it must end with.
"""
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from common.checkpoint import checkpoints, step_name
from harness.launch import STRATEGIES, problems, survivors_job, torchrun
from harness.metrics import Watch, events, phases
from harness.procs import children, finish, free_port, kill_node, start, workers
from harness.s3server import BUCKET

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
POLL_S = 0.005  # how often a save's folder is looked at while waiting for its shards


# ----------------------------------------------------------------------------- what a trial records
@dataclass
class Reference:
    """The figures of an uninterrupted job, which the trials of its strategy and size are compared with."""
    digest: str
    step_s: float  # median step time of rank 0
    total_s: float  # launch to exit
    run_dir: str
    cold: dict  # the launch to the first step, in the phases of harness.metrics.phases


@dataclass
class Trial:
    """One trial's job and verdict: a row of the soak's tables and of its results.json."""
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
    crash_rank: int  # where the kind crashes a rank (FT_FAULTS' rank=)
    crash_step: Optional[int] = None  # the step an injected crash follows (crash-in-save: the save it dies in)
    faults: str = ""  # FT_FAULTS of the job's launches (faulted()), "kind=N,...": the faults fired from inside
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
    members: list = field(default_factory=list)  # with etcd: each node's member (a Popen); and which one was killed
    killed_member: int = None
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


# ----------------------------------------------------------------------------- the references
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
    """A crash on a random rank after a random step up to `latest`."""
    def prepare(job):
        job.crash_step = job.rng.randint(1, latest)
        job.faults = f"crash-at-step={job.crash_step},rank={job.crash_rank}"
    return prepare


def crash_in_snapshot(job):
    """A crash halfway through a random step's memory snapshot, before its record: never restored."""
    job.crash_step = job.rng.randint(1, STEPS - 1)
    job.faults = f"crash-in-snapshot={job.crash_step},rank={job.crash_rank}"


def crash_in_save(job):
    """A crash while a random save is written, before its commit: that checkpoint must never be loaded."""
    job.damaged = job.crash_step = job.rng.randrange(SAVE_EVERY, STEPS, SAVE_EVERY)
    job.faults = f"crash-in-save={job.damaged}"


def first_launch_crashes(then):
    """A first launch that dies with no restart left, after `then(job)` has done what it does to its
    newest checkpoint: the job proper is its relaunch. The memory tier is off: its snapshots, newer
    than the disk's newest checkpoint, would be loaded instead, and the disk's fallback go untested."""
    def prepare(job):
        job.flags += NO_MEMORY_TIER.get(job.trial.strategy, [])
        job.crash_step = job.rng.randint(2 * SAVE_EVERY, STEPS - 1)
        crash = {"FT_FAULTS": f"crash-at-step={job.crash_step}"}  # the first launch's alone
        first = start(*torchrun(job.script, job.trial.processes, job.run_dir, job.flags, max_restarts=0, env=crash),
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
    first = start(*faulted(job, torchrun(job.script, job.trial.processes, job.run_dir, job.flags, max_restarts=0)),
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
def faulted(job, launch):
    """A launch of the job, (command, environment), with the job's faults in FT_FAULTS, where the scripts
    read them (tiers/faults.py). Only the faulted job's launches have them, never a reference's."""
    cmd, env = launch
    return cmd, {**env, "FT_FAULTS": job.faults} if job.faults else env


def one_node(job):
    if job.trial.strategy in SURVIVORS:  # the launcher's supervisor, with the spares the flags ask for
        spares = int(job.flags[job.flags.index("--spares") + 1]) if "--spares" in job.flags else 0
        return faulted(job, survivors_job(job.script, job.trial.processes, job.run_dir, plain(job.flags),
                                          spares=spares))
    return faulted(job, torchrun(job.script, job.trial.processes, job.run_dir, job.flags))


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

    def node(is_host):
        return faulted(job, torchrun(job.script, job.trial.processes // 2, job.run_dir, job.flags, nnodes="1:2",
                                     endpoint=endpoint, rdzv_id=rdzv_id, is_host=is_host, env=ONE_THREAD))
    job.lost = start(*node(is_host=False), log=f"{job.run_dir}-node1.log")
    return node(is_host=True)


def two_survivor_nodes(job):
    """node-lost, --survivors: two nodes of half the ranks each, with the strategy's spares, each with a
    memory of its own; node 0's supervisor holds the job's store. Node 1 starts here; so, once it is
    lost, does a new node 1 when there is no spare to take its ranks (job.relaunch)."""
    endpoint, nproc, flags = f"localhost:{free_port()}", job.trial.processes // 2, plain(job.flags)
    spares = int(job.flags[job.flags.index("--spares") + 1]) if "--spares" in job.flags else 0
    flags += HANG_FLAGS_DEFAULT  # a node is found lost once silent for --hang-timeout-s

    def node(n, memory):
        return faulted(job, survivors_job(job.script, nproc, job.run_dir,
                                          [*flags, "--snapshot-dir", f"{job.run_dir}-{memory}"], spares=spares,
                                          nnodes=2, node=n, endpoint=endpoint))
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


# ----------------------------------------------------------------------------- the fault kinds
@dataclass
class FaultKind:
    """A kind of fault: the jobs it applies to, and its part in each stage of a trial (chaos_judge.run_trial).
    A new kind is one entry of FAULTS, with its stage functions above."""
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
    etcd: bool = False  # --nodes, --survivors: the control plane in etcd, a member on each node (chaos_nodes.py)


# The kinds by name; chaos_nodes.py appends the --nodes kinds.
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
    # it (tests/test_ddp.py kills it from inside, with FT_FAULTS=crash-in-save=N).
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
]}


def processes(strategy, kind, ranks):
    """How many processes a trial's job has: --ranks on each of its kind's nodes, or a parameter server's."""
    if strategy.startswith("rpc"):
        return max(3, ranks + 1)  # a server and at least two trainers
    return kind.nodes * max(kind.min_ranks, ranks)

