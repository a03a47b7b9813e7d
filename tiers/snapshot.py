"""The memory tier: every --snapshot-every K steps, each rank copies what a bitwise resume needs into
files on a tmpfs (/dev/shm), which outlive the process that wrote them, though not the machine. A
restarted process resumes from there and replays at most the step it died in, where the disk
checkpoints alone replay every step since their last commit.

One folder per node (--snapshot-dir), two slots per rank, used in turn (slot = step // K % 2):
    <run>-rank<R>-slot<S>-<size>.bin  the state's tensors back to back, model then optimizer: an FSDP
                        rank's own shards; for DDP one copy per node, named after the node's first
                        rank, each of the node's ranks copying a part of it
    <run>-rank<R>-slot<S>.json  rank R's record: step, world size, config, its RNG, the tensors'
                        names, dtypes, shapes and offsets, the CRC32 of the part it copied and of them
A snapshot deletes its slot's record, copies, then writes the record to a temp name and renames it:
a process killed at any point leaves the other slot whole; a step is restored only where every part
of it is recorded and matches its checksum. <run> is the run's id (ckpt/run-id, created with the
run), so another run's snapshots are never read; a record whose config differs is refused as a disk
checkpoint's would be.

The folder is this user's alone: the first snapshot makes it with mode 700, and open_tier (then the
first snapshot) refuses one that another user made or can write; every file in it is opened without
following a link and checked (a regular file of this user's: tiers/shm.py). Another local user can
neither read a snapshot, plant one, nor redirect a write. A slot's bytes are reserved before they are
written: a full tmpfs is then an error that turns the tier off, where a write through a mapping it
cannot back would kill the process (SIGBUS).

The copy runs in a thread of its own while the next step's forward and backward run; the loop waits
for it (`wait`) only before the optimizer step that would change the tensors being copied.

On several nodes (open_tier's `replicate`) each record also goes to the same local rank of the next
node (tiers/replica.py, imported only then), so that a node replaced with an empty memory still
resumes from memory.

Its face: open_tier() once, with the model and the optimizer (the tier waits for its copy before each
optimizer step, as a hook of the optimizer's), handed to the checkpointer, which calls its hooks
(common/checkpointer.py): after_step starts a snapshot, restore is a resume's first rung, preempted (a
stop's step saved on disk) and finish(done) remove the run's snapshots; tiers/survivors.py calls settle
and regroup in a survivor's recovery. Beneath them: start(step); held(), what this rank can restore, answered locally;
restore_step(step, everyone, group), over whatever group the caller gives it; resume(), which settles
the step over the world group and restores it; remove().
"""
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from common.checkpoint import (atomic_write, checkpoints, resume_problem, rng_from_json, rng_state, rng_to_json,
                               set_rng_state)
from common.dist import PEER_LOST, agree, gather_json, print0
from common.model import SHAPE_FIELDS
from tiers.shm import checksum, folder_problem, map_file, private_folder, read_checked

FORMAT = 2  # the layout of a record (written below, read in `load`); 2: its checksum covers its layout
ALIGN = 64  # bytes: every tensor in a .bin starts at a multiple, so that its typed view is aligned
STATE_BYTES_PER_PARAM = 12  # an fp32 weight and AdamW's two fp32 moments


def default_dir(run_dir, run=None):
    """This user's folder for the run in /dev/shm, named after the run's id (`run`, else the one in its
    ckpt/run-id): a file of this user's alone, so that no other user can know the name, and make the
    folder first to block the run. A run with no id yet (its first rank 0 makes it: open_tier) gets a
    name nobody has made. None where there is no /dev/shm: no memory tier."""
    if not os.path.isdir("/dev/shm"):
        return None
    run = run or (run_id(Path(run_dir) / "ckpt", make=False) if (Path(run_dir) / "ckpt").is_dir() else None)
    return Path("/dev/shm") / f"snapshots-{os.getuid()}-{run[:16] if run else uuid.uuid4().hex}"


def folder_of(cfg, run=None):
    """Where this node keeps the run's snapshots: --snapshot-dir, or default_dir (None: the tier is off)."""
    return Path(cfg.snapshot_dir) if cfg.snapshot_dir else default_dir(cfg.run_dir, run)


def tier_problems(cfg, params, sharded):
    """[a line] if the node's snapshot folder cannot take the run's slots (see room_problem), for a model
    of `params` parameters; sharded: each rank holds 1/world of the state (FSDP)."""
    folder = folder_of(cfg)
    if folder is None:
        return []
    world = int(os.environ.get("WORLD_SIZE", 1))
    ckpt_dir = Path(cfg.run_dir) / "ckpt"
    problem = room_problem(folder, needed_bytes(params, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                                sharded), run_id(ckpt_dir, make=False) if ckpt_dir.is_dir() else None)
    return [problem] if problem else []


def node_ranks():
    """The ranks of this node's processes (DDP's group: they share one copy): torchrun numbers a node's
    ranks in a row."""
    first = int(os.environ.get("RANK", 0)) - int(os.environ.get("LOCAL_RANK", 0))
    return range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def open_tier(cfg, ckpt_dir, model, optimizer, group, sample_fields, replicate=None, faults=None):
    """This rank's Snapshots of `model` and `optimizer`, sharing one copy of the state with the ranks
    `group`; None, said in one line, on every rank if one has no /dev/shm (the tier's collectives need
    all of them). Every rank calls it: rank 0 reads or creates the run's id and sends it to the others.
    A snapshot's config is checked as a disk checkpoint's would be (its model's shape, and
    `sample_fields` unless they may change). `replicate` keeps each record ("records": DDP, whose nodes
    hold the same state) or each record and its shards ("shards": FSDP) on the same local rank of the
    next node (tiers/replica.py), when there is one. `faults`: the tests' (tiers/faults.py), or None."""
    ids = gather_json(run_id(ckpt_dir) if dist.get_rank() == 0 else None)[:1]  # rank 0's
    folder = folder_of(cfg, ids[0])
    # Checked again here if it is there (another may have made it since the check); else the first snapshot
    # makes it (Snapshots.make_folder), so that a job that stops before (refused by the archive) leaves nothing.
    problems = gather_json(existing_problem(folder) if folder else "no /dev/shm (pass --snapshot-dir to choose a "
                           "folder)")
    bad = next((r for r, problem in enumerate(problems) if problem), None)
    if bad is not None:
        print0(f"memory tier off: rank {bad}: {problems[bad]}")
        return None
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    replica = None
    if replicate and world > local:  # several nodes: a side group, its timeout that of a hang once it is formed
        from common.dist import set_collective_timeout
        from tiers.replica import Replica
        # Formed with the long timeout: on a lossy link, connecting can outlast a hang's (a false alarm's
        # recovery would end in a crash, and every rank replaced).
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        set_collective_timeout(cfg.hang_timeout_s, side)
        replica = Replica(folder, ids[0], rank, (rank + local) % world, (rank - local) % world, side, replicate, FORMAT)
    snapshots = Snapshots(folder, ids[0], rank, group, cfg.snapshot_every, {"world_size": world,
                          "config": dataclasses.asdict(cfg)}, model, optimizer,
                          lambda record: resume_problem(record, cfg, FORMAT, SHAPE_FIELDS, sample_fields)[0], replica)
    snapshots.faults = faults
    snapshots.reopen = functools.partial(open_tier, cfg, ckpt_dir, model, optimizer, group, sample_fields, replicate,
                                         faults)
    print0(f"memory tier: a snapshot every {cfg.snapshot_every} steps in {snapshots.folder}"
           + (f", each {'record' if replicate == 'records' else 'record and its shards'} also kept by rank "
              f"+ {local} (the next node)" if replica else ""))
    return snapshots


def existing_problem(folder):
    """Why `folder`, if it is there, cannot hold this user's snapshots (folder_problem), or None."""
    try:
        return folder_problem(folder)
    except FileNotFoundError:  # not made yet
        return None


def run_id(ckpt_dir, make=True):
    """The run's id (rank 0 only), made with the run and bound to its checkpoint folder (its path and
    inode): deleting ckpt/ starts a new run, and so does a copy of the run folder (a fork, to try a
    variant), whose snapshots can then never be read or deleted as the original's. The file is this
    user's alone: "<id> <folder>:<inode>". make=False (the preflight): the id if this folder has one of
    its own, else None; nothing written."""
    path, folder = Path(ckpt_dir) / "run-id", Path(ckpt_dir).resolve()
    here = f"{folder}:{folder.stat().st_ino}"
    try:
        run, _, made_in = path.read_text().strip().partition(" ")
    except (FileNotFoundError, NotADirectoryError):
        run, made_in = "", ""
    if not run or made_in not in ("", here):  # none yet, or made in another folder: this one is a copy
        if not make:
            return None
        run = uuid.uuid4().hex
    if made_in != here and make:  # (an id of an older version, made_in "": bound to the folder it is in)
        atomic_write(path, lambda f: f.write(f"{run} {here}".encode()), mode=0o600)
    return run


def local_tensors(state):
    """[(name, tensor)] of a nested state dict in a fixed order; a DTensor gives its local shard, which
    shares its storage."""
    found = []

    def walk(name, obj):
        if torch.is_tensor(obj):
            found.append((name, obj.to_local() if isinstance(obj, DTensor) else obj))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(f"{name}/{key}", value)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(f"{name}/{i}", value)

    walk("", state)
    return found


def layout(tensors):
    """[(name, dtype, shape, offset)] of `tensors` in a .bin, and its size in bytes."""
    entries, offset = [], 0
    for name, t in tensors:
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return entries, offset


def views(buf, entries):
    """The typed tensors of a .bin mapped as `buf` (uint8), one per layout entry."""
    out = []
    for _, dtype, shape, offset in entries:
        dtype = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(buf[offset:offset + n].view(dtype).view(shape))
    return out


def needed_bytes(params, world, local_world, sharded):
    """Bytes a node's snapshot folder holds: two slots of 12 bytes a parameter, for each copy on the
    node (sharded: each local rank holds 1/world of the state, and on several nodes the shards of a
    rank of the node before as well; else one copy per node)."""
    copies = local_world / world * (2 if world > local_world else 1) if sharded else 1
    return int(2 * STATE_BYTES_PER_PARAM * params * copies)


def room_problem(folder, need, run=None):
    """A line if `folder` is not this user's alone (folder_problem), or if its filesystem cannot take
    `need` more bytes, counting as free the bytes that the snapshots of the run `run` already hold (a
    restart writes over its own), not those of other runs. A folder removed while it is checked (the
    run's own, by a rank that finished the job as a new spare started) is checked again, as it is now."""
    folder, instead = Path(folder), "pass another, or --snapshot-every 0 to go without the tier"
    for tries_left in reversed(range(3)):
        try:
            if folder.exists() or folder.is_symlink():
                problem = folder_problem(folder)
                if problem:
                    return problem
            probe = next((p for p in [folder, *folder.parents] if p.exists()), None)
            if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK):
                return f"--snapshot-dir {folder}: not a writable folder; {instead}"
            fs = os.statvfs(probe)
            held = sum(p.lstat().st_blocks * 512 for p in folder.glob(f"{run}-rank*")) if run and folder.is_dir() else 0
            break
        except FileNotFoundError as e:
            if not tries_left:
                return f"--snapshot-dir {folder}: {e.strerror} (removed while checked, 3 times); {instead}"
        except OSError as e:  # a name too long, say
            return f"--snapshot-dir {folder}: {e.strerror}; {instead}"
    free = fs.f_bavail * fs.f_frsize + held
    if free < need:
        return (f"--snapshot-dir {folder}: the memory tier needs {need / 2**20:.0f} MiB on this node, "
                f"{free / 2**20:.0f} MiB free; free some, or pass --snapshot-every 0 to go without it")
    return None


@dataclass
class Held:
    """What one rank can restore, as it answers alone (Snapshots.held): each step of its own slots with
    the reason it cannot be used (None: it can), and the steps of each peer whose replica it keeps."""
    own: dict = field(default_factory=dict)  # {step: problem or None}
    kept: dict = field(default_factory=dict)  # {source rank: [steps]}

    def usable(self):
        return {step for step, problem in self.own.items() if problem is None}

    def to_json(self):
        return {"own": list(self.own.items()), "kept": list(self.kept.items())}

    @staticmethod
    def from_json(sent):
        """A peer's Held, as gather_json brought it (its numbers made integers again)."""
        return Held({int(step): problem for step, problem in sent["own"]},
                    {int(source): [int(step) for step in steps] for source, steps in sent["kept"]})


class Snapshots:
    """This rank's two slots in `folder`, and the copy into them in a thread of its own.

    The ranks `group` (a range) share one copy of the state, in the .bin named after its first rank,
    each copying and checksumming its part: an FSDP rank is a group of its own (its shards); DDP's
    ranks on a node form one group, their states being the same. `header` is what every record says of
    the run (its id, world size, config); `check(record)` is a record's config problem, or None.
    `replica` (tiers/replica.py), on several nodes: each record (and its shards) is also kept by a
    rank of the next node, and this rank keeps those of the node before."""

    def __init__(self, folder, run, rank, group, every, header, model, optimizer, check, replica=None):
        self.folder, self.run, self.rank, self.group, self.every = Path(folder), run, rank, group, every
        self.model, self.optimizer, self.check, self.replica = model, optimizer, check, replica
        self.header = {"format": FORMAT, "run": run, **header}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self.copying = None  # the copy in flight
        self.failed = False  # a copy failed: no more snapshots on this rank
        self.made = False  # the folder, made (or checked again) by the first snapshot
        self.tensors = None  # the live tensors copied at each snapshot, found at the first
        self.nbytes = None  # of a slot's .bin (the group's copy), known at the first
        self.maps = {}  # slot -> the group's .bin, mapped as uint8
        self.blocked_s = 0.0  # the loop's time blocked by the last snapshot: its start, then the wait for its copy
        self.faults, self.reopen = None, None  # (open_tier sets them: the tests' faults, and how to open it again)
        # The optimizer must not change tensors a snapshot is still copying: it waits for the copy first.
        optimizer.register_step_pre_hook(lambda *_: self.wait())

    # ------------------------------------------------------------------------- the checkpointer's hooks
    def after_step(self, step, checkpointer):
        self.start(step, rng_state(), self.faults.in_snapshot(step) if self.faults else None)

    def in_flight(self):
        return {"snapshot_s": self.blocked_s}

    def restore(self, checkpointer):
        """A resume's first rung: the newest snapshot, if every rank can restore it and it is newer than the
        disk's newest checkpoint. Returns the step restored, or None."""
        t0 = time.perf_counter()
        committed = checkpoints(checkpointer.ckpt_dir) if checkpointer.rank == 0 else None
        step = self.resume(committed[0][0] if committed else None, checkpointer.device)
        if step is not None:
            checkpointer.monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(self.folder),
                                       source="memory")
            print0(f"resuming from step {step} (memory snapshot)")
        return step

    def settle(self):
        """A peer was lost: the copy in flight ends (whole, or not recorded; one cut short by the lost peer,
        a replica's exchange, is not news: the tier is opened again over the new group)."""
        if self.copying is not None:
            with contextlib.suppress(Exception):
                self.copying.result()
            self.copying = None
        self.pool.shutdown()

    def regroup(self, checkpointer):
        return self.reopen()

    def preempted(self, step):
        """A stop for a restart (a preemption, a cancel, a time limit): `step`, the newest any slot holds,
        is committed on disk, so a restart resumes from there and would never restore a snapshot; they go
        now, not holding the node's memory for a requeue that may land on other nodes, or never come."""
        self.remove()

    def finish(self, done):
        if done:  # the last step is on disk: the memory tier has nothing more to offer
            self.remove()

    def summary(self):
        return {"snapshot_bytes": self.nbytes}

    def path(self, rank, slot, suffix):
        return self.folder / f"{self.run}-rank{rank}-slot{slot}{suffix}"

    def slot(self, step):
        return step // self.every % 2

    def due(self, step):
        """A snapshot at `step`; with a replica, even on a rank whose copies failed: its partner and
        source still exchange records with it (an empty one from it), as they cannot know."""
        return step % self.every == 0 and (not self.failed or self.replica is not None)

    # ------------------------------------------------------------------------- write
    def start(self, step, rng, crash_midway=None):
        """Snapshot `step` in the thread, if it is due: the model's and the optimizer's tensors, as
        get_state_dict gives them (found once: they are updated in place from then on, as AdamW's and
        FSDP's are), and `rng`, this rank's RNG state now. `crash_midway` is fault injection, called
        halfway through the copy."""
        if not self.due(step):
            return
        t0 = time.perf_counter()
        self.wait()
        if self.tensors is None:
            self.tensors = local_tensors(get_state_dict(self.model, self.optimizer))
            self.entries, self.nbytes = layout(self.tensors)
            self.part = part(self.entries, self.nbytes, self.rank - self.group.start, len(self.group))
        self.copying = self.pool.submit(self._write, step, rng, crash_midway)
        self.blocked_s = time.perf_counter() - t0

    def wait(self):
        """Until the copy in flight is done (its time counts in blocked_s). A copy that failed (a full
        tmpfs) turns the tier off on this rank, in one line: the disk tier is still there, and a
        restart finds no newer snapshot of this rank, so it loads from disk. A replica's exchange that
        failed with a peer is the job's loss, not the tier's: its error goes on (the group re-forms)."""
        t0 = time.perf_counter()
        if self.copying is not None:
            try:
                self.copying.result()
            except Exception as e:
                if any(phrase in str(e) for phrase in PEER_LOST):
                    self.copying = None
                    raise
                if not self.failed:
                    print(f"rank {self.rank}: memory snapshot failed ({str(e).strip()[:160]}): the memory tier is "
                          "off on this rank, the disk checkpoints go on", flush=True)
                self.failed = True
            self.copying = None
        self.blocked_s += time.perf_counter() - t0

    def _write(self, step, rng, crash_midway):
        """The copy and its record (not after a failed one), then the exchange of records with the peers."""
        payload, error = b"", None
        if not self.failed:
            try:
                self.make_folder()
                payload = self._copy(step, rng, crash_midway)
            except Exception as e:  # still exchange (an empty record), then report it
                error = e
        if self.replica:
            self.replica.exchange(payload, self.maps[self.slot(step)][0] if payload else None)
        if error is not None:
            raise error

    def make_folder(self):
        """Make the folder (mode 0700) at the first snapshot, or check it again if another rank has; one
        that is not this user's alone fails the copy (OSError)."""
        if not self.made:
            problem = private_folder(self.folder)
            if problem:
                raise OSError(problem)
            self.made = True

    def _copy(self, step, rng, crash_midway):
        slot = self.slot(step)
        record_path = self.path(self.rank, slot, ".json")
        record_path.unlink(missing_ok=True)  # from here until the rename, this slot is not a snapshot
        if slot not in self.maps:  # the group's ranks map it at once: its size in its name, none unlinks another's
            buf = map_file(self.path(self.group.start, slot, f"-{self.nbytes}.bin"), self.nbytes, write=True)
            self.maps[slot] = buf, views(buf, self.entries)
        buf, targets = self.maps[slot]
        (lo, hi), mine = self.part
        for n, i in enumerate(mine):
            targets[i].copy_(self.tensors[i][1])
            if crash_midway and n == len(mine) // 2:
                crash_midway()
        record = {**self.header, "step": step, "slot": slot, "rank": self.rank, "rng": rng_to_json(rng),
                  "layout": self.entries, "nbytes": self.nbytes, "part": [lo, hi],
                  "crc32": checksum(buf[lo:hi], self.entries)}
        payload = json.dumps(record).encode()
        atomic_write(record_path, lambda f: f.write(payload), mode=0o600)  # JSON: nothing in it runs
        return payload

    # ------------------------------------------------------------------------- read
    def records(self):
        """{step: record} of this rank's committed slots of this run (their world size and config are
        checked by held())."""
        found = {}
        for slot in (0, 1):
            try:
                record = json.loads(read_checked(self.path(self.rank, slot, ".json")))
            except (OSError, ValueError):  # absent, or not a record
                continue
            if record.get("format") == FORMAT and record.get("run") == self.run:
                found[record["step"]] = record
        return found

    def problem(self, record):
        """Why `record` cannot be restored in this job, or None."""
        if record["world_size"] != self.header["world_size"]:
            return (f"written at world size {record['world_size']}, this job has {self.header['world_size']} "
                    "(the memory tier does not reshard)")
        return self.check(record)

    def held(self):
        """What this rank can restore (Held), from its own files alone: no collective."""
        kept = {source: [step for step, record in found.items() if self.problem(record) is None]
                for source, found in (self.replica.records() if self.replica else {}).items()}
        return Held({step: self.problem(record) for step, record in self.records().items()}, kept)

    def load(self, record):
        """The tensors and RNG of `record` (this rank's): the group's .bin, each part checked against
        the record of the rank that wrote it. Raises ValueError naming what is wrong."""
        step, slot = record["step"], record["slot"]  # (--snapshot-every may have changed since)
        parts = []
        for r in self.group:
            other = record if r == self.rank else json.loads(read_checked(self.path(r, slot, ".json")))
            if (other.get("run"), other.get("step"), other.get("layout")) != (self.run, step, record["layout"]):
                raise ValueError(f"rank {r}'s slot {slot} holds another step")
            parts.append((*other["part"], other["crc32"]))
        path = self.path(self.group.start, slot, f"-{record['nbytes']}.bin")
        try:
            buf = map_file(path, record["nbytes"], write=False)
        except FileNotFoundError:
            raise ValueError(f"{path.name} is missing") from None
        for lo, hi, crc in parts:
            if checksum(buf[lo:hi], record["layout"]) != crc:
                raise ValueError(f"bytes {lo}-{hi} of {path.name} do not match their checksum (damaged)")
        return views(buf, record["layout"]), record["layout"], rng_from_json(record["rng"])

    def restore_step(self, step, everyone, device, group=None):
        """Restore `step` into the model, the optimizer and this rank's RNG, over `group` (default: the
        world), whose ranks' Held are `everyone`, in the group's order; every member calls it. Returns
        whether every member restored it (if not, none did: the caller falls back together).

        Each rank checks the data it reads against its checksum, and the ranks agree on the outcome. A
        rank with no snapshot of the step (its node replaced, its memory empty) restores it from its
        replica on a peer: its RNG from the replica, and the model and optimizer from a rank that has
        the step (replicated "records": the same on every rank) or its shards from the rank that keeps
        them ("shards")."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        error, rng, record = None, None, None
        try:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            if step in everyone[rank].usable():
                tensors, entries, rng = self.load(self.records()[step])
                restore(tensors, entries, model_state, optim_state)
        except Exception as e:  # whatever is wrong with files in a folder of tmpfs, the disk is still there
            error = e
            print(f"rank {self.rank}: memory snapshot of step {step} not loaded ({e})", flush=True)
        if not agree(error is None, device, group):
            return False
        needy = [r for r in range(world) if step not in everyone[r].usable()]
        if needy:  # a replaced node's ranks: their records from the replicas, their state from peers
            replicas = self.replica.records() if self.replica else {}
            offers = [{int(r): record for r, record in offer.items()} for offer in gather_json(
                {r: replicas[r][step] for r in needy if step in replicas.get(r, {})}, group)]
            holder = {r: h for h, offer in enumerate(offers) for r in offer}
            if rank in needy:
                record = offers[holder[rank]][rank]
                rng = rng_from_json(record["rng"])
            if self.replica.mode == "shards":  # each needy rank's shards from the rank that keeps them, in turn
                for r in needy:
                    if rank == holder[r]:
                        self.replica.send_shards(replicas[r][step], r)
                    elif rank == r:
                        buf = self.replica.receive_shards(record, holder[r])
                        restore(views(buf, record["layout"]), record["layout"], model_state, optim_state)
                how = "their shards from the ranks that kept them"
            else:
                source = min(r for r in range(world) if step in everyone[r].usable())
                for _, t in local_tensors((model_state, optim_state)):
                    dist.broadcast(t, source, group=group)
                how = f"the model and optimizer from rank {source}"
            print0(f"memory snapshot of step {step}: ranks {needy} had none (a replaced node): their records from "
                   f"the replicas, {how}")
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        set_rng_state(rng)
        return True

    def resume(self, disk_step, device):
        """Restore the newest snapshot that every rank can restore whole, if it is newer than the newest
        disk checkpoint (`disk_step`, as rank 0 sees it; None if there is none). Returns the step
        restored, or None (with a line saying why, if there was a snapshot) for the caller to load from
        disk. One collective over the world group gathers what each rank holds; the ranks then try each
        step that all of them can restore, newest first, and load the same step or all fall back."""
        everyone = gather_json((self.held().to_json(), disk_step))
        held = [Held.from_json(h) for h, _ in everyone]
        steps, why = candidates(held, everyone[0][1], self.replica.mode if self.replica else None)
        if why:
            print0(why)
        for step in steps:
            if self.restore_step(step, held, device):
                return step
            print0(f"memory snapshot of step {step} did not load on every rank: "
                   + ("trying the older one" if step != steps[-1] else "loading from disk"))
        return None

    def remove(self):
        """Delete the run's snapshots in this folder (a finished job): each rank its own slots, then, once
        every rank has (a barrier), what is left of the run's (the ranks of an earlier, larger world size,
        a record's temp file, the replicas), and the folder once it is empty."""
        self.wait()
        for path in self.folder.glob(f"{self.run}-rank{self.rank}-slot*"):
            path.unlink(missing_ok=True)
        dist.barrier()
        try:  # the node's other ranks clean up at the same time: the folder may go at any moment
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith((f"{self.run}-rank", f".{self.run}-rank")):
                (self.folder / name).unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:  # another run's snapshots are still there, or another rank removed it first
            pass


def part(entries, nbytes, index, count):
    """((lo, hi), [entry indices]): the `index`-th of `count` parts of a .bin, split at tensor
    boundaries into byte ranges of about nbytes / count each."""
    bounds = [0] + [next((e[3] for e in entries if e[3] >= nbytes * k / count), nbytes) for k in range(1, count)]
    bounds.append(nbytes)
    lo, hi = bounds[index], bounds[index + 1]
    return (lo, hi), [i for i, e in enumerate(entries) if lo <= e[3] < hi]


def restore(tensors, entries, model_state, optim_state):
    """Copy the snapshot's `tensors` into the state dicts that get_state_dict gave (the live model's
    and optimizer's, by name), after checking that they are the same tensors; the caller then loads
    them with set_state_dict."""
    live = local_tensors((model_state, optim_state))  # as `start` found them
    expected = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in live]
    if expected != [e[:3] for e in entries]:
        raise ValueError("its tensors are not this model's and optimizer's")
    with torch.no_grad():
        for (_, t), saved in zip(live, tensors):
            t.copy_(saved)


def candidates(everyone, disk_step, mode):
    """(the steps to try, newest first, and a line saying why the newest snapshot is not among them, or
    None): the steps that every rank of `everyone` (their Held, in rank order) can restore, itself or
    from a replica, and that are newer than the disk's newest checkpoint `disk_step` (None: none).
    `mode` is the replica's ("records": a peer has the model and optimizer; "shards"), or None."""
    world = len(everyone)
    newest = max((s for held in everyone for s in held.own), default=None)
    if newest is None:
        return [], None
    from_peers = [set() for _ in range(world)]
    for held in everyone:
        for owner, steps in held.kept.items():
            from_peers[owner].update(steps)
    own = [held.usable() for held in everyone]
    pool = set.union(*own) | (set.union(*from_peers) if mode == "shards" else set())
    usable = {s for s in pool if all(s in own[r] or s in from_peers[r] for r in range(world))}
    steps = sorted((s for s in usable if disk_step is None or s > disk_step), reverse=True)
    if steps and steps[0] == newest:
        return steps, None
    missing = next((f"rank {r}: {held.own[newest]}" if newest in held.own else f"rank {r} has none"
                    for r, held in enumerate(everyone) if held.own.get(newest, "") is not None), None)
    why = missing or f"the disk checkpoint of step {disk_step} is not older"
    return steps, (f"memory snapshot of step {newest} not used: {why}"
                   + (f"; trying step {steps[0]}" if steps else "; loading from disk"))
