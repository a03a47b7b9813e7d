"""A team's own model, swapped in by docs/model-and-data.md's recipe, in a copy of the scripts as a user would make
it: DDP trains it, FSDP's meta build gives it DDP's seeded weights and buffers, and a FSDP crash resumes bitwise."""
import shutil

import pytest

from conftest import DROPOUT, REPO, SMALL, metrics, summary, torchrun


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """ddp/, fsdp/, common/ and tiers/ (the memory tier is on by default) copied, common/model.py's
    Transformer replaced by tests/other_model.py's."""
    root = tmp_path_factory.mktemp("your-project")
    for folder in ("ddp", "fsdp", "common", "tiers"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    model = root / "common" / "model.py"
    model.write_text(model.read_text() + "\n\n" + (REPO / "tests" / "other_model.py").read_text())
    return root


def test_the_swapped_model_trains_fsdp_builds_it_with_its_buffers_and_resumes_bitwise(tmp_path, project):
    flags = [*SMALL, *DROPOUT]
    # DDP's checkpoint is torch.save of the state dict, whatever the model: a crash there is the same as
    # with the project's own model (tests/test_ddp.py). FSDP's goes through the meta build and DCP.
    ddp = torchrun(project / "ddp" / "train.py", 2, tmp_path / "ddp", *flags)
    assert "model: 26,784 parameters" in ddp.stdout  # the rotary model's count (a tied head), not the first's
    fsdp = tmp_path / "fsdp"
    torchrun(project / "fsdp" / "train.py", 2, fsdp, *flags)
    # The first step's loss comes from the weights and buffers before any update: FSDP's, built on the
    # meta device and scattered by rank 0, are DDP's (a buffer left as to_empty made it would differ).
    first = [metrics(run, 0, "step")[0]["loss"] for run in (tmp_path / "ddp", fsdp)]
    assert first[0] == pytest.approx(first[1], rel=1e-6, abs=0)
    crashed = tmp_path / "crashed"
    torchrun(project / "fsdp" / "train.py", 2, crashed, *flags, faults="crash-at-step=10", restarts=1)
    assert summary(crashed)["param_digest"] == summary(fsdp)["param_digest"]
