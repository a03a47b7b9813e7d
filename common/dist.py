"""Distributed setup in a few visible lines, ranks that agree, collective timeouts, a lost peer in one line."""
import contextlib
import datetime
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import fail


def device_problems(choice):
    """[a line] if --device cuda cannot give each of this node's ranks a GPU (pick_device would raise)."""
    local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
    if choice == "cuda" and gpus < local:
        return [f"--device cuda needs a GPU for each of this node's {local} ranks, found {gpus} "
                "(--device auto uses the CPU then)"]
    return []


def pick_device(choice, local_rank, local_world_size):
    """auto: one GPU per local rank when there are enough, else CPU. cuda without enough GPUs is an error."""
    gpus = torch.cuda.device_count()
    if choice == "cuda" and gpus < local_world_size:
        raise ValueError(f"--device cuda needs {local_world_size} GPUs on this node, found {gpus}")
    if choice == "cpu" or (choice == "auto" and gpus < local_world_size):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup(device_choice="auto", timeout_s=300):
    """(rank, world_size, device) under torchrun, or alone for `python script.py`; gloo on CPU, NCCL on CUDA."""
    refuse_unsafe_restarts()
    if "RANK" not in os.environ:  # launched without torchrun: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="localhost", MASTER_PORT=str(_free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device = pick_device(device_choice, local_rank, local_world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # One node's job: rank 0's store on the loopback only. torch's TCPStore listens on every interface,
    # whatever MASTER_ADDR says (pytorch issue 173909); rank 0 binds its socket here and hands it over.
    alone = local_world_size == world_size and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = loopback_store(rank, world_size, timeout) if alone else None
    if local_world_size == world_size:
        keep_on_loopback()
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                            **({"store": store, "rank": rank, "world_size": world_size} if store else {}))
    if device_choice == "auto" and device.type == "cpu" and rank == 0:
        print(f"device: cpu with gloo ({torch.cuda.device_count()} GPUs for {local_world_size} local ranks)", flush=True)
    return rank, world_size, device


def loopback_store(rank, world_size, timeout):
    """The process group's store at 127.0.0.1:MASTER_PORT, served by rank 0 from a socket bound there."""
    port, fd = int(os.environ["MASTER_PORT"]), None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(world_size)
        fd = listener.detach()
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout, master_listen_fd=fd)


def keep_on_loopback():
    """On one node, gloo's and TensorPipe's sockets on the loopback too, not on the host name's address."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
    for name in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        os.environ.setdefault(name, loopback)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def refuse_unsafe_restarts():
    """Refuse torchrun restarts over its shared rendezvous store, where a new group can read the last attempt's
    addresses and hang (pytorch issues 135712, 167288); the variable against it is read by torchrun, not a worker."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        fail("torchrun restarts are not reliable while it shares its rendezvous store with the workers: "
             "launch it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (as run.sh does)")


# ----------------------------------------------------------------------------- collectives
def gather_json(value, group=None):
    """Every rank's `value` of `group` (default: the world), in rank order, as JSON, never a pickle: a process
    that got into the group can send a wrong value but never run code here. Tuples come back as lists."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], device=device), group=group)
    longest = max(int(size) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(data)] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(o[:int(n)].cpu().numpy().tobytes()) for o, n in zip(out, sizes)]


def agree(ok, device, group=None):
    """True only if `ok` holds on every rank of `group`, so that all take the same branch after a failure."""
    flag = torch.tensor(int(ok), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


PREEMPTED = 143  # the exit code of a job stopped by SIGTERM (128 + 15): it saved, and expects a restart


class StepGuard:
    """One all-reduce at each step's end carries the loss and whether any rank got SIGTERM or SIGUSR1 (or was
    told the job ends: end_after_step), so all stop after the same step. Collectives wait `timeout_s` while
    starting, loading and saving; after 5 steps, `hang_timeout_s` or 20 steps' time, so that a frozen rank
    fails the job in seconds."""

    def __init__(self, device, timeout_s, hang_timeout_s):
        self.device, self.timeout_s, self.hang_timeout_s = device, timeout_s, hang_timeout_s
        self.step_timeout_s, self.signalled_at, self.ending, self.ended = timeout_s, None, False, False
        signal.signal(signal.SIGTERM, self._note)
        signal.signal(signal.SIGUSR1, self._note)  # Slurm's --signal=USR1@SECONDS, passed on by torchrun

    def _note(self, *_):
        self.signalled_at = self.signalled_at or time.time()

    def end_after_step(self):
        """Every rank saves after the next step and ends, as on a preemption, though no rank was signalled
        (--survivors: its supervisor ends the job)."""
        self.ending = True

    def agree(self, loss):
        """(the loss averaged over the ranks, whether to save now and stop); then `ended` says whether it
        is the job's end rather than a signal."""
        flag = lambda on: torch.tensor(float(on), device=self.device)  # noqa: E731
        stats = torch.stack([loss.detach().float(), flag(self.signalled_at is not None), flag(self.ending)])
        dist.all_reduce(stats)
        self.ended = stats[2].item() > 0
        return stats[0].item() / dist.get_world_size(), stats[1].item() > 0 or self.ended

    def shorten_timeout(self, step_times):
        """After this attempt's 5th step (the first ones are slow): the short timeout from now on."""
        if len(step_times) == 5:
            self.step_timeout_s = min(self.timeout_s, max(self.hang_timeout_s, 20 * statistics.median(step_times)))
            set_collective_timeout(self.step_timeout_s)
            print0(f"collective timeout {self.step_timeout_s:.0f} s from now on ({self.timeout_s} s while saving)")

    @contextlib.contextmanager
    def patient(self):
        """The long timeout, for a save: the other ranks may wait while rank 0 writes or prunes."""
        set_collective_timeout(self.timeout_s)
        try:
            yield
        finally:
            set_collective_timeout(self.step_timeout_s)


def set_collective_timeout(seconds, group=None):
    """The timeout of the later collectives of `group` (default: the world), on gloo and NCCL alike."""
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # the name before torch 2.12
    setter(datetime.timedelta(seconds=seconds), group)


def exit_without_finalizing(code=0):
    """End with `code` without finalization, where gloo's threads may SIGABRT (pytorch PR 179291): torchrun or
    the supervisor would see a crash (signal 6). A message for a code is printed and exits 1, as Python does."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


@contextlib.contextmanager
def ending_without_finalizing():
    """A script's end, at its last line or by SystemExit (a preemption's 143, a lost peer's 1, a stop's line),
    through exit_without_finalizing. Any other exception keeps its traceback."""
    try:
        yield
        code = 0
    except SystemExit as stop:
        code = stop.code
    exit_without_finalizing(code)


# What gloo's and NCCL's errors say when a peer died or hung, which torchrun answers by a restart.
PEER_HUNG = ("Timed out", "timed out", "timeout caused pair closure")
GIVEN_UP = "a peer was lost and the group given up"  # a save refused its commit (abandoned)
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             GIVEN_UP, *PEER_HUNG)


def torchrun_restarts(reason):
    """torchrun restarts the workers; after a hung peer, this node's others are fenced first (fence_local_workers)."""
    return "torchrun will restart the workers", fence_local_workers() if reason in PEER_HUNG else []


after_peer_loss = torchrun_restarts  # a launcher that replaces a lost process alone sets its own


def abandoned():
    """Whether this process's group was given up after a peer's loss, its save never to commit (always
    False here: a launcher whose survivors re-form the group sets its own)."""
    return False


@contextlib.contextmanager
def peer_loss_in_one_line(run_dir):
    """A collective that fails because a peer died or hung: one line and exit 1 for a restart, not 40 lines that
    read like a disaster; the traceback goes to <run-dir>/traceback-rank<r>.txt. Other errors are raised."""
    try:
        yield
    except RuntimeError as e:  # gloo's errors are RuntimeErrors; NCCL's DistBackendError is one too
        reason = next((phrase for phrase in PEER_LOST if phrase in str(e)), None)
        if reason is None:
            raise
        rank, path = os.environ.get("RANK", "0"), Path(run_dir) / f"traceback-rank{os.environ.get('RANK', '0')}.txt"
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}, restart {restarts()}\n{traceback.format_exc()}")
        then, fenced = after_peer_loss(reason)
        print(f"rank {rank}: peer lost ({reason}); {then} (traceback: {path})"
              + (f"; SIGKILLed this node's other workers first: pids {fenced}" if fenced else ""),
              file=sys.stderr, flush=True)
        raise SystemExit(1)


def fence_local_workers():
    """After a timeout (a peer hangs), SIGKILL this node's other workers of the torchrun run; return their pids.
    torchrun would SIGKILL them 30 s after its SIGTERM, which a stopped process ignores; checkpoints survive it."""
    me, agent, run_id = os.getpid(), os.getppid(), os.environ.get("TORCHELASTIC_RUN_ID")
    killed = []
    if run_id is None:  # not under torchrun: no agent, no siblings
        return killed
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if pid == me or parent != agent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"TORCHELASTIC_RUN_ID={run_id}".encode() not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return killed


def teardown(timeout_s=10):
    """destroy_process_group, given at most `timeout_s`: it can hang (pytorch issue 75097)."""
    if not dist.is_initialized():
        return
    destroy = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    destroy.start()
    destroy.join(timeout_s)
    if destroy.is_alive():
        print(f"rank {os.environ.get('RANK', 0)}: destroy_process_group did not return in {timeout_s} s: "
              "leaving without it", file=sys.stderr, flush=True)


def print0(*args):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def restarts():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
