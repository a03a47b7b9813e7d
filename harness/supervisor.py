"""The survivors' supervisor, one a node (the launcher's side of tiers/survivors.py, whose docstring gives the
store's keys): the node's processes, each started again alone when it dies, a fence for a frozen one, the beats
of the nodes, and on node 0 the job's store; or, with etcd (tiers/etcd.py), the node's lease there, its own
store for its ranks' beats and for the process groups of the generations it begins, and, on the node elected
leader, what node 0 does otherwise. Runs in the launcher (harness/launch.py), never in a worker."""
import contextlib
import datetime
import math
import os
import signal
import socket
import subprocess
import threading
import time

from harness.procs import dies_with_parent
from harness.warm import FAULT as WARM_FAULT, READY_S, Forked, WarmParent
from common.dist import PREEMPTED
from tiers.survivors import (FIRST_RANK, NCCL_SETTINGS, NETNS, NODE_STORE, NPROC, POLL_S, SLOT, SLOTS, STOP, STORE,
                             STRIDE, WORLD, claim_of, in_network_namespace, vacancy_of)

SIGNALLED_S = 2.0  # after a signal, an etcd call's deadline (tiers/etcd.py's DEADLINE_S otherwise)
BEAT_ROUNDS = 20  # a supervisor's beat (and its look for hangs) every 20 rounds of POLL_S
STOPPED_FLOOR_S, STOPPED_STEPS = 1.0, 20  # a stopped rank is fenced after 20 of its steps, at least 1 s
STORE_LOST_S = 30  # a node whose beat has not reached the store for this long (at least 4 fence_s) leaves the job
LEASE_FLOOR_S = 5  # etcd: a node's lease lives at least this long (fence_s if longer): an etcd election takes 1-2 s
KEEP_S = 0.5  # etcd: how often a node renews its lease
ELECT_ROUNDS = 5  # etcd: a node that does not lead looks for a vacant leadership every 5 beats


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


class StoreLost(Exception):
    """The job's store, on node 0, stopped answering: that node's launcher is gone (or, with etcd, no member
    of a majority answers this node)."""


def address_towards(host, port):
    """This machine's address on the route to host:port (a UDP socket's, connected: nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class Supervisor:
    """The processes of one node of a job in this mode (see the module's docstring), and on node 0 the
    job's store.

    `cmd` runs the script; `nproc` ranks a node on `nnodes` nodes (this one `node`; `endpoint` host:port
    of node 0's store when there are several) and `spares` waiting processes, each restarted up to
    `max_restarts` times; a process stopped for 20 of its steps (at most `fence_s`), or a rank that
    reports no loss within twice `fence_s` of a peer's report, is SIGKILLed (fenced) and replaced; node 0 gives away the ranks of a node
    silent for `fence_s` after a report. run() returns this node's exit status."""

    def __init__(self, cmd, env, nproc, spares, max_restarts, fence_s, stop_file, node=0, nnodes=1, endpoint=None,
                 etcd=None):
        self.cmd, self.env, self.nproc, self.world, self.slots = cmd, env, nproc, nproc * nnodes, nproc + spares
        self.node, self.nnodes = node, nnodes
        self.max_restarts, self.fence_s, self.stop_file = max_restarts, fence_s, stop_file
        self.etcd, self.leader = etcd, node == 0 and etcd is None  # etcd: ([(host, port)], its key prefix)
        self.netns, self.exposed = None, None  # the store's private network namespace (an fd); or why not
        if etcd:
            self.join_etcd(*etcd)
        else:
            self.serve_or_reach(endpoint)
        self.own = range(node * STRIDE, node * STRIDE + self.slots)  # this node's slots, in the job's numbering
        self.procs, self.restarts = {}, dict.fromkeys(self.own, 0)
        self.retired = set()  # the slots of spares that used up their restarts: never started again
        self.ended = False
        self.cut_off = False  # this node lost the store, or was given up as lost: it must not end the job
        self.signalled = []
        self.watch = None  # (the current generation, when it was first seen)
        self.stopped_since = {}  # slot -> when its process was first seen stopped
        self.beats = {}  # node 0: node -> (its incarnation, its beat, when that beat was first seen)
        self.joining = {}  # (rank, slot, pid) of a newcomer of this node not yet in a generation -> since when
        self.joined = set()  # the (rank, slot, pid) seen in one
        self.forming = None  # (the generation being formed, when its first member was seen)
        self.ignored = set()  # the store's keys whose values are not this job's (each said once)
        self.settled = {}  # n -> (vacancy n, its claim), both read and valid: neither changes again
        self.bogus = {}  # rank -> its vacancy's node, for the ranks claimed by no process of the job (owners)
        self.claims = {}  # rank -> (its vacancy's generation, slot, pid) of this node's newcomers (owners)
        self.first_launch, self.warm_restarts = True, 0
        self.warm = self.start_warm()  # forks the node's processes once it has imported what they import

    def serve_or_reach(self, endpoint):
        """The job's store without etcd: served here on node 0 (at RDZV_ENDPOINT on several nodes), reached
        there from the other nodes; this node's incarnation counted in it."""
        import torch.distributed as dist
        host, port = endpoint.rsplit(":", 1) if endpoint else ("127.0.0.1", 0)
        if self.node == 0 and self.nnodes == 1:  # only the job's processes reach it: they inherit the namespace's fd
            try:
                (self.store, port), self.netns = in_network_namespace(lambda: serve_store(host))
            except OSError as e:
                self.exposed = f"{e.strerror}: a network namespace of its own needs root"
        if self.node == 0 and self.netns is None:
            self.store, port = serve_store(host, int(port))
        if self.node == 0:
            self.store.add("gen", 0)
            self.store.add("vacancies", 0)
        else:  # node 0's store: its launcher may still be starting (the client retries until the timeout)
            print(f"supervisor: node {self.node} waits up to 300 s for node 0's store at {host}:{port}", flush=True)
            try:
                self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=300))
            except (RuntimeError, dist.DistError) as e:
                raise SystemExit(f"supervisor: node 0's store at {host}:{port} did not answer in 300 s "
                                 f"({str(e).strip()[:80]}): start node 0, then this node again") from None
        self.node_store, self.address = self.store, f"{host}:{port}"
        self.incarnation = self.store.add(f"node/{self.node}/incarnation", 1)

    def join_etcd(self, endpoints, prefix):
        """The job's store in etcd (tiers/etcd.py): this node's incarnation counted and its lease granted
        there, and its own store served on its address towards etcd, for its ranks' beats and relayed
        aborts and for the process group of each generation it begins."""
        import torch.distributed as dist
        from tiers.etcd import EtcdStore
        self.store, self.ttl_s = EtcdStore(endpoints, prefix), max(LEASE_FLOOR_S, math.ceil(self.fence_s))
        try:
            if self.store.check(["end"]):
                print(f"supervisor: a job with this RDZV_ID ({prefix}) has ended in etcd already: give each launch "
                      "an RDZV_ID of its own (Slurm: $SLURM_JOB_ID.$SLURM_RESTART_COUNT)", flush=True)
                raise SystemExit(2)
            self.lease = self.store.grant(self.ttl_s)
            self.lease_sent = time.monotonic()
            threading.Thread(target=self.keep_lease, name="keep-lease", daemon=True).start()
            self.incarnation = self.store.count_up(f"node/{self.node}/incarnation",
                                                   lambda i: [(f"node/{self.node}/alive/{i}", "1", self.lease)])
        except dist.DistNetworkError as e:
            raise SystemExit(f"supervisor: node {self.node}: {e}: start etcd's members, or check ETCD_ENDPOINTS") from None
        host = address_towards(*endpoints[0])
        self.node_store, port = serve_store(host)
        self.address, self.relayed = f"{host}:{port}", 0  # relayed: the oldest generation whose abort is not yet here
        self.store.compare_set("g0/store", "", self.address)  # the first generation meets at the first node's

    def keep_lease(self):
        """etcd: renew this node's lease every KEEP_S (its own client). A lease that lapsed, or no answer
        for its life since the last renewal sent, ends the node (watch_store)."""
        from tiers.etcd import EtcdStore
        store = EtcdStore(*self.etcd, deadline_s=self.ttl_s)
        while True:
            sent = time.monotonic()
            try:
                if store.keep_alive(self.lease) <= 0:
                    self.lease_sent = -math.inf  # lapsed: watch_store ends the node now
                    return
                self.lease_sent = sent
            except RuntimeError:  # (DistNetworkError) watch_store ends the node once the lease's life has passed
                pass
            time.sleep(max(0.0, KEEP_S - (time.monotonic() - sent)))

    def environment(self, slot=None):
        """The environment of the process of `slot`; without one, what the node's processes share (the
        warm parent's)."""
        # One thread a process for several ranks unless the user says otherwise, as torchrun sets it (the
        # same sums, bitwise; a rank alone keeps torch's threads, as under torchrun).
        threads = {"OMP_NUM_THREADS": "1"} if self.world > 1 else {}
        threads.update(NCCL_SETTINGS)  # the user's own settings win
        from tiers.etcd import JOB
        env = {**threads, **self.env, STORE: self.address, WORLD: str(self.world),
               **({NETNS: str(self.netns)} if self.netns is not None else {}),
               **({JOB: f"{self.etcd[1]} {','.join(f'{h}:{p}' for h, p in self.etcd[0])}", NODE_STORE: self.address}
                  if self.etcd else {}),
               SLOTS: str(self.slots), NPROC: str(self.nproc), "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts)}
        if slot is None:
            return env
        local = slot - self.own.start
        first = local < self.nproc and self.restarts[slot] == 0 and self.incarnation == 1
        return {**env, SLOT: str(slot), "TORCHELASTIC_RESTART_COUNT": str(self.restarts[slot]),
                **({FIRST_RANK: str(self.node * self.nproc + local)} if first else {})}

    def start(self, slot):
        """Start the process of `slot`: forked by the warm parent once it is ready (the first launch waits
        for it), else a fresh interpreter."""
        env = self.environment(slot)
        warm = self.warm is not None and self.warm.ready(READY_S if self.first_launch else 0)
        if self.warm is not None and not warm and self.first_launch:
            self.warm_lost(f"was not ready in {READY_S} s" if self.warm.loaded is None else "ended as it loaded")
        if warm:
            proc = self.warm.fork(env)
            if isinstance(proc, Forked):
                self.procs[slot] = proc
                return
            self.warm_lost(f"could not fork ({proc})")
        # SIGKILLed by the kernel if the supervisor dies: no orphan trains on.
        self.procs[slot] = subprocess.Popen(dies_with_parent(self.cmd, signal.SIGKILL), env=env, start_new_session=True,
                                            pass_fds=() if self.netns is None else (self.netns,))

    def start_warm(self):
        """A new warm parent (harness/warm.py), or None (said in one line) where there can be none."""
        env = self.environment()
        if self.warm_restarts:
            env.pop(WARM_FAULT, None)  # a fault fires once
        try:
            return WarmParent(self.cmd, env, pass_fds=() if self.netns is None else (self.netns,))
        except OSError as e:
            print(f"supervisor: no warm parent ({e.strerror}): every process starts as a fresh interpreter", flush=True)
            return None

    def warm_lost(self, why):
        """The warm parent is gone or useless: a new one, unless it never got ready or has been replaced
        max_restarts times; meanwhile every new process starts as a fresh interpreter."""
        was_ready = bool(self.warm.loaded)
        self.warm.close()
        again = was_ready and self.warm_restarts < self.max_restarts and not self.signalled
        print(f"supervisor: the warm parent (pid {self.warm.proc.pid}) {why}: new processes start as fresh "
              f"interpreters {'until another is ready' if again else 'from now on'}", flush=True)
        self.warm = None
        if again:
            self.warm_restarts += 1
            self.warm = self.start_warm()

    def owners(self):
        """{rank: the slot that holds it now (None: no process yet)}: the first launch's, then each
        vacancy's claimant. The store takes any client's word, so a value that is not this job's is
        ignored (said once): a vacancy that is no vacancy, a claim that names no slot; and a claim of one
        of this node's slots by a pid that is not the slot's process, or of a slot this node does not
        run, leaves its rank to nobody (self.bogus: the fence posts it again)."""
        owner = {r: r // self.nproc * STRIDE + r % self.nproc for r in range(self.world)}
        last = {}  # rank -> (its newest vacancy, that vacancy's claim)
        for n in range(1, self.store.add("vacancies", 0) + 1):
            if n in self.settled:  # a vacancy and its claim, both the job's, never change: read once
                vacancy, claim = self.settled[n]
                last[vacancy[0]], owner[vacancy[0]] = (n, vacancy, claim), claim[0]
                continue
            if not self.store.check([f"vacancy/{n}"]):  # counted, not yet written (a supervisor writes it next)
                continue
            vacancy = vacancy_of(self.store.get(f"vacancy/{n}"), self.world, self.nnodes)
            if vacancy is None:
                self.ignore(f"vacancy/{n}")
                continue
            claim = claim_of(self.store.get(f"claim/{n}"), self.nnodes) if self.store.check([f"claim/{n}"]) else ()
            if claim:
                self.settled[n] = (vacancy, claim)
            if claim is None:
                self.ignore(f"claim/{n}")
            last[vacancy[0]] = (n, vacancy, claim)
            owner[vacancy[0]] = claim[0] if claim else None
        self.bogus, self.claims = {}, {}
        for rank, (n, vacancy, claim) in last.items():
            # (a slot not started yet in this incarnation is not judged: a node come back gives its ranks away)
            theirs = bool(claim) and claim[0] // STRIDE == self.node and (claim[0] not in self.own or (
                claim[0] in self.procs and claim[1] != self.procs[claim[0]].pid))
            if theirs or claim is None and self.leader:
                self.ignore(f"claim/{n}")
                self.bogus[rank] = vacancy[2]
                owner[rank] = None
            elif claim and claim[0] in self.own:
                self.claims[rank] = (vacancy[1], *claim)  # this node's newcomers: (their vacancy's generation, slot, pid)
        return owner

    def ignore(self, key):
        if key not in self.ignored:
            self.ignored.add(key)
            print(f"supervisor: {key} in the job's store is not this job's: ignored", flush=True)

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
        self.post({rank: (f"slot {slot}", node or self.node) for rank, slot in self.owners().items() if slot in slots},
                  why)

    def post(self, ranks, why):
        """Post `ranks` ({rank: (who held it, the node its newcomer is of: a number or "any")}) as vacancies
        of one new generation."""
        if not ranks:
            return
        # Every survivor's watcher hears it now (tiers/survivors.py, Team.watch), not only the dead rank's neighbours.
        failed = self.store.add("gen", 0)
        for store in {id(s): s for s in (self.store, self.node_store)}.values():  # (etcd: here too, at once)
            store.compare_set(f"g{failed}/abort", "", f"rank {min(ranks)} {why}")
        gen = self.next_generation()
        for rank, (held, node) in ranks.items():
            n = self.store.add("vacancies", 1)
            self.store.set(f"vacancy/{n}", f"{rank} {gen} {node}")
            print(f"supervisor: rank {rank} ({held}) {why}: generation {gen}, its place to the next process "
                  f"{'of any node ' if node == 'any' else ''}to take it", flush=True)

    def next_generation(self):
        """Begin the next generation: with etcd, its process group to meet at this node's store."""
        return self.store.next_generation(self.address) if self.etcd else self.store.add("gen", 1)

    def relay(self, gen):
        """etcd: the aborts of the generations up to `gen`, copied from etcd into this node's store, where
        its ranks' watchers wait (one read a beat for the node, not one a rank)."""
        while self.relayed <= gen and self.store.check([f"g{self.relayed}/abort"]):
            self.node_store.compare_set(f"g{self.relayed}/abort", "", self.store.get(f"g{self.relayed}/abort").decode())
            self.relayed += 1

    def elect(self, rounds):
        """etcd: take the leadership if nobody holds it (a key held by this node's lease); once held, until
        the lease lapses, which ends the node."""
        if self.leader or rounds % (BEAT_ROUNDS * ELECT_ROUNDS):
            return
        if self.store.create("leader", str(self.node), lease=self.lease):
            self.leader = True
            print(f"supervisor: node {self.node} leads the job (etcd): it gives lost nodes' ranks away", flush=True)

    def fence(self):
        """Kill (fence) the processes that hold the job up, so that the supervisor replaces them: one
        stopped (SIGSTOP) for stop_bound(), whatever its peers wait in; and, once a survivor has reported
        a loss and no process died for 2 fence_s, the ranks of this node that reported none (frozen
        otherwise: a deadlock); and those that did not join a generation others joined (join_deadline).
        A rank claimed by no process of the job is posted again. Node 0 also gives away the ranks of a
        node found silent, and starts the next generation when every rank reported a loss and none died
        (a false alarm)."""
        gen, now = self.store.add("gen", 0), time.monotonic()
        if self.etcd:
            self.relay(gen)
        for slot in self.own:
            if not self.stopped(slot):
                self.stopped_since.pop(slot, None)
            elif now - self.stopped_since.setdefault(slot, now) >= (bound := self.stop_bound(slot)):
                self.kill(slot, f"stopped for {bound:.1f} s")
                self.stopped_since.pop(slot)
        if self.leader:
            self.find_lost_nodes(gen, now)
        self.owners()
        if self.bogus:  # claimed in the store by no process of the job: nobody would ever take them
            self.post({rank: ("claimed by no process of the job", node) for rank, node in self.bogus.items()},
                      "posted again")
            return
        self.join_deadline(gen, now)
        self.survivor_deadline(gen, now)
        reports = self.store.add(f"g{gen}/lost", 0)
        if reports == 0:
            return
        if reports >= self.world and self.leader:  # every rank alive and reporting: nobody to replace
            if self.store.compare_set(f"g{gen}/next", "", "same").decode() == "same":
                self.next_generation()
                print(f"supervisor: generation {gen} failed with no process lost (a false alarm: a slow link, a "
                      f"pause): the same processes form generation {gen + 1}", flush=True)
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

    def join_deadline(self, gen, now):
        """A newcomer of this node that claimed a rank (a vacancy of generation v) and has joined no
        generation since (g<k>/member/<rank> with its pid, v <= k <= gen) within 2 fence_s of its claim
        being seen is fenced, whatever its state (frozen after its claim, not stopped), and replaced.
        Survivors are not timed here: one may be finishing a save (Team.recover: settle)."""
        for rank, (since, slot, pid) in self.claims.items():
            key = (rank, slot, pid)
            if key in self.joined:
                continue
            if any(self.store.check([f"g{k}/member/{rank}"]) and self.store.get(f"g{k}/member/{rank}").decode()
                   == str(pid) for k in range(since, gen + 1)):
                self.joined.add(key)
                self.joining.pop(key, None)
            elif now - self.joining.setdefault(key, now) >= 2 * self.fence_s:
                self.kill(slot, f"did not join generation {gen} in {2 * self.fence_s:.0f} s of its claim")
                self.joining.pop(key)

    def survivor_deadline(self, gen, now):
        """A survivor of this node (a rank this node's process held before generation `gen`, not a
        newcomer: join_deadline) that has not joined `gen` within 2 fence_s of the first rank that did is
        fenced, and replaced: it is stuck in a wait that ending the groups did not end (its own writing
        of a save to a disk that hangs, say), and reports nothing."""
        members = [f"g{gen}/member/{r}" for r in range(self.world)]
        if gen == 0 or self.store.check(members) or not any(self.store.check([key]) for key in members):
            return
        if self.forming is None or self.forming[0] != gen:
            self.forming = (gen, now)
        if now - self.forming[1] < 2 * self.fence_s:
            return
        newcomers = {rank for rank, (_, slot, pid) in self.claims.items() if (rank, slot, pid) not in self.joined}
        for rank in (r for r in range(self.world) if r not in newcomers and not self.store.check([members[r]])):
            slot = self.slot_of(rank)
            if slot is not None:
                self.kill(slot, f"did not join generation {gen} in {2 * self.fence_s:.0f} s of the first rank")
        self.forming = (gen, now)  # the kill is seen as a death on the next round

    def stop_bound(self, slot):
        """How long the process of `slot` may stay stopped before it is fenced: STOPPED_STEPS of its rank's
        median step (its beat, tiers/survivors.py), at least STOPPED_FLOOR_S, at most fence_s; fence_s
        for a spare, or before the rank has a beat."""
        rank = self.holder(slot)
        try:
            median = float(self.node_store.get(f"beat/{rank}").split()[1]) if rank is not None and \
                self.node_store.check([f"beat/{rank}"]) else 0.0
        except (ValueError, IndexError):  # not a beat
            median = 0.0
        return min(self.fence_s, max(STOPPED_FLOOR_S, STOPPED_STEPS * median)) if median > 0 else self.fence_s

    def find_lost_nodes(self, gen, now):
        """Node 0 (with etcd, the leader): a node whose supervisor has not beaten for fence_s (with etcd:
        whose lease has lapsed) while a survivor reports a loss is lost whole (its processes die with their
        supervisor): its ranks go to spares of any node. Its supervisor, if it was only cut off, fences its
        own processes when it reads that it was lost (with etcd: when its lease has lapsed)."""
        if self.etcd:  # (each node's keys read only once a loss is reported: one read a beat until then)
            if self.store.add(f"g{gen}/lost", 0) == 0:
                return
            for node in (k for k in range(self.nnodes) if k != self.node):
                incarnation = self.store.add(f"node/{node}/incarnation", 0)
                if incarnation and not self.store.check([f"node/{node}/alive/{incarnation}"]) and not \
                        self.store.check([f"node/{node}/done"]):
                    self.give_away(node, incarnation, f"its lease in etcd lapsed ({self.ttl_s} s)")
            return
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
        """Say the job is over, and wake the spares that wait for the next vacancy (Team.take_vacancy): any
        value there wakes them, so never over another supervisor's vacancy. After a signal, the control plane
        may be gone (under Slurm, a cancel TERMs etcd's members too): then nobody is told."""
        try:
            self.store.set("end", "1")
            self.store.compare_set(f"vacancy/{self.store.add('vacancies', 0) + 1}", "", "end")
        except RuntimeError:  # (DistNetworkError)
            if not self.signalled:
                raise
            if self.etcd:  # gone: leave() asks nothing either
                self.store.deadline_s = 0

    def beat(self):
        """Say this node lives; raise StoreLost if node 0 is gone, and SystemExit if node 0 found this node
        silent and gave its ranks away (its processes are then stale: they are killed)."""
        import torch.distributed as dist
        try:
            if not self.etcd:  # (with etcd, the lease says the node lives: keep_lease)
                self.store.add(f"node/{self.node}/beat", 1)
            lost = self.store.check([f"node/{self.node}/lost/{self.incarnation}"])
            self.beaten = time.monotonic()
        except (RuntimeError, dist.DistError) as e:
            self.cut_off = True
            raise StoreLost(str(e).strip()[:100]) from None
        if lost:
            self.cut_off = True
            self.kill_all()
            raise SystemExit(f"supervisor: node {self.node} was silent for {self.fence_s:.0f} s and its ranks were "
                             "given to others: its processes killed (fenced), and this node leaves the job (exit 1); "
                             "the job trains on without it (start this node again to add its spares)")

    def watch_store(self):
        """A thread of a node other than node 0: cut off, a store call blocks (TCP retransmits, no timeout
        ends it), so this thread ends the node once its beat has not reached the store for STORE_LOST_S (at
        least 4 fence_s; node 0 gives its ranks away after fence_s): its processes killed, exit 1. With
        etcd, of every node: once its lease may have lapsed (no renewal for its life since the last one
        sent), before the leader can give its ranks away."""
        bound = max(STORE_LOST_S, 4 * self.fence_s)
        while True:
            time.sleep(0.1 if self.etcd else 1)
            if self.signalled:  # the ranks save and end: the control plane is no longer needed (run)
                continue
            if self.etcd and time.monotonic() - self.lease_sent > self.ttl_s:
                self.lost_store(f"no member of a majority renewed its lease in {self.ttl_s} s")
            elif not self.etcd and time.monotonic() - self.beaten > bound:
                self.lost_store(f"no answer for {bound:.0f} s")
            else:
                continue
            for proc in list(self.procs.values()) + ([self.warm.proc] if self.warm is not None else []):
                with contextlib.suppress(OSError):
                    proc.kill()
            os._exit(1)

    def lost_store(self, why):
        # This node cannot tell a dead node 0 from a link cut: node 0, if it lives, gives this node's
        # ranks to its spares and trains on without it (tests/test_scaleout.py).
        if self.etcd:
            print(f"supervisor: node {self.node} lost the job's control plane in etcd ({why}): this node's "
                  "processes killed, and this node leaves the job (exit 1). The nodes that reach a majority of "
                  "etcd's members train on without it (start this node again to add its spares)", flush=True)
            return
        print(f"supervisor: node {self.node} lost the job's store on node 0 ({why}): this node's processes "
              "killed, and this node leaves the job (exit 1). If node 0 lives, the job trains on there "
              "without it (start this node again to add its spares); if not, run the job again: it "
              "resumes from memory or disk", flush=True)

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
        self.first_launch = False
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(number, self.pass_on)
        code, rounds = None, 0
        self.beaten = time.monotonic()
        if self.node != 0 or self.etcd:
            threading.Thread(target=self.watch_store, name="watch-store", daemon=True).start()
        try:
            while code is None:
                rounds += 1
                # Once signalled (a preemption, a cancel), the ranks save and end with no control plane: under
                # Slurm, etcd's members may be cancelled with them (docs/slurm-survivors.sbatch).
                steady = not self.signalled
                try:
                    if rounds % BEAT_ROUNDS == 0 and self.nnodes > 1 and steady:
                        self.beat()
                    if self.etcd and steady:
                        self.elect(rounds)
                    code = self.round(fence=rounds % BEAT_ROUNDS == 0 and steady)  # deaths every 5 ms, hangs every 0.1 s
                except (StoreLost, RuntimeError):  # (RuntimeError: DistNetworkError)
                    if not self.signalled:
                        raise
                    # A signal came during a call to etcd, whose members it may have ended: given up, and
                    # no other made (seen in `bash run.sh slurm`'s cancel-etcd check: a fence's read).
                time.sleep(POLL_S)
        except StoreLost as e:
            self.lost_store(e)
            self.kill_all()
            return 1
        finally:  # spares leave at the end; whatever still runs after a while is killed
            self.beaten = float("inf")
            if not self.cut_off:
                self.end()
            for proc in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10 if self.ended else 0)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    code = code or 1
            if self.warm is not None:
                self.warm.close()
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
            others = list(range(1, self.nnodes)) if self.node == 0 and not self.etcd else []
            while others and time.monotonic() < deadline:
                others = [k for k in others if not self.store.check([f"node/{k}/done"]) and not self.store.check(
                    [f"node/{k}/lost/{self.store.add(f'node/{k}/incarnation', 0)}"])]
                time.sleep(0.1)

    def round(self, fence):
        """One look at the processes: None while the job runs, else its exit status. A process that ends
        with 0 (done, or a stop: its code in the stop file) or 143 (preempted), or any after a signal,
        ends the job; any other is replaced alone."""
        ended = False
        if self.warm is not None and self.warm.proc.poll() is not None:
            self.warm_lost(f"died ({'exit ' if self.warm.proc.returncode >= 0 else 'signal '}"
                           f"{abs(self.warm.proc.returncode)})")
        elif self.warm is not None:
            self.warm.ready(0)  # (says so once it is)
        for slot, proc in self.procs.items():
            status = proc.poll()
            if status is None or slot in self.retired:
                continue
            if status in (0, PREEMPTED) or self.signalled or os.path.exists(self.stop_file):
                ended = True
                continue
            how = f"exit {status}" if status > 0 else f"signal {-status}"
            if self.restarts[slot] >= self.max_restarts and self.holder(slot) is None:  # an idle spare
                print(f"supervisor: slot {slot}, a spare, failed {self.restarts[slot] + 1} times ({how}): retired; the "
                      "job trains on without it", flush=True)
                self.retired.add(slot)
                continue
            if self.restarts[slot] >= self.max_restarts and self.store.check([STOP]):  # again, in the last try
                print(f"supervisor: slot {slot} failed {self.restarts[slot] + 1} times ({how}): ending the job now; "
                      "the memory tier keeps the newest step every rank holds", flush=True)
                return 1
            if self.restarts[slot] >= self.max_restarts:  # its rank once more: the step saved first, as on a preemption
                why = f"slot {slot} failed {self.restarts[slot] + 1} times ({how})"
                print(f"supervisor: {why}: the job ends once its ranks have saved their next step (its rank is "
                      "taken once more)", flush=True)
                self.store.set(STOP, why)  # before the vacancy: every survivor reads it as it recovers
            self.vacate([slot], f"died (exit {status})" if status > 0 else f"killed by signal {-status}")
            self.restarts[slot] += 1
            self.start(slot)
        if ended:
            self.ended = True
            self.beaten = float("inf")  # the waits below beat no more: not a lost store (watch_store)
            self.end()
            for proc in self.procs.values():  # the others finish as they will; spares leave on "end"
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(60, self.fence_s * 4))
            statuses = {slot: p.poll() for slot, p in self.procs.items() if slot not in self.retired}
            code = next((1 if s is None else s for s in statuses.values() if s != 0), 0)  # None: still running, killed
            if code not in (0, PREEMPTED):  # which process made it so, in one line
                print("supervisor: the job ends in failure: " + ", ".join(
                    f"slot {slot} {'still running (killed)' if s is None else f'exited {s}'}"
                    for slot, s in statuses.items() if s != 0), flush=True)
            if code == PREEMPTED and not self.signalled and self.store.check([STOP]):  # saved, not for a restart
                print(f"supervisor: the job saved its step and ends (exit 1): {self.store.get(STOP).decode()}",
                      flush=True)
                return 1
            return code
        if fence:
            self.fence()
        return None

    def pass_on(self, number, _):
        """A signal to the job goes on to every process; Ctrl-C (SIGINT) as SIGTERM, as torchrun's agent
        passes it: the ranks save their step and end (exit 143), never a KeyboardInterrupt mid-step."""
        self.signalled.append(number)
        if self.etcd:  # what it still says to etcd (end, leave), it says in 2 s or not at all
            self.store.deadline_s = min(self.store.deadline_s, SIGNALLED_S)
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM if number == signal.SIGINT else number)
