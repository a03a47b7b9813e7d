"""DDP end to end on CPU with gloo: crashes and restarts under the real torchrun end bitwise equal."""
import hashlib
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from common import checkpoint
from common.checkpoint import checkpoints, step_name
from common.rundir import lock_run_dir
from common.config import parse_config
from tiers.snapshot import default_dir
from tiers.tokens import write_tokens
from harness import launch, procs
from harness.launch import load_script
from harness.procs import free_port
from conftest import (DROPOUT, LONG, LOOPBACK, REPO, SMALL, listening, metrics, named_on_the_network, refused, run_sh, summary,
                      torchrun, wait_for_step)

SCRIPT = "ddp/train.py"


def single(run_dir, *flags, env=None, code=0, preexec_fn=None):
    """One process, no torchrun: `python ddp/train.py` (a process group of one); asserts its exit code."""
    proc = subprocess.run([sys.executable, SCRIPT, "--run-dir", str(run_dir), *map(str, flags)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
                          preexec_fn=preexec_fn)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
    """A one-process job's run folder after 8 steps of SMALL (checkpoints 4 and 8): the starting point
    of the tests that resume it, each in a copy of its own (in_copy)."""
    run_dir = tmp_path_factory.mktemp("ddp-8-steps")
    single(run_dir, *SMALL, "--steps", 8)
    return run_dir


def in_copy(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path, dirs_exist_ok=True)


def files(run_dir):
    """{path: sha256} of every file in the run folder's ckpt/ but run-id (a copied run folder is a run of
    its own, whose first launch gives it an id)."""
    return {p.relative_to(run_dir): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (run_dir / "ckpt").rglob("*") if p.is_file() and p.name != "run-id"}


def docstring_launch_line():
    """The torchrun command the script's docstring shows, continuation lines joined, comments dropped."""
    lines = (REPO / SCRIPT).read_text().split('"""')[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"))
    command = " ".join(line.split("#")[0].strip().rstrip("\\") for line in lines[start:start + 2])
    return " ".join(command.split())


def test_the_docstring_launch_line_survives_a_crash_bitwise(tmp_path, ddp_reference):
    # The line as a user copies it (2 ranks, torchrun restarts, the rendezvous variable), with dropout on:
    # the saved per-rank RNG is what makes the resumed masks equal. The crash is the memory tier's worst
    # moment: the node's two ranks share one copy of the state, each copying half, and rank 1 dies
    # halfway through its half of step 10's, before its record. Step 10 is then not whole; step 9, in the
    # other slot, is: one step is replayed, not the two since the disk's step 8.
    command = docstring_launch_line()
    assert command.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3")
    flags = " ".join(map(str, ["--run-dir", tmp_path, *SMALL, *DROPOUT]))
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "FT_FAULTS": "crash-in-snapshot=10"}
    proc = subprocess.run(["bash", "-c", f"{command} {flags}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "injected crash: rank 1 while copying the memory snapshot of step 10" in proc.stderr
    assert "resuming from step 9 (memory snapshot)" in proc.stdout
    assert [(e["step"], e["source"]) for e in metrics(tmp_path, 1, "load")] == [(9, "memory")]
    result = summary(tmp_path)
    assert result["restarts"] == 1 and result["resumed_from_step"] == 9
    assert result["param_digest"] == summary(ddp_reference)["param_digest"]


def test_launch_without_the_rendezvous_variable_is_refused_in_one_line(tmp_path):
    command = docstring_launch_line().replace("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ", "")
    command = command.replace("--nproc-per-node 2 --max-restarts 3", "--nproc-per-node 1 --max-restarts 1")
    command = command.replace("localhost:0", f"localhost:{free_port()}")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}", TMPDIR=str(tmp_path))  # (the stop's file)
    proc = subprocess.run(["bash", "-c", f"{command} --run-dir {tmp_path} {' '.join(SMALL)}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    # One attempt, one line: the worker's stop exits 2; torchrun's restart finds the stop and ends before
    # importing torch; torchrun exits 1 (and prints its failure report), a stop, not a success.
    assert proc.returncode == 1 and "restart 1: the job has stopped (exit code 2)" in proc.stdout, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "train.py: error:" in line]
    assert len(errors) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in errors[0], proc.stderr[-2000:]
    assert not checkpoints(tmp_path / "ckpt") and not (tmp_path / "summary.json").exists()


def test_crash_in_save_ignores_the_torn_checkpoint(tmp_path, ddp_reference):
    # An async save: rank 0's writer thread dies with the file written, not renamed, while the loop trains
    # on (a synchronous save writes through the same atomic_save, on the main thread). The memory tier is
    # off: its snapshot of step 8 would be loaded, and the fallback on disk go untested.
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, *DROPOUT, "--async-save", "--snapshot-every", 0,
                    faults="crash-in-save=8", restarts=1)
    assert "injected crash: rank 0 while saving step 8" in proc.stderr
    result = summary(tmp_path)
    assert result["resumed_from_step"] == 4  # the step-8 file was never committed
    assert result["param_digest"] == summary(ddp_reference)["param_digest"]
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ckpts == [step_name(s, ".pt") for s in (8, 12, 16)]  # keep 3; the torn temp file is gone


def test_truncated_latest_checkpoint_is_moved_aside_and_keep_1_keeps_the_fresh_save(tmp_path, ddp_reference):
    shutil.copytree(ddp_reference / "ckpt", tmp_path / "ckpt")
    latest = tmp_path / "ckpt" / step_name(16, ".pt")
    damaged = latest.read_bytes()[: latest.stat().st_size // 2]
    latest.write_bytes(damaged)
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, *DROPOUT, "--keep", 1)
    assert f"checkpoint {latest} unreadable" in proc.stdout and "resuming from step 12" in proc.stdout
    assert summary(tmp_path)["resumed_from_step"] == 12
    assert summary(tmp_path)["param_digest"] == summary(ddp_reference)["param_digest"]
    # The damaged file is kept aside, byte for byte; --keep 1 kept the step-16 checkpoint just written.
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert len(names) == 2 and names[0] == step_name(16, ".pt"), names
    assert re.fullmatch(r"step-00000016\.pt\.unreadable-.*", names[1])
    assert (tmp_path / "ckpt" / names[1]).read_bytes() == damaged


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, ddp_reference):
    shutil.copytree(ddp_reference / "ckpt", tmp_path / "ckpt")
    for path in (tmp_path / "ckpt").iterdir():
        path.write_bytes(path.read_bytes()[:100])
    proc = subprocess.run([sys.executable, SCRIPT, "--run-dir", tmp_path, *SMALL], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: no checkpoint in" in proc.stderr
    assert "starting fresh" not in proc.stdout and not (tmp_path / "summary.json").exists()


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


@pytest.fixture(scope="module")
def daly_job(tmp_path_factory):
    """One process, 150 steps of the default model; PEAK_TFLOPS gives the CPU a peak, so the MFU figures
    that a GPU run logs are checked here too. --save-every 0 with an MTBF of 1.8 s, so that the interval
    Young and Daly give is a few steps: sqrt(2 x save x MTBF). Returns (run folder, its output)."""
    run_dir = tmp_path_factory.mktemp("ddp-daly")
    proc = single(run_dir, "--steps", 150, "--save-every", 0, "--mtbf-h", 0.0005, "--log-every", 1000,
                  env={"PEAK_TFLOPS": "0.5"})
    return run_dir, proc.stdout


def test_loss_falls_on_the_synthetic_task_and_mfu_is_logged(daly_job):
    run_dir, _ = daly_job
    steps, result = metrics(run_dir, 0, "step"), summary(run_dir)
    losses = [e["loss"] for e in steps]
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])
    flops_per_token = 6 * result["params"]  # one rank: MFU = 6 x params x tokens/s over the peak
    for e in steps:
        assert e["mfu"] == pytest.approx(flops_per_token * e["tokens_per_s"] / 0.5e12, rel=1e-9)
    assert result["mfu"] == pytest.approx(flops_per_token * result["tokens_per_s"] / 0.5e12, rel=1e-9)


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--steps", "0"], "--steps must be > 0"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--log-every", "0"], "--log-every must be > 0"),
    (["--min-lr", "nan"], "--min-lr must be >= 0, got nan"),
    (["--timeout-s", "-5"], "--timeout-s must be in (0, 604800] (a week), got -5"),
    (["--vocab", "0"], "--vocab must be > 0"),
    (["--device", "gpu"], "--device gpu: choose from auto, cpu, cuda"),
    (["--heads", "3"], "--heads 3 does not divide --dim 64"),
    (["--batch-size", "7"], "--batch-size 7 (the global batch) does not split evenly over 2 ranks"),
    (["--data", "/no/such/file.txt", "--vocab", "256"], "--data /no/such/file.txt: no such file"),
    (["--data", "SHORT", "--vocab", "256"], "bytes, fewer than one sequence (--seq-len 32 + 2)"),
    (["--run-dir", "/etc/hostname/run"], "--run-dir: /etc/hostname/run is not a writable folder"),
    (["--run-dir", "CKPT_IS_A_FILE"], "ckpt is not a writable folder"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    # Token files (tiers/tokens.py), each refused before training, the file never read whole.
    (["--data", "EMPTY.bin"], "is empty"),
    (["--data", "ODD.bin"], "bytes are an odd count"),
    (["--data", "WRONG_MAGIC.tokens"], "but its magic is 20240521"),
    (["--data", "ID_300.bin", "--vocab", "256"], "holds token id 300"),
    (["--data", "A_FOLDER"], "is a folder"),
    (["--val-data", "ODD.bin"], "--val-data "),
    (["--grad-accum", "5"], "--grad-accum 5 does not divide a rank's 12 rows"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
    (["--snapshot-dir", "OTHERS_CAN_WRITE"], "not a folder of this user's alone"),
    (["--device", "cuda"], "--device cuda needs a GPU for each of this node's 1 ranks, found 0"),
    (["--seed", str(2**32)], "--seed must be in [0, 2^32), got 4294967296"),
    (["--timeout-s", str(10**14)], "--timeout-s must be in (0, 604800] (a week), got 100000000000000"),
    # No abbreviation: harness/launch.py, which reads --survivors, --spares and --hang-timeout-s, takes none.
    (["--surv"], "unrecognized arguments: --surv"),
    (["--hang-timeout", "1"], "unrecognized arguments: --hang-timeout 1"),
    (["--survivors", "--spare", "1"], "unrecognized arguments: --spare 1"),
    (["--light-keep", "5"], "--light-keep does nothing without --light-every"),
    ([], "PEAK_TFLOPS (the device's bf16 peak, for MFU) must be a positive number, got 'fast'"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path, monkeypatch):
    # The check run.sh does before torchrun starts workers (and each worker again at start).
    monkeypatch.setenv("WORLD_SIZE", "2")
    if "PEAK_TFLOPS" in message:
        monkeypatch.setenv("PEAK_TFLOPS", "fast")
    if "SHORT" in flags:
        (tmp_path / "short.txt").write_text("too short")
        flags = [str(tmp_path / "short.txt") if f == "SHORT" else f for f in flags]
    files = {"EMPTY.bin": b"", "ODD.bin": b"\x01\x00\x02",
             "WRONG_MAGIC.tokens": np.array([20240521, 1, 64] + [0] * 253, "<i4").tobytes() + bytes(128),
             "ID_300.bin": np.array([5, 300] * 100, "<u2").tobytes()}
    for name in set(files) & set(flags):
        (tmp_path / name).write_bytes(files[name])
    for name, mode in (("A_FOLDER", 0o755), ("OTHERS_CAN_WRITE", 0o777)):
        if name in flags:
            (tmp_path / name).mkdir()
            (tmp_path / name).chmod(mode)
    flags = [str(tmp_path / f) if f in files or f in ("A_FOLDER", "OTHERS_CAN_WRITE") else f for f in flags]
    if "CKPT_IS_A_FILE" in flags:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "ckpt").write_text("not a folder")
        flags = [str(tmp_path / "run") if f == "CKPT_IS_A_FILE" else f for f in flags]
    run_dir = [] if "--run-dir" in flags else ["--run-dir", str(tmp_path)]
    err = refused(SCRIPT, *run_dir, *flags)
    assert message in err, err


def deny_reading_checkpoints(monkeypatch):
    # Root reads any file, whatever its mode (the tests run as root in CI): deny it as a user would be.
    monkeypatch.setattr(checkpoint.os, "access", lambda path, mode: not str(path).endswith(".pt"))


@pytest.mark.parametrize("make, message", [
    (lambda ckpt: torch.save([1, 2], ckpt / step_name(4, ".pt")), "not a checkpoint of these scripts (no config in it)"),
    (lambda ckpt: torch.save({"format": 2, "config": {"mode": "sync", "straggler_timeout": 30.0}},
                             ckpt / step_name(4, ".pt")),  # rpc/ps.py's
     "written by another script (or version): its settings include mode, straggler_timeout"),
    (lambda ckpt: (ckpt.parent / ".lock").mkdir(), ".lock is not a plain file (a link or a folder): remove it"),
    (lambda ckpt: (ckpt.parent / ".lock").symlink_to(ckpt.parent / "elsewhere"), ".lock is not a plain file"),
    (lambda ckpt: torch.save({"format": 2, "config": {}}, ckpt / step_name(4, ".pt")),
     "cannot read it (permission denied): fix its permissions, nothing was moved"),
])
def test_a_run_folder_this_script_cannot_use_is_refused_in_one_line_and_left_alone(make, message, tmp_path,
                                                                                     monkeypatch):
    (tmp_path / "ckpt").mkdir()
    make(tmp_path / "ckpt")
    if "permission" in message:
        deny_reading_checkpoints(monkeypatch)
    before = sorted((p.name, p.is_dir()) for p in tmp_path.rglob("*"))
    err = refused(SCRIPT, "--run-dir", tmp_path)
    assert message in err, err
    assert sorted((p.name, p.is_dir()) for p in tmp_path.rglob("*")) == before


def test_run_sh_rejects_bad_input_before_starting_workers(tmp_path):
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, "--stepz", 10)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "unrecognized arguments: --stepz" in proc.stderr and "torch.distributed" not in proc.stderr
    for args in (["nonsense"], ["ddp", "four"], []):
        proc = run_sh(*args)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash run.sh")


def test_incompatible_checkpoint_is_refused_and_left_intact(tmp_path, eight_steps):
    in_copy(eight_steps, tmp_path)
    before = files(tmp_path)
    # The flags' check (run.sh's preflight, each worker's start) refuses another model shape...
    err = refused(SCRIPT, "--run-dir", tmp_path, *SMALL, "--dim", 64, "--layers", 3)
    assert "checkpoint was made with dim=32 (this run: 64), layers=2 (this run: 3)" in err
    err = refused(SCRIPT, "--run-dir", tmp_path, *SMALL, "--seed", 5)  # ...other samples...
    assert "seed=0 (this run: 5)" in err and "--allow-changes" in err
    err = refused("fsdp/train.py", "--run-dir", tmp_path, *SMALL)  # ...and another script's run folder
    assert "another script's checkpoint (a file: ddp or rpc's)" in err
    assert files(tmp_path) == before
    # ...while a new learning rate and weight decay are applied and said (the saved optimizer's
    # settings do not override them: the step-10 checkpoint's are this run's).
    proc = single(tmp_path, *SMALL, "--steps", 10, "--lr", 0.01, "--weight-decay", 0.05)
    assert "resuming with changed settings: steps 8 -> 10, lr 0.003 -> 0.01, weight_decay 0.1 -> 0.05" in proc.stdout
    saved = torch.load(checkpoints(tmp_path / "ckpt")[0][1], weights_only=True)["optimizer"]["param_groups"]
    assert {group["weight_decay"] for group in saved} == {0.05}
    # The finished run launched again: said, nothing trained, its summary kept as it was; the weights
    # exported (--export) are the summary's.
    summary_before = (tmp_path / "summary.json").read_bytes()
    proc = single(tmp_path, *SMALL, "--steps", 10, "--export", tmp_path / "model.pt")
    assert "the run was finished at step 10: nothing to train (a larger --steps trains on), its summary.json is " \
        "kept" in proc.stdout and (tmp_path / "summary.json").read_bytes() == summary_before
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert checkpoint.param_digest(exported) == summary(tmp_path)["param_digest"]
    lrs = [e["lr"] for e in metrics(tmp_path, 0, "step") if e["step"] > 8]
    ddp = load_script(REPO / SCRIPT)
    cfg = parse_config(ddp.Config, argv=[*SMALL, "--steps", "10", "--lr", "0.01"])
    assert lrs == [ddp.lr_at(cfg, 8), ddp.lr_at(cfg, 9)]


def test_a_second_job_on_the_same_run_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    lock = lock_run_dir(tmp_path)  # what rank 0 of a running job (rendezvous id job42) holds
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    # A node joining a job of several nodes passes the preflight with the job's id (test_scaleout.py joins
    # one through run.sh); another job does not.
    assert launch.run_dir_in_use(tmp_path, "job42") is None
    assert "is in use by another job" in launch.run_dir_in_use(tmp_path, "job43")
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, *SMALL)  # refused before torchrun starts
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is in use by another job" in proc.stderr
    proc = single(tmp_path, *SMALL, code=2)  # and by the worker itself, when launched some other way
    assert "is in use by another job" in proc.stderr and not checkpoints(tmp_path / "ckpt")
    lock.close()  # the job ends (or dies): the folder is free again
    single(tmp_path, *SMALL, "--steps", 4)
    assert summary(tmp_path)["steps"] == 4


def test_save_every_0_chooses_the_disk_interval_by_young_and_daly(daly_job):
    run_dir, stdout = daly_job
    chosen = re.findall(r"save every (\d+) steps: sqrt\(2 x ([\d.]+) ms a save x 0.0005 h between failures\) "
                        r"= ([\d.]+) s, at ([\d.]+) ms a step \(Young and Daly\)", stdout)
    assert chosen, stdout[-3000:]
    for steps, save_ms, seconds, step_ms in chosen:
        assert float(seconds) == pytest.approx(math.sqrt(2 * float(save_ms) / 1000 * 1.8), abs=0.01)
        # The interval is round(seconds / step time) for some values the printed ones round to.
        low = (float(seconds) - 0.0005) / (float(step_ms) + 0.0005) * 1000
        high = (float(seconds) + 0.0005) / (float(step_ms) - 0.0005) * 1000
        assert round(low) <= int(steps) <= max(1, round(high)), (steps, seconds, step_ms)
    saved = [e["step"] for e in metrics(run_dir, 0, "save")]
    assert saved[0] == 10 and saved[-1] == 150  # the first measures a save's cost; the last step is saved
    assert all(any(s % int(c[0]) == 0 for c in chosen) for s in saved[1:-1]), (saved, chosen)


def test_a_diverged_loss_stops_the_job_without_saving_and_without_a_retry(tmp_path, eight_steps):
    # A stop is a stop: torchrun would retry a non-zero exit 3 times, retraining into the same NaN; the
    # workers exit 0, which it does not retry, and run.sh exits with their code.
    in_copy(eight_steps, tmp_path)
    before = files(tmp_path)
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, *SMALL, env={"FT_FAULTS": "nan-at-step=10"})
    assert proc.returncode == 3 and "resuming from step 8" in proc.stdout and "restart 1" not in proc.stdout
    assert [line for line in proc.stderr.splitlines() if "error" in line or "Traceback" in line] == [
        "train.py: error: loss is nan at step 10: stopping without saving, the checkpoints of earlier steps are kept"]
    assert files(tmp_path) == before  # the last finite checkpoints, untouched; nothing of step 10 or later
    # (Under plain torchrun, a stop's code is left in a file of the launch's that each restart reads:
    # test_launch_without_the_rendezvous_variable_is_refused_in_one_line.)


def test_a_failed_save_stops_the_job_and_keeps_the_previous_checkpoints(tmp_path, eight_steps):
    in_copy(eight_steps, tmp_path)
    before = files(tmp_path)

    def file_size_limit():  # a full disk, as far as the checkpoint is concerned: its write fails
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    for flags in ([], ["--async-save"]):  # an async save's write fails in its thread: noticed at the next save
        proc = single(tmp_path, *SMALL, *flags, code=3, preexec_fn=file_size_limit)
        assert proc.stderr.strip().splitlines()[-1].endswith(
            "error: saving step 12 failed (File too large): the checkpoints of earlier steps are kept")
        assert files(tmp_path) == before  # no temp file left behind, step 8 as it was, byte for byte


@pytest.mark.parametrize("kind", ["text", "llm.c tokens"])
def test_trains_on_a_text_file_or_a_token_file(tmp_path, kind):
    if kind == "text":
        data, vocab, detected = tmp_path / "corpus.txt", 256, "data: bytes of a text file"
        data.write_text("It was the best of times, it was the worst of times. " * 50)
    else:  # what any tokenizer's ids become with tiers.tokens.write_tokens (llm.c's header, uint16)
        data, vocab, detected = tmp_path / "train.tokens", 300, "data: llm.c uint16 GPT-2 tokens"
        write_tokens(data, [(7 * i) % 300 for i in range(3000)])
    proc = single(tmp_path / "run", *SMALL, "--steps", 8, "--data", data, "--vocab", vocab)
    assert "no checkpoint, starting fresh" in proc.stdout and detected in proc.stdout
    result = summary(tmp_path / "run")
    assert result["world_size"] == 1 and result["steps"] == 8 and result["final_loss"] < math.log(vocab)


def test_a_preemption_signal_to_run_sh_saves_the_step_in_progress_and_the_relaunch_ends_bitwise(tmp_path,
                                                                                                 ddp_long_reference):
    # A preemption as Slurm's --signal=USR1@SECONDS makes it: run.sh gets SIGUSR1, passes it to torchrun,
    # whose agent passes it to the workers (--signals-to-handle), which finish their step, agree, save it
    # and exit; the next launch loses no step. (A worker's own SIGTERM: the chaos soak's sigterm kind.)
    flags = LONG
    run_dir = tmp_path / "preempted"
    # A job on one machine listens on the loopback only (its stores, gloo): nobody else can reach it,
    # even with a rendezvous endpoint (docs/slurm.sbatch sets one) and a host name that resolves
    # to the network address.
    cmd = named_on_the_network(["bash", "run.sh", "ddp", "2", "--run-dir", run_dir, *flags], tmp_path)
    proc = procs.start(cmd, {**os.environ, "RDZV_ENDPOINT": f"{socket.gethostname()}:{free_port()}"},
                        tmp_path / "preempted.log")
    assert wait_for_step(run_dir, 20, proc), "the job ended before step 20: the signal never fired"
    sockets = listening(proc.pid)
    assert sockets and all(address in LOOPBACK for address, _ in sockets), sockets
    proc.send_signal(signal.SIGUSR1)
    code, output, hung = procs.finish(proc, time.time() + 60)
    assert code == 143 and not hung, output[-3000:]  # preempted: a scheduler's script requeues on it
    preempted = metrics(run_dir, 0, "preempted")
    assert len(preempted) == 1 and 20 <= preempted[0]["step"] < 120, output[-3000:]
    step = preempted[0]["step"]
    assert "preempted (SIGTERM or SIGUSR1): step" in output and checkpoints(run_dir / "ckpt")[0][0] == step
    assert not default_dir(run_dir).exists()  # the step is on disk: its memory snapshots went, not held for a requeue
    # The step saved is the one in progress when the first worker got the signal, not one later. A step's
    # line is logged just after the ranks agreed on it, so a signal can fall between the agreement on
    # step s and its line: then s + 1, two past the last line before the signal, is the one in progress.
    signalled = min(e["signalled_at"] for r in (0, 1) for e in metrics(run_dir, r, "preempted"))
    logged_before = [e["step"] for e in metrics(run_dir, 0, "step") if e["time"] < signalled]
    assert 1 <= step - max(logged_before, default=0) <= 2
    proc = torchrun(SCRIPT, 2, run_dir, *flags)
    assert f"resuming from step {step}" in proc.stdout
    assert summary(run_dir)["param_digest"] == summary(ddp_long_reference)["param_digest"]
