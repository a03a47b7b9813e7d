"""Goodput under random process kills: the memory tier against the disk alone, measured in one run.

    bash run.sh goodput [--nproc 2] [--steps 1500] [--mean-gap-s 20] [--seed 0] [--out runs/goodput]

An uninterrupted job, then the same job with a random worker SIGKILLed at steps drawn in advance, the
gaps geometric with a mean of --mean-gap-s seconds of training (the uninterrupted job's median step
sets how many steps that is): once with the disk alone (--snapshot-every 0 --save-every 10), once with
the memory tier (--snapshot-every 1 --save-every 50). Goodput is the uninterrupted job's time (disk
alone) over the faulted job's, so the tier's own cost counts against it; the time lost to each kill is split into the steps trained again and the rest
(detection, restart, load: harness.metrics.phases). Each faulted job must end with the uninterrupted
digest, after exactly one torchrun restart per kill. Writes results.json into --out.
"""
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import Parser  # noqa: E402
from harness.launch import finish, problems, start, torchrun, workers  # noqa: E402
from harness.metrics import Watch, events, phases  # noqa: E402

MODES = {"disk alone": ["--snapshot-every", 0, "--save-every", 10],
         "memory tier": ["--snapshot-every", 1, "--save-every", 50]}


def step_times(run_dir):
    return [e["step_s"] for e in events(run_dir) if e["event"] == "step" and e["rank"] == 0 and e["step"] > 5]


def faulted(script, nproc, run_dir, flags, kills, rng):
    """The job with a SIGKILL to a random worker once rank 0 has done each step of `kills` (in the
    attempt that follows the previous kill). Returns (wall seconds, [epoch time of each kill])."""
    t0 = time.time()
    proc = start(*torchrun(script, nproc, run_dir, flags, max_restarts=len(kills) + 1), log=f"{run_dir}.log")
    watch, killed_at = Watch(run_dir), []
    for attempt, step in enumerate(kills):  # each kill makes one torchrun restart: kill n lands in attempt n
        watch.first("step", proc, attempt=attempt, min_step=step)
        pids = workers(proc.pid, attempt)
        if not pids:
            raise SystemExit(f"goodput: {run_dir.name} ended before its kill at step {step}")
        rank = rng.choice(sorted(pids))
        kill_worker(pids[rank])
        killed_at.append(time.time())
    code, output, hung = finish(proc, t0 + 1800)
    wrong = ["hung"] if hung else problems(run_dir, code, output, restarts=len(kills))
    if wrong:
        raise SystemExit(f"goodput: {run_dir.name} failed ({'; '.join(wrong)}):\n{output[-3000:]}")
    return time.time() - t0, killed_at


def kill_worker(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile: the job's problems() will say how
        pass


def main(argv=None):
    p = Parser(prog="bash run.sh goodput", description=__doc__.split("\n")[0])
    p.add_argument("--script", default="ddp/train.py", help="ddp/train.py or fsdp/train.py")
    p.add_argument("--nproc", type=int, default=2, help="processes of the job")
    p.add_argument("--steps", type=int, default=1500, help="steps of the job")
    p.add_argument("--preset", default="medium", help="model preset")
    p.add_argument("--mean-gap-s", type=float, default=20.0, help="mean seconds of training between kills")
    p.add_argument("--seed", type=int, default=0, help="seeds the kills' steps and victims")
    p.add_argument("--out", default="runs/goodput", help="folder for the jobs and results.json")
    args = p.parse_args(argv)
    if args.script not in ("ddp/train.py", "fsdp/train.py") or args.nproc < 1 or args.steps < 100:
        p.error("--script ddp/train.py or fsdp/train.py, --nproc >= 1, --steps >= 100")
    out, rng = Path(args.out).resolve(), random.Random(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--steps", args.steps, "--preset", args.preset, "--batch-size", 8 * args.nproc, "--log-every", 1000,
             "--dropout", 0.1]

    clean_dir = out / "uninterrupted"
    t0 = time.time()
    proc = start(*torchrun(args.script, args.nproc, clean_dir, [*flags, *MODES["disk alone"]]), log=f"{clean_dir}.log")
    code, output, hung = finish(proc, t0 + 1800)
    clean_s = time.time() - t0
    wrong = ["hung"] if hung else problems(clean_dir, code, output)
    if wrong:
        raise SystemExit(f"goodput: the uninterrupted job failed ({'; '.join(wrong)}):\n{output[-3000:]}")
    step_s = statistics.median(step_times(clean_dir))
    p_kill = min(1.0, step_s / args.mean_gap_s)  # per step: a geometric gap of mean_gap_s / step_s steps
    kills, step = [], 0
    while True:
        step += 1 + int(rng.expovariate(p_kill)) if p_kill < 1 else 1
        if step >= args.steps - 10:
            break
        kills.append(step)
    digest = json.loads((clean_dir / "summary.json").read_text())["param_digest"]
    print(f"uninterrupted: {clean_s:.1f} s, median step {step_s * 1000:.1f} ms; kills after steps {kills}",
          flush=True)

    rows = {}
    for mode, extra in MODES.items():
        run_dir = out / mode.replace(" ", "-")
        wall, killed_at = faulted(args.script, args.nproc, run_dir, [*flags, *extra], kills, random.Random(args.seed))
        rows_events = events(run_dir)
        split = [phases(rows_events, t) for t in killed_at]
        replayed = sum(s["replayed_steps"] for s in split)
        rows[mode] = {"wall_s": wall, "goodput": clean_s / wall, "lost_s": wall - clean_s, "kills": len(kills),
                      "replayed_steps": replayed, "replayed_s": replayed * step_s,
                      "recovery_s": [s["total_s"] for s in split],
                      "digest_equal": json.loads((run_dir / "summary.json").read_text())["param_digest"] == digest}
        print(f"{mode}: {wall:.1f} s, goodput {clean_s / wall:.3f}, {replayed} steps replayed", flush=True)
    table = [[mode, f"{r['goodput']:.3f}", f"{r['lost_s']:.1f} s", f"{r['replayed_steps']} ({r['replayed_s']:.1f} s)",
              f"{r['lost_s'] - r['replayed_s']:.1f} s", "yes" if r["digest_equal"] else "NO"] for mode, r in rows.items()]
    print(tabulate(table, headers=["", "goodput", "time lost", "steps replayed", "restarts etc.", "digest =="]))
    result = {"uninterrupted_s": clean_s, "median_step_s": step_s, "kills_after_steps": kills, "modes": rows,
              "command": "bash run.sh goodput " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    if not all(r["digest_equal"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
