"""Chaos soak: seeded random faults, each job checked against its uninterrupted reference.

    bash run.sh chaos                               # a short soak (a few minutes on 2 cores)
    bash run.sh chaos --trials 40 --seed 7          # a long one; the seed reproduces every trial
    bash run.sh chaos --strategies fsdp --trials 10

Faults, drawn at random per trial: SIGKILL of a random worker at a random moment of training
(mid-forward, mid-backward, mid-collective or mid-save, wherever it lands), --crash-at-step on a
random rank, --crash-in-save, two faults in one job (a crash, then a SIGKILL after the restart),
the newest checkpoint truncated or a shard deleted between two launches, and a crash while an
async save is in flight. A trial passes when the job finishes within its time bound, loaded no
damaged checkpoint, and ends with the reference digest. Exit code 1 if any trial failed.
"""
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.checkpoint import checkpoints  # noqa: E402
from common.compare import events, finish, torchrun_cmd  # noqa: E402
from common.config import Parser  # noqa: E402

JOBS = {  # strategy -> (script, processes, flags); small jobs, so that most of a trial is training
    "ddp": ("ddp/train.py", 2, []),
    "fsdp": ("fsdp/train.py", 2, []),
    "fsdp-async": ("fsdp/train.py", 2, ["--async-save"]),
    "rpc": ("rpc/ps.py", 3, []),
}
STEPS, EVERY = 48, 4
COMMON = ["--steps", STEPS, "--save-every", EVERY, "--dim", "64", "--layers", "2", "--heads", "4",
          "--seq-len", "32", "--batch-size", "12", "--log-every", "1000"]
KINDS = ["sigkill", "crash-at-step", "crash-in-save", "two-faults", "damage-newest", "async-in-flight"]


def launch(script, nproc, run_dir, flags, max_restarts=3):
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = torchrun_cmd(script, nproc, run_dir, flags, max_restarts)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True), cmd


def workers(agent_pid):
    """PIDs of the processes torchrun's agent started (its direct children)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent_pid:
            pids.append(int(stat.parent.name))
    return pids


def restarted(run_dir):
    return any(e["event"] == "start" and e["restarts"] > 0 for e in events(run_dir))


def sigkill_during_training(proc, run_dir, rng, window, deadline, after_restart=False):
    """SIGKILL one random worker at a random moment of training. Returns the kill time, or None."""
    while not (restarted(run_dir) if after_restart else any(e["event"] == "step" for e in events(run_dir))):
        try:
            proc.wait(timeout=0.1)  # the job ended before training started: nothing to kill
            return None
        except subprocess.TimeoutExpired:
            if time.time() > deadline:
                return None
    try:
        proc.wait(timeout=rng.uniform(0, window))  # the fault's random moment
        return None
    except subprocess.TimeoutExpired:
        pids = workers(proc.pid)
        if not pids:
            return None
        os.kill(rng.choice(pids), signal.SIGKILL)
        return time.time()


def damage_newest(run_dir, rng):
    """Truncate the newest committed checkpoint, or delete one of its shard files. Returns its step."""
    step, path = checkpoints(Path(run_dir) / "ckpt")[0]
    target = path if path.is_file() else rng.choice(sorted(path.glob("*.distcp")))
    if path.is_dir() and rng.random() < 0.5:
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return step


def run_trial(t, strategy, kind, rng, out, reference, bound):
    script, nproc, extra = JOBS[strategy]
    run_dir = out / f"trial-{t:03d}-{strategy}-{kind}"
    flags, crash_rank = [*COMMON, *extra], rng.randrange(nproc)
    steps, every = STEPS, EVERY
    if kind in ("crash-at-step", "two-faults"):
        flags += ["--crash-at-step", rng.randrange(1, steps), "--crash-rank", crash_rank]
    elif kind == "crash-in-save":
        flags += ["--crash-in-save", rng.randrange(every, steps, every)]
    elif kind == "async-in-flight":  # right after a save was started in the background
        flags += ["--crash-at-step", rng.randrange(every, steps - 1, every) + 1, "--crash-rank", crash_rank]
    deadline, damaged, fault_at = time.time() + bound, None, None
    if kind == "damage-newest":  # first launch dies with no restart left; damage; relaunch
        proc, cmd = launch(script, nproc, run_dir, [*flags, "--crash-at-step", rng.randrange(2 * every, steps)], 0)
        finish(proc, deadline)
        damaged = damage_newest(run_dir, rng)
    proc, cmd = launch(script, nproc, run_dir, flags)
    if kind in ("sigkill", "two-faults"):
        fault_at = sigkill_during_training(proc, run_dir, rng, 0.9 * reference["train_s"], deadline,
                                           after_restart=kind == "two-faults")
    code, output, hung = finish(proc, deadline)
    result = {"trial": t, "strategy": strategy, "kind": kind, "hung": hung, "exit": code,
              "command": " ".join(map(str, cmd)), "killed": fault_at is not None}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else {}
    ev = events(run_dir)
    loads = [e["step"] for e in ev if e["event"] == "load" and e["rank"] == 0]
    result["fired"] = damaged is not None or any(e["event"] == "start" and e["restarts"] > 0 for e in ev)
    result["recovered"] = code == 0 and bool(summary)
    result["digest_equal"] = summary.get("param_digest") == reference["digest"]
    result["bad_loads"] = int(damaged in loads)
    starts = sorted(e["time"] for e in ev if e["event"] == "start" and e["restarts"] > 0)
    if fault_at is None and starts:  # an injected crash: its moment is the last step before the restart
        before = [e["time"] for e in ev if e["event"] == "step" and e["time"] < starts[0]]
        fault_at = max(before) if before else None
    after = [e["time"] for e in ev if e["event"] == "step" and fault_at and e["time"] > fault_at
             and starts and e["time"] > starts[-1]]
    result["recovery_s"] = min(after) - fault_at if after and fault_at else None
    if not (result["recovered"] and result["digest_equal"] and not result["bad_loads"]):
        result["output_tail"] = output[-3000:]
    return result


def main(argv=None):
    p = Parser(prog="bash run.sh chaos", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=4, help="jobs with faults")
    p.add_argument("--seed", type=int, default=0, help="reproduces the series of trials")
    p.add_argument("--strategies", default="ddp,fsdp,fsdp-async,rpc", help="from: " + ", ".join(JOBS))
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, from: " + ", ".join(KINDS))
    p.add_argument("--out", default="runs/chaos", help="folder for the jobs and results.json")
    args = p.parse_args(argv)
    strategies, kinds = args.strategies.split(","), args.kinds.split(",")
    bad = [s for s in strategies if s not in JOBS] + [k for k in kinds if k not in KINDS]
    if bad or args.trials < 1:
        p.error(f"unknown: {', '.join(bad)}" if bad else "--trials must be >= 1")
    out, rng, started = Path(args.out).resolve(), random.Random(args.seed), time.time()
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)

    def log(msg):
        print(f"[{time.time() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    plan = []
    for t in range(args.trials):
        strategy = rng.choice(strategies)
        choices = [k for k in kinds if k != "async-in-flight" or strategy == "fsdp-async"] or kinds
        plan.append((t, strategy, rng.choice(choices), random.Random(rng.random())))
    references = {}
    for strategy in sorted({s for _, s, _, _ in plan}):
        script, nproc, extra = JOBS[strategy]
        run_dir = out / f"reference-{strategy}"
        log(f"reference {strategy} ...")
        launched = time.time()
        proc, _ = launch(script, nproc, run_dir, [*COMMON, *extra])
        code, output, _ = finish(proc, launched + 600)
        if code != 0:
            raise SystemExit(f"chaos: the reference {strategy} job failed:\n{output[-3000:]}")
        steps = [e["time"] for e in events(run_dir) if e["event"] == "step"]
        references[strategy] = {"digest": json.loads((run_dir / "summary.json").read_text())["param_digest"],
                                "train_s": max(steps) - min(steps), "total_s": time.time() - launched}
    results = []
    for t, strategy, kind, trial_rng in plan:
        log(f"trial {t}: {strategy}, {kind} ...")
        bound = 4 * references[strategy]["total_s"] + 60  # generous, but a hang cannot pass it
        results.append(run_trial(t, strategy, kind, trial_rng, out, references[strategy], bound))
        r = results[-1]
        log(f"trial {t}: {'ok' if r['recovered'] and r['digest_equal'] and not r['bad_loads'] else 'FAILED'}"
            f" (exit {r['exit']}, recovery {r['recovery_s'] and round(r['recovery_s'], 1)} s)")
    (out / "results.json").write_text(json.dumps({"seed": args.seed, "trials": results}, indent=2) + "\n")
    rows = []
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        if rs:
            rec = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
            rows.append([kind, len(rs), sum(r["fired"] for r in rs), sum(r["recovered"] for r in rs), sum(r["digest_equal"] for r in rs),
                         sum(r["bad_loads"] for r in rs), sum(r["hung"] for r in rs),
                         f"{statistics.median(rec):.1f} s" if rec else "n/a"])
    print(f"chaos: {len(results)} trials, seed {args.seed}, strategies {args.strategies}")
    print(tabulate(rows, headers=["fault", "jobs", "jobs hit", "recovered", "digest == reference", "damaged loaded",
                                  "hangs", "median recovery"]))
    failed = [r for r in results if not (r["recovered"] and r["digest_equal"] and not r["bad_loads"])]
    for r in failed:
        print(f"\nFAILED trial {r['trial']} ({r['strategy']}, {r['kind']}); reproduce with "
              f"bash run.sh chaos --seed {args.seed} --trials {r['trial'] + 1}; its last command:\n{r['command']}\n"
              f"{r.get('output_tail', '')}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
