"""Unit tests of the shared mechanics: atomic save, checkpoint lookup, keep-K, RNG, digest, data, CLI."""
import dataclasses
import fcntl
import os
import random
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch

from common.checkpoint import (atomic_save, atomic_write, checkpoints, load_newest, param_digest, prune, resume_problem,
                               rng_state, set_rng_state, step_name)
from common import rundir
from common.rundir import lock_run_dir
from harness.launch import run_dir_in_use
from common import model, monitor
from common.config import parse_config
from common.data import StepData
from tiers import faults
from tiers.tokens import open_source
from common.model import ModelConfig, Transformer
from conftest import REPO, refused, run_sh
from harness.launch import load_script


def test_atomic_save_killed_before_rename_keeps_old_checkpoint(tmp_path):
    atomic_save({"step": 1}, tmp_path / step_name(1, ".pt"))
    # A real process writes step 2 and is killed (os._exit) after its bytes are on disk, before the rename.
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from common.checkpoint import atomic_save
        atomic_save({{"step": 2, "blob": bytes(1 << 20)}}, {str(tmp_path / step_name(2, ".pt"))!r},
                    before_commit=lambda: os._exit(9))
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert any(".tmp-" in name for name in leftovers), leftovers  # the bytes were really written
    assert [s for s, _ in checkpoints(tmp_path)] == [1]  # ...but never picked up
    step, _, state = load_newest(tmp_path, torch.load)
    assert step == 1 and state == {"step": 1}


def test_lookup_ignores_temp_files_and_uncommitted_folders(tmp_path):
    atomic_save({}, tmp_path / step_name(5, ".pt"))
    (tmp_path / f".{step_name(10, '.pt')}.tmp-123").write_bytes(b"partial")
    (tmp_path / step_name(12)).mkdir()  # a DCP folder whose .metadata was never written
    (tmp_path / step_name(12) / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / step_name(8)).mkdir()
    (tmp_path / step_name(8) / ".metadata").write_bytes(b"done")
    (tmp_path / "step-9.pt").write_bytes(b"not our name")
    assert [(s, p.name) for s, p in checkpoints(tmp_path)] == [(8, step_name(8)), (5, step_name(5, ".pt"))]
    assert [s for s, _ in checkpoints(tmp_path, committed=False)] == [12]


def test_prune_keeps_newest_k_and_never_an_in_flight_save(tmp_path):
    for step in (1, 2, 3, 4, 5):
        atomic_save({"step": step}, tmp_path / step_name(step, ".pt"))
    (tmp_path / step_name(3)).mkdir()  # stale: uncommitted and older than the commit
    (tmp_path / step_name(6)).mkdir()  # maybe an async save still being written: must stay
    (tmp_path / f".{step_name(7, '.pt')}.tmp-99").write_bytes(b"x")
    prune(tmp_path, keep=2, committed_step=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(4, ".pt"), step_name(5, ".pt"), step_name(6)]


def test_a_checkpoint_that_cannot_be_deleted_is_kept_with_one_line(tmp_path, monkeypatch, capsys):
    for step in (1, 2, 3):
        atomic_save({"step": step}, tmp_path / step_name(step, ".pt"))
    stuck, replace = tmp_path / step_name(1, ".pt"), os.replace

    def refuse(src, dst):  # what a folder of another user's allows (root, running the tests, may do anything)
        if Path(src) == stuck:
            raise PermissionError(13, "Permission denied")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse)
    for committed in (3, 4):  # pruned after each commit: said once
        atomic_save({"step": committed}, tmp_path / step_name(committed, ".pt"))
        prune(tmp_path, keep=1, committed_step=committed)
    assert [s for s, _ in checkpoints(tmp_path)] == [4, 1] and not list(tmp_path.glob(".*"))
    assert capsys.readouterr().out == f"could not delete {stuck} (Permission denied): it is kept; delete it yourself\n"


def test_prune_never_deletes_the_checkpoint_just_committed(tmp_path):
    # Newer committed checkpoints (say, unreadable ones not yet moved aside) must not push the fresh one out.
    for step in (4, 8, 12, 16):
        atomic_save({"step": step}, tmp_path / step_name(step, ".pt"))
    prune(tmp_path, keep=1, committed_step=8)
    assert [s for s, _ in checkpoints(tmp_path)] == [16, 12, 8]


def test_load_newest_retries_once_then_moves_the_unreadable_aside(tmp_path, capsys):
    atomic_save({"w": torch.arange(10)}, tmp_path / step_name(1, ".pt"))
    atomic_save({"w": torch.arange(1000)}, tmp_path / step_name(2, ".pt"))
    path = tmp_path / step_name(2, ".pt")
    damaged = path.read_bytes()[:500]
    path.write_bytes(damaged)
    step, _, state = load_newest(tmp_path, lambda p: torch.load(p, weights_only=True))
    assert step == 1 and torch.equal(state["w"], torch.arange(10))
    out = capsys.readouterr().out
    assert "trying once more" in out and "falling back" in out and "moved step-00000002.pt aside" in out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(step_name(2, ".pt.unreadable-"))]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged  # kept as it was, never loaded again
    assert [s for s, _ in checkpoints(tmp_path)] == [1]


def test_load_newest_recovers_from_a_transient_failure_and_moves_nothing_when_none_loads(tmp_path):
    for step in (1, 2):
        atomic_save({"step": step}, tmp_path / step_name(step, ".pt"))
    failures = []

    def flaky(path):  # the first read fails, as a network filesystem might for a moment
        if not failures:
            failures.append(path)
            raise OSError("transient")
        return torch.load(path, weights_only=True)

    assert load_newest(tmp_path, flaky)[0] == 2
    assert load_newest(tmp_path, lambda p: 1 / 0) == (None, None, None)
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 1]  # nothing loads: nothing is moved


def test_atomic_write_that_fails_leaves_no_temp_file_and_the_old_file(tmp_path):
    path = tmp_path / step_name(1, ".pt")
    atomic_save({"step": 1}, path)
    before = path.read_bytes()

    def full_disk(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(path, full_disk)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_bytes() == before


def test_run_dir_lock_is_exclusive_and_released_with_its_holder(tmp_path):
    lock = lock_run_dir(tmp_path)
    assert lock is not None and lock_run_dir(tmp_path) is None  # a second holder, even in this process, is refused
    assert "pid" in run_dir_in_use(tmp_path)
    lock.close()  # what the OS does when the holder dies
    assert run_dir_in_use(tmp_path) is None and lock_run_dir(tmp_path) is not None


def test_rank_0_waits_out_a_preflights_shared_test_of_the_lock_and_takes_it(tmp_path, monkeypatch):
    # Another node's preflight (run_dir_in_use) holds the lock shared for an instant: rank 0, taking the lock
    # then, must not refuse its own job. The shared holder lets go when rank 0 first waits.
    (tmp_path / ".lock").touch()
    preflight = open(tmp_path / ".lock")
    fcntl.flock(preflight, fcntl.LOCK_SH | fcntl.LOCK_NB)
    waits = []
    monkeypatch.setattr(rundir.time, "sleep", lambda seconds: (waits.append(seconds), preflight.close()))
    lock = lock_run_dir(tmp_path)
    assert lock is not None and len(waits) == 1
    assert "pid" in run_dir_in_use(tmp_path)


def test_resume_problem_names_what_changed_and_refuses_what_breaks_the_resume():
    ddp = load_script(REPO / "ddp" / "train.py")
    cfg = parse_config(ddp.Config, argv=[])
    saved = {"format": ddp.FORMAT, "config": dataclasses.asdict(cfg)}
    check = lambda new, allow=False: resume_problem(saved, new, ddp.FORMAT, ("dim",), ("seed", "batch_size"), allow)  # noqa: E731
    assert check(cfg) == (None, [])
    assert check(dataclasses.replace(cfg, lr=0.01, run_dir="elsewhere")) == (None, ["lr 0.003 -> 0.01"])
    problem, changes = check(dataclasses.replace(cfg, seed=1))
    assert "seed=0 (this run: 1)" in problem and "--allow-changes" in problem and changes == ["seed 0 -> 1"]
    assert check(dataclasses.replace(cfg, seed=1), allow=True) == (None, ["seed 0 -> 1"])
    assert "dim=64 (this run: 32)" in check(dataclasses.replace(cfg, dim=32), allow=True)[0]
    old = {**saved, "format": ddp.FORMAT - 1}
    assert f"format {ddp.FORMAT - 1}" in resume_problem(old, cfg, ddp.FORMAT, (), (), False)[0]


SCRIPTS = ["ddp/train.py", "fsdp/train.py", "rpc/ps.py"]


def bad_values(rule, kind):
    """Values outside a flag's declared range."""
    values = {"must be > 0": [0, -1], "must be >= 0": [-1], "must be in [0, 1)": [1.0, -0.5],
              "must be >= 1": [0.5, -1], "must be in [0, 2^32)": [-1, 2**32],
              "must be in (0, 604800] (a week)": [0, 10**14], "must be in (0, 1e6] (a century)": [0, 1e308],
              "must be in [1, 604800] (a second to a week)": [0.001, 10**14]}
    out = values[rule[0]]
    return out + [float("nan"), float("inf")] if kind is float else out


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_has_a_range_and_a_value_outside_it_is_one_line(script, tmp_path, monkeypatch):
    # Generated from each script's Config: a new numeric flag without a declared range fails here.
    monkeypatch.setenv("WORLD_SIZE", "3")
    module = load_script(REPO / script)
    ranges = {**module.RANGES, **model.RANGES}  # the script's training flags' and the model's
    fields = [f for f in dataclasses.fields(module.Config) if _numeric(module.Config, f)]
    assert fields and not [f.name for f in fields if f.name not in ranges]
    for f in fields:
        for value in bad_values(ranges[f.name], _numeric(module.Config, f)):
            flag = "--" + f.name.replace("_", "-")
            assert flag in refused(script, "--run-dir", tmp_path, flag, value), (flag, value)


def _numeric(cls, field):
    """int or float for a numeric field (Optional[int] counts), else None."""
    tp = [a for a in typing.get_args(typing.get_type_hints(cls)[field.name]) if a is not type(None)] or \
        [typing.get_type_hints(cls)[field.name]]
    return tp[0] if tp[0] in (int, float) else None


def test_rng_round_trip():
    state = rng_state()
    first = (random.random(), torch.rand(3))
    set_rng_state(state)
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0] and torch.equal(first[1], second[1])


def test_digest_depends_on_weights_only():
    c = ModelConfig(dim=32, heads=2)
    a, b = Transformer(c, seed=1).state_dict(), Transformer(c, seed=1).state_dict()
    assert param_digest(a) == param_digest(dict(reversed(list(b.items()))))  # same weights, any key order
    assert param_digest(a) != param_digest(Transformer(c, seed=2).state_dict())
    assert param_digest(a) != param_digest({k: v.double() for k, v in a.items()})  # dtype counts
    b["head.weight"][0, 0] += 1e-7
    assert param_digest(a) != param_digest(b)


@pytest.mark.parametrize("real_text", [False, True])
def test_data_is_a_function_of_step_and_same_across_world_sizes(real_text, tmp_path):
    path = None
    if real_text:
        path = tmp_path / "text.txt"
        path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    vocab = 256 if path else 64
    data = StepData(seed=3, global_batch=12, seq_len=16, vocab=vocab, source=path and open_source(path, vocab, 16))
    for step in (0, 7):
        whole = torch.cat([data.batch(step, 0, 1)[0]])
        for world in (2, 3, 4):
            parts = torch.cat([data.batch(step, r, world)[0] for r in range(world)])
            assert torch.equal(parts, whole)
    x, y = data.batch(5, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(data.batch(5, 0, 1)[0], data.batch(6, 0, 1)[0])
    again = StepData(seed=3, global_batch=12, seq_len=16, vocab=vocab, source=path and open_source(path, vocab, 16))
    assert torch.equal(again.batch(5, 1, 2)[0], data.batch(5, 1, 2)[0])


def test_config_flags_come_from_the_dataclass(capsys):
    ddp = load_script(REPO / "ddp" / "train.py")
    cfg = parse_config(ddp.Config, argv=["--steps", "7", "--no-tie-head", "--light-every", "3"])
    assert (cfg.steps, cfg.tie_head, cfg.light_every, cfg.export) == (7, False, 3, "")
    small = parse_config(ddp.Config, argv=["--preset", "small", "--dim", "999"], presets=model.PRESETS)
    assert (small.dim, small.layers, small.heads, small.preset) == (128, 3, 4, "small")  # the preset wins
    with pytest.raises(SystemExit):
        parse_config(ddp.Config, argv=["--preset", "huge"], presets=model.PRESETS)
    with pytest.raises(SystemExit):
        parse_config(ddp.Config, argv=["--help"])
    assert "total optimizer steps" in capsys.readouterr().out  # the field's comment is its help


def test_test_faults_are_asked_for_by_ft_faults_never_by_a_flag(capsys):
    assert faults.parse("crash-at-step=25,rank=1", "ddp") == {"crash-at-step": 25, "rank": 1}
    for script in SCRIPTS:
        module = load_script(REPO / script)
        with pytest.raises(SystemExit):
            parse_config(module.Config, argv=["--help"])
        help_ = capsys.readouterr().out
        assert "--steps" in help_ and not re.findall(r"--(?:crash|freeze|pause|nan|drop)-", help_), script


@pytest.mark.parametrize("script, spec, message", [
    ("ddp/train.py", "crash-at-step", "'crash-at-step' is not kind=N"),
    ("ddp/train.py", "crash-at-stop=3", "no fault 'crash-at-stop': choose from crash-at-step, "),
    ("ddp/train.py", "drop-trainer-at-step=3", "drop-trainer-at-step is not a fault of ddp's: choose from "),
    ("rpc/ps.py", "pause-at-step=3", "pause-at-step is not a fault of rpc's"),
    ("fsdp/train.py", "crash-at-step=x", "crash-at-step must be an integer, got 'x'"),
    ("fsdp/train.py", "nan-at-step=0", "nan-at-step must be > 0 (a step), got 0"),
    ("ddp/train.py", "crash-at-step=3,rank=1,crash-at-step=4", "crash-at-step is given twice"),
    ("rpc/ps.py", "rank=1", "no fault asked for, only its rank"),
])
def test_a_bad_ft_faults_is_one_line(script, spec, message, tmp_path, monkeypatch):
    # The check run.sh does before torchrun starts workers (and each worker again at start).
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("FT_FAULTS", spec)
    err = refused(script, "--run-dir", tmp_path)
    assert f"FT_FAULTS={spec}: {message}" in err, err


def test_a_bad_ft_faults_stops_run_sh_before_any_worker_starts(tmp_path):
    proc = run_sh("ddp", 2, "--run-dir", tmp_path, env={"FT_FAULTS": "crash-at-step=-3"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "FT_FAULTS=crash-at-step=-3: crash-at-step must be > 0 (a step), got -3" in proc.stderr
    assert not (tmp_path / "metrics-rank0.jsonl").exists()


def test_peak_flops_is_known_for_listed_gpus_or_given_by_the_environment(monkeypatch):
    monkeypatch.delenv("PEAK_TFLOPS", raising=False)
    assert monitor.peak_flops(torch.device("cpu")) is None and monitor.mfu(1e12, 1.0, torch.device("cpu")) is None
    monkeypatch.setenv("PEAK_TFLOPS", "2")
    assert monitor.mfu(1e12, 1.0, torch.device("cpu")) == 0.5
    names = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
             "NVIDIA A100-SXM4-80GB": 312e12}
    assert {name: monitor.bf16_peak(name) for name in names} == names
    assert monitor.bf16_peak("NVIDIA GeForce RTX 4090") is None  # unlisted: no MFU unless PEAK_TFLOPS is set


def test_a_full_disk_under_the_metrics_file_is_one_line_and_training_goes_on(tmp_path, capsys):
    (tmp_path / "metrics-rank0.jsonl").symlink_to("/dev/full")  # every write: No space left on device
    m = monitor.Monitor(tmp_path, 0, torch.device("cpu"))
    m.event("start")
    m.event("step", step=1)  # no second line, no exception
    m.close()
    err = capsys.readouterr().err
    assert err == f"rank 0: writing {tmp_path}/metrics-rank0.jsonl failed (No space left on device): no more metrics from this rank\n"


def test_a_script_that_exits_by_systemexit_keeps_its_code_and_skips_finalization(tmp_path):
    # A preemption ends a rank by SystemExit(143). Python's finalization after it could SIGABRT in gloo's
    # threads (seen once in CI: the supervisor read signal 6, not 143). So a script's end skips finalization.
    # An atexit handler stands for finalization here: it must not run, and the code and message must survive.
    script = tmp_path / "end.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys
        from common.dist import ending_without_finalizing
        atexit.register(lambda: print("finalized", flush=True))
        with ending_without_finalizing():
            print("saved", flush=True)
            raise SystemExit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for arg, code in (("143", 143), ("a stop in one line", 1)):
        end = subprocess.run([sys.executable, str(script), arg], env=env, capture_output=True, text=True, timeout=120)
        assert (end.returncode, end.stdout) == (code, "saved\n"), (end.returncode, end.stdout, end.stderr)
        assert end.stderr == ("" if code == 143 else "a stop in one line\n"), end.stderr
