"""The survivors' control plane in etcd: with ETCD_ENDPOINTS set on a job of several nodes, the job's store
(the keys tiers/survivors.py's docstring lists) lives in an etcd cluster of three or more members instead of
node 0's supervisor, so that no node is the job's single point of failure. Imported only then.

What goes to etcd, under /ft/<RDZV_ID>/: the job's events (the generation, vacancies and claims, a
generation's abort, members and loss reports), each node's liveness as a key held by a lease of its
supervisor (`node/<k>/alive`: it lapses --hang-timeout-s after the node dies or is cut off from a majority
of the members), and the leader (`leader`, a key held by a lease: the supervisor that does what node 0's did,
giving a lost node's ranks away and starting the next generation after a false alarm). What does not: a
rank's beats and the abort as its watcher waits for it (its own node's supervisor relays that, see
harness/supervisor.py), and a generation's process group, which meets at a TCPStore served by the
supervisor that began the generation (`g<gen>/store`, written with the generation in one transaction).

EtcdStore answers the calls that the supervisors and the ranks make of a store (add, set, get, check,
compare_set, wait) through etcd's v3 HTTP gateway (etcd3gw), a request at a time to one member, the next
member when one does not answer within REQUEST_S; after DEADLINE_S with no answer it raises
torch.distributed.DistNetworkError, as a lost TCPStore does: etcd unreachable, or this node cut off from a
majority of its members (a member without a majority answers nothing)."""
import datetime
import os
import time

import torch.distributed as dist

ENDPOINTS = "ETCD_ENDPOINTS"  # host:port,host:port,...: the etcd members' client URLs, as the user gives them
JOB = "FT_ETCD"  # the ranks': "<prefix> <host:port,...>"
REQUEST_S = 1.0  # one request to one member; then the next member is asked
DEADLINE_S = 10.0  # no member answered in this long: the store is lost (an etcd leader's election takes 1-2 s)
POLL_S = 0.05  # how often a wait reads etcd


def endpoints_of(value):
    """[(host, port)] of an ETCD_ENDPOINTS value ("host:port,host:port,..."; http:// allowed); ValueError
    (one line) if it is not one."""
    pairs = []
    for item in value.split(","):
        host, _, port = item.strip().removeprefix("http://").rstrip("/").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{ENDPOINTS} must be host:port[,host:port...] (etcd's client URLs), got '{value}'")
        pairs.append((host, int(port)))
    return pairs


def prefix_of(job_id):
    return f"/ft/{job_id}/"


class EtcdStore:
    """The job's store in etcd (see the module's docstring): keys under `prefix`, on the members at
    `endpoints` ([(host, port)]). One client a thread: a request waits for the one before it."""

    def __init__(self, endpoints, prefix, deadline_s=DEADLINE_S):
        import etcd3gw
        import etcd3gw.exceptions
        self.clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=REQUEST_S, api_path="/v3/") for h, p in endpoints]
        self.errors = etcd3gw.exceptions.Etcd3Exception
        self.prefix, self.deadline_s, self.member = prefix, deadline_s, 0
        self.where = ",".join(f"{h}:{p}" for h, p in endpoints)

    # ------------------------------------------------------------------ one request, on whichever member answers
    def call(self, what):
        """what(client) on the first member that answers, starting with the last one that did; DistNetworkError
        after deadline_s without an answer (read on each try: a signal to the supervisor shortens a call in flight)."""
        start, error = time.monotonic(), None
        while time.monotonic() < start + self.deadline_s:
            for _ in range(len(self.clients)):
                try:
                    return what(self.clients[self.member])
                except self.errors as e:  # refused, timed out, no leader, a 5xx: the next member
                    error = e
                    self.member = (self.member + 1) % len(self.clients)
            time.sleep(POLL_S)
        raise dist.DistNetworkError(f"etcd ({self.where}) did not answer in {self.deadline_s:.0f} s: "
                                    f"{str(error).strip()[:100] or type(error).__name__}")

    def key(self, key):
        from etcd3gw.utils import _encode
        return _encode(self.prefix + key)

    def txn(self, compare, success, failure=()):
        return self.call(lambda c: c.transaction({"compare": compare, "success": list(success),
                                                  "failure": list(failure)}))

    def read(self, key):
        """(value bytes, mod_revision) of `key`, or (None, 0)."""
        from etcd3gw.utils import _decode
        kvs = self.call(lambda c: c.post(c.get_url("/kv/range"), json={"key": self.key(key)})).get("kvs", [])
        return (_decode(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])) if kvs else (None, 0)

    def put_op(self, key, value, lease=None):
        from etcd3gw.utils import _encode
        return {"request_put": {"key": self.key(key), "value": _encode(str(value)),
                                **({"lease": lease} if lease else {})}}

    def unchanged(self, key, revision):
        """A comparison: `key` as read at `revision` (0: still absent)."""
        if revision == 0:
            return {"key": self.key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        return {"key": self.key(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}

    # ------------------------------------------------------------------ the calls of a c10d Store that the job makes
    def set(self, key, value, lease=None):
        self.txn([], [self.put_op(key, value, lease)])

    def get(self, key, timeout_s=300):
        """The value of `key`, waiting for it as TCPStore.get does; DistStoreError if it never comes."""
        self.wait([key], datetime.timedelta(seconds=timeout_s))
        return self.read(key)[0]

    def check(self, keys):
        """Whether every one of `keys` exists: one read of the range they share (a transaction may compare
        only 128 keys), so that a rank waiting for a generation's members costs etcd one request."""
        from etcd3gw.utils import _decode, _encode
        if not keys:
            return True
        first, last = min(keys), max(keys)
        common = first[:next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), len(first))]
        start = self.prefix + common
        end = start[:-1] + chr(ord(start[-1]) + 1)  # every key that begins with `start`
        kvs = self.call(lambda c: c.post(c.get_url("/kv/range"), json={
            "key": _encode(start), "range_end": _encode(end), "keys_only": True})).get("kvs", [])
        there = {_decode(kv["key"]).decode()[len(self.prefix):] for kv in kvs}
        return all(k in there for k in keys)

    def wait(self, keys, timeout=datetime.timedelta(seconds=300)):
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"etcd: {keys[0]} not set in {timeout.total_seconds():.0f} s")
            time.sleep(POLL_S)

    def add(self, key, amount):
        """Add `amount` to the number at `key` (absent: 0) and return the sum (a compare-and-set loop)."""
        while True:
            value, revision = self.read(key)
            total = int(value or 0) + amount
            if amount == 0 or self.txn([self.unchanged(key, revision)], [self.put_op(key, total)]).get("succeeded"):
                return total

    def compare_set(self, key, expected, desired):
        """As TCPStore's, for an absent key (`expected` ""): `desired` set and returned if `key` was absent,
        else its value."""
        assert expected == "", "the job only ever sets absent keys"
        if self.create(key, desired):
            return desired.encode()
        return self.read(key)[0]

    # ------------------------------------------------------------------ what only etcd does: transactions and leases
    def create(self, key, value, lease=None):
        """Set `key` if it is absent: True if this call set it."""
        return bool(self.txn([self.unchanged(key, 0)], [self.put_op(key, value, lease)]).get("succeeded"))

    def count_up(self, key, puts=lambda n: ()):
        """Add one to the number at `key` and put puts(the new number) ([(key, value, lease)]) in the same
        transaction: none without the other, whoever dies in between. Returns the new number."""
        while True:
            value, revision = self.read(key)
            n = int(value or 0) + 1
            ops = [self.put_op(key, n), *(self.put_op(k, v, lease) for k, v, lease in puts(n))]
            if self.txn([self.unchanged(key, revision)], ops).get("succeeded"):
                return n

    def next_generation(self, store_address):
        """Begin the next generation and name the TCPStore its process group meets at (one transaction: a
        supervisor that dies in between leaves no generation without a store). Returns its number."""
        return self.count_up("gen", lambda gen: [(f"g{gen}/store", store_address, None)])

    def grant(self, ttl_s):
        """A new lease of `ttl_s` seconds (its id): the keys put with it go when it lapses."""
        return self.call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": int(ttl_s)}))["ID"]

    def keep_alive(self, lease):
        """Renew `lease`: its remaining seconds; 0 or less if it has lapsed already."""
        result = self.call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        return int(result.get("result", {}).get("TTL", -1))


def client(deadline_s=DEADLINE_S):
    """An EtcdStore of the job whose ranks' environment names it (JOB)."""
    prefix, endpoints = os.environ[JOB].split()
    return EtcdStore(endpoints_of(endpoints), prefix, deadline_s)
