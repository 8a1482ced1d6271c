"""The native step loop (gmtool.kernels.native_loop, step_loop.c) on the CPU: the C program is compiled with the
system compiler and driven with fake driver entry points (ctypes callbacks) that record every launch. A piecewise
entry of fake CUDA graphs and attention runners bound through TritonAttention (fake Triton kernels, gmtool's own
argument building) launches, per step, the same graphs and kernels in entry.steps order as the Python loop, with
the same grids and parameters read back through the void* array, the step's num_seqs patched in; a step of no
sequence, the interpreter, a layout the driver disagrees with, no compiler: the Python path, and why."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

from gmtool.kernels import launcher, native_loop
from gmtool.kernels.native_loop import GRAPH_LAUNCH, KERNEL_LAUNCH, Driver, NativeUnavailable

STREAM = 0x5EED
LOG: list = []  # what launched, in order: Python path and native loop alike
try:  # the real kernel, before the fixture below swaps in a fake
    from gmtool.kernels.prefill_attention import _varlen_kernel as REAL_VARLEN
except ImportError:  # no triton
    REAL_VARLEN = None

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


# -- fake Triton: typed signatures as Triton would specialize them, metadata, launches logged -----------------------
class FakeCompiled:
    def __init__(self, signature: dict, key: int, **meta):
        self.src = SimpleNamespace(signature=signature)
        self.function, self.packed_metadata = 0xF000 + key, ("meta", key)
        base = dict(num_warps=4 + key, shared=1024 * (key + 1), global_scratch_size=0, profile_scratch_size=0)
        self.metadata = SimpleNamespace(**(base | meta))

    @property
    def run(self):
        def run(gx, gy, gz, stream, function, _packed, _meta, _enter, _exit, *args):
            # as Triton's launcher passes them: fp32 scalars rounded to float32
            values = [
                _f32(v) if t == "fp32" else v for v, t in zip(args, self.src.signature.values()) if t != "constexpr"
            ]
            LOG.append(("kernel", function, (gx, gy, gz), stream, tuple(values)))

        return run


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _type_of(value, loose: bool) -> str:
    """The signature type Triton gives an argument: ints equal to 1 (unless do_not_specialize) and None are
    compiled as constants."""
    if value is None or (isinstance(value, int) and value == 1 and not loose):
        return "constexpr"
    if isinstance(value, torch.Tensor):
        return "*fp32" if value.is_floating_point() else "*i64"
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


FUNCTIONS: dict[int, FakeCompiled] = {}


class FakeKernel:
    def __init__(self, real, key):
        self.arg_names, self.params, self.key = real.arg_names, real.params, key
        self.__name__ = real.fn.__name__ if hasattr(real, "fn") else str(key)
        self.variants = {}

    def __getitem__(self, grid):
        def run(*args, **kw):
            named = dict(zip(self.arg_names, args)) | kw
            sig = {
                n: "constexpr" if p.is_constexpr else _type_of(named[n], p.do_not_specialize)
                for n, p in zip(self.arg_names, self.params)
            }
            key = tuple(sig.items())
            if key not in self.variants:
                self.variants[key] = FakeCompiled(sig, self.key * 4 + len(self.variants))
                FUNCTIONS[self.variants[key].function] = self.variants[key]
            compiled = self.variants[key]
            compiled.run(*grid, STREAM, compiled.function, None, None, None, None, *named.values())
            return compiled

        return run


@pytest.fixture(autouse=True)
def fakes(monkeypatch, tmp_path_factory):
    pytest.importorskip("triton")
    from gmtool.kernels import decode_attention as da, prefill_attention as pa

    for key, (mod, name) in enumerate(((pa, "_varlen_kernel"), (da, "_decode_split_kernel"), (da, "_combine_kernel"))):
        monkeypatch.setattr(mod, name, FakeKernel(getattr(mod, name), key))
    monkeypatch.setattr(launcher, "_stream_source", lambda: ((lambda device: STREAM), 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(native_loop.ENV, raising=False)
    lib = native_loop.load_library(cache=tmp_path_factory.getbasetemp() / "native-cache")
    monkeypatch.setattr(native_loop, "library", lambda: lib)
    monkeypatch.setattr(native_loop, "default_stream", lambda: lambda: STREAM)
    LOG.clear()
    FUNCTIONS.clear()


# -- fake driver: records what the C loop launches, the parameters decoded through the void* array ------------------
def _decode(params, signature: dict) -> tuple:
    out = []
    types = [t for t in signature.values() if t != "constexpr"]
    for i, t in enumerate(types):
        at = params[i]
        if t.startswith("*"):
            out.append(ctypes.c_uint64.from_address(at).value)
        elif t == "fp32":
            out.append(ctypes.c_float.from_address(at).value)
        else:
            out.append({"i32": ctypes.c_int32, "i64": ctypes.c_int64}[t].from_address(at).value)
    scratch = [ctypes.c_uint64.from_address(params[len(types) + j]).value for j in range(2)]
    assert scratch == [0, 0]  # global and profile scratch: null
    return tuple(out)


class FakeDriver:
    def __init__(self, fail_kernel: int = 0, sizes=None, graphs=None):
        self.launch_shapes, self.graph_launches = [], 0

        def graph(exec_handle, stream):
            self.graph_launches += 1
            if graphs is not None and exec_handle in graphs.execs:  # a stitched graph: what each node launches
                LOG.extend(graphs.launch(exec_handle, stream))
                return graphs.fail_launch
            LOG.append(("graph", exec_handle, stream))
            return 0

        def kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            c = FUNCTIONS[function]
            self.launch_shapes.append((function, (bx, by, bz), shared))
            LOG.append(("kernel", function, (gx, gy, gz), stream, _decode(params, c.src.signature)))
            return fail_kernel

        self.cbs = (GRAPH_LAUNCH(graph), KERNEL_LAUNCH(kernel))
        addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        self.driver = Driver(addr(self.cbs[0]), addr(self.cbs[1]), sizes, self.cbs, graphs)


CHILD = 0x10000  # a fake piece's CUgraph: its exec handle + CHILD


class FakeGraphs:
    """The driver's graph building as native_loop.CudaGraphBuilder calls it: graphs of nodes in a chain, execs
    that copy their graph's nodes, kernel nodes holding the parameters copied at add or set time (the driver
    copies the values then). Launching a stitched exec logs what its nodes launch, as the op-by-op path logs."""

    def __init__(self, fail_set: int = 0, fail_add: int = 0):
        self.graphs, self.execs, self.sets, self.destroyed = {}, {}, [], []
        self.fail_set, self.fail_add, self.fail_launch = fail_set, fail_add, 0
        self._ids = iter(range(0x70000, 0x80000))

        def node_set(exec_handle, node, params):
            self.sets.append(node)
            if self.fail_set:
                return self.fail_set
            nodes = self.execs[exec_handle]
            nodes[[n for n, _ in nodes].index(node)] = (node, self._copy(params.contents))
            return 0

        self.cb = native_loop.NODE_SET(node_set)
        self.node_set = ctypes.cast(self.cb, ctypes.c_void_p).value

    @staticmethod
    def _copy(p) -> tuple:
        c = FUNCTIONS[p.func]
        params = ctypes.cast(p.params, ctypes.POINTER(ctypes.c_void_p))
        return ("kernel", p.func, tuple(p.grid), tuple(p.block), p.shared, _decode(params, c.src.signature))

    def create(self):
        g = next(self._ids)
        self.graphs[g] = []
        return g

    def _add(self, graph, deps, what):
        nodes = self.graphs[graph]
        assert deps == ([nodes[-1][0]] if nodes else [])  # a chain, in order
        if self.fail_add and len(nodes) == self.fail_add:
            raise native_loop.NotNative("cuGraphAddKernelNode failed: CUDA error 1")
        node = next(self._ids)
        nodes.append((node, what))
        return node

    def add_child(self, graph, deps, child):
        return self._add(graph, deps, ("graph", child - CHILD))

    def add_kernel(self, graph, deps, params):
        return self._add(graph, deps, self._copy(params))

    def instantiate(self, graph):
        e = next(self._ids)
        self.execs[e] = list(self.graphs[graph])
        return e

    def destroy(self, graph, exec_handle):
        self.destroyed.append((graph, exec_handle))

    def launch(self, exec_handle, stream) -> list:
        out = []
        for _, what in self.execs[exec_handle]:
            if what[0] == "graph":
                out.append(("graph", what[1], stream))
            else:
                _, func, grid, block, shared, params = what
                meta = FUNCTIONS[func].metadata
                assert block == (32 * meta.num_warps, 1, 1) and shared == meta.shared
                out.append(("kernel", func, grid, stream, params))
        return out


class FakeGraph:
    def __init__(self, handle):
        self.handle = handle

    def exec_handle(self):
        return self.handle

    def graph_handle(self):
        return self.handle + CHILD

    def replay(self):
        LOG.append(("graph", self.handle, STREAM))


def _entry(impl="planned", layers=2, plan=((16, 40), (8, 8))):
    from gmtool.core.buckets import BucketKey
    from gmtool.core.executor import AttentionRunner, CapturedGraph
    from gmtool.modes import GraphMode
    from tests.test_launcher import _triton_ctx

    ctx, q, out = _triton_ctx(impl, plan, tokens=64 if impl != "decode" else 2)
    steps = [FakeGraph(0x6000)]
    for layer in range(layers):
        steps += [AttentionRunner(0, q, out, 0.5 + layer, ctx), FakeGraph(0x6001 + layer)]
    return CapturedGraph(BucketKey(64), GraphMode.PIECEWISE, impl, steps, ctx), out


def _step(entry, plan):
    LOG.clear()
    entry.replay(SimpleNamespace(plan=plan))
    return list(LOG)


def _native(monkeypatch, driver: FakeDriver):
    monkeypatch.setattr(native_loop, "cuda_driver", lambda: driver.driver)


def _param(logged, name: str):
    """A logged kernel launch's parameter by name."""
    sig = FUNCTIONS[logged[1]].src.signature
    return logged[4][[k for k, t in sig.items() if t != "constexpr"].index(name)]


PLANS = [((64, 64),), ((30, 40), (20, 30), (14, 14)), ((1, 9), (1, 1))]


@pytest.mark.parametrize("impl", ["planned", "decode"])
def test_native_step_launches_what_the_python_loop_launches(monkeypatch, impl):
    """The native loop's launches, in order, equal the Python loop's: the graphs' exec handles, each kernel's
    function, grid, stream and parameters (pointers, ints, the fp32 scale, the step's num_seqs patched in)."""
    fake = FakeDriver()
    _native(monkeypatch, fake)
    entry, _ = _entry(impl)
    first = _step(entry, PLANS[0])  # the Python loop: each runner's first launch goes through Triton
    assert entry.launch_path == "native" and entry.loop is not None
    assert [x[0] for x in first] == ["graph", "kernel", "graph", "kernel", "graph"] or impl == "decode"
    for plan in PLANS[1:] + PLANS[:1]:
        native = _step(entry, plan)
        with native_loop.python_path(entry):
            python = _step(entry, plan)
        assert native == python, plan
        kinds = [x[0] for x in native]
        graphs = [x[1] for x in native if x[0] == "graph"]
        assert graphs == [0x6000, 0x6001, 0x6002] and kinds[-1] == "graph" and kinds[0] == "graph"
        kernels = [x for x in native if x[0] == "kernel"]
        assert len(kernels) >= 2 and all(x[-2 if x[0] == "kernel" else -1] == STREAM for x in native)
        if impl == "planned":  # one varlen launch per runner, with the step's grid and num_seqs
            n, tiles = len(plan), max(1, -(-max(q for q, _ in plan) // 64))
            assert [x[2] for x in kernels] == [(n, tiles, 4)] * 2
            assert [_param(x, "num_seqs") for x in kernels] == [n, n]
    for function, block, shared in fake.launch_shapes:
        meta = FUNCTIONS[function].metadata
        assert block == (32 * meta.num_warps, 1, 1) and shared == meta.shared


def test_a_second_step_patches_its_own_num_seqs(monkeypatch):
    """Two native steps with other plans: each launch carries its own step's grid and num_seqs, never the
    previous one's (the C loop writes the step value into the packed parameter before each launch)."""
    _native(monkeypatch, FakeDriver())
    entry, _ = _entry("planned", layers=1)
    _step(entry, PLANS[0])
    seen = []
    for plan in (((5, 5),) * 3, ((70, 70),) * 2, ((3, 3),) * 7):
        (kernel,) = [x for x in _step(entry, plan) if x[0] == "kernel"]
        seen.append((kernel[2], _param(kernel, "num_seqs")))
    assert seen == [((3, 1, 4), 3), ((2, 2, 4), 2), ((7, 1, 4), 7)]
    assert entry.ctx.planned_with == [entry.ctx.signature]  # what the step consumed, as the Python loop notes


def test_a_step_of_no_sequence_runs_the_python_way(monkeypatch):
    """A grid of 0 from the step: the C loop launches nothing and the Python loop runs the step (the planned
    runner zeroes its output instead of launching)."""
    _native(monkeypatch, FakeDriver())
    entry, out = _entry("planned")
    _step(entry, PLANS[0])
    out.fill_(3.0)
    log = _step(entry, ())
    assert [x[0] for x in log] == ["graph", "graph", "graph"] and not out.any()
    assert any(x[0] == "kernel" for x in _step(entry, PLANS[1]))  # and the next step is native again


def test_a_failed_launch_raises_with_the_driver_code(monkeypatch):
    _native(monkeypatch, FakeDriver(fail_kernel=700))
    entry, _ = _entry("planned")
    _step(entry, PLANS[0])
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        _step(entry, PLANS[1])


# -- the Python path, and why ---------------------------------------------------------------------------------------
def _path_after_one_step(monkeypatch, driver=None, **entry_kw):
    _native(monkeypatch, driver or FakeDriver())
    entry, _ = _entry(**entry_kw)
    _step(entry, PLANS[0])
    return entry


def _sizes(function: int) -> list[int]:
    """The parameter sizes of a compiled fake, as the driver would report them: the launcher's layout."""
    sig = FUNCTIONS[function].src.signature.values()
    return [8 if t[0] == "*" or t == "i64" else 4 for t in sig if t != "constexpr"] + [8, 8]


def _reporting(sizes):
    """param_info(function, index) -> (rc, size) over sizes(function); rc 1 (invalid value) past the end."""
    return lambda f, i: (0, sizes(f)[i]) if i < len(sizes(f)) else (1, 0)


def test_the_driver_s_layout_is_checked(monkeypatch):
    """cuFuncGetParamInfo (where the driver has it) against the packed layout: count and each size."""
    assert _path_after_one_step(monkeypatch, FakeDriver(sizes=_reporting(_sizes))).launch_path == "native"
    for sizes, why in (
        (lambda f: [8] * len(_sizes(f)), "is 8 bytes for the driver, 4 in the packed layout"),
        (lambda f: _sizes(f) + [8], "the driver knows more parameters than the"),
        (lambda f: _sizes(f)[:3], "the driver knows 3 parameters (error 1 asking for one more)"),
    ):
        path = _path_after_one_step(monkeypatch, FakeDriver(sizes=_reporting(sizes))).launch_path
        assert path.startswith("python: ") and why in path, path


def test_no_compiler_keeps_the_python_path(monkeypatch, tmp_path):
    with pytest.raises(NativeUnavailable, match="no C compiler"):
        native_loop.build_library(cc="/nonexistent/cc", cache=tmp_path)
    monkeypatch.setattr(native_loop, "library", lambda: "no C compiler (cc is not on PATH; set CC)")
    entry = _path_after_one_step(monkeypatch)
    assert entry.launch_path == "python: no C compiler (cc is not on PATH; set CC)" and entry.loop is None
    assert [x[0] for x in _step(entry, PLANS[1])] == ["graph", "kernel", "graph", "kernel", "graph"]


def test_the_interpreter_keeps_the_python_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _path_after_one_step(monkeypatch).launch_path
    assert path.startswith("python: ") and "interpreter" in path


def test_scratch_keeps_the_python_path(monkeypatch):
    monkeypatch.setattr(FakeCompiled, "__init__", _with_scratch(FakeCompiled.__init__))
    path = _path_after_one_step(monkeypatch).launch_path
    assert path.startswith("python: ") and "scratch" in path


@pytest.mark.parametrize("off", ["0", "false", " OFF", "no"])
def test_the_switch_turns_it_off(monkeypatch, off):
    """Every GMTOOL_* switch takes the same off words (gmtool.switches): 'false' left this one on."""
    monkeypatch.setenv(native_loop.ENV, off)
    assert _path_after_one_step(monkeypatch).launch_path == f"python: GMTOOL_NATIVE_LOOP={off}"


def _with_scratch(init):
    def patched(self, signature, key, **meta):
        init(self, signature, key, **(meta | {"global_scratch_size": 128}))

    return patched


def test_torch_runners_and_the_cpu_tape_keep_the_python_path():
    """The CPU tape's graphs have nothing to launch natively; torch attention runners have no bound launch."""
    from tests.helpers import Rig

    rig = Rig(mode="piecewise", buckets=(16,))
    b = rig.batch("10+6", seed=1)
    rig.graph(b)
    entry = rig.ex.graphs[rig.ex.key_for(b)]
    assert entry.launch_path == "python: TapeGraph steps have no native launch" and entry.loop is None


def test_a_segment_around_a_python_runner(monkeypatch):
    """A runner the loop cannot launch splits the entry: native before it, Python for it and for the lone graph
    after it (a segment without a runner would save nothing over torch's replay)."""
    _native(monkeypatch, FakeDriver())
    entry, _ = _entry("planned")
    torch_runner = entry.steps[3]
    torch_runner.launch = lambda: LOG.append(("torch",))
    _step(entry, PLANS[0])
    assert entry.launch_path.startswith("native for 3 of 5 steps; python: a runner without bound Triton launches")
    log = _step(entry, PLANS[1])
    assert [x[0] for x in log] == ["graph", "kernel", "graph", "torch", "graph"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90")
def test_the_packed_layout_is_the_compiled_kernel_s():
    """The installed Triton's own compiled varlen kernel (sm_90, no GPU): the metadata asks for nothing the loop
    leaves out, and the packed layout (the non-constexpr parameters, then the two null scratch pointers) has the
    count and sizes of the .entry's parameters in its PTX, which is what cuFuncGetParamInfo reports on CUDA."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels.launcher import DIRECT, STEP_SEQS, BoundKernel, KernelLaunch
    from gmtool.kernels.testing import compile_for_hopper

    consts = dict(G=2, D=64, D_PAD=64, DV=64, DV_PAD=64, PAGE=16, BLOCK_M=64, BLOCK_N=64, WIDE=False, PREC="tf32")
    consts |= dict(WINDOW=0, SOFTCAP=0.0, SINKS=False)
    idx = ("bt_ptr", "lens_ptr", "cu_ptr")
    arg_type = lambda n: ("*i64" if n in idx else "*bf16") if n.endswith("_ptr") else "fp32" if "scale" in n else "i32"  # noqa: E731
    compiled = compile_for_hopper(REAL_VARLEN, consts, arg_type)
    assert native_loop._metadata_problem(compiled.metadata) is None
    compiled.function = 0x1234  # loaded on a GPU only
    bound = BoundKernel.__new__(BoundKernel)
    names = REAL_VARLEN.arg_names
    bound.kernel, bound.slots, bound.path, bound.compiled = REAL_VARLEN, (names.index("num_seqs"),), DIRECT, compiled
    bound._direct = [0x1000 * i if n.endswith("_ptr") else 0.5 if "scale" in n else i for i, n in enumerate(names)]
    op = native_loop.KernelOp(KernelLaunch(bound, (STEP_SEQS, 1, 16), (STEP_SEQS,)))
    ptx = re.search(r"\.entry\s+\w+\s*\((.*?)\)", compiled.asm["ptx"], re.S).group(1)
    ptx_sizes = [int(w[-2:]) // 8 for w in re.findall(r"\.param\s+\.([busf]\d\d)", ptx)]
    assert op.sizes == tuple(ptx_sizes) and len(ptx_sizes) == len(names) - len(consts) + 2
    assert op.patches == [(names.index("num_seqs"), 4, 0)] and op.block == 128 and op.shared == compiled.metadata.shared


def test_the_c_source_ships_in_the_wheel():
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gmtool"]
    assert native_loop.SOURCE.is_file() and any(fnmatch("kernels/step_loop.c", g) for g in globs)


def test_without_a_driver_the_reason_is_given():
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed here")
    except OSError:
        pass
    native_loop.cuda_driver.cache_clear()
    why = native_loop.cuda_driver()
    assert isinstance(why, str) and "libcuda.so.1" in why


# -- stitched: one graph launch per step -----------------------------------------------------------------------------
def _stitched(monkeypatch, graphs=None, **entry_kw):
    graphs = graphs or FakeGraphs()
    fake = FakeDriver(graphs=graphs)
    _native(monkeypatch, fake)
    entry, out = _entry(**entry_kw)
    _step(entry, PLANS[0])
    return entry, fake, graphs


@pytest.mark.parametrize("impl", ["planned", "decode"])
def test_a_stitched_step_launches_what_the_python_loop_launches(monkeypatch, impl):
    """Where the driver builds graphs, each native segment is one graph (the pieces as child graphs, the
    runners' kernels as kernel nodes, in order): a step is one launch of it, and what its nodes launch (their
    grids and parameters as last set) equals the Python loop's launches for every plan, in any order."""
    entry, fake, graphs = _stitched(monkeypatch, impl=impl)
    assert entry.launch_path == native_loop.STITCHED
    # the last two differ in query tiles alone (the grid's second value), not in num_seqs
    plans = PLANS[1:] + PLANS[:1] + PLANS[1:2] + [((64, 64),), ((70, 70),)]
    before = fake.graph_launches
    stitched = [_step(entry, plan) for plan in plans]  # one run, no A/B in between: nodes as the steps left them
    assert fake.graph_launches == before + len(plans)  # the whole segment: one graph launch per step
    with native_loop.python_path(entry):
        python = [_step(entry, plan) for plan in plans]
    with native_loop.unstitched(entry):
        by_op = [_step(entry, plan) for plan in plans]
    for plan, a, b, c in zip(plans, stitched, python, by_op):
        assert a == b == c, plan


def test_a_run_of_one_shape_sets_no_node(monkeypatch):
    """Kernel nodes are set when the step's values change, and only then: a run of steps of one plan launches
    the graph as it stands; the next plan sets every kernel node once, with its own grid and num_seqs."""
    entry, fake, graphs = _stitched(monkeypatch, layers=2)
    _step(entry, PLANS[1])
    first = native_loop.node_sets(entry)
    assert first == 2  # one varlen kernel per runner
    for _ in range(3):
        _step(entry, PLANS[1])
    assert native_loop.node_sets(entry) == first
    log = _step(entry, ((3, 3),) * 7)
    assert native_loop.node_sets(entry) == first + 2
    assert [(x[2], _param(x, "num_seqs")) for x in log if x[0] == "kernel"] == [((7, 1, 4), 7)] * 2


def test_a_failed_node_update_raises_and_sets_again(monkeypatch):
    """A driver error while setting a node: the step raises with the op and the code, and the next step sets
    every node again (none is taken as already holding the new values)."""
    graphs = FakeGraphs()
    entry, fake, _ = _stitched(monkeypatch, graphs)
    graphs.fail_set = 700
    with pytest.raises(RuntimeError, match="update of .* failed: CUDA error 700"):
        _step(entry, PLANS[1])
    graphs.fail_set = 0
    stitched = _step(entry, PLANS[1])
    with native_loop.python_path(entry):
        assert stitched == _step(entry, PLANS[1])
    graphs.fail_launch = 719
    with pytest.raises(RuntimeError, match="stitched graph failed: CUDA error 719"):
        _step(entry, PLANS[2])


def test_what_keeps_a_segment_unstitched(monkeypatch):
    """A piece without its CUgraph, a failed build (nothing kept: the graph destroyed) and the switch: native op
    by op, and the path says why."""
    kept = FakeGraph.graph_handle
    monkeypatch.setattr(FakeGraph, "graph_handle", lambda self: (_ for _ in ()).throw(launcher.NotNative("not kept")))
    entry, _, _ = _stitched(monkeypatch)
    assert entry.launch_path == "native (not stitched: FakeGraph: not kept)"
    monkeypatch.setattr(FakeGraph, "graph_handle", kept)
    entry, _, graphs = _stitched(monkeypatch, FakeGraphs(fail_add=2))
    assert entry.launch_path == "native (not stitched: cuGraphAddKernelNode failed: CUDA error 1)"
    assert len(graphs.destroyed) == 1 and graphs.destroyed[0][1] is None
    assert [x[0] for x in _step(entry, PLANS[1])] == ["graph", "kernel", "graph", "kernel", "graph"]
    monkeypatch.setenv(native_loop.STITCH_ENV, "0")
    entry, _, _ = _stitched(monkeypatch)
    assert entry.launch_path == native_loop.NATIVE


def test_a_dropped_loop_destroys_its_graph(monkeypatch):
    """The stitched graph and its exec go with the entry's loop (release drops it before the pools)."""
    import gc

    entry, _, graphs = _stitched(monkeypatch)
    assert graphs.destroyed == []
    entry.loop = None
    gc.collect()
    assert len(graphs.destroyed) == 1 and all(graphs.destroyed[0])
