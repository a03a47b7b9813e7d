"""DDP end to end on CPU with gloo: crashes and restarts under the real torchrun end bitwise equal."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from common.checkpoint import step_name
from common.config import load_script, parse_config
from conftest import REPO, SMALL, metrics, run_sh, summary, torchrun

SCRIPT = "ddp/train.py"


def single(run_dir, *flags, env=None):
    """One process, no torchrun: `python ddp/train.py` (a process group of one)."""
    proc = subprocess.run([sys.executable, SCRIPT, "--run-dir", str(run_dir), *map(str, flags)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_crash_at_step_resumes_bitwise(tmp_path, ddp_reference):
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, "--crash-at-step", 10)
    assert "injected crash: rank 1 after step 10" in proc.stderr
    assert "resuming from step 8" in proc.stdout
    result = summary(tmp_path)
    assert result["restarts"] == 1 and result["resumed_from_step"] == 8
    assert result["param_digest"] == summary(ddp_reference)["param_digest"]


def test_crash_in_save_ignores_the_torn_checkpoint(tmp_path, ddp_reference):
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, "--crash-in-save", 8)
    assert "injected crash: rank 0 while saving step 8" in proc.stderr
    result = summary(tmp_path)
    assert result["resumed_from_step"] == 4  # the step-8 file was never committed
    assert result["param_digest"] == summary(ddp_reference)["param_digest"]
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ckpts == [step_name(s, ".pt") for s in (8, 12, 16)]  # keep 3; the torn temp file is gone


def test_truncated_latest_checkpoint_falls_back_to_the_previous(tmp_path, ddp_reference):
    shutil.copytree(ddp_reference / "ckpt", tmp_path / "ckpt")
    latest = tmp_path / "ckpt" / step_name(16, ".pt")
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL)
    assert f"checkpoint {latest} unreadable" in proc.stdout and "resuming from step 12" in proc.stdout
    assert summary(tmp_path)["resumed_from_step"] == 12
    assert summary(tmp_path)["param_digest"] == summary(ddp_reference)["param_digest"]


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, ddp_reference):
    shutil.copytree(ddp_reference / "ckpt", tmp_path / "ckpt")
    for path in (tmp_path / "ckpt").iterdir():
        path.write_bytes(path.read_bytes()[:100])
    proc = subprocess.run([sys.executable, SCRIPT, "--run-dir", tmp_path, *SMALL], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: no checkpoint in" in proc.stderr
    assert "starting fresh" not in proc.stdout and not (tmp_path / "summary.json").exists()


def test_two_crashes_resume_twice(tmp_path, ddp_reference):
    # First launch dies at step 6 with no restarts left; the relaunch dies again at 14 and is restarted.
    first = torchrun(SCRIPT, 2, tmp_path, *SMALL, "--crash-at-step", 6, max_restarts=0, check=False)
    assert first.returncode != 0
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, "--crash-at-step", 14, "--crash-rank", 0)
    assert "resuming from step 4" in proc.stdout and "resuming from step 12" in proc.stdout
    result = summary(tmp_path)
    assert (result["resumed_from_step"], result["restarts"]) == (12, 1)
    assert result["param_digest"] == summary(ddp_reference)["param_digest"]
    loads = [e["step"] for e in metrics(tmp_path, 0, "load")]
    assert loads == [4, 12]


def test_resume_at_another_world_size(tmp_path, ddp_reference):
    shutil.copytree(ddp_reference / "ckpt", tmp_path / "ckpt")
    # One process loads the 2-rank checkpoint of step 16: exactly the saved weights...
    proc = single(tmp_path, *SMALL)
    assert "resuming from step 16" in proc.stdout
    assert "world size changed from 2 to 1: per-rank RNG re-derived" in proc.stdout
    assert summary(tmp_path)["param_digest"] == summary(ddp_reference)["param_digest"]
    # ...and trains on from there.
    single(tmp_path, *SMALL, "--steps", 20)
    result = summary(tmp_path)
    assert (result["world_size"], result["steps"], result["resumed_from_step"]) == (1, 20, 16)


def test_loss_falls_on_the_synthetic_task_and_mfu_is_logged(tmp_path):
    # PEAK_TFLOPS gives the CPU a peak, so the MFU figures that a GPU run logs are checked here too.
    single(tmp_path, "--steps", 150, "--save-every", 150, "--log-every", 1000, env={"PEAK_TFLOPS": "0.5"})
    steps, result = metrics(tmp_path, 0, "step"), summary(tmp_path)
    losses = [e["loss"] for e in steps]
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])
    flops_per_token = 6 * result["params"]  # one rank: MFU = 6 x params x tokens/s over the peak
    for e in steps:
        assert e["mfu"] == pytest.approx(flops_per_token * e["tokens_per_s"] / 0.5e12, rel=1e-9)
    assert result["mfu"] == pytest.approx(flops_per_token * result["tokens_per_s"] / 0.5e12, rel=1e-9)


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--steps", "0"], "--steps must be > 0"),
    (["--save-every", "-1"], "--save-every must be > 0"),
    (["--heads", "3"], "--heads 3 does not divide --dim 64"),
    (["--batch-size", "7"], "--batch-size 7 (the global batch) does not split evenly over 2 ranks"),
    (["--data", "/no/such/file.txt", "--vocab", "256"], "--data /no/such/file.txt: no such file"),
    (["--run-dir", "/etc/hostname/run"], "--run-dir /etc/hostname/run is not writable"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    ([], "PEAK_TFLOPS (the device's bf16 peak, for MFU) must be a positive number, got 'fast'"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path, monkeypatch, capsys):
    # The check run.sh does before torchrun starts workers (and each worker again at start).
    monkeypatch.setenv("WORLD_SIZE", "2")
    if "PEAK_TFLOPS" in message:
        monkeypatch.setenv("PEAK_TFLOPS", "fast")
    ddp = load_script(REPO / SCRIPT)
    run_dir = [] if "--run-dir" in flags else ["--run-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        parse_config(ddp.Config, ddp.check, [*run_dir, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_run_sh_rejects_bad_input_before_starting_workers(tmp_path):
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, "--stepz", 10)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "unrecognized arguments: --stepz" in proc.stderr and "torch.distributed" not in proc.stderr
    for args in (["nonsense"], ["ddp", "four"], []):
        proc = run_sh(*args)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash run.sh")


def test_incompatible_checkpoint_is_refused_and_left_intact(tmp_path):
    single(tmp_path, *SMALL, "--steps", 4)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, *SMALL, "--dim", 64, "--layers", 3)
    assert proc.returncode == 2
    assert "checkpoint was made with dim=32 (this run: 64), layers=2 (this run: 3)" in proc.stderr
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_trains_on_a_text_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 50)
    proc = single(tmp_path / "run", *SMALL, "--steps", 8, "--data", text, "--vocab", 256)
    assert "no checkpoint, starting fresh" in proc.stdout
    result = summary(tmp_path / "run")
    assert result["world_size"] == 1 and result["steps"] == 8 and result["final_loss"] < 5.6  # < ln 256
