"""rpc/ps.py: the parameter server resumes bit-exactly after crashes, drops a lost trainer without
stalling, shuts down cleanly, and updates under its lock whatever order the gradients arrive in."""
import threading
import time

import pytest
import torch

from common.checkpoint import param_digest
from common.config import load_script, parse_config
from common.model import Transformer, model_config
from conftest import REPO, SMALL, metrics, summary, torchrun

ps = load_script(REPO / "rpc" / "ps.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 3-process job (a server, 2 trainers) that the crash tests compare against."""
    run_dir = tmp_path_factory.mktemp("rpc-reference")
    torchrun("rpc/ps.py", 3, run_dir, *SMALL)
    return summary(run_dir)


# ----------------------------------------------------------------------------- crash and resume
def test_uninterrupted_run_writes_the_summary(reference):
    assert reference["strategy"] == "rpc" and reference["steps"] == 16 and reference["world_size"] == 3
    assert reference["resumed_from_step"] is None and reference["restarts"] == 0 and reference["trainers_lost"] == 0


@pytest.mark.parametrize("flags, crash, resumed_from", [
    (["--crash-at-step", 6], "trainer 2 after step 6", 4),  # the last rank, a trainer
    (["--crash-at-step", 6, "--crash-rank", 0], "server after step 6", 4),  # after the update, before its save
    (["--crash-in-save", 8], "server while saving step 8", 4),  # step 8's checkpoint is never committed
], ids=["trainer", "server", "server-mid-save"])
def test_crash_resumes_to_the_same_weights(tmp_path, reference, flags, crash, resumed_from):
    proc = torchrun("rpc/ps.py", 3, tmp_path, *SMALL, *flags)
    assert f"injected crash: {crash}" in proc.stderr
    assert f"resuming from step {resumed_from}" in proc.stdout
    s = summary(tmp_path)
    assert s["restarts"] == 1 and s["resumed_from_step"] == resumed_from
    assert s["steps"] == 16 and s["param_digest"] == reference["param_digest"]
    assert [e["step"] for e in metrics(tmp_path, 0, "load")] == [resumed_from]


# ----------------------------------------------------------------------------- a lost trainer
def test_lost_trainer_is_dropped_and_the_job_finishes(tmp_path):
    straggler_s = 4
    t0 = time.monotonic()
    torchrun("rpc/ps.py", 4, tmp_path, *SMALL, "--drop-trainer-at-step", "6", "--straggler-timeout", straggler_s,
             timeout=180)
    elapsed = time.monotonic() - t0
    s = summary(tmp_path)
    assert s["steps"] == 16 and s["trainers_lost"] == 1 and s["restarts"] == 0

    lost = metrics(tmp_path, 0, "trainer_lost")
    assert [(e["trainer"], e["step"]) for e in lost] == [(3, 6)]
    steps = metrics(tmp_path, 0, "step")
    assert [e["trainers"] for e in steps] == [3] * 6 + [2] * 10  # update 7 onwards without trainer 3
    waited = steps[6]["step_s"]  # the update that waited for trainer 3
    assert straggler_s <= waited < straggler_s + 10
    # Only that one update waited; the job took start-up, that wait, and normal steps.
    normal = s["median_step_s"]
    assert all(e["step_s"] < straggler_s for i, e in enumerate(steps) if i not in (0, 6))
    assert elapsed < 90 + straggler_s + 16 * normal * 4, (elapsed, normal)
    # Every process, the one that left included, got through rpc.shutdown.
    for rank in range(4):
        [shutdown] = metrics(tmp_path, rank, "shutdown")
        assert shutdown["shutdown_s"] < 30


@pytest.mark.parametrize("world, flags, message", [
    ("1", [], "needs at least 2 processes (rank 0 is the server, the others are trainers), got 1"),
    ("3", ["--drop-trainer-at-step", "4", "--crash-rank", "0"], "rank 0 is the server: pick a rank in 1..2"),
    ("3", ["--straggler-timeout", "400"], "--straggler-timeout must be > 0 and below --timeout-s 300"),
    ("4", ["--batch-size", "8"], "--batch-size 8 (the global batch) does not split evenly over 3 ranks"),
])
def test_bad_input_is_one_line_and_exit_2(world, flags, message, tmp_path, monkeypatch, capsys):
    # The check run.sh does before torchrun starts workers (and each worker again at start).
    monkeypatch.setenv("WORLD_SIZE", world)
    script = load_script(REPO / "rpc" / "ps.py")  # registered afresh: the flags' help is read from its source
    with pytest.raises(SystemExit) as exit_:
        parse_config(script.Config, script.check, ["--run-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


# ----------------------------------------------------------------------------- the server object, no RPC
def make_server(tmp_path, cfg, trainers, after_update=lambda step: None):
    model = Transformer(model_config(cfg), seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ps.lr_at(cfg, s) / cfg.lr)
    monitor = ps.Monitor(tmp_path, 0, torch.device("cpu"), log_every=1000)
    return ps.ParameterServer(model, optimizer, scheduler, cfg, monitor, trainers, 0, range(1, trainers + 1),
                              after_update)


def serial_reference(cfg, grads_per_step):
    """The same updates done one after another: [{trainer: grads}] per step, averaged in trainer order."""
    model = Transformer(model_config(cfg), seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ps.lr_at(cfg, s) / cfg.lr)
    digests = []
    for by_trainer in grads_per_step:
        for i, p in enumerate(model.parameters()):
            total = torch.zeros_like(p)
            for t in sorted(by_trainer):
                total = total + by_trainer[t][i]
            p.grad = total / len(by_trainer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        digests.append(param_digest(model.state_dict()))
    return digests


def random_grads(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in Transformer(model_config(cfg)).parameters()]
    return [torch.randn(shape, generator=g) for shape in shapes]


SERVER_CFG = dict(steps=6, dim=16, heads=2, layers=1, seq_len=8, vocab=16, batch_size=8, warmup=2)


def test_pushes_from_many_threads_match_serial_updates(tmp_path):
    cfg, trainers = ps.Config(**SERVER_CFG), 8
    grads = [{t: random_grads(cfg, 100 * step + t) for t in range(1, trainers + 1)} for step in range(cfg.steps)]
    saved = []
    server = make_server(tmp_path, cfg, trainers, after_update=saved.append)
    replies = {t: [] for t in range(1, trainers + 1)}
    start = threading.Barrier(trainers)

    def trainer(t):
        start.wait()  # all push at once, in whatever order the scheduler picks
        for step in range(cfg.steps):
            version, weights = server.push(t, step, grads[step][t], float(t)).wait()
            replies[t].append((version, param_digest(weights)))

    threads = [threading.Thread(target=trainer, args=(t,)) for t in range(1, trainers + 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    expected = serial_reference(cfg, grads)
    assert saved == list(range(1, cfg.steps + 1))  # after_update once per update, in order
    assert param_digest(server.model.state_dict()) == expected[-1]
    for t in replies:  # every trainer was answered with the weights of each update
        assert replies[t] == [(step + 1, expected[step]) for step in range(cfg.steps)]
    assert server.loss == sum(range(1, trainers + 1)) / trainers
    assert [e["step"] for e in metrics(tmp_path, 0, "step")] == list(range(1, cfg.steps + 1))


def test_missing_trainer_is_dropped_after_the_straggler_timeout(tmp_path):
    cfg, trainers = ps.Config(**SERVER_CFG, straggler_timeout=0.5), 3
    cfg.steps = 3
    grads = [{t: random_grads(cfg, 100 * step + t) for t in range(1, trainers + 1)} for step in range(cfg.steps)]
    server = make_server(tmp_path, cfg, trainers)
    # Trainers 1 and 2 push every step; trainer 3 never does, so step 0 completes only if the
    # server's main thread drops trainer 3 by itself.
    replies = []

    def trainers_1_and_2():
        for step in range(cfg.steps):
            futures = [server.push(t, step, grads[step][t], 1.0) for t in (1, 2)]
            replies.append([f.wait()[0] for f in futures])

    th = threading.Thread(target=trainers_1_and_2)
    th.start()
    server.wait_until_done()
    th.join()

    assert server.version == cfg.steps and server.live == {1, 2}
    assert replies == [[1, 1], [2, 2], [3, 3]]
    assert server.push(3, 0, grads[0][3], 1.0).wait() is None  # the lost trainer, back too late: told to stop
    assert server.pull(3) is None
    [lost] = metrics(tmp_path, 0, "trainer_lost")
    assert lost["trainer"] == 3 and lost["step"] == 0 and lost["waited_s"] >= cfg.straggler_timeout
    expected = serial_reference(cfg, [{t: g[t] for t in (1, 2)} for g in grads])
    assert param_digest(server.model.state_dict()) == expected[-1]
