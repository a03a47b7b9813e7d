"""One trial of the chaos soak (harness/chaos.py) and its verdict: its kind's stages run in order on its
job (chaos_faults.py), then the finished job judged against its reference. What a trial must show to
pass is in chaos.py's docstring.
"""
import json
import time

from harness.chaos_faults import JOB_FLAGS, NO_MEMORY_TIER, SURVIVORS, FaultMissed, Job, Trial, processes
from harness.launch import STRATEGIES, problems
from harness.metrics import Watch, events, final_history, phases
from harness.procs import finish, start


def run_trial(t, strategy, kind, rng, out, ref, ranks):
    """Trial `t`: the kind prepares its job, the job is launched, the kind fires its fault into it, the
    job is waited for and judged."""
    script, strategy_flags = STRATEGIES[strategy]
    nproc = processes(strategy, kind, ranks)
    trial = Trial(t, strategy, kind.name, nproc, kind.restarts_on.get(strategy, kind.restarts))
    job = Job(trial, script, out / f"trial-{t:03d}-{strategy}-{kind.name}", rng, ref, [*JOB_FLAGS, *strategy_flags],
              deadline=time.time() + 4 * ref.total_s + 60, crash_rank=rng.randrange(nproc))  # drawn first, any kind
    try:
        kind.prepare(job)
        job.cmd, job.env = kind.launch(job)
        trial.command = " ".join(job.cmd)
        if job.faults:  # the scripts read them from the environment
            trial.command = f"FT_FAULTS={job.faults} {trial.command}"
        job.watch = Watch(job.run_dir, new_lines_only=True)  # not a first launch's (first_launch_crashes)
        job.proc = start(job.cmd, job.env, log=f"{job.run_dir}.log")
        kind.fire(job)
        code, job.output, trial.hung = finish(job.proc, job.deadline)
        job.events = job.watch.poll()
        return judge(job, kind, code)
    except FaultMissed as missed:
        trial.problems.append(missed.problem)
        trial.output_tail = missed.output[-3000:]
        return trial
    finally:
        if job.cluster:  # every node's processes, namespaces and files
            job.cluster.close()


def judge(job, kind, code):
    """The finished job against its reference: what every trial is checked for, the recovery in its
    phases, and the kind's own checks."""
    trial, ev, summary_path = job.trial, job.events, job.run_dir / "summary.json"
    job.summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else {}
    trial.exit, trial.recovered = code, bool(job.summary)
    # --survivors: no torchrun restart, a new generation of the group per lost process
    trial.restarts = job.summary.get("generation" if trial.strategy in SURVIVORS else "restarts")
    if trial.hung:
        trial.problems.append("hung")
    elif trial.strategy in SURVIVORS:
        trial.problems += survivors_problems(job, kind, code)
    else:  # expected None: any count (a false alarm's restart)
        trial.problems += problems(job.run_dir, code, job.output, trial.restarts if trial.expected_restarts is None
                                   else trial.expected_restarts)
    # A checkpoint that must not be loaded is on disk; the memory tier may hold a whole snapshot of its step.
    from_disk = [e["step"] for e in ev if e["rank"] == 0 and e["event"] == "load" and e.get("source") != "memory"]
    trial.bad_loads = sum(job.damaged is not None and step == job.damaged for step in from_disk)
    trial.fired = kind.fired(job)
    trial.fault_step = job.hit.step if job.hit else job.crash_step

    trained_at = [e["time"] for e in ev if e["attempt"] == 0 and e["event"] in ("step", "save")]
    lost_at = [e["lost_at"] for e in ev if e["event"] == "recovered"]  # --survivors: no new attempt, a new generation
    if lost_at:
        trained_at = [t for t in trained_at if t < min(lost_at)]
    # The time of the fault; an injected crash's: attempt 0's last step or save.
    fault_at = job.hit.time if job.hit else max(trained_at, default=None)
    if fault_at and (trial.expected_restarts or kind.relaunch_timed):  # a relaunch after damage: no fault time
        after = [e for e in ev if e["rank"] == 0 and e["event"] in ("start", "recovered") and e["time"] > fault_at]
        trial.resumed_step = after[0].get("resumed_from_step", after[0].get("step")) if after else None
        split = phases(ev, fault_at)
        trial.recovery_s = split.get("total_s")
        for key in ("detect_s", "restart_s", "load_s", "first_step_s", "replayed_steps", "replay_s"):
            setattr(trial, key, split.get(key))
        cold_s = job.ref.cold.get("total_s")
        if trial.recovery_s and cold_s:
            trial.vs_cold_start = trial.recovery_s / cold_s

    trial.problems += kind.checks(job)
    if kind.lost_processes and trial.strategy in NO_MEMORY_TIER and (trial.replayed_steps or 0) > 1:
        trial.problems.append(f"replayed {trial.replayed_steps} steps: the memory tier loses at most one")
    trial.digest_equal = bool(job.summary) and job.summary.get("param_digest") == kind.expected(job)
    if trial.strategy == "rpc-async" and job.summary:  # arrival order decides its weights: its guarantees instead
        wrong = async_problems(events(job.run_dir), job.summary)
        trial.problems += wrong
        trial.async_ok = not wrong
    trial.passed = (trial.fired and trial.recovered and (trial.digest_equal or trial.async_ok) and not trial.bad_loads
                    and trial.kept is not False and not trial.problems)
    if not trial.passed:
        trial.output_tail = job.output[-3000:]
    return trial


def survivors_problems(job, kind, code):
    """What is wrong with a finished --survivors job ([] if nothing): it must exit 0 with no Traceback,
    after one new generation per lost process (a lost node: one), and every rank but the lost ones
    must have kept its process (one start event, the pid of its recovered events)."""
    if code != 0 or not job.summary:
        return [f"exit code {code}" + ("" if job.summary else ", no summary")]
    wrong = ["a Traceback in the output"] if "Traceback" in job.output else []
    lost = job.trial.expected_restarts
    if lost is not None and job.summary.get("generation") != lost:
        wrong.append(f"generation {job.summary.get('generation')}, expected {lost}")
    may_restart = job.trial.processes // 2 if job.lost else lost or 0
    if job.cluster:  # --nodes: the ranks of the nodes lost or gone; on a lossy link, any fenced rank
        may_restart = job.trial.processes // kind.nodes * len(job.gone)
        may_restart = job.trial.processes if lost is None else may_restart
    starts, held = {}, {}  # each rank's processes; the one that held it at each recovery
    for e in sorted(job.events, key=lambda e: e["time"]):
        if e["event"] == "start":
            starts.setdefault(e["rank"], []).append(e["pid"])
        elif e["event"] == "recovered" and e["pid"] != starts.get(e["rank"], [None])[-1]:
            held[e["rank"]] = e["pid"]
    restarted = [r for r, pids in starts.items() if len(pids) > 1]
    if len(restarted) > may_restart or held:
        wrong.append(f"ranks {restarted} started again: a survivor restarted (starts {starts})")
    return wrong


def async_problems(all_events, summary):
    """What breaks rpc/ps.py's async guarantees, from every launch's metrics ([] if nothing): each resume
    loaded the state its checkpoint's save had (weights and optimizer, by the digest the save recorded
    in the checkpoint and, unless killed between its commit and its event, in its save event); the
    final history has every update once; no (trainer, trainer step) was applied twice; none staler than
    the bound."""
    wrong = []
    saves = [e for e in all_events if e["rank"] == 0 and e["event"] == "save"]
    for load in (e for e in all_events if e["rank"] == 0 and e["event"] == "load"):
        saved = [e["digest"] for e in saves if e["step"] == load["step"] and e["time"] < load["time"]]
        if load["digest"] != load["saved_digest"] or saved[-1:] not in ([], [load["digest"]]):
            wrong.append(f"the resume from step {load['step']} loaded another state than its save had")
    history = final_history(all_events)
    applied = [(trainer, step) for update in history.values() for trainer, step, _ in update]
    stalest = max((step - 1 - version for step, update in history.items() for _, _, version in update), default=0)
    if sorted(history) != list(range(1, summary["steps"] + 1)):
        wrong.append(f"the final history has updates {sorted(history)}, not 1..{summary['steps']}")
    if len(applied) != len(set(applied)):
        wrong.append(f"{len(applied) - len(set(applied))} gradients applied twice")
    if stalest > summary["max_staleness"]:
        wrong.append(f"a gradient {stalest} updates stale applied, above --max-staleness {summary['max_staleness']}")
    return wrong

