"""Goodput under random process kills: the disk alone, the memory tier, and the survivors that keep
running (a dead rank replaced cold, or by a spare), measured in one run.

    bash run.sh goodput [--nproc 2] [--steps 1500] [--mean-gap-s 20] [--seed 0] [--out runs/goodput]
                        [--modes "memory tier,survivors spare"] [--signal KILL|STOP] [--plot DIR]

An uninterrupted job, then the same job with a random worker SIGKILLed (--signal STOP: stopped, a
frozen process the job must fence) at steps drawn in advance, the
gaps geometric with a mean of --mean-gap-s seconds of training (the uninterrupted job's median step
sets how many steps that is): once with the disk alone (--snapshot-every 0 --save-every 10), once with
the memory tier (--snapshot-every 1 --save-every 50), then with it --survivors (the dead rank's process
started again; its peers keep theirs) and --survivors --spares 1 (a spare takes the place). Goodput is the uninterrupted job's time (disk
alone) over the faulted job's, so the tier's own cost counts against it; the time lost to each kill is split into the steps trained again and the rest
(detection, restart, load: harness.metrics.phases). Each faulted job must end with the uninterrupted
digest, after exactly one torchrun restart per kill (--survivors: one new generation per kill, and one
new process: every other rank's is the same). Writes results.json into --out; --plot DIR draws each
job's step against its wall time, the kills marked, into DIR/goodput.png.
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
from harness.launch import finish, problems, start, survivors_job, torchrun, workers  # noqa: E402
from harness.metrics import Watch, events, phases  # noqa: E402

MODES = {"disk alone": ["--snapshot-every", 0, "--save-every", 10],
         "memory tier": ["--snapshot-every", 1, "--save-every", 50],
         "survivors cold": ["--snapshot-every", 1, "--save-every", 50, "--survivors"],
         "survivors spare": ["--snapshot-every", 1, "--save-every", 50, "--survivors", "--spares", 1]}


def step_times(run_dir):
    return [e["step_s"] for e in events(run_dir) if e["event"] == "step" and e["rank"] == 0 and e["step"] > 5]


def faulted(script, nproc, run_dir, flags, kills, rng, sig=signal.SIGKILL):
    """The job with `sig` (a SIGKILL; a SIGSTOP: a frozen process, which the job must fence) to a random
    worker once rank 0 has done each step of `kills` (after the previous kill). Returns (wall seconds,
    [epoch time of each kill])."""
    t0, survivors = time.time(), "--survivors" in flags
    if survivors:  # the supervisor's processes, each restarted alone; a spare's flag is in `flags`
        cmd, env = survivors_job(script, nproc, run_dir, [f for f in flags if f != "--survivors"],
                                 max_restarts=len(kills) + 1)
    else:
        cmd, env = torchrun(script, nproc, run_dir, flags, max_restarts=len(kills) + 1)
    proc = start(cmd, env, log=f"{run_dir}.log")
    watch, killed_at = Watch(run_dir), [0.0]
    for attempt, step in enumerate(kills):  # torchrun: each kill makes one restart, so kill n lands in attempt n
        watch.until(lambda e: e["rank"] == 0 and e["event"] == "step" and e["step"] >= step
                    and e["time"] > killed_at[-1], proc)
        pids = ({e["rank"]: e["pid"] for e in watch.poll() if e["event"] == "start"} if survivors
                else workers(proc.pid, attempt))
        if not pids or proc.poll() is not None:
            raise SystemExit(f"goodput: {run_dir.name} ended before its kill at step {step}")
        kill_worker(pids[rng.choice(sorted(pids))], sig)
        killed_at.append(time.time())
    code, output, hung = finish(proc, t0 + 1800)
    if not survivors:
        wrong = ["hung"] if hung else problems(run_dir, code, output, restarts=len(kills))
    else:  # no torchrun: one new process and one new generation per kill, no Traceback
        wrong = ["hung"] if hung else [f"exit code {code}"] if code else ["a Traceback"] if "Traceback" in output else []
        starts = [e for e in events(run_dir) if e["event"] == "start"]
        generation = json.loads((run_dir / "summary.json").read_text()).get("generation") if not wrong else None
        if not wrong and (len(starts) != nproc + len(kills) or generation != len(kills)):
            wrong.append(f"{len(starts)} processes started for {nproc} ranks and {len(kills)} kills, generation "
                         f"{generation}: a survivor restarted")
    if wrong:
        raise SystemExit(f"goodput: {run_dir.name} failed ({'; '.join(wrong)}):\n{output[-3000:]}")
    return time.time() - t0, killed_at[1:]


def percentiles(values):
    """"p50 / p95 s" of a list of seconds (the nearest rank)."""
    ordered = sorted(values)
    if not ordered:
        return "-"
    at = [ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] for q in (0.5, 0.95)]
    return f"{at[0]:.2f} / {at[1]:.2f} s"


def plot(results, folder):
    """Each job's finished step (rank 0's) against the seconds since its launch, the kills marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for mode, (run_dir, launched, killed_at) in results.items():
        steps = sorted((e["time"] - launched, e["step"]) for e in events(run_dir) if e["event"] == "step"
                       and e["rank"] == 0)
        line, = ax.plot(*zip(*steps), label=mode, linewidth=1.2)
        at = [(t - launched, max((s for w, s in steps if w <= t - launched), default=0)) for t in killed_at]
        ax.plot(*zip(*at), "x", color=line.get_color(), markersize=7) if at else None
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("step finished (rank 0)")
    ax.set_title("Training under SIGKILLs (x: a kill)")
    ax.legend()
    Path(folder).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(folder) / "goodput.png", dpi=110, bbox_inches="tight")
    print(f"plot: {Path(folder) / 'goodput.png'}", flush=True)


def kill_worker(pid, sig):
    try:
        os.kill(pid, sig)
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
    p.add_argument("--modes", default=",".join(MODES), help=f"the faulted jobs, of: {', '.join(MODES)}")
    p.add_argument("--signal", default="KILL", choices=["KILL", "STOP"], help="what each fault sends a worker")
    p.add_argument("--plot", default="", help="a folder for goodput.png: each job's step against its wall time")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if args.script not in ("ddp/train.py", "fsdp/train.py") or args.nproc < 1 or args.steps < 100:
        p.error("--script ddp/train.py or fsdp/train.py, --nproc >= 1, --steps >= 100")
    if not set(modes) <= set(MODES) or (args.script != "ddp/train.py" and any("survivors" in m for m in modes)):
        p.error(f"--modes takes some of: {', '.join(MODES)} (the survivors modes with ddp/train.py only)")
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

    rows, drawn = {}, {"uninterrupted": (clean_dir, t0, [])}
    for mode in modes:
        run_dir = out / mode.replace(" ", "-")
        launched = time.time()
        wall, killed_at = faulted(args.script, args.nproc, run_dir, [*flags, *MODES[mode]], kills,
                                  random.Random(args.seed), getattr(signal, f"SIG{args.signal}"))
        drawn[mode] = (run_dir, launched, killed_at)
        rows_events = events(run_dir)
        split = [phases(rows_events, t) for t in killed_at]
        if not all(split):
            raise SystemExit(f"goodput: {run_dir.name}: no step trained after a kill")
        replayed = sum(s["replayed_steps"] for s in split)
        before = [e["step_s"] for e in rows_events if e["event"] == "step" and e["rank"] == 0 and 5 < e["step"]
                  and e["time"] < killed_at[0]]  # this layout's step time, before the first kill
        rows[mode] = {"step_ratio": statistics.median(before) / step_s if len(before) > 10 else None, "wall_s": wall, "goodput": clean_s / wall, "lost_s": wall - clean_s, "kills": len(kills),
                      "replayed_steps": replayed, "replayed_s": replayed * step_s,
                      "recovery_s": [s["total_s"] for s in split],
                      "digest_equal": json.loads((run_dir / "summary.json").read_text())["param_digest"] == digest}
        print(f"{mode}: {wall:.1f} s, goodput {clean_s / wall:.3f}, {replayed} steps replayed", flush=True)
    table = [[mode, f"{r['goodput']:.3f}", f"{r['lost_s']:.1f} s", f"{r['replayed_steps']} ({r['replayed_s']:.1f} s)",
              f"{r['lost_s'] - r['replayed_s']:.1f} s", percentiles(r["recovery_s"]),
              f"{r['step_ratio']:.2f}" if r["step_ratio"] else "-", "yes" if r["digest_equal"] else "NO"]
             for mode, r in rows.items()]
    print(tabulate(table, headers=["", "goodput", "time lost", "steps replayed", "restarts etc.",
                                   "kill to training again p50 / p95", "step time / uninterrupted", "digest =="]))
    result = {"uninterrupted_s": clean_s, "median_step_s": step_s, "kills_after_steps": kills, "modes": rows,
              "signal": args.signal, "command": "bash run.sh goodput " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(drawn, args.plot)
    if not all(r["digest_equal"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
