"""The CUDA graph-node diff without CUDA: the alignment and comparison of node records, the reading of kernel
arguments through a stand-in for cuda-bindings' driver API (real ctypes memory, as the driver hands it over), the
attribution of nodes to modules, and the dynamic-dimension table."""

import ctypes
from enum import Enum, IntEnum
from types import SimpleNamespace

import pytest

from gmtool.verify.graphnodes import NodeReader, NodeSampler, scalar_params
from gmtool.verify.nodediff import PTR, Node, diff_nodes, fold_layers, short_name
from gmtool.verify.report import _findings, dyndims_frame


def gemm(module, m=64):
    return Node(
        "kernel",
        "_ZN7cutlass6KernelI4GemmEEvT_",
        module,
        (m // 64, 4, 1),
        (128, 1, 1),
        0,
        ((PTR,), (PTR,), (m,), (4096,)),
    )


def attn(layer, tiles, num_seqs=2):
    return Node(
        "kernel",
        "_varlen_kernel",
        f"model.layers.{layer}.self_attn",
        (num_seqs, tiles, 16),
        (128, 1, 1),
        0,
        ((PTR,), (PTR,), (num_seqs,), (PTR, 8, 0)),
    )


def layers(tiles: int, n: int = 2, extra: dict | None = None) -> list[Node]:
    out = []
    for i in range(n):
        out += [
            gemm(f"model.layers.{i}.self_attn.qkv_proj"),
            attn(i, tiles),
            *(extra or {}).get(i, []),
            gemm(f"model.layers.{i}.mlp.down_proj"),
            Node("memset", "", f"model.layers.{i}.mlp", args=((0,), (4,), (256,), (1,))),
        ]
    return out


# -- the diff -------------------------------------------------------------------------------------------------
def test_two_captures_that_differ_only_in_buffer_addresses_are_clean():
    res = diff_nodes(layers(2), layers(2), layers(2))
    assert res.clean and res.nodes == (8, 8) and res.kernels == (6, 6) and res.unstable == 0
    assert res.dependent() == [] and res.to_dict()["clean"]


def test_the_attention_kernels_whose_grid_depends_on_the_composition_are_named():
    res = diff_nodes(layers(2), layers(3), layers(2))
    assert not res.clean
    assert {(c.index, c.field, c.a, c.b) for c in res.changes} == {
        (1, "grid", (2, 2, 16), (2, 3, 16)),
        (5, "grid", (2, 2, 16), (2, 3, 16)),
    }
    assert res.dependent() == [
        {"kernel": "_varlen_kernel", "module": "model.layers.*.self_attn", "nodes": 2, "fields": ["grid"]}
    ]
    assert "_varlen_kernel in model.layers.0.self_attn: grid (2, 2, 16) vs (2, 3, 16)" == str(res.changes[0])


def test_a_scalar_argument_word_inside_a_struct_is_named_by_argument():
    b = layers(2)
    b[1] = Node(**{**b[1].__dict__, "args": ((PTR,), (PTR,), (2,), (PTR, 12, 0))})
    res = diff_nodes(layers(2), b)
    assert [(c.index, c.field, c.a, c.b) for c in res.changes] == [(1, "arg 3 word 1", 8, 12)]
    assert res.dependent()[0]["fields"] == ["arg 3"]


def test_a_kernel_in_one_capture_only_is_named_and_the_rest_stays_aligned():
    extra = Node("kernel", "at::native::copy_kernel", "model.layers.0.self_attn")
    a, b = layers(2), layers(2, extra={0: [extra]})
    b[6] = attn(1, 3)  # layer 1's attention, shifted one place by the extra kernel, differs too
    res = diff_nodes(a, b)
    assert [(c.index, c.index_b, c.field, c.a, c.b) for c in res.changes] == [
        (5, 6, "grid", (2, 2, 16), (2, 3, 16)),
        (-1, 2, "node", "absent", "present"),
    ]
    rows = {r["kernel"]: r for r in res.dependent()}
    assert rows["at::native::copy_kernel"]["fields"] == ["node"] and rows["_varlen_kernel"]["nodes"] == 1


def test_words_that_differ_between_two_captures_of_one_batch_are_left_out_and_counted():
    noisy = layers(2)
    noisy[2] = Node(**{**noisy[2].__dict__, "args": ((PTR,), (PTR,), (64,), (0xDEAD,))})  # padding garbage
    b = layers(3)
    b[2] = Node(**{**b[2].__dict__, "args": ((PTR,), (PTR,), (64,), (0xBEEF,))})
    res = diff_nodes(layers(2), b, control=noisy)
    assert res.unstable == 1 and {c.field for c in res.changes} == {"grid"}
    assert "arg 3" in {c.field for c in diff_nodes(layers(2), b).changes}  # without the control: reported


def test_a_control_that_differs_in_structure_is_said():
    res = diff_nodes(layers(2), layers(2), control=layers(2)[:-1])
    assert res.clean and "not deterministic" in res.notes[0]


def test_names_are_readable():
    assert (
        short_name("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_T1_")
        == "at::native::vectorized_elementwise_kernel"
    )
    assert short_name("_Z10add_kernelPfS_") == "add_kernel"
    assert short_name("_varlen_kernel") == "_varlen_kernel"
    assert fold_layers("model.layers.11.self_attn.o_proj") == "model.layers.*.self_attn.o_proj"


# -- reading nodes through the driver API ----------------------------------------------------------------------
class CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_SUPPORTED = 801


class NodeType(Enum):
    CU_GRAPH_NODE_TYPE_KERNEL = 0
    CU_GRAPH_NODE_TYPE_MEMSET = 2
    CU_GRAPH_NODE_TYPE_EVENT_RECORD = 7


class Handle(int):
    def __new__(cls, init_value=0):
        return super().__new__(cls, init_value)


DEVICE = range(0x7F0000000000, 0x7F0000100000)  # the one allocation the fake device has


class FakeDriver:
    """The subset of cuda.bindings.driver graphnodes calls, returning what the bindings return: (status, *values)."""

    CUresult = CUresult
    CUgraph = CUstream = CUdeviceptr = Handle
    CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR=11)
    CUstreamCaptureStatus = SimpleNamespace(CU_STREAM_CAPTURE_STATUS_ACTIVE=1)

    def __init__(self, param_info=True):
        self.keep = []  # the argument memory, alive as long as the graph
        self.nodes = {}
        self.sizes = {101: [8, 4, 24, 8]}
        self.param_info = param_info

    def kernel(self, handle, func, name, values: list[bytes], grid=(4, 1, 1)):
        bufs = [ctypes.create_string_buffer(v, len(v)) for v in values]
        slots = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        self.keep += [bufs, slots]
        self.nodes[handle] = (
            "kernel",
            SimpleNamespace(
                func=Handle(func),
                kern=Handle(0),
                gridDimX=grid[0],
                gridDimY=grid[1],
                gridDimZ=grid[2],
                blockDimX=128,
                blockDimY=1,
                blockDimZ=1,
                sharedMemBytes=0,
                kernelParams=ctypes.addressof(slots),
            ),
            name,
        )

    def cuGraphGetNodes(self, graph, n):
        handles = sorted(self.nodes)
        return CUresult.CUDA_SUCCESS, (handles[:n] if n else None), len(handles)

    def cuGraphNodeGetType(self, h):
        return CUresult.CUDA_SUCCESS, NodeType["CU_GRAPH_NODE_TYPE_" + self.nodes[h][0].upper()]

    def cuGraphKernelNodeGetParams(self, h):
        return CUresult.CUDA_SUCCESS, self.nodes[h][1]

    def cuGraphMemsetNodeGetParams(self, h):
        return CUresult.CUDA_SUCCESS, self.nodes[h][1]

    def cuFuncGetName(self, func):
        return CUresult.CUDA_SUCCESS, next(n[2] for n in self.nodes.values() if n[1].func == func).encode()

    def cuFuncGetParamInfo(self, func, i):
        if not self.param_info:
            return CUresult.CUDA_ERROR_NOT_SUPPORTED, 0, 0
        sizes = self.sizes[int(func)]
        if i >= len(sizes):
            return CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0
        return CUresult.CUDA_SUCCESS, sum(sizes[:i]), sizes[i]

    def cuPointerGetAttribute(self, attr, ptr):
        return (CUresult.CUDA_SUCCESS if int(ptr) in DEVICE else CUresult.CUDA_ERROR_INVALID_VALUE), 0


def q(*words: int) -> bytes:
    return b"".join(w.to_bytes(8, "little") for w in words)


@pytest.fixture
def driver():
    d = FakeDriver()
    ptr = DEVICE.start + 4096
    d.kernel(1, 101, "_varlen_kernel", [q(ptr), (7).to_bytes(4, "little"), q(64, ptr + 64, 3), q(0)], grid=(2, 3, 16))
    d.nodes[2] = ("memset", SimpleNamespace(value=0, elementSize=4, width=512, height=1), "")
    d.nodes[3] = ("event_record", None, "")
    return d


def test_kernel_arguments_are_read_as_words_with_device_addresses_masked(driver):
    reader = NodeReader(driver)
    nodes = reader.graph_nodes(1234, module_of=lambda i: ["model.layers.0.self_attn", "", "model"][i])
    assert nodes == [
        Node(
            "kernel",
            "_varlen_kernel",
            "model.layers.0.self_attn",
            (2, 3, 16),
            (128, 1, 1),
            0,
            ((PTR,), (7,), (64, PTR, 3), (0,)),
        ),
        Node("memset", "", "", args=((0,), (4,), (512,), (1,))),
        Node("event_record", "", "model"),
    ]
    assert reader.notes == set()


def test_a_cpp_kernels_struct_arguments_are_compared_by_size_only(driver):
    """ATen passes by-value structs whose unused slots hold host stack bytes: two captures of one batch can
    differ there. Their size is compared, their words are not; a C++ kernel's 4- and 8-byte scalars still are."""
    name = "_ZN2at6native29vectorized_elementwise_kernelILi4EEEviT0_T1_"
    driver.sizes[102] = [4, 24, 1]
    reader = NodeReader(driver)
    nodes = []
    for garbage in (0x4657B9BE44A76C00, 0x5E7C7870):
        driver.nodes.clear()
        driver.kernel(5, 102, name, [(512).to_bytes(4, "little"), q(3, garbage, 0), b"\xe0"])
        nodes.append(reader.graph_nodes(1)[0])
    assert nodes[0].args == ((512,), ("struct of 24 bytes",), ("struct of 1 bytes",))
    assert diff_nodes([nodes[0]], [nodes[1]]).clean
    driver.nodes.clear()
    driver.kernel(5, 102, name, [(256).to_bytes(4, "little"), q(3, 0, 0), b"\x00"])
    changed = diff_nodes([nodes[0]], reader.graph_nodes(1)).changes
    assert [(c.field, c.a, c.b) for c in changed] == [("arg 0", 512, 256)]
    assert any("struct" in n for n in reader.notes)


POW = (  # ATen's x.pow(2) in RMSNorm: (int N, a lambda, std::array<char*, 2>), as cuFuncGetName gave it on the H200
    "_ZN2at6native29vectorized_elementwise_kernelILi4EZNS0_51_GLOBAL__N__b1108092_12_PowKernel_cu_751192d7_2139629"
    "pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_EUlfE_St5arrayIPcLm2EEEEviS6_T1_"
)


def test_the_demangled_signature_says_which_cpp_arguments_are_structs():
    assert scalar_params(POW) == [True, False, False]  # int N; the lambda and the array are by-value structs
    assert scalar_params("_Z3fooiPfdj") == [True, True, True, True]  # int, float*, double, unsigned int
    assert scalar_params("_small_m_kernel") is None  # not C++: Triton kernels' arguments are all compared
    assert scalar_params(POW, demangle=None) is None


def test_a_lambda_of_scalar_size_is_compared_by_size_not_as_a_scalar(driver):
    """On the H200 the 4-byte closure of pow's lambda held host bytes in one layer of 28: read as a scalar, the
    dynamic-dimension diff called piecewise decode unsafe. The demangled signature makes it a struct."""
    driver.sizes[103] = [4, 4, 16]
    reader = NodeReader(driver)
    nodes = []
    for n, garbage in ((512, 215816736), (512, 725278992), (256, 725278992)):
        driver.nodes.clear()
        driver.kernel(6, 103, POW, [n.to_bytes(4, "little"), garbage.to_bytes(4, "little"), q(0, 0)])
        nodes.append(reader.graph_nodes(1)[0])
    assert nodes[0].args == ((512,), ("struct of 4 bytes",), ("struct of 16 bytes",))
    assert diff_nodes([nodes[0]], [nodes[1]]).clean
    assert [(c.field, c.a, c.b) for c in diff_nodes([nodes[0]], [nodes[2]]).changes] == [("arg 0", 512, 256)]


def test_without_argument_sizes_arguments_are_not_compared_and_that_is_said(driver):
    driver.param_info = False
    reader = NodeReader(driver)
    kernel = reader.graph_nodes(1234)[0]
    assert kernel.args == () and kernel.grid == (2, 3, 16)
    assert any("cuFuncGetParamInfo" in n for n in reader.notes)


def test_nodes_are_attributed_to_the_module_running_when_they_were_captured(driver, monkeypatch):
    """Readings at every op and module boundary: nodes added between two readings belong to the module running."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=9))
    count = {"n": 0}
    driver.cuStreamGetCaptureInfo = lambda s: (CUresult.CUDA_SUCCESS, 1, 5, Handle(77), [], 0)
    driver.cuGraphGetNodes = lambda g, n: (CUresult.CUDA_SUCCESS, None, count["n"])
    tracker = SimpleNamespace(current="")
    s = NodeSampler(driver, tracker)
    for module, launched in [
        ("model.embed_tokens", 1),
        ("model.layers.0.self_attn", 0),
        ("model.layers.0.self_attn", 2),
        ("model.layers.0.mlp", 3),
        ("", 1),
    ]:
        tracker.current = module
        count["n"] += launched
        s.sample()
    of = s.module_of(77)
    assert [of(i) for i in range(8)] == [
        "model.embed_tokens",
        *["model.layers.0.self_attn"] * 2,
        *["model.layers.0.mlp"] * 3,
        "",
        "",
    ]
    assert s.module_of(78)(0) == "" and s.failed is None


# -- the table and the findings -------------------------------------------------------------------------------
def _record(mode, diff, expected_unsafe=False):
    return {
        "mode": mode,
        "kind": "prefill",
        "key": "t256",
        "compositions": ["128+128", "64+192"],
        "ops": (900, 900),
        "baked": [],
        "diverged_at": None,
        "note": None,
        "graph_nodes": diff.to_dict(),
        "clean": diff.clean,
        "expected_unsafe": expected_unsafe,
    }


def test_the_table_names_the_dependent_kernels_and_a_safe_mode_with_them_is_a_finding():
    narrow, full = diff_nodes(layers(2), layers(3)), diff_nodes(layers(2), layers(2))
    doc = {
        "capturability": [],
        "runs": [],
        "dynamic_dims": [_record("full", full), _record("full-narrow", narrow, True)],
    }
    df = dyndims_frame(doc)
    assert list(df["result"]) == ["clean", "BAKED IN (expected)"]
    assert df["depends on the composition"][1] == "_varlen_kernel in model.layers.*.self_attn x2 (grid)"
    assert df["graph nodes"][1] == "6 kernels, 2 changed"
    cpu = {**doc, "dynamic_dims": [{**d, "graph_nodes": None} for d in doc["dynamic_dims"]]}
    assert "graph nodes" not in dyndims_frame(cpu).columns  # the CPU tape compares no nodes: no column of '-'
    assert _findings(doc) == []  # full-narrow's finding is the bug it exists to show
    doc["dynamic_dims"][1]["expected_unsafe"] = False
    assert "kernel _varlen_kernel in model.layers.*.self_attn (grid)" in _findings(doc)[0]
