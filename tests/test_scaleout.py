"""Several nodes on one machine: two torchrun agents meeting at one c10d rendezvous, as two nodes would."""
import os
import subprocess
import sys
import uuid

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


def test_worker_killed_on_second_node_both_nodes_resume(tmp_path):
    reference = tmp_path / "reference"
    torchrun("ddp/train.py", 4, reference, *SMALL)
    run = tmp_path / "two-nodes"
    # Rank 3 lives on the second node to join; its agent restarts it, the first node's agent re-joins.
    outputs = two_nodes("ddp/train.py", 2, run, *SMALL, "--crash-at-step", 10, "--crash-rank", 3)
    assert "injected crash: rank 3 after step 10" in "".join(outputs)
    assert [e["step"] for r in range(4) for e in metrics(run, r, "load")] == [8, 8, 8, 8]
    assert summary(run)["world_size"] == 4
    assert summary(run)["param_digest"] == summary(reference)["param_digest"]
