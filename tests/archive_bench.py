"""What --archive costs and gives, measured against a local S3 server (harness/s3server.py), from what the
jobs write (their metrics and summary.json):

    .venv/bin/python tests/archive_bench.py --presets small,medium --out archive_bench.json

For each preset and script (ddp, fsdp; 2 ranks, --save-every 10): a job without --archive and the same job
with it and --light-every 10 (then: each checkpoint's bytes and seconds to archive, the training loop's
time in the archive's calls, the median step against the job without, a light checkpoint's bytes and
blocking time against a full save's); then the finished run resumed from its run folder, and
from the archive once the folder is gone (the seconds from the process's start to the first step would
include `import torch`: these are the load's own, and the fetch's). Exit 1 if a job fails.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from harness import launch, procs  # noqa: E402
from harness.s3server import S3Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def events(run_dir, name):
    lines = (Path(run_dir) / "metrics-rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def job(script, run_dir, flags, env):
    cmd, env = launch.torchrun(script, 2, run_dir, flags, env=env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wrong = launch.problems(run_dir, procs.exit_code(proc.returncode, env), proc.stdout + proc.stderr)
    if wrong:
        sys.exit(f"archive_bench: {script} {' '.join(map(str, flags))}: {'; '.join(wrong)}\n{proc.stderr[-3000:]}")
    return json.loads((Path(run_dir) / "summary.json").read_text())


def measure(script, preset, steps, folder, server):
    flags = ["--preset", preset, "--steps", steps, "--save-every", 10, "--log-every", 1000]
    plain = job(script, folder / "plain", flags, server.env)
    archive = [*flags, "--archive", f"s3://ckpt/{preset}-{Path(script).parent.name}", "--light-every", 10]
    run = folder / "archived"
    archived = job(script, run, archive, server.env)
    uploads, lights, saves = events(run, "archive"), events(run, "light"), events(run, "save")
    blocked_s = events(run, "archive_end")[0]["blocked_s"]
    shutil.copytree(run, folder / "local")  # the finished run, resumed from its folder ...
    job(script, folder / "local", archive, server.env)
    local_s = events(folder / "local", "load")[-1]["load_s"]
    shutil.rmtree(run)  # ... and from the archive, its folder gone
    job(script, run, archive, server.env)
    fetch, load = events(run, "fetch")[0], events(run, "load")[-1]
    return {"preset": preset, "script": Path(script).parent.name, "checkpoint_bytes": uploads[0]["bytes"],
            "archives": len(uploads), "archive_s_median": statistics.median(u["seconds"] for u in uploads),
            "loop_blocked_s_per_save": blocked_s / len(uploads), "median_step_s": archived["median_step_s"],
            "step_ratio": archived["median_step_s"] / plain["median_step_s"],
            "resume_local_s": local_s, "resume_archive_fetch_s": fetch["fetch_s"],
            "resume_archive_load_s": load["load_s"], "light_bytes": lights[0]["bytes"],
            "light_blocking_s_median": statistics.median(e["blocking_s"] for e in lights),
            "save_blocking_s_median": statistics.median(e["blocking_s"] for e in saves)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--scripts", default="ddp/train.py,fsdp/train.py")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="archive-bench-") as tmp:
        server = S3Server(Path(tmp) / "s3")
        server.start()
        try:
            rows = [measure(script, preset, args.steps, Path(tmp) / f"{preset}-{i}", server)
                    for preset in args.presets.split(",") for i, script in enumerate(args.scripts.split(","))]
        finally:
            server.stop()
    print(tabulate([[r["preset"], r["script"], f"{r['checkpoint_bytes'] / 2**20:.1f}", r["archives"],
                     f"{r['archive_s_median']:.3f}", f"{r['loop_blocked_s_per_save'] * 1000:.2f}",
                     f"{r['loop_blocked_s_per_save'] / r['median_step_s'] * 100:.1f}%", f"{r['step_ratio']:.2f}",
                     f"{r['resume_local_s']:.2f}", f"{r['resume_archive_fetch_s']:.2f} + {r['resume_archive_load_s']:.2f}",
                     f"{r['light_bytes'] / 2**20:.1f}", f"{r['light_blocking_s_median'] * 1000:.1f} / "
                     f"{r['save_blocking_s_median'] * 1000:.1f}"] for r in rows],
                   headers=["preset", "script", "ckpt MiB", "archived", "archive s (median)", "loop ms a save",
                            "of a step", "step / without", "resume: local load s", "archive: fetch + load s",
                            "light MiB", "light / full save ms"]))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
