"""A short chaos soak: every fault kind once, each fired at a step of training under the real torchrun,
each job checked against its uninterrupted reference."""
import json
import random
import re

import pytest

from harness import chaos, chaos_faults
from harness.chaos import FAULTS, KINDS
from conftest import run_sh

# The kinds without a test of their own, each on the smallest job it allows (--ranks 1; sigstop takes
# 2, as only a peer notices a hang; it freezes an FSDP rank with an async save on, whose save group has
# a timeout of its own too). sigstop comes first: it mostly waits (its peer's timeout; the peer then
# SIGKILLs it, where torchrun would wait 30 s) while the other slot of --jobs 2 runs the rest. The others
# have tests of their own in the suite, and `bash run.sh chaos` runs them all: node-lost (test_scaleout.py;
# --survivors: test_etcd.py), preempt and crash-at-step (test_ddp.py's preemption and docstring-launch
# tests), crash-in-save
# (test_ddp.py, test_rpc.py), async-in-flight (test_fsdp.py), damage-newest (test_ddp.py's truncated
# checkpoint), sigkill (test_compare.py's goodput test kills a worker under torchrun); two-faults, a
# second crash recovered as the first (rpc's: test_rpc.py), only there; disk-lost (test_archive.py's lost
# run folder resumed from the archive).
OWN_TESTS = {"node-lost", "preempt", "crash-at-step", "crash-in-save", "async-in-flight", "damage-newest",
             "two-faults", "sigkill", "disk-lost", "crash-in-snapshot"}  # the last: test_ddp.py's docstring launch
# --survivors' own: two ranks killed together, a spare's death then a rank's, a replacement's death as it
# joins. Only `bash run.sh chaos` runs them (docs/testing.md), for the suite's time (15-20 s each here).
CHAOS_ONLY = {"two-at-once", "spare-killed", "replacement-killed"}
PLAN = ["sigstop:fsdp-async", "sigterm:fsdp-async", "transient-read:fsdp-async"]


def test_every_fault_kind_fires_in_training_and_the_job_recovers_bitwise(tmp_path):
    proc = run_sh("chaos", "--plan", ",".join(PLAN), "--ranks", 1, "--jobs", 2, "--seed", 7, "--out", tmp_path,
                  timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "damaged loaded" in proc.stdout and "to workers' launch" in proc.stdout  # the two tables were printed
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert {t["kind"] for t in trials} == set(KINDS) - OWN_TESTS - CHAOS_ONLY
    for t in trials:
        assert t["fired"] and t["recovered"] and t["digest_equal"] and t["passed"], t
        assert t["bad_loads"] == 0 and not t["hung"] and t["restarts"] == t["expected_restarts"], t
    assert all(t["kept"] for t in trials if t["kind"] == "transient-read")
    # Recovery time in its phases, wherever a fault was followed by a restart or a relaunch.
    timed = [t for t in trials if t["expected_restarts"]]
    assert len(timed) == 2
    for t in timed:
        assert t["recovery_s"] > t["detect_s"] > 0 and t["restart_s"] > 0 and t["vs_cold_start"] > 0, t
    # The frozen rank is fenced by its peer once the 5 s hang timeout has passed, not 30 s after it by torchrun.
    [stop] = [t for t in trials if t["kind"] == "sigstop"]
    assert stop["detect_s"] < 25, stop


def test_bad_flag_is_one_line_and_a_folder_of_the_users_is_never_emptied(tmp_path, capsys):
    proc = run_sh("chaos", "--strategies", "ddp,nope", "--out", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "bash run.sh chaos: error: unknown or inapplicable: nope (see --help)"
    (tmp_path / "thesis.tex").write_text("not the soak's")
    with pytest.raises(SystemExit) as exit_:  # the same check, in this process
        chaos.main(["--plan", "sigkill:ddp", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        f"bash run.sh chaos: error: --out {tmp_path} holds files that chaos did not write: name a new or empty folder "
        "(see --help)")
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]


def test_the_faults_fired_from_inside_are_the_faulted_jobs_ft_faults_alone(tmp_path, monkeypatch):
    """A kind that crashes a process from inside asks for it in the FT_FAULTS of the faulted job's
    launches (damage-newest: its first launch's), never on a command line or in a reference's."""
    launched = []
    monkeypatch.delenv("FT_FAULTS", raising=False)
    monkeypatch.setattr(chaos_faults, "start", lambda cmd, env, log: launched.append((cmd, env)))
    monkeypatch.setattr(chaos_faults, "finish", lambda proc, deadline: (1, "", True))
    ref = chaos_faults.Reference("digest", 0.01, 1.0, str(tmp_path / "reference"), {})
    expected = {"crash-at-step": r"crash-at-step=\d+,rank=\d", "two-faults": r"crash-at-step=\d+,rank=\d",
                "crash-in-snapshot": r"crash-in-snapshot=\d+,rank=\d", "crash-in-save": r"crash-in-save=\d+"}
    for strategy in ("ddp", "ddp-survivors"):
        for name, spec in expected.items():
            kind, nproc = FAULTS[name], chaos_faults.processes(strategy, FAULTS[name], 2)
            trial = chaos_faults.Trial(0, strategy, name, nproc, kind.restarts)
            job = chaos_faults.Job(trial, "ddp/train.py", tmp_path / f"{strategy}-{name}", random.Random(0), ref,
                                   [*chaos_faults.JOB_FLAGS, *chaos.STRATEGIES[strategy][1]], 0.0, crash_rank=1)
            kind.prepare(job)
            cmd, env = kind.launch(job)
            assert re.fullmatch(spec, env["FT_FAULTS"]) and str(job.crash_step) in env["FT_FAULTS"], (name, env)
            assert not any(str(arg).startswith("--crash") for arg in cmd), cmd
    job = chaos_faults.Job(trial, "ddp/train.py", tmp_path / "damaged", random.Random(0), ref,
                           list(chaos_faults.JOB_FLAGS), 0.0, crash_rank=1)
    with pytest.raises(chaos_faults.FaultMissed):  # finish() above: the first launch did not crash
        FAULTS["damage-newest"].prepare(job)
    assert launched[-1][1]["FT_FAULTS"] == f"crash-at-step={job.crash_step}" and not job.faults
    assert "FT_FAULTS" not in FAULTS["damage-newest"].launch(job)[1]  # the relaunch, the job proper
    with pytest.raises(SystemExit):  # finish() above: the reference hung
        chaos_faults.reference("ddp", 2, tmp_path)
    assert "FT_FAULTS" not in launched[-1][1]


def test_a_drawn_soak_takes_only_the_strategies_a_kind_applies_to(capsys):
    """--nodes with every strategy: rpc has no kind on real nodes, so no trial draws it (it raised
    IndexError once the first round was over); a choice with no kind at all is refused in one line."""
    drawn = chaos.drawn_plan(chaos.NODE_KINDS, list(chaos.STRATEGIES), random.Random(3))
    trials = [next(drawn) for _ in range(5 * len(chaos.NODE_KINDS))]
    assert all(strategy in FAULTS[kind].strategies for strategy, kind in trials)
    assert {kind for _, kind in trials} == set(chaos.NODE_KINDS)
    with pytest.raises(SystemExit) as exit_:
        chaos.main(["--nodes", "--strategies", "rpc"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().startswith(
        "bash run.sh chaos: error: unknown or inapplicable: the kinds ")
