"""A short chaos soak: seeded random faults under the real torchrun, each job checked against its reference."""
import json

from conftest import run_sh


def test_short_chaos_soak_loses_nothing(tmp_path):
    proc = run_sh("chaos", "--trials", 2, "--seed", 7, "--strategies", "ddp,fsdp", "--out", tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    trials = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert len(trials) == 2
    for t in trials:
        assert t["fired"] and t["recovered"] and t["digest_equal"], t
        assert t["bad_loads"] == 0 and not t["hung"], t
    assert "damaged loaded" in proc.stdout  # the table was printed


def test_bad_flag_is_one_line(tmp_path):
    proc = run_sh("chaos", "--strategies", "ddp,nope", "--out", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "bash run.sh chaos: error: unknown: nope (see --help)"
