"""fsdp/train.py end to end: real torchrun, gloo on CPU. Each test runs the real job and reads what it wrote."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.checkpoint import checkpoints, param_digest
from common.model import ModelConfig, Transformer
from harness import launch, procs
from harness.metrics import events, training_peaks
from conftest import DROPOUT, PEAK_TFLOPS, SMALL, metrics, refused, summary, torchrun

SCRIPT = "fsdp/train.py"


def copy_run(src, dst):
    shutil.copytree(src, dst)
    (Path(dst) / "summary.json").unlink()
    return dst


def test_a_crash_while_an_async_save_copies_the_shards_resumes_from_the_previous_commit(tmp_path, fsdp_reference):
    # Rank 1 dies in the staging thread of step 12's save, its loop gone on; without rank 1's shards
    # step 12 never commits, and the job resumes from step 8. With --cpu-offload the weights and the
    # optimizer state live on the CPU, and are staged from there.
    # The memory tier is off: its snapshot of step 12 or 11 would be loaded instead.
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, *DROPOUT, "--cpu-offload", "--async-save", "--snapshot-every", 0,
                    faults="crash-in-staging=12", restarts=1)
    assert "async save: staged in a background thread into pageable CPU buffers" in proc.stdout
    assert "injected crash: rank 1 while staging step 12" in proc.stderr
    assert "resuming from step 8" in proc.stdout
    s = summary(tmp_path)
    assert (s["restarts"], s["resumed_from_step"], s["steps"]) == (1, 8, 16)
    assert s["param_digest"] == summary(fsdp_reference)["param_digest"]


def test_async_save_crash_in_flight_resumes_from_the_previous_commit(tmp_path, fsdp_reference):
    # The crash hits the last save, which every rank waits for before the job ends: rank 1 is in the
    # save's collectives when rank 0 dies, a lost peer (a restart), not a failed save (exit 3, no retry:
    # it was one on 4079b2c). The one loaded is the third save, staged into the buffers the earlier
    # saves filled: a stale or mixed-up buffer would load other weights and change the digest.
    proc = torchrun(SCRIPT, 2, tmp_path, *SMALL, *DROPOUT, "--async-save", "--snapshot-every", 0,
                    faults="crash-in-save=16", restarts=1)  # the memory tier off, as above
    assert "step-00000016: shards written, not committed" in proc.stderr
    assert "resuming from step 12" in proc.stdout  # not from the torn step 16...
    assert "removed step-00000016 (never committed)" in proc.stdout  # ...which is saved again in a fresh folder
    assert [s for s, _ in checkpoints(tmp_path / "ckpt")] == [16, 12, 8]
    assert checkpoints(tmp_path / "ckpt", committed=False) == []
    s = summary(tmp_path)
    assert s["async_save"] and s["restarts"] == 1
    assert s["param_digest"] == summary(fsdp_reference)["param_digest"]
    saves = metrics(tmp_path, 0, "save")
    assert {e["step"] for e in saves} == {4, 8, 12, 16}
    assert all(0 < e["blocking_s"] <= e["total_s"] and 0 < e["staging_s"] <= e["total_s"] and e["bytes"] > 0
               for e in saves)


def test_a_damaged_memory_snapshot_is_refused_by_its_checksum_and_the_job_ends_bitwise(tmp_path, fsdp_reference):
    # A first launch dies after step 10 with no restart left: its snapshots of steps 9 and 8 (rank 0's
    # perhaps of 10) stay in memory. One byte of rank 0's step 9 changes; the relaunch refuses it by its
    # checksum and resumes from step 8 (the older slot, or the disk's), never from the damaged bytes.
    snap_dir = tmp_path / "memory"
    flags = [*SMALL, *DROPOUT, "--snapshot-dir", snap_dir]
    first = torchrun(SCRIPT, 2, tmp_path, *flags, faults="crash-at-step=10", max_restarts=0, check=False)
    assert first.returncode != 0 and "injected crash: rank 1 after step 10" in first.stderr
    record = next(r for r in map(json.loads, map(Path.read_text, snap_dir.glob("*-rank0-slot*.json"))) if r["step"] == 9)
    data = snap_dir / f"{record['run']}-rank0-slot{9 % 2}-{record['nbytes']}.bin"
    damaged = bytearray(data.read_bytes())
    damaged[record["part"][1] // 2] ^= 0xFF
    data.write_bytes(damaged)
    proc = torchrun(SCRIPT, 2, tmp_path, *flags)
    assert "do not match their checksum (damaged)" in proc.stdout
    assert summary(tmp_path)["resumed_from_step"] == 8
    assert summary(tmp_path)["param_digest"] == summary(fsdp_reference)["param_digest"]
    assert not snap_dir.exists()  # a finished job removes its snapshots


def test_reshard_4_to_3_ranks_then_continue(tmp_path, fsdp_four_ranks):
    # 4 -> 2 ranks, trained on: the elastic test in test_scaleout.py that loses a node. 4 -> 1 with nothing
    # left to train, exactly the saved weights: test_archive.py's FSDP test (from the archive).
    # From the 4-rank step-8 checkpoint, train steps 9-16 on 3 ranks (uneven shards) and export the weights as one file.
    run_dir = copy_run(fsdp_four_ranks, tmp_path / "from-8")
    for step in (12, 16):
        shutil.rmtree(run_dir / "ckpt" / f"step-{step:08d}")
    export = tmp_path / "model.pt"
    proc = torchrun(SCRIPT, 3, run_dir, *SMALL, "--export", export)
    assert "resharded from 4 to 3 ranks" in proc.stdout and "resuming from step 8" in proc.stdout
    s = summary(run_dir)
    assert (s["steps"], s["resumed_from_step"], s["world_size"]) == (16, 8, 3)
    assert s["final_loss"] == pytest.approx(summary(fsdp_four_ranks)["final_loss"], abs=1e-3)  # same data and steps
    model = Transformer(ModelConfig(vocab=64, seq_len=16, dim=32, layers=2, heads=2))
    model.load_state_dict(torch.load(export, weights_only=True))  # strict: the keys of the unwrapped model
    assert param_digest(model.state_dict()) == s["param_digest"]


def test_a_checkpoint_unreadable_on_one_rank_is_moved_aside_never_deleted(tmp_path, fsdp_reference):
    # Rank 1's shard of step 16 is missing while the job chooses (a network filesystem's hiccup, say):
    # both ranks fall back together, and the folder is kept aside, whole, for a person to recover.
    run_dir = copy_run(fsdp_reference, tmp_path / "run")
    newest = run_dir / "ckpt" / "step-00000016"
    original = {p.name: p.read_bytes() for p in newest.iterdir()}
    (newest / "__1_0.distcp").rename(tmp_path / "hidden.distcp")
    proc = torchrun(SCRIPT, 2, run_dir, *SMALL, *DROPOUT)
    assert "checkpoint step-00000016 did not load on every rank: trying once more" in proc.stdout
    assert "checkpoint step-00000016 did not load on every rank: falling back" in proc.stdout
    assert "resuming from step 12" in proc.stdout
    for rank in (0, 1):
        assert [e["step"] for e in metrics(run_dir, rank, "load")] == [12]
        assert [Path(e["path"]).name for e in metrics(run_dir, rank, "fallback")] == ["step-00000016"]
    assert summary(run_dir)["param_digest"] == summary(fsdp_reference)["param_digest"]
    aside = list((run_dir / "ckpt").glob("step-00000016.unreadable-*"))
    assert len(aside) == 1 and "moved step-00000016 aside" in proc.stdout
    (tmp_path / "hidden.distcp").rename(aside[0] / "__1_0.distcp")  # the shard is back: nothing was lost
    assert {p.name: p.read_bytes() for p in aside[0].iterdir()} == original


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, fsdp_reference):
    run_dir = copy_run(fsdp_reference, tmp_path / "run")
    for _, path in checkpoints(run_dir / "ckpt"):
        (path / "__0_0.distcp").unlink()
    proc = torchrun(SCRIPT, 1, run_dir, *SMALL, *DROPOUT, max_restarts=0, check=False)  # one rank: started faster
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: no checkpoint in" in proc.stderr and "starting fresh" not in proc.stdout
    assert [s for s, _ in checkpoints(run_dir / "ckpt")] == [16, 12, 8]  # none loads: none is moved


def test_a_full_disk_during_an_async_save_is_one_line_and_exit_3(tmp_path, fsdp_reference):
    # Files the disk cannot grow past 20 KiB: the fsdp_reference's checkpoints load, step 20's shards do not
    # fit. DCP's writer threads each raised a traceback; now the job says it once per node, exit 3.
    run_dir = copy_run(fsdp_reference, tmp_path / "run")
    cmd, env = launch.torchrun(SCRIPT, 2, run_dir, [*SMALL, *DROPOUT, "--steps", 24, "--async-save"], max_restarts=3)
    limited = ["bash", "-c", 'trap "" XFSZ; ulimit -f 20; exec "$@"', "bash", *cmd]  # SIGXFSZ ignored: EFBIG
    code, output, hung = procs.finish(procs.start(limited, env, log=tmp_path / "run.log"), time.time() + 120)
    assert code == 3 and not hung and "Traceback" not in output, output[-3000:]
    assert output.count("error: saving step 20 failed (File too large): the checkpoints of earlier steps are kept") == 1
    assert [s for s, _ in checkpoints(run_dir / "ckpt")] == [16, 12, 8]  # step 20 never committed


def test_mfu_counts_the_tokens_of_each_rank(fsdp_reference):
    s = summary(fsdp_reference)
    flops_per_s_per_rank = 6 * s["params"] * s["tokens_per_s"] / s["world_size"]  # tokens_per_s: the global batch
    assert s["world_size"] == 2 and s["mfu"] == pytest.approx(flops_per_s_per_rank / (PEAK_TFLOPS * 1e12), rel=1e-9)
    for rank in (0, 1):
        assert all(e["mfu"] > 0 for e in metrics(fsdp_reference, rank, "step"))


def test_fsdp_and_ddp_losses_agree(fsdp_reference, ddp_reference):
    fsdp, ddp = summary(fsdp_reference), summary(ddp_reference)
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-4)  # other reduction order: not bitwise
    assert set(fsdp) == set(ddp)


def test_a_shard_only_rank_peaks_in_training_at_a_fraction_of_a_ddp_rank(tmp_path):
    # FSDP at 4 ranks, a 14.2M-parameter model (54 MiB of fp32 weights), 3 steps. On CPU glibc keeps the
    # block-sized buffers FSDP frees every step (all-gathered weights, unsharded gradients) in its heap,
    # and a shard-only rank's RSS then grows each step to 5.9x the full model above its baseline. With a
    # fixed mmap threshold those buffers go back to the OS when freed, and the RSS is what the rank
    # holds: its state (here 1.0x the full model) and about four unsharded blocks in flight. Measured:
    # 1.90x (docs/scripts.md: FSDP). A DDP rank holds at least 4x: weights, gradients and AdamW's two
    # moments, whole (test_compare.py checks its state against that count); it measured 8.36x.
    shape = ["--dim", 384, "--layers", 8, "--heads", 4, "--vocab", 64, "--seq-len", 16, "--batch-size", 8,
             "--steps", 3, "--save-every", 100, "--log-every", 100,
             "--snapshot-every", 0]  # the memory tier's pages, touched by each rank, would count in its RSS
    torchrun(SCRIPT, 4, tmp_path, *shape, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    _, peak = training_peaks(events(tmp_path))  # the ranks other than 0: shards only
    full = 4 * summary(tmp_path)["params"]
    assert peak <= 2.5 * full, (peak, full)  # under DDP's 4x by more than a full model


def clip_both_ways(rank, world, folder):
    """One rank of test_the_clipping_is_torchs_bit_for_bit: the FSDP2 gradients of 10 batches, each clipped
    by torch.nn.utils.clip_grad_norm_ (DTensor's all-reduce) and, from the same gradients, by fsdp/train.py's
    clip_grad_norm; writes whether every clipped gradient was bitwise equal."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from fsdp.train import clip_grad_norm
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    model = Transformer(ModelConfig(seq_len=16, dim=32, heads=2), seed=0)
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    equal = []
    for batch in range(10):  # a clipping that is not torch's differs in ~1 of 3 (a sum in another order)
        model.zero_grad()
        tokens = torch.randint(0, 64, (6, 17), generator=torch.Generator().manual_seed(world * batch + rank))
        model(tokens[:, :-1], tokens[:, 1:]).backward()  # a gradient norm of about 0.9
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torchs = [p.grad.to_local().clone() for p in model.parameters()]
        torch._foreach_copy_([p.grad.to_local() for p in model.parameters()], grads)
        clip_grad_norm(model, 0.5, torch.device("cpu"))
        equal.append(all(map(torch.equal, torchs, [p.grad.to_local() for p in model.parameters()])))
    (Path(folder) / f"equal-{rank}.json").write_text(json.dumps(equal))
    dist.destroy_process_group()


def test_the_clipping_is_torchs_bit_for_bit(tmp_path):
    # fsdp/train.py clips with its own all-reduce, not DTensor's inside torch; its weights stay those
    # torch's clip_grad_norm_ would give (measured: the same param_digest, 2 and 4 ranks, 16 steps).
    torch.multiprocessing.start_processes(clip_both_ways, args=(4, tmp_path), nprocs=4, start_method="fork")
    for rank in range(4):
        assert json.loads((tmp_path / f"equal-{rank}.json").read_text()) == [True] * 10


def test_export_to_a_folder_is_refused_before_training(tmp_path):
    err = refused(SCRIPT, "--run-dir", tmp_path / "run", "--export", tmp_path)
    assert f"--export {tmp_path} is a folder" in err, err
