"""Tests written for mutants that the rest of the suite let through (tools/mutants.py names each one's mutant):
each breaks something the sweep's verdicts rest on, in a way that graph and eager share, or that no other test
looks at."""

from types import SimpleNamespace

import pandas as pd
import torch

from gmtool.model.attention import ForwardContext
from gmtool.core.buckets import BucketKey
from gmtool.core.executor import CapturedGraph
from gmtool.report.markdown import render_markdown
from gmtool.records import Document
from gmtool.report.results import write_results
from gmtool.report.summary import bucket_summary
from tests.helpers import Rig, rel
from tests.test_report import make_doc, rec, table_rows
from tests.test_vmm_bookkeeping import MiB, fresh, lib, malloc  # noqa: F401  (lib: a fixture)


# -- copy-in: eager and graphs read the same buffers, so a field that never arrives fools both alike ----------
def test_copy_in_writes_every_field_and_pads_the_rest():
    """Each field of the batch where its view reads it on the device, and the padding as attention expects it:
    padded tokens are token 0 in the null slot of no sequence, padded sequences are empty (cu_q's tail holds
    the token count), block-table entries past a sequence's blocks point to the null block. Keys change from
    load to load, so both the full padding and the in-place one run. inputs-block-tables-not-copied,
    inputs-kv-lens-not-copied, inputs-cu-tail-zero."""
    rig = Rig(buckets=(8, 16), max_num_seqs=16)
    inputs = rig.ex.inputs
    cases = [
        ("1*5", BucketKey(8, None, True)),
        ("3@20+1*2", BucketKey(8)),
        ("7+1@100", BucketKey(16, 8)),
        ("1*3@40+5", BucketKey(16)),
        ("1*2", BucketKey(8, None, True)),
        ("1*7@120", BucketKey(8, None, True)),
        ("1*2", BucketKey(8, None, True)),
        ("2+2", BucketKey(16, 8)),
    ]
    for i, (text, key) in enumerate(cases):
        b = rig.batch(text, seed=i)
        v = inputs.load(b, key)  # the device arena, after the copy
        n, s, w = b.num_tokens, b.num_seqs, b.block_table_array.shape[1]
        for name, want, pad in (
            ("input_ids", b.input_ids, 0),
            ("positions", b.positions, 0),
            ("slot_mapping", b.slot_mapping, 0),
            ("token_seq", b.token_seq, -1),
        ):
            got = getattr(v, name).tolist()
            assert got == want.tolist() + [pad] * (key.num_tokens - n), (text, name)
        slots = inputs.seq_slots(key)
        assert v.logits_indices.tolist() == b.logits_indices.tolist() + [0] * (slots - s), text
        assert v.kv_lens.tolist() == b.kv_lens + [0] * (slots - s), text
        assert v.cu_q.tolist() == b.cu_q.tolist() + [n] * (slots - s), text
        assert v.block_tables[:s, :w].tolist() == b.block_table_array.tolist(), text
        assert not v.block_tables[:s, w:].any() and not v.block_tables[s:].any(), text


def test_gmtool_eager_matches_hf_attention_on_prefill():
    """gmtool's eager forward (paged K/V write, its own attention, the logits row it samples) against the HF
    model with its own SDPA attention: the judge compares replays with gmtool eager, so gmtool eager must be
    the model. batch-logits-first-token, kv-write-v-gets-k."""
    from gmtool.measure.hf_compiled import sdpa_copy

    rig = Rig()
    hf = sdpa_copy(rig.lm.model)
    b = rig.batch("8+5+3", seed=1)
    out = rig.eager(b)
    start = 0
    with torch.no_grad():
        for i, q in enumerate(b.q_lens):
            ids = torch.from_numpy(b.input_ids[start : start + q])[None]
            want = hf(input_ids=ids, position_ids=torch.arange(q)[None], use_cache=False).logits[0, -1:]
            assert rel(out[i : i + 1], want) < 1e-4, i
            start += q


# -- stale-metadata detection with the Triton kernels ----------------------------------------------------------
def test_triton_plan_signature_is_the_launch_grid():
    """The Triton planned kernel bakes (num_seqs, max_q_len) into its grid and reads lengths from the device: a
    frozen plan is stale exactly when that pair changes. plan-signature-triton-no-max-q."""
    from gmtool.kernels import TritonAttention

    a, same_grid, other_grid = ((16, 16), (16, 16)), ((16, 40), (10, 10)), ((20, 20), (12, 12))
    triton = object.__new__(TritonAttention)  # its kernels need CUDA; its plan signature is host arithmetic
    ctx = ForwardContext(None, None, "planned", a, backend=triton)
    assert ctx.plan_signature(a) == ctx.plan_signature(same_grid)
    assert ctx.plan_signature(a) != ctx.plan_signature(other_grid)  # same sequence count, another max_q_len
    entry = CapturedGraph(BucketKey(32), "full", "planned", [], ctx, baked_plans=[ctx.plan_signature(a)])
    assert not entry.stale_metadata(SimpleNamespace(plan=same_grid))
    assert entry.stale_metadata(SimpleNamespace(plan=other_grid))
    torch_ctx = ForwardContext(None, None, "planned", a)  # the reference slices every sequence on the host
    assert torch_ctx.plan_signature(a) != torch_ctx.plan_signature(same_grid)


# -- VMM ---------------------------------------------------------------------------------------------------------
def test_vmm_physical_bytes_count_whole_chunks(lib):  # noqa: F811
    """With a chunk of two granules, physical memory is counted in chunks. vmm-physical-in-granules."""
    fresh(lib, chunk=4 * MiB)
    lib.begin_range()
    assert malloc(lib, 5 * MiB)  # two 4 MiB chunks
    assert lib.chunk_bytes() == 4 * MiB
    assert lib.physical_bytes() == 8 * MiB and lib.stats().physical_bytes == 8 * MiB
    assert lib.range_mapped(0) == 8 * MiB


# -- report rows -------------------------------------------------------------------------------------------------
def test_bucket_summary_reports_the_worst_composition():
    """A bucket's max rel err is its worst composition's, in every report. summary-min-error."""
    rows = bucket_summary(
        [
            rec("full", 16, "8*2", ms=3.0, eager=9.0, err=1e-6),
            rec("full", 16, "4*4", ms=3.1, eager=9.0, err=3e-6),
            rec("full", 16, "2*8", ms=3.2, eager=9.0, err=2e-6),
        ]
    )
    assert len(rows) == 1 and rows[0]["max_rel_err"] == 3e-6 and rows[0]["status"] == "ok"
    md = render_markdown(make_doc())
    summary = {(r[0], r[1]): r for r in table_rows(md, "Summary (mode x bucket)")}
    assert summary[("16", "full")][7] == "8.00e-01"  # 8*2 replayed fine; 4*4 was off by 0.8


def test_results_csv_flattens_every_timing(tmp_path):
    """results.csv: one column per field of each timing (latency_ms_median, ..._p90, ...). csv-flattening-loses-timings."""
    doc = make_doc()
    write_results(tmp_path, Document.from_dict(doc))
    df = pd.read_csv(tmp_path / "results.csv")
    timed = [r for r in doc["records"] if r["latency_ms"]]
    assert len(df) == len(doc["records"])
    assert {f"latency_ms_{k}" for k in timed[0]["latency_ms"]} <= set(df.columns)
    assert sorted(df["latency_ms_median"].dropna()) == sorted(r["latency_ms"]["median"] for r in timed)
    assert sorted(df["latency_ms_p90"].dropna()) == sorted(r["latency_ms"]["p90"] for r in timed)


def test_results_csv_spreads_the_traced_kernel_classes(tmp_path):
    """--trace rows: ms per kernel class over time_by_class_ms_<class> columns (a dict's Python repr in one cell
    is neither JSON nor a number a spreadsheet reads); untraced rows leave them empty."""
    doc = make_doc()
    traced = next(r for r in doc["records"] if r["latency_ms"])
    traced["time_by_class_ms"] = {"attention": 0.25, "GEMM": 1.5, "norm": 0.0, "elementwise": 0.5, "other": 0.125}
    write_results(tmp_path, Document.from_dict(doc))
    df = pd.read_csv(tmp_path / "results.csv")
    assert "time_by_class_ms" not in df.columns
    row = df.iloc[doc["records"].index(traced)]
    assert {k: row[f"time_by_class_ms_{k}"] for k in traced["time_by_class_ms"]} == traced["time_by_class_ms"]
    assert df["time_by_class_ms_GEMM"].notna().sum() == 1
