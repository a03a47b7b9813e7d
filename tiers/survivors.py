"""The survivors tier: a dead rank is replaced alone, by a spare when one waits; the other ranks keep
their processes, their memory and their place, re-form the process group with the newcomer, and go on
from the newest step that every rank can restore (the memory tier). Imported only in this mode
(--survivors, --spares): delete this module and those lines of a script to go without it.

torchrun's agent stops all of its workers when one fails, and with its c10d rendezvous every node
restarts too. Here the launcher (harness/launch.py) runs a Supervisor (harness/supervisor.py) on each
node instead of torchrun: one process per rank of the node plus --spares waiting ones, each restarted
alone when it dies. Node 0's holds the job's store, which outlives every worker: on one node, as root,
in a network namespace of its own, which only the job's processes enter (in_network_namespace: no other
process can connect; else on the loopback, said at start); on several, at the address of RDZV_ENDPOINT,
where whoever reaches it is trusted with the job's control; or, with ETCD_ENDPOINTS, in etcd, where no
node holds it (tiers/etcd.py: leases, transactions, a leader instead of node 0). No pickle crosses a group
(common.dist.gather_json), except DCP's own in an FSDP save or load (docs/guarantees.md), and every
value read from the store is checked (vacancy_of, claim_of; one that is not the job's is ignored, in
one line). The store holds:
    gen                 the generation: a supervisor adds one for each rank it finds dead
    vacancy/<n>         "<rank> <gen> <node>": the n-th rank left by a dead process, for a process of
                        that node, or of any ("any": its node was lost) (count: vacancies)
    claim/<n>           "<slot> <pid>": the process that took vacancy n (a slot: its place in the launch,
                        node * STRIDE + its place on the node, whatever the other nodes' --spares)
    g<gen>/member/<r>   rank r is ready to form generation gen; the group forms when all are
    g<gen>/abort        why generation gen is over: written first by a supervisor that saw a death, a
                        fence or a lost node, or by the first rank whose collective failed; every rank's
                        watcher then ends its waits on the group (Team.watch)
    g<gen>/lost/<r>     rank r saw a peer fail in generation gen (count: g<gen>/lost)
    g<gen>/next         "same": every rank reported, nobody died (a false alarm): node 0 began the next
    beat/<r>            "<steps> <median step s>" of rank r, every BEAT_S (Team.beat)
    node/<k>/...        node k's supervisor: its incarnation (one more each time it starts: a node that
                        comes back starts only spares), its beat (one more every 0.1 s), lost/<i> (who
                        gave away the ranks of its incarnation i: node 0, which found it silent, or the
                        node itself, come back), done (its processes have ended)
    end                 the job is over: spares leave (woken by a last vacancy/<n> that says "end")
    stop                why the job must end (a slot used up its restarts): the ranks that recover next
                        save after their next step and exit, as on a preemption (StepGuard.end_after_step)
With etcd, also: g<gen>/store (where generation gen's group meets: a supervisor's own store),
node/<k>/alive/<i> (held by node k's lease) and leader (held by the leading node's lease); beat/<r>, and
a copy of each g<gen>/abort, are on the rank's own node's store instead (FT_NODE_STORE).
Each generation's process group lives under its own prefix of the store, so no key of a failed one
is ever read again.

How a survivor hears, and how its waits end: its watcher thread waits in the store for its
generation's abort, which a supervisor writes as soon as it sees a death (or fences a frozen process,
or finds a node lost), and so does the first rank whose collective fails. The watcher then ends the
generation's process groups on this process (end_generation: gloo's connections closed, NCCL's groups
aborted), so that every collective in flight raises at once, whoever issued it and in whichever
thread it waits: the scripts', DDP's reducer, FSDP2's, DTensor's in the clipping, DCP's in a save. The
step ends (Team.__exit__, Team.lost_peer) and Team.recover reports the loss, lets the save in flight
end (settle: never committed after the abort), drops the groups, waits for the supervisor's next
generation, forms it with the newcomer, and the script then restores the newest step every rank
holds, as a restart would, and redoes the steps after it. A generation every rank
reports lost with nobody dead (a pause, a slow link) is a false alarm: the same processes form the next.
A frozen rank never dies: the supervisor kills a process stopped for STOPPED_STEPS of its steps (at
least STOPPED_FLOOR_S), and, once a survivor has reported a loss, whichever rank has not reported one
within twice --hang-timeout-s, or, once a rank is ready for a generation, whichever has not joined it
within as long (a fence: a stale process can never come back), and replaces it. A rank that a claim
gives to no process of the job (a claim another client wrote) is posted again. A node lost whole (its
supervisor silent for --hang-timeout-s once a survivor has reported a loss) leaves its ranks to spares
of any node: node 0's supervisor posts them; the lost node's own supervisor, if it was only cut off,
kills its processes.
"""
import collections
import concurrent.futures
import contextlib
import ctypes
import datetime
import fcntl
import os
import socket
import statistics
import struct
import threading
import time

import torch
import torch.distributed as dist

import common.dist
from common.config import fail
from common.dist import PEER_LOST, exit_without_finalizing, keep_on_loopback, pick_device, set_collective_timeout

STORE, SLOT, WORLD, SLOTS, GEN = "FT_STORE", "FT_SLOT", "FT_WORLD", "FT_SLOTS", "FT_GENERATION"
STOP = "stop"  # the job's key: why the job ends once its step is saved (the supervisor's)
NETNS = "FT_STORE_NETNS"  # one node, as root: the fd of the network namespace the job's store listens in
NODE_STORE = "FT_NODE_STORE"  # with etcd (tiers/etcd.py): host:port of this node's supervisor's store
NPROC, FIRST_RANK = "FT_NPROC", "FT_RANK"  # ranks a node; the rank of a process of the first launch
STRIDE = 1000  # slots of node k: k * STRIDE + 0, 1, ... (a node runs fewer processes)
PROCESS_BYTES = 400 * 2**20  # a process's memory before its model: 421 MiB PSS (686 MiB RSS) measured, torch 2.14, CPU
POLL_S = 0.005  # how often a waiting process reads the store (one node: a few microseconds a read)
ETCD_POLL_S = 0.05  # as often, with the job's store in etcd (tiers/etcd.py)
RETRIES = 3  # failures during one recovery before a survivor gives up its process (the supervisor replaces it)
BEAT_S = 0.1  # a rank's beat (beat/<rank>: its steps and its median step) every BEAT_S
CLONE_NEWNET = 0x40000000  # (linux/sched.h)
FORKED = "FT_FORKED"  # set in a process that the node's warm parent forked (harness/warm.py)
HANG_AT_CLAIM = "FT_HANG_AT_CLAIM"  # tests: the process that wins vacancy N hangs there (alive, never joins)
HANG_IN_SETTLE = "FT_HANG_IN_SETTLE"  # tests: "R G": rank R, recovering from generation G, hangs as in a save
# NCCL in this mode: only an abort (the watcher's) or the group's own timeout ends a collective; neither
# the watchdog (after an error, a timeout: it would kill the process) nor the heartbeat monitor kills it.
NCCL_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0",
                 "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def layout_problems(cfg, params):
    """[lines] on what keeps a --survivors job from starting: --spares alone, more processes (ranks and
    spares) than a node's slots (STRIDE), or than this node has GPUs (--device cuda) or memory for (each
    holds torch itself, PROCESS_BYTES, and the model, its gradients and AdamW's moments: 16 bytes a
    parameter, on the CPU)."""
    if not cfg.survivors:
        return ["--spares needs --survivors"] if cfg.spares else []
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) + cfg.spares  # this node's
    if processes > STRIDE:
        return [f"--survivors --spares {cfg.spares}: {processes} processes on a node, at most {STRIDE} (a node's slots)"]
    if cfg.device == "cuda" and torch.cuda.device_count() < processes:
        return [f"--survivors --spares {cfg.spares}: {processes} processes need a GPU each, this node has "
                f"{torch.cuda.device_count()}"]
    need, free = processes * (PROCESS_BYTES + 16 * params), available_memory()
    if cfg.device != "cuda" and free is not None and need > free:
        return [f"--survivors --spares {cfg.spares}: {processes} processes need about {need / 2**30:.1f} GiB of "
                f"memory (torch's and the model's state), this node has {free / 2**30:.1f} GiB available"]
    return []


def available_memory():
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


# ----------------------------------------------------------------------------- the store: private, and never trusted
def in_network_namespace(make, fd=None):
    """(make(), the namespace's fd): make() called in a thread of its own that first joins the network
    namespace `fd` (setns), or a new one (unshare, its loopback brought up) if `fd` is None. A thread's
    network namespace is its own: the sockets make() opens stay in that namespace, where no process
    outside it can connect, and the process's other sockets stay where they are. Both need root
    (CAP_SYS_ADMIN): OSError otherwise."""
    done = {}

    def run():
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            if (libc.setns(fd, CLONE_NEWNET) if fd is not None else libc.unshare(CLONE_NEWNET)) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            if fd is None:  # a new namespace's loopback is down: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
                    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
            done["value"] = (make(), fd if fd is not None else os.open("/proc/thread-self/ns/net", os.O_RDONLY))
        except BaseException as e:
            done["error"] = e
    thread = threading.Thread(target=run, name="survivors-netns")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]


def connect(timeout_s, node=False):
    """A client of the job's store (FT_STORE), its socket made in the store's network namespace where
    the supervisor made one (FT_STORE_NETNS: an fd that only the job's processes inherit); with etcd
    (tiers/etcd.py), the job's store there, and `node`: this node's supervisor's (FT_NODE_STORE)."""
    if os.environ.get(NODE_STORE) and not node:
        from tiers import etcd
        return etcd.client()
    host, port = os.environ[STORE].rsplit(":", 1)

    def client():
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return in_network_namespace(client, int(os.environ[NETNS]))[0] if NETNS in os.environ else client()


def vacancy_of(value, world, nnodes):
    """(rank, generation, node) of a vacancy/<n> value, "<rank> <gen> <node|any>"; None for anything else
    (the store takes any client's word: a value that is not this job's is never acted on)."""
    try:
        rank, gen, node = value.decode().split()
        assert 0 <= int(rank) < world and int(gen) >= 0 and (node == "any" or 0 <= int(node) < nnodes)
        return int(rank), int(gen), node if node == "any" else str(int(node))
    except (ValueError, AssertionError, UnicodeDecodeError):
        return None


def claim_of(value, nnodes):
    """(slot, pid) of a claim/<n> value, "<slot> <pid>", for a slot of the job's nodes; None otherwise."""
    try:
        slot, pid = (int(x) for x in value.decode().split())
        assert 0 <= slot < nnodes * STRIDE and pid > 0
        return slot, pid
    except (ValueError, AssertionError, UnicodeDecodeError):
        return None


# ----------------------------------------------------------------------------- ending a generation's waits
# gloo has no abort (its abort() is a no-op, pytorch issue 130345), and a survivor that does not talk to
# the dead peer waits in its collective until the group's timeout: in the scripts' collectives, and in
# the ones torch issues itself (DDP's reducer, FSDP2, DTensor's all-reduce in the clipping, DCP's save in
# the main thread or its own). What ends them all is gloo's own timeout path: a receive that times out
# closes every connection of its group's context (Context::signalException), so every collective in
# flight on the group, or issued on it later, raises at once, in whichever thread waits, and the
# group's gloo_tcp_loop thread goes idle. end_generation runs that receive on every gloo group of the
# generation (the world, the async save's, the memory tier's), and aborts the NCCL ones (their abort()
# is real). Verified on torch 2.11 and 2.14.
_ended = threading.Lock()
_abandoned = [None]  # why this process's generation is over, until the next one forms (Team.form)
POISON_TAG = 0x7F7F7F  # a tag no collective of the job uses: nothing is ever sent for it


def end_generation(reason):
    """End every wait of this process on the process groups it holds (once a generation; the next call
    returns at once): whoever issued them, they raise now, and so does any later one on those groups."""
    with _ended:
        if _abandoned[0] is not None:
            return
        _abandoned[0] = reason
        groups = list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []
        for group in (g for g in groups if dist.get_backend(g) == "gloo" and g.size() > 1):
            close_connections(group)
        if any(dist.get_backend(g) == "nccl" for g in groups):  # NCCL's abort ends its kernels and waits
            dist.distributed_c10d._abort_process_group()


def close_connections(group):
    """Close every connection of the gloo `group` on this process: a receive from a peer, waited for 1 ms,
    times out, and gloo then closes all the pairs of the group's context. A peer whose pair is closed
    already (it died) answers at once with an error instead: the next one is tried."""
    for peer in (r for r in range(group.size()) if r != group.rank()):
        try:
            group.recv([torch.empty(1)], peer, POISON_TAG).wait(datetime.timedelta(milliseconds=1))
        except RuntimeError as e:
            if "Timed out" in str(e):
                return


def abandoned():
    """Whether this process's generation is over (end_generation ran; the next one has not formed)."""
    return _abandoned[0] is not None


def replaced_by_supervisor(reason):
    """common.dist's after_peer_loss here: the supervisor starts a process in this one's place (and fences
    on its own)."""
    return "the supervisor will start a process in its place", []


# ----------------------------------------------------------------------------- a worker's side
def join(cfg):
    """(team, rank, world size, device) of this process in a --survivors job, once it holds a rank: a
    spare waits here; one still waiting when the job ends leaves here."""
    common.dist.after_peer_loss, common.dist.abandoned = replaced_by_supervisor, abandoned
    team = Team(cfg.timeout_s, cfg.hang_timeout_s)
    joined = team.join(cfg.device)
    if joined is None:
        exit_without_finalizing()
    return (team, *joined)


class Team:
    """This process's place in the job: a rank it holds, or a spare's wait for one; the generations it
    forms with the others."""

    def __init__(self, timeout_s, hang_timeout_s):
        if STORE not in os.environ:
            fail("--survivors runs under run.sh (python -m harness.launch), which supervises the processes")
        self.store = connect(timeout_s)
        self.node_store = connect(timeout_s, node=True) if os.environ.get(NODE_STORE) else self.store  # (etcd)
        self.poll_s = POLL_S if self.store is self.node_store else ETCD_POLL_S  # (etcd: a request each, not a read)
        self.slot, self.world, self.slots = int(os.environ[SLOT]), int(os.environ[WORLD]), int(os.environ[SLOTS])
        self.nproc = int(os.environ[NPROC])
        self.node, self.local_slot = divmod(self.slot, STRIDE)
        self.timeout_s, self.hang_timeout_s = timeout_s, hang_timeout_s
        self.rank, self.gen, self.seen = None, None, 0  # seen: the vacancies looked at
        # The incarnation of this node whose processes these are: node 0 may give its ranks away (lost/<i>)
        self.incarnation = self.store.add(f"node/{self.node}/incarnation", 0)
        self.lost = False  # a peer was lost in the body of `with team:`
        self.formed = threading.Lock()  # held while a generation is formed: the watcher never ends the next
        self.step_times, self.started = collections.deque(maxlen=50), None  # the steps of `with team:`
        self.reported = None  # the generation whose loss this process reported (abandon)

    def join(self, device_choice):
        """Take a rank (a spare waits here for one; the first launch's processes take theirs at once),
        form the generation, and set the environment the scripts read (RANK, WORLD_SIZE, ...). Returns
        (rank, world_size, device); None if the job ended while this process waited (a spare)."""
        if self.world == self.nproc:
            keep_on_loopback()
        device = pick_device(device_choice, self.local_slot, self.slots)  # a GPU per process, spares' included
        first = FIRST_RANK in os.environ
        if first:
            self.rank = int(os.environ[FIRST_RANK])
        else:
            warm_up(device)  # what every new process pays once, paid before it is needed
            self.rank = self.take_vacancy()
            if self.rank is None:
                return None
        # LOCAL_*: the rank's place on the node the launch gave it (the memory tier's copies and replicas
        # follow it), even when a spare of another node holds it now.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(self.rank % self.nproc),
                          LOCAL_WORLD_SIZE=str(self.nproc))
        self.form(0 if first else None, device)
        for target in (self.watch, self.beat):
            threading.Thread(target=target, name=f"survivors-{target.__name__}", daemon=True).start()
        return self.rank, self.world, device

    def take_vacancy(self):
        """The rank of the oldest vacancy for this node (or any) that this slot wins, waiting for one (a
        wake-up at least every --timeout-s); None once the job has ended."""
        while True:
            count = self.store.add("vacancies", 0)
            while self.seen < count:
                self.seen += 1
                try:
                    vacancy = vacancy_of(self.store.get(f"vacancy/{self.seen}"), self.world, self.world // self.nproc)
                except dist.DistStoreError:  # counted but never written (not by a supervisor: it writes at once)
                    vacancy = None
                if vacancy is None:
                    print(f"slot {self.slot}: vacancy/{self.seen} in the job's store is not a vacancy: ignored",
                          flush=True)
                    continue
                rank, _, node = vacancy
                if node not in (str(self.node), "any"):  # a rank of another node: its spares' or its restart's
                    continue
                if self.given_up():  # a spare of a node cut off: the ranks are for the nodes that are not
                    return None
                me = f"{self.slot} {os.getpid()}"  # this process, not its slot: a restarted one is another
                if self.store.compare_set(f"claim/{self.seen}", "", me).decode() == me:
                    if os.environ.get(HANG_AT_CLAIM) == str(self.seen):
                        print(f"fault injection: slot {self.slot} hangs after it claimed vacancy {self.seen}", flush=True)
                        threading.Event().wait()
                    how = "forked" if os.environ.get(FORKED) else "a fresh interpreter"
                    print(f"slot {self.slot} (pid {os.getpid()}, {how}): takes rank {rank}", flush=True)
                    return rank
            if self.store.check(["end"]):
                return None
            with contextlib.suppress(dist.DistStoreError):  # the store answers when the key is set (the end sets it too)
                self.store.wait([f"vacancy/{self.seen + 1}"], datetime.timedelta(seconds=self.timeout_s))

    def form(self, gen, device):
        """Form generation `gen` (None: the newest) with every rank: say this rank is ready, wait until all
        are, then init_process_group over the generation's prefix of the store. A newer generation met
        while waiting, or a group that fails to form (a member died meanwhile), moves on to the next."""
        deadline = time.monotonic() + self.timeout_s
        gen = self.newest() if gen is None else gen
        while True:
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {self.rank}: no generation formed in {self.timeout_s} s: leaving for a restart")
            if self.given_up():  # its rank is another process's now (posted before the generation began)
                raise SystemExit(f"rank {self.rank}: node {self.node} was found lost and its ranks given to others: "
                                 "this process leaves (fenced)")
            self.store.set(f"g{gen}/member/{self.rank}", str(os.getpid()))
            if not self.all_ready(gen, deadline):
                gen = self.newest()
                continue
            try:  # everyone is warm and waiting: a short timeout, so that a member's death here costs little
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                        store=dist.PrefixStore(f"g{gen}", self.group_store(gen)), rank=self.rank,
                                        world_size=self.world, device_id=device if device.type == "cuda" else None,
                                        timeout=datetime.timedelta(seconds=max(self.hang_timeout_s, 10)))
                break
            except (RuntimeError, dist.DistError) as e:
                # The failed init took the group's number, which destroy_process_group would have given back
                # (a private counter): give it back, or this process's next group would not meet the others'.
                dist.distributed_c10d._world.group_count = 0
                print(f"rank {self.rank}: generation {gen} did not form ({str(e).strip()[:100]}): waiting for the "
                      "next", flush=True)
                while self.newest() <= gen and time.monotonic() < deadline:
                    time.sleep(self.poll_s)
                gen = self.newest()
        set_collective_timeout(self.timeout_s)  # the long timeout while the state is restored
        with self.formed, _ended:
            _abandoned[0] = None
            self.gen = gen
        os.environ[GEN] = str(gen)

    def group_store(self, gen):
        """Where generation `gen`'s process group meets: the job's store; with etcd, the store of the
        supervisor that began the generation (g<gen>/store), reached from here."""
        if not os.environ.get(NODE_STORE):
            return self.store
        host, port = self.store.get(f"g{gen}/store", self.timeout_s).decode().rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=datetime.timedelta(seconds=max(self.hang_timeout_s, 10)))

    def given_up(self):
        """Whether node 0 found this node silent (cut off, say) and gave its ranks away: its processes are
        stale, and must never join a generation, whatever they can reach again."""
        return self.store.check([f"node/{self.node}/lost/{self.incarnation}"])

    def watch(self):
        """The watcher thread: it waits for the abort of this process's generation (g<gen>/abort), written by
        a supervisor as soon as it sees a death, fences a frozen process or finds a node lost, and by the
        first rank whose collective fails; it then ends at once every wait of this process on the
        generation's groups (end_generation), whoever issued it, so that every survivor recovers now, not
        only the dead rank's neighbours. Its own store client: one blocked in wait() stalls every other
        call on its client. (With etcd, this node's supervisor's store, where it relays the aborts.)"""
        store = connect(self.timeout_s, node=True)
        while True:
            gen = self.gen
            try:  # every generation ends with its abort: a supervisor's, or a failed rank's (reform)
                store.wait([f"g{gen}/abort"], datetime.timedelta(days=1))
                reason = store.get(f"g{gen}/abort").decode()
            except dist.DistError:  # the store is gone: the main thread finds out at its next call
                return
            with self.formed:
                if self.gen == gen:
                    end_generation(f"generation {gen}: {reason}")
            while self.gen == gen:
                time.sleep(POLL_S)

    def beat(self):
        """The beat thread: every BEAT_S, this rank's steps and median step (beat/<rank>), from which the
        supervisors learn how long a step takes here (a frozen process is one stopped for many of them)."""
        while True:
            time.sleep(BEAT_S)
            steps = list(self.step_times)
            try:
                self.node_store.set(f"beat/{self.rank}", f"{len(steps)} {statistics.median(steps) if steps else 0:.6f}")
            except dist.DistError:
                return

    def all_ready(self, gen, deadline):
        """Wait until every rank is ready to form `gen`: True, or False once a newer one has begun."""
        while not self.store.check([f"g{gen}/member/{r}" for r in range(self.world)]):
            if self.newest() > gen or time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def newest(self):
        return self.store.add("gen", 0)

    def __enter__(self):
        self.lost, self.started = False, time.perf_counter()
        return self

    def __exit__(self, kind, error, traceback):
        """The body of `with team:` (a step of the loop) ends early when a peer is lost: team.lost, and the
        error goes no further; any other error goes on. A body that ended after its generation's abort
        (its collectives done before it) is lost too: the others have left to recover."""
        if error is None and not abandoned():
            self.step_times.append(time.perf_counter() - self.started)
        self.lost = self.lost_peer(error) if error is not None else abandoned()
        return self.lost

    def recover(self, checkpointer, device, step, rebuild=None):
        """A survivor's way back after a peer was lost at `step`: it reports the loss and ends its waits on
        the old groups (abandon), what the checkpointer has in flight settles (a save committed whole, or
        left uncommitted: never loaded), the group re-forms with the newcomer
        (reform), what belonged to the old group is made again over the new one (FSDP: `rebuild()`, the
        sharded model, its optimizer, tiers and checkpointer; DDP: the checkpointer's tiers, regroup()), and
        every rank restores the newest step all of them hold (a tier's, the memory tier; else the disk), as
        the newcomer does at its start: the same collectives in the same order. Returns (the step
        restored, the checkpointer)."""
        t0, lost_at = time.perf_counter(), time.time()
        for attempt in range(1, RETRIES + 1):
            try:
                self.abandon()
                if attempt == 1:
                    if os.environ.get(HANG_IN_SETTLE) == f"{self.rank} {self.gen}":  # a write to a disk that hangs
                        print(f"fault injection: rank {self.rank} hangs in its recovery from generation {self.gen}",
                              flush=True)
                        threading.Event().wait()
                    settle(checkpointer, self.timeout_s)
                gen = self.reform(device)
                formed_s = time.perf_counter() - t0
                checkpointer = rebuild() if rebuild else regroup(checkpointer)
                restored = checkpointer.restore()
                restored = checkpointer.load() if restored is None else restored
                if restored is None:  # its model and optimizer are trained, the newcomers' fresh: it starts again too
                    raise SystemExit(f"rank {self.rank}: no step that every rank holds, in memory or on disk: this "
                                     "process leaves, so that every rank starts afresh (the supervisor replaces it)")
                break
            except RuntimeError as error:
                if not self.lost_peer(error):
                    raise
                print(f"rank {self.rank}: another peer was lost while generation {self.gen} formed or restored "
                      f"(attempt {attempt} of {RETRIES})", flush=True)
        else:
            raise SystemExit(f"rank {self.rank}: more than {RETRIES} failures in one recovery: leaving for a restart")
        set_collective_timeout(checkpointer.guard.step_timeout_s)
        if self.store.check([STOP]):  # the supervisor ends the job: saved after the next step, as on a preemption
            checkpointer.guard.end_after_step()
        checkpointer.monitor.event("recovered", step=restored, lost_step=step, generation=gen, lost_at=lost_at,
                                   formed_s=formed_s, recover_s=time.perf_counter() - t0, pid=os.getpid())
        if self.rank == 0:
            print(f"generation {gen}: a peer was lost in step {step + 1}; the group re-formed in {formed_s:.2f} s, "
                  f"training again from step {restored or 0} ({time.perf_counter() - t0:.2f} s)", flush=True)
        return restored or 0, checkpointer

    @staticmethod
    def lost_peer(error):
        """Whether a collective's error says a peer died or hung (gloo's and NCCL's words for it)."""
        return isinstance(error, RuntimeError) and any(phrase in str(error) for phrase in PEER_LOST)

    def abandon(self):
        """After a peer was lost: report it (the others hear of it at once through the abort, if no
        supervisor has said it yet; the supervisor fences a rank that reports none), and end every wait
        of this process on the generation's groups (end_generation), once a generation."""
        failed = self.gen
        if self.reported == failed:
            return
        try:
            for store in {id(s): s for s in (self.store, self.node_store)}.values():  # (etcd: this node's at once)
                store.compare_set(f"g{failed}/abort", "", f"rank {self.rank} saw a collective fail")
            self.store.set(f"g{failed}/lost/{self.rank}", str(os.getpid()))
            self.store.add(f"g{failed}/lost", 1)
        except dist.DistNetworkError:
            raise SystemExit(f"rank {self.rank}: the job's store (node 0's launcher, or etcd) is lost or out of "
                             "reach: leaving (this node's supervisor says what follows)") from None
        self.reported = failed
        end_generation(f"generation {failed}: rank {self.rank} saw a collective fail")

    def reform(self, device):
        """Once the generation is abandoned: drop its groups (their work has ended with them), wait for
        the supervisor's next generation and form it. Returns its number."""
        failed = self.gen
        leave = threading.Thread(target=dist.destroy_process_group, daemon=True)
        if dist.is_initialized():  # (on NCCL the abort dropped them already)
            leave.start()
            leave.join(self.timeout_s)
        if leave.is_alive():
            raise SystemExit(f"rank {self.rank}: the broken process group did not close: leaving for a restart")
        deadline = time.monotonic() + self.timeout_s + self.hang_timeout_s
        while self.newest() <= failed:  # the supervisor has not seen a death yet (a frozen peer: it fences one)
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {self.rank}: no replacement in {self.timeout_s + self.hang_timeout_s:.0f} s: "
                                 "leaving for a restart")
            time.sleep(self.poll_s)
        self.form(None, device)
        return self.gen


def settle(checkpointer, timeout_s):
    """A peer was lost and the generation's groups ended: the tiers' work in flight ends (their
    settle()), and so does the checkpointer's save in flight: committed whole before the loss, or left
    uncommitted (never loaded). Its collectives raised with the groups, FSDP's commit is refused once the
    generation is abandoned (common.dist.abandoned; DDP's is rank 0's file alone, of a step every rank
    finished); what remains is this rank's own writing of its files. One still running after `timeout_s` could commit or write later: this process leaves (the
    supervisor replaces it). FSDP's async staging buffers go too: the checkpointer rebuilt over the new
    group has its own."""
    checkpointer.each("settle")
    pending, checkpointer.pending = checkpointer.pending, None
    future = getattr(pending, "future", None)  # rank 0's write (DDP), every rank's (FSDP)
    if future is not None:
        done, _ = concurrent.futures.wait([future], timeout=timeout_s)
        if not done:
            raise SystemExit(f"rank {checkpointer.rank}: the save of step {pending.step} in flight when a peer was "
                             f"lost still runs after {timeout_s:.0f} s: leaving, so that it never commits late")
        error = future.exception()
        if error or checkpointer.rank == 0:
            print(f"rank {checkpointer.rank}: the save of step {pending.step} in flight when a peer was lost: "
                  + (f"not committed ({next((p for p in PEER_LOST if p in str(error)), str(error)[:120])}), never "
                     "loaded" if error else "committed"), flush=True)
    if getattr(checkpointer, "stager", None):  # (fsdp's)
        checkpointer.stager.close()


def regroup(checkpointer):
    """`checkpointer` over a re-formed process group (DDP: the model is whole on every rank): its tiers
    opened again over it (their regroup(checkpointer); None: off). Returns it."""
    tiers = [tier.regroup(checkpointer) if hasattr(tier, "regroup") else tier for tier in checkpointer.tiers]
    checkpointer.tiers = [tier for tier in tiers if tier is not None]
    return checkpointer


def warm_up(device):
    """A spare's or a replacement's start-up before it holds a rank: its device (a CUDA context) and torch's
    optimizer machinery (the first construction imports torch._dynamo, about as long as `import torch`)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))])

