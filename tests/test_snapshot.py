"""The memory tier's files, in one process (a gloo group of one): a snapshot restores exactly, and one
that is torn, damaged, another run's, another configuration's or another world size's is never loaded.
The tier's own folder and files keep another local user out (a real other uid), and a full tmpfs (a
real mount) turns it off instead of killing the process. The end-to-end crashes are in test_ddp.py and
test_fsdp.py."""
import json
import os
import shutil
import stat
import subprocess
import types
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from tiers import shm, snapshot
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
    assert shm.private_folder(folder) is None
    return snapshot.Snapshots(folder, run, 0, range(0, 1), 1, {"world_size": world, "config": CONFIG}, model,
                              optimizer, check)


def take(snaps, step, crash_midway=None):
    snaps.start(step, rng_state(), crash_midway)
    snaps.wait()


def restored(folder, run="run-a", disk_step=None, check=lambda record: None):
    """(step restored or None, the fresh model and optimizer it was restored into), as a restarted
    process restores them."""
    model, optimizer = trained(seed=1, steps=0)
    optimizer.param_groups[0]["weight_decay"] = 0.05  # a changed --weight-decay
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
    assert optimizer2.param_groups[0]["weight_decay"] == 0.05  # the restoring run's setting, as from disk
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

    record_path = snaps.path(0, snaps.slot(4), ".json")
    intact = record_path.read_text()
    swapped = json.loads(intact)
    a, b = [entry for entry in swapped["layout"] if entry[2] == swapped["layout"][0][2]][:2]
    a[3], b[3] = b[3], a[3]  # two tensors of one shape trade places: the offsets are in the checksum too
    record_path.write_text(json.dumps(swapped))
    assert restored(tmp_path)[0] is None and "do not match their checksum" in capsys.readouterr().out
    record_path.write_text(intact)

    record = snaps.records()[4]
    path = snaps.path(0, snaps.slot(4), f"-{record['nbytes']}.bin")
    data = bytearray(path.read_bytes())
    data[record["part"][1] // 2] ^= 0xFF  # one byte changed after its record was written
    path.write_bytes(data)
    assert restored(tmp_path)[0] is None
    out = capsys.readouterr().out
    assert "do not match their checksum (damaged)" in out and "loading from disk" in out
    assert path.exists()  # refused, never deleted


STRANGER = ["setpriv", "--reuid=54321", "--regid=54321", "--clear-groups", "--"]  # another local user


@pytest.fixture
def dev_shm():
    """A fresh name in /dev/shm, where every local user can make files; removed after the test."""
    path = Path("/dev/shm") / f"snapshots-test-{uuid.uuid4().hex}"
    yield path
    subprocess.run(["rm", "-rf", path], check=True)


def test_another_user_can_neither_redirect_a_write_nor_plant_a_snapshot(tmp_path, dev_shm, capsys):
    model, optimizer = trained(seed=0, steps=1)
    victim = tmp_path / "victim"  # a file only the job's user may write
    victim.write_bytes(b"the job user's own")
    # The race no preflight closes: the room check finds no folder; another user then makes it, open to
    # all, with links named like the slots (the run's id and the slot's size are easy to guess).
    assert snapshot.room_problem(dev_shm, 1024) is None
    nbytes = snapshot.layout(snapshot.local_tensors(get_state_dict(model, optimizer)))[1]
    slots = [f"run-a-rank0-slot{s}{suffix}" for s in (0, 1) for suffix in (".json", f"-{nbytes}.bin")]
    subprocess.run([*STRANGER, "sh", "-c", f'mkdir -m 777 "$0" && for s in {" ".join(slots)}; do '
                    f'ln -s "$1" "$0/$s"; done', dev_shm, victim], check=True)
    cfg = types.SimpleNamespace(snapshot_every=1, snapshot_dir=str(dev_shm), run_dir=str(tmp_path), hang_timeout_s=60)
    assert snapshot.open_tier(cfg, tmp_path, model, optimizer, range(0, 1), ()) is None
    assert capsys.readouterr().out.strip() == (
        f"memory tier off: rank 0: --snapshot-dir {dev_shm}: not a folder of this user's alone (drwxrwxrwx, uid "
        "54321; the tier needs mode 700), so its snapshots could be another's: remove it, or pass another")
    assert snapshot.room_problem(dev_shm, 1024).startswith(f"--snapshot-dir {dev_shm}: not a folder of this user's")
    # A link in the tier's own folder (mode 700) is not followed either: the copy fails, in one line.
    mine = tmp_path / "mine"
    snaps = snapshots(mine, model, optimizer)
    for name in (f"run-a-rank0-slot1-{nbytes}.bin", "run-a-rank0-slot0.json"):
        (mine / name).symlink_to(victim)
    take(snaps, 1)
    assert "memory snapshot failed ([Errno 40] Too many levels of symbolic links" in capsys.readouterr().out
    assert snaps.records() == {} and victim.read_bytes() == b"the job user's own"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    # And the run's id, which names its files, is the user's alone.
    snapshot.run_id(tmp_path)
    assert stat.S_IMODE((tmp_path / "run-id").stat().st_mode) == 0o600


def test_a_full_tmpfs_turns_the_tier_off_in_one_line_and_its_last_snapshot_still_restores(tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 0.8 MB of state: 193 pages a slot
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    nbytes = snapshot.layout(snapshot.local_tensors(get_state_dict(model, optimizer)))[1]
    page = os.sysconf("SC_PAGE_SIZE")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    # Room for one slot and its record, not two slots: a real tmpfs answers a write it cannot back
    # with SIGBUS, which used to kill the process at every attempt.
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(-(-nbytes // page) + 8) * page}", "tmpfs", mount], check=True)
    try:
        snaps = snapshots(mount / "shm", model, optimizer)
        take(snaps, 1)
        want = state_digest(model, optimizer)
        take(snaps, 2)
        assert snaps.failed and [line for line in capsys.readouterr().out.splitlines() if "memory" in line] == [
            "rank 0: memory snapshot failed ([Errno 28] No space left on device): the memory tier is off on this "
            "rank, the disk checkpoints go on"]
        fresh = torch.nn.Linear(256, 256)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters())
        assert snapshots(mount / "shm", fresh, fresh_optimizer).resume(None, torch.device("cpu")) == 1
        assert state_digest(fresh, fresh_optimizer) == want
        # The room check counts as free only the bytes the run's own snapshots hold, not another run's.
        assert snapshot.room_problem(mount / "shm", nbytes, "run-a") is None
        assert "the memory tier needs" in snapshot.room_problem(mount / "shm", nbytes, "run-b")
    finally:
        subprocess.run(["umount", "--lazy", mount], check=True)


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


def test_a_copied_run_folder_is_a_run_of_its_own_whose_snapshots_never_touch_the_originals(tmp_path):
    # A fork: a run folder copied to try a variant, both on one --snapshot-dir.
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    original = snapshot.run_id(tmp_path / "run" / "ckpt")
    shutil.copytree(tmp_path / "run", tmp_path / "fork")
    fork = snapshot.run_id(tmp_path / "fork" / "ckpt")
    assert fork != original and snapshot.run_id(tmp_path / "run" / "ckpt") == original
    assert snapshot.run_id(tmp_path / "fork" / "ckpt", make=False) == fork  # and it stays the fork's
    model, optimizer = trained(seed=0, steps=1)
    take(snapshots(tmp_path / "shm", model, optimizer, run=original), 1)
    forked = snapshots(tmp_path / "shm", model, optimizer, run=fork)
    take(forked, 2)
    assert sorted(forked.records()) == [2]  # not the original's step 1
    forked.remove()
    assert [p.name for p in (tmp_path / "shm").glob("*.json")] == [f"{original}-rank0-slot1.json"]


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
    monkeypatch.setattr(snapshot, "default_dir", lambda run_dir, run=None: None)
    cfg = types.SimpleNamespace(snapshot_every=1, snapshot_dir="", run_dir=str(tmp_path))
    assert snapshot.open_tier(cfg, tmp_path, None, None, range(0, 1), ()) is None
    assert "memory tier off: rank 0: no /dev/shm" in capsys.readouterr().out


def test_room_is_checked_before_training(tmp_path, monkeypatch):
    assert snapshot.room_problem(tmp_path, 1024) is None
    problem = snapshot.room_problem(tmp_path, 2**60)
    assert problem.startswith(f"--snapshot-dir {tmp_path}: the memory tier needs") and "--snapshot-every 0" in problem
    afile = tmp_path / "afile"
    afile.write_text("")
    assert "not a writable folder" in snapshot.room_problem(afile / "sub", 1024)  # one line, not a traceback
    assert "File name too long" in snapshot.room_problem(tmp_path / ("x" * 300), 1024)
    # A folder removed in the middle of the check (a finished job's, while a spare of it starts) is no
    # problem: checked again, it is absent, and its parent has room.
    folder, statvfs = tmp_path / "shm", os.statvfs
    folder.mkdir(mode=0o700)
    def removed_meanwhile(path):
        if folder.exists():
            folder.rmdir()
            raise FileNotFoundError(2, "No such file or directory")
        return statvfs(path)
    monkeypatch.setattr(snapshot.os, "statvfs", removed_meanwhile)
    assert snapshot.room_problem(folder, 1024, "run-a") is None and not folder.exists()
    # Two slots of 12 bytes a parameter: one copy per node for DDP, a rank's share of it for FSDP, and
    # on several nodes that of a rank of the node before (its replica).
    assert snapshot.needed_bytes(1000, 4, 4, sharded=False) == 24_000
    assert snapshot.needed_bytes(1000, 4, 4, sharded=True) == 24_000
    assert snapshot.needed_bytes(1000, 8, 4, sharded=True) == 24_000 and snapshot.needed_bytes(1000, 8, 2, True) == 12_000


def test_the_default_folder_is_named_after_the_runs_own_id_which_only_this_user_can_read(tmp_path):
    # So no other user can make it first and block the run (its old name was a hash of the run's path).
    (tmp_path / "ckpt").mkdir()
    assert snapshot.default_dir(tmp_path) != snapshot.default_dir(tmp_path)  # no id yet: a name nobody made
    run = snapshot.run_id(tmp_path / "ckpt")
    assert snapshot.default_dir(tmp_path).name == f"snapshots-{os.getuid()}-{run[:16]}"
    assert stat.S_IMODE((tmp_path / "ckpt" / "run-id").stat().st_mode) == 0o600  # this user's alone, wherever it is
