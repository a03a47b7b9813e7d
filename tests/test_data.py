"""Unit tests of common/data.py and tiers/tokens.py: token files (llm.c's and nanoGPT's) round trip, memory-mapped; the
synthetic task and the byte path draw the rows they drew before token files existed; each bad file
gets one line, and a validation file that does not match the training data's is refused."""
import json

import numpy as np
import pytest
import torch

from common.data import StepData
from tiers.tokens import GPT2_MAGIC, LLAMA3_MAGIC, file_problems, open_source, pair_problems, write_tokens

FOX = "the quick brown fox jumps over the lazy dog. " * 40


def step_data(seed, global_batch, seq_len, vocab, path=None, flag="--data"):
    """StepData over the token file at `path` as a script opens it (tiers/tokens.py), or the synthetic task."""
    return StepData(seed, global_batch, seq_len, vocab, open_source(path, vocab, seq_len, flag) if path else None)


def data_problems(path, vocab, seq_len, flag="--data", train=None):
    """The problems of `path` as a script's check finds them, beside the --data file `train` for --val-data."""
    return file_problems(path, vocab, seq_len, flag) or (pair_problems(train, path) if train else [])


def llmc_file(path, ids, magic=GPT2_MAGIC, version=1, count=None, dtype="<u2"):
    """An llm.c token file written by hand, so that its header can be wrong."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())
    return path


# --------------------------------------------------------------------------- unchanged rows
@pytest.mark.parametrize("text, step, rows", [
    # computed with common/data.py as it was before token files (bytes read whole into an int64 tensor)
    (False, 0, [[48, 51, 54, 57, 60, 63, 2, 5, 8], [61, 62, 63, 0, 1, 2, 3, 4, 5]]),
    (False, 7, [[12, 16, 20, 24, 28, 32, 36, 40, 44], [38, 43, 48, 53, 58, 63, 4, 9, 14]]),
    (True, 0, [[104, 101, 32, 113, 117, 105, 99, 107, 32], [111, 103, 46, 32, 116, 104, 101, 32, 113]]),
    (True, 7, [[116, 104, 101, 32, 108, 97, 122, 121, 32], [114, 111, 119, 110, 32, 102, 111, 120, 32]]),
])
def test_synthetic_task_and_text_bytes_draw_the_same_rows_as_before(text, step, rows, tmp_path):
    path = None
    if text:
        path = tmp_path / "fox.txt"
        path.write_text(FOX)
    data = step_data(seed=3, global_batch=2, seq_len=8, vocab=256 if text else 64, path=path)
    got = data.global_rows(step)
    assert got.dtype == torch.int64 and got.tolist() == rows
    assert data.format.startswith("bytes of a text file" if text else "synthetic")


# --------------------------------------------------------------------------- token files
def write_gpt2(path, ids):
    write_tokens(path, ids)


def write_flat(path, ids):
    write_tokens(path, ids, header=False)


def write_llama3(path, ids):
    llmc_file(path, ids, magic=LLAMA3_MAGIC, version=7, dtype="<u4")


@pytest.mark.parametrize("name, write, ceiling, detected", [
    pytest.param("train.tok", write_gpt2, 2 ** 16,
                 "llm.c uint16 GPT-2 tokens (magic 20240520, version 1, 5,000 tokens)", id="llm.c uint16, any name"),
    pytest.param("train.bin", write_gpt2, 2 ** 16, "llm.c uint16 GPT-2 tokens", id="llm.c uint16, .bin"),
    pytest.param("train.bin", write_flat, 2 ** 16, "nanoGPT flat uint16 tokens (.bin, 5,000 tokens)", id="nanoGPT"),
    pytest.param("train.bin", write_llama3, 128_256,
                 "llm.c uint32 LLaMA-3 tokens (magic 20240801, version 7, 5,000 tokens)", id="llm.c uint32"),
])
def test_token_file_rows_are_windows_of_the_ids_written(name, write, ceiling, detected, tmp_path):
    ids = np.random.default_rng(0).permutation(ceiling)[:5000]  # distinct ids: the first one says where a row starts
    write(tmp_path / name, ids)
    assert data_problems(tmp_path / name, ceiling, 16) == []
    data = step_data(seed=3, global_batch=6, seq_len=16, vocab=ceiling, path=tmp_path / name)
    assert data.format.startswith(detected)
    for row in data.global_rows(4).tolist():
        start = int(np.flatnonzero(ids == row[0])[0])
        assert row == ids[start:start + 17].tolist()
    assert not torch.equal(data.global_rows(4), data.global_rows(5))


def test_both_uint16_formats_draw_the_same_rows(tmp_path):
    ids = np.arange(3000) % 1000
    write_tokens(tmp_path / "a.bin", ids)
    write_tokens(tmp_path / "b.bin", ids, header=False)
    a, b = (step_data(seed=1, global_batch=4, seq_len=8, vocab=1000, path=tmp_path / n) for n in ("a.bin", "b.bin"))
    assert torch.equal(a.global_rows(9), b.global_rows(9))


@pytest.mark.parametrize("name", ["train.bin", "fox.txt"])
def test_a_file_is_memory_mapped_not_held_as_a_tensor(name, tmp_path):
    if name == "fox.txt":
        (tmp_path / name).write_text(FOX)
    else:
        write_tokens(tmp_path / name, np.arange(4000))
    data = step_data(seed=0, global_batch=4, seq_len=8, vocab=4000, path=tmp_path / name)
    assert isinstance(data.tokens, np.memmap)
    assert not any(isinstance(value, torch.Tensor) for value in vars(data).values())


def test_write_tokens_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="65536"):
        write_tokens(tmp_path / "a.bin", [1, 65536])
    with pytest.raises(ValueError, match="65536"):
        write_tokens(tmp_path / "a.bin", [-1, 2])
    with pytest.raises(ValueError, match=r"\.bin suffix"):
        write_tokens(tmp_path / "flat.txt", [1, 2], header=False)  # it would be read back as bytes


# --------------------------------------------------------------------------- bad files
def header_cut_short(path):
    llmc_file(path, range(100))
    path.write_bytes(path.read_bytes()[:500])


def one_bad_id_in_a_big_file(path):
    # 1.3 MB: the check once read 16 windows of 64 KiB of it, and none of them held id 40,000
    ids = np.zeros(655_360, dtype=np.int64)
    ids[40_000] = 5000
    write_tokens(path, ids)


def flat_ids(path, dtype="<u2"):
    path.write_bytes(np.asarray([(7 * i) % 300 for i in range(2000)], dtype=dtype).tobytes())


def tokenizer_json(path):
    vocab = {f"t{i}": i for i in range(300)}
    path.write_text(json.dumps({"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": vocab}},
                               indent=2))


@pytest.mark.parametrize("make, name, vocab, message", [
    pytest.param(lambda p: p.write_bytes(b""), "train.bin", 4096, "is empty", id="empty"),
    pytest.param(lambda p: p.write_bytes(bytes(2001)), "train.bin", 4096, "odd count", id="odd byte count"),
    pytest.param(lambda p: llmc_file(p, range(100), magic=20240999), "train.bin", 4096, "its magic is 20240999",
                 id="wrong magic"),
    pytest.param(lambda p: llmc_file(p, range(100), version=2), "train.bin", 4096, "of version 2, which is not read",
                 id="bad version"),
    pytest.param(lambda p: llmc_file(p, range(100), count=120), "train.bin", 4096, "counting 120 uint16 GPT-2",
                 id="count mismatch"),
    pytest.param(header_cut_short, "train.bin", 4096, "fewer than its 1024-byte header", id="header cut short"),
    pytest.param(lambda p: write_tokens(p, [1, 2, 3, 4096] * 50), "train.bin", 4096, "holds token id 4096",
                 id="ids >= vocab"),
    pytest.param(one_bad_id_in_a_big_file, "train.bin", 4096, "holds token id 5000",
                 id="one id >= vocab in a big file"),
    pytest.param(tokenizer_json, "tokenizer.json", 4096, "is a JSON file (a tokenizer's vocabulary or a config)",
                 id="a tokenizer's JSON"),
    pytest.param(flat_ids, "train.tok", 4096, "neither a token file", id="flat uint16 ids not named *.bin"),
    pytest.param(lambda p: flat_ids(p, "<u4"), "train.u32", 4096, "neither a token file", id="flat uint32 ids"),
    pytest.param(lambda p: np.save(p, np.arange(2000)), "train.npy", 4096, "neither a token file", id="numpy .npy"),
    pytest.param(lambda p: p.write_text(FOX, encoding="utf-16"), "fox.txt", 4096, "neither a token file",
                 id="UTF-16 text"),
    pytest.param(lambda p: p.write_bytes(bytes(range(1, 32)) * 100), "ctl.txt", 4096, "control characters",
                 id="control characters"),
    pytest.param(lambda p: p.write_text(FOX), "fox.bin", 65536, "is named *.bin, as nanoGPT's flat uint16 tokens are, "
                 "but is plainly text", id="text named *.bin"),
    pytest.param(lambda p: write_tokens(p, range(10)), "train.bin", 4096, "10 tokens, fewer than one sequence",
                 id="too few tokens"),
    pytest.param(lambda p: p.write_text(FOX), "fox.txt", 64, "needs --vocab 256 or more, got 64", id="text, vocab 64"),
    pytest.param(lambda p: p.write_text("too short"), "fox.txt", 256, "9 bytes, fewer than one sequence",
                 id="text too short"),
    pytest.param(lambda p: p.mkdir(), "data", 4096, "is a folder", id="a directory"),
    pytest.param(lambda p: None, "nothing.bin", 4096, "no such file", id="a missing path"),
])
def test_a_bad_file_gets_one_line_naming_it(make, name, vocab, message, tmp_path):
    path = tmp_path / name
    make(path)
    problems = data_problems(path, vocab, seq_len=16)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"--data {path}") and message in problems[0] and "\n" not in problems[0]
    assert data_problems(path, vocab, 16, flag="--val-data")[0].startswith(f"--val-data {path}")
    with pytest.raises(ValueError) as error:
        step_data(seed=0, global_batch=4, seq_len=16, vocab=vocab, path=path)
    assert str(error.value) == problems[0]
    with pytest.raises(ValueError, match="^--val-data "):
        step_data(seed=0, global_batch=4, seq_len=16, vocab=vocab, path=path, flag="--val-data")


def test_plainly_text_in_any_script_is_read_as_bytes(tmp_path):
    # Multi-byte characters, one of them cut by the end of the sample the check reads
    path = tmp_path / "corpus.txt"
    path.write_text("x" + "naïve café, 日本語の文章。\n" * 4000, encoding="utf-8")
    assert data_problems(path, 256, 16) == []
    assert step_data(seed=0, global_batch=2, seq_len=16, vocab=256, path=path).format.startswith("bytes of a text file")


def test_ids_above_vocab_get_the_advice_of_their_flag(tmp_path):
    path = tmp_path / "ids.bin"
    one_bad_id_in_a_big_file(path)
    [data] = data_problems(path, 4096, 16)
    assert "holds token id 5000" in data and "pass --vocab 5001 or more" in data
    [val] = data_problems(path, 4096, 16, "--val-data")
    assert val.startswith(f"--val-data {path} holds token id 5000") and "--vocab 5001" not in val
    assert "a validation file from the training data's tokenizer" in val and "below --vocab 4096" in val
    (tmp_path / "fox.txt").write_text(FOX)
    [text] = data_problems(tmp_path / "fox.txt", 64, 16, "--val-data")
    assert "a validation file from the training data's tokenizer" in text and "--vocab 256" not in text


@pytest.mark.parametrize("name, write_val, message", [
    pytest.param("val.bin", write_flat, "holds nanoGPT flat uint16 tokens but --data", id="flat beside llm.c's"),
    pytest.param("val.bin", write_llama3, "holds llm.c uint32 LLaMA-3 tokens but --data", id="uint32 beside uint16"),
    pytest.param("val.txt", lambda p, ids: p.write_text(FOX), "holds bytes of a text file but --data",
                 id="text beside tokens"),
])
def test_a_validation_file_of_another_format_is_refused(name, write_val, message, tmp_path):
    train, val, same = tmp_path / "train.bin", tmp_path / name, tmp_path / "val-same.tok"
    ids = [(7 * i) % 300 for i in range(2000)]
    write_gpt2(train, ids)
    write_gpt2(same, ids[::-1])
    assert data_problems(same, 300, 16, "--val-data", train=train) == []
    write_val(val, ids)
    problems = data_problems(val, 300, 16, "--val-data", train=train)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(f"--val-data {val} {message} {train} holds llm.c uint16 GPT-2 tokens: give a ")
