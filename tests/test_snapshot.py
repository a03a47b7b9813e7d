"""The memory tier's files, in one process (a gloo group of one): a snapshot restores exactly, and one
that is torn, damaged, another run's, another configuration's or another world size's is never loaded.
The end-to-end crashes are in test_ddp.py and test_fsdp.py."""
import json
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from common import snapshot
from common.checkpoint import param_digest, rng_state

CONFIG = {"seed": 0, "dim": 8}


@pytest.fixture(scope="module", autouse=True)
def group_of_one(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('store')}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def trained(seed, steps):
    """A small model and its AdamW after `steps` steps (the optimizer's state exists from the first)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def state_digest(model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = dict(snapshot.local_tensors((model_state, optim_state)))
    return param_digest(tensors)


def snapshots(folder, model, optimizer, run="run-a", world=1, check=lambda record: None):
    """A rank's tier of `model` and `optimizer`, as open_tier makes it: one process that writes, or one
    that restarted and reads."""
    return snapshot.Snapshots(folder, run, 0, range(0, 1), 1, {"world_size": world, "config": CONFIG}, model,
                              optimizer, check)


def take(snaps, step, crash_midway=None):
    snaps.start(step, rng_state(), crash_midway)
    snaps.wait()


def restored(folder, run="run-a", disk_step=None, check=lambda record: None):
    """(step restored or None, the fresh model and optimizer it was restored into), as a restarted
    process restores them."""
    model, optimizer = trained(seed=1, steps=0)
    step = snapshots(folder, model, optimizer, run, check=check).resume(disk_step, torch.device("cpu"))
    return step, model, optimizer


def test_the_newest_snapshot_restores_the_model_optimizer_and_rng_exactly(tmp_path):
    model, optimizer = trained(seed=0, steps=3)
    snaps = snapshots(tmp_path, model, optimizer)
    take(snaps, 2)  # slot 0
    expected_rng = torch.get_rng_state()
    take(snaps, 3)  # slot 1: the newest
    want = state_digest(model, optimizer)
    torch.manual_seed(123)  # the restore must set it back
    step, model2, optimizer2 = restored(tmp_path)
    assert step == 3 and state_digest(model2, optimizer2) == want
    assert torch.equal(torch.get_rng_state(), expected_rng)
    # Only what is not newer than the disk's newest checkpoint: the disk is loaded instead.
    assert restored(tmp_path, disk_step=3)[0] is None


def test_the_optimizer_waits_for_the_copy_in_flight_before_it_changes_the_weights(tmp_path):
    model, optimizer = trained(seed=0, steps=1)
    snaps = snapshots(tmp_path, model, optimizer)
    snaps.start(1, rng_state())
    assert snaps.copying is not None  # in its thread
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()  # its pre-hook waited for the copy
    assert snaps.copying is None


def test_a_torn_snapshot_leaves_the_other_slot_and_a_damaged_one_is_refused_by_its_checksum(tmp_path, capsys):
    model, optimizer = trained(seed=0, steps=2)
    take(snapshots(tmp_path, model, optimizer), 4)
    at_four = state_digest(model, optimizer)
    snaps = snapshots(tmp_path, *trained(seed=0, steps=3))

    def die():
        raise OSError("No space left on device")  # halfway through the copy: no record written

    take(snaps, 5, crash_midway=die)
    assert "memory snapshot failed (No space left on device): the memory tier is off" in capsys.readouterr().out
    assert not snaps.due(6) and sorted(snaps.records()) == [4]
    step, model2, optimizer2 = restored(tmp_path)
    assert step == 4 and state_digest(model2, optimizer2) == at_four

    record = snaps.records()[4]
    path = snaps.path(0, snaps.slot(4), f"-{record['nbytes']}.bin")
    data = bytearray(path.read_bytes())
    data[record["part"][1] // 2] ^= 0xFF  # one byte changed after its record was written
    path.write_bytes(data)
    assert restored(tmp_path)[0] is None
    out = capsys.readouterr().out
    assert "do not match their checksum (damaged)" in out and "loading from disk" in out
    assert path.exists()  # refused, never deleted


def test_another_runs_configs_or_world_sizes_snapshots_are_never_loaded(tmp_path, capsys):
    model, optimizer = trained(seed=0, steps=1)
    take(snapshots(tmp_path, model, optimizer, run="run-a"), 1)
    assert snapshots(tmp_path, model, optimizer, run="run-b").records() == {}  # another run's files: not even read
    assert restored(tmp_path, run="run-b")[0] is None

    refused = restored(tmp_path, check=lambda record: f"made with seed={record['config']['seed']}")
    assert refused[0] is None and "memory snapshot of step 1 not used: rank 0: made with seed=0" in \
        capsys.readouterr().out

    take(snapshots(tmp_path, model, optimizer, world=2), 2)  # as if written by a job of 2 ranks
    assert restored(tmp_path)[0] == 1  # step 2's is another world size's: the older slot
    assert "written at world size 2, this job has 1" in capsys.readouterr().out


def test_records_hold_nothing_that_runs_and_a_finished_job_removes_its_slots(tmp_path):
    model, optimizer = trained(seed=0, steps=1)
    snaps = snapshots(tmp_path / "node", model, optimizer)
    take(snaps, 1)
    take(snaps, 2)
    record = json.loads(snaps.path(0, 0, ".json").read_text())  # JSON: read without unpickling anything
    assert record["step"] == 2 and record["run"] == "run-a" and record["crc32"]
    # A rank of a larger world size before an elastic shrink left its slot: the run's files all go.
    (tmp_path / "node" / "run-a-rank3-slot1.json").write_text("{}")
    (tmp_path / "node" / "run-a-rank2-slot1-64.bin").write_bytes(bytes(64))
    snaps.remove()
    assert not (tmp_path / "node").exists()


def test_the_tier_is_off_on_every_rank_when_one_has_no_dev_shm(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(snapshot, "default_dir", lambda run_dir: None)
    cfg = types.SimpleNamespace(snapshot_every=1, snapshot_dir="", run_dir=str(tmp_path))
    assert snapshot.open_tier(cfg, tmp_path, None, None, range(0, 1), ()) is None
    assert "memory tier off: no /dev/shm on rank 0" in capsys.readouterr().out


def test_room_is_checked_before_training(tmp_path):
    assert snapshot.room_problem(tmp_path, 1024) is None
    problem = snapshot.room_problem(tmp_path, 2**60)
    assert problem.startswith(f"--snapshot-dir {tmp_path}: the memory tier needs") and "--snapshot-every 0" in problem
    # Two slots of 12 bytes a parameter: one copy per node for DDP, a rank's share of it for FSDP, and
    # on several nodes that of a rank of the node before (its replica).
    assert snapshot.needed_bytes(1000, 4, 4, sharded=False) == 24_000
    assert snapshot.needed_bytes(1000, 4, 4, sharded=True) == 24_000
    assert snapshot.needed_bytes(1000, 8, 4, sharded=True) == 24_000 and snapshot.needed_bytes(1000, 8, 2, True) == 12_000
