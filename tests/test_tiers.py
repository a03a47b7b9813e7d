"""Each optional tier is a module that a team can delete: a script copied with common/ minus the
tiers' modules runs, and resumes bitwise, with the tiers' flags off (README, "Using a script in your
job"). The memory tier (common/snapshot.py and its replicas, common/replica.py) and the token files
(common/tokens.py) go first: that copy crashes through the faults tier; then common/faults.py goes
too, and that copy resumes the crashed run and ends with the uninterrupted job's weights."""
import shutil

import pytest

from conftest import DROPOUT, REPO, SMALL, summary, torchrun
from common.checkpoint import checkpoints

FLAGS = [*SMALL, *DROPOUT, "--snapshot-every", "0"]  # the memory tier's flag off; no --data: no token file


def copy_without(root, script, modules):
    """The script's folder and common/ copied into `root` as a team would, minus `modules`."""
    for folder in (script.split("/")[0], "common"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    for module in modules:
        (root / module).unlink()
    return root / script


@pytest.mark.parametrize("script, reference", [("ddp/train.py", "ddp_reference"), ("fsdp/train.py", "fsdp_reference")])
def test_a_script_without_its_tiers_runs_and_resumes_bitwise(script, reference, tmp_path, request):
    run_dir = tmp_path / "run"
    crashing = copy_without(tmp_path / "no-memory-tier", script,
                            ["common/snapshot.py", "common/replica.py", "common/tokens.py"])
    crashed = torchrun(crashing, 2, run_dir, *FLAGS, "--crash-at-step", "10", max_restarts=0, check=False)
    assert crashed.returncode != 0 and "injected crash: rank 1 after step 10" in crashed.stderr
    assert [step for step, _ in checkpoints(run_dir / "ckpt")][0] == 8 and not (run_dir / "summary.json").exists()

    core = copy_without(tmp_path / "core", script, ["common/snapshot.py", "common/replica.py", "common/tokens.py",
                                                    "common/faults.py"])
    resumed = torchrun(core, 2, run_dir, *FLAGS)  # no restart, no traceback
    assert "resuming from step 8" in resumed.stdout
    assert summary(run_dir)["param_digest"] == summary(request.getfixturevalue(reference))["param_digest"]
