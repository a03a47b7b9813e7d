"""How long a --survivors job takes to train again after it loses a rank, wherever the rank dies: between
steps (SIGKILL), or inside torch's own collectives (DDP's reducer, DTensor's clipping, DCP's save and the
async save's thread), and whether the old groups' gloo threads go quiet afterwards.

    .venv/bin/python tests/recovery_bench.py --script ddp --nproc 4 --out recovery-ddp-4.json
    .venv/bin/python tests/recovery_bench.py --script fsdp --nproc 8 --cases kills,clip --dir /tmp/rb

For a script and a world size: one uninterrupted torchrun job (the reference), then one --survivors job
with a spare per case, each of the same tiny model (FLAGS) and --steps:
  kills        --kills SIGKILLs, one after each --every steps of rank 0, of a random rank (0 included):
               the pid of its latest start event; a kill not followed by a generation of its own fails the case
  sync-save    fsdp: rank 0 dies in step --fault-step's save (a save every --every steps), before its commit
  async-write  fsdp --async-save: rank 2 dies writing its shards of step --fault-step, in the background
  clip         fsdp: rank 1 dies as its peers all-reduce the gradient norm of step --fault-step (DTensor)
  backward     ddp: rank 1 dies in the backward of step --fault-step, its peers in DDP's reducer
For each loss (a generation g of the survivors' "recovered" events):
  again_s      rank 0's first step after its recovery (the lowest survivor's, if rank 0 was the lost one):
               its start (end time less step_s) less the earliest survivor's lost_at: "kill to training again"
  spread_s     max - min of the survivors' lost_at: how far apart they heard of it
  recover_s    the largest survivor's recover_s (loss heard to group formed and state restored)
  heard_s      kills only: the earliest lost_at less the moment the bench sent the SIGKILL
and, from /proc every SAMPLE_S, the CPU seconds (utime + stime) of each survivor's gloo loop threads that
existed before the loss (the old groups', counted at each loss: a thread that outlives several counts
several times): over the 10 s after its recovery, against the 10 s before the loss (less where the
thread is younger), and how many of them are still there 10 s after (else: gone within how long of the
recovery). --steps must leave 10 s of training after the last loss: the table gives the shortest span
after a recovery that was sampled. A case fails if its job does not exit 0 with a summary.json, prints a
Traceback (harness.launch.problems), its fault never fires, or its digest differs from the reference's.
The run folders stay in --dir for a look. Exit 1 if a case failed.
"""
import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tabulate import tabulate  # noqa: E402

from harness import launch, procs  # noqa: E402
from harness.metrics import Watch, events  # noqa: E402

# A tiny model: on 2 cores a step took 23 ms (ddp, 4 ranks) to 542 ms (fsdp, 16 ranks).
FLAGS = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "48",
         "--log-every", "100", "--hang-timeout-s", "3"]
LOOP_THREAD = "gloo_tcp_loop"  # gloo's tcp::Loop names its thread so (/proc/<pid>/task/<tid>/comm)
WINDOW_S = 10.0  # the loop threads' CPU is summed over this long before each loss and after each recovery
SAMPLE_S = 0.25  # how often the threads' CPU is read
POLL_S = 0.05  # how often the metrics are read while the bench waits for a step to kill at
TICK_S = 1 / os.sysconf("SC_CLK_TCK")

# case: (the scripts it applies to, its flags beyond FLAGS, FT_FAULTS with {step})
CASES = {
    "kills": (("ddp", "fsdp"), [], ""),
    "sync-save": (("fsdp",), ["--save-every", "{every}"], "crash-in-save={step}"),
    "async-write": (("fsdp",), ["--save-every", "{every}", "--async-save"], "crash-in-write={step},rank=2"),
    "clip": (("fsdp",), [], "crash-in-clip={step},rank=1"),
    "backward": (("ddp",), [], "crash-in-backward={step},rank=1"),
}
NO_SAVES = ["--save-every", "100000"]  # but the last step's


def percentile(values, q):
    """The q-th percentile (0-100) of values, interpolated between the nearest ranks; None if none."""
    values = sorted(values)
    if not values:
        return None
    at = (len(values) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def loop_threads(pids):
    """{(pid, tid): CPU ticks} of the gloo loop threads of the processes `pids`."""
    found = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone
            continue
        for tid in tasks:
            try:
                if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != LOOP_THREAD:
                    continue
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                found[(pid, int(tid))] = int(fields[11]) + int(fields[12])  # utime, stime (stat's 14th, 15th)
            except (OSError, IndexError, ValueError):
                continue
    return found


def run_job(cmd, env, run_dir, deadline, nproc=0, kills=0, every=0, seed=0):
    """Start a job, send it its SIGKILLs (one after each `every` steps of rank 0, `kills` of them, at a rank
    drawn with `seed`), sample its workers' loop threads until it ends. Returns (exit code, output,
    [(time, {(pid, tid): ticks})], [{"rank", "pid", "step", "time"} per kill sent])."""
    proc = procs.start(cmd, env, run_dir / "job.log")
    watch, draw, samples, sent = Watch(run_dir), random.Random(seed), [], []
    read, pids, latest_pid, rank0_steps = 0, set(), {}, []  # what the events read so far say
    next_sample = 0.0
    while proc.poll() is None and time.time() < deadline:
        new = watch.poll()[read:]
        read += len(new)
        for e in new:
            if e["event"] == "start":
                pids.add(e["pid"])
                latest_pid[e["rank"]] = e["pid"]
            elif e["event"] == "step" and e["rank"] == 0:
                rank0_steps.append((e["step"], e["time"]))
        if time.monotonic() >= next_sample:
            samples.append((time.time(), loop_threads(pids)))
            next_sample = time.monotonic() + SAMPLE_S
        due = every * (len(sent) + 1)
        after = sent[-1]["time"] if sent else 0  # a step trained since the last kill, not one before it
        if len(sent) < kills and rank0_steps and rank0_steps[-1][0] >= due and rank0_steps[-1][1] > after:
            rank = draw.randrange(nproc)
            pid = latest_pid[rank]
            try:
                os.kill(pid, signal.SIGKILL)
                sent.append({"rank": rank, "pid": pid, "step": due, "time": time.time()})
            except ProcessLookupError:
                sent.append({"rank": rank, "pid": pid, "step": due, "time": time.time(), "missed": True})
        time.sleep(POLL_S)  # sampling /proc and the metrics every POLL_S, not waiting for a moment
    code, output, _ = procs.finish(proc, deadline)
    return code, output, samples, sent


def cpu_between(samples, key, t0, t1):
    """(CPU seconds of thread `key` between t0 and t1, seconds of that span it was seen in) from the samples
    taken in it: a thread seen once there (gone within a sample of t0) counts 0."""
    inside = [(t, threads[key]) for t, threads in samples if t0 <= t <= t1 and key in threads]
    if len(inside) < 2:
        return 0.0, 0.0
    return (inside[-1][1] - inside[0][1]) * TICK_S, inside[-1][0] - inside[0][0]


def recoveries(run_dir, samples, sent):
    """One row per generation formed after a loss, from the survivors' recovered events (see the docstring)."""
    rows_by_rank = events(run_dir)
    steps = sorted((e for e in rows_by_rank if e["event"] == "step"), key=lambda e: e["time"])
    step_s = statistics.median(e["step_s"] for e in steps if e["rank"] == 0)
    found = []
    for gen in sorted({e["generation"] for e in rows_by_rank if e["event"] == "recovered"}):
        heard = [e for e in rows_by_rank if e["event"] == "recovered" and e["generation"] == gen]
        lost_at = min(e["lost_at"] for e in heard)
        ref = min(heard, key=lambda e: e["rank"])
        first = next((e for e in steps if e["rank"] == ref["rank"] and e["time"] > ref["time"]), None)
        row = {"generation": gen, "survivors": len(heard), "timed_rank": ref["rank"], "lost_at": lost_at,
               "again_s": first["time"] - first["step_s"] - lost_at if first else None,
               "spread_s": max(e["lost_at"] for e in heard) - lost_at,
               "recover_s": max(e["recover_s"] for e in heard), "formed_s": max(e["formed_s"] for e in heard),
               "restored_step": ref["step"], "lost_step": ref.get("lost_step")}
        row["slow"] = row["again_s"] is None or row["again_s"] > 1 + step_s
        kill = next((k for k in reversed(sent) if not k.get("missed") and k["time"] <= lost_at <= k["time"] + 30),
                    None)
        if kill:
            row["kill"], row["heard_s"] = kill, lost_at - kill["time"]
        before = after = 0.0
        old, alive, gone_by, before_spans, covered, details = 0, 0, [], [], [], []
        for e in heard:
            last = [threads for t, threads in samples if t < e["lost_at"]]
            for key in (k for k in (last[-1] if last else {}) if k[0] == e["pid"]):
                old += 1
                cpu, span = cpu_between(samples, key, e["lost_at"] - WINDOW_S, e["lost_at"])
                cpu_after = cpu_between(samples, key, e["time"], e["time"] + WINDOW_S)[0]
                before, after, before_spans = before + cpu, after + cpu_after, [*before_spans, span]
                seen = [t for t, threads in samples if key in threads]
                if seen[-1] >= e["time"] + WINDOW_S - SAMPLE_S:
                    alive += 1
                else:
                    gone_by.append(seen[-1] + SAMPLE_S - e["time"])  # last seen, plus a sample's gap
                details.append({"rank": e["rank"], "pid": key[0], "tid": key[1], "cpu_before_s": cpu,
                                "before_span_s": span, "cpu_after_s": cpu_after,
                                "last_seen_after_recovery_s": seen[-1] - e["time"]})
            covered.append(min(samples[-1][0], e["time"] + WINDOW_S) - e["time"] if samples else 0.0)
        row.update(old_loop_threads=old, old_alive_after=alive, old_gone_within_s=max(gone_by, default=None),
                   old_cpu_before_s=before, before_window_s=max(before_spans, default=None),
                   old_cpu_after_s=after, after_window_s=min(covered, default=0.0), old_threads=details)
        found.append(row)
    return found, step_s


def job_problems(run_dir, code, output):
    """launch.problems of a --survivors job: exit 0 with a summary.json, and no Traceback. Its "restarts" (the
    supervisor's of rank 0's slot, in TORCHELASTIC_RESTART_COUNT) follow the kills: not checked."""
    path = Path(run_dir) / "summary.json"
    restarts = json.loads(path.read_text())["restarts"] if code == 0 and path.exists() else 0
    return launch.problems(run_dir, code, output, restarts) + (["a Traceback in the output"] if "Traceback" in output
                                                               else [])


def fired(run_dir, faults, output):
    """Whether the case's fault fired: its marker in faults-fired/ and its line in the output."""
    kind = faults.split("=")[0]
    return (Path(run_dir) / "faults-fired" / kind).exists() and "injected crash:" in output


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--script", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--nproc", type=int, default=4, help="ranks (the global batch, 48, must divide by it)")
    p.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(CASES)}; default: all the script's")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs of the kills case")
    p.add_argument("--every", type=int, default=20, help="steps between kills; the save cases' --save-every")
    p.add_argument("--fault-step", type=int, default=100, help="the step the other cases' fault fires at")
    p.add_argument("--seed", type=int, default=0, help="draws the ranks the kills hit")
    p.add_argument("--timeout-s", type=float, default=900, help="per job: one still running then is killed, failed")
    p.add_argument("--dir", default="", help="where the run folders go (kept); default: a new one in /tmp")
    p.add_argument("--out", default="", help="also write the results as JSON to this file")
    args = p.parse_args()
    cases = (args.cases.split(",") if args.cases else
             [case for case, (scripts, _, _) in CASES.items() if args.script in scripts])
    wrong = [c for c in cases if c not in CASES or args.script not in CASES[c][0]]
    if wrong or 48 % args.nproc:
        sys.exit(f"recovery_bench: {args.script} has no case {', '.join(wrong)}" if wrong else
                 f"recovery_bench: --nproc {args.nproc} does not divide the batch of 48")
    script = f"{args.script}/train.py"
    base = [*FLAGS, "--steps", str(args.steps)]
    folder = Path(args.dir or tempfile.mkdtemp(prefix="recovery-bench-")) / f"{args.script}-{args.nproc}"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{script}, {args.nproc} ranks: run folders in {folder}", flush=True)

    ref_dir = folder / "reference"
    cmd, env = launch.torchrun(script, args.nproc, ref_dir, [*base, *NO_SAVES], env={"FT_FAULTS": ""})
    t0 = time.time()
    code, output, _, _ = run_job(cmd, env, ref_dir, t0 + args.timeout_s)
    reference = {"dir": str(ref_dir), "wall_s": time.time() - t0, "problems": launch.problems(ref_dir, code, output)}
    reference["digest"] = (json.loads((ref_dir / "summary.json").read_text())["param_digest"]
                           if not reference["problems"] else None)
    print(f"  reference: {reference['wall_s']:.0f} s; {'; '.join(reference['problems']) or 'ok'}", flush=True)

    results = {}
    for case in cases:
        _, extra, faults = CASES[case]
        faults = faults.format(step=args.fault_step)
        flags = [*base, *(f.format(every=args.every) for f in extra)] if extra else [*base, *NO_SAVES]
        run_dir = folder / case
        cmd, env = launch.survivors_job(script, args.nproc, run_dir, flags, spares=1, max_restarts=args.kills)
        t0 = time.time()
        code, output, samples, sent = run_job(cmd, {**env, "FT_FAULTS": faults}, run_dir, t0 + args.timeout_s,
                                              args.nproc, args.kills if case == "kills" else 0, args.every, args.seed)
        problems = job_problems(run_dir, code, output)
        if case == "kills":
            problems += [f"the kill at step {k['step']} (rank {k['rank']}) found no process" for k in sent
                         if k.get("missed")]
            problems += [f"{len(sent)} of {args.kills} kills sent"] if len(sent) < args.kills else []
        elif not fired(run_dir, faults, output):
            problems.append(f"FT_FAULTS={faults} never fired")
        rows, step_s = recoveries(run_dir, samples, sent) if (run_dir / "metrics-rank0.jsonl").exists() else ([], None)
        if case == "kills":
            heard = {r["kill"]["time"] for r in rows if "kill" in r}
            problems += [f"{len(sent) - len(heard)} kills not followed by a generation of their own within 30 s"
                         ] if len(heard) < len(sent) else []
        digest = (json.loads((run_dir / "summary.json").read_text())["param_digest"]
                  if (run_dir / "summary.json").exists() else None)
        if reference["digest"] is not None and digest != reference["digest"]:
            problems.append("param_digest differs from the reference's")
        again = [r["again_s"] for r in rows if r["again_s"] is not None]
        results[case] = {
            "dir": str(run_dir), "faults": faults, "flags": flags, "wall_s": time.time() - t0, "step_s": step_s,
            "losses": len(rows), "again_p50_s": percentile(again, 50), "again_p95_s": percentile(again, 95),
            "again_max_s": max(again, default=None), "spread_max_s": max((r["spread_s"] for r in rows), default=None),
            "recover_max_s": max((r["recover_s"] for r in rows), default=None),
            "old_cpu_before_s": sum(r["old_cpu_before_s"] for r in rows),
            "old_cpu_after_s": sum(r["old_cpu_after_s"] for r in rows),
            "old_loop_threads": sum(r["old_loop_threads"] for r in rows),
            "old_alive_after": sum(r["old_alive_after"] for r in rows),
            "old_gone_within_s": max((r["old_gone_within_s"] for r in rows if r["old_gone_within_s"] is not None),
                                     default=None),
            "after_window_min_s": min((r["after_window_s"] for r in rows), default=None),
            "slow_losses": sum(r["slow"] for r in rows),
            "digest_same": digest is not None and digest == reference["digest"], "problems": problems,
            "recoveries": rows, "kills_sent": sent}
        r = results[case]
        print(f"  {case}: {r['wall_s']:.0f} s, {len(rows)} losses, again "
              f"{', '.join(f'{x:.2f}' for x in again)} s{'; ' + '; '.join(problems) if problems else ''}", flush=True)

    def s(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"

    table = [[case, r["losses"], s(r["step_s"] * 1000 if r["step_s"] else None, 0),
              f"{s(r['again_p50_s'])} / {s(r['again_p95_s'])} / {s(r['again_max_s'])}", s(r["spread_max_s"], 3),
              s(r["recover_max_s"]), r["slow_losses"],
              f"{r['old_loop_threads']}: {r['old_alive_after']} alive, gone in {s(r['old_gone_within_s'], 1)} s",
              f"{s(r['old_cpu_before_s'])} / {s(r['old_cpu_after_s'])} ({s(r['after_window_min_s'], 1)} s)",
              "yes" if r["digest_same"] else "NO",
              "; ".join(r["problems"]) or "-"] for case, r in results.items()]
    print(tabulate(table, headers=["case", "losses", "step ms", "again s p50 / p95 / max", "hear spread s",
                                   "recover_s max", "> 1 s + step",
                                   "old loop threads", "their CPU s before / after (after's span)",
                                   "digest = ref", "problems"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"script": script, "nproc": args.nproc, "flags": base,
                                              "command": " ".join(sys.argv), "reference": reference,
                                              "cases": results}, indent=2) + "\n")
    sys.exit(1 if reference["problems"] or any(r["problems"] for r in results.values()) else 0)


if __name__ == "__main__":
    main()
