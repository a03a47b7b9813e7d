"""A short chaos soak: every fault kind once, each fired at a step of training under the real torchrun,
each job checked against its uninterrupted reference."""
import json

import pytest

from harness import chaos
from harness.chaos import KINDS
from conftest import run_sh

# The kinds without a test of their own, each on the smallest job it allows (--ranks 1; sigstop takes
# 2, as only a peer notices a hang; it freezes an FSDP rank with an async save on, whose save group has
# a timeout of its own too). sigstop comes first: it mostly waits (its peer's timeout; the peer then
# SIGKILLs it, where torchrun would wait 30 s) while the other slot of --jobs 2 runs the rest. The others
# have tests of their own in the suite, and `bash run.sh chaos` runs them all: node-lost (test_scaleout.py;
# --survivors: test_survivors.py), preempt and crash-at-step (test_ddp.py's preemption and docstring-launch
# tests), crash-in-save
# (test_ddp.py, test_rpc.py), async-in-flight (test_fsdp.py), damage-newest (test_ddp.py's truncated
# checkpoint), sigkill (test_compare.py's goodput test kills a worker under torchrun); two-faults, a
# second crash recovered as the first (rpc's: test_rpc.py), only there; disk-lost (test_archive.py's lost
# run folder resumed from the archive).
OWN_TESTS = {"node-lost", "preempt", "crash-at-step", "crash-in-save", "async-in-flight", "damage-newest",
             "two-faults", "sigkill", "disk-lost", "crash-in-snapshot"}  # the last: test_ddp.py's docstring launch
# --survivors' own: two ranks killed together, a spare's death then a rank's, a replacement's death as it
# joins. Only `bash run.sh chaos` runs them (the README's soak), for the suite's time (15-20 s each here).
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
