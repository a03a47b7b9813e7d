"""What someone else puts in a run folder never runs: fsdp/checkpoint.py reads a checkpoint's `.metadata`
through an unpickler that admits only DCP's classes and its non-tensor items with torch's weights-only
unpickler, and common.rundir.ownership_problems finds a run folder that others could have written."""
import dataclasses
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.rundir import ownership_problems, run_dir_problems
from fsdp.checkpoint import MetadataUnpickler, Planner, Reader
from conftest import REPO, summary, torchrun

SCRIPT = "fsdp/train.py"
SHAPE = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "12", "--log-every", "100",
         "--save-every", "2"]


class Payload:
    """Unpickled, creates the file `marker`: what a stranger's pickle would do, harmlessly."""

    def __init__(self, marker):
        self.marker = Path(marker)

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder with fsdp/train.py's own checkpoints of steps 2 and 4: one plain process (world size 1),
    no torchrun."""
    run_dir = tmp_path_factory.mktemp("fsdp-saved")
    proc = subprocess.run([sys.executable, SCRIPT, "--run-dir", str(run_dir), "--steps", "4", *SHAPE], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir / "summary.json").unlink()
    return run_dir


def drop_metadata_payload(folder, marker):
    """A step folder whose `.metadata` runs the payload when unpickled, beside a train.pt that passes the
    script's preflight."""
    folder.mkdir()
    torch.save({"format": 2, "config": {}}, folder / "train.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def drop_bytes_payload(real, folder, marker):
    """A copy of the real checkpoint folder `real` whose `.metadata` is DCP's own, but whose first
    optimizer param_groups item (a non-tensor item, unpickled by DCP's planner) is the payload."""
    shutil.copytree(real, folder)
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # ours: written by the fixture's job
    index = next(i for i in metadata.storage_data if i.fqn.startswith("optimizer.param_groups."))
    item = io.BytesIO()
    torch.save(Payload(marker), item)
    (folder / "__9_0.distcp").write_bytes(item.getvalue())
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="__9_0.distcp",
                                                       offset=0, length=len(item.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_the_unpicklers_admit_real_checkpoints_and_refuse_the_payloads(tmp_path, saved):
    real = saved / "ckpt" / "step-00000004"
    with open(real / ".metadata", "rb") as f:
        expected = pickle.load(f)
    metadata = Reader(real).read_metadata()
    assert (metadata.state_dict_metadata, metadata.storage_data) == (expected.state_dict_metadata,
                                                                      expected.storage_data)

    marker = tmp_path / "ran"
    drop_metadata_payload(tmp_path / "step-00000099", marker)
    payload = (tmp_path / "step-00000099" / ".metadata").read_bytes()
    with pytest.raises(pickle.UnpicklingError, match=r"refused pathlib\.Path\.touch in .*step-00000099/\.metadata"):
        MetadataUnpickler(io.BytesIO(payload), tmp_path / "step-00000099" / ".metadata").load()
    item = io.BytesIO()
    torch.save(Payload(marker), item)
    lr = SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.0.lr"))
    with pytest.raises(pickle.UnpicklingError, match=r"^refused the item optimizer\.param_groups\.0\.lr \(Unsupported"):
        Planner().load_bytes(lr, io.BytesIO(item.getvalue()))
    assert not marker.exists()
    pickle.loads(payload)  # the payload is real: plain pickle runs it, as DCP's own reader would
    assert marker.exists()


def test_a_folder_dropped_into_ckpt_never_runs_and_is_moved_aside(tmp_path, saved):
    # Two strangers' folders newer than the job's own step 4: one whose `.metadata` runs code, one that is
    # a real checkpoint but for one non-tensor item that runs code. Both are refused on every rank, moved
    # aside like damaged ones, and the job trains on from step 4.
    run_dir = shutil.copytree(saved, tmp_path / "run")
    ckpt, marker = run_dir / "ckpt", tmp_path / "payload-ran"
    drop_metadata_payload(ckpt / "step-00000099", marker)
    drop_bytes_payload(ckpt / "step-00000004", ckpt / "step-00000098", marker)
    proc = torchrun(SCRIPT, 2, run_dir, "--steps", "6", *SHAPE)  # exit 0 after 0 restarts, no Traceback
    assert not marker.exists()
    assert "refused pathlib.Path.touch in" in proc.stdout
    assert "refused the item optimizer.param_groups.0." in proc.stdout
    assert "resuming from step 4" in proc.stdout
    for step in (99, 98):
        assert f"moved step-{step:08d} aside" in proc.stdout
        assert len(list(ckpt.glob(f"step-{step:08d}.unreadable-*"))) == 1
    s = summary(run_dir)
    assert (s["restarts"], s["resumed_from_step"], s["steps"]) == (0, 4, 6)


def test_a_run_folder_that_others_can_write_is_a_problem(tmp_path):
    run_dir = tmp_path / "run"
    step = run_dir / "ckpt" / "step-00000004"
    step.mkdir(parents=True)
    (step / "train.pt").write_bytes(b"")
    os.chmod(run_dir, 0o755)
    assert ownership_problems(run_dir) == [] and ownership_problems(tmp_path / "fresh") == []

    os.chmod(step, 0o757)  # o+w: anyone could replace the files in it
    assert ownership_problems(run_dir) == [f"--run-dir: {step} is writable by others (drwxr-xrwx): chmod -R go-w "
                                           f"{step}; only what this user wrote is loaded or written into"]
    os.chmod(step / "train.pt", 0o646)
    (problem,) = ownership_problems(run_dir)
    assert problem.startswith(f"--run-dir: {step} is writable by others") and "(and 1 more like it)" in problem

    os.chmod(step, 0o755)
    os.chmod(step / "train.pt", 0o644)
    (run_dir / "ckpt" / "step-00000008").symlink_to(step)
    (problem,) = ownership_problems(run_dir)
    assert "step-00000008 is a symbolic link" in problem


def test_no_pickle_crosses_a_process_group():
    # A process that gets into a group (a rank's place taken through the job's store) can send a wrong
    # value, never run code: the scripts and tiers exchange JSON (common.dist.gather_json) or tensors,
    # never torch's object collectives, which unpickle what a peer sends. (DCP's own planning, inside
    # torch, still exchanges pickles among the ranks that save: docs/guarantees.md says so; rpc/ps.py is RPC,
    # which pickles by design.)
    import ast
    pickling = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                "send_object_list", "recv_object_list"}
    found = []
    for path in [*REPO.glob("common/*.py"), *REPO.glob("tiers/*.py"), REPO / "ddp/train.py", *REPO.glob("fsdp/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in pickling or isinstance(node, ast.Attribute) and node.attr == "loads" and \
                    getattr(node.value, "id", None) == "pickle":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name or 'pickle.loads'}")
    assert not found, found


def test_a_light_or_export_folder_that_others_can_write_is_a_problem_when_the_job_writes_there(tmp_path):
    (tmp_path / "light").mkdir()
    os.chmod(tmp_path / "light", 0o777)
    assert ownership_problems(tmp_path) == []  # no --light-every: nothing is written there
    assert "light is writable by others" in ownership_problems(tmp_path, ["light"])[0]
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    assert "another user could replace" in run_dir_problems(tmp_path / "run", str(open_to_all / "m.pt"))[0]
    os.chmod(open_to_all, 0o755)
    os.chown(open_to_all, 65534, 65534)  # another user's folder: they could replace the file too
    assert "belongs to" in run_dir_problems(tmp_path / "run", str(open_to_all / "m.pt"))[0]
    os.chown(open_to_all, os.geteuid(), os.getegid())
    os.chmod(open_to_all, 0o1777)  # sticky, as /tmp: nobody replaces another's file there
    assert run_dir_problems(tmp_path / "run", str(open_to_all / "m.pt")) == []
