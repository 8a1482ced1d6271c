"""The CUDA graph-node diff on qwen3-0.6b: one bucket captured with two compositions (and the first again, as the
control), the graphs read through cuda-bindings and compared node by node. gmtool's decode graphs, and full's
prefill graphs under the wide key, have no kernel whose launch or scalar arguments depend on the composition;
full-narrow's prefill graphs do, and those kernels are the attention's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GMTOOL_ATTENTION_KERNELS = ("_varlen_kernel", "_decode_split_kernel", "_combine_kernel", "_write_kv_kernel")


@pytest.fixture(scope="module", params=["triton", "torch"])
def rig(request):
    from gmtool.verify.graphnodes import unavailable
    from gmtool.verify.run import VerifyConfig, build_bench, dyn_dim_batches

    cfg = VerifyConfig(model="qwen3-0.6b", device="cuda", modes="full,piecewise,full-narrow", attention=request.param)
    bench = build_bench(cfg)
    assert unavailable(bench.device) is None, unavailable(bench.device)
    yield request.param, bench, {kind: (a, b) for kind, a, b in dyn_dim_batches(bench, cfg)}
    del bench
    torch.cuda.empty_cache()


def _show(res) -> None:
    g = res.graph_nodes
    print(
        f"\n{res.mode} {res.key} {res.compositions}: {g.nodes[0]} nodes, {g.kernels[0]} kernels, "
        f"{len(g.changes)} changes, {g.unstable} unstable words ignored; notes: {g.notes}"
    )
    for row in g.dependent():
        print("  depends on the composition:", row)
    for c in g.changes[:6]:  # the words themselves: an address the pointer test missed shows as one
        hexed = [hex(x) if isinstance(x, int) else x for x in (c.a, c.b)]
        print(f"  change at node {c.index}/{c.index_b}: {c} ({hexed[0]} vs {hexed[1]})")


def _attributed(bench, mode, batch):
    from gmtool.verify.dyndims import recorded_ops
    from gmtool.verify.graphnodes import NodeReader

    reader = NodeReader()
    nodes = recorded_ops(bench, mode, batch, reader=reader)[2]
    return nodes, reader


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_gmtools_decode_graphs_have_no_composition_dependent_node(rig, mode):
    from gmtool.verify.dyndims import dynamic_dims

    attention, bench, pairs = rig
    res = dynamic_dims(bench, mode, *pairs["decode"])
    _show(res)
    g = res.graph_nodes
    assert g is not None and g.kernels[0] > 100 and g.nodes[0] == g.nodes[1]
    assert g.clean, [str(c) for c in g.changes[:10]]
    # cuBLAS launches its GEMMs with packed arguments, which cannot be read: the only arguments left uncompared
    assert not any(("not compared" in n and "packed" not in n) or "not attributed" in n for n in g.notes), g.notes


def test_nodes_carry_arguments_and_the_module_that_issued_them(rig):
    attention, bench, pairs = rig
    nodes, reader = _attributed(bench, "full", pairs["decode"][0])
    kernels = [n for n in nodes if n.kind == "kernel"]
    # every kernel's arguments are read, except cuBLAS's GEMMs (nvjet_*, launched with packed arguments)
    unread = {n.name for n in kernels if not n.args}
    assert all(name.startswith("nvjet") or "gemm" in name.lower() for name in unread), sorted(unread)[:5]
    in_attn = {n.name for n in kernels if n.module.endswith("self_attn")}
    print(f"\n{len(kernels)} kernels; in self_attn: {sorted(in_attn)[:8]}")
    assert sum(n.module.startswith("model.layers.") for n in kernels) > 0.9 * len(kernels)
    if attention == "triton":
        assert all(any(name.startswith(k) for name in in_attn) for k in ("_decode_split_kernel", "_write_kv_kernel"))


def test_full_narrow_prefill_nodes_that_depend_on_the_composition_are_the_attention_kernels(rig):
    from gmtool.verify.dyndims import dynamic_dims

    attention, bench, pairs = rig
    narrow = dynamic_dims(bench, "full-narrow", *pairs["prefill"])
    _show(narrow)
    rows = narrow.graph_nodes.dependent()
    assert rows and not narrow.clean
    for row in rows:
        assert (
            row["module"].endswith("self_attn")
            or "attn" in row["kernel"].lower()
            or "attention" in row["kernel"].lower()
            or row["kernel"].startswith(GMTOOL_ATTENTION_KERNELS)
        ), row
    if attention == "triton":  # the grid is (num_seqs, tiles of the longest chunk, heads)
        assert all(r["kernel"].startswith("_varlen_kernel") and r["fields"] == ["grid"] for r in rows), rows
    wide = dynamic_dims(bench, "full", *pairs["prefill"])
    _show(wide)
    assert wide.graph_nodes.clean, [str(c) for c in wide.graph_nodes.changes[:10]]
