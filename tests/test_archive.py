"""--archive s3://bucket/prefix (common/archive.py), against a real S3 server (harness/s3server.py: SeaweedFS's
`weed mini`, keys required, on loopback ports of its own). Each test has a prefix of its own in its bucket."""
import dataclasses
import json
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from conftest import DROPOUT, REPO, SMALL, metrics, refused, run_sh, summary, torchrun
from harness import launch
from harness.metrics import Watch
from harness.s3server import BUCKET, S3Server, client


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The standard variables pointing at the test server, for checks run in this process."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3.env


def marked(fs, prefix):
    """The archived steps under `prefix` (their marker exists), oldest first."""
    return sorted(int(Path(m).parent.name[5:]) for m in fs.glob(f"{BUCKET}/{prefix}/step-*/ARCHIVED.json"))


def test_a_lost_run_folder_resumes_from_the_archive_bitwise(tmp_path, s3, ddp_reference):
    # The uploader is SIGKILLed before step 8's marker: the job starts another, and its training never waits.
    # Then the run folder is lost, step 16's object is missing (its marker is whole: moved aside) and step
    # 12 lost its marker (as a kill before it leaves it: never loaded): the job resumes from the newest
    # whole step that is left, and ends with the weights of the job that never failed.
    archive = "s3://ckpt/lost-folder"
    flags = [*SMALL, *DROPOUT, "--keep", 1, "--archive", archive]
    run = tmp_path / "run"
    out = torchrun("ddp/train.py", 2, run, *flags, env={**s3.env, "FT_ARCHIVE_CRASH_AT_STEP": "8"})
    output = out.stdout + out.stderr
    assert "the archive's uploader dies before step 8's marker" in output
    assert "archive: the uploader died (exit -9); starting another" in output
    fs = s3.client()
    done = summary(run)
    assert done["param_digest"] == summary(ddp_reference)["param_digest"]
    assert 16 in done["archived"] and set(done["archived"]) <= set(marked(fs, "lost-folder")) <= {4, 8, 12, 16}
    assert [e["step"] for e in metrics(run, 0, "archive")] == done["archived"]
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == ["step-00000016.pt"]  # --keep 1, once archived

    shutil.rmtree(run)
    fs.rm_file(f"{BUCKET}/lost-folder/step-00000016/step-00000016.pt")
    fs.rm_file(f"{BUCKET}/lost-folder/step-00000012/ARCHIVED.json")
    whole = max(s for s in marked(fs, "lost-folder") if s < 12)
    out = torchrun("ddp/train.py", 2, run, *flags, env=s3.env)
    output = out.stdout + out.stderr
    assert "archive: moved step 16 aside" in output and f"fetched step {whole} from {archive}" in output
    assert fs.exists(f"{BUCKET}/lost-folder/step-00000012/step-00000012.pt")  # never deleted, never loaded
    assert len(fs.glob(f"{BUCKET}/lost-folder/unreadable/step-00000016-*/ARCHIVED.json")) == 1  # kept, aside
    assert [e["step"] for e in metrics(run, 0, "fetch")] == [whole] == [summary(run)["resumed_from_step"]]
    assert summary(run)["param_digest"] == summary(ddp_reference)["param_digest"]
    assert 16 in marked(fs, "lost-folder")  # trained again and archived again


def test_the_archive_is_refused_in_one_line_before_any_worker_starts(tmp_path, s3_env, monkeypatch):
    # Each problem is one line and exit 2, from the flags' check (run.sh's preflight and each worker).
    run = ["--run-dir", tmp_path / "run"]
    assert "--archive must be an s3://bucket/prefix URL" in refused("ddp/train.py", *run, "--archive", "gs://ckpt/x")
    assert "bucket nosuch does not exist" in refused("ddp/train.py", *run, "--archive", "s3://nosuch/x")
    # Another config's archive: its newest step's marker says the model was another shape.
    module = launch.load_script(REPO / "ddp/train.py")
    other = {**dataclasses.asdict(module.Config()), "dim": 48}
    client(s3_env).pipe_file(f"{BUCKET}/other-config/step-00000004/ARCHIVED.json",
                 json.dumps({"step": 4, "name": "step-00000004.pt", "files": {}, "config": other}).encode())
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


def test_a_store_down_for_a_while_holds_up_no_step_and_the_uploads_catch_up(tmp_path, s3):
    # The store stops once the first checkpoint is archived. Training goes on; each failed upload is one
    # line and an event, and keep-K deletes nothing unarchived; the store returns, and every checkpoint of
    # the job ends up archived.
    flags = ["--steps", 600, "--save-every", 30, "--dim", 32, "--layers", 2, "--heads", 2, "--seq-len", 16,
             "--batch-size", 12, "--log-every", 100, "--keep", 2, "--archive", "s3://ckpt/store-down"]
    cmd, env = launch.torchrun("ddp/train.py", 1, tmp_path, flags, env=s3.env)
    job, watch = launch.start(cmd, env, tmp_path / "job.log"), Watch(tmp_path)
    try:
        assert watch.first("archive", job), "the job ended before its first archive"
        s3.stop()
        failed = watch.first("archive_failed", job)  # logged at a save after the failed attempt
        assert failed, "no upload failed while the store was down"
    finally:
        s3.start()
    up_since = time.time()
    code, output, hung = launch.finish(job, time.time() + 240)
    assert not launch.problems(tmp_path, code, output), output[-3000:]
    steps = [e["time"] for e in metrics(tmp_path, 0, "step")]
    assert any(failed["time"] < t < up_since for t in steps), ("nothing trained meanwhile", failed, up_since, steps[-1])
    assert re.search(r"archive: step \d+: attempt 1 failed \(\w+", output), output[-3000:]
    assert marked(s3.client(), "store-down") == list(range(30, 601, 30)), output[-3000:]
    assert max(e["attempts"] for e in metrics(tmp_path, 0, "archive")) > 1
    assert len(list((tmp_path / "ckpt").glob("step-*.pt"))) == 2, output[-3000:]  # --keep 2, once all are archived


@pytest.mark.parametrize("script, nproc, then", [("fsdp/train.py", 2, 3), ("rpc/ps.py", 3, 3)])
def test_fsdp_and_rpc_resume_from_the_archive(tmp_path, s3, script, nproc, then):
    # FSDP's DCP folder (an async save) resumes at another world size, resharded; the parameter server's
    # file as ddp's does. Nothing is left to train: exactly the archived weights.
    flags = [*SMALL, "--archive", f"s3://ckpt/{script.split('/')[0]}",
             *(["--async-save"] if script.startswith("fsdp") else [])]
    run = tmp_path / "run"
    torchrun(script, nproc, run, *flags, env=s3.env)
    saved = summary(run)
    assert saved["archived"] == [4, 8, 12, 16] == marked(s3.client(), script.split("/")[0])
    shutil.rmtree(run)
    out = torchrun(script, then, run, *flags, env=s3.env)
    assert "fetched step 16" in out.stdout and "resuming from step 16" in out.stdout
    if script.startswith("fsdp"):
        assert "resharded from 2 to 3 ranks" in out.stdout
    assert summary(run)["param_digest"] == saved["param_digest"]
