"""--survivors: a dead or frozen rank is replaced alone (by a spare when one waits), the other ranks keep
their processes, and the job ends with the weights of one that never failed (tiers/survivors.py)."""
import contextlib
import io
import os
import re
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from conftest import (DROPOUT, LONG, LOOPBACK, SMALL, listening, metrics, named_on_the_network, refused, summary,
                      torchrun, wait_for_step)
from harness import launch, procs
from harness.metrics import Watch
from tiers.survivors import HANG_AT_CLAIM, HANG_IN_SETTLE, PROCESS_BYTES, available_memory

SCRIPT = "ddp/train.py"


def survivors_run(run_dir, *flags, nproc=2, spares=0, script=SCRIPT, timeout=240, wrap=None, while_running=None,
                  env=None, faults=""):
    """A --survivors job of `nproc` ranks; returns its output, after checking that it exited 0 with no Traceback.
    `wrap(command)`: the command that runs the launcher's; `while_running(proc)`: a look at it as it runs;
    `faults`: its FT_FAULTS (tiers/faults.py)."""
    cmd, job_env = launch.survivors_job(script, nproc, run_dir, flags, spares)
    proc = procs.start(wrap(cmd) if wrap else cmd, {**job_env, **(env or {}), "FT_FAULTS": faults},
                       run_dir / "job.log")
    if while_running:
        while_running(proc)
    code, output, hung = procs.finish(proc, time.time() + timeout)
    assert code == 0 and not hung and "Traceback" not in output, output[-5000:]
    return output


def store_of(pid):
    """((host, port), the namespace's fd or None) of the job's store, as the worker `pid` was given them."""
    env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    host, port = env["FT_STORE"].rsplit(":", 1)
    return (host, int(port)), env.get("FT_STORE_NETNS")


def reaches(address, uid=None):
    """Whether a process of this machine (of user `uid`, when given) connects to `address`: a child forked
    from this one, outside the job's namespaces, that tries. It exits 1 only for a refused or timed-out
    connection, 2 for anything else (a user who cannot read this python's files: nothing is imported after
    setuid, the address is given as bytes, which needs no codec), so that "cannot connect" is never a crash."""
    child = os.fork()
    if child == 0:
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            with socket.socket() as s:
                s.settimeout(2)
                s.connect((address[0].encode(), address[1]))
            os._exit(0)
        except (ConnectionRefusedError, TimeoutError):
            os._exit(1)
        except BaseException:
            os._exit(2)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    assert status in (0, 1), f"the probe of {address} failed otherwise (exit {status})"
    return status == 0


def as_the_job(pid, nsfd, address):
    """A client of the job's store, made in its namespace (as root, through the worker `pid`'s fd)."""
    from tiers.survivors import in_network_namespace
    fd = os.open(f"/proc/{pid}/fd/{nsfd}", os.O_RDONLY)
    try:
        return in_network_namespace(lambda: TCPStore(*address, is_master=False, timeout=timedelta(seconds=10)), fd)[0]
    finally:
        os.close(fd)


def process_story(run_dir, rank):
    """(the pids of rank `rank`'s start events, in order; its recovered events)."""
    return [e["pid"] for e in metrics(run_dir, rank, "start")], metrics(run_dir, rank, "recovered")


def test_at_4_ranks_every_survivor_hears_at_once_of_a_pause_a_kill_and_a_stop(tmp_path):
    # 4 ranks and a spare. After step 10 rank 1 pauses (alive) 1.5 --hang-timeout-s: its peers'
    # collectives time out, every rank reports it, and the same processes form the next generation (a
    # false alarm: nobody replaced, the memory tier still on). After step 40 rank 2 is SIGKILLed, in
    # step 55's backward rank 1 dies (its peers wait in DDP's reducer, inside torch), after step 70 rank 3
    # is SIGSTOPped, each while the others wait in collectives with one another, not with it: they hear
    # of it from the job's store (the supervisor's abort), not from a timeout. Rank 3 hangs as it
    # recovers from rank 1's death (as a save's write to a disk that hangs would): it reported the loss,
    # and is fenced for not joining the next generation within 2 --hang-timeout-s. Meanwhile
    # the job on one machine listens on the loopback only, even where the host's name resolves to its
    # network address, and its store in a network namespace of its own: no other user (nobody, 65534),
    # nor root outside the job, can connect to it.
    flags = [*SMALL, *DROPOUT, "--steps", "100", "--save-every", "50", "--hang-timeout-s", 3]
    reference = tmp_path / "reference"
    torchrun(SCRIPT, 4, reference, *flags)
    run = tmp_path / "run"

    def meanwhile(proc):
        assert wait_for_step(run, 10, proc), "the job ended before step 10: the pause never came"
        sockets = listening(proc.pid)
        assert sockets and all(address in LOOPBACK for address, _ in sockets), sockets
        store, nsfd = store_of(metrics(run, 0, "start")[-1]["pid"])
        assert nsfd is not None and store[1] not in {port for _, port in sockets}
        with socket.create_server(("127.0.0.1", 0)) as control:  # what user 65534 does reach: a port out here
            assert reaches(control.getsockname(), uid=65534)
        assert not reaches(store, uid=65534) and not reaches(store)
        assert as_the_job(metrics(run, 0, "start")[-1]["pid"], nsfd, store).check(["vacancies"])  # the job's own do
        for step, rank, number in ((40, 2, signal.SIGKILL), (70, 3, signal.SIGSTOP)):
            assert wait_for_step(run, step, proc), f"the job ended before step {step}: rank {rank} never faulted"
            os.kill(metrics(run, rank, "start")[-1]["pid"], number)
    output = survivors_run(run, *flags, nproc=4, spares=1, faults="pause-at-step=10,crash-in-backward=55,rank=1",
                           env={HANG_IN_SETTLE: "3 2"},
                           wrap=lambda cmd: named_on_the_network(cmd, tmp_path), while_running=meanwhile)
    assert "injected pause: rank 1 after step 10" in output
    assert "the job's store in a network namespace of its own" in output
    assert "generation 0 failed with no process lost (a false alarm" in output
    assert "supervisor: rank 2 (slot 2) killed by signal 9: generation 2" in output
    assert "injected crash: rank 1 in the backward of step 55" in output
    assert "fault injection: rank 3 hangs in its recovery from generation 2" in output
    assert "supervisor: rank 3 (slot 3) did not join generation 3 in 6 s of the first rank: frozen, killed" in output
    # The spare, then the restarted slots 2, 1 and 3 (the next spares), forked by the warm parent: the
    # job's weights are those of the torchrun job's fresh processes.
    assert re.findall(r"slot (\d+) \(pid \d+, (.+?)\): takes rank (\d)", output) == [
        ("4", "forked", "2"), ("2", "forked", "1"), ("1", "forked", "3"), ("3", "forked", "3")], output[-3000:]
    stopped = re.search(r"supervisor: rank 3 \(slot 1\) stopped for ([\d.]+) s: frozen, killed", output)
    assert stopped and float(stopped[1]) < 3, output[-3000:]  # learnt from the steps, not the hang timeout
    # Rank 0 kept its process through the five; each fault cost one new process at most.
    for rank, processes in enumerate((1, 2, 2, 3)):
        assert len(metrics(run, rank, "start")) == processes, (rank, metrics(run, rank, "start"))
    assert [e["generation"] for e in metrics(run, 0, "recovered")] == [1, 2, 4, 5]  # (3 never formed)
    assert [e["generation"] for e in metrics(run, 1, "recovered")] == [1, 2, 5]  # (a newcomer from 4)
    heard_at_once(run, 4, (2, 5))  # (the paused rank heard of generation 1 on waking; 4 waited for the fence)
    assert [e["source"] for e in metrics(run, 0, "load")] == ["memory"] * 4
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]


def test_what_the_store_says_is_checked_a_bogus_claim_is_posted_again_and_a_claimant_that_never_joins_fenced(
        tmp_path, ddp_long_reference):
    # Written into the job's store after step 10, as a process that got into it could (root here,
    # through the job's namespace): vacancy 1, which is no vacancy (it crashed the supervisor: a
    # traceback), and vacancy 2 claimed in advance for slot 0 by pid 1, no process of the job. After step
    # 30 rank 1 is SIGKILLed: its vacancy 2 went to nobody (no bound). It is posted again as vacancy 3,
    # whose claimant then hangs (a fault: not stopped, so only the missing join shows it): it is fenced
    # within 2 --hang-timeout-s, and another process takes the rank. Each is one line; the job ends with
    # the untouched job's weights.
    run = tmp_path / "run"

    def writes(proc):
        assert wait_for_step(run, 10, proc), "the job ended before step 10"
        address, nsfd = store_of(metrics(run, 0, "start")[-1]["pid"])
        store = as_the_job(metrics(run, 0, "start")[-1]["pid"], nsfd, address)
        assert store.add("vacancies", 1) == 1
        store.set("vacancy/1", "x y z")
        store.compare_set("claim/2", "", "0 1")
        assert wait_for_step(run, 30, proc), "the job ended before step 30"
        os.kill(metrics(run, 1, "start")[-1]["pid"], signal.SIGKILL)
    output = survivors_run(run, *LONG, "--hang-timeout-s", 2, spares=1, while_running=writes, env={HANG_AT_CLAIM: "3"})
    assert "supervisor: vacancy/1 in the job's store is not this job's: ignored" in output
    assert "slot 2: vacancy/1 in the job's store is not a vacancy: ignored" in output
    assert "supervisor: claim/2 in the job's store is not this job's: ignored" in output
    assert re.search(r"supervisor: rank 1 \(claimed by no process of the job\) posted again: generation \d+", output)
    # Its claimant: the spare (slot 2), or slot 1 started again, as fast now (forked) and waiting as well.
    hung = re.search(r"fault injection: slot (\d) hangs after it claimed vacancy 3", output)
    assert hung, output[-3000:]
    assert re.search(rf"supervisor: rank 1 \(slot {hung[1]}\) did not join generation \d+ in 4 s of its claim: frozen, "
                     "killed", output), output[-3000:]
    assert re.search(r"slot \d \(pid \d+, forked\): takes rank 1", output.split("did not join generation")[1])
    assert summary(run)["param_digest"] == summary(ddp_long_reference)["param_digest"]


def wait_for_line(proc, pattern, count=1, timeout=120):
    """The `count`-th match of `pattern` in the job's output, or None if the job ended (or `timeout` s
    passed) first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        found = list(re.finditer(pattern, proc.log.read_text(errors="replace")))
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.05)  # polling the job's output for the line, not waiting for a moment
    return None


STEPS_300 = [*SMALL, *DROPOUT, "--steps", "300", "--save-every", "100"]  # room for several failures in a row


@pytest.fixture(scope="module")
def ddp_300_reference(tmp_path_factory):
    """The uninterrupted 2-rank job of STEPS_300 that the tests of many failures compare with."""
    run_dir = tmp_path_factory.mktemp("ddp-300-reference")
    torchrun(SCRIPT, 2, run_dir, *STEPS_300)
    return run_dir


def never_ran(pid, timeout=60):
    """Whether process `pid`, a child the supervisor does not know of, has exited (a zombie of the
    supervisor, the subreaper, until it ends; or gone), waiting up to `timeout` s for it to."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)  # polling /proc for its exit, not waiting for a moment
    return False


def test_the_warm_parent_forks_each_new_process_and_when_it_dies_a_fresh_interpreter_stands_in(tmp_path,
                                                                                                 ddp_300_reference):
    # Every process of the node is forked by the warm parent (harness/warm.py), which has imported torch
    # and the script: the first launch's, and each replacement. After step 10 rank 1 is SIGKILLed, and
    # the warm parent SIGKILLs itself in the fork of its replacement (FT_WARM_DIES_IN_FORK), once the
    # child is the supervisor's and before it says its pid: that child exits without running (it would
    # have run beside its slot's next process: audit N7), and the replacement is a fresh interpreter,
    # while the supervisor starts another warm parent. Once that one is ready, rank 0 is SIGKILLed: its
    # replacement is forked again; then that warm parent is SIGKILLed while idle, and the supervisor
    # says so. The ranks kept nothing but their memory snapshots: the job ends with the weights of an
    # uninterrupted one.
    run = tmp_path / "run"
    loaded = r"supervisor: the warm parent \(pid (\d+)\) loaded in [\d.]+ s \(1 threads\)"

    def faults(proc):
        assert wait_for_step(run, 10, proc), "the job ended before step 10"
        first = int(wait_for_line(proc, loaded)[1])
        assert Path(f"/proc/{first}/comm").read_text().strip() == "ft-warm-parent"
        os.kill(metrics(run, 1, "start")[-1]["pid"], signal.SIGKILL)  # its replacement: the parent's fork 3
        orphan = wait_for_line(proc, r"fault injection: the warm parent dies in its fork 3, of pid (\d+)")
        assert orphan, "the warm parent did not die in its fork"
        assert wait_for_line(proc, rf"the warm parent \(pid {first}\) could not fork \(it did not answer\): new "
                                   "processes start as fresh interpreters until another is ready")
        assert never_ran(int(orphan[1])), "the child of a warm parent that died in its fork runs"
        orphans.append(orphan[1])
        second = wait_for_line(proc, loaded, count=2)
        assert second and int(second[1]) != first, "no new warm parent"
        recovered = Watch(run).first("recovered", proc, rank=0)
        assert recovered and wait_for_step(run, recovered["step"] + 5, proc), "the job ended before the second kill"
        os.kill(metrics(run, 0, "start")[-1]["pid"], signal.SIGKILL)
        assert wait_for_line(proc, r"slot 0 \(pid \d+, forked\): takes rank 0"), "rank 0's replacement was not forked"
        os.kill(int(second[1]), signal.SIGKILL)
        assert wait_for_line(proc, rf"the warm parent \(pid {second[1]}\) died \(signal 9\): new processes start as "
                                   "fresh interpreters until another is ready"), "the supervisor never saw it die"
    orphans = []
    output = survivors_run(run, *STEPS_300, "--hang-timeout-s", 3, while_running=faults,
                           env={"FT_WARM_DIES_IN_FORK": "3"})
    # (Before, it ran and claimed rank 1 beside its replacement: "claim/1 in the job's store is not this
    # job's: ignored", a generation more, 5.8 s.)
    assert f"pid {orphans[0]}, " not in output and "not this job's" not in output, output[-3000:]
    assert summary(run)["generation"] == 2  # rank 1's loss, rank 0's
    assert re.search(r"slot 1 \(pid \d+, a fresh interpreter\): takes rank 1", output), output[-3000:]
    assert re.search(r"slot 0 \(pid \d+, forked\): takes rank 0", output), output[-3000:]
    assert [len(metrics(run, rank, "start")) for rank in (0, 1)] == [2, 2]
    assert summary(run)["param_digest"] == summary(ddp_300_reference)["param_digest"]


def test_a_slot_that_keeps_dying_is_retired_if_a_spare_and_ends_the_job_after_a_save_if_a_rank(tmp_path,
                                                                                               ddp_300_reference):
    # 2 ranks and a spare. The idle spare is SIGKILLed 4 times, each time as soon as the warm parent has
    # forked its replacement: the supervisor restarts it 3 times (MAX_RESTARTS), then retires its slot in
    # one line, and the job trains on (before, a spare's fourth death ended the whole job, exit 1). Then
    # rank 1's process is SIGKILLed 4 times, each time once the group has re-formed with its replacement
    # and trained 5 steps: at slot 1's fourth death the job must end, but first, as on a preemption, its
    # rank is taken once more and every rank saves its next step (before, the survivors were SIGKILLed
    # mid-step, nothing saved). The job exits 1 (a failure: no requeue), and run again resumes from that
    # step with the weights of an uninterrupted job.
    run = tmp_path / "run"
    loaded = r"supervisor: the warm parent \(pid (\d+)\) loaded in"
    cmd, env = launch.survivors_job(SCRIPT, 2, run, [*STEPS_300, "--hang-timeout-s", "3"], 1)
    job = procs.start(cmd, env, tmp_path / "job.log")
    assert wait_for_step(run, 5, job), "the job ended before step 5"
    warm, killed = int(wait_for_line(job, loaded)[1]), set()
    ranks = {metrics(run, r, "start")[-1]["pid"] for r in (0, 1)}
    for _ in range(4):
        spare = set()
        while not spare and job.poll() is None:  # the supervisor's child that holds no rank, not yet killed
            spare = set(procs.children(job.pid)) - {warm} - ranks - killed  # (forked twice: the supervisor's)
            time.sleep(0.01)  # polling /proc for the fork, not waiting for a moment
        assert len(spare) == 1, f"the spare was never forked again ({spare})"
        os.kill(*spare, signal.SIGKILL)
        killed |= spare
    assert wait_for_line(job, r"supervisor: slot 2, a spare, failed 4 times \(signal 9\): retired; the job "
                              "trains on without it"), "the spare's slot was not retired before the job ended"
    for kill in range(4):
        if kill:
            recovered = Watch(run).until(lambda e: e["event"] == "recovered" and e["rank"] == 0
                                         and e["generation"] == kill, job)
            assert recovered and wait_for_step(run, recovered["step"] + 5, job), f"the job ended before kill {kill + 1}"
        last = max(e["step"] for e in metrics(run, 0, "step"))
        os.kill(metrics(run, 1, "start")[-1]["pid"], signal.SIGKILL)
    code, output, hung = procs.finish(job, time.time() + 120)
    assert code == 1 and not hung and "Traceback" not in output, output[-5000:]
    assert "supervisor: slot 1 failed 4 times (signal 9): the job ends once its ranks have saved their next step" \
           in output, output[-3000:]
    saved = re.search(r"the job ends \(its supervisor says why\): step (\d+) saved, exiting", output)
    assert saved and "supervisor: the job saved its step and ends (exit 1): slot 1 failed 4 times" in output
    assert int(saved[1]) < 100 and int(saved[1]) >= last - 1
    assert [len(metrics(run, rank, "start")) for rank in (0, 1)] == [1, 5]
    again = survivors_run(run, *STEPS_300)
    assert f"resuming from step {saved[1]}" in again, again[-3000:]
    assert summary(run)["param_digest"] == summary(ddp_300_reference)["param_digest"]


@pytest.mark.parametrize("flags, message", [
    (["--spares", 1], "--spares needs --survivors"),
    (["--survivors", "--spares", -1], "--spares must be >= 0"),
    (["--survivors", "--spares", 1000], "1001 processes on a node, at most 1000 (a node's slots)"),
    # Each spare a whole process, torch's memory included: more than this node holds, whatever it holds.
    (["--survivors", "--spares", min(998, 2 * available_memory() // PROCESS_BYTES)], "processes need about"),
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
            launch.supervise(SCRIPT, 2, ["--survivors"], 0, 15.0, dict(os.environ))
        assert exit_.value.code == 2 and stderr.getvalue().count("\n") == 1, stderr.getvalue()
        assert "takes a fixed NNODES, each node's NODE_RANK and RDZV_ENDPOINT" in stderr.getvalue()
    monkeypatch.delenv("FT_STORE", raising=False)
    from tiers.survivors import Team
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr := io.StringIO()):
        Team(300, 15)
    assert exit_.value.code == 2 and "runs under run.sh" in stderr.getvalue()
    assert launch.survivors_layout(["--run-dir", str(tmp_path), "--survivors", "--spares", "2"]) == (True, 2, 15.0)


def heard_at_once(run_dir, world, generations):
    """The recovered events of generations `generations`, checked: every survivor of each (a process of
    the rank that kept its pid) saw the loss within 1 s of the others and trained again within 1 s plus
    one median step of the job (the ends of torch's own waits included: a save's, the clipping's)."""
    step_s = sorted(e["step_s"] for r in range(world) for e in metrics(run_dir, r, "step"))
    step_s = step_s[len(step_s) // 2]
    events = [e for r in range(world) for e in metrics(run_dir, r, "recovered")]
    for gen in generations:
        seen = [e for e in events if e["generation"] == gen]
        assert len(seen) >= world - 1, (gen, events)
        assert max(e["lost_at"] for e in seen) - min(e["lost_at"] for e in seen) < 1, seen
        assert all(e["recover_s"] < 1 + step_s for e in seen), (step_s, seen)
    return events


def test_fsdp_rank_0_lost_in_a_synchronous_save_then_in_the_clipping_costs_the_survivors_under_a_second(
        tmp_path, fsdp_four_ranks):
    # 4 ranks and a spare. Rank 0 dies in step 8's save, its shards written, before its commit: the other
    # ranks wait in DCP's collectives (one, in gloo's broadcast tree, from a live peer: 300 s before the
    # groups were ended whole). Its replacement dies in step 14's gradient clipping, as the others
    # all-reduce the norm inside DTensor. Each time every survivor hears within 1 s and trains again.
    output = survivors_run(tmp_path, *SMALL, script="fsdp/train.py", nproc=4, spares=1,
                           faults="crash-in-save=8,crash-in-clip=14,rank=0")
    assert "injected crash: rank 0 while saving step 8" in output
    assert "injected crash: rank 0 in the gradient clipping of step 14" in output
    assert [len(metrics(tmp_path, rank, "start")) for rank in range(4)] == [3, 1, 1, 1]
    heard_at_once(tmp_path, 4, (1, 2))
    assert not (tmp_path / "ckpt" / "step-00000008" / ".metadata").exists()  # never committed
    assert summary(tmp_path)["param_digest"] == summary(fsdp_four_ranks)["param_digest"]


def test_fsdp_a_rank_lost_during_an_async_upload_and_rank_0_in_its_commit_never_commit_late(tmp_path,
                                                                                         fsdp_four_ranks):
    # FSDP's shards belong to the group they were made on: the survivors build the model again over the
    # re-formed group and restore their shards from the memory tier, the spare the dead rank's from its
    # replica. Rank 2 dies as it starts writing step 8's shards in the background, rank 0 alive: its
    # save's collectives, on a gloo group of their own, end with the generation, and rank 0 never
    # commits it. Then rank 0 dies in step 12's background commit, its shards written: never loaded.
    output = survivors_run(tmp_path, *SMALL, "--async-save", script="fsdp/train.py", nproc=4, spares=1,
                           faults="crash-in-write=8,crash-in-save=12,rank=2")
    assert "injected crash: rank 2 while writing its shards of step 8" in output
    assert "injected crash: rank 0 while saving step 12" in output
    assert "rank 0: the save of step 8 in flight when a peer was lost: not committed" in output
    assert "rank 1: the save of step 12 in flight when a peer was lost: not committed" in output
    assert [len(metrics(tmp_path, rank, "start")) for rank in range(4)] == [2, 1, 2, 1]
    heard_at_once(tmp_path, 4, (1, 2))
    for step in (8, 12):  # neither save ever committed, nor loaded: every rank restored a memory snapshot
        assert not (tmp_path / "ckpt" / f"step-{step:08d}" / ".metadata").exists()
    assert all(e["source"] == "memory" for e in metrics(tmp_path, 1, "load")), metrics(tmp_path, 1, "load")
    assert summary(tmp_path)["param_digest"] == summary(fsdp_four_ranks)["param_digest"]
