"""The core knows no tier: common/ never imports or names tiers/ (read from the code), a script imports a tier only
inside its flag's `if`, and a script copied with common/ alone, no tiers/ folder at all, runs and resumes
bitwise with the tiers' flags off: literally what a team copies for a plain job (README, "Using a script
in your job")."""
import ast
import shutil
import subprocess
import sys

import pytest

from conftest import DROPOUT, REPO, SMALL, summary, torchrun
from common.checkpoint import checkpoints

SCRIPTS = ["ddp/train.py", "ddp/checkpoint.py", "fsdp/train.py", "fsdp/checkpoint.py", "rpc/ps.py", "rpc/server.py"]


def imported(node, above=()):
    """[(the module named, the nodes above the import)] of every import below `node`."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            found += [(alias.name, above) for alias in child.names]
        elif isinstance(child, ast.ImportFrom):
            found.append((child.module or "", above))
        found += imported(child, (*above, child))
    return found


def test_the_core_never_imports_a_tier_and_a_script_imports_one_only_under_an_if():
    core = sorted((REPO / "common").glob("*.py"))
    assert len(core) >= 8
    for path in core:
        source = path.read_text()
        names = [name for name, _ in imported(ast.parse(source))]
        assert not [n for n in names if n.split(".")[0] == "tiers"], f"{path} imports a tier"
        # Not even in a comment: tiers/survivors.py or tiers.snapshot would be a tier the core knows of.
        assert "tiers/" not in source and "tiers." not in source, f"{path} names a module of tiers/"
        assert "FT_" not in source.replace("FT_STOP_FILE", ""), f"{path} reads a tier's variable"
    plugged = 0
    for script in SCRIPTS:
        for name, above in imported(ast.parse((REPO / script).read_text())):
            if name.split(".")[0] == "tiers":
                plugged += 1
                assert any(isinstance(node, ast.If) for node in above), f"{script}: `import {name}` outside an if"
    assert plugged >= 10  # ddp, fsdp and rpc plug their tiers in


@pytest.mark.parametrize("script, reference", [("ddp/train.py", "ddp_reference"), ("fsdp/train.py", "fsdp_reference")])
def test_a_script_copied_with_common_alone_resumes_a_run_bitwise(script, reference, tmp_path, request):
    # The uninterrupted job's run folder as a job killed after its commit of step 8 leaves it: the
    # checkpoints of steps 12 and 16 not yet written.
    reference = request.getfixturevalue(reference)
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "ckpt", run_dir / "ckpt")
    for step, path in checkpoints(run_dir / "ckpt"):
        if step > 8:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    core = tmp_path / "core"  # what a team copies: the script's folder and common/, no tiers/
    for folder in (script.split("/")[0], "common"):
        shutil.copytree(REPO / folder, core / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert not (core / "tiers").exists()
    # The memory tier is on by default: without its module, one line before anything starts.
    plain = subprocess.run([sys.executable, core / script, "--run-dir", tmp_path / "other"], capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr
    assert plain.stderr.endswith("error: --snapshot-every needs tiers/, which is not here: copy it with the script, or "
                                 "run with --snapshot-every 0 (see --help)\n"), plain.stderr
    light = subprocess.run([sys.executable, core / script, "--run-dir", tmp_path / "other", "--snapshot-every", "0",
                            "--light-every", "5"], capture_output=True, text=True, timeout=120)
    assert light.returncode == 2 and light.stderr.endswith(
        "error: --light-every needs tiers/, which is not here: copy it with the script, or run without --light-every "
        "(see --help)\n") and light.stderr.count("\n") == 1, light.stderr
    assert not (tmp_path / "other").exists()
    # The memory tier's flag off; no --data (no token file), no fault flag.
    resumed = torchrun(core / script, 2, run_dir, *SMALL, *DROPOUT, "--snapshot-every", "0")  # no restart, no traceback
    assert "resuming from step 8" in resumed.stdout
    assert summary(run_dir)["param_digest"] == summary(reference)["param_digest"]
