"""What a --survivors node's processes hold in memory: each one's RSS and PSS (its share of the pages it
shares), the warm parent's (harness/warm.py) beside a bare `import torch`, all read from /proc.

    .venv/bin/python tests/warm_bench.py --nproc 4 --spares 1 [--preset tiny] [--repo PATH] [--out warm_bench.json]

A bare `python -c "import torch"` first (OMP_NUM_THREADS=1, as each process of a job of several ranks
has it), then `bash run.sh ddp NPROC --survivors --spares SPARES` of --repo's checkout (this one by
default; another commit's, in a git worktree, for a before-and-after in one run), read once rank 0 has
trained 20 steps, then ended. PSS adds up: the node's total is the memory its processes take together,
where a fork's pages shared with the warm parent count once, not once a process. Exit 1 if the job
ended before it was read.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.metrics import Watch  # noqa: E402


def memory(pid):
    """(RSS, PSS) of process `pid`, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * 1024
    return fields["Rss"], fields["Pss"]


def bare_torch():
    """(RSS, PSS) of a python that has imported torch and nothing else."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, torch; print(flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.readline()  # its import is done
    try:
        return memory(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--repo", default=str(REPO), help="the checkout whose run.sh runs the job")
    p.add_argument("--out", default="")
    args = p.parse_args()
    result = {"bare_import_torch": dict(zip(("rss", "pss"), bare_torch()))}
    with tempfile.TemporaryDirectory(prefix="warm-bench-") as folder:
        run = Path(folder) / "run"
        job = subprocess.Popen(["bash", f"{args.repo}/run.sh", "ddp", str(args.nproc), "--run-dir", str(run),
                                "--preset", args.preset, "--steps", "100000", "--save-every", "100000", "--survivors",
                                "--spares", str(args.spares)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        try:
            if Watch(run).first("step", job, time.time() + 300, min_step=20) is None:
                sys.exit("warm_bench: the job ended before step 20")
            supervisor = job.pid  # run.sh execs the launcher, which is the supervisor
            kids = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _parent(p) == supervisor]
            rows = {}
            for pid in kids:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                rows[str(pid)] = {"name": name, **dict(zip(("rss", "pss"), memory(pid)))}
            result["processes"] = rows
        finally:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait()
    warm = [r for r in result["processes"].values() if r["name"] == "ft-warm-parent"]
    workers = [r for r in result["processes"].values() if r["name"] != "ft-warm-parent"]
    result["summary"] = {
        "workers": len(workers), "worker_rss_mean": sum(r["rss"] for r in workers) / len(workers),
        "worker_pss_mean": sum(r["pss"] for r in workers) / len(workers),
        "node_pss": sum(r["pss"] for r in result["processes"].values()),
        "warm_parent_rss": warm[0]["rss"] if warm else None, "warm_parent_pss": warm[0]["pss"] if warm else None,
        "warm_parent_rss_vs_bare_torch": warm[0]["rss"] / result["bare_import_torch"]["rss"] if warm else None,
        "command": " ".join(sys.argv),
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _parent(proc):
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


if __name__ == "__main__":
    main()
