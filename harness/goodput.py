"""Goodput under random process kills: the disk alone, the memory tier, and the survivors that keep
running (a dead rank replaced by a new process, forked by the node's warm parent, or by a spare),
measured in one run.

    bash run.sh goodput [--nproc 2] [--steps 1500] [--mean-gap-s 20] [--seed 0] [--out runs/goodput]
                        [--modes "memory tier,survivors spare"] [--signal KILL|STOP] [--rounds 1] [--plot DIR]

An uninterrupted job, then the same job with a random worker SIGKILLed (--signal STOP: stopped, a
frozen process the job must fence) at steps drawn in advance, the gaps geometric with a mean of
--mean-gap-s seconds of training (the uninterrupted job's median step sets how many steps that is):
once with the disk alone (--snapshot-every 0 --save-every 10), once with the memory tier
(--snapshot-every 1 --save-every 50), then with it --survivors (the dead rank's process started
again; its peers keep theirs) and --survivors --spares 1 (a spare takes the place).

Two goodputs. The wall clock's: the uninterrupted job's time (disk alone) over the faulted job's, so
the tier's own cost counts against it, and so does any change in the machine's load between the two
jobs. The kills': the job's own training time (its steps times its own median step) over that plus
what each kill cost it (harness.metrics.phases' back_s less one step: detection, restart, load, the
steps trained again), which a busy machine slows alike. Read the kills' goodput to compare modes: the
uninterrupted job is torchrun's, and the survivors' processes, forked by a warm parent, step faster
than torchrun's (measured on 2 cores: ddp by a few percent, fsdp at 4 ranks by a quarter), so their
wall-clock goodput can pass 1. --rounds N runs the uninterrupted job and
every mode N times, interleaved (round 1's, then round 2's), so that a drift in load shows as a
difference between rounds. Each faulted job must end with the uninterrupted digest, after exactly one
torchrun restart per kill (--survivors: one new generation per kill, and one new process: every other
rank's is the same). Writes results.json into --out; --plot DIR draws each job's step against its wall
time (round 1), the kills marked, into DIR/goodput.png.
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
from harness.launch import problems, survivors_job, torchrun  # noqa: E402
from harness.procs import finish, start, workers  # noqa: E402
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
    p.add_argument("--rounds", type=int, default=1, help="times each job runs, the rounds interleaved")
    p.add_argument("--plot", default="", help="a folder for goodput.png: each job's step against its wall time")
    args = p.parse_args(argv)
    os.environ.pop("FT_FAULTS", None)  # its faults are its own kills, none from the caller's shell
    modes = [m.strip() for m in args.modes.split(",")]
    if args.script not in ("ddp/train.py", "fsdp/train.py") or args.nproc < 1 or args.steps < 100 or args.rounds < 1:
        p.error("--script ddp/train.py or fsdp/train.py, --nproc >= 1, --steps >= 100, --rounds >= 1")
    if not set(modes) <= set(MODES):
        p.error(f"--modes takes some of: {', '.join(MODES)}")
    out, rng = Path(args.out).resolve(), random.Random(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--steps", args.steps, "--preset", args.preset, "--batch-size", 8 * args.nproc, "--log-every", 1000,
             "--dropout", 0.1]
    clean, rows, drawn, kills, digest = [], {}, {}, None, None
    for round_ in range(1, args.rounds + 1):
        suffix = f"-{round_}" if args.rounds > 1 else ""
        clean_dir = out / f"uninterrupted{suffix}"
        t0 = time.time()
        proc = start(*torchrun(args.script, args.nproc, clean_dir, [*flags, *MODES["disk alone"]]),
                     log=f"{clean_dir}.log")
        code, output, hung = finish(proc, t0 + 1800)
        clean_s = time.time() - t0
        wrong = ["hung"] if hung else problems(clean_dir, code, output)
        if wrong:
            raise SystemExit(f"goodput: the uninterrupted job failed ({'; '.join(wrong)}):\n{output[-3000:]}")
        step_s = statistics.median(step_times(clean_dir))
        clean.append({"wall_s": clean_s, "median_step_s": step_s})
        if kills is None:  # drawn once, from round 1's step time: every job of every round gets the same
            kills, digest = draw_kills(rng, step_s, args.mean_gap_s, args.steps), summary(clean_dir)["param_digest"]
            drawn["uninterrupted"] = (clean_dir, t0, [])
        print(f"uninterrupted{suffix}: {clean_s:.1f} s, median step {step_s * 1000:.1f} ms; kills after steps "
              f"{kills}", flush=True)
        for mode in modes:
            run_dir = out / f"{mode.replace(' ', '-')}{suffix}"
            launched = time.time()
            wall, killed_at = faulted(args.script, args.nproc, run_dir, [*flags, *MODES[mode]], kills,
                                      random.Random(args.seed), getattr(signal, f"SIG{args.signal}"))
            drawn.setdefault(mode, (run_dir, launched, killed_at))
            row = measure(run_dir, killed_at, wall, clean_s, step_s, args.steps, digest)
            rows.setdefault(mode, []).append(row)
            print(f"{mode}{suffix}: {wall:.1f} s, goodput {row['goodput']:.3f} (the kills': "
                  f"{row['goodput_of_kills']:.3f}), {row['replayed_steps']} steps replayed", flush=True)
    print(tabulate([[mode, *table_row(runs)] for mode, runs in rows.items()],
                   headers=["", "goodput (wall clock)", "goodput (the kills')", "time lost", "steps replayed",
                            "restarts etc.", "kill to training again p50 / p95", "step time / uninterrupted",
                            "digest =="]))
    print("(compare the modes by the kills' goodput: the wall clock's is against torchrun's uninterrupted job, "
          "whose processes step slower than the survivors' forked ones)")
    result = {"kills_after_steps": kills, "rounds": args.rounds, "uninterrupted": clean, "modes": rows,
              "signal": args.signal,
              "command": "bash run.sh goodput " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(drawn, args.plot)
    if not all(r["digest_equal"] for runs in rows.values() for r in runs):
        sys.exit(1)


def draw_kills(rng, step_s, mean_gap_s, steps):
    """The steps after which a kill lands: gaps geometric, of mean `mean_gap_s` seconds of `step_s` steps."""
    p_kill = min(1.0, step_s / mean_gap_s)  # per step: a geometric gap of mean_gap_s / step_s steps
    kills, step = [], 0
    while True:
        step += 1 + int(rng.expovariate(p_kill)) if p_kill < 1 else 1
        if step >= steps - 10:
            return kills
        kills.append(step)


def measure(run_dir, killed_at, wall, clean_s, clean_step_s, steps, digest):
    """One faulted job's figures (results.json's, one round)."""
    ev = events(run_dir)
    split = [phases(ev, t) for t in killed_at]
    if not all(s and s["back_s"] is not None for s in split):
        raise SystemExit(f"goodput: {run_dir.name}: no step trained after a kill")
    own_step_s = statistics.median(step_times(run_dir))
    costs = [max(0.0, s["back_s"] - own_step_s) for s in split]
    replayed = sum(s["replayed_steps"] for s in split)
    before = [e["step_s"] for e in ev if e["event"] == "step" and e["rank"] == 0 and 5 < e["step"]
              and e["time"] < killed_at[0]]  # this layout's step time, before the first kill
    return {"step_ratio": statistics.median(before) / clean_step_s if len(before) > 10 else None, "wall_s": wall,
            "goodput": clean_s / wall, "lost_s": wall - clean_s, "kills": len(killed_at),
            "goodput_of_kills": steps * own_step_s / (steps * own_step_s + sum(costs)), "kill_costs_s": costs,
            "own_step_s": own_step_s, "replayed_steps": replayed, "replayed_s": replayed * own_step_s,
            "recovery_s": [s["total_s"] for s in split], "digest_equal": summary(run_dir)["param_digest"] == digest}


def table_row(runs):
    """A mode's cells: each round's figure, separated by commas (the kill times: all rounds together)."""
    def each(cell):
        return ", ".join(cell(r) for r in runs)
    return [each(lambda r: f"{r['goodput']:.3f}"), each(lambda r: f"{r['goodput_of_kills']:.3f}"),
            each(lambda r: f"{r['lost_s']:.1f} s"), each(lambda r: f"{r['replayed_steps']} ({r['replayed_s']:.1f} s)"),
            each(lambda r: f"{sum(r['kill_costs_s']) - r['replayed_s']:.1f} s"),
            percentiles([t for r in runs for t in r["recovery_s"]]),
            each(lambda r: f"{r['step_ratio']:.2f}" if r["step_ratio"] else "-"),
            "yes" if all(r["digest_equal"] for r in runs) else "NO"]


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


if __name__ == "__main__":
    main()
