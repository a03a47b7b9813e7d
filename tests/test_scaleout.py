"""Several nodes on one machine: two torchrun agents meeting at one c10d rendezvous, as two nodes would;
and the cluster launch files the README gives."""
import re
import shutil
import subprocess
import time
import uuid

import yaml

from common.dist import free_port
from common.launch import finish, start, torchrun as torchrun_command
from conftest import REPO, SMALL, metrics, summary, torchrun


def two_nodes(script, nproc, run_dir, *flags, restarts=0, timeout=300):
    """Start one torchrun agent per 'node' on this machine, same endpoint and id; wait for both, and
    check them as conftest.torchrun checks one node. Only the failing node's agent counts a restart (the
    other one restarts its workers for the new membership, uncounted), so `restarts` is the count of
    the rank that counted most; summary.json, written by rank 0, may come from either node."""
    endpoint, rdzv_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]
    agents = [start(*torchrun_command(script, nproc, run_dir, flags, nnodes=2, endpoint=endpoint, rdzv_id=rdzv_id),
                    log=f"{run_dir}-node{node}.log") for node in range(2)]
    deadline = time.time() + timeout
    ended = [finish(agent, deadline) for agent in agents]  # (exit code, output, hung) per node
    outputs = [output for _, output, _ in ended]
    for code, output, _ in ended:
        assert code == 0, output[-6000:]
    counted = max(e["restarts"] for rank in range(2 * nproc) for e in metrics(run_dir, rank, "start"))
    assert counted == restarts, f"{counted} torchrun restarts, expected {restarts}"
    if restarts == 0:
        assert "Traceback" not in "".join(outputs), "".join(outputs)[-6000:]
    return outputs


def test_worker_killed_on_one_node_both_resume_then_one_node_resumes_alone(tmp_path, fsdp_four_ranks):
    reference = fsdp_four_ranks  # the same job on one node, uninterrupted
    run = tmp_path / "two-nodes"
    # c10d orders the nodes by their agents, so ranks 2-3 share a node: kill rank 3 there. Its agent
    # restarts its workers; the other node's agent sees the group change and restarts its own.
    outputs = two_nodes("fsdp/train.py", 2, run, *SMALL, "--crash-at-step", 10, "--crash-rank", 3, restarts=1)
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
