"""Real nodes on one machine, for the tests and the chaos soak: each node a network namespace of its own (its
own address, loopback, ports and hostname) joined to the others through a bridge in a namespace of its own
(the switch), and each node's processes in a mount namespace with a private tmpfs at /dev/shm, which dies
with them as a node's memory does; the run folder, on this machine's disk, is the nodes' shared storage.

    with Cluster(2) as cluster:
        node0 = cluster.start(0, ["bash", "run.sh", "ddp", "1", ...], env, log)   # as a user launches a node
        cluster.cut(1); ...; cluster.heal(1)    # a partition: node 1's link down at the switch, then up
        cluster.lossy(1, 20)                    # 20 % of node 1's packets dropped, each way
        cluster.kill(1)                         # lost whole: every process in node 1's namespace SIGKILLed
        members = [cluster.etcd(k, range(3), folder) for k in range(3)]   # an etcd cluster, a member a node
        cluster.etcd_leader(range(3))           # the node whose member leads it

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and util-linux; packet loss needs nftables, etcd
Debian's etcd-server (3.4); each installed from Debian's packages when missing. This kernel has no netem: no fixed delay, only a rate limit (slow()).
The namespaces have no route out: their traffic never leaves them (10.200.0.0/24, not the host's subnet).
Everything a Cluster makes is removed when it closes, and leftovers of a process that died before it could
close one (namespaces named ft-<its pid>-...) are removed by the next Cluster.
"""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from harness.procs import REPO

SUBNET = "10.200.0"  # node k is SUBNET.(10 + k)
PORT = 29500  # the job's endpoint on node 0: each node has ports of its own, so no other program holds it
ETCD_CLIENT, ETCD_PEER = 2379, 2380  # an etcd member's ports on its node
NAME = re.compile(r"^ft-(\d+)-\d+-")
SHM_MB = 1024  # each node's /dev/shm; a tmpfs takes memory only as it is written
_made = itertools.count()


def can_make_nodes():
    """None if this process can make nodes, else why not (one line). As root it can: what a node needs
    and the machine lacks is installed (need)."""
    return None if os.geteuid() == 0 else "real nodes need root (network and mount namespaces)"


def sh(*cmd, check=True):
    """Run an administrative command; its error in one line if it fails."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: {(done.stderr or done.stdout).strip()}")
    return done


def namespaces():
    return [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def pids_in(netns):
    return [int(p) for p in sh("ip", "netns", "pids", netns, check=False).stdout.split()]


def remove(netns):
    """Kill whatever runs in the namespace, then delete it (its veth ends go with it) and its /etc/netns files."""
    for pid in pids_in(netns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sh("ip", "netns", "del", netns, check=False)
    shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


def remove_leftovers():
    """The namespaces of Clusters whose process died before closing them (never a living process's)."""
    for netns in namespaces():
        owner = NAME.match(netns)
        if owner and not Path(f"/proc/{owner.group(1)}").exists():
            remove(netns)


def need(command, package):
    """`command`, installed once from Debian's `package` if missing: iproute2's ip and util-linux's
    unshare for every node, nftables' nft for the packet-loss fault."""
    install = ("apt-get", "install", "-y", "-qq", "--no-install-recommends", package)
    if shutil.which(command) is None and sh(*install, check=False).returncode != 0:
        sh("apt-get", "update", "-qq")  # a machine with no package lists yet
        sh(*install)
    return shutil.which(command)


class Cluster:
    """`n` nodes (see the module's docstring): node k's namespace self.netns[k], its address self.address(k)."""

    def __init__(self, n):
        why = can_make_nodes()
        if why:
            raise RuntimeError(why)
        need("ip", "iproute2")
        need("unshare", "util-linux")
        remove_leftovers()
        self.tag = f"ft-{os.getpid()}-{next(_made)}"
        self.switch = f"{self.tag}-sw"
        self.netns = [f"{self.tag}-n{k}" for k in range(n)]
        self.procs, self.losses = [], set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(k)} {self.hostname(k)}\n" for k in range(len(self.netns)))
        for k, netns in enumerate(self.netns):
            sh("ip", "netns", "add", netns)
            # `ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts: each node resolves every node's name
            # (torchrun's agents publish their hostname), and its own to its own address.
            (Path("/etc/netns") / netns).mkdir(parents=True, exist_ok=True)
            (Path("/etc/netns") / netns / "hosts").write_text(hosts)
            sh("ip", "link", "add", f"v{k}", "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", netns)
            sh("ip", "-n", self.switch, "link", "set", f"v{k}", "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", f"v{k}", "up")
            sh("ip", "-n", netns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            sh("ip", "-n", netns, "link", "set", "eth0", "up")
            sh("ip", "-n", netns, "link", "set", "lo", "up")

    def address(self, k):
        return f"{SUBNET}.{10 + k}"

    def hostname(self, k):
        return f"node{k}.{self.tag}"

    @property
    def endpoint(self):
        """host:port of node 0, where a job's store (torchrun's rendezvous, the survivors' store) is served."""
        return f"{self.address(0)}:{PORT}"

    def env(self, k):
        """What a node's processes need in their environment: gloo on the node's own interface."""
        return {"GLOO_SOCKET_IFNAME": "eth0"}

    def wrap(self, k, cmd):
        """`cmd` as run on node k: in the node's network namespace, with a fresh /dev/shm and the node's
        hostname (ip, unshare and sh each exec the next: the process is the command's). Its environment
        needs self.env(k)."""
        boot = (f"mount -t tmpfs -o size={SHM_MB}m,mode=1777 ftshm /dev/shm && hostname {self.hostname(k)} "
                '&& exec "$@"')
        return ["ip", "netns", "exec", self.netns[k], "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", boot, "sh", *map(str, cmd)]

    def start(self, k, cmd, env, log):
        """Boot node k with one command (a launcher: its processes are its children), wrapped (wrap()), in
        a session of its own, its output to `log`. Returns the Popen."""
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(self.wrap(k, cmd), cwd=REPO, env={**env, **self.env(k)}, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        proc.log, proc.env, proc.node = Path(log), env, k
        self.procs.append(proc)
        return proc

    def launch(self, k, args, nnodes, log, env=None):
        """Boot node k with `bash run.sh ARGS` as a cluster user launches a node of a job of `nnodes`:
        NNODES, NODE_RANK and RDZV_ENDPOINT (node 0's address) set, gloo on the node's interface."""
        env = {**os.environ, "NNODES": str(nnodes), "NODE_RANK": str(k), "RDZV_ENDPOINT": self.endpoint,
               "RDZV_ID": self.tag, **(env or {})}
        return self.start(k, ["bash", "run.sh", *map(str, args)], env, log)

    def etcd(self, k, members, folder):
        """Start the etcd member of node k, one of a cluster with a member on each of `members` (nodes), as a
        cluster runs it (its data in `folder`/etcd-m<k>; started again, it rejoins with it). Returns its Popen."""
        need("etcd", "etcd-server")
        url = lambda j, port: f"http://{self.address(j)}:{port}"  # noqa: E731
        cmd = ["etcd", "--name", f"m{k}", "--data-dir", Path(folder) / f"etcd-m{k}",
               "--listen-client-urls", url(k, ETCD_CLIENT), "--advertise-client-urls", url(k, ETCD_CLIENT),
               "--listen-peer-urls", url(k, ETCD_PEER), "--initial-advertise-peer-urls", url(k, ETCD_PEER),
               "--initial-cluster", ",".join(f"m{j}={url(j, ETCD_PEER)}" for j in members),
               "--initial-cluster-token", self.tag, "--initial-cluster-state", "new",
               "--pre-vote"]  # (a member back from a cut does not unseat the leader: etcd 3.5's default)
        log = Path(folder) / f"etcd-m{k}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:  # (appended: a member started again keeps its first life's log)
            proc = subprocess.Popen(self.wrap(k, cmd), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.log, proc.env, proc.node = log, {}, k
        self.procs.append(proc)
        return proc

    def etcd_endpoints(self, members):
        return ",".join(f"{self.address(k)}:{ETCD_CLIENT}" for k in members)

    def etcd_status(self, k):
        """Node k's member's status (etcd's /v3/maintenance/status, asked from node k), or None."""
        ask = ("import json, sys, urllib.request as u; r = u.Request(sys.argv[1], data=b'{}', method='POST'); "
               "print(u.urlopen(r, timeout=2).read().decode())")
        done = sh("ip", "netns", "exec", self.netns[k], sys.executable, "-c", ask,
                  f"http://{self.address(k)}:{ETCD_CLIENT}/v3/maintenance/status", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def etcd_leader(self, members):
        """The node whose member leads the etcd cluster of `members`, or None (no leader now)."""
        for k in members:
            status = self.etcd_status(k)
            if status and status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return k
        return None

    def kill(self, k):
        """Lose node k whole, as a power cut would: every process in its namespace SIGKILLed at once (its
        /dev/shm goes with the last of them). Returns their pids."""
        pids = pids_in(self.netns[k])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.node == k:
                proc.wait()
        return pids

    def cut(self, k):
        """Cut node k off, alive: its link down at the switch. Its packets vanish silently both ways (no
        reset, no error: to its peers it looks like a hang)."""
        sh("ip", "-n", self.switch, "link", "set", f"v{k}", "down")

    def heal(self, k):
        sh("ip", "-n", self.switch, "link", "set", f"v{k}", "up")

    def lossy(self, k, percent, sparing=None):
        """Drop `percent` % of node k's packets at the switch, each way, at random (with `sparing`, a TCP
        port, only TCP packets to or from other ports: lossy(1, 100, sparing=PORT) stalls node 1's
        training traffic, not its store's); lossy(k, 0) ends it."""
        table = f"loss{k}"
        if k in self.losses:
            sh("ip", "netns", "exec", self.switch, "nft", "delete", "table", "bridge", table)
            self.losses.discard(k)
        if percent <= 0:
            return
        need("nft", "nftables")
        drop = "drop" if percent >= 100 else f"numgen random mod 100 < {int(percent)} drop"
        spared = ""
        if sparing is not None:  # (not "tcp sport != P tcp dport != P drop": on this kernel it drops P's too)
            spared, drop = f"    tcp dport {sparing} accept\n    tcp sport {sparing} accept\n", f"ip protocol tcp {drop}"
        rules = (f"table bridge {table} {{\n  chain forward {{\n    type filter hook forward priority 0; policy accept;\n"
                 f'{spared}    iifname "v{k}" {drop}\n    oifname "v{k}" {drop}\n  }}\n}}\n')
        done = subprocess.run(["ip", "netns", "exec", self.switch, "nft", "-f", "-"], input=rules, text=True,
                              capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft: {done.stderr.strip()}")
        self.losses.add(k)

    def slow(self, k, rate="10mbit"):
        """Limit node k's link to `rate` each way (tbf: delay only under load; this kernel has no netem)."""
        for netns, dev in ((self.switch, f"v{k}"), (self.netns[k], "eth0")):
            sh("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
               "latency", "400ms")

    def close(self):
        """Kill every node's processes and remove every namespace and file this Cluster made."""
        for netns in [*self.netns, self.switch]:
            remove(netns)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()
