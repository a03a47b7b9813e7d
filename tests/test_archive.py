"""--archive s3://bucket/prefix (tiers/archive.py) and --light-every, against a real S3 server (conftest's s3:
SeaweedFS's `weed mini`, keys required, on loopback ports of its own). Each test archives under a prefix of
its own. rpc/ps.py's archive: tests/test_rpc.py's reference job."""
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from common.checkpoint import param_digest
from common.model import ModelConfig, Transformer
from common.config import parse_config
from conftest import DROPOUT, FOUR_RANKS_ARCHIVE, REPO, SMALL, metrics, refused, run_sh, summary, torchrun
from harness import launch, procs
from harness.metrics import Watch
from harness.s3server import BUCKET, client
from tiers import archive
from tiers.archive import ASIDE
from tiers.snapshot import default_dir


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The standard variables pointing at the test server, for checks run in this process."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3.env


def light_digest(path):
    """The digest of a light checkpoint's weights, loaded by plain torch.load into the model (strict keys)."""
    model = Transformer(ModelConfig(vocab=64, seq_len=16, dim=32, layers=2, heads=2))  # SMALL's shape
    model.load_state_dict(torch.load(path, weights_only=True))
    return param_digest(model.state_dict())


def marked(fs, prefix):
    """The archived steps under `prefix` (their marker exists), oldest first."""
    return sorted(int(Path(m).parent.name[5:]) for m in fs.glob(f"{BUCKET}/{prefix}/step-*/ARCHIVED.json"))


# One job for the tests below: 1 rank, 400 steps, a save every 25; its uploader SIGKILLs itself before
# step 50's marker; the store goes down (SIGKILL) once a checkpoint is archived and comes back once an
# upload has failed. Training is never interrupted (no restart), so its digest is the reference.
FLAGS = ["--steps", 400, "--save-every", 25, "--dim", 32, "--layers", 2, "--heads", 2, "--seq-len", 16,
         "--batch-size", 12, "--log-every", 1000, *DROPOUT, "--keep", 2, "--archive", "s3://ckpt/long",
         "--light-every", 100, "--light-keep", 2]
SAVES = list(range(25, 401, 25))


@pytest.fixture(scope="module")
def long_job(tmp_path_factory, s3):
    run = tmp_path_factory.mktemp("archive-long") / "run"
    cmd, env = launch.torchrun("ddp/train.py", 1, run, FLAGS, env={**s3.env, "FT_ARCHIVE_CRASH_AT_STEP": "50"})
    job, watch = procs.start(cmd, env, run.parent / "job.log"), Watch(run)
    try:
        assert watch.first("archive", job), "the job ended before its first archive"
        down_since = time.time()
        s3.stop(crash=True)
        failed = watch.first("archive_failed", job)  # logged at a save after the failed attempt
        assert failed, "no upload failed while the store was down"
    finally:
        s3.start()
    up_since = time.time()
    code, output, hung = procs.finish(job, time.time() + 240)
    assert not launch.problems(run, code, output), output[-3000:]
    return run, output, failed, (down_since, up_since)


def test_a_dead_uploader_and_a_store_down_hold_up_no_step_and_lose_no_checkpoint(long_job, s3):
    # The uploader is started again and sends its step again; each failed upload is a line and an event,
    # training goes on meanwhile; keep-K deletes nothing unarchived; once the store is back, every
    # checkpoint of the job is archived, and the job's end waits for the last one.
    run, output, failed, (down_since, up_since) = long_job
    assert "the archive's uploader dies before step 50's marker" in output
    assert "archive: the uploader died (exit -9); starting another" in output
    assert re.search(r"archive: step \d+: attempt 1 failed \(\w+", output), output[-3000:]
    # While the store was down, a save, then training after it. (Not "steps after the failed attempt":
    # the restarted uploader imports s3fs before its first attempt, and 400 small steps can be over by
    # then; its failure is then logged in the job's final wait.)
    saved = next((e["time"] for e in metrics(run, 0, "save") if down_since < e["time"] < up_since), None)
    assert saved, ("no save while the store was down", failed)
    assert any(saved < e["time"] < up_since for e in metrics(run, 0, "step")), ("nothing trained meanwhile", failed)
    assert marked(s3.client(), "long") == SAVES == [a["step"] for a in summary(run)["archived"]]
    assert {e["step"] for e in metrics(run, 0, "archive_failed")} <= set(SAVES)  # each failed one archived since
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == ["step-00000375.pt", "step-00000400.pt"]
    # The light series: plain state dicts of the model, --light-keep of them.
    assert sorted(p.name for p in (run / "light").iterdir()) == ["step-00000300.pt", "step-00000400.pt"]
    assert light_digest(run / "light" / "step-00000400.pt") == summary(run)["param_digest"]


def test_a_lost_run_folder_resumes_from_the_newest_whole_archived_step_bitwise(long_job, s3, tmp_path):
    # The run folder is lost but for its light checkpoints (never resumed from); in the store, step 400's
    # object is missing (its marker whole: moved aside), step 375 lost its marker (as a kill before it
    # leaves it: never loaded) and an upload of a large file was left unfinished (the next uploader
    # aborts it). The job resumes from step 350 and ends with the same weights.
    run, _, _, _ = long_job
    reference = summary(run)["param_digest"]
    shutil.copytree(run / "light", tmp_path / "light")
    shutil.rmtree(run)
    shutil.copytree(tmp_path / "light", run / "light")
    fs = s3.client()
    fs.rm_file(f"{BUCKET}/long/step-00000400/step-00000400.pt")
    fs.rm_file(f"{BUCKET}/long/step-00000375/ARCHIVED.json")
    fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key="long/step-00000350/__0_0.distcp")
    out = torchrun("ddp/train.py", 1, run, *FLAGS, env=s3.env)
    output = out.stdout + out.stderr
    assert "archive: moved step 400 aside" in output and "fetched step 350 from s3://ckpt/long" in output
    assert len(fs.glob(f"{BUCKET}/long/unreadable/step-00000400-*/ARCHIVED.json")) == 1  # kept, aside
    assert fs.exists(f"{BUCKET}/long/step-00000375/step-00000375.pt")  # never deleted
    assert [e["step"] for e in metrics(run, 0, "fetch")] == [350] == [summary(run)["resumed_from_step"]]
    assert "archive: aborted an unfinished upload of long/step-00000350/__0_0.distcp" in output
    assert not fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="long").get("Uploads")
    assert summary(run)["param_digest"] == reference
    assert 375 in marked(fs, "long") and 400 in marked(fs, "long")  # trained again, archived again


def plant_marker(fs, prefix, step, name, files, objects=(), pad=0, config=None):
    """A marker (ARCHIVED.json) for `step` under `prefix`, written as whoever controls the bucket would:
    `files` {name: bytes}, each listed with its real size and sha256 unless given as (bytes, size)."""
    listed = {}
    for fname, data in files.items():
        data, size = data if isinstance(data, tuple) else (data, len(data))
        listed[fname] = {"bytes": size, "sha256": hashlib.sha256(data).hexdigest()}
    for key, data in objects:
        fs.pipe_file(f"{BUCKET}/{prefix}/step-{step:08d}/{key}", data)
    marker = {"step": step, "name": name, "files": listed, "config": config or {}, "pad": "x" * pad}
    fs.pipe_file(f"{BUCKET}/{prefix}/step-{step:08d}/ARCHIVED.json", json.dumps(marker).encode())


def test_a_marker_from_the_bucket_writes_nothing_outside_the_fetch_and_a_damaged_archive_is_a_stop(long_job, s3,
                                                                                                  tmp_path):
    # Over a whole step 350, seven markers that whoever can write the bucket could leave, newest first: a
    # DCP folder without its .metadata (fetched, it would count as no checkpoint: a fresh start), a file
    # named by an absolute path (its object there, its sha256 right: the old fetch wrote it), a ../ file
    # name, a ../ step name, another step's name, a marker of 2 MiB, an object larger than its marker says. Each is
    # one line and skipped; step 350 is fetched and the job ends as the untouched one; then the seven are
    # moved aside. Nothing is written outside the run folder.
    run, _, _, _ = long_job
    reference, fs = summary(run)["param_digest"], s3.client()
    for obj in fs.find(f"{BUCKET}/long/step-00000350"):
        fs.copy(obj, obj.replace("/long/", "/planted/"))
    pt, outside = fs.cat_file(f"{BUCKET}/planted/step-00000350/step-00000350.pt"), tmp_path / "outside"
    outside.mkdir()
    evil = str(outside / "escape-abs.txt")
    config = json.loads(fs.cat_file(f"{BUCKET}/planted/step-00000350/ARCHIVED.json"))["config"]
    plant = functools.partial(plant_marker, config=config)
    plant(fs, "planted", 357, "step-00000357", {"a": b"a"}, objects=[("a", b"a")])  # no .metadata: not committed
    plant(fs, "planted", 356, "step-00000356.pt", {"step-00000356.pt": pt, evil: b"the bucket's bytes"},
          objects=[("step-00000356.pt", pt), (evil, b"the bucket's bytes")])
    plant(fs, "planted", 355, "step-00000355.pt", {"step-00000355.pt": pt, "../escape-rel.txt": b"x"},
          objects=[("step-00000355.pt", pt)])
    plant(fs, "planted", 354, "../../escape-name.pt", {"../../escape-name.pt": pt})
    plant(fs, "planted", 353, "step-00000350.pt", {"step-00000350.pt": pt}, objects=[("step-00000350.pt", pt)])
    plant(fs, "planted", 352, "step-00000352.pt", {"step-00000352.pt": pt}, objects=[("step-00000352.pt", pt)],
          pad=2 << 20)
    plant(fs, "planted", 351, "step-00000351.pt", {"step-00000351.pt": (pt[:10], 10)},
          objects=[("step-00000351.pt", pt)])
    job = tmp_path / "job" / "run"
    out = torchrun("ddp/train.py", 1, job, *FLAGS[:-6], "--archive", "s3://ckpt/planted", env=s3.env)
    output = out.stdout + out.stderr
    why = {357: "lists no .metadata", 356: "not a plain file name", 355: "not a plain file name", 354: "not step 354's own checkpoint",
           353: "not step 353's own checkpoint", 352: "more than a marker's", 351: "its marker says 10"}
    for step, words in why.items():
        line = next(x for x in output.splitlines() if x.startswith(f"archive: step {step} fails its check"))
        assert words in line, line
        assert f"archive: moved step {step} aside" in output
    assert "fetched step 350 from s3://ckpt/planted" in output and summary(job)["resumed_from_step"] == 350
    assert summary(job)["param_digest"] == reference
    assert not list(outside.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["job", "outside"]
    assert sorted(p.name for p in job.parent.iterdir()) == ["run"]
    assert not [p for p in job.rglob("*escape*")] and not list(Path("/").glob("escape*"))
    # M5: an archive whose every step fails its check stops the job in one line, exit 2; nothing moved.
    for obj in fs.find(f"{BUCKET}/long/step-00000350"):
        fs.copy(obj, obj.replace("/long/", "/allbad/"))
    fs.pipe_file(f"{BUCKET}/allbad/step-00000350/step-00000350.pt", pt[:-1] + bytes([pt[-1] ^ 1]))
    out = torchrun("ddp/train.py", 1, tmp_path / "bad", *FLAGS[:-6], "--archive", "s3://ckpt/allbad", env=s3.env,
                   check=False)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [x for x in out.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "no archived step of s3://ckpt/allbad passes its check" in errors[0], out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert marked(fs, "allbad") == [350] and not fs.exists(f"{BUCKET}/allbad/{ASIDE}")
    assert not list((tmp_path / "bad" / "ckpt").glob("step-*"))


def test_the_archive_is_refused_in_one_line_before_any_worker_starts(tmp_path, s3_env, monkeypatch):
    # Each problem is one line and exit 2, from the flags' check (run.sh's preflight and each worker).
    run = ["--run-dir", tmp_path / "run"]
    assert "--archive must be an s3://bucket/prefix URL" in refused("ddp/train.py", *run, "--archive", "gs://ckpt/x")
    assert "bucket nosuch does not exist" in refused("ddp/train.py", *run, "--archive", "s3://nosuch/x")
    # Another config's archive: its newest step's marker says the model was another shape.
    module = launch.load_script(REPO / "ddp/train.py")
    other = {**dataclasses.asdict(module.Config()), "dim": 48}
    client(s3_env).pipe_file(f"{BUCKET}/other-config/step-00000004/ARCHIVED.json",
                 json.dumps({"step": 4, "name": "step-00000004.pt", "config": other,
                                 "files": {"step-00000004.pt": {"bytes": 1, "sha256": "0" * 64}}}).encode())
    line = refused("ddp/train.py", *run, "--archive", "s3://ckpt/other-config")
    assert "s3://ckpt/other-config/step-00000004: checkpoint was made with dim=48 (this run: 64)" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert "refused the credentials for bucket ckpt" in refused("fsdp/train.py", *run, "--archive", "s3://ckpt/x")
    assert "not-the-secret" not in refused("fsdp/train.py", *run, "--archive", "s3://ckpt/x")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        assert "did not answer" in refused("fsdp/train.py", *run, "--archive", "s3://ckpt/x")
    # Through run.sh: the same line, before any worker; nothing made in the run folder.
    done = run_sh("ddp", 2, *run, "--archive", "s3://nosuch/x", env=s3_env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "bucket nosuch does not exist" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_job_refused_over_a_damaged_archive_leaves_nothing_in_dev_shm(s3, tmp_path):
    # N6: the archive's only step is damaged (its object shorter than its marker says), so the job stops at
    # its resume (exit 2, "never a fresh start over the archive"), after the memory tier has opened: the
    # tier's folder is made by its first snapshot, so none is left behind.
    module = launch.load_script(REPO / "ddp/train.py")
    config = dataclasses.asdict(parse_config(module.Config, module.check, [*map(str, SMALL)]))
    plant_marker(s3.client(), "damaged", 4, "step-00000004.pt", {"step-00000004.pt": (b"x" * 10, 1000)},
                 objects=[("step-00000004.pt", b"x" * 10)], config=config)
    run = tmp_path / "run"
    out = torchrun("ddp/train.py", 1, run, *SMALL, "--archive", "s3://ckpt/damaged", env=s3.env, check=False)
    assert out.returncode == 2 and "never a fresh start over the archive" in out.stderr, out.stderr[-2000:]
    assert default_dir(run).name.endswith((run / "ckpt" / "run-id").read_text()[:16])  # the run's own folder
    assert not default_dir(run).exists()


def test_an_upload_to_a_store_that_stops_answering_is_cut_off_in_one_line_and_retried(s3, s3_env, tmp_path,
                                                                                      monkeypatch, capsys):
    # N4: the store stops (SIGSTOP) as the uploader starts to send a file. Its request then waits for the
    # store's "100 Continue", which no read timeout bounds; the file's deadline cuts it off in one line, the
    # uploader tries again, and the step is archived whole once the store answers again, its marker last.
    monkeypatch.setattr(archive, "STALL_S", 2)
    monkeypatch.setitem(archive.CLIENT_CONFIG, "read_timeout", 2)  # the retries' requests while it is stopped
    path = tmp_path / "step-00000007.pt"
    path.write_bytes(os.urandom(4 << 20))
    fs, stopped = archive.filesystem(), []
    put = fs.put_file

    def stop_the_store_first(*args, **kwargs):
        if not stopped:
            os.kill(s3.proc.pid, signal.SIGSTOP)
            stopped.append(True)
        return put(*args, **kwargs)

    fs.put_file, results = stop_the_store_first, io.StringIO()
    again = threading.Timer(8, os.kill, (s3.proc.pid, signal.SIGCONT))
    again.start()
    try:
        done = archive.attempt(fs, "s3://ckpt/stalled", {"step": 7, "path": str(path), "config": {}}, results)
    finally:
        again.cancel()
        os.kill(s3.proc.pid, signal.SIGCONT)
    assert results.getvalue(), f"the upload waited for the store in silence ({done})"
    first = json.loads(results.getvalue().splitlines()[0])
    assert re.fullmatch(r"TimeoutError: step-00000007.pt not stored in \d s: the store stopped answering, or is "
                        r"slower than 8 MiB/s", first["failed"]), first
    err = capsys.readouterr().err
    assert f"archive: step 7: attempt 1 failed ({first['failed']}); again in 1 s\n" in err, err
    assert done["attempts"] >= 2 and done["bytes"] == 4 << 20
    assert marked(s3.client(), "stalled") == [7]
    assert s3.client().cat_file(f"{BUCKET}/stalled/step-00000007/step-00000007.pt") == path.read_bytes()


def test_fsdp_resumes_from_the_archive_at_another_world_size(tmp_path, fsdp_four_ranks, s3):
    # The 4-rank FSDP job's DCP folders (async saves) resume at 1 rank from the archive, resharded:
    # nothing is left to train, exactly the archived weights. Its light series gathers the shards on rank 0.
    saved = summary(fsdp_four_ranks)
    assert [a["step"] for a in saved["archived"]] == [4, 8, 12, 16] == marked(s3.client(), FOUR_RANKS_ARCHIVE)
    assert [e["step"] for e in metrics(fsdp_four_ranks, 0, "light")] == [8, 16]
    assert light_digest(fsdp_four_ranks / "light" / "step-00000016.pt") == saved["param_digest"]
    run = tmp_path / "run"
    out = torchrun("fsdp/train.py", 1, run, *SMALL, "--archive", f"s3://ckpt/{FOUR_RANKS_ARCHIVE}", env=s3.env)
    assert "fetched step 16" in out.stdout and "resharded from 4 to 1 ranks" in out.stdout
    assert summary(run)["param_digest"] == saved["param_digest"]


def test_the_summary_lists_the_archives_in_the_uploaders_order(capsys):
    """close() waits for the last results; two that come at once (the uploader finishing as its input
    closes) keep their order (they were swapped once: [4, 8, 16, 12] in CI)."""
    results = [{"step": s, "bytes": 1, "seconds": 0.1, "attempts": 1, "already": False} for s in (12, 16)]

    class Uploader:  # stands in for the uploader process: both results arrive as its input closes
        returncode = None

        def __init__(self, queue):
            self.stdin = self
            self.queue = queue

        def close(self):
            for result in results:
                self.queue.put(result)

        poll = wait = kill = lambda self: None

    class Monitor:
        events = []

        def event(self, kind, **fields):
            self.events.append((kind, fields))

    up = archive.Archive.__new__(archive.Archive)
    up.url, up.held, up.done, up.archived, up.blocked_s = "s3://b/p", {12: "a", 16: "b"}, [], [], 0.0
    up.results = archive.queue.SimpleQueue()
    up.proc = Uploader(up.results)
    up.close(wait_s=5, monitor=Monitor())
    assert [a["step"] for a in up.archived] == [12, 16] and not up.held
    assert Monitor.events[-1] == ("archive_end", {"archived": [12, 16], "not_archived": [], "blocked_s": 0.0})
    assert capsys.readouterr().out.splitlines() == ["archived step 12 (0.0 MiB in 0.10 s, 1 attempt)",
                                                    "archived step 16 (0.0 MiB in 0.10 s, 1 attempt)"]
