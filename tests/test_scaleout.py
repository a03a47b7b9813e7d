"""Several nodes on one machine: torchrun agents meeting at one c10d rendezvous, as nodes would (a fixed
pair; an elastic job that loses a node, and one that gains one); and the cluster launch files the README
gives."""
import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from tiers import snapshot
from harness.launch import ELASTIC_RDZV_CONF, finish, free_port, kill_node, start, torchrun as torchrun_command
from harness.metrics import Watch, phases
from conftest import LONG, REPO, SMALL, metrics, summary, torchrun, wait_for_step


def nodes(script, nproc, run_dir, flags, nnodes):
    """A function that starts node `n` of one job on this machine: a torchrun agent with `nproc` workers,
    all at one endpoint and id. Node 0 holds the rendezvous store (its loss ends the job, as the loss of
    the endpoint's machine would); its log is <run_dir>-node<n>.log."""
    endpoint, rdzv_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]

    def start_node(node, extra=(), log=None):  # one thread a worker, as torchrun sets it for nproc > 1 only
        return start(*torchrun_command(script, nproc, run_dir, [*flags, *extra], nnodes=nnodes, endpoint=endpoint,
                                       rdzv_id=rdzv_id, is_host=node == 0, env={"OMP_NUM_THREADS": "1"}),
                     log=log or f"{run_dir}-node{node}.log")
    start_node.endpoint, start_node.rdzv_id = endpoint, rdzv_id
    return start_node


def test_a_lost_node_leaves_the_other_training_alone_within_30_s_bitwise(tmp_path, fsdp_four_ranks):
    # An elastic job (--nnodes 1:2) of two nodes with 2 ranks each; after step 9 one node is lost whole,
    # its agent and its workers SIGKILLed at once. The survivor's workers fail on their next collective,
    # its agent restarts them (its restart 1) and forms the rendezvous alone once the lost node's
    # heartbeats have lapsed: 2 ranks, resharded from the last commit, step 8.
    run = tmp_path / "elastic"
    start_node = nodes("fsdp/train.py", 2, run, SMALL, nnodes="1:2")
    survivor, lost = start_node(0), start_node(1)
    assert wait_for_step(run, 9, survivor), "the job ended before step 9: the node was never lost"
    kill_node(lost)
    lost_at = time.time()
    code, output, hung = finish(survivor, lost_at + 120)
    assert code == 0 and not hung, output[-6000:]
    after = [e for r in range(2) for e in metrics(run, r) if e["time"] > lost_at]
    assert {(e["world_size"], e["resumed_from_step"], e["restarts"]) for e in after if e["event"] == "start"} == {(2, 8, 1)}
    assert {(e["from_world_size"], e["world_size"]) for e in after if e["event"] == "reshard"} == {(4, 2)}
    assert (summary(run)["world_size"], summary(run)["steps"]) == (2, 16)
    assert not snapshot.default_dir(run).exists()  # the lost ranks' snapshots removed with the survivors'
    # Exactly the uninterrupted 4-rank job's step 8, resumed at 2 ranks.
    reference = tmp_path / "reference"
    shutil.copytree(fsdp_four_ranks / "ckpt" / "step-00000008", reference / "ckpt" / "step-00000008")
    proc = torchrun("fsdp/train.py", 2, reference, *SMALL)
    assert "resharded from 4 to 2 ranks" in proc.stdout and "resuming from step 8" in proc.stdout
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
    # The node's loss to the first step at 2 ranks: the settings that bound it are in harness.launch.
    split = phases([e for r in range(2) for e in metrics(run, r)], lost_at)
    print(f"node lost -> first step at 2 ranks: {split}")
    assert split["replayed_steps"] >= 1 and split["total_s"] <= 30, split


def test_a_replaced_node_resumes_from_its_peers_memory_bitwise(tmp_path, ddp_long_reference):
    # Two nodes of one DDP rank, each with a memory of its own (--snapshot-dir). Node 1 is lost whole
    # after step 20, before the first disk save, and a new node takes its place with an empty memory. Its
    # rank restores the step from node 0: the model and optimizer (the same on every rank) from rank 0,
    # its RNG from the replica of its record that node 0 kept: no step since the disk save is replayed,
    # only those since the last record node 0 received. (FSDP's shards from a replica, and the survivors'
    # way: test_survivors.py.) (2:2 nodes: a fixed pair, with the elastic settings that drop a lost node
    # from the rendezvous in seconds, not 15.)
    script, flags, reference = "ddp/train.py", LONG, ddp_long_reference  # 100 steps after step 20, a save at 60
    run = tmp_path / "run"
    start_node = nodes(script, 1, run, flags, nnodes="2:2")
    first = start_node(0, ["--snapshot-dir", tmp_path / "memory-0"])
    lost = start_node(1, ["--snapshot-dir", tmp_path / "memory-1"])
    assert wait_for_step(run, 20, first), "the job ended before step 20: the node was never lost"
    kill_node(lost)
    lost_at = time.time()
    done_before = max(e["step"] for e in metrics(run, 0, "step") if e["time"] < lost_at)
    new = start_node(1, ["--snapshot-dir", tmp_path / "memory-new"], log=f"{run}-node1-new.log")
    ended = [finish(agent, lost_at + 120) for agent in (first, new)]
    assert all(code == 0 and not hung for code, _, hung in ended), [output[-3000:] for _, output, _ in ended]
    loads = [e for r in range(2) for e in metrics(run, r, "load") if e["time"] > lost_at]
    assert {(e["step"], e["source"]) for e in loads} == {(loads[0]["step"], "memory")} and len(loads) == 2
    assert done_before - 1 <= loads[0]["step"] <= done_before + 1, (done_before, loads)
    assert "ranks [1] had none (a replaced node): their records from the replicas, the model and optimizer from " \
           "rank 0" in ended[0][1]
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]


def test_a_node_that_joins_an_elastic_job_is_admitted_at_a_saved_step(tmp_path):
    # One node of an elastic job (--nnodes 1:2) trains alone; a second one starts after step 5. torchrun
    # admits it only in a new rendezvous round: the first node's agent sees it waiting, stops its
    # workers with SIGTERM (uncounted: a membership change, not a failure), they save the step in
    # progress, and both nodes go on with 4 ranks from that step. Then both are preempted.
    run, flags = tmp_path / "grow", [*SMALL, "--steps", 10_000, "--save-every", 10_000]
    start_node = nodes("fsdp/train.py", 2, run, flags, nnodes="1:2")
    first = start_node(0)
    assert wait_for_step(run, 5, first), "the job ended before step 5"
    # The second node starts through run.sh, as a user would: the run folder's lock is held by the job,
    # which a node of it (its RDZV_ID) joins (another job may not: test_ddp.py).
    env = {**os.environ, "NNODES": "1:2", "RDZV_ENDPOINT": start_node.endpoint, "RDZV_ID": start_node.rdzv_id,
           "OMP_NUM_THREADS": "1", "RDZV_CONF": f"{ELASTIC_RDZV_CONF},is_host=0"}  # (both "nodes" match the host)
    second = start(["bash", "run.sh", "fsdp", "2", "--run-dir", str(run), *map(str, flags)], env, log=f"{run}-node1.log")
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


# Stand-ins for Slurm's commands, as Slurm 22.05 treated docs/slurm.sbatch (job 42). srun runs a step
# that, like run.sh's workers, saves and exits 143 on SIGTERM (or exits $STEP_EXIT at once). scancel
# signals the batch shell (--batch) or the steps (--signal); a plain one cancels the job: TERM to both.
# scontrol requeue also sends TERM to both. Then the job refuses scancel: at once after a cancel; after a
# requeue (COMPLETING for KillWait) with "try again later", retried in the foreground until the batch shell ends.
STAND_INS = {
    "srun": 'echo $$ > "$STATE/step.pid"\n[ -n "${STEP_EXIT:-}" ] && exit "$STEP_EXIT"\n'
            'trap \'kill $!; echo saved >> "$STATE/log"; exit 143\' TERM\ntouch "$STATE/ready"\nsleep 120 & wait $!\n',
    "scancel": '''if [ -e "$STATE/requeued" ]; then
  echo "scancel: error: Job can not be altered now, try again later" >&2
  while kill -0 "$(cat "$STATE/batch.pid")" 2>/dev/null; do sleep 0.05; done; exit 1
fi
[ -e "$STATE/cancelled" ] && { echo "scancel: error: Job/step already completing or completed" >&2; exit 1; }
case "$1" in
  --batch) kill -"${2#--signal=}" "$(cat "$STATE/batch.pid")" ;;
  --signal=*) kill -"${1#--signal=}" "$(cat "$STATE/step.pid")" ;;
  *) echo cancelled >> "$STATE/log"; touch "$STATE/cancelled"
     kill -TERM $(cat "$STATE/batch.pid" "$STATE/step.pid") ;;
esac
''',
    "scontrol": '''case "$1" in
  show) echo node0 ;;
  requeue) echo requeued >> "$STATE/log"; touch "$STATE/requeued"
           kill -TERM $(cat "$STATE/batch.pid" "$STATE/step.pid") 2>/dev/null; exit 0 ;;
esac
''',
}


@pytest.mark.parametrize("slurm_sends, step_exit, code, log", [
    ("USR1", None, 143, ["saved", "requeued"]),  # the limit's warning, --signal=B:USR1@60: to the batch shell
    ("scancel --batch --signal=USR1 42", None, 143, ["saved", "requeued"]),  # the same by hand
    ("scancel --signal=TERM 42", None, 143, ["saved", "requeued"]),  # to the steps only
    ("scancel 42", None, 143, ["cancelled", "saved"]),  # the trap's scancel is refused; no requeue follows
    ("scontrol requeue 42", None, 143, ["requeued", "saved"]),  # by Slurm, once; the trap's scancel must not block
    (None, 3, 3, []),  # a stop (a full disk): not requeued
])
def test_the_readme_slurm_file_saves_the_step_and_requeues_only_when_slurm_does_not_end_the_job(
        tmp_path, slurm_sends, step_exit, code, log):
    script = tmp_path / "train.sbatch"
    script.write_text((REPO / "docs" / "slurm.sbatch").read_text())
    assert "bash run.sh fsdp" in script.read_text()
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(), state.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", **({"STEP_EXIT": str(step_exit)} if step_exit else {})}
    batch = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env)
    (state / "batch.pid").write_text(f"{batch.pid}\n")
    if slurm_sends:
        while not (state / "ready").exists():  # the step is up, its trap set
            assert batch.poll() is None, "the batch file ended before its step started"
            time.sleep(0.01)  # polling for the file the stand-in step writes, not waiting for a moment
        if slurm_sends == "USR1":
            os.kill(batch.pid, signal.SIGUSR1)
        else:
            subprocess.run(slurm_sends.split(), env=env, check=True)
    try:
        assert batch.wait(timeout=5) == code  # promptly: a blocked scancel would hold it until KillWait's SIGKILL
    finally:
        batch.kill(), batch.wait()  # reaped, so that a retrying stand-in scancel sees it gone
    assert ((state / "log").read_text().splitlines() if (state / "log").exists() else []) == log
