"""--survivors: a dead or frozen rank is replaced alone (by a spare when one waits), the other ranks keep
their processes, and the job ends with the weights of one that never failed (tiers/survivors.py)."""
import contextlib
import io
import re
import time

import pytest

from conftest import (DROPOUT, LONG, LOOPBACK, SMALL, listening, metrics, named_on_the_network, refused, summary,
                      torchrun, wait_for_step)
from harness import launch

SCRIPT = "ddp/train.py"


def survivors_run(run_dir, *flags, spares=0, script=SCRIPT, timeout=240, wrap=None, while_running=None):
    """A --survivors job of 2 ranks; returns its output, after checking that it exited 0 with no Traceback.
    `wrap(command)`: the command that runs the launcher's; `while_running(proc)`: a look at it as it runs."""
    cmd, env = launch.survivors_job(script, 2, run_dir, flags, spares)
    proc = launch.start(wrap(cmd) if wrap else cmd, env, run_dir / "job.log")
    if while_running:
        while_running(proc)
    code, output, hung = launch.finish(proc, time.time() + timeout)
    assert code == 0 and not hung and "Traceback" not in output, output[-5000:]
    return output


def process_story(run_dir, rank):
    """(the pids of rank `rank`'s start events, in order; its recovered events)."""
    return [e["pid"] for e in metrics(run_dir, rank, "start")], metrics(run_dir, rank, "recovered")


def test_a_frozen_rank_is_fenced_and_replaced_cold_while_the_survivor_keeps_its_process(tmp_path, ddp_reference):
    # Rank 1 stops itself (SIGSTOP) after step 6: the supervisor kills it (a fence: it can never come
    # back), and a new process takes rank 1's place and restores step 5 from the memory tier with rank 0.
    # Meanwhile (frozen: the job waits) the job on one machine listens on the loopback only, its store
    # and gloo, even where the host's name resolves to its network address.
    def loopback_only(proc):
        assert wait_for_step(run, 6, proc), "the job ended before step 6: the freeze never came"
        sockets = listening(proc.pid)
        assert sockets and all(address in LOOPBACK for address, _ in sockets), sockets
    run = tmp_path / "run"
    output = survivors_run(run, *SMALL, *DROPOUT, "--freeze-at-step", 6, "--crash-rank", 1, "--hang-timeout-s", 2,
                           wrap=lambda cmd: named_on_the_network(cmd, tmp_path), while_running=loopback_only)
    assert "injected freeze: rank 1 after step 6" in output
    # Stopped for 2 s, or silent 4 s after rank 0 reported its collective's timeout: whichever comes first.
    assert re.search(r"supervisor: rank 1 \(slot 1\) (stopped for 2|held up generation 0 for 4) s: frozen, killed", output)
    survivor, recovered = process_story(run, 0)
    assert len(survivor) == 1 and [(e["pid"], e["step"]) for e in recovered] == [(survivor[0], 5)]
    frozen, replacement = metrics(run, 1, "start")
    assert replacement["restarts"] == 1 and replacement["launched_at"] > recovered[0]["lost_at"]
    assert summary(run)["param_digest"] == summary(ddp_reference)["param_digest"]


@pytest.mark.parametrize("flags, message", [
    (["--spares", 1], "--spares needs --survivors"),
    (["--survivors", "--spares", -1], "--spares must be >= 0"),
    (["--survivors", "--spares", 100000, "--dim", 1024, "--layers", 24, "--heads", 16],
     "processes need about"),
])
def test_a_layout_that_cannot_run_is_refused_in_one_line(flags, message):
    assert message in refused(SCRIPT, *flags)


def test_survivors_on_elastic_nodes_or_without_the_launcher_is_refused_in_one_line(monkeypatch, tmp_path):
    # Its nodes keep their numbers: a fixed count, each told its own, and where node 0 serves the store.
    for nnodes, node, endpoint in [("1:2", "0", "localhost:1"), ("2", None, "localhost:1"), ("2", "0", None)]:
        monkeypatch.setenv("NNODES", nnodes)
        for name, value in (("NODE_RANK", node), ("RDZV_ENDPOINT", endpoint)):
            monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr := io.StringIO()):
            launch.supervise(SCRIPT, 2, ["--survivors"], 0, 15.0)
        assert exit_.value.code == 2 and stderr.getvalue().count("\n") == 1, stderr.getvalue()
        assert "takes a fixed NNODES, each node's NODE_RANK and RDZV_ENDPOINT" in stderr.getvalue()
    monkeypatch.delenv("FT_STORE", raising=False)
    from tiers.survivors import Team
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr := io.StringIO()):
        Team(300, 15)
    assert exit_.value.code == 2 and "runs under run.sh" in stderr.getvalue()
    assert launch.survivors_layout(["--run-dir", str(tmp_path), "--survivors", "--spares", "2"]) == (True, 2, 15.0)


def test_fsdp_rank_0_dies_in_an_async_save_a_spare_takes_its_shards_and_the_save_is_never_loaded(tmp_path,
                                                                                                fsdp_reference):
    # FSDP's shards belong to the group they were made on: the survivor builds its model again over the
    # re-formed group and restores its shards from the memory tier, the spare rank 0's from rank 0's
    # slot. Rank 0 dies in the background write of step 8's checkpoint, its shards written but not
    # committed: the survivor's part of that save fails with the group, and step 8 is never loaded.
    output = survivors_run(tmp_path, *SMALL, *DROPOUT, "--async-save", "--crash-in-save", 8, script="fsdp/train.py",
                           spares=1)
    assert "injected crash: rank 0 while saving step 8" in output
    assert "rank 1: the save of step 8 in flight when a peer was lost: not committed" in output
    survivor, recovered = process_story(tmp_path, 1)
    assert len(survivor) == 1 and [e["pid"] for e in recovered] == survivor and recovered[0]["step"] >= 8
    assert [e["step"] for e in metrics(tmp_path, 0, "load")] == [recovered[0]["step"]]  # from memory, not step 8's
    assert summary(tmp_path)["param_digest"] == summary(fsdp_reference)["param_digest"]


def test_a_node_lost_whole_leaves_its_rank_to_a_spare_of_the_other_node_with_its_shards_from_the_replica(tmp_path):
    # Two nodes of one FSDP rank, each with a memory of its own (--snapshot-dir); node 0 runs a spare.
    # After step 20 node 1 is lost whole: its supervisor and its processes SIGKILLed at once. Rank 0 keeps
    # its process; node 0's supervisor, finding node 1 silent for --hang-timeout-s, gives rank 1 to its
    # spare, which takes rank 1's shards and RNG from the replica rank 0 kept (the memory tier's, across
    # nodes) and its step from the step rank 0 restores: the job ends with an uninterrupted job's weights.
    script, flags = "fsdp/train.py", [*LONG, "--hang-timeout-s", 2]  # the first disk save at step 60
    reference = tmp_path / "reference"
    torchrun(script, 2, reference, *LONG)
    run, endpoint = tmp_path / "run", f"localhost:{launch.free_port()}"

    def start_node(node, spares):
        cmd, env = launch.survivors_job(script, 1, run, [*flags, "--snapshot-dir", tmp_path / f"memory-{node}"],
                                        spares, nnodes=2, node=node, endpoint=endpoint)
        return launch.start(cmd, env, tmp_path / f"node{node}.log")
    first, lost = start_node(0, spares=1), start_node(1, spares=0)
    assert wait_for_step(run, 20, first), "the job ended before step 20: the node was never lost"
    launch.kill_node(lost)
    lost_at = time.time()
    code, output, hung = launch.finish(first, lost_at + 120)
    assert code == 0 and not hung and "Traceback" not in output, output[-5000:]
    assert "supervisor: rank 1 (slot 1000) lost with node 1 (silent for 2 s)" in output
    assert "ranks [1] had none (a replaced node): their records from the replicas, their shards from the ranks" \
           " that kept them" in output
    survivor, recovered = process_story(run, 0)
    assert len(survivor) == 1 and [e["pid"] for e in recovered] == survivor
    spare = metrics(run, 1, "start")[-1]
    assert spare["launched_at"] < lost_at and [e["step"] for e in metrics(run, 1, "load")] == [recovered[0]["step"]]
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
