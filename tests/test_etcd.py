"""The survivors' control plane in a real etcd (tiers/etcd.py) on three real nodes (harness/nodes.py), a member
on each, as a cluster runs it (Debian's etcd-server, installed when missing): no node is the job's single point
of failure, node 0 included, and etcd's own leader can be lost."""
import time

import pytest

from harness.metrics import Watch
from harness.procs import finish
from conftest import LONG, metrics, summary, torchrun, wait_for_step

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it for several ranks a node
NODES = 3
HANG_S = 3  # --hang-timeout-s; a node's lease in etcd lives 5 s (harness/supervisor.py: LEASE_FLOOR_S)
FLAGS = [*LONG, "--steps", 300, "--save-every", 100]  # about 25 ms a step here: 8 s of training


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 3-rank job of FLAGS."""
    run_dir = tmp_path_factory.mktemp("etcd-reference")
    torchrun("ddp/train.py", NODES, run_dir, *FLAGS)
    return run_dir


@pytest.fixture
def three_nodes(tmp_path):
    """Three real nodes, and an etcd cluster with a member on each, led by one of them."""
    from harness.nodes import Cluster, can_make_nodes
    if can_make_nodes():
        pytest.skip(can_make_nodes())
    with Cluster(NODES) as made:
        made.members = [made.etcd(k, range(NODES), tmp_path) for k in range(NODES)]
        assert led(made, time.time() + 60) is not None, "etcd elected no leader in 60 s"
        yield made


def led(cluster, deadline):
    """The node whose etcd member leads, once one does (polled until `deadline`; None if none by then)."""
    while time.time() < deadline:
        leader = cluster.etcd_leader(range(NODES))
        if leader is not None:
            return leader
        time.sleep(0.1)  # polling etcd's status, not waiting for a guessed moment
    return None


def launch(cluster, run, log_dir, spares):
    """The job on every node: ddp, one rank a node and `spares` on each, the control plane in etcd."""
    env = {**ONE_THREAD, "ETCD_ENDPOINTS": cluster.etcd_endpoints(range(NODES))}
    return [cluster.launch(k, ["ddp", 1, "--run-dir", run, "--survivors", "--spares", spares, *FLAGS,
                               "--hang-timeout-s", HANG_S], NODES, log_dir / f"node{k}.log", env) for k in range(NODES)]


def now_at(run, rank):
    """The newest step rank `rank` has completed."""
    return max((e["step"] for e in Watch(run).poll() if e["event"] == "step" and e["rank"] == rank), default=0)


def rejoined(cluster, k, job):
    """Wait until node k's etcd member answers with a leader (started again, or its link healed)."""
    while not (cluster.etcd_status(k) or {}).get("leader"):
        assert job.poll() is None, "the job ended before node k's etcd member was back"
        time.sleep(0.1)  # polling etcd's status, not waiting for a guessed moment


def test_etcds_leader_lost_costs_nothing_and_node_0_lost_whole_costs_seconds_bitwise(tmp_path, three_nodes,
                                                                                       reference):
    # ddp, one rank a node and a spare on each, the control plane in etcd. After step 15 the etcd member that
    # leads is killed (its node lives) and started again: the job trains on, no process fenced or replaced.
    # After step 30 node 0 is lost whole (rank 0, its spare, its supervisor, its etcd member, its /dev/shm):
    # nodes 1 and 2 keep their processes, a spare of theirs takes rank 0 with its record from the replica rank
    # 1 kept, the job trains again within --hang-timeout-s + 5 s of the loss, and ends with an uninterrupted
    # 3-rank job's weights.
    cluster, run = three_nodes, tmp_path / "run"
    nodes = launch(cluster, run, tmp_path, 1)
    assert wait_for_step(run, 15, nodes[1], rank=1), "the job ended before step 15: etcd's leader was never lost"
    leader = cluster.etcd_leader(range(NODES))
    cluster.members[leader].kill()
    cluster.members[leader].wait()
    killed_at = time.time()
    assert led(cluster, time.time() + 30) not in (None, leader), "etcd elected no other leader in 30 s"
    cluster.members[leader] = cluster.etcd(leader, range(NODES), tmp_path)  # it rejoins with its data
    rejoined(cluster, leader, nodes[1])  # before node 0 (and its member) is lost
    back_at = time.time()
    assert wait_for_step(run, now_at(run, 1) + 10, nodes[1], rank=1), "the job ended before node 0 was lost"
    cluster.kill(0)
    lost_at = time.time()
    outputs = []
    for k in (1, 2):
        code, output, hung = finish(nodes[k], lost_at + 120)
        assert code == 0 and not hung and "Traceback" not in output, output[-5000:]
        outputs.append(output)
    said = "".join(outputs)
    assert "supervisor: rank 0 (slot 0) lost with node 0 (its lease in etcd lapsed" in said, said[-5000:]
    assert "fenced" not in said + nodes[0].log.read_text(), said[-5000:]
    for rank in (1, 2):  # the survivors: one process each, throughout; one recovery, node 0's
        starts, recovered = [e["pid"] for e in metrics(run, rank, "start")], metrics(run, rank, "recovered")
        assert len(starts) == 1 and [e["pid"] for e in recovered] == starts, (starts, recovered)
        assert recovered[0]["lost_at"] > lost_at - 1 and recovered[0]["time"] - lost_at <= HANG_S + 5, recovered
    assert len(metrics(run, 0, "start")) == 2  # rank 0: its process on node 0, then a spare of node 1 or 2
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
    steps = [e["time"] for e in metrics(run, 1, "step") if killed_at - 1 < e["time"] < back_at + 1]
    print(f"etcd leader (node {leader}'s member) lost: its longest step meanwhile "
          f"{max(b - a for a, b in zip(steps, steps[1:])):.3f} s; node 0 lost whole -> training again after "
          f"{max(metrics(run, r, 'recovered')[0]['time'] for r in (1, 2)) - lost_at:.2f} s")


def test_node_0_cut_off_leaves_in_one_line_and_then_node_1_lost_whole_bitwise(tmp_path, three_nodes, reference):
    # The same job with two spares a node. Node 0 (rank 0, and an etcd member) is cut off: a minority of etcd,
    # it cannot renew its lease, so it kills its processes and leaves in one line (exit 1) before the others
    # give its rank away; its processes write nothing after the cut. Its link healed and its member back, node 1
    # is lost whole: node 2's spares take every rank it held, and the job ends with an uninterrupted job's
    # weights on node 2 alone.
    cluster, run = three_nodes, tmp_path / "run"
    nodes = launch(cluster, run, tmp_path, 2)
    assert wait_for_step(run, 15, nodes[2], rank=2), "the job ended before step 15: node 0 was never cut off"
    rank0 = metrics(run, 0, "start")[-1]["pid"]
    cluster.cut(0)
    cut_at = time.time()
    code, left, hung = finish(nodes[0], cut_at + 60)
    left_at = time.time()
    cluster.heal(0)
    assert code == 1 and not hung and "Traceback" not in left, left[-4000:]
    assert "supervisor: node 0 lost the job's control plane in etcd" in left, left[-4000:]
    recovered = Watch(run).until(lambda e: e["event"] == "recovered" and e["rank"] == 2, nodes[2], time.time() + 60)
    assert recovered, "the others did not train again within 60 s of node 0's cut"
    spare = Watch(run).until(lambda e: e["event"] == "start" and e["rank"] == 0 and e["pid"] != rank0, nodes[2],
                             time.time() + 60)  # rank 0's events from then on are a spare's
    assert spare, "no spare took rank 0 within 60 s"
    stale = [e for e in metrics(run, 0) if cut_at + 1 < e["time"] < spare["time"]]
    assert not [e for e in stale if e["event"] in ("step", "save")], stale
    rejoined(cluster, 0, nodes[2])  # node 0's member: two of three again, before node 1's goes
    assert wait_for_step(run, now_at(run, 2) + 10, nodes[2], rank=2), "the job ended before node 1 was lost"
    cluster.kill(1)
    lost_at = time.time()
    code, output, hung = finish(nodes[2], lost_at + 120)
    assert code == 0 and not hung and "Traceback" not in output, output[-5000:]
    said = output + nodes[1].log.read_text()
    assert "rank 0 (slot 0) lost with node 0 (its lease in etcd lapsed" in said, said[-5000:]
    assert "lost with node 1 (its lease in etcd lapsed" in said, said[-5000:]
    starts = [e["pid"] for e in metrics(run, 2, "start")]
    assert len(starts) == 1 and len(metrics(run, 2, "recovered")) == 2  # rank 2: one process, two recoveries
    assert summary(run)["world_size"] == NODES and summary(run)["param_digest"] == summary(reference)["param_digest"]
    print(f"node 0 cut off -> it left after {left_at - cut_at:.1f} s, the others trained again after "
          f"{recovered['time'] - cut_at:.1f} s; node 1 lost whole -> the job ended on node 2")
