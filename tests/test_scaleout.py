"""Several nodes on one machine: two torchrun agents meeting at one c10d rendezvous, as two nodes would;
and the cluster launch files the README gives."""
import os
import re
import shutil
import subprocess
import sys
import uuid

import yaml

from common.dist import free_port
from conftest import REPO, SMALL, metrics, summary, torchrun


def two_nodes(script, nproc, run_dir, *flags, timeout=300):
    """Start one torchrun agent per 'node' on this machine, same endpoint and id; wait for both."""
    endpoint, rdzv_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
         "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
         str(REPO / script), "--run-dir", str(run_dir), *map(str, flags)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-6000:]
    return outputs


def test_worker_killed_on_one_node_both_resume_then_one_node_resumes_alone(tmp_path, fsdp_four_ranks):
    reference = fsdp_four_ranks  # the same job on one node, uninterrupted
    run = tmp_path / "two-nodes"
    # c10d orders the nodes by their agents, so ranks 2-3 share a node: kill rank 3 there. Its agent
    # restarts its workers; the other node's agent sees the group change and restarts its own.
    outputs = two_nodes("fsdp/train.py", 2, run, *SMALL, "--crash-at-step", 10, "--crash-rank", 3)
    assert "injected crash: rank 3 after step 10" in "".join(outputs)
    assert [e["step"] for r in range(4) for e in metrics(run, r, "load")] == [8, 8, 8, 8]
    assert summary(run)["world_size"] == 4
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
    # The same checkpoint on one node with 2 ranks: resharded, exactly the saved weights.
    shutil.copytree(run / "ckpt", tmp_path / "one-node" / "ckpt")
    proc = torchrun("fsdp/train.py", 2, tmp_path / "one-node", *SMALL)
    assert "resharded from 4 to 2 ranks" in proc.stdout and "resuming from step 16" in proc.stdout
    assert summary(tmp_path / "one-node")["param_digest"] == summary(reference)["param_digest"]


def readme_block(language, marker):
    """The fenced block of `language` in README.md whose first line contains `marker`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    return next(b for b in blocks if marker in b.splitlines()[0])


def test_slurm_batch_script_in_readme_is_valid_bash(tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(readme_block("bash", "#!/bin/bash"))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "srun" in script.read_text() and "bash run.sh fsdp" in script.read_text()


def test_kubernetes_manifest_in_readme_parses():
    manifest = yaml.safe_load(readme_block("yaml", "apiVersion"))
    assert manifest["kind"] == "PyTorchJob" and manifest["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in worker["env"]
