"""Several nodes of one job, each a real node (harness/nodes.py: its own network namespace, address and
/dev/shm; the run folder on this machine's disk is their shared storage), launched through run.sh as a
cluster user launches them: torchrun's agents meeting at one c10d rendezvous (a fixed pair; an elastic
job that loses a node, and one that gains one), and the survivors' supervisors (a stalled link, the node of
rank 0 and the job's store cut off; a node lost whole: test_etcd.py, and `bash run.sh slurm`)."""
import shutil
import signal
import time

from harness.nodes import PORT
from harness.procs import finish
from harness.metrics import Watch, phases
from conftest import LONG, SMALL, metrics, summary, torchrun_meanwhile, wait_for_step

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it for several ranks a node


def node_of(cluster, k, mode, nproc, run, flags, nnodes, log):
    """Node k of a job of `nnodes`: `bash run.sh MODE NPROC --run-dir RUN FLAGS` in its namespaces."""
    return cluster.launch(k, [mode, nproc, "--run-dir", run, *flags], nnodes, log, ONE_THREAD)


def test_a_lost_node_leaves_the_other_training_alone_within_30_s_bitwise(tmp_path, fsdp_four_ranks, cluster):
    # An elastic job (NNODES=1:2) of two nodes with 2 ranks each; after step 9 node 1 is lost whole,
    # every process in its namespace SIGKILLed at once. The survivor's workers fail on their next
    # collective, its agent restarts them (its restart 1) and forms the rendezvous alone once the lost
    # node's heartbeats have lapsed: 2 ranks, resharded from the last commit, step 8.
    run = tmp_path / "elastic"
    survivor, _ = (node_of(cluster, k, "fsdp", 2, run, SMALL, "1:2", tmp_path / f"node{k}.log") for k in (0, 1))
    assert wait_for_step(run, 9, survivor), "the job ended before step 9: the node was never lost"
    cluster.kill(1)
    lost_at = time.time()
    reference = tmp_path / "reference"  # the uninterrupted 4-rank job's step 8 resumed at 2 ranks, meanwhile
    shutil.copytree(fsdp_four_ranks / "ckpt" / "step-00000008", reference / "ckpt" / "step-00000008")
    referenced = torchrun_meanwhile("fsdp/train.py", 2, reference, *SMALL)
    code, output, hung = finish(survivor, lost_at + 120)
    assert code == 0 and not hung, output[-6000:]
    after = [e for r in range(2) for e in metrics(run, r) if e["time"] > lost_at]
    assert {(e["world_size"], e["resumed_from_step"], e["restarts"]) for e in after if e["event"] == "start"} == {(2, 8, 1)}
    assert {(e["from_world_size"], e["world_size"]) for e in after if e["event"] == "reshard"} == {(4, 2)}
    assert (summary(run)["world_size"], summary(run)["steps"]) == (2, 16)
    # Exactly the uninterrupted 4-rank job's step 8, resumed at 2 ranks.
    resumed = referenced()
    assert "resharded from 4 to 2 ranks" in resumed and "resuming from step 8" in resumed
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
    # The node's loss to the first step at 2 ranks: the settings that bound it are in harness.launch.
    split = phases([e for r in range(2) for e in metrics(run, r)], lost_at)
    print(f"node lost -> first step at 2 ranks: {split}")
    assert split["replayed_steps"] >= 1 and split["total_s"] <= 30, split


def test_a_replaced_node_resumes_from_its_peers_memory_bitwise(tmp_path, ddp_long_reference, cluster):
    # Two nodes of one DDP rank (NNODES=2:2: a fixed pair, with the elastic settings that drop a lost node
    # from the rendezvous in seconds, not 15), each with the memory tier in its own /dev/shm. Node 1 is
    # lost whole after step 20, before the first disk save, and boots again: a new /dev/shm, empty. Its
    # rank restores the step from node 0: the model and optimizer (the same on every rank) from rank 0,
    # its RNG from the replica of its record that node 0 kept: no step since the disk save is replayed,
    # only those since the last record node 0 received. (FSDP's shards from a replica: the survivors' test.)
    run = tmp_path / "run"
    first, _ = (node_of(cluster, k, "ddp", 1, run, LONG, "2:2", tmp_path / f"node{k}.log") for k in (0, 1))
    assert wait_for_step(run, 20, first), "the job ended before step 20: the node was never lost"
    cluster.kill(1)
    lost_at = time.time()
    done_before = max(e["step"] for e in metrics(run, 0, "step") if e["time"] < lost_at)
    new = node_of(cluster, 1, "ddp", 1, run, LONG, "2:2", tmp_path / "node1-new.log")
    ended = [finish(agent, lost_at + 120) for agent in (first, new)]
    assert all(code == 0 and not hung for code, _, hung in ended), [output[-3000:] for _, output, _ in ended]
    loads = [e for r in range(2) for e in metrics(run, r, "load") if e["time"] > lost_at]
    assert {(e["step"], e["source"]) for e in loads} == {(loads[0]["step"], "memory")} and len(loads) == 2
    assert done_before - 1 <= loads[0]["step"] <= done_before + 1, (done_before, loads)
    assert "ranks [1] had none (a replaced node): their records from the replicas, the model and optimizer from " \
           "rank 0" in ended[0][1]
    assert summary(run)["param_digest"] == summary(ddp_long_reference)["param_digest"]


def test_a_node_that_joins_an_elastic_job_is_admitted_at_a_saved_step(tmp_path, cluster):
    # One node of an elastic job (NNODES=1:2) trains alone; a second one starts after step 5 (the run
    # folder's lock is held by the job, which a node of it, its RDZV_ID, joins: another job may not,
    # test_ddp.py). torchrun admits it only in a new rendezvous round: the first node's agent sees it
    # waiting, stops its workers with SIGTERM (uncounted: a membership change, not a failure), they save
    # the step in progress, and both nodes go on with 4 ranks from that step. Then both are preempted.
    run, flags = tmp_path / "grow", [*SMALL, "--steps", 10_000, "--save-every", 10_000]
    first = node_of(cluster, 0, "fsdp", 2, run, flags, "1:2", tmp_path / "node0.log")
    assert wait_for_step(run, 5, first), "the job ended before step 5"
    second = node_of(cluster, 1, "fsdp", 2, run, flags, "1:2", tmp_path / "node1.log")
    added_at = time.time()
    watch, deadline = Watch(run), added_at + 120  # rank 0's first start at 4 ranks, then a step after it
    four = watch.until(lambda e: e["rank"] == 0 and e["event"] == "start" and e["world_size"] == 4, first, deadline)
    trained_at_4 = four and watch.until(lambda e: e["rank"] == 0 and e["event"] == "step" and e["time"] > four["time"],
                                        first, deadline)
    assert trained_at_4, "no step at 4 ranks within 120 s of the second node's start"
    for agent in (first, second):
        agent.send_signal(signal.SIGTERM)
    ended = [finish(agent, time.time() + 60) for agent in (first, second)]
    assert all(code not in (0, None) for code, _, _ in ended), [output[-3000:] for _, output, _ in ended]
    starts = [e for e in metrics(run, 0, "start") if e["time"] > added_at]
    grown = metrics(run, 0, "preempted")[0]  # the step the first node's workers saved for the membership change
    assert [(e["world_size"], e["resumed_from_step"], e["restarts"]) for e in starts] == [(4, grown["step"], 0)]
    assert [(e["from_world_size"], e["world_size"]) for e in metrics(run, 0, "reshard")] == [(2, 4)]
    assert len(metrics(run, 0, "preempted")) == 2  # the membership change, then the preemption at 4 ranks
    print(f"node added -> first step at 4 ranks: {phases(metrics(run, 0), added_at)}")


def said(nodes, phrases, deadline):
    """The first of `phrases` that the log of one of `nodes` (their launches) holds, waiting for one while
    they all run; None if one ends or the deadline (epoch seconds) passes first."""
    while all(node.poll() is None for node in nodes) and time.time() < deadline:
        text = "".join(node.log.read_text(errors="replace") for node in nodes)
        found = next((phrase for phrase in phrases if phrase in text), None)
        if found:
            return found
        time.sleep(0.1)  # polling the logs for a line, not waiting for a moment
    return None


def process_story(run_dir, rank):
    """(the pids of rank `rank`'s start events, in order; its recovered events)."""
    return [e["pid"] for e in metrics(run_dir, rank, "start")], metrics(run_dir, rank, "recovered")


def test_a_stalled_link_is_a_false_alarm_and_a_cut_off_store_leaves_one_side_training(tmp_path, cluster):
    # Two nodes of one FSDP rank (--survivors), a spare on each. After step 20 every TCP packet of node 1
    # but the job's store's is dropped, until a generation fails: a collective stalls past
    # --hang-timeout-s, but nobody is dead and every rank still reaches the store, so the same processes
    # form the next generation (a false alarm): no process replaced, the memory tier still on. (A random
    # loss, 20 % of every packet, made one now and then, or none in 120 s: chaos's lossy-link kind.) 40
    # steps after the recovery node 0 (rank 0 and the job's store) is cut off until node 1 has left: one
    # side only trains on. Node 0, finding node 1 silent, gives rank 1 to its own spare, which takes rank
    # 1's shards and RNG from the replica rank 0 kept (the memory tier's, across nodes; no disk save yet)
    # and its step from the step rank 0 restores, as for a node lost whole (lost by a kill, with etcd:
    # test_etcd.py; under Slurm: `bash run.sh slurm`'s node0-lost). Node 1 loses the store, kills its
    # processes and exits 1, saying what became of the job. Its processes wrote nothing after the cut
    # (rank 1's shards of each later save are the spare's), and the job ends with an uninterrupted job's
    # weights.
    script, flags = "fsdp/train.py", [*LONG, "--steps", 300, "--save-every", 100, "--hang-timeout-s", 5]
    reference = tmp_path / "reference"
    run = tmp_path / "run"
    zero, one = (node_of(cluster, k, "fsdp", 1, run, ["--survivors", "--spares", 1, *flags], 2,
                         tmp_path / f"node{k}.log") for k in (0, 1))
    assert wait_for_step(run, 20, zero), "the job ended before step 20: the link never stalled"
    cluster.lossy(1, 100, sparing=PORT)
    failed = said([zero, one], ["supervisor: generation 0 failed"], time.time() + 60)
    cluster.lossy(1, 0)
    assert failed, "no false alarm within 60 s of the stall (or the job ended)"
    alarm = Watch(run).until(lambda e: e["event"] == "recovered" and e["rank"] == 0, zero, time.time() + 120)
    assert alarm, "no recovery within 120 s of the stall (or the job ended)"
    assert wait_for_step(run, alarm["step"] + 40, zero), "the job ended before node 0 was cut off"
    rank1 = metrics(run, 1, "start")[-1]["pid"]  # its process when node 0 is cut off
    cluster.cut(0)
    cut_at = time.time()
    referenced = torchrun_meanwhile(script, 2, reference, *flags[:-2])  # while node 1 waits out the store's bound
    code, left, hung = finish(one, cut_at + 90)  # the store call's bound (supervisor.STORE_LOST_S), then its exit
    left_at = time.time()
    cluster.heal(0)
    assert code == 1 and not hung, left[-4000:]
    assert "supervisor: node 1 lost the job's store on node 0" in left and "If node 0 lives, the job trains on" in left
    code, output, hung = finish(zero, time.time() + 120)
    assert code == 0 and not hung, output[-5000:]
    assert "(a false alarm: a slow link, a pause)" in output and "fenced" not in output + left, output[-5000:]
    assert "memory tier is off" not in output + left
    assert "supervisor: rank 1 (slot 1000) lost with node 1 (silent for 5 s)" in output
    assert "ranks [1] had none (a replaced node): their records from the replicas, their shards from the ranks" \
           " that kept them" in output, output[-5000:]
    survivor, recovered = process_story(run, 0)
    assert survivor == [metrics(run, 0, "start")[0]["pid"]]  # rank 0: one process throughout
    assert process_story(run, 1)[0] == [rank1, metrics(run, 1, "start")[-1]["pid"]]  # its process, then node 0's spare
    spare = metrics(run, 1, "start")[-1]  # the cut-off side's last word: rank 1's events from then on are the spare's
    assert spare["launched_at"] < cut_at and metrics(run, 1, "load")[-1]["step"] == recovered[-1]["step"]
    # A replica of the step in flight is sent during the next step: the job goes on from the step before it at worst.
    assert recovered[-1]["step"] >= max(e["step"] for e in metrics(run, 0, "step") if e["time"] < cut_at) - 2
    stale = [e for e in metrics(run, 1) if cut_at + 1 < e["time"] < spare["time"]]
    assert not [e for e in stale if e["event"] in ("step", "save")], stale
    referenced()
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
    print(f"node 1 stalled: a false alarm; node 0 cut off -> node 1 left after {left_at - cut_at:.1f} s")
