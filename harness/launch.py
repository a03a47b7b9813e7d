"""The one torchrun command line of run.sh, the runners (compare, chaos) and the tests; the preflight
that checks a job's flags before torchrun starts; and the check every finished job gets.

    python -m harness.launch --preflight SCRIPT NPROC [flags]   # what `bash run.sh ddp|fsdp|rpc NPROC` runs
    python -m harness.launch SCRIPT NPROC [flags]               # no preflight (tests/gpu_check.sh)

The command line reads NNODES (N, or MIN:MAX for an elastic job), NODE_RANK, RDZV_ENDPOINT (host:port
of the first node; default localhost:0), RDZV_ID (default: the script's folder), RDZV_CONF and
MAX_RESTARTS (default 3); and, for --survivors on several nodes, ETCD_ENDPOINTS (tiers/etcd.py: the
job's control plane in etcd, RDZV_ENDPOINT unused). Without --preflight nothing here imports torch.

torchrun shares its rendezvous store with the workers by default; after a restart the new process
group can then read the failed attempt's addresses and fail to connect or hang (pytorch issues
135712, 167288). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, read by the agent, gives the workers a store
of their own, so every launch here sets it.

A deliberate stop (a refused setting, a full disk, a diverged loss) ends a worker under torchrun with
status 0, the one torchrun does not retry, its real code left in $FT_STOP_FILE (common.stop.stop):
every launch here names a private file for it, and main() and harness.procs.finish() report that code.
"""
import atexit
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run.sh runs this file as a script

from common.stop import STOP_FILE  # noqa: E402  (common.stop imports no torch)
from harness.procs import REPO, dies_with_parent, exit_code, free_port  # noqa: E402

# The jobs that the chaos soak faults and the comparison measures, by name: (script, extra flags).
# The comparison names its columns by the command instead (column()): "ddp --async-save".
STRATEGIES = {
    "ddp": ("ddp/train.py", []),
    "ddp-async": ("ddp/train.py", ["--async-save"]),
    "fsdp": ("fsdp/train.py", []),
    "fsdp-async": ("fsdp/train.py", ["--async-save"]),
    "rpc": ("rpc/ps.py", []),
    "rpc-async": ("rpc/ps.py", ["--mode", "async"]),  # chaos checks it by its guarantees, not a digest
    "ddp-survivors": ("ddp/train.py", ["--survivors", "--spares", "1"]),  # launched by survivors_job, not torchrun
    "fsdp-survivors": ("fsdp/train.py", ["--survivors"]),  # a cold replacement
}


def column(strategy):
    """The comparison's name for a strategy: its script's folder and flags ("ddp --async-save")."""
    script, flags = STRATEGIES[strategy]
    return " ".join([Path(script).parent.name, *flags])


# An elastic job (--nnodes MIN:MAX) re-forms without a lost node. c10d's defaults make that slow: a
# node is dropped from the rendezvous only after keep_alive_max_attempt missed heartbeats, one every
# keep_alive_interval s (default 3 x 5 s), and a round that has MIN nodes waits last_call_timeout s
# (default 30) for more before it completes. The same wait is what lets all the nodes of a first
# launch meet in one round: it must outlast the spread of the agents' start times.
ELASTIC_RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5"

# The signals torchrun's agent passes on to the workers, which save the step in progress and exit
# (common.dist.StepGuard): its defaults, and SIGUSR1, which Slurm's --signal=USR1@SECONDS sends.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
PREEMPTED = 143  # common.dist.PREEMPTED, copied: common.dist imports torch, which only --preflight loads here


def nodes(nnodes):
    """NNODES as a string, "1" when unset; "1:1" (elastic, at most one node) is one node: "1", whose
    rendezvous and stores are private to the machine."""
    nnodes = str(nnodes or "1")
    return "1" if nnodes.rpartition(":")[2] == "1" else nnodes


def torchrun(script, nproc, run_dir=None, flags=(), nnodes=1, max_restarts=3, endpoint=None, rdzv_id=None, env=None,
             is_host=None, node_rank=None, rdzv_conf=None, grace_s=None):
    """(command, environment) running `script [--run-dir run_dir] flags` under torchrun. One node's
    rendezvous is a private file, whatever `endpoint` says; the agents of one job on several nodes share
    `endpoint` (host:port; default a free port of this machine) and `rdzv_id`. `nnodes` "MIN:MAX" makes an elastic job (`rdzv_conf`, default
    ELASTIC_RDZV_CONF). Agents on one machine all match the endpoint's host: is_host=True/False says
    which one holds the rendezvous store, which dies with it (a job survives the loss of any node but
    that one). `grace_s`: the seconds torchrun gives the workers between the signal it passes on and its
    SIGKILL (default 30; where this torch's torchrun can change it). The environment names a fresh
    stop file (exit_code() reads it)."""
    nnodes = nodes(nnodes)
    conf = [rdzv_conf or ELASTIC_RDZV_CONF] if ":" in str(nnodes) else []
    conf += [f"is_host={int(is_host)}"] if is_host is not None else []
    if str(nnodes) == "1":
        # One machine, whatever the endpoint: the rendezvous in a private file, not in a TCP store, which
        # torch opens on every interface (pytorch issue 173909); the workers' own store is on the
        # loopback (common.dist.loopback_store). The agent keeps the file across restarts.
        conf.append("store_type=file")
        endpoint = str(stop_folder() / f"rendezvous-{uuid.uuid4().hex}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           *([f"--node-rank={node_rank}"] if node_rank is not None else []), f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--signals-to-handle={SIGNALS}",
           f"--log-dir={stop_folder() / 'torchelastic'}",  # else a torchelastic_* folder in /tmp per launch
           *([f"--shutdown-timeout={grace_s}"] if grace_s and has_shutdown_timeout() else []),
           f"--rdzv-endpoint={endpoint or f'localhost:{free_port()}'}", f"--rdzv-id={rdzv_id or uuid.uuid4().hex[:8]}",
           *([f"--rdzv-conf={','.join(conf)}"] if conf else []),
           str(REPO / script), *(["--run-dir", str(run_dir)] if run_dir is not None else []), *map(str, flags)]
    stop_file = stop_folder() / f"stop-{uuid.uuid4().hex}"
    return cmd, {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", STOP_FILE: str(stop_file), **(env or {})}


@functools.cache
def stop_folder():
    """This process's private folder for its jobs' stop files, removed when it exits."""
    folder = Path(tempfile.mkdtemp(prefix="ft-stop-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def has_shutdown_timeout():
    """Whether this torch's torchrun takes --shutdown-timeout (2.14 does; 2.11 does not: its agent
    SIGKILLs the workers 30 s after it passes a signal on). Read from its source: torch not imported."""
    spec = importlib.util.find_spec("torch.distributed.run")
    return spec is not None and "--shutdown-timeout" in Path(spec.origin).read_text()


def grace_for(run_dir):
    """The seconds a preempted job needs between the signal and a SIGKILL: three times its slowest save
    so far (rank 0's save events: the whole write to the commit), and never under torchrun's 30."""
    path = Path(run_dir) / "metrics-rank0.jsonl"
    slowest = 0.0
    if path.is_file():
        with open(path, errors="replace") as f:
            for line in f:
                if '"event": "save"' in line:
                    try:
                        slowest = max(slowest, float(json.loads(line).get("total_s") or 0))
                    except ValueError:  # a line cut short by a crash
                        continue
    return max(30, int(3 * slowest + 1))


def problems(run_dir, code, output, restarts=0):
    """What is wrong with a finished job that should have exited 0 after exactly `restarts` torchrun
    restarts ([] if nothing). torchrun's restarts hide failures: a job that crashed and resumed still
    ends with the right digest. So the count in summary.json must be the expected one, and a job
    expected to run clean must print no Traceback. A job with restarts may print some: when a worker
    dies, its peers' collectives fail with a Traceback before the agent stops them."""
    if code != 0:
        return [f"exit code {code}"]
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return ["exit 0 without a summary.json"]
    found, wrong = json.loads(path.read_text())["restarts"], []
    if found != restarts:
        wrong.append(f"{found} torchrun restarts, expected {restarts}")
    if restarts == 0 and "Traceback" in output:
        wrong.append("a Traceback in the output of a job that should have run clean")
    return wrong


def load_script(path):
    """Import a script file as a module (its `main` does not run)."""
    spec = importlib.util.spec_from_file_location("script_under_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect finds the Config source through it
    spec.loader.exec_module(module)
    return module


def run_dir_in_use(run_dir, job=None):
    """Why a new job must not start in `run_dir` (a running job holds its lock), or None. Checked once,
    before the workers start (harness/launch.py): a worker would see its own rank 0's lock. `job`: the
    rendezvous id of a node joining a job of several nodes, which passes if it is the holder's."""
    import fcntl
    if not (Path(run_dir) / ".lock").exists():
        return None
    # A shared lock, read only: another node's preflight, testing at the same moment, is no holder (an
    # exclusive test by each node refused one of them, its holder's line not yet written), and the
    # holder's line is never truncated. Only a job's rank 0 holds the lock exclusively (common.rundir).
    with os.fdopen(os.open(Path(run_dir) / ".lock", os.O_RDONLY | os.O_NOFOLLOW)) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder = f.read().strip() or "another process"
    if job is not None and holder.rpartition(", job ")[2] == job:  # a node of the running job: it joins it
        return None
    return (f"--run-dir {run_dir} is in use by another job ({holder} holds its .lock): "
            "wait for it to end, or use another --run-dir")


def preflight(script, worlds, flags, local_world=None, job=None):
    """Check a job's flags once, before torchrun starts workers that would each refuse them: exit 2 with
    one line if the script's check(cfg) finds a problem at one of the world sizes `worlds` (an elastic
    job runs at any of them; `local_world` ranks on this node), or if a running job holds the run
    folder, unless it is the job of several nodes whose rendezvous id is `job` (this node joins it).
    Returns the parsed config."""
    from common.config import fail, parse_config

    outside = {name: os.environ.get(name) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    module = load_script(REPO / script)
    for world in worlds:
        os.environ["WORLD_SIZE"] = str(world)  # the checks that depend on it (global batch) see the planned size
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world or world)  # and the memory tier's room on this node
        cfg = parse_config(module.Config, module.check, flags, prog=script, presets=getattr(module, "PRESETS", None))
    in_use = run_dir_in_use(cfg.run_dir, job)
    if in_use:
        fail(in_use, prog=script)
    for name, value in outside.items():  # torchrun gets the environment as it was
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    return cfg


def survivors_layout(flags):
    """(--survivors, --spares, --hang-timeout-s) of a job's flags, read without importing its script. One it
    cannot read (--spares abc, --survivors=yes) gives the defaults: the script's own check refuses it, in
    its one line (the preflight; each worker without it), where this parser would print its usage."""
    import argparse
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--survivors", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--spares", type=int, default=0)
    parser.add_argument("--hang-timeout-s", type=float, default=15.0)
    try:
        known, _ = parser.parse_known_args(flags)
    except argparse.ArgumentError:
        return False, 0, 15.0
    return known.survivors, known.spares, known.hang_timeout_s


def survivors_job(script, nproc, run_dir, flags=(), spares=0, max_restarts=3, nnodes=1, node=0, endpoint=None):
    """(command, environment) of a job in which survivors keep running (--survivors): this module's
    main, which supervises one process per rank and `spares` more (tiers/survivors.py); node `node`
    of `nnodes`, whose node 0 serves the job's store at `endpoint` (host:port)."""
    cmd = [sys.executable, "-m", "harness.launch", script, str(nproc), "--run-dir", str(run_dir), "--survivors",
           "--spares", str(spares), *map(str, flags)]
    stop_file = stop_folder() / f"stop-{uuid.uuid4().hex}"
    several = {"NNODES": str(nnodes), "NODE_RANK": str(node), "RDZV_ENDPOINT": endpoint} if nnodes > 1 else {}
    return cmd, {**os.environ, "MAX_RESTARTS": str(max_restarts), STOP_FILE: str(stop_file), **several}


def control_plane(nnodes):
    """([(host, port)], key prefix) of the job's control plane in etcd (ETCD_ENDPOINTS, RDZV_ID), said in
    one line; None without ETCD_ENDPOINTS. A bad value, or no RDZV_ID: one line, exit 2."""
    from tiers.etcd import ENDPOINTS, endpoints_of, prefix_of
    if not os.environ.get(ENDPOINTS):
        return None
    try:
        endpoints = endpoints_of(os.environ[ENDPOINTS])
    except ValueError as e:
        print(f"run.sh: {e}", file=sys.stderr)
        sys.exit(2)
    job = os.environ.get("RDZV_ID", "")
    if not job or not all(c.isalnum() or c in "._-" for c in job):
        print(f"run.sh: {ENDPOINTS} needs RDZV_ID, the job's name in etcd, letters, digits, '.', '_' or '-', one for "
              f"each launch (Slurm: $SLURM_JOB_ID.$SLURM_RESTART_COUNT), got '{job}'", file=sys.stderr)
        sys.exit(2)
    few = (f" With {len(endpoints)} member(s) etcd survives no member's loss: run 3 (or 5), on 3 machines at least; a "
           "job of 2 nodes needs a third member elsewhere." if len(endpoints) < 3 else "")
    print(f"run.sh: several nodes: the job's control plane in etcd ({os.environ[ENDPOINTS]}, /ft/{job}/): no node "
          f"is its single point of failure. etcd, each node's store and gloo trust whoever connects: only the job's "
          f"nodes must reach them.{few}", file=sys.stderr)
    return endpoints, prefix_of(job)


def supervise(script, nproc, flags, spares, fence_s, workers_env):
    """Run this node's part of a --survivors job (tiers/survivors.py's Supervisor), whose processes get
    `workers_env`, and exit with its status."""
    from harness.supervisor import Supervisor
    nnodes, node = nodes(os.environ.get("NNODES")), os.environ.get("NODE_RANK")
    endpoint = os.environ.get("RDZV_ENDPOINT") if nnodes != "1" else None
    etcd = control_plane(nnodes) if nnodes != "1" else None
    if nnodes != "1":
        if ":" in nnodes or node is None or not (endpoint or etcd):
            print(f"run.sh: --survivors on several nodes takes a fixed NNODES, each node's NODE_RANK and RDZV_ENDPOINT "
                  f"or ETCD_ENDPOINTS (got NNODES={nnodes}{'' if node is None else f', NODE_RANK={node}'}): its nodes "
                  "keep their ranks, and a spare of any node takes a lost one's", file=sys.stderr)
            sys.exit(2)
        if not etcd:
            print(f"run.sh: several nodes: the job's store ({endpoint}, on node 0) and gloo trust whoever connects: "
                  "only the job's nodes must reach them. Node 0 is the job's single point of failure: its loss ends "
                  "the job (ETCD_ENDPOINTS: the control plane in etcd, docs/nodes.md)", file=sys.stderr)
    env = {**workers_env, STOP_FILE: os.environ.get(STOP_FILE) or str(stop_folder() / f"stop-{uuid.uuid4().hex}")}
    supervisor = Supervisor([sys.executable, str(REPO / script), *map(str, flags)], env, nproc, spares,
                            int(os.environ.get("MAX_RESTARTS") or 3), fence_s, env[STOP_FILE], int(node or 0),
                            int(nnodes), endpoint, etcd)
    private = ("; the job's store in a network namespace of its own" if supervisor.netns is not None else
               f"; the job's store on 127.0.0.1, where any local user can reach it ({supervisor.exposed})"
               if supervisor.exposed else "")
    print(f"run.sh: survivors keep running: {nproc} processes and {spares} spares"
          f"{f' on node {node} of {nnodes}' if nnodes != '1' else ''}, each replaced alone{private}",
          file=sys.stderr, flush=True)
    code = exit_code(supervisor.run(), env)
    sys.exit(PREEMPTED if supervisor.signalled and code not in (0, 2, 3) else code)


def main(argv):
    """[--preflight] SCRIPT NPROC [flags]: run torchrun with the settings of the environment (see the
    docstring above) and exit with its status, or with a deliberate stop's code; run.sh has checked
    NPROC and NNODES. The signals a scheduler sends this process go on to torchrun, which gives the
    workers grace_for(the run folder) seconds to save (SHUTDOWN_TIMEOUT: another)."""
    checked = argv[:1] == ["--preflight"]
    script, nproc, *flags = argv[1:] if checked else argv
    workers_env = dict(os.environ)
    survivors, spares, fence_s = survivors_layout(flags)
    if survivors:  # read once, as torch loads: the supervisor's lost store would print a C++ stack of 20 frames
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    nnodes = nodes(os.environ.get("NNODES"))
    run_dir = None
    endpoint = os.environ.get("RDZV_ENDPOINT") or "localhost:0"
    if checked:  # an elastic job is checked at every world size from MIN to MAX nodes
        fewest, _, most = nnodes.partition(":")
        worlds = [int(nproc) * n for n in range(int(fewest), int(most or fewest) + 1)]
        joining = os.environ.get("RDZV_ID") if nnodes != "1" else None  # a node of a running job passes
        run_dir = preflight(script, worlds, flags, int(nproc), joining).run_dir
        host = endpoint.rpartition(":")[0]
        try:  # torchrun would retry an unknown host for minutes, then print a traceback
            socket.getaddrinfo(host, None)
        except socket.gaierror as e:
            print(f"run.sh: RDZV_ENDPOINT={endpoint}: cannot resolve {host} ({e.strerror})", file=sys.stderr)
            sys.exit(2)
    if survivors:
        supervise(script, int(nproc), flags, spares, fence_s, workers_env)
    if nnodes != "1" and not os.environ.get("RDZV_ENDPOINT"):
        print(f"run.sh: NNODES={nnodes} needs RDZV_ENDPOINT, the host:port of the first node (ETCD_ENDPOINTS serves "
              "--survivors only)", file=sys.stderr)
        sys.exit(2)
    if nnodes != "1":  # torch binds none of these to the endpoint's interface
        print(f"run.sh: several nodes: the rendezvous ({endpoint}), the workers' store and gloo listen on every "
              "interface, and they trust whoever connects: only the job's nodes must reach them", file=sys.stderr)
    grace_s = int(os.environ.get("SHUTDOWN_TIMEOUT") or (grace_for(run_dir) if run_dir else 30))
    cmd, env = torchrun(script, int(nproc), None, flags, nnodes=nnodes, node_rank=os.environ.get("NODE_RANK") or None,
                        max_restarts=int(os.environ.get("MAX_RESTARTS") or 3),
                        endpoint=endpoint,
                        rdzv_id=os.environ.get("RDZV_ID") or Path(script).parent.name,
                        rdzv_conf=os.environ.get("RDZV_CONF"), grace_s=grace_s)
    # torchrun in a session of its own: a terminal's Ctrl-C reaches it once, through here; and SIGTERM,
    # the kernel's, if this process dies first (a SIGKILL): its workers then save and stop, as when preempted.
    proc, signalled = subprocess.Popen(dies_with_parent(cmd, signal.SIGTERM), env=env, start_new_session=True), []

    def pass_on(number, _):
        signalled.append(number)
        proc.send_signal(number)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, pass_on)
    code = exit_code(proc.wait(), env)
    # Preempted: the workers saved their step (or, cut short, left the previous commit) and exited 143;
    # torchrun, signalled too, exits 1. A scheduler's script requeues on 143 (docs/nodes.md: Slurm).
    sys.exit(PREEMPTED if signalled and code not in (0, 2, 3) else code)


if __name__ == "__main__":
    main(sys.argv[1:])
