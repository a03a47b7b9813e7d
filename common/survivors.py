"""The survivors tier: a dead rank is replaced alone, by a spare when one waits; the other ranks keep
their processes, their memory and their place, re-form the process group with the newcomer, and go on
from the newest step that every rank can restore (the memory tier). Imported only in this mode
(--survivors, --spares): delete this module and those lines of a script to go without it.

torchrun's agent stops all of its workers when one fails, and with its c10d rendezvous every node
restarts too. Here the launcher (harness/launch.py) runs a Supervisor on each node instead of torchrun:
one process per rank of the node plus --spares waiting ones, each restarted alone when it dies. Node
0's holds the job's store, which outlives every worker (on one node bound to the loopback; on several,
to the address of RDZV_ENDPOINT). The store holds:
    gen                 the generation: a supervisor adds one for each rank it finds dead
    vacancy/<n>         "<rank> <gen> <node>": the n-th rank left by a dead process, for a process of
                        that node, or of any ("any": its node was lost) (count: vacancies)
    claim/<n>           "<slot> <pid>": the process that took vacancy n (a slot: its place in the launch,
                        node * STRIDE + its place on the node, whatever the other nodes' --spares)
    g<gen>/member/<r>   rank r is ready to form generation gen; the group forms when all are
    g<gen>/lost/<r>     rank r saw a peer fail in generation gen (count: g<gen>/lost)
    node/<k>/...        node k's supervisor: its incarnation (one more each time it starts: a node that
                        comes back starts only spares), its beat (one more every 0.1 s), lost/<i> (who
                        gave away the ranks of its incarnation i: node 0, which found it silent, or the
                        node itself, come back), done (its processes have ended)
    end                 the job is over: spares leave (woken by a last vacancy/<n> that says "end")
Each generation's process group lives under its own prefix of the store, so no key of a failed one
is ever read again.

A survivor that sees a collective fail (Team.lost_peer) calls Team.reform: it destroys its group,
waits for the supervisor's next generation, forms it with the newcomer, and the script then restores
the newest step every rank holds, as a restart would, and redoes the steps after it. A frozen rank
never dies: the supervisor kills a process stopped for --hang-timeout-s, and, once a survivor has
reported a loss, whichever rank has not reported one within twice --hang-timeout-s (a fence: a stale
process can never come back), and replaces it. A node lost whole (its supervisor silent for
--hang-timeout-s once a survivor has reported a loss) leaves its ranks to spares of any node: node 0's
supervisor posts them; the lost node's own supervisor, if it was only cut off, kills its processes.
"""
import concurrent.futures
import contextlib
import ctypes
import datetime
import os
import signal
import socket
import subprocess
import threading
import time

STORE, SLOT, WORLD, SLOTS, GEN = "FT_STORE", "FT_SLOT", "FT_WORLD", "FT_SLOTS", "FT_GENERATION"
NPROC, FIRST_RANK = "FT_NPROC", "FT_RANK"  # ranks a node; the rank of a process of the first launch
BEAT_ROUNDS = 20  # a supervisor's beat (and its look for hangs) every 20 rounds of POLL_S
STRIDE = 1000  # slots of node k: k * STRIDE + 0, 1, ... (a node runs fewer processes)
POLL_S = 0.005  # how often a waiting process reads the store (one node: a few microseconds a read)
RETRIES = 3  # failures during one recovery before a survivor gives up its process (the supervisor replaces it)


def layout_problems(cfg, params):
    """[lines] on what keeps a --survivors job from starting: --spares alone, or more processes (ranks and
    spares) than this node has GPUs (--device cuda) or memory for (each holds the model, its gradients and
    AdamW's moments: 16 bytes a parameter, on the CPU)."""
    import torch
    if not cfg.survivors:
        return ["--spares needs --survivors"] if cfg.spares else []
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) + cfg.spares  # this node's
    if cfg.device == "cuda" and torch.cuda.device_count() < processes:
        return [f"--survivors --spares {cfg.spares}: {processes} processes need a GPU each, this node has "
                f"{torch.cuda.device_count()}"]
    need, free = processes * 16 * params, available_memory()
    if cfg.device != "cuda" and free is not None and need > free:
        return [f"--survivors --spares {cfg.spares}: {processes} processes need about {need / 2**30:.1f} GiB of "
                f"memory for the model's state, this node has {free / 2**30:.1f} GiB available"]
    return []


def available_memory():
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


# ----------------------------------------------------------------------------- a worker's side
def join(cfg):
    """(team, rank, world size, device) of this process in a --survivors job, once it holds a rank: a
    spare waits here; one still waiting when the job ends leaves here."""
    from common.dist import exit_without_finalizing
    team = Team(cfg.timeout_s, cfg.hang_timeout_s)
    joined = team.join(cfg.device)
    if joined is None:
        exit_without_finalizing()
    return (team, *joined)


class Team:
    """This process's place in the job: a rank it holds, or a spare's wait for one; the generations it
    forms with the others."""

    def __init__(self, timeout_s, hang_timeout_s):
        import torch.distributed as dist
        from common.config import fail
        if STORE not in os.environ:
            fail("--survivors runs under run.sh (python -m harness.launch), which supervises the processes")
        host, port = os.environ[STORE].rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self.slot, self.world, self.slots = int(os.environ[SLOT]), int(os.environ[WORLD]), int(os.environ[SLOTS])
        self.nproc = int(os.environ[NPROC])
        self.node, self.local_slot = divmod(self.slot, STRIDE)
        self.timeout_s, self.hang_timeout_s = timeout_s, hang_timeout_s
        self.rank, self.gen, self.seen = None, None, 0  # seen: the vacancies looked at

    def join(self, device_choice):
        """Take a rank (a spare waits here for one; the first launch's processes take theirs at once),
        form the generation, and set the environment the scripts read (RANK, WORLD_SIZE, ...). Returns
        (rank, world_size, device); None if the job ended while this process waited (a spare)."""
        from common.dist import keep_on_loopback, pick_device
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
        return self.rank, self.world, device

    def take_vacancy(self):
        """The rank of the oldest vacancy for this node (or any) that this slot wins, waiting for one; None
        once the job has ended."""
        import torch.distributed as dist
        while True:
            count = self.store.add("vacancies", 0)
            while self.seen < count:
                self.seen += 1
                rank, _, node = self.store.get(f"vacancy/{self.seen}").decode().split()
                if node not in (str(self.node), "any"):  # a rank of another node: its spares' or its restart's
                    continue
                me = f"{self.slot} {os.getpid()}"  # this process, not its slot: a restarted one is another
                if self.store.compare_set(f"claim/{self.seen}", "", me).decode() == me:
                    print(f"slot {self.slot} (pid {os.getpid()}): takes rank {rank}", flush=True)
                    return int(rank)
            if self.store.check(["end"]):
                return None
            with contextlib.suppress(dist.DistStoreError):  # the store answers when the key is set (the end sets it too)
                self.store.wait([f"vacancy/{self.seen + 1}"], datetime.timedelta(days=1))

    def form(self, gen, device):
        """Form generation `gen` (None: the newest) with every rank: say this rank is ready, wait until all
        are, then init_process_group over the generation's prefix of the store. A newer generation met
        while waiting, or a group that fails to form (a member died meanwhile), moves on to the next."""
        import torch.distributed as dist
        from common.dist import set_collective_timeout
        deadline = time.monotonic() + self.timeout_s
        gen = self.newest() if gen is None else gen
        while True:
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {self.rank}: no generation formed in {self.timeout_s} s: leaving for a restart")
            self.store.set(f"g{gen}/member/{self.rank}", str(os.getpid()))
            if not self.all_ready(gen, deadline):
                gen = self.newest()
                continue
            try:  # everyone is warm and waiting: a short timeout, so that a member's death here costs little
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                        store=dist.PrefixStore(f"g{gen}", self.store), rank=self.rank,
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
                    time.sleep(POLL_S)
                gen = self.newest()
        set_collective_timeout(self.timeout_s)  # the long timeout while the state is restored
        self.gen = gen
        os.environ[GEN] = str(gen)

    def all_ready(self, gen, deadline):
        """Wait until every rank is ready to form `gen`: True, or False once a newer one has begun."""
        while not self.store.check([f"g{gen}/member/{r}" for r in range(self.world)]):
            if self.newest() > gen or time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def newest(self):
        return self.store.add("gen", 0)

    def recover(self, checkpointer, device, step, rebuild=None, memory_tier=None):
        """A survivor's way back after a peer was lost at `step`: a save in flight settles (committed whole,
        or left uncommitted: never loaded), the group re-forms with the newcomer (reform), what belonged to
        the old group is made again over the new one (FSDP: `rebuild()`, the sharded model, its optimizer,
        tier and checkpointer; DDP: the memory tier, `memory_tier()`), and every
        rank restores the newest step all of them hold (the memory tier, else the disk), as the newcomer
        does at its start: the same collectives in the same order. Returns (the step restored, the checkpointer)."""
        from common.dist import set_collective_timeout
        t0, lost_at = time.perf_counter(), time.time()
        snapshots = checkpointer.snapshots
        if snapshots and snapshots.copying is not None:  # a copy in flight ends (whole, or not recorded); one
            with contextlib.suppress(Exception):  # cut short by the lost peer (a replica's exchange) is not news:
                snapshots.copying.result()  # the tier is opened again over the new group below
            snapshots.copying = None
        if snapshots:
            snapshots.pool.shutdown()
        pending, checkpointer.pending = checkpointer.pending, None
        future = getattr(pending, "future", None)  # rank 0's write (DDP), every rank's (FSDP)
        if future is not None:  # its collectives fail with the group, its commit is atomic
            done, _ = concurrent.futures.wait([future], timeout=self.timeout_s)
            error = future.exception() if done else TimeoutError(f"still running after {self.timeout_s} s")
            if error or self.rank == 0:
                print(f"rank {self.rank}: the save of step {pending.step} in flight when a peer was lost: "
                      + (f"not committed ({str(error)[:120]}), never loaded" if error else "committed"), flush=True)
        if rebuild and getattr(checkpointer, "stager", None):  # FSDP's async staging buffers: the new one has its own
            checkpointer.stager.close()
        for attempt in range(1, RETRIES + 1):
            try:
                gen = self.reform(device)
                formed_s = time.perf_counter() - t0
                if rebuild:
                    checkpointer = rebuild()
                elif snapshots:
                    checkpointer.snapshots = memory_tier()
                restored = checkpointer.load_from_memory() if checkpointer.snapshots else None
                restored = checkpointer.load() if restored is None else restored
                break
            except RuntimeError as error:
                if not self.lost_peer(error):
                    raise
                print(f"rank {self.rank}: another peer was lost while generation {self.gen} formed or restored "
                      f"(attempt {attempt} of {RETRIES})", flush=True)
        else:
            raise SystemExit(f"rank {self.rank}: more than {RETRIES} failures in one recovery: leaving for a restart")
        set_collective_timeout(checkpointer.guard.step_timeout_s)
        checkpointer.monitor.event("recovered", step=restored, lost_step=step, generation=gen, lost_at=lost_at,
                                   formed_s=formed_s, recover_s=time.perf_counter() - t0, pid=os.getpid())
        if self.rank == 0:
            print(f"generation {gen}: a peer was lost in step {step + 1}; the group re-formed in {formed_s:.2f} s, "
                  f"training again from step {restored or 0} ({time.perf_counter() - t0:.2f} s)", flush=True)
        return restored or 0, checkpointer

    @staticmethod
    def lost_peer(error):
        """Whether a collective's error says a peer died or hung (gloo's and NCCL's words for it)."""
        from common.dist import PEER_LOST
        return isinstance(error, RuntimeError) and any(phrase in str(error) for phrase in PEER_LOST)

    def reform(self, device):
        """After a peer was lost: leave the broken group, report the loss (the supervisor fences a rank
        that reports none), wait for the supervisor's next generation and form it. Returns its number."""
        import torch.distributed as dist
        failed = self.gen
        try:
            self.store.set(f"g{failed}/lost/{self.rank}", str(os.getpid()))
            self.store.add(f"g{failed}/lost", 1)
        except dist.DistNetworkError:
            raise SystemExit(f"rank {self.rank}: the job's store (node 0's launcher) is lost: leaving; the job "
                             "restarts whole") from None
        leave = threading.Thread(target=dist.destroy_process_group, daemon=True)  # the failed op has ended
        if dist.is_initialized():
            leave.start()
            leave.join(self.timeout_s)
        if leave.is_alive():
            raise SystemExit(f"rank {self.rank}: the broken process group did not close: leaving for a restart")
        deadline = time.monotonic() + self.timeout_s + self.hang_timeout_s
        while self.newest() <= failed:  # the supervisor has not seen a death yet (a frozen peer: it fences one)
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {self.rank}: no replacement in {self.timeout_s + self.hang_timeout_s:.0f} s: "
                                 "leaving for a restart")
            time.sleep(POLL_S)
        self.form(None, device)
        return self.gen


def warm_up(device):
    """A spare's or a replacement's start-up before it holds a rank: its device (a CUDA context) and torch's
    optimizer machinery (the first construction imports torch._dynamo, about as long as `import torch`)."""
    import torch
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))])


# ----------------------------------------------------------------------------- the node's side
def serve_store(host, port=0, timeout_s=300):
    """(store, port): the job's store, served by this process from a socket bound to `host`'s address
    only (127.0.0.1 for a job on one node), on `port` (0: a free one)."""
    import torch.distributed as dist
    family, kind, proto, _, address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(64)
    port = listener.getsockname()[1]
    store = dist.TCPStore(address[0], port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          master_listen_fd=listener.detach(), wait_for_workers=False)
    return store, port


def _die_with_parent():
    """In a worker, before exec: the kernel SIGKILLs it when the supervisor dies (no orphan trains on)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StoreLost(Exception):
    """The job's store, on node 0, stopped answering: that node's launcher is gone."""


class Supervisor:
    """The processes of one node of a job in this mode (see the module's docstring), and on node 0 the
    job's store.

    `cmd` runs the script; `nproc` ranks a node on `nnodes` nodes (this one `node`; `endpoint` host:port
    of node 0's store when there are several) and `spares` waiting processes, each restarted up to
    `max_restarts` times; a process stopped for `fence_s`, or a rank that reports no loss within twice
    that of a peer's report, is SIGKILLed (fenced) and replaced; node 0 gives away the ranks of a node
    silent for `fence_s` after a report. run() returns this node's exit status."""

    def __init__(self, cmd, env, nproc, spares, max_restarts, fence_s, stop_file, node=0, nnodes=1, endpoint=None):
        import torch.distributed as dist
        self.cmd, self.env, self.nproc, self.world, self.slots = cmd, env, nproc, nproc * nnodes, nproc + spares
        self.node, self.nnodes = node, nnodes
        self.max_restarts, self.fence_s, self.stop_file = max_restarts, fence_s, stop_file
        host, port = endpoint.rsplit(":", 1) if endpoint else ("127.0.0.1", 0)
        if node == 0:
            self.store, port = serve_store(host, int(port))
            self.store.add("gen", 0)
            self.store.add("vacancies", 0)
        else:  # node 0's store: its launcher may still be starting (the client retries until the timeout)
            self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=300))
        self.address = f"{host}:{port}"
        self.incarnation = self.store.add(f"node/{node}/incarnation", 1)
        self.own = range(node * STRIDE, node * STRIDE + self.slots)  # this node's slots, in the job's numbering
        self.procs, self.restarts = {}, dict.fromkeys(self.own, 0)
        self.ended = False
        self.cut_off = False  # this node lost the store, or was given up as lost: it must not end the job
        self.signalled = []
        self.watch = None  # (the current generation, when it was first seen)
        self.stopped_since = {}  # slot -> when its process was first seen stopped
        self.beats = {}  # node 0: node -> (its incarnation, its beat, when that beat was first seen)

    def start(self, slot):
        # One thread a process for several ranks unless the user says otherwise, as torchrun sets it (the
        # same sums, bitwise; a rank alone keeps torch's threads, as under torchrun).
        threads = {"OMP_NUM_THREADS": "1"} if self.world > 1 else {}
        local = slot - self.own.start
        first = local < self.nproc and self.restarts[slot] == 0 and self.incarnation == 1
        env = {**threads, **self.env, STORE: self.address, SLOT: str(slot), WORLD: str(self.world),
               SLOTS: str(self.slots), NPROC: str(self.nproc), "TORCHELASTIC_RESTART_COUNT": str(self.restarts[slot]),
               "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
               **({FIRST_RANK: str(self.node * self.nproc + local)} if first else {})}
        self.procs[slot] = subprocess.Popen(self.cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def owners(self):
        """{rank: the slot that holds it now (None: no process yet)}: the first launch's, then each
        vacancy's claimant."""
        owner = {r: r // self.nproc * STRIDE + r % self.nproc for r in range(self.world)}
        for n in range(1, self.store.add("vacancies", 0) + 1):
            rank = int(self.store.get(f"vacancy/{n}").decode().split()[0])
            owner[rank] = int(self.store.get(f"claim/{n}").split()[0]) if self.store.check([f"claim/{n}"]) else None
        return owner

    def holder(self, slot):
        """The rank `slot` holds now (None: a spare's slot, or a lost node's)."""
        return next((r for r, s in self.owners().items() if s == slot), None)

    def slot_of(self, rank):
        """This node's slot that holds `rank` (None: another node's, or none)."""
        return next((s for s in self.own if self.holder(s) == rank), None)

    def stopped(self, slot):
        """Whether the process of `slot` is stopped (SIGSTOP: state T in /proc; not a debugger's stop, t)."""
        try:
            with open(f"/proc/{self.procs[slot].pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError, TypeError, KeyError):
            return False

    def vacate(self, slots, why, node=None):
        """The processes of `slots` are gone: the ranks they held go to the next generation's newcomers,
        of this node (a spare, or a restart), or of any node (`node` "any": a node lost). One generation
        for them all: the group re-forms once."""
        ranks = {slot: rank for rank, slot in self.owners().items() if slot in slots}
        if not ranks:
            return
        gen = self.store.add("gen", 1)
        for slot, rank in ranks.items():
            n = self.store.add("vacancies", 1)
            self.store.set(f"vacancy/{n}", f"{rank} {gen} {node or self.node}")
            print(f"supervisor: rank {rank} (slot {slot}) {why}: generation {gen}, its place to the next process "
                  f"{'of any node ' if node == 'any' else ''}to take it", flush=True)

    def fence(self):
        """Kill (fence) the processes that hold the job up for fence_s, so that the supervisor replaces
        them: one stopped (SIGSTOP) that long, whatever its peers wait in (a save waits --timeout-s); and,
        once a survivor has reported a loss and no process died for 2 fence_s, the ranks of this node
        that reported none (frozen otherwise: a deadlock). Node 0 also gives away the ranks of a node found silent."""
        gen, now = self.store.add("gen", 0), time.monotonic()
        for slot in self.own:
            if not self.stopped(slot):
                self.stopped_since.pop(slot, None)
            elif now - self.stopped_since.setdefault(slot, now) >= self.fence_s:
                self.kill(slot, f"stopped for {self.fence_s:.0f} s")
                self.stopped_since.pop(slot)
        if self.node == 0:
            self.find_lost_nodes(gen, now)
        if self.store.add(f"g{gen}/lost", 0) == 0:
            return
        if self.watch is None or self.watch[0] != gen:  # the first report of a loss in this generation
            self.watch = (gen, now)
            return
        # A rank in a collective that began before the loss reports it within fence_s (its timeout, once
        # training runs): one silent twice that long is frozen otherwise.
        if now - self.watch[1] < 2 * self.fence_s:
            return
        for rank in (r for r in range(self.world) if not self.store.check([f"g{gen}/lost/{r}"])):
            slot = self.slot_of(rank)
            if slot is not None:
                self.kill(slot, f"held up generation {gen} for {2 * self.fence_s:.0f} s")
        self.watch = (gen, now)  # the kill is seen as a death on the next round

    def find_lost_nodes(self, gen, now):
        """Node 0: a node whose supervisor has not beaten for fence_s while a survivor reports a loss is
        lost whole (its processes die with their supervisor): its ranks go to spares of any node. Its
        supervisor, if it was only cut off, fences its own processes when it reads that it was lost."""
        for node in range(1, self.nnodes):
            seen = (self.store.add(f"node/{node}/incarnation", 0), self.store.add(f"node/{node}/beat", 0))
            if self.beats.get(node, (None, None))[:2] != seen:
                self.beats[node] = (*seen, now)
            elif now - self.beats[node][2] >= self.fence_s and self.store.add(f"g{gen}/lost", 0) > 0:
                self.give_away(node, seen[0], f"silent for {self.fence_s:.0f} s")

    def kill(self, slot, why):
        """Fence the process of `slot`: SIGKILL, which a stopped process obeys too; its death is replaced."""
        if self.procs[slot].poll() is None:
            rank = self.holder(slot)
            print(f"supervisor: {f'rank {rank}' if rank is not None else 'a spare'} (slot {slot}) {why}: frozen, "
                  "killed (fenced)", flush=True)
            self.procs[slot].kill()

    def end(self):
        """Say the job is over, and wake the spares that wait for the next vacancy (Team.take_vacancy)."""
        self.store.set("end", "1")
        self.store.set(f"vacancy/{self.store.add('vacancies', 0) + 1}", "end")

    def beat(self):
        """Say this node lives; raise StoreLost if node 0 is gone, and SystemExit if node 0 found this node
        silent and gave its ranks away (its processes are then stale: they are killed)."""
        import torch.distributed as dist
        try:
            self.store.add(f"node/{self.node}/beat", 1)
            lost = self.store.check([f"node/{self.node}/lost/{self.incarnation}"])
        except (RuntimeError, dist.DistError) as e:
            self.cut_off = True
            raise StoreLost(str(e).strip()[:100]) from None
        if lost:
            self.cut_off = True
            self.kill_all()
            raise SystemExit(f"supervisor: node {self.node} was silent for {self.fence_s:.0f} s and its ranks were "
                             "given to others: its processes killed (fenced); start it again to add its spares")

    def kill_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def give_away(self, node, incarnation, why):
        """The ranks that node `node` held in its `incarnation` go to processes of any node, once: whoever
        says so first (node 0, finding it silent; the node, come back) posts the vacancies."""
        me = f"node {self.node}"
        if self.store.compare_set(f"node/{node}/lost/{incarnation}", "", me).decode() != me:
            return
        self.vacate(range(node * STRIDE, (node + 1) * STRIDE), f"lost with node {node} ({why})", node="any")

    def run(self):
        if self.incarnation > 1:  # the node came back: its ranks went, or go now, to others; it starts spares
            self.give_away(self.node, self.incarnation - 1, "started again")
        for slot in self.own:
            self.start(slot)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(number, self.pass_on)
        code, rounds = None, 0
        try:
            while code is None:
                rounds += 1
                if rounds % BEAT_ROUNDS == 0 and self.nnodes > 1:
                    self.beat()
                code = self.round(fence=rounds % BEAT_ROUNDS == 0)  # deaths every 5 ms, hangs every 0.1 s
                time.sleep(POLL_S)
        except StoreLost as e:
            print(f"supervisor: node {self.node} lost the job's store on node 0 ({e}): this node's processes "
                  "killed; the job restarts whole (run it again: it resumes from memory or disk)", flush=True)
            self.kill_all()
            return 1
        finally:  # spares leave at the end; whatever still runs after a while is killed
            if not self.cut_off:
                self.end()
            for proc in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10 if self.ended else 0)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    code = code or 1
            self.leave()
        return code

    def leave(self):
        """Several nodes: say this node is done; node 0, whose process holds the store, waits for the
        others' (not for a node it found lost) before it goes, as their spares still read the store."""
        if self.nnodes == 1 or self.cut_off:
            return
        with contextlib.suppress(RuntimeError):  # node 0's store gone meanwhile: nothing to say
            self.store.set(f"node/{self.node}/done", "1")
            deadline = time.monotonic() + 60
            others = list(range(1, self.nnodes)) if self.node == 0 else []
            while others and time.monotonic() < deadline:
                others = [k for k in others if not self.store.check([f"node/{k}/done"]) and not self.store.check(
                    [f"node/{k}/lost/{self.store.add(f'node/{k}/incarnation', 0)}"])]
                time.sleep(0.1)

    def round(self, fence):
        """One look at the processes: None while the job runs, else its exit status. A process that ends
        with 0 (done, or a stop: its code in the stop file) or 143 (preempted), or any after a signal,
        ends the job; any other is replaced alone."""
        ended = False
        for slot, proc in self.procs.items():
            status = proc.poll()
            if status is None:
                continue
            if status in (0, 143) or self.signalled or os.path.exists(self.stop_file):
                ended = True
                continue
            if self.restarts[slot] >= self.max_restarts:
                print(f"supervisor: slot {slot} failed {self.restarts[slot] + 1} times (exit {status}): "
                      "ending the job", flush=True)
                return 1
            self.vacate([slot], f"died (exit {status})" if status > 0 else f"killed by signal {-status}")
            self.restarts[slot] += 1
            self.start(slot)
        if ended:
            self.ended = True
            self.end()
            for proc in self.procs.values():  # the others finish as they will; spares leave on "end"
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(60, self.fence_s * 4))
            statuses = [p.poll() for p in self.procs.values()]
            return next((1 if s is None else s for s in statuses if s != 0), 0)  # None: still running, killed
        if fence:
            self.fence()
        return None

    def pass_on(self, number, _):
        self.signalled.append(number)
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(number)
