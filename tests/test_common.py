"""Unit tests of the shared mechanics: atomic save, checkpoint lookup, keep-K, RNG, digest, data, CLI."""
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from common.checkpoint import (atomic_save, checkpoints, load_newest, param_digest, prune, rng_state,
                               set_rng_state, step_name)
from common import monitor
from common.config import parse_config
from common.data import StepData
from common.model import ModelConfig, Transformer
from conftest import REPO


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
    (tmp_path / step_name(3)).mkdir()  # stale: uncommitted and older than the newest commit
    (tmp_path / step_name(6)).mkdir()  # maybe an async save still being written: must stay
    (tmp_path / f".{step_name(7, '.pt')}.tmp-99").write_bytes(b"x")
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(4, ".pt"), step_name(5, ".pt"), step_name(6)]


def test_load_newest_falls_back_past_a_truncated_file(tmp_path, capsys):
    atomic_save({"w": torch.arange(10)}, tmp_path / step_name(1, ".pt"))
    atomic_save({"w": torch.arange(1000)}, tmp_path / step_name(2, ".pt"))
    path = tmp_path / step_name(2, ".pt")
    path.write_bytes(path.read_bytes()[:500])
    step, _, state = load_newest(tmp_path, lambda p: torch.load(p, weights_only=True))
    assert step == 1 and torch.equal(state["w"], torch.arange(10))
    assert "falling back" in capsys.readouterr().out


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
    data = StepData(seed=3, global_batch=12, seq_len=16, vocab=256 if path else 64, path=path)
    for step in (0, 7):
        whole = torch.cat([data.batch(step, 0, 1)[0]])
        for world in (2, 3, 4):
            parts = torch.cat([data.batch(step, r, world)[0] for r in range(world)])
            assert torch.equal(parts, whole)
    x, y = data.batch(5, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(data.batch(5, 0, 1)[0], data.batch(6, 0, 1)[0])
    again = StepData(seed=3, global_batch=12, seq_len=16, vocab=256 if path else 64, path=path)
    assert torch.equal(again.batch(5, 1, 2)[0], data.batch(5, 1, 2)[0])


def test_config_flags_come_from_the_dataclass(capsys):
    from common.config import load_script
    ddp = load_script(REPO / "ddp" / "train.py")
    cfg = parse_config(ddp.Config, argv=["--steps", "7", "--no-tie-head", "--crash-at-step", "3"])
    assert (cfg.steps, cfg.tie_head, cfg.crash_at_step, cfg.crash_in_save) == (7, False, 3, None)
    small = parse_config(ddp.Config, argv=["--preset", "small", "--dim", "999"])
    assert (small.dim, small.layers, small.heads, small.preset) == (128, 3, 4, "small")  # the preset wins
    with pytest.raises(SystemExit):
        parse_config(ddp.Config, argv=["--preset", "huge"])
    with pytest.raises(SystemExit):
        parse_config(ddp.Config, argv=["--help"])
    assert "total optimizer steps" in capsys.readouterr().out  # the field's comment is its help


def test_peak_flops_is_known_for_listed_gpus_or_given_by_the_environment(monkeypatch):
    monkeypatch.delenv("PEAK_TFLOPS", raising=False)
    assert monitor.peak_flops(torch.device("cpu")) is None and monitor.mfu(1e12, 1.0, torch.device("cpu")) is None
    monkeypatch.setenv("PEAK_TFLOPS", "2")
    assert monitor.mfu(1e12, 1.0, torch.device("cpu")) == 0.5
    names = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
             "NVIDIA A100-SXM4-80GB": 312e12}
    assert {name: monitor.bf16_peak(name) for name in names} == names
    assert monitor.bf16_peak("NVIDIA GeForce RTX 4090") is None  # unlisted: no MFU unless PEAK_TFLOPS is set
