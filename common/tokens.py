"""Token files for common/data.py's StepData, read where --data names one (imported only then):

- llm.c's token file, recognised by its magic whatever its name: a header of 256 little-endian
  int32 (magic, version, token count, then zeros), then the tokens. Magic 20240520 version 1 holds
  uint16 ids (GPT-2's tokenizer), magic 20240801 version 7 uint32 ids (LLaMA-3's).
- nanoGPT's flat token file: little-endian uint16 ids and nothing else, named *.bin.
- anything else: a text file, trained on as bytes (vocab 256).
`write_tokens` writes the first two from any tokenizer's ids; `file_problems` checks a file before
training starts.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER_BYTES = 256 * 4
GPT2_MAGIC, LLAMA3_MAGIC = 20240520, 20240801
# magic: (the version read here, numpy dtype of a token, name); as llm.c's dev/data/data_common.py writes them
LLMC_FORMATS = {GPT2_MAGIC: (1, "<u2", "uint16 GPT-2"), LLAMA3_MAGIC: (7, "<u4", "uint32 LLaMA-3")}
SAMPLE_WINDOW_BYTES = 64 * 1024
SAMPLE_WINDOWS = 16  # 1 MiB of ids checked against --vocab, whatever the file's size


# --------------------------------------------------------------------------- file formats
@dataclass(frozen=True)
class TokenFile:
    """Where a file's tokens are: `count` tokens of numpy `dtype` from byte `offset` on."""
    path: str
    dtype: str
    offset: int
    count: int
    format: str  # what was detected, for the log

    def tokens(self):
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))


def token_file(path):
    """How `path` holds its tokens. Raises ValueError with what is wrong with the file, worded to follow
    the file's name, or OSError when it cannot be read."""
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError("is empty: write the tokens (or text) into it first")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    ints = np.frombuffer(head[:len(head) // 4 * 4], dtype="<i4")
    if len(ints) and int(ints[0]) in LLMC_FORMATS:
        return llmc_token_file(path, size, ints)
    count = int(ints[2]) if len(ints) == 256 else 0
    if count > 0 and not ints[3:].any() and size - HEADER_BYTES in (2 * count, 4 * count):
        # The shape of llm.c's header, counting this file's tokens exactly: read as flat ids, it would
        # train on its header. A magic from another tool or version, or a corrupted one.
        raise ValueError(f"has llm.c's header (256 int32 counting its {count:,} tokens) but its magic is "
                         f"{ints[0]}, not {' or '.join(map(str, LLMC_FORMATS))}: write it again with "
                         f"write_tokens() in common/tokens.py")
    if Path(path).suffix.lower() == ".bin":
        if size % 2:
            raise ValueError(f"is read as nanoGPT's flat uint16 tokens (a .bin without llm.c's header), but its "
                             f"{size:,} bytes are an odd count: it is truncated or not uint16; write it again")
        return TokenFile(str(path), "<u2", 0, size // 2, f"nanoGPT flat uint16 tokens (.bin, {size // 2:,} tokens)")
    return TokenFile(str(path), "u1", 0, size, f"bytes of a text file (vocab 256, {size:,} bytes)")


def llmc_token_file(path, size, ints):
    magic = int(ints[0])
    version, dtype, kind = LLMC_FORMATS[magic]
    if len(ints) < 256:
        raise ValueError(f"starts with llm.c's magic {magic} but has {size:,} bytes, fewer than its "
                         f"{HEADER_BYTES}-byte header: it is truncated; write it again")
    if ints[1] != version:
        known = ", ".join(f"{v} with magic {m} ({k})" for m, (v, _, k) in LLMC_FORMATS.items())
        raise ValueError(f"is an llm.c token file (magic {magic}) of version {ints[1]}, which is not read here "
                         f"(only {known}): write it again with write_tokens() in common/tokens.py")
    count, itemsize = int(ints[2]), np.dtype(dtype).itemsize
    if size != HEADER_BYTES + count * itemsize:
        raise ValueError(f"has an llm.c header counting {count:,} {kind} tokens ({HEADER_BYTES + count * itemsize:,} "
                         f"bytes in all), but the file has {size:,} bytes: it is truncated or was appended to; "
                         f"write it again")
    return TokenFile(str(path), dtype, HEADER_BYTES, count,
                     f"llm.c {kind} tokens (magic {magic}, version {version}, {count:,} tokens)")


def largest_id(tokens):
    """The largest id in SAMPLE_WINDOWS evenly spaced windows of a memory-mapped token array, the
    first and the last among them: a sample, so that a check costs the same for any file size."""
    window = SAMPLE_WINDOW_BYTES // tokens.itemsize
    if len(tokens) <= window * SAMPLE_WINDOWS:
        return int(tokens.max())
    starts = np.linspace(0, len(tokens) - window, SAMPLE_WINDOWS).astype(np.int64)
    return max(int(tokens[s:s + window].max()) for s in starts)


# --------------------------------------------------------------------------- checks
def file_problems(path, vocab, seq_len, flag="--data"):
    """What is wrong with `path` as training data for this --vocab and --seq-len: one line naming the
    file and what to do, or [] when nothing is. Reads the header and, for a token file, the largest id
    of a sample (`largest_id`), never the whole file: an id >= vocab outside the sample is not found here."""
    if not os.path.exists(path):
        return [f"{flag} {path}: no such file"]
    if os.path.isdir(path):
        return [f"{flag} {path} is a folder: give one token file (llm.c's, or nanoGPT's *.bin) or a text file"]
    try:
        source = token_file(path)
    except OSError as e:
        return [f"{flag} {path}: cannot read it ({e.strerror or e}): check the file's permissions"]
    except ValueError as e:
        return [f"{flag} {path} {e}"]
    unit = "bytes" if source.dtype == "u1" else "tokens"
    if source.count < seq_len + 2:
        return [f"{flag} {path} has {source.count:,} {unit}, fewer than one sequence (--seq-len {seq_len} + 2)"]
    if source.dtype == "u1":
        return [] if vocab >= 256 else [f"{flag} {path} is read as bytes (not an llm.c token file nor a *.bin): it "
                                        f"needs --vocab 256 or more, got {vocab}"]
    if vocab >= 2 ** (8 * np.dtype(source.dtype).itemsize):
        return []  # every id the file can hold fits
    largest = largest_id(source.tokens())
    if largest >= vocab:
        return [f"{flag} {path} holds token id {largest} (the largest in a sample of the file), but --vocab is "
                f"{vocab}: pass --vocab {largest + 1} or more (the tokenizer's vocabulary size)"]
    return []


# --------------------------------------------------------------------------- writing
def write_tokens(path, ids, header=True):
    """Write token ids from any tokenizer as uint16: llm.c's file (its header, magic 20240520 version 1),
    or with header=False nanoGPT's flat file, which must be named *.bin to be recognised."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= 2 ** 16):
        raise ValueError(f"token ids must be in [0, 65536) to fit uint16, got {ids.min()} .. {ids.max()}")
    if not header and Path(path).suffix.lower() != ".bin":
        raise ValueError(f"{path}: a flat token file is recognised by its .bin suffix; name it *.bin")
    with open(path, "wb") as f:
        if header:
            f.write(np.array([GPT2_MAGIC, LLMC_FORMATS[GPT2_MAGIC][0], ids.size] + [0] * 253, dtype="<i4").tobytes())
        f.write(ids.astype("<u2").tobytes())
