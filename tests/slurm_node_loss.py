"""What a real Slurm (Debian's slurm-wlm 22.05) does to a running job when one of its nodes is lost whole:
a node that is not the batch host, with and without --no-kill, and the batch host with it. Root; run once
by hand, not in the suite (about 4 minutes):

    .venv/bin/python tests/slurm_node_loss.py

Three nodes of harness/nodes.py with harness/slurm.py's Slurm (SlurmdTimeout 10 s here, 300 s by default):
node0 holds slurmctld and is excluded from the job; node1 (the batch host) and node2 run it, a task a
node that writes the time to a file of the shared folder every second. It prints the job's state, batch
host and nodes as they change over the 60 s after each loss, and how long ago each task last wrote."""
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness.slurm as hs  # noqa: E402
from harness.nodes import Cluster  # noqa: E402

top = Path(tempfile.mkdtemp(prefix="ft-slurm-exp-"))
hs.need_slurm()
BATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --exclude=node0
{nokill}
srun {srun_nokill} bash -c 'echo task $SLURM_NODEID on $(hostname); while :; do date +%s > {top}/beat-$SLURM_NODEID; sleep 1; done'
echo "srun ended: $?"
"""


def state(slurm, job):
    out = slurm.run("scontrol", "-o", "show", "job", job).stdout
    f = dict(re.findall(r"(\S+?)=(\S*)", out))
    return f.get("JobState"), f.get("BatchHost"), f.get("NodeList"), f.get("Restarts")

with Cluster(3) as cluster:
    slurm = hs.Slurm(cluster, top / "slurm", slurmd_timeout_s=10)
    try:
        for case, (nokill, lose) in {"default, lose node2 (not batch host)": ("", 2),
                                     "--no-kill, lose node2 (not batch host)": ("#SBATCH --no-kill", 2),
                                     "--no-kill, lose node1 (batch host)": ("#SBATCH --no-kill", 1)}.items():
            script = top / f"job{lose}{bool(nokill)}.sbatch"
            script.write_text(BATCH.format(nokill=nokill, srun_nokill="--no-kill" if nokill else "", top=top))
            out = top / f"{script.stem}.out"
            job = slurm.run("sbatch", "--parsable", "--no-requeue", f"--output={out}", script).stdout.strip()
            deadline = time.time() + 60
            while state(slurm, job)[0] != "RUNNING" and time.time() < deadline:
                time.sleep(0.2)
            time.sleep(2)  # (the tasks started)
            print(case, "before:", state(slurm, job), flush=True)
            t0 = time.time()
            cluster.kill(lose)
            seen = []
            while time.time() - t0 < 60:
                s = state(slurm, job)
                if not seen or seen[-1][1] != s:
                    seen.append((round(time.time() - t0, 1), s))
                time.sleep(0.5)
            print(case, "after:", seen, flush=True)
            beats = {b.name: round(time.time() - int(b.read_text() or 0)) for b in top.glob("beat-*")}
            print(f"  the tasks' last beats, seconds ago (a task beats every second): {beats}", flush=True)
            for b in top.glob("beat-*"):
                b.unlink()
            print("  log:", out.read_text()[-400:] if out.exists() else "", flush=True)
            slurm.run("scancel", job, check=False)
            # bring the lost node's slurmd back
            slurm.slurmd[lose] = cluster.start(lose, ["slurmd", "-D", "-N", f"node{lose}"], slurm.env,
                                               top / "slurm" / "log" / f"slurmd-again-{lose}.out")
            slurm.run("scontrol", "update", f"nodename=node{lose}", "state=resume", check=False)
            slurm.wait_for(lambda: slurm.idle_nodes() == 3, "idle", slurm.ctld, 120)
    finally:
        slurm.stop()
print("files:", top)
