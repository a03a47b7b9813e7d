"""A parameter server on torch.distributed.rpc that survives failures: a checkpointed server,
stateless trainers, and lost trainers dropped after a timeout. The server's state, its updates (sync
and async) and its checkpoint are in rpc/server.py: copy it with this script.

    bash run.sh rpc 4                                  # torchrun, 4 processes: rank 0 the server, 1-3 trainers
    FT_FAULTS=crash-at-step=25 bash run.sh rpc 4 --steps 40 --save-every 10   # see a crash recovered
    FT_FAULTS=drop-trainer-at-step=10 bash run.sh rpc 4 --straggler-timeout 5  # see a lost trainer dropped
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 rpc/ps.py         # the variable makes restarts reliable (README)

Rank 0 holds the model and the optimizer. Each trainer pulls the weights, computes gradients on
its part of the step's batch and pushes them with rpc_async. In sync mode (the default), once
every live trainer has pushed, the server averages the gradients in trainer order (so arrival
order cannot change the result), steps, checkpoints, and answers every waiting trainer with the
new weights. Trainers hold nothing that the server's checkpoint does not determine: after a crash
torchrun restarts every process, the server resumes from its checkpoint and the trainers carry on
from its version. A trainer that stops pushing (frozen, or gone without a crash torchrun sees) is
dropped after --straggler-timeout seconds and the others carry on without its rows of the batch.
No wait of the server's is unbounded: the job ends without a barrier over every process, so a
lost trainer never holds the server; and a trainer of its node still running at the end (frozen,
hung) is killed, since torchrun waits for every worker. A loss that is not finite stops the job
before it saves.

    bash run.sh rpc 4 --mode async --slow-trainer 3 --slow-factor 3   # a 3x slower trainer slows no one

--mode async: no trainer waits for another. An update averages the first --updates-per-step
gradients that arrive, from any trainers; a gradient computed more than --max-staleness updates
before the one that would apply it is dropped, and counted (rpc/server.py says how). A trainer's
n-th step trains on its rows of global batch n (sync: of the server's step n); the server counts
each trainer's steps taken and saves the counts. A trainer that froze or left is simply not heard
from: async mode drops no one. Arrival order decides the weights, so two async runs are not bitwise
equal; what holds instead, whatever process crashes: the server resumes at its last checkpoint with
the weights and optimizer state it saved (its save and load events carry their digest), no gradient
is applied twice (each update lists the (trainer, trainer step) it applied; the trainers go on from
the saved counts), and no applied gradient is staler than the bound.
"""
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` from anywhere in the repo
LAUNCHED_AT = time.time()  # this process's start, before torch is imported: where a restart's time splits
from common.stop import end_if_stopped  # noqa: E402  (common.stop imports no torch)
end_if_stopped()  # a torchrun restart after a stop of this launch ends here, before importing torch

import torch
from torch.distributed import rpc as torch_rpc  # `torch_rpc`, not `rpc`: here `rpc` is this folder (rpc/server.py)

from common.checkpoint import atomic_write_json, newest_resume_problem, param_digest, seed_rng
from common.config import (AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, SECONDS, SHARED_RANGES, flag_problems, needs,
                           parse_config)
from common.data import StepData
from common.dist import (device_problems, ending_without_finalizing, keep_on_loopback, loopback_store, pick_device,
                         print0, refuse_unsafe_restarts, restarts)
from common.model import PRESETS, SHAPE_FIELDS, Transformer, model_config, model_problems, num_params
from common.monitor import Monitor, memory, mfu, peak_flops_problems, state_bytes
from common.rundir import hold_run_dir, ownership_problems, run_dir_problems
from rpc.server import (FORMAT, SAMPLE_FIELDS, ParameterServer, Reply, kill_stuck_trainers, read_checkpoint, resume,
                        save_checkpoint, set_server)


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """Parameter-server training on torch.distributed.rpc with a checkpointed server and auto-resume."""
    steps: int = 200  # total server updates of the job (a resumed job runs up to this)
    run_dir: str = "runs/rpc"  # holds ckpt/, metrics-rank<r>.jsonl and summary.json
    save_every: int = 50  # the server saves a checkpoint every N updates, and at the last one
    keep: int = 3  # committed checkpoints kept; older ones are deleted after each save
    seed: int = 0  # seeds the weights, the data and each trainer's per-step RNG
    device: str = "auto"  # where trainers compute: auto (a GPU per local rank if enough, else CPU), cpu or cuda
    preset: str = ""  # a named model shape (PRESETS in common/model.py: tiny ... 1b); replaces vocab, seq_len, dim, layers, heads
    vocab: int = 64  # vocabulary size: above every token id of --data (256 or more for a text file)
    seq_len: int = 32  # tokens per sequence
    dim: int = 64  # model width
    layers: int = 2  # Transformer blocks
    heads: int = 4  # attention heads; must divide dim
    dropout: float = 0.0  # dropout; trainers reseed per step from (seed, step, rank), so resume stays exact
    tie_head: bool = False  # share the output head with the token embedding
    batch_size: int = 24  # global batch: sequences per update, split evenly across the trainers
    data: str = ""  # a token file (llm.c's or nanoGPT's *.bin) or a text file (bytes); default: the synthetic task
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup: int = 20  # steps of linear warmup
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    log_every: int = 10  # print a log line every N steps
    timeout_s: int = 300  # RPC timeout: a hung server fails the trainers' calls; no gradient at all fails the server
    straggler_timeout: float = 30.0  # seconds the server waits for a missing trainer before it goes on without it
    allow_changes: bool = False  # resume even if --seed, --batch-size or --data differ from the checkpoint's
    mode: str = "sync"  # sync: each update waits for every live trainer (bitwise resumable); async: for no one
    updates_per_step: int = 0  # async: gradients an update averages, from any trainers (0: one per trainer)
    max_staleness: int = 4  # async: drop a gradient computed more than N updates before the one applying it
    slow_trainer: Optional[int] = None  # a straggler: this trainer rank computes --slow-factor times slower
    slow_factor: float = 1.0  # the straggler sleeps (F - 1) x its compute time after each step: a slower machine
    archive: str = ""  # s3://bucket/prefix: each committed checkpoint is copied there in the background; a run folder without one resumes from it


# The valid values of the numeric flags above (common/config.py's rules; the model's are in common/model.py).
RANGES = {**SHARED_RANGES, "straggler_timeout": SECONDS, "updates_per_step": NON_NEGATIVE,
          "max_staleness": NON_NEGATIVE, "slow_trainer": POSITIVE, "slow_factor": AT_LEAST_ONE}


def check(cfg):
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        return [f"needs at least 2 processes (rank 0 is the server, the others are trainers), got {world}"]
    problems = (model_problems(cfg) + flag_problems(cfg, world - 1, RANGES) + device_problems(cfg.device)  # trainers split the batch
                + peak_flops_problems() + run_dir_problems(cfg.run_dir) + ownership_problems(cfg.run_dir))
    if os.environ.get("FT_FAULTS"):  # the tests' faults (tiers/faults.py)
        from tiers.faults import fault_problems
        problems += fault_problems("rpc")
    if cfg.data:  # a token file (tiers/tokens.py)
        with needs("--data"):
            from tiers.tokens import data_problems
        problems += data_problems(cfg)
    if cfg.save_every == 0:
        problems.append("--save-every 0 (an interval by Young and Daly's rule) is ddp's and fsdp's: give the server N")
    if cfg.mode not in ("sync", "async"):
        problems.append(f"--mode {cfg.mode}: choose from sync, async")
    elif cfg.mode == "sync" and (cfg.updates_per_step, cfg.max_staleness) != (0, Config.max_staleness):
        problems.append("--updates-per-step and --max-staleness are for --mode async (sync takes one gradient "
                        "from every live trainer, computed on the current step)")
    if cfg.slow_trainer is not None and not 0 < cfg.slow_trainer < world:
        problems.append(f"--slow-trainer must be a trainer's rank, 1..{world - 1}, got {cfg.slow_trainer}")
    if not 0 < cfg.straggler_timeout < cfg.timeout_s:
        problems.append(f"--straggler-timeout must be > 0 and below --timeout-s {cfg.timeout_s} (a trainer may "
                        f"wait that long for its reply), got {cfg.straggler_timeout}")
    unfit = newest_resume_problem(Path(cfg.run_dir) / "ckpt", cfg, lambda p: read_checkpoint(p, mmap=True), FORMAT,
                                  SHAPE_FIELDS, SAMPLE_FIELDS)  # the newest readable checkpoint must fit
    problems += [unfit] if unfit else []
    if cfg.archive:  # the object store answers; with no checkpoint here, its newest must fit (tiers/archive.py)
        with needs("--archive"):
            from tiers.archive import tier_problems
        problems += tier_problems(cfg, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    return problems


# ----------------------------------------------------------------------------- checkpoint (server)
# When the server saves; what its checkpoint holds, and the resume, are rpc/server.py's.
def after_update(ckpt_dir, world, faults, archive, server, step):
    """The ParameterServer's after_update(server, step) (serve() binds the first four with
    functools.partial). It runs under the server's lock, between the optimizer step and the replies: no
    update is half-done."""
    if faults:
        faults.after_step(step)
    if step % server.cfg.save_every == 0 or step == server.cfg.steps:
        save_checkpoint(server, ckpt_dir, world, step, archive, faults.in_save(step) if faults else None)


# ----------------------------------------------------------------------------- server (rank 0)
def serve(cfg, model, monitor, faults, world, options, run_dir, tokens_per_step):
    """Rank 0: resume, answer the trainers' pulls and pushes until the last update, write summary.json.
    Returns the trainers not heard from at the end (lost, or silent since the last update)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt_dir = run_dir / "ckpt"
    archive = None
    if cfg.archive:  # each commit copied to S3; a run folder without one gets the archive's newest first
        from tiers.archive import ArchiveTier
        archive = ArchiveTier(cfg, 0, monitor)
        archive.before_load(None)
    # Resumed before init_rpc: the trainers' init_rpc returns only once the server is ready to answer.
    resumed = resume(ckpt_dir, model, optimizer, cfg, world, monitor)
    monitor.event("start", launched_at=LAUNCHED_AT, resumed_from_step=resumed.resumed_from, restarts=restarts(),
                  world_size=world)
    server = ParameterServer(model, optimizer, cfg, monitor, world - 1, resumed.step, resumed.lost,
                             functools.partial(after_update, ckpt_dir, world, faults, archive),
                             trainer_steps=resumed.trainer_steps)
    set_server(server)  # the object the trainers' RPCs reach: set before init_rpc lets any arrive
    torch_rpc.init_rpc("server", rank=0, world_size=world, rpc_backend_options=options)
    try:
        server.wait_until_done()
    except BaseException:
        torch_rpc.shutdown(graceful=False)  # fail fast; torchrun restarts the group
        raise
    step_times = server.step_times
    if archive:  # waits for its last upload
        archive.finish()
    summary = {
        "strategy": "rpc", "world_size": world, "steps": server.version, "final_loss": server.loss,
        "param_digest": param_digest(model.state_dict()), "resumed_from_step": resumed.resumed_from,
        "restarts": restarts(), "params": num_params(model), "state_bytes_per_rank": state_bytes(model, optimizer),
        "median_step_s": statistics.median(step_times) if step_times else None,
        "tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
        "trainers_lost": len(server.lost), "lost_trainers": sorted(server.lost),
        "skipped_rows": server.skipped_rows(), "mode": cfg.mode, "max_staleness": cfg.max_staleness,
        "stale_dropped": server.stale_dropped,  # in this attempt, as the mean staleness of what it applied
        "mean_staleness": statistics.mean(server.staleness) if server.staleness else None,
        "archived": archive.archived if archive else None}
    if not step_times and (run_dir / "summary.json").exists():  # a finished run launched again
        print0(f"the run was finished at step {server.version}: nothing to train (a larger --steps trains on), "
               "its summary.json is kept")
    else:
        atomic_write_json(summary, run_dir / "summary.json")
        print0(f"done: step {server.version}, final loss {summary['final_loss']}, "
               f"param_digest {summary['param_digest']}, trainers lost {summary['lost_trainers']}")
    # Stay up until every live trainer has the last weights (a local shutdown could cut a reply
    # short), but never for a trainer that froze or died since.
    unconfirmed = server.wait_for_leaves()
    if unconfirmed:
        print(f"trainers {unconfirmed} did not confirm the last step within {cfg.straggler_timeout} s: "
              "not waiting for them", flush=True)
    return sorted(set(server.lost) | set(unconfirmed))


# ----------------------------------------------------------------------------- trainer (ranks 1..)
GONE = "the server is gone"  # a trainer's reason to stop when the server no longer answers


def call_server(function, *args, timeout_s):
    """function(*args) on the server: its answer, or None if the server is gone.

    Gone (its process ended or its agent shut down: the call fails at once) means stop: either the
    job is over, or the server crashed and its own exit makes torchrun restart the group. A server
    still there but silent for the whole RPC timeout is hung: the trainer fails, so that torchrun
    stops the group, the hung server with it, and restarts it."""
    t0 = time.monotonic()
    try:
        answer = torch_rpc.rpc_async("server", function, args=args).wait()
    except RuntimeError:
        if time.monotonic() - t0 >= timeout_s:
            raise
        return None
    if isinstance(answer, Exception):  # an exception set on an async_execution future arrives as a value
        raise answer
    return answer


def train(cfg, model, data, monitor, faults, rank, world, device, options, tokens_per_step):
    """A trainer: pull the weights, push the gradients of its rows of the step's batch, until the last
    step or until the server says stop (or is gone); then tell the server it has the last weights."""
    trainers = world - 1
    flops_per_step = 6 * num_params(model) * tokens_per_step / trainers  # model FLOPs of one trainer, for MFU
    torch_rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    monitor.event("start", launched_at=LAUNCHED_AT, restarts=restarts(), world_size=world)
    reply = call_server(ParameterServer.pull_remote, rank, timeout_s=cfg.timeout_s) or Reply(0, None, GONE)
    trainer_step = reply.trainer_step  # this trainer's steps so far, as the server's checkpoint counts them

    while reply.stop is None and reply.step < cfg.steps:
        step = reply.step  # the server's version that these weights are
        batch = trainer_step if cfg.mode == "async" else step  # the global batch whose rows this step trains on
        t0 = time.perf_counter()
        model.load_state_dict(reply.weights)
        seed_rng(cfg.seed * 1_000_003 + batch, rank)  # dropout randomness follows from the batch, not from history
        inputs, targets = (t.to(device) for t in data.batch(batch, rank - 1, trainers))
        model.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss = faults.poison_loss(loss, batch) if faults else loss
        loss.backward()
        grads = [p.grad.cpu() for p in model.parameters()]
        if rank == cfg.slow_trainer:  # a slower machine: the same step takes --slow-factor times as long
            time.sleep((cfg.slow_factor - 1) * (time.perf_counter() - t0))
        t1 = time.perf_counter()
        reply = (call_server(ParameterServer.push_remote, rank, step, grads, loss.item(), batch,
                             timeout_s=cfg.timeout_s) or Reply(step, None, GONE))
        t2 = time.perf_counter()
        if reply.stop is not None:
            break
        trainer_step = batch + 1
        monitor.event("step", step=reply.step, trainer_step=trainer_step, loss=loss.item(), step_s=t2 - t0,
                      compute_s=t1 - t0, wait_s=t2 - t1, tokens_per_s=tokens_per_step / trainers / (t2 - t0),
                      **memory(device), mfu=mfu(flops_per_step, t2 - t0, device))
        if faults:  # this push took the server from step (async may skip)
            faults.after_step(reply.step, previous=step)
        if faults and faults.leaves(reply.step, previous=step):
            print(f"trainer {rank}: leaving silently at step {reply.step} (FT_FAULTS drop-trainer-at-step)", flush=True)
            break
    if reply.stop is not None:
        print(f"trainer {rank}: stopping at step {reply.step}: {reply.stop}", flush=True)
    elif reply.step >= cfg.steps:  # a server gone before its answer left has heard it: nothing is lost
        call_server(ParameterServer.leave_remote, rank, timeout_s=cfg.timeout_s)


# ----------------------------------------------------------------------------- main
def loopback_rendezvous(url, **_):
    """A rendezvous handler ("loopback://", rank and world size in the query) for init_rpc, which takes an
    init method, not a store, on one node: common.dist.loopback_store, its timeout then set by the caller."""
    query = dict(pair.split("=") for pair in url.partition("?")[2].split("&"))
    rank, world = int(query["rank"]), int(query["world_size"])
    yield loopback_store(rank, world, datetime.timedelta(seconds=300)), rank, world


def main(cfg):
    # ------------------------------------------------------------------------- setup
    # No process group: init_rpc is the rendezvous (MASTER_ADDR/PORT from torchrun, fresh each
    # restart); RPC is the only communication.
    refuse_unsafe_restarts()
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")  # torch's own init_rpc
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu") if rank == 0 else pick_device(cfg.device, int(os.environ["LOCAL_RANK"]),
                                                                int(os.environ["LOCAL_WORLD_SIZE"]))
    one_node = int(os.environ["LOCAL_WORLD_SIZE"]) == world
    if one_node:  # every listener on the loopback: the store (env:// opens one on every interface), gloo, TensorPipe
        keep_on_loopback()
        torch.distributed.register_rendezvous_handler("loopback", loopback_rendezvous)
    options = torch_rpc.TensorPipeRpcBackendOptions(init_method="loopback://" if one_node else "env://",
                                                    rpc_timeout=cfg.timeout_s)
    run_dir = Path(cfg.run_dir)
    hold_run_dir(run_dir, rank)  # the server holds its lock until the process exits
    print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print0(f"rpc: world size {world} (a server, {world - 1} trainers), restart {restarts()}")
    monitor = Monitor(run_dir, rank, device, cfg.log_every)
    faults = None  # the tests' faults, made only when FT_FAULTS asks for one
    if os.environ.get("FT_FAULTS"):
        from tiers.faults import Faults
        faults = Faults(cfg, rank, world, "server" if rank == 0 else f"trainer {rank}")

    # ------------------------------------------------------------------------- data
    source = None  # the synthetic task
    if cfg.data:  # a token file (tiers/tokens.py)
        from tiers.tokens import sources
        source = sources(cfg)[0]
    data = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, source)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    # ------------------------------------------------------------------------- model
    # The server's weights are the model (its optimizer is built in serve()); a trainer's copy is
    # overwritten by every pull.
    model = Transformer(model_config(cfg), seed=cfg.seed).to(device)
    print0(f"model: {num_params(model):,} parameters")

    # ------------------------------------------------------------------------- serve or train
    unheard = []
    if rank == 0:
        unheard = serve(cfg, model, monitor, faults, world, options, run_dir, tokens_per_step)
    else:
        train(cfg, model, data, monitor, faults, rank, world, device, options, tokens_per_step)

    # ------------------------------------------------------------------------- teardown
    # Each process shuts down its own agent. A graceful torch_rpc.shutdown() is a barrier over every
    # process with no timeout, so a trainer that froze or died would hold the job for ever; instead
    # the trainers stop once they have the last weights (or are dropped), and the server once they
    # said so (serve()). No process has an RPC of its own in flight by then.
    t0 = time.perf_counter()
    torch_rpc.shutdown(graceful=False)
    monitor.event("shutdown", shutdown_s=time.perf_counter() - t0)
    monitor.close()
    if unheard:  # the server: a trainer that froze would keep torchrun waiting for ever
        kill_stuck_trainers(unheard, cfg.straggler_timeout)


if __name__ == "__main__":
    cfg = parse_config(Config, check, presets=PRESETS)
    with ending_without_finalizing():  # no finalization, where gloo may abort the process: see common.dist
        main(cfg)
