"""--tp on the CPU backend: two processes joined through gloo, the all-reduce recorded on the tape and replayed.

Each spawn costs a few seconds of imports per rank, so every group of tests shares one run (session fixtures).
"""

import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.core.compositions import parse_composition
from gmtool.errors import GmtoolError
from gmtool.measure.check import checked_replay
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from gmtool.measure.workbench import Workbench
from gmtool.modes import GraphMode
from gmtool.parallel import launch
from gmtool.parallel.comm import agree, place
from tests.test_compare import run_cli
from tests.helpers import md_table_rows

TINY = ["--device", "cpu", "--num-iters", "2", "--num-iters-warmup", "1"]
MIXES = ("1*1", "1*3", "4=2+2")  # decode buckets 1 and 4, and a prefill batch in bucket 4
CLI_MIXES = MIXES[1:]  # bucket 4 only: the launch is what is under test there
ENV = {**os.environ, "GMTOOL_CPU_THREADS": "1", "PYTHONPATH": os.getcwd()}


def gm(*args, env=None, timeout=240):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gmtool.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _config(tp: int) -> SweepConfig:
    return SweepConfig(
        model="tiny-qwen3",
        device="cpu",
        dtype="fp32",
        buckets="1,4",
        modes=("eager", "full"),
        compositions=",".join(MIXES),
        max_kv_len=64,
        tp=tp,
    )


def tp_logits(cfg: SweepConfig, modes: tuple[str, ...]) -> dict:
    """On each rank: every mix's eager logits, and each graph mode's replay judged by the sweep's own check
    (its logits, and its error against eager on the same padded shape); what the rank holds."""
    bench = Workbench.build(cfg)
    attn = bench.lm.model.model.layers[0].self_attn
    out = {"kv_heads": bench.cache.k[0].shape[2], "q_rows": attn.q_proj.weight.shape[0]}
    executors = {m: bench.executor(GraphMode(m)) for m in modes}
    for text in MIXES:
        batch = bench.batch(parse_composition(text))
        ref, _ = bench.reference(batch)
        out[("eager", text)] = ref.logits.clone()
        for m, ex in executors.items():
            _, check, logits = checked_replay(ex, batch, ref)
            out[(m, text)], out[("same shape", m, text)] = logits, check.max_rel_err_same_shape
    for ex in executors.values():
        ex.release()  # graphs before the group goes
    out["agreed"] = agree("K/V differ" if place().rank == 1 else None)  # a verdict only rank 1 reached
    return out


@pytest.fixture(scope="session")
def tp2():
    """Rank 0's logits of a TP=2 run through the launcher (two processes, gloo)."""
    return launch.run(tp_logits, _config(2), ("full", "piecewise"), timeout=60)


def test_tp2_replay_is_exact_against_tp2_eager(tp2):
    assert tp2["kv_heads"] == 1 and tp2["q_rows"] == 2 * 16  # half of tiny-qwen3's 2 KV and 4 query heads
    for text in MIXES:
        for mode in ("full", "piecewise"):
            assert tp2[("same shape", mode, text)] == 0.0, (mode, text)
            assert torch.isfinite(tp2[(mode, text)]).all()


def test_ranks_agree_on_a_verdict_one_rank_reached(tp2):
    """So every rank skips the timing of a replay one of them judged unsafe (else the others wait for it)."""
    assert tp2["agreed"] == "rank 1: K/V differ"


def test_tp2_matches_tp1_eager_within_tolerance(tp2):
    bench = Workbench.build(_config(1))
    _, tol = tolerances_for(torch.float32)
    for text in MIXES:
        fn, logits = bench.eager_fn(bench.batch(parse_composition(text)))
        fn()
        for mode in ("eager", "full", "piecewise"):
            err = rel_err_per_seq(tp2[(mode, text)], logits)
            assert err < tol / 10, (mode, text, err)  # a different summation order, nothing more


@pytest.fixture(scope="session")
def tp2_compare(tmp_path_factory):
    """compare under torchrun (two ranks it starts; gmtool sees WORLD_SIZE and joins its group). gmtool's own
    spawning is what the tp2 fixture and the failed-rank test go through."""
    out = tmp_path_factory.mktemp("tp") / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(launch._free_port()),
            "-m",
            "gmtool.cli.main",
            "compare",
            "eager,full,piecewise",
            *TINY,
            "--buckets",
            "4",
            "--compositions",
            ",".join(CLI_MIXES),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    return p.returncode, p.stdout, p.stderr, out


def test_tp2_compare_under_torchrun_writes_every_ranks_rows(tp2_compare):
    code, stdout, stderr, out = tp2_compare
    assert code == 0, stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["tp"] == 2
    assert any("--tp 2: rank 0 of 2" in n for n in doc["notes"])
    share = next(n for n in doc["notes"] if "all-reduces of a step, timed alone" in n)  # the collective's share
    assert "the 4 all-reduces" in share and "4: " in share and "of full's replay" in share
    rows = doc["records"]
    assert sorted({r["rank"] for r in rows}) == [0, 1]
    per_rank = {
        rank: [(r["mode"], r["bucket"], r["composition"]) for r in rows if r["rank"] == rank] for rank in (0, 1)
    }
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 3 * len(CLI_MIXES)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["max_rel_err_same_shape"] == 0.0  # the tape replays the same ops, the collective included
        assert r["max_rel_err"] <= r["tolerance"]
        if r["mode"] != "eager":  # replay ms and host time per rank
            assert r["latency_ms"]["median"] > 0 and r["host_us"]["median"] > 0
    captured = [r for r in rows if r["capture_s"] is not None]
    assert {(r["rank"], r["mode"], r["bucket"]) for r in captured} >= {
        (k, m, 4) for k in (0, 1) for m in ("full", "piecewise")
    }
    assert "┃ rank ┃" in stdout  # the terminal table has a row per rank
    assert (out / "records.jsonl").is_file() and (out / "report.md").is_file()


def test_a_tp1_run_is_the_baseline_of_a_tp2_run(tp2_compare, tmp_path):
    """TP=1 against TP=2 in one report: both runs describe the whole model (a rank holds half its parameters),
    so the TP=1 results join the TP=2 rows of every rank as their baseline."""
    code, stdout, stderr, out = tp2_compare
    assert code == 0, stderr
    one = tmp_path / "tp1"
    code, _, stderr = run_cli(
        "compare", "eager,full,piecewise", *TINY, "--buckets", 4, "--compositions", ",".join(CLI_MIXES), "--out", one
    )
    assert code == 0, stderr
    tp1, tp2 = (json.loads((d / "results.json").read_text()) for d in (one, out))
    assert tp2["model"]["params"] == tp1["model"]["params"]
    code, stdout, stderr = run_cli("report", out, "--baseline", one / "results.json")
    assert code == 0, stderr
    assert "baseline" in (out / "report.md").read_text().lower()
    # every rank's rows join the TP=1 run's rows of the same mode, bucket and mix: none is new
    assert f"{len(tp2['records'])} rows matched, 0 new" in " ".join(stdout.split())
    assert any(r[0].endswith("(rank 1)") for r in md_table_rows((out / "report.md").read_text(), "Change vs baseline"))


@pytest.mark.parametrize(
    "fail, says",
    [
        ("1", "error: rank 1 of 2 failed: injected failure"),
        # rank 1 killed (the OOM killer's SIGKILL) while rank 0 waits in a collective: gloo's "connection reset" of
        # rank 0 reached the parent first and was named as the failure, rank 1 "stopped after --tp-timeout"
        ("1:kill", "error: rank 1 of 2 failed: killed by signal SIGKILL (out of host memory? the OOM killer sends it)"),
    ],
)
def test_a_failed_rank_is_named_and_the_others_stop(tmp_path, fail, says):
    code, _, stderr, took = gm(
        "capture", *TINY, "--tp", 2, "--buckets", 1, "--compositions", "1*1", "--tp-timeout", 3,
        "--out", tmp_path / "x", env={launch.FAIL_ENV: fail},
    )  # fmt: skip
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(says), stderr
    assert took < 60  # a few seconds of imports, then at most --tp-timeout for rank 0


def test_a_tp_run_that_went_well_says_nothing_on_stderr_but_its_note(tmp_path):
    """The parent stopped its ranks while their exit joined the report queue's thread: a rank's
    KeyboardInterrupt traceback (or "Exception ignored in atexit callback") followed a clean verdict."""
    code, stdout, stderr, _ = gm(
        "capture", *TINY, "--tp", 2, "--buckets", "1,2", "--out", tmp_path / "x", "--format", "quiet",
    )  # fmt: skip
    assert code == 0 and "verdict: " in stdout
    assert [line for line in stderr.splitlines() if not line.startswith("note: no CUDA here")] == [], stderr


def test_a_rank_that_reported_its_result_ignores_the_parent_s_stop(monkeypatch):
    """What the test above sees only when the parent's stop lands while a rank exits, every time: a rank that has
    put its result on the queue takes no Ctrl-C or SIGTERM as an interrupt any more."""
    import signal
    import threading

    sent, death = [], []

    class Queue:
        def put(self, message):
            sent.append((message, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), death[-1]))

    monkeypatch.setattr(launch, "_as_rank", lambda *a: "result")
    monkeypatch.setattr(launch, "_die_with_parent", lambda parent, sig=signal.SIGTERM: death.append(sig))
    held = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch._worker(1, 2, 0, None, {}, (), {}, 1.0, Queue(), threading.Event(), os.getpid())
    finally:
        for s, h in held.items():
            signal.signal(s, h)
    # and dies with its parent by SIGKILL: ignoring SIGTERM, it outlived a parent killed while the report filled
    # the pipe, waiting on it for good
    assert sent == [((1, 0, None), launch._ignore, launch._ignore, signal.SIGKILL)]


def test_what_failed_a_tp_run_is_read_from_reports_and_exits_in_that_order():
    """launch._failure(done, exited): reports read (rank -> (code, message)), exit codes seen before the read."""
    sigkill = launch._failure({}, {1: -9})[2]
    assert sigkill == "killed by signal SIGKILL (out of host memory? the OOM killer sends it)"
    assert launch._failure({}, {}) is None and launch._failure({0: (0, b"")}, {0: 0, 1: 0}) is None
    # a rank killed outright is the cause of what the others report
    assert launch._failure({1: (1, "connection reset")}, {0: -9}) == (0, 1, sigkill)
    # a rank that reported its failure, then exited 1, is its report, not "exited without a word" (a review saw
    # a GmtoolError every rank met turned into that, exit 1 instead of 2, when the report was still queued)
    assert launch._failure({0: (2, "bad config"), 1: (2, "bad config")}, {0: 1, 1: 1}) == (0, 2, "bad config")
    assert launch._failure({0: (0, b"")}, {0: 0, 1: 3}) == (1, 1, "exited with code 3 without a word")
    assert launch._failure({}, {0: -15}) == (0, 1, "killed by signal SIGTERM")


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--tp", "3"], {}, "--tp 3: the model's 4 attention heads do not divide by 3"),
        (["--tp", "0"], {}, "--tp must be 1 or more"),
        ([], {"WORLD_SIZE": "2", "RANK": "0"}, "incomplete rendezvous: MASTER_ADDR, MASTER_PORT not set"),
        (
            ["--tp", "4"],
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "--tp 4 but torchrun started 2 ranks",
        ),
        (
            [],
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "y"},
            "incomplete rendezvous: MASTER_PORT='y' is not a number",
        ),
        (
            [],
            {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "99999"},
            "incomplete rendezvous: MASTER_PORT=99999 is not a TCP port",
        ),
        (  # a rank past the group waited for the others until the timeout, then a traceback
            [],
            {"WORLD_SIZE": "2", "RANK": "3", "MASTER_ADDR": "localhost", "MASTER_PORT": "29512"},
            "incomplete rendezvous: RANK=3 in a group of WORLD_SIZE=2",
        ),
        (
            [],
            {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "nowhere.invalid", "MASTER_PORT": "29513"},
            "incomplete rendezvous: MASTER_ADDR='nowhere.invalid' does not resolve",
        ),
        (["--tp", "2", "--tp-timeout", "1e308"], {}, "--tp-timeout must be 1 to 604,800 seconds, got 1e+308"),
        (["--tp", "2", "--tp-timeout", "0.001"], {}, "--tp-timeout must be 1 to 604,800 seconds, got 0.001"),
    ],
)
def test_bad_requests_are_one_line(tmp_path, monkeypatch, args, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, stdout, stderr = run_cli("capture", *TINY, "--buckets", 1, *args, "--out", tmp_path / "x")
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and says in stderr, stderr
    assert not (tmp_path / "x").exists()


def test_more_ranks_than_gpus_is_refused():
    cfg = types.SimpleNamespace(tp=2, torch_device=torch.device("cuda"), model="tiny-qwen3")
    with pytest.raises(GmtoolError, match=r"--tp 2 needs 2 GPUs, 1 visible"):
        launch.check_request(cfg, visible_gpus=1)
    launch.check_request(cfg, visible_gpus=2)
    cfg.torch_device = torch.device("cuda:1")
    with pytest.raises(GmtoolError, match="rank r on cuda:r"):
        launch.check_request(cfg, visible_gpus=2)


@pytest.mark.parametrize(("model_type", "says"), [("olmo2", "query and 2/2 K/V heads a rank"), ("stablelm", "shape")])
def test_a_family_whose_layers_do_not_split_by_heads_is_refused_in_one_line(tmp_path, model_type, says):
    """OLMo 2 normalizes q and k over every head, StableLM reshapes by its whole head count: split, they failed
    inside the sweep with a raw torch error (exit 1); a probe of the split model refuses them first."""
    from tests.arch_configs import write_config

    path = write_config(model_type, tmp_path)
    code, _, stderr, _ = gm(
        "capture", "--device", "cpu", "--model", path, "--tp", 2, "--buckets", 1, "--out", tmp_path / "x"
    )
    assert code == 2, stderr
    line = stderr.strip().splitlines()[-1]
    assert "its layers do not split by heads" in line or "do not run split over ranks" in line, stderr
    assert says in line and "run it with --tp 1" in line, stderr
    assert not (tmp_path / "x").exists()


def _ranks_of(pgid: int) -> list[int]:
    """The spawned rank processes of a process group (their command line runs multiprocessing's spawn)."""
    found = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.getpgid(int(d)) == pgid:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        found.append(int(d))
        except (OSError, ProcessLookupError):
            continue
    return found


def _group_alive(pgid: int) -> bool:
    """Any process of the group still running (a zombie no init reaped in a container has ended)."""
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.getpgid(int(d)) == pgid:
                with open(f"/proc/{d}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        return True
        except (OSError, ProcessLookupError, IndexError):
            continue
    return False


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_tp_run_stopped_while_its_ranks_start_leaves_nothing_running_and_no_traceback(tmp_path, sig):
    """Ctrl-C (to the whole group, as a terminal sends it) while spawn imports gmtool in the ranks printed a
    traceback per rank; SIGTERM to the parent alone (timeout, a batch system) left both ranks running without
    it, and they wrote a whole run's results afterwards."""
    import signal as signal_mod

    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "gmtool.cli.main", "compare", "eager,full", "--tp", "2", *TINY, "--buckets", "4"]
        + ["--compositions", "1*3", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(_ranks_of(p.pid)) < 2 and time.monotonic() < deadline:  # then they import torch and gmtool
        time.sleep(0.05)
    assert len(_ranks_of(p.pid)) == 2
    time.sleep(1.5)  # inside the imports their spawn starts with
    signum = getattr(signal_mod, sig)
    if sig == "SIGINT":
        os.killpg(p.pid, signum)
    else:
        os.kill(p.pid, signum)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
    time.sleep(1.0)
    assert not _group_alive(p.pid), "a rank outlived its parent"
    assert not (out / "results.json").exists() or json.loads((out / "results.json").read_text())["partial"]


@pytest.mark.parametrize("to,sig", [("group", "SIGTERM"), ("parent", "SIGINT")])
def test_a_tp_run_stopped_mid_sweep_writes_what_was_measured(tmp_path, to, sig):
    """A group SIGTERM (timeout, Slurm) killed the ranks outright: no results.json. A SIGINT to the parent alone
    (kill -INT, a harness) was not passed on: the ranks measured on and wrote a whole run after 'interrupted'."""
    import signal as signal_mod

    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "gmtool.cli.main", "compare", "eager,full", "--tp", "2", "--device", "cpu"]
        + ["--num-iters", "200", "--num-iters-warmup", "0", "--buckets", "1,2,4,8", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    journal, deadline = out / "records.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 3:  # the header and two rows
            break
        time.sleep(0.1)
    signum = getattr(signal_mod, sig)
    os.killpg(p.pid, signum) if to == "group" else os.kill(p.pid, signum)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["partial"] and doc["partial"]["reason"] == "interrupted" and doc["records"], doc.get("partial")
    time.sleep(1.0)
    assert not _group_alive(p.pid), "a rank outlived its parent"


def test_a_signal_while_the_ranks_start_is_held_until_all_started_then_raised():
    """A Ctrl-C inside p.start() came out there (torch's threads take it despite the mask): later ranks were never
    started, and stopping them raised 'can only join a started process' over the interrupt."""
    import multiprocessing as mp
    import signal as signal_mod

    started = []

    class Rank:
        pid = None

        def start(self):
            os.kill(os.getpid(), signal_mod.SIGINT if not started else signal_mod.SIGTERM)
            time.sleep(0.05)
            started.append(self)

    ranks, before = [Rank(), Rank()], signal_mod.getsignal(signal_mod.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        launch._start(ranks)
    assert started == ranks  # both started: the interrupt was held, not lost and not raised in between
    assert signal_mod.getsignal(signal_mod.SIGINT) is before
    launch._stop([mp.get_context("spawn").Process(target=print)])  # never started: nothing to stop, no error
