"""Token files for common/data.py's StepData, read where --data names one (imported only then, in the
scripts' `if cfg.data or cfg.val_data:` blocks):

- llm.c's token file, recognised by its magic whatever its name: a header of 256 little-endian
  int32 (magic, version, token count, then zeros), then the tokens. Magic 20240520 version 1 holds
  uint16 ids (GPT-2's tokenizer), magic 20240801 version 7 uint32 ids (LLaMA-3's).
- nanoGPT's flat token file: little-endian uint16 ids and nothing else, named *.bin.
- a file that is plainly text (`text_problem`), trained on as bytes (vocab 256).
Anything else is refused: ids in a file of no known format would be trained on as bytes.
`write_tokens` writes the first two from any tokenizer's ids; `data_problems` checks --data and
--val-data before training starts (`file_problems` each, `pair_problems` that --val-data is in the
format of --data); `sources` opens them for StepData and the evaluation.
"""
import codecs
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER_BYTES = 256 * 4
GPT2_MAGIC, LLAMA3_MAGIC = 20240520, 20240801
# magic: (the version read here, numpy dtype of a token, name); as llm.c's dev/data/data_common.py writes them
LLMC_FORMATS = {GPT2_MAGIC: (1, "<u2", "uint16 GPT-2"), LLAMA3_MAGIC: (7, "<u4", "uint32 LLaMA-3")}
SCAN_CHUNK_BYTES = 8 * 2 ** 20  # ids checked against --vocab a memory map of this size at a time: bounded memory
TEXT_SAMPLE_BYTES = 64 * 1024  # the start of a file that must be plainly text for it to be read as bytes
PRINTABLE_SHARE = 0.95  # of that sample's characters, printable or whitespace


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

    @property
    def kind(self):
        """The format without this file's counts: files from one tokenizer, written the same way, share it."""
        return self.format.split(" (")[0]


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
                         f"write_tokens() in tiers/tokens.py")
    if Path(path).suffix.lower() == ".bin":
        if text_problem(path) is None:  # a token stream has ids below 256, with a NUL byte, in its first 64 KiB
            raise ValueError("is named *.bin, as nanoGPT's flat uint16 tokens are, but is plainly text: rename it "
                             "(*.txt) to train on its bytes, or give the tokens written from it by write_tokens()")
        if size % 2:
            raise ValueError(f"is read as nanoGPT's flat uint16 tokens (a .bin without llm.c's header), but its "
                             f"{size:,} bytes are an odd count: it is truncated or not uint16; write it again")
        return TokenFile(str(path), "<u2", 0, size // 2, f"nanoGPT flat uint16 tokens (.bin, {size // 2:,} tokens)")
    if Path(path).suffix.lower() == ".json":
        raise ValueError("is a JSON file (a tokenizer's vocabulary or a config), not a corpus: give the token file "
                         "written from the tokenizer's ids (write_tokens() in tiers/tokens.py), or a text file")
    problem = text_problem(path)
    if problem:
        raise ValueError(f"is neither a token file (llm.c's, with its header; nanoGPT's flat uint16, named *.bin) "
                         f"nor plainly text ({problem}): if it holds flat uint16 ids, name it *.bin; otherwise "
                         f"write the ids with write_tokens() in tiers/tokens.py")
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
                         f"(only {known}): write it again with write_tokens() in tiers/tokens.py")
    count, itemsize = int(ints[2]), np.dtype(dtype).itemsize
    if size != HEADER_BYTES + count * itemsize:
        raise ValueError(f"has an llm.c header counting {count:,} {kind} tokens ({HEADER_BYTES + count * itemsize:,} "
                         f"bytes in all), but the file has {size:,} bytes: it is truncated or was appended to; "
                         f"write it again")
    return TokenFile(str(path), dtype, HEADER_BYTES, count,
                     f"llm.c {kind} tokens (magic {magic}, version {version}, {count:,} tokens)")


def text_problem(path):
    """Why `path` is not plainly text, or None. Plainly text: its first TEXT_SAMPLE_BYTES are UTF-8 with no
    NUL byte, at least PRINTABLE_SHARE of their characters printable or whitespace (any script). Token ids
    without a header fail this at any dtype (a uint16 id below 256 has a NUL byte, others are not UTF-8),
    so that they are never trained on as bytes; the sample keeps the check's cost fixed."""
    with open(path, "rb") as f:
        head = f.read(TEXT_SAMPLE_BYTES)
    if b"\0" in head:
        return f"a NUL byte at byte {head.index(0):,}"
    try:  # not final: a character cut by the end of the sample is no error
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start:,}"
    control = sum(not (c.isprintable() or c.isspace()) for c in text)
    if control > (1 - PRINTABLE_SHARE) * len(text):
        return f"{control / len(text):.0%} control characters in its first {len(head):,} bytes"
    return None


def largest_id(source):
    """The largest id of a token file, every id read: an id >= --vocab anywhere would crash every attempt
    of the job when a step draws it. One vectorised pass, SCAN_CHUNK_BYTES mapped at a time (a 1 GB file:
    about 0.5 s from disk, 0.15 s from the page cache, measured on 2 cores). Cached per process for the
    file as it is: the preflight asks at each world size, a worker in its check and again in StepData."""
    stat = os.stat(source.path)
    return scanned_largest_id(source, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))


@functools.lru_cache(maxsize=8)
def scanned_largest_id(source, identity):
    """largest_id's pass; `identity` (the file's inode and times) is only the cache's key."""
    itemsize = np.dtype(source.dtype).itemsize
    chunk, largest = SCAN_CHUNK_BYTES // itemsize, 0
    for start in range(0, source.count, chunk):
        ids = np.memmap(source.path, dtype=source.dtype, mode="r", offset=source.offset + start * itemsize,
                        shape=(min(chunk, source.count - start),))
        largest = max(largest, int(ids.max()))
    return largest


def vocab_fix(flag, largest, vocab):
    """What to do about ids >= --vocab: the training data sets the vocabulary, so a validation file with
    such ids is from another tokenizer, and a larger --vocab would not fix it."""
    if flag == "--val-data":
        return f"give a validation file from the training data's tokenizer (its ids must be below --vocab {vocab})"
    return f"pass --vocab {largest + 1} or more (the tokenizer's vocabulary size), or the file of the model's tokenizer"


# --------------------------------------------------------------------------- checks
def file_problems(path, vocab, seq_len, flag="--data"):
    """What is wrong with `path` as training data for this --vocab and --seq-len: one line naming the
    file and what to do, or [] when nothing is. Reads the header, the start of a file read as text, and
    every id of a token file whose dtype can hold an id >= vocab (`largest_id`)."""
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
        fix = vocab_fix(flag, 255, vocab) if flag == "--val-data" else f"it needs --vocab 256 or more, got {vocab}"
        return [] if vocab >= 256 else [f"{flag} {path} is read as bytes (not an llm.c token file nor a *.bin): {fix}"]
    if vocab >= 2 ** (8 * np.dtype(source.dtype).itemsize):
        return []  # every id the file can hold fits
    largest = largest_id(source)
    if largest >= vocab:
        return [f"{flag} {path} holds token id {largest} (its largest), but --vocab is {vocab}: "
                f"{vocab_fix(flag, largest, vocab)}"]
    return []


def pair_problems(train, val):
    """--val-data `val` beside --data `train`, each fine on its own: one line when their formats differ
    (bytes and tokens, uint16 and uint32, llm.c's header and none), or []. A model trained on one
    tokenizer's ids and validated on another's gets a loss that means nothing, and ids below --vocab do
    not show it. Two flat files from two tokenizers look alike: that is not found here."""
    try:
        train_file, val_file = token_file(train), token_file(val)
    except (OSError, ValueError):
        return []  # file_problems says what is wrong with either
    if train_file.kind == val_file.kind:
        return []
    return [f"--val-data {val} holds {val_file.kind} but --data {train} holds {train_file.kind}: give a validation "
            f"file from the training data's tokenizer, written the same way"]


# --------------------------------------------------------------------------- the scripts' two calls
def data_problems(cfg):
    """The problems of --data and of --val-data (each file's, then --val-data's beside --data): lines, or []."""
    problems = file_problems(cfg.data, cfg.vocab, cfg.seq_len) if cfg.data else []
    if getattr(cfg, "val_data", ""):  # (rpc has no evaluation)
        problems += (file_problems(cfg.val_data, cfg.vocab, cfg.seq_len, "--val-data")
                     or (pair_problems(cfg.data, cfg.val_data) if cfg.data else []))
    return problems


def open_source(path, vocab, seq_len, flag="--data"):
    """The TokenFile of `path` for StepData, checked again (file_problems: ValueError with its line)."""
    problems = file_problems(path, vocab, seq_len, flag)  # `flag`: the file's, for the message
    if problems:
        raise ValueError(problems[0])
    return token_file(path)


def sources(cfg):
    """(training, evaluation): the TokenFiles of --data and of --val-data (default: --data; opened only
    for --eval-every), None where the synthetic task stands in."""
    train = open_source(cfg.data, cfg.vocab, cfg.seq_len) if cfg.data else None
    if getattr(cfg, "val_data", "") and getattr(cfg, "eval_every", 0):
        return train, open_source(cfg.val_data, cfg.vocab, cfg.seq_len, "--val-data")
    return train, train


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
