"""auto mode on the CPU tape backend: which executor serves each batch, served_by in the records, exact against
eager through compare, and the commands that accept it."""

from __future__ import annotations

import json

import pytest

from gmtool.config import SweepConfig
from gmtool.core.auto import AutoExecutor, EagerStep
from gmtool.core.buckets import BucketKey
from gmtool.core.compositions import parse_composition
from gmtool.measure.workbench import Workbench
from gmtool.modes import CAPTURE_MODES, MEMORY_MODES, GraphMode
from gmtool.records import Record
from tests.helpers import md_table_rows, rel
from tests.test_compare import FAST, one_error, run_cli


@pytest.fixture(scope="module")
def auto():
    cfg = SweepConfig(
        model="tiny-qwen3",
        device="cpu",
        dtype="fp32",
        buckets="4,8",
        max_tokens=24,
        modes=(GraphMode.EAGER, GraphMode.AUTO),
        max_kv_len=96,
        max_num_seqs=16,
    )
    bench = Workbench.build(cfg, num_blocks=200)
    ex = bench.executor(GraphMode.AUTO)
    yield bench, ex
    ex.release()


def _eager(bench, batch):
    fn, logits = bench.eager_fn(batch)
    fn()
    return logits.clone()


def test_auto_is_a_composite_mode_served_per_batch():
    assert GraphMode.AUTO.composed_of == {"decode": GraphMode.FULL, "mixed": GraphMode.PIECEWISE}
    assert GraphMode.AUTO.served_by is None  # decided per batch
    assert [GraphMode(m).served_by for m in ("eager", "full", "full-narrow", "piecewise")] == [
        "eager",
        "full",
        "full",
        "piecewise",
    ]
    assert GraphMode.AUTO in CAPTURE_MODES and GraphMode.AUTO in MEMORY_MODES
    assert GraphMode.FULL_NARROW not in MEMORY_MODES


@pytest.mark.parametrize(
    "text, served, key",
    [
        ("1*3", "full", BucketKey(4, None, True)),  # uniform decode: a full decode graph
        ("1*8", "full", BucketKey(8, None, True)),
        ("3+2", "piecewise", BucketKey(8, None, False)),  # prefill: piecewise, keyed by token count alone
        ("1*2+5", "piecewise", BucketKey(8, None, False)),  # mixed: decode requests riding with a chunk
        ("6+3@20", "eager", BucketKey(9, 2, False)),  # 9 tokens: above bucket 8
        ("1*12", "eager", BucketKey(12, 12, True)),  # decode above the largest bucket: eager, its exact shape
    ],
)
def test_dispatch_choices_and_exact_against_eager(auto, text, served, key):
    bench, ex = auto
    batch = bench.batch(parse_composition(text, seed=3))
    assert ex.served_by(batch) == served
    assert ex.key_for(batch) == key
    out = ex.step(batch).clone()
    assert rel(out, _eager(bench, batch)) < 1e-5, text
    entry = ex.prepare(batch)
    assert entry.mode.served_by == served  # what the sweep writes into the record
    if served == "eager":
        assert isinstance(entry, EagerStep) and key not in ex.graphs  # nothing captured for it
    else:
        assert key in ex.parts["decode" if served == "full" else "mixed"].graphs


def test_one_arena_and_disjoint_keys(auto):
    """Both executors read the same input arena (a step's inputs land where the checks read them) and their
    keys never collide, so one memory strategy can hold both sets."""
    _, ex = auto
    assert isinstance(ex, AutoExecutor)
    full, pw = ex.parts["decode"], ex.parts["mixed"]
    assert full.inputs is pw.inputs is ex.inputs and full.backend is pw.backend
    assert all(k.decode for k in full.graphs) and not any(k.decode for k in pw.graphs)
    assert len(ex.graphs) == len(full.graphs) + len(pw.graphs)


def test_an_eager_step_over_another_bucket_s_inputs_is_refused(auto):
    """Above the largest bucket the step runs eagerly over the arena's views at its own key's offsets: after
    another batch was loaded there, it refuses as a graph does; loaded again, it is right."""
    from gmtool.errors import InputsNotLoaded

    bench, ex = auto
    big, small = bench.batch(parse_composition("1*12", seed=5)), bench.batch(parse_composition("1*3", seed=6))
    entry = ex.prepare(big)
    assert isinstance(entry, EagerStep)
    ex.step(small)
    with pytest.raises(InputsNotLoaded, match="another bucket"):
        entry.replay(big)
    assert rel(ex.step(big).clone(), _eager(bench, big)) < 1e-5


def test_fused_layers_write_k_v_only_where_the_attention_is_in_the_graph(auto):
    """The forward context tells --fuse's QK kernel whether it may write the step's K/V itself: yes in a full
    executor (and eager), no in a piecewise one, whose capture writes them at the end of each piece, so that its
    warm-ups and compile-ahead's pass launch the kernels its capture records."""
    from gmtool.model import attention

    bench, ex = auto
    for kind, writes in (("decode", True), ("mixed", False)):
        part = ex.parts[kind]
        batch = bench.batch(parse_composition("1*3" if kind == "decode" else "3+2", seed=1))
        key = part.key_for(batch)
        ctx = part._context(key, part.inputs.load(batch, key), batch)
        assert ctx.layers_write_kv is writes, kind
        with attention.forward_context(ctx):
            assert (attention.cache_writer() is ctx) is writes, kind


def test_above_max_tokens_is_one_line(auto):
    from gmtool.errors import GmtoolError

    bench, ex = auto
    batch = bench.batch(parse_composition("1*4+26", seed=1))
    with pytest.raises(GmtoolError, match="above --max-tokens 24"):
        ex.prepare(batch)


def test_served_by_reads_old_records():
    old = {"mode": "full", "bucket": 4, "composition": "1*4", "status": "ok"}
    assert Record(**old).served_by is None  # results.json written before served_by still loads
    assert Record(**old, served_by="full").to_dict()["served_by"] == "full"


def test_compare_auto_rows_are_exact_and_say_what_served_them(tmp_path):
    out = tmp_path / "auto"
    comps = "1*3,1*4,2+2,1*2+2,8=1*5,3+5,1*2+6@16"
    code, _, err = run_cli("compare", "eager,auto", *FAST, "--buckets", "4,8", "--compositions", comps, "--out", out)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    rows = {(r["mode"], r["composition"]): r for r in doc["records"]}
    expect = {
        "1*3": "full",
        "1*4": "full",
        "2+2": "piecewise",
        "1*2+2": "piecewise",
        "1*5": "full",
        "3+5": "piecewise",
        "1*2+6@16": "piecewise",
    }
    assert {c: rows[("auto", c)]["served_by"] for c in expect} == expect
    assert all(rows[("eager", c)]["served_by"] == "eager" for c in expect)
    for c in expect:
        r = rows[("auto", c)]
        assert r["status"] == "ok" and r["max_rel_err_same_shape"] <= 1e-5 and r["max_rel_err"] <= 1e-3, r
        assert (r["runners"] > 0) == (expect[c] == "piecewise")
    assert "served_by" in (out / "results.csv").read_text().splitlines()[0].split(",")
    summary = {(r[0], r[1]): r for r in md_table_rows((out / "report.md").read_text(), "Summary (mode x bucket)")}
    assert summary[("4", "auto")][11] == "full/piecewise" and summary[("4", "eager")][11] == "eager"
    assert summary[("4", "auto")][12].endswith("x")  # its distance to the floor


def test_capture_accepts_auto_and_memreport_refuses_only_for_want_of_cuda(tmp_path):
    code, _, err = run_cli(
        "capture", "--mode", "auto", *FAST, "--buckets", "2", "--compositions", "1*2,2", "--out", tmp_path / "cap"
    )
    assert code == 0, err
    recs = json.loads((tmp_path / "cap" / "results.json").read_text())["records"]
    assert sorted(r["served_by"] for r in recs if r["mode"] == "auto") == ["full", "piecewise"]
    code, _, err = run_cli("memreport", "--mode", "auto", "--device", "cpu", "--out", tmp_path / "mem")
    assert code == 2 and "memory strategies need CUDA" in one_error(err)
    code, _, err = run_cli("memreport", "--mode", "full-narrow", "--device", "cpu", "--out", tmp_path / "mem2")
    assert code == 2 and "--mode must be one of full, piecewise, auto" in one_error(err)


def test_verify_soaks_auto(tmp_path):
    code, _, err = run_cli(
        "verify", "--modes", "auto", "--device", "cpu", "--steps", "6", "--check-every", "3", "--out", tmp_path / "v"
    )
    assert code == 0, err
    assert json.loads((tmp_path / "v" / "verify.json").read_text())["runs"][0]["mode"] == "auto"


def test_one_memory_strategy_holds_both_sets_and_outlives_them(auto):
    """memreport's strategy sees every capture of both parts (auto's memory is the sum of the two sets), and
    is released only once no graph of either part is left."""
    bench, _ = auto

    class Recorder:
        order = "descending"

        def __init__(self):
            self.keys, self.graphs_left, self.releases = [], None, 0

        def pool_for(self, key):
            return None

        def captured(self, key, entry):
            self.keys.append(key)

        def physical_bytes(self):
            return None

        def release(self):
            self.releases += 1
            self.graphs_left = len(ex.graphs)

    rec = Recorder()
    ex = bench.executor(GraphMode.AUTO, rec)
    for text in ("1*4", "3+2"):
        ex.step(bench.batch(parse_composition(text, seed=0)))
    assert rec.keys == [BucketKey(4, None, True), BucketKey(8, None, False)]
    ex.release()
    assert (rec.releases, rec.graphs_left) == (1, 0)


def test_a_sweep_runs_auto_above_the_largest_bucket_eagerly_and_says_so(tmp_path):
    """auto's third case, eager above the largest bucket, was reachable from no command: a mix above it was
    refused as fitting no bucket. Within --max-tokens it is now its own row group: auto's row served_by eager
    and checked against eager, the other graph modes' rows skipped with the reason, and a note."""
    import json

    from gmtool.config import SweepConfig
    from gmtool.errors import GmtoolError
    from tests.test_compare import run_cli

    args = ["--device", "cpu", "--scenario", "mixed", "--buckets", "16,32", "--num-iters", "1"]
    code, stdout, err = run_cli(
        "compare", "eager,auto,full", *args, "--num-iters-warmup", "0", "--max-tokens", "64",
        "--compositions", "1*16,40,30+1*4", "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    rows = {(r["mode"], r["composition"]): r for r in doc["records"]}
    for mix, size in (("40", 40), ("30+1*4", 34)):
        auto, full = rows[("auto", mix)], rows[("full", mix)]
        assert auto["bucket"] == size and auto["served_by"] == "eager" and auto["status"] == "ok", auto
        assert auto["max_rel_err"] is not None and auto["max_rel_err"] <= auto["tolerance"]
        assert full["status"] == "skipped" and "no full graph" in full["error"], full
    assert rows[("auto", "1*16")]["served_by"] == "full"
    assert doc["config"]["eager_sizes"] == [34, 40]
    checked = sum(1 for r in doc["records"] if r["mode"] != "eager" and r["status"] != "skipped")
    assert f"({checked} replays checked against eager; 2 skipped)" in " ".join(stdout.split()), stdout
    assert rows[("auto", "40")]["captured_with"] is None and rows[("auto", "40")]["runners"] is None
    assert any("above the largest bucket (32): auto runs them eagerly" in n for n in doc["notes"]), doc["notes"]
    with pytest.raises(
        GmtoolError, match=r"fits no bucket .*capture and compare also take it with mode auto and --max-tokens"
    ):
        SweepConfig(device="cpu", buckets="16,32", compositions="40", modes=("eager", "full"))
    # memreport, which refuses --max-tokens' eager sizes, needs the other way out named
    with pytest.raises(GmtoolError, match="raise --max-tokens to 40 or more, or add a bucket of 40 or more"):
        SweepConfig(device="cpu", buckets="16,32", compositions="40", modes=("eager", "auto"))
    with pytest.raises(GmtoolError, match="raise --max-tokens to 40 or more$"):  # a bucket of 40 is above it too
        SweepConfig(device="cpu", buckets="16,32", compositions="40", modes=("eager", "auto"), max_tokens=32)


def test_mixes_auto_runs_eagerly_choose_nothing_of_the_graphs():
    """The run's scenario and --piecewise-impl fx's check follow the mixes graphs serve: a prefill mix above the
    largest bucket made a run of decode graphs 'prefill' (and plan then costed decode steps as prefill graphs),
    and let fx through where auto captures no piecewise graph; --trace and --fuse's check take the largest graph
    bucket, not an eager size."""
    from gmtool.config import SweepConfig
    from gmtool.errors import GmtoolError

    opts = dict(device="cpu", buckets="16,32", max_tokens=64, compositions="1*16,1*32,40")
    cfg = SweepConfig(**opts, modes=("eager", "auto", "full"))
    assert cfg.scenario == "decode" and not any("scenario" in n for n in cfg.notes), cfg.notes
    assert cfg.largest_graph_bucket == 32 and cfg.eager_sizes == [40]
    with pytest.raises(GmtoolError, match="auto serves every batch of this run with full graphs"):
        SweepConfig(**opts, modes=("eager", "auto"), piecewise_impl="fx")
