"""Reading what common/monitor.py writes: every rank's metrics-rank<r>.jsonl, as a job writes them (Watch)
or once it ended, and the figures the runners, the chaos soak and the tests take from it (recovery
phases, a parameter server's history, step times while a save is in flight, memory at start-up and in
training)."""
import json
import statistics
import time
from pathlib import Path

POLL_S = 0.005  # how often a Watch reads the files while it waits for an event


def events(run_dir):
    rows = []
    for path in sorted(Path(run_dir).glob("metrics-rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


class Watch:
    """Follows a job's metrics-rank<r>.jsonl files as they grow, for a runner or a test that must act at
    a step of training (a step, not a moment: it lands however fast the machine is). Each event gets
    `attempt`: the torchrun restart count of its rank's last start event (-1 before any). Step, save and
    start events are labelled right; a load or fallback, written before its start event, is not.
    new_lines_only: the lines already in the files (an earlier launch's) are skipped."""

    def __init__(self, run_dir, new_lines_only=False):
        self.run_dir, self.events, self.attempt = Path(run_dir), [], {}
        self.offset = {p: p.stat().st_size for p in self.run_dir.glob("metrics-rank*.jsonl")} if new_lines_only else {}

    def poll(self):
        """Every event read so far, those written since the last poll read now."""
        for path in sorted(self.run_dir.glob("metrics-rank*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offset.get(path, 0))
                data = f.read()
            data = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self.offset[path] = self.offset.get(path, 0) + len(data)
            for line in data.splitlines():
                e = json.loads(line)
                if e["event"] == "start":
                    self.attempt[e["rank"]] = e["restarts"]
                self.events.append({**e, "attempt": self.attempt.get(e["rank"], -1)})
        return self.events

    def until(self, match, proc, deadline=None):
        """The first event for which match(event) holds, waiting for it while the job `proc` runs; None if
        the job ends or the deadline (epoch seconds) passes first."""
        seen = 0
        while proc.poll() is None and (deadline is None or time.time() < deadline):
            new = self.poll()[seen:]
            seen += len(new)
            found = next((e for e in new if match(e)), None)
            if found is not None:
                return found
            time.sleep(POLL_S)  # polling the files the job writes, not waiting for a guessed moment
        return None

    def first(self, event, proc, deadline=None, rank=0, attempt=None, min_step=None):
        """Rank `rank`'s first `event` (of torchrun attempt `attempt`; at step `min_step` or later), as until()."""
        return self.until(lambda e: e["rank"] == rank and e["event"] == event
                          and (attempt is None or e["attempt"] == attempt)
                          and (min_step is None or e["step"] >= min_step), proc, deadline)

    def latest_step(self, attempt=None, rank=0):
        """The last step rank `rank` completed so far (in torchrun attempt `attempt`); 0 if none."""
        return max((e["step"] for e in self.poll() if e["rank"] == rank and e["event"] == "step"
                    and (attempt is None or e["attempt"] == attempt)), default=0)


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def phases(events, since):
    """How long a job took to train again after the moment `since` (epoch seconds), split into what it
    waited for, as rank 0's metrics show it; {} if no step followed a start after `since`. After a
    fault, `since` is the fault's time; for a cold start, the launch of torchrun. With --survivors, rank 0
    may have lived on: its 'recovered' event stands for the start (no launch, no restart), and a spare
    that took its place was launched before `since` (no restart either).

      total_s         `since` to the end of the first step trained after it
      detect_s        `since` to the launch of the new workers (the 'start' event's launched_at): the
                      fault noticed (a failed collective, or the hang timeout), the old workers
                      stopped, the rendezvous formed again; for a cold start, torchrun's own start
      restart_s       the workers' launch to their first metrics line: imports, process group, model
      load_s          the 'load' event's: reading the checkpoint resumed from
      first_step_s    the 'start' event to the end of the first step
      replayed_steps  steps trained again: the last step completed before `since` (after the
                      previous 'start'), less the step resumed from
      replay_s        the 'start' event until that step is completed again (0 if none)
      back_s          `since` to the end of the first step beyond the last one completed before it:
                      all that `since` cost (detection, restart, load, replay), plus one step
    """
    rank0 = sorted((e for e in events if e["rank"] == 0), key=lambda e: e["time"])
    steps = [e for e in rank0 if e["event"] == "step"]
    begun = ("start", "recovered")
    start = next((e for e in rank0 if e["event"] in begun and e["time"] > since), None)
    first = next((e for e in steps if start and e["time"] > start["time"]), None)
    if first is None:
        return {}
    workers_at = start.get("launched_at") if start.get("launched_at", 0) > since else None
    first_line = next((e["time"] for e in rank0 if workers_at and e["time"] >= workers_at), None)
    load = [e["load_s"] for e in rank0 if e["event"] == "load" and since < e["time"] <= start["time"]]
    previous = max((e["time"] for e in rank0 if e["event"] in begun and e["time"] <= since), default=None)
    resumed = start.get("resumed_from_step", start.get("step")) or 0
    trained = [e["step"] for e in steps if previous is not None and previous <= e["time"] <= since]
    replayed = max(0, max(trained, default=resumed) - resumed)
    again = next((e for e in steps if e["time"] > start["time"] and e["step"] >= resumed + replayed), first)
    beyond = next((e for e in steps if e["time"] > start["time"] and e["step"] > resumed + replayed), None)
    return {
        "total_s": first["time"] - since,
        "detect_s": workers_at - since if workers_at else None,
        "restart_s": first_line - workers_at if workers_at and first_line else None,
        "load_s": load[-1] if load else None,
        "first_step_s": first["time"] - start["time"],
        "replayed_steps": replayed,
        "replay_s": again["time"] - start["time"] if replayed else 0.0,
        "back_s": beyond["time"] - since if beyond else None,
    }


def step_slowdown_while_saving(steps):
    """Rank 0's median step time over the steps that ran while an async save was in flight (their
    `saving` flag), divided by the median over the other steps; None where no step overlapped a save."""
    rank0 = [e for e in steps if e["rank"] == 0]
    during = median_or_none(e["step_s"] for e in rank0 if e.get("saving"))
    others = median_or_none(e["step_s"] for e in rank0 if not e.get("saving"))
    return during / others if during and others else None


def startup_peaks(events):
    """(rank 0, the largest of the other ranks): the peak memory of building the model above what the
    process held before (the 'built' event); None where the script writes no such event."""
    built = {e["rank"]: e["peak_bytes"] - e["baseline_bytes"] for e in events if e["event"] == "built"}
    return built.get(0), max((v for r, v in built.items() if r != 0), default=None)


def training_peaks(events):
    """(rank 0, the largest of the other ranks): the peak memory up to the last step (the step events'
    CUDA or RSS peak: the build's included) above what the process held before building the model (the
    'built' event's baseline); None where the script writes no such event. On FSDP the ranks other
    than 0 hold shards only: rank 0 also built the full model on the CPU for the scatter. On CPU the
    step events' peak is ru_maxrss, which Linux carries over an exec: it also counts the forked torchrun
    agent's RSS, below a worker's baseline once torch and the model are loaded."""
    baseline = {e["rank"]: e["baseline_bytes"] for e in events if e["event"] == "built"}
    peak = {}
    for e in events:
        if e["event"] == "step" and e["rank"] in baseline:
            peak[e["rank"]] = max(peak.get(e["rank"], 0), e.get("cuda_peak_bytes") or e.get("rss_peak_bytes") or 0)
    above = {rank: value - baseline[rank] for rank, value in peak.items()}
    return above.get(0), max((v for r, v in above.items() if r != 0), default=None)


def final_history(events):
    """{step: [[trainer, trainer step, version], ...] it applied} of a parameter server's last run, from rank
    0's metrics of every launch: each start cuts the history back to the step it resumed from."""
    history = {}
    for e in events:
        if e["rank"] == 0 and e["event"] == "start":
            history = {step: applied for step, applied in history.items() if step <= (e["resumed_from_step"] or 0)}
        elif e["rank"] == 0 and e["event"] == "step":
            history[e["step"]] = e["applied"]
    return history
