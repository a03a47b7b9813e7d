"""A team's own data and batch: a token file, gradient accumulation and evaluation, end to end on CPU."""
import subprocess
import sys

import pytest

from tiers.tokens import write_tokens
from conftest import DROPOUT, REPO, SMALL, metrics, summary, torchrun

TOKENS = [(7 * i + i // 13) % 300 for i in range(4000)]  # any tokenizer's ids, vocabulary 300


def test_token_file_grad_accum_and_eval_survive_a_crash_bitwise(tmp_path):
    # FSDP on nanoGPT's format (flat uint16; ddp reads llm.c's in tests/test_ddp.py). Each rank's 6 rows
    # are 2 micro-batches. The crashed job also evaluates every 5 steps, under dropout: an evaluation draws
    # no random number, so with it, and through a crash, the job ends with the weights of the one without.
    data = tmp_path / "train.bin"
    write_tokens(data, TOKENS, header=False)
    flags = [*SMALL, *DROPOUT, "--data", data, "--vocab", 300, "--grad-accum", 2]
    torchrun("fsdp/train.py", 2, tmp_path / "reference", *flags)
    proc = torchrun("fsdp/train.py", 2, tmp_path / "crashed", *flags, "--eval-every", 5, faults="crash-at-step=6",
                    restarts=1)
    # The survivor of the crash says so in one line; its traceback is in a file, not on the console.
    assert "rank 0: peer lost (" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" in (tmp_path / "crashed" / "traceback-rank0.txt").read_text()
    format_ = "nanoGPT flat uint16 tokens"
    assert f"data: {format_}" in proc.stdout and "2 micro-batches a step" in proc.stdout
    assert f"eval: every 5 steps, 4 batches of {format_}" in proc.stdout
    evals = metrics(tmp_path / "crashed", 0, "eval")
    assert [e["step"] for e in evals] == [5, 10, 15] and all(0 < e["loss"] < 6 for e in evals)
    assert summary(tmp_path / "crashed")["param_digest"] == summary(tmp_path / "reference")["param_digest"]


def test_four_micro_batches_follow_the_loss_curve_of_one(tmp_path):
    # The same 12 rows a step, in one batch or four: the same losses within float rounding (the
    # gradient is summed in another order, so the weights are not bitwise equal). DDP, without dropout,
    # whose masks would follow the micro-batches' shapes; the run of four also evaluates every 8 steps,
    # which changes no training loss.
    losses = {}
    for k, extra in ((1, []), (4, ["--eval-every", "8"])):
        proc = subprocess.run([sys.executable, "ddp/train.py", "--run-dir", str(tmp_path / f"k{k}"), *map(str, SMALL),
                               "--grad-accum", str(k), *extra], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[k] = [e["loss"] for e in metrics(tmp_path / f"k{k}", 0, "step")]
    assert len(losses[4]) == 16 and losses[4] == pytest.approx(losses[1], rel=1e-4)
    assert [e["step"] for e in metrics(tmp_path / "k4", 0, "eval")] == [8, 16]
