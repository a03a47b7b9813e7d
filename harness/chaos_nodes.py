"""The chaos soak's kinds on real nodes (bash run.sh chaos --nodes, as root): their stages, and their
entries appended to the table of kinds, chaos_faults.FAULTS, after the others.

Each node is a network namespace with an address and a /dev/shm of its own (harness/nodes.py). The
kinds: a node killed whole, cut off shorter and longer than --hang-timeout-s, node 0 (rank 0 and the
job's store) cut off, a lossy link, two nodes lost one after the other; for torchrun (c10d) and
--survivors. And for --survivors with the control plane in etcd (three nodes, a member of an etcd
cluster on each, tiers/etcd.py): node 0 killed whole, node 0 cut off, the etcd leader's member killed.
"""
import contextlib
import dataclasses
import subprocess
import time

from harness.chaos_faults import (DATA_PARALLEL, FAULTS, HANG_FLAGS_DEFAULT, MARGIN, ONE_THREAD, SAVE_EVERY, STEPS,
                                  SURVIVORS, FaultKind, FaultMissed, Hit, at_step, faulted, plain, resumed_reference)
from harness.launch import survivors_job, torchrun
from harness.nodes import Cluster, pids_in
from harness.procs import finish
from tiers.etcd import ENDPOINTS

# A node is cut off for less, then for more than --hang-timeout-s (5 s, HANG_FLAGS_DEFAULT): its link is
# down for that long at the switch. A lossy link loses LOSS_PERCENT of its packets for LOSSY_S.
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
    etcd = {}
    if kind.etcd:  # a member on each node; every node's spares (node 0 is lost too), not node 0's alone
        job.members = [job.cluster.etcd(k, range(n), job.run_dir.parent / f"{job.run_dir.name}-etcd") for k in range(n)]
        etcd = {ENDPOINTS: job.cluster.etcd_endpoints(range(n)), "RDZV_ID": job.cluster.tag}
        deadline = time.time() + 60
        while job.cluster.etcd_leader(range(n)) is None:
            if time.time() > deadline:
                raise FaultMissed("etcd elected no leader in 60 s", "")
            time.sleep(0.1)  # polling etcd's status, not waiting for a guessed moment

    def command(k):
        if strategy in SURVIVORS:
            cmd, env = survivors_job(job.script, nproc, job.run_dir, plain(job.flags),
                                     spares=nproc if kind.etcd and spares else spares if k == 0 else 0, nnodes=n,
                                     node=k, endpoint=job.cluster.endpoint)
            return faulted(job, (cmd, {**env, **etcd}))
        return faulted(job, torchrun(job.script, nproc, job.run_dir, job.flags,
                                     nnodes=f"{1 if kind.elastic else n}:{n}", endpoint=job.cluster.endpoint,
                                     rdzv_id=job.cluster.tag, env=ONE_THREAD))

    def boot(k):
        cmd, env = command(k)
        return job.cluster.start(k, cmd, {**env, **ONE_THREAD}, f"{job.run_dir}-node{k}-{len(job.gone)}.log")
    job.boot = boot
    main = 1 if kind.etcd else 0  # the node whose launcher is the trial's job: with etcd, node 0 may be lost
    job.nodes = {k: boot(k) for k in range(n) if k != main}
    cmd, env = command(main)
    return job.cluster.wrap(main, cmd), {**env, **ONE_THREAD, **job.cluster.env(main)}


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
    outlasts the hang timeout, node 1 (cut off itself, or from node 0's store; with etcd, node k itself) must
    leave the job, exit 1; its processes' pids are kept (cut_pids), to check that none trained or saved after
    the cut."""
    def fire(job):
        leaves = k if FAULTS[job.trial.kind].etcd else 1

        def cut():
            job.cut_pids = pids_in(job.cluster.netns[leaves])
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
            code, output, _ = finish(job.nodes[leaves], job.deadline)
            job.left.append((leaves, code, output))
            replaced_if_needed(job, leaves)
    return fire


def etcd_leader_killed(job):
    """The etcd member that leads killed (its node lives) after a random step, then started again, once
    another leads: the job trains on, nobody fenced, no generation lost."""
    def kill():
        leader = job.cluster.etcd_leader(range(FAULTS[job.trial.kind].nodes))
        if leader is None:
            return False
        job.members[leader].kill()
        job.members[leader].wait()
        job.killed_member = leader
        return True
    job.hit = at_step(job, job.rng.randint(SAVE_EVERY + 1, STEPS - MARGIN), None, kill)
    if job.hit is None:
        return
    while job.cluster.etcd_leader(range(FAULTS[job.trial.kind].nodes)) in (None, job.killed_member):
        if job.proc.poll() is not None:
            return
        time.sleep(0.1)  # polling etcd's status for a new leader, not waiting for a guessed moment
    k = job.killed_member
    job.members[k] = job.cluster.etcd(k, range(FAULTS[job.trial.kind].nodes), job.run_dir.parent / f"{job.run_dir.name}-etcd")


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


# The --nodes kinds join the table of kinds, after the others (chaos.py takes FAULTS from here, with them).
FAULTS.update({name: FaultKind(name, DATA_PARALLEL + SURVIVORS, nodes=nodes, restarts=restarts, real_nodes=True,
                               elastic=elastic, launch=on_nodes, fire=fire, checks=nodes_ended, expected=node_expected)
               for name, nodes, restarts, elastic, fire in [
                   # (restarts: torchrun's, or the survivors' generations; None: any, a false alarm costs one)
                   ("node-killed", 2, 1, True, kill_nodes(1)),
                   ("node-cut-short", 2, 0, False, cut_node(1, CUT_SHORT_S)),  # TCP retransmits: nobody notices
                   ("node-cut-long", 2, 1, False, cut_node(1, CUT_LONG_S)),
                   ("node0-cut", 2, 1, False, cut_node(0, CUT_LONG_S)),  # rank 0 and the job's store cut off
                   ("lossy-link", 2, None, False, lossy_link),
                   ("two-nodes-lost", 3, 2, True, kill_nodes(2, 1)),  # one after the other
               ]})
FAULTS.update({name: FaultKind(name, SURVIVORS, nodes=3, restarts=restarts, real_nodes=True, etcd=True, launch=on_nodes,
                               fire=fire, checks=nodes_ended, expected=node_expected)
               for name, restarts, fire in [
                   ("etcd-node0-killed", 1, kill_nodes(0)),  # rank 0, its supervisor and its etcd member
                   ("etcd-node0-cut", 1, cut_node(0, CUT_LONG_S)),  # node 0 leaves; the majority trains on
                   ("etcd-leader-killed", 0, etcd_leader_killed),  # etcd's own leader: nothing happens
               ]})
