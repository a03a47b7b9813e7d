"""fsdp/train.py's checkpoint, built and read here: a folder ckpt/step-NNNNNNNN/ holding every rank's
shards of "model" and "optimizer" (DCP, by name, as get_state_dict gives them), and train.pt (format,
step, world_size, config, every rank's RNG), then DCP's `.metadata`, the commit.

Checkpointer says what a checkpoint holds (write), waits for its commit (commit) and loads one
(load); when to save, and the ladder of a resume, are common.checkpointer.BaseCheckpointer's. Below
it: the writer that commits a folder, the record of a save in flight (synchronous or while training
goes on) and its waits, the staging options, the reader that unpickles only what DCP writes, and the
load that every rank agrees on, with its fallback.
"""
import dataclasses
import datetime
import pickle
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path, PosixPath
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.torch_version import TorchVersion

from common.checkpoint import (COMMIT_MARKER, atomic_save, checkpoints, fsync_dir, keeping_settings, move_aside,
                               refuse_unfit, remove, restore_rng, rng_from_json, rng_state, rng_to_json, seed_rng,
                               step_name)
from common.checkpointer import BaseCheckpointer
from common.config import fail
import common.dist
from common.dist import GIVEN_UP, PEER_LOST, agree, gather_json, print0
from common.model import SHAPE_FIELDS

# The layout of a ckpt/step-NNNNNNNN/ folder (Checkpointer.write): DCP's shards of "model" and
# "optimizer", train.pt (format, step, world size, config, every rank's RNG), `.metadata` last. A load
# refuses any other format.
FORMAT = 2
# Settings a resume must keep: the model's shape (or the weights do not fit) and which samples a step sees.
SAMPLE_FIELDS = ("seed", "batch_size", "data")

# torch 2.11 fails the second async save through one DefaultStager (KeyError in its state-dict
# copy); 2.13 and later reuse one, and its buffers, for the whole run.
REUSE_STAGER = TorchVersion(torch.__version__) >= "2.13"


def staging_options(cuda):
    """An async save copies this rank's shards into CPU buffers (staging) in a thread of its own. On
    CUDA the buffers are pinned and the copies non-blocking, on a stream of their own; the CPU has
    neither (non-blocking copies raise without an accelerator, pin_memory is ignored)."""
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=cuda)


def describe_staging(cuda):
    return (f"async save: staged in a background thread into {'pinned' if cuda else 'pageable'} CPU buffers"
            + (" by non-blocking copies on a side stream" if cuda else " (pinned memory needs CUDA)") + "; "
            + ("one stager for the run, its buffers reused" if REUSE_STAGER else
               f"a stager per save (torch {torch.__version__} cannot reuse one)"))



class Checkpointer(BaseCheckpointer):
    """What a checkpoint of fsdp/train.py holds (write), its commit, and the resume; when to save is
    BaseCheckpointer's (common/checkpointer.py).

    An async save copies this rank's shards into CPU buffers (staging), then writes them, both in
    threads: the optimizer waits for the copy only before its next step (a hook of the optimizer's),
    which would change the weights being copied. Where the torch version allows, one stager keeps its
    buffers for the run and copies into them again at each save; else each save gets a fresh one. Its
    collectives run in a thread, over a group of their own (gloo, as DCP needs a CPU backend for it),
    so that they never interleave with the training collectives."""

    def __init__(self, *args, faults=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults  # the tests' (tiers/faults.py), or None
        threading.excepthook = keep_writer_errors  # DCP's writer threads' errors, for save_failed's one line
        cuda, self.save_group, self.stager = self.device.type == "cuda", None, None
        self.staging = staging_options(cuda)
        if self.cfg.async_save:
            self.save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
            self.stager = DefaultStager(self.staging) if REUSE_STAGER else None
            print0(describe_staging(cuda))
        self.optimizer.register_step_pre_hook(lambda *_: self.pending and self.pending.wait_staged())

    def write(self, step, asynchronous):
        """Start the checkpoint of `step`: every rank's shards through DCP, then rank 0's train.pt and DCP's
        `.metadata`, which commits it. Returns the ShardedSave still in flight if asynchronous, else None:
        a synchronous save is committed before it returns."""
        t0 = time.perf_counter()
        path = self.ckpt_dir / step_name(step)
        # The Writer adds "rng", every rank's RNG state, gathered in the thread that saves.
        train_pt = {"format": FORMAT, "step": step, "world_size": self.world, "config": dataclasses.asdict(self.cfg)}
        state = dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer)))  # this rank's shards
        before_commit = self.faults.in_save(step, f" into {path}: shards written, not committed") if self.faults \
            else None
        writer = Writer(path, train_pt, rng_state(), self.save_group if asynchronous else None, self.cfg.save_threads,
                        before_commit=before_commit, before_write=self.faults.in_write(step) if self.faults else None)
        record = ShardedSave(step, path, t0)
        if asynchronous:  # returns at once: the copy and the write go on in threads
            # The side stream does not wait for the training stream: this step's weights must be final.
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            record.stager = ((self.faults.stager(self.staging, step) if self.faults else None) or self.stager
                             or DefaultStager(self.staging))
            response = dcp.async_save(state, storage_writer=writer, process_group=self.save_group,
                                      async_stager=record.stager)  # an AsyncSaveResponse: staging is async
            record.staging, record.future = response.staging_completion, response.upload_completion
            record.staging.add_done_callback(lambda _: setattr(record, "staged_at", time.perf_counter()))
            record.future.add_done_callback(lambda _: setattr(record, "done_at", time.perf_counter()))
            record.blocking_s = time.perf_counter() - t0
            return record
        try:  # returns once every rank's shards and the commit are on disk
            dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as e:  # a full disk: the folder stays uncommitted, never loaded
            save_failed(step, e)
        record.done_at = time.perf_counter()
        record.blocking_s = record.done_at - t0
        self.commit(record)
        return None

    def commit(self, record, in_loop=True):
        """Wait for the save `record` to commit (in the loop, the wait blocks training), then make it
        durable, prune and report it."""
        record.wait_committed(in_loop, self.stager)
        nbytes = 0
        if self.rank == 0:  # the commit reaches the disk before older checkpoints are deleted
            fsync_dir(record.path)
            fsync_dir(self.ckpt_dir)
            nbytes = sum(f.stat().st_size for f in record.path.iterdir())
            self.prune(record.step)
        total_s = (record.done_at or time.perf_counter()) - record.t0  # its callback may run after result()
        self.report(record.step, nbytes, record.blocking_s, record.staging_s(), total_s,
                    staging_wait_s=record.staging_wait_s, commit_wait_s=record.commit_wait_s)

    def finish(self, done=False):
        super().finish(done)
        if self.stager:
            self.stager.close()

    def full_weights(self):
        """--light-every: every rank's shards gathered into rank 0's CPU memory (the others get nothing)."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self):
        """Load the newest checkpoint folder that loads on every rank and fits the config, and restore
        train.pt's step and RNG states; else start fresh. Returns the step resumed from, or None."""
        cfg, rank, world = self.cfg, self.rank, self.world
        step = None
        # Rank 0 lists the committed checkpoints, newest first, for everyone; all ranks try each in
        # turn and move on together, so they never load different steps.
        candidates = [[Path(p) for p in paths] if paths is not None else None for paths in gather_json(
            [str(path) for _, path in checkpoints(self.ckpt_dir)] if rank == 0 else None)[:1]]
        path, train_pt, load_s, unreadable = keeping_settings(self.optimizer, lambda: load_newest_everywhere(
            candidates[0], self.model, self.optimizer, self.device, self.monitor))
        if candidates[0] and train_pt is None:  # never train fresh over checkpoints that exist but do not load
            fail(f"no checkpoint in {self.ckpt_dir} loads (see above); move the damaged ones away or use another "
                 "--run-dir")
        if train_pt is not None:
            refuse_unfit(train_pt, cfg, path, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
            step = train_pt["step"]
            if restore_rng(train_pt["rng"], train_pt["world_size"], cfg.seed, step, rank, world):
                print0(f"resharded from {train_pt['world_size']} to {world} ranks")
                self.monitor.event("reshard", step=step, from_world_size=train_pt["world_size"], world_size=world)
            self.monitor.event("load", step=step, load_s=load_s, path=str(path), source="disk")
            print0(f"resuming from step {step}")
        else:
            seed_rng(cfg.seed, rank)
            print0("no checkpoint, starting fresh")
        # The steps of newer folders will be trained and saved again, into fresh folders (a committed
        # one is never overwritten in place): move the unreadable ones aside, and remove torn saves.
        if rank == 0:
            for p in unreadable:
                move_aside(p, "did not load on every rank")
            for _, p in checkpoints(self.ckpt_dir, committed=False):
                if remove(p):
                    print(f"removed {p.name} (never committed)", flush=True)
        return step

class Writer(dcp.FileSystemWriter):
    """DCP's file writer (`thread_count` threads a rank) that also writes train.pt. DCP calls
    prepare_local_plan on every rank, in the thread that saves, before it gathers their plans: each
    rank's RNG state `rng` goes to rank 0 there (over `group`, the one DCP saves over), so an async save
    gathers it off the training loop. DCP calls finish() on rank 0 once every rank's shards are on disk,
    to write `.metadata`, the commit: `train_pt` and the RNG states go into train.pt there, just before.
    `before_commit` runs between the two, `before_write` as a rank starts writing its shards (the
    tests' faults), as in common.checkpoint.atomic_write."""

    def __init__(self, path, train_pt, rng, group, thread_count, before_commit=None, before_write=None):
        super().__init__(path, thread_count=thread_count)
        self.train_pt, self.rng, self.group, self.before_commit = train_pt, rng, group, before_commit
        self.before_write = before_write

    def write_data(self, plan, planner):
        if self.before_write:
            self.before_write()
        return super().write_data(plan, planner)

    def prepare_local_plan(self, plan):
        rngs = [rng_from_json(r) for r in gather_json(rng_to_json(self.rng), self.group)]
        self.train_pt = {**self.train_pt, "rng": rngs}
        return super().prepare_local_plan(plan)

    def finish(self, metadata, results):
        atomic_save(self.train_pt, Path(self.path) / "train.pt")
        if self.before_commit:
            self.before_commit()
        if common.dist.abandoned():  # (--survivors) a peer was lost meanwhile: the group is over, so is its save
            raise RuntimeError(f"{GIVEN_UP} before the commit")
        super().finish(metadata, results)


@dataclass
class ShardedSave:
    """A DCP checkpoint being written. blocking_s is what the training loop waited for it: the call, then
    for an async save the wait for its copy (staging) before the next optimizer step and the wait for
    its commit before the next save (not the wait at the end of the job: no step is left to stall).
    An async save also holds the futures of its staging (None once waited for) and of its write, and
    the stager that holds the staged copy."""
    step: int
    path: Path
    t0: float
    blocking_s: float = 0.0
    staging_wait_s: float = 0.0  # of blocking_s: the wait for the copy before the next optimizer step
    commit_wait_s: float = 0.0  # of blocking_s: the wait for the commit before the next save
    staged_at: Optional[float] = None
    done_at: Optional[float] = None
    staging: Optional[Future] = None
    future: Optional[Future] = None
    stager: Optional[DefaultStager] = None

    def wait_staged(self):
        """Before an optimizer step, which must not change weights this save is still copying."""
        if self.staging:
            self.staging_wait_s = wait_for_save(self.staging, self.step)
            self.blocking_s += self.staging_wait_s
            self.staging = None

    def wait_committed(self, in_loop, shared_stager):
        """Until every rank's shards and the commit are on disk; in the loop, the wait blocks training.
        Then a stager of the save's own (not `shared_stager`) is closed and dropped: the callbacks on the
        futures hold this record, so a stager it kept would keep its staged copy until a garbage
        collection, pinned on CUDA."""
        if self.future is not None:
            waited = wait_for_save(self.future, self.step)
            if in_loop:
                self.commit_wait_s = waited
                self.blocking_s += waited
        if self.stager is not None and self.stager is not shared_stager:
            self.stager.close()
        self.stager = None

    def staging_s(self):
        """Seconds from the call to the end of the copy (async saves only)."""
        return (self.staged_at or self.done_at or time.perf_counter()) - self.t0 if self.future else None


def wait_for_save(future, step):
    """Wait for a future of the save of `step` and return the seconds waited; a failure is save_failed."""
    t0 = time.perf_counter()
    try:
        future.result()
    except (Exception, CheckpointException) as e:  # DCP's own error is not an Exception
        save_failed(step, e)
    return time.perf_counter() - t0


WRITER_ERRORS = []  # what DCP's writer threads raised (keep_writer_errors), for save_failed's line


def keep_writer_errors(args, default=threading.excepthook):
    """threading.excepthook: DCP writes through threads of its own, and on a full disk each printed its
    traceback (29 in a 2-rank save) before the save failed in the caller. Their errors are kept for
    save_failed instead; any other thread's go to Python's default hook."""
    if any(frame.f_code.co_name == "_write_files_from_queue" for frame, _ in traceback.walk_tb(args.exc_traceback)):
        WRITER_ERRORS.append(args.exc_value)
    else:
        default(args)


def save_failed(step, error):
    """One line and exit 3 for a save that failed (a full disk): its folder is never committed, so the
    checkpoints of earlier steps stay the ones a restart loads. The reason is the disk's (an OSError of
    a writer thread) when there is one: the caller's own error may be a consequence, as a torn zip.

    A save whose collectives lost a peer (it died or hung while the save was in flight: DCP's result
    never came from rank 0) did not fail on this rank: the peer's crash is what torchrun must answer.
    It is raised as a lost peer (common.dist.peer_loss_in_one_line: one line, exit 1, a restart from
    the last commit), not stopped as a failed save, which is never retried."""
    lost = next((phrase for phrase in PEER_LOST if phrase in str(error)), None)
    if lost:
        raise RuntimeError(f"saving step {step}: {lost}, a peer died or hung while the save was in flight") \
            from error
    cause = next((e for e in WRITER_ERRORS if isinstance(e, OSError)), error)
    reason = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[-1][:160] or type(cause).__name__
    fail(f"saving step {step} failed ({reason}): the checkpoints of earlier steps are kept", code=3)


# ----------------------------------------------------------------------------- what a load unpickles
# DCP's own reader unpickles `.metadata` with pickle.load, and its planner each non-tensor item with
# torch.load(weights_only=False): a step folder that someone else put in ckpt/ would run its code on
# every rank. Reader and Planner admit only what DCP writes for this project's state.

# The globals a `.metadata` pickle of this project names (listed from its checkpoints, torch 2.14, 1 and 2
# ranks, sync and async), by the module and name the pickle gives: DCP's metadata classes, the file
# reader's _StorageInfo, torch.Size, the function that names a layout, the checkpoint's path (from
# `pathlib._local` on Python 3.13), and torch's dtypes, layouts and memory formats, which are plain values.
METADATA_GLOBALS = {
    **{(cls.__module__, cls.__qualname__): cls
       for cls in (Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
                   ChunkStorageMetadata, TensorProperties, _MEM_FORMAT_ENCODING, _StorageInfo)},
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{(module, "PosixPath"): PosixPath for module in ("pathlib", "pathlib._local")},
    **{("torch", name): value for name, value in vars(torch).items()
       if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))},
}


class MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that refuses any global not in METADATA_GLOBALS, naming it and the file `name`:
    every object a pickle builds or function it calls goes through find_class, so none runs."""

    def __init__(self, file, name):
        super().__init__(file)
        self.name = name

    def find_class(self, module, name):
        try:
            return METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused {module}.{name} in {self.name}: "
                                         "not one of the classes DCP's metadata holds") from None


class Reader(dcp.FileSystemReader):
    """DCP's file reader, reading `.metadata` through MetadataUnpickler; the metadata must name only files
    of its own folder. The Writer writes one `.metadata` (rank 0, at the commit), never a rank's own
    `__<rank>.metadata`, so the `rank` that DCP passes to fall back to one is not read (torch 2.14's
    signature: `*args, **kwargs`)."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / COMMIT_MARKER
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        outside = [i.relative_path for i in metadata.storage_data.values()
                   if Path(i.relative_path).name != i.relative_path]
        if outside:
            raise pickle.UnpicklingError(f"{path} names {outside[0]!r}, a file outside its folder")
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader does: its logs name the load
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(dcp.DefaultLoadPlanner):
    """DCP's load planner, unpickling each non-tensor item (here the optimizer's param_groups: numbers,
    bools, None, strings, tuples) with torch.load(weights_only=True); DCP's reader loads tensors so
    already. A refusal is one line: torch's own message is a page that suggests weights_only=False."""

    def load_bytes(self, read_item, value):
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((line.split("error: ", 1)[-1].split(". ")[0] for line in str(e).splitlines()
                        if "WeightsUnpickler error:" in line), "not a weights-only pickle")
            raise pickle.UnpicklingError(f"refused the item {read_item.dest_index.fqn} ({why})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
        else:
            self.state_dict[read_item.dest_index.fqn] = item


# ----------------------------------------------------------------------------- load
def load_checkpoint(path, model, optimizer, device):
    """Load the checkpoint folder `path` into the live model and optimizer on every rank.

    Returns (train_pt, error): train_pt is train.pt's record if every rank loaded the whole checkpoint,
    else None, with this rank's error if it had one. `.metadata` is read once before DCP's load: a
    refusal is then this rank's one-line error (inside the load, DCP logs it with a traceback first). A
    failed DCP load may have written part of the live tensors; the load that succeeds later overwrites
    them all."""
    train_pt, error, reader = None, None, Reader(path)
    try:
        train_pt = torch.load(path / "train.pt", map_location="cpu", weights_only=True)
        reader.read_metadata()
    except Exception as e:
        error = e
    if agree(error is None, device):
        try:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.load({"model": model_state, "optimizer": optim_state}, storage_reader=reader, planner=Planner())
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        except (Exception, CheckpointException) as e:  # DCP's own error is not an Exception
            error = e
        if agree(error is None, device):
            return train_pt, None
    return None, error


def load_newest_everywhere(candidates, model, optimizer, device, monitor):
    """Load the newest of `candidates` that loads on every rank. Each is tried twice (a read can fail
    for a moment on a network filesystem, or run out of memory), then the ranks move on together.
    Returns (path, its train.pt record, seconds to load, the candidates that did not load)."""
    unreadable = []
    for path in candidates:
        for attempt in (1, 2):
            t0 = time.perf_counter()
            train_pt, error = load_checkpoint(path, model, optimizer, device)
            if train_pt is not None:
                return path, train_pt, time.perf_counter() - t0, unreadable
            if error is not None:
                reason = str(error).strip().splitlines()[-1][:160]  # DCP's message ends with the root cause
                print(f"rank {dist.get_rank()}: checkpoint {path} unreadable ({type(error).__name__}: {reason})",
                      flush=True)
            print0(f"checkpoint {path.name} did not load on every rank: "
                   + ("trying once more" if attempt == 1 else "falling back to the previous one"))
        monitor.event("fallback", path=str(path), error=repr(error)[:300] if error else None)
        unreadable.append(path)
    return None, None, None, unreadable
