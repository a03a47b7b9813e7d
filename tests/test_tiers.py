"""Each optional tier is a module that a team can delete: a script copied with common/ minus the
tiers' modules (the memory tier and its replicas, token files, the survivors, the archive, the faults)
runs, and resumes bitwise, with the tiers' flags off (README, "Using a script in your job")."""
import shutil

import pytest

from conftest import DROPOUT, REPO, SMALL, summary, torchrun
from common.checkpoint import checkpoints

TIERS = ["tiers/snapshot.py", "tiers/replica.py", "tiers/tokens.py", "tiers/survivors.py", "tiers/archive.py",
         "tiers/faults.py"]


def copy_without(root, script, modules):
    """The script's folder and common/ copied into `root` as a team would, minus `modules`."""
    for folder in (script.split("/")[0], "common"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for module in modules:
        (root / module).unlink()
    return root / script


@pytest.mark.parametrize("script, reference", [("ddp/train.py", "ddp_reference"), ("fsdp/train.py", "fsdp_reference")])
def test_a_script_without_its_tiers_resumes_a_run_bitwise(script, reference, tmp_path, request):
    # The uninterrupted job's run folder as a job killed after its commit of step 8 leaves it: the
    # checkpoints of steps 12 and 16 not yet written.
    reference = request.getfixturevalue(reference)
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "ckpt", run_dir / "ckpt")
    for step, path in checkpoints(run_dir / "ckpt"):
        if step > 8:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    core = copy_without(tmp_path / "core", script, TIERS)
    # The memory tier's flag off (on by default); no --data (no token file), no fault flag.
    resumed = torchrun(core, 2, run_dir, *SMALL, *DROPOUT, "--snapshot-every", "0")  # no restart, no traceback
    assert "resuming from step 8" in resumed.stdout
    assert summary(run_dir)["param_digest"] == summary(reference)["param_digest"]
