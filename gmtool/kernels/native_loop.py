"""A piecewise step's launches made by one call into C (step_loop.c) instead of a Python loop over its steps.

A piecewise step alternates graph pieces and attention runners: 29 torch CUDAGraph.replay calls (4.7 us of host
time each on the H200) and 28 direct Triton launches (6 us each) for a 28-layer model, where one full graph costs
one launch. After an entry's first replay every runner's kernels have compiled and gone direct
(gmtool.kernels.launcher), so each launch is fixed but for the step's grid and num_seqs: the entry's graphs and
kernels become one program (StepLoop), and a step is one call that takes those values (ForwardContext.step_grid)
and launches everything in order through the driver (cuGraphLaunch, cuLaunchKernel).

What the program holds per kernel: the CUfunction, 32 * num_warps threads, the shared memory bytes and a packed
parameter buffer laid out as Triton 3.x's launcher lays it (3.6 and 3.9 alike): every non-constexpr parameter
in order (pointers 8 bytes, i32 4, i64 8, fp32 4 ...), then the scratch pointers that launcher appends, null
while the kernel needs no scratch (global_scratch, and profile_scratch in the Triton versions whose metadata
has profile_scratch_size). A kernel that needs scratch, clusters, PDL, a cooperative grid or an instrumented
build keeps the Python path. On CUDA the layout is checked against the driver's (cuFuncGetParamInfo: count and
each size) where the driver has it.

What the loop skips from torch's CUDAGraph.replay: the captured generators' philox offsets. The model runs in eval
mode and gmtool's forward draws no random numbers; an RNG op inside a captured forward (gmtool verify reports it,
capturability's Hazard.RNG, without refusing capture) would repeat its numbers under the native loop.

Steps the loop cannot launch (torch attention runners, the CPU tape's graphs) run in Python, in
order, between native segments; `CapturedGraph.launch_path` says which ran and why. GMTOOL_NATIVE_LOOP=0 turns
it off (for A/B in benchmarks).

Stitched (launch_path "stitched", the default where the driver builds graphs): each native segment becomes one
CUDA graph, built once, its pieces as child graph nodes and its kernels as kernel nodes in order; a step is one
cuGraphLaunch, after setting the kernel nodes (cuGraphExecKernelNodeSetParams) only when the step's values
differ from those the nodes hold. The LM head ends the last piece (gmtool.core.forwards.lm_head), so a step is
that one launch: on the H200 (2026-12-01, qwen3-0.6b prefill 128, 28 runners) a replay took 14.5-14.9 us of
host time back to back against the full graph's 12.6-13.4 (tools/stitched_launch_probe.py); with the head
run eagerly after the graph it had taken 69-154 us. Setting the 28 attention nodes when the grid changes
costs about 2 us a runner (tools/native_loop_timing.py). Attention still runs at each step's own launch
shape: the graph holds no attention kernel at a captured grid. GMTOOL_STITCH=0 launches op by op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Callable, NamedTuple

from gmtool.switches import switched_off
from gmtool.kernels.launcher import DIRECT, PENDING, KernelLaunch, NotNative, StepValue

SOURCE = Path(__file__).with_name("step_loop.c")
ABI = 2  # gmt_abi_version() of the source this module speaks to
VALUES = 4  # per-step values one call takes (GMT_VALUES)
GRAPH, KERNEL = 0, 1
EMPTY_GRID, INT_RANGE, BAD_PROGRAM = -1, -2, -3  # nothing launched
NATIVE = "native"
STITCHED = "stitched"  # native, and each segment one graph launch (stitch)
PYTHON = "python"
ENV = "GMTOOL_NATIVE_LOOP"
STITCH_ENV = "GMTOOL_STITCH"  # 0: native segments launch op by op
MAX_SHARED = 228 * 1024  # above it Triton 3.9 launches with an attribute the loop does not set
PENDING_RETRIES = 3  # replays that may still find a runner's kernel not launched yet before the loop gives up

# parameter types as Triton's launcher packs them: struct format, bytes
_SCALARS = {
    "i32": ("<i", 4),
    "i64": ("<q", 8),
    "u32": ("<I", 4),
    "u64": ("<Q", 8),
    "fp32": ("<f", 4),
    "f32": ("<f", 4),
    "fp64": ("<d", 8),
}
_PATCHABLE = {"i32": 4, "i64": 8}  # the types a step value may be patched into


class NativeUnavailable(Exception):
    """The loop cannot run in this process at all (no compiler, no driver); the message says why."""


# -- the C program, built on first use --------------------------------------------------------------------------------
def build_library(cc: str | None = None, cache: Path | None = None) -> Path:
    """Compile step_loop.c (or reuse the build of the same source and flags) into a per-user cache directory."""
    from gmtool.memory.vmm import _writable_dir, cache_dir

    compiler = cc or os.environ.get("CC") or "cc"
    found = shutil.which(compiler) or (shutil.which("cc") if cc is None else None)
    if found is None:
        raise NativeUnavailable(f"no C compiler ({compiler} is not on PATH; set CC)")
    flags = ["-O2", "-shared", "-fPIC"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = _writable_dir(cache or cache_dir()) or _writable_dir(Path(tempfile.gettempdir()) / "gmtool-cache")
    if out_dir is None:
        raise NativeUnavailable("no writable cache directory for the step loop's build (set GMTOOL_CACHE_DIR)")
    target = out_dir / f"step_loop-{key}.so"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    proc = subprocess.run([found, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        first = (proc.stderr.strip().splitlines() or ["no output"])[0]
        raise NativeUnavailable(f"{compiler} could not compile step_loop.c: {first}")
    os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
    return target


def load_library(cc: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(cc, cache)))
    if lib.gmt_abi_version() != ABI:
        raise NativeUnavailable(f"step_loop.c speaks ABI {lib.gmt_abi_version()}, this module {ABI}")
    lib.gmt_run.restype = ctypes.c_int
    lib.gmt_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * VALUES
    return lib


@functools.cache
def library() -> ctypes.CDLL | str:
    """The process's loaded step loop, or why there is none (asked once per process)."""
    try:
        return load_library()
    except (NativeUnavailable, OSError) as e:
        return str(e)


# -- the driver's entry points ----------------------------------------------------------------------------------------
GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
KERNEL_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
)


class Driver(NamedTuple):
    """Addresses of cuGraphLaunch and cuLaunchKernel (or fakes with their signatures), and param_info(function,
    index) -> (rc, size) from cuFuncGetParamInfo, None where the driver lacks it. graphs: what builds stitched
    graphs (CudaGraphBuilder's methods), None: segments launch op by op. keep: what must stay alive."""

    graph_launch: int
    kernel_launch: int
    param_info: Callable | None = None
    keep: tuple = ()
    graphs: object | None = None


@functools.cache
def cuda_driver() -> Driver | str:
    """libcuda.so.1's entry points, resolved once per process; or why not."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        graph, kernel = cu.cuGraphLaunch, cu.cuLaunchKernel
    except (OSError, AttributeError) as e:
        return f"the CUDA driver's launch entry points are missing: {e}"
    info = getattr(cu, "cuFuncGetParamInfo", None)  # CUDA 12.4+
    param_info = None
    if info is not None:
        info.restype = ctypes.c_int
        info.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]

        def param_info(function: int, index: int) -> tuple[int, int]:
            off, size = ctypes.c_size_t(), ctypes.c_size_t()
            return info(function, index, ctypes.byref(off), ctypes.byref(size)), size.value

    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    try:
        graphs = CudaGraphBuilder(cu)
    except AttributeError:  # a driver without the graph-building entry points: op by op
        graphs = None
    return Driver(addr(graph), addr(kernel), param_info, (cu,), graphs)


class NodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (step_loop.c's gmt_node_params); the v1 entry points read its first fields."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


NODE_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(NodeParams))


class CudaGraphBuilder:
    """The driver calls that build a stitched graph (one per segment, once), and the address of
    cuGraphExecKernelNodeSetParams the C loop calls per step. Each method returns a handle or raises
    NotNative with the driver's code. Tests hand in a fake with the same methods.

    Each piece goes in as one child graph node. Copying its nodes in instead (a flat graph, as one capture
    makes) was tried and launched no faster: 79 against 80 us of host time per launch (H200, 2026-12-01, a
    28-layer prefill step); and cuBLAS's programmatic edges cannot be copied by the v1 edge query.
    """

    def __init__(self, cu: ctypes.CDLL):
        def fn(name, *args):
            f = getattr(cu, name + "_v2", None) or getattr(cu, name)
            f.restype, f.argtypes = ctypes.c_int, list(args)
            return f

        P, VP, SZ = ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_size_t
        self._create = fn("cuGraphCreate", P, ctypes.c_uint)
        self._child = fn("cuGraphAddChildGraphNode", P, VP, P, SZ, VP)
        self._kernel = fn("cuGraphAddKernelNode", P, VP, P, SZ, ctypes.POINTER(NodeParams))
        self._instantiate = cu.cuGraphInstantiateWithFlags
        self._instantiate.restype, self._instantiate.argtypes = ctypes.c_int, [P, VP, ctypes.c_ulonglong]
        self._destroy_exec, self._destroy = fn("cuGraphExecDestroy", VP), fn("cuGraphDestroy", VP)
        self.node_set = ctypes.cast(fn("cuGraphExecKernelNodeSetParams", VP, VP, VP), ctypes.c_void_p).value

    @staticmethod
    def _out(call, what: str, *args) -> int:
        h = ctypes.c_void_p()
        rc = call(ctypes.byref(h), *args)
        if rc != 0:
            raise NotNative(f"{what} failed: CUDA error {rc}")
        return h.value

    @staticmethod
    def _deps(deps: list[int]):
        return (ctypes.c_void_p * max(1, len(deps)))(*deps), len(deps)

    def create(self) -> int:
        return self._out(self._create, "cuGraphCreate", 0)

    def add_child(self, graph: int, deps: list[int], child: int) -> int:
        return self._out(self._child, "cuGraphAddChildGraphNode", graph, *self._deps(deps), child)

    def add_kernel(self, graph: int, deps: list[int], params: NodeParams) -> int:
        return self._out(self._kernel, "cuGraphAddKernelNode", graph, *self._deps(deps), ctypes.byref(params))

    def instantiate(self, graph: int) -> int:
        return self._out(self._instantiate, "cuGraphInstantiateWithFlags", graph, 0)

    def destroy(self, graph: int | None, exec_handle: int | None) -> None:
        if exec_handle:
            self._destroy_exec(exec_handle)
        if graph:
            self._destroy(graph)


# -- programs ---------------------------------------------------------------------------------------------------------
class _Op(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("block_x", ctypes.c_uint32),
        ("shared", ctypes.c_uint32),
        ("grid_value", ctypes.c_int32 * 3),
        ("grid_const", ctypes.c_uint32 * 3),
        ("first_patch", ctypes.c_int32),
        ("num_patches", ctypes.c_int32),
        ("handle", ctypes.c_void_p),
        ("params", ctypes.c_void_p),
        ("node", ctypes.c_void_p),
    ]


class _Patch(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("size", ctypes.c_int32), ("value", ctypes.c_int32)]


class _Program(ctypes.Structure):
    _fields_ = [
        ("graph_launch", ctypes.c_void_p),
        ("kernel_launch", ctypes.c_void_p),
        ("ops", ctypes.c_void_p),
        ("patches", ctypes.c_void_p),
        ("num_ops", ctypes.c_int32),
        ("failed_op", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("node_set", ctypes.c_void_p),
        ("stitched", ctypes.c_void_p),
        ("applied", ctypes.c_int64 * VALUES),
        ("applied_valid", ctypes.c_int32),
        ("node_sets", ctypes.c_int32),
    ]


class GraphOp(NamedTuple):
    handle: int  # CUgraphExec
    label: str
    graph: int | None = None  # its CUgraph, which a stitched graph embeds; None: not kept (why_not says why)
    why_not: str = ""


class KernelOp:
    """One kernel launch of a program: its packed parameters (one 8-byte slot each, the value in its first bytes,
    as the driver reads each parameter's own size), the void* array into them, and the step values it takes."""

    def __init__(self, launch: KernelLaunch, driver: Driver | None = None):
        bound = launch.bound
        if bound.path != DIRECT or bound.compiled is None:
            raise NotNative(f"a runner's kernel does not launch directly ({bound.path})")
        c, name = bound.compiled, getattr(bound.kernel, "__name__", str(bound.kernel))
        self.label = name
        meta = c.metadata
        why = _metadata_problem(meta)
        if why:
            raise NotNative(f"{name}: {why}")
        if not c.function:
            raise NotNative(f"{name}: the compiled kernel has no loaded function")
        self.function, self.block = int(c.function), 32 * int(meta.num_warps)
        self.shared = int(meta.shared)
        sig = list(c.src.signature.items())
        # the parameters the launcher passes: every non-constexpr one, in order, from what the direct path passes
        values = {n: bound._direct[i] for i, (n, _) in enumerate(sig)}
        fixed = dict(zip((sig[i][0] for i in bound.slots), launch.ints))
        params = [(n, t) for n, t in sig if t != "constexpr"]
        sizes, self.patches = [], []  # patches: (parameter index, size, step value index)
        packed = []
        for i, (n, t) in enumerate(params):
            v = fixed.get(n, values[n])
            if not isinstance(t, str):
                raise NotNative(f"{name}: parameter {n} is a tuple ({t}): not packed here")
            if isinstance(v, StepValue):
                if t not in _PATCHABLE or v.index >= VALUES:
                    raise NotNative(f"{name}: {n} ({t}) cannot take a step value")
                self.patches.append((i, _PATCHABLE[t], v.index))
                v = 0
            if t.startswith("*"):
                packed.append(struct.pack("<Q", 0 if v is None else int(v)))
                sizes.append(8)
            elif t in _SCALARS:
                fmt, size = _SCALARS[t]
                packed.append(struct.pack(fmt, float(v) if fmt in ("<f", "<d") else int(v)).ljust(8, b"\0"))
                sizes.append(size)
            else:
                raise NotNative(f"{name}: parameter {n} of type {t} is not packed here")
        for _ in range(_scratch_params(meta)):  # null: _metadata_problem refused any scratch size
            packed.append(bytes(8))
            sizes.append(8)
        self.sizes = tuple(sizes)
        n = len(packed)
        self.buffer = (ctypes.c_uint64 * max(1, n)).from_buffer_copy(b"".join(packed) or bytes(8))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(1, n))(*[base + 8 * i for i in range(n)])
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        if len(grid) != 3:
            raise NotNative(f"{name}: a grid of {len(grid)} dimensions")
        self.grid_value = tuple(g.index if isinstance(g, StepValue) else -1 for g in grid)
        self.grid_const = tuple(0 if isinstance(g, StepValue) else int(g) for g in grid)
        if any(v >= VALUES for v in self.grid_value):
            raise NotNative(f"{name}: a grid takes step value {max(self.grid_value)}: at most {VALUES}")
        if any(c < 1 for c, v in zip(self.grid_const, self.grid_value) if v < 0):
            raise NotNative(f"{name}: a grid of {grid} launches nothing")
        self.reads_plan = launch.reads_plan
        if driver is not None and driver.param_info is not None:
            why = layout_problem(driver.param_info, self.function, self.sizes)
            if why:
                raise NotNative(f"{name}: {why}")


def _scratch_params(meta) -> int:
    """The null scratch pointers Triton's launcher appends: global_scratch (3.3+), and profile_scratch in the
    versions whose metadata has profile_scratch_size (3.5+: 3.6 and 3.9 both)."""
    return int(hasattr(meta, "global_scratch_size")) + int(hasattr(meta, "profile_scratch_size"))


def _metadata_problem(meta) -> str | None:
    """Why a kernel with this metadata needs more than cuLaunchKernel with null scratch pointers, or None."""
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return "needs global or profile scratch memory, allocated per launch by Triton's launcher"
    if getattr(meta, "num_ctas", 1) != 1 or any(d != 1 for d in getattr(meta, "cluster_dims", None) or ()):
        return "launches in clusters"
    if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        return "launches with a cooperative grid or programmatic dependent launch"
    if getattr(meta, "instrumentation_mode", ""):
        return f"instrumented ({meta.instrumentation_mode}): the launcher passes more parameters"
    if getattr(meta, "warp_size", 32) != 32:
        return f"warp size {meta.warp_size}"
    if int(meta.shared) > MAX_SHARED:
        return f"{meta.shared} bytes of shared memory (over {MAX_SHARED}: a launch attribute the loop does not set)"
    return None


def layout_problem(param_info: Callable, function: int, sizes: tuple[int, ...]) -> str | None:
    """The driver's view of the kernel's parameters against the packed layout: count and each size."""
    for i, size in enumerate(sizes):
        rc, got = param_info(function, i)
        if rc != 0:
            return f"the driver knows {i} parameters (error {rc} asking for one more), the packed layout {len(sizes)}"
        if got != size:
            return f"parameter {i} is {got} bytes for the driver, {size} in the packed layout"
    rc, _ = param_info(function, len(sizes))
    if rc == 0:
        return f"the driver knows more parameters than the {len(sizes)} packed"
    return None


class NativeProgram:
    """Ops in order, packed for gmt_run; calling it launches them all on `stream` with the step's values."""

    def __init__(self, ops: list, driver: Driver, lib: ctypes.CDLL):
        self.ops, self.driver, self.lib = ops, driver, lib
        self._ops = (_Op * max(1, len(ops)))()
        patches = [p for op in ops if isinstance(op, KernelOp) for p in op.patches]
        self._patches = (_Patch * max(1, len(patches)))()
        at = 0
        for i, op in enumerate(ops):
            o = self._ops[i]
            if isinstance(op, GraphOp):
                o.kind, o.handle = GRAPH, op.handle
                continue
            o.kind, o.block_x, o.shared, o.handle = KERNEL, op.block, op.shared, op.function
            o.grid_value[:], o.grid_const[:] = op.grid_value, op.grid_const
            o.params = ctypes.addressof(op.params)
            o.first_patch, o.num_patches = at, len(op.patches)
            for index, size, value in op.patches:
                p = self._patches[at]
                p.dst, p.size, p.value = ctypes.addressof(op.buffer) + 8 * index, size, value
                at += 1
        self._program = _Program(
            driver.graph_launch, driver.kernel_launch, ctypes.addressof(self._ops), ctypes.addressof(self._patches)
        )
        self._program.num_ops = len(ops)
        self.address = ctypes.addressof(self._program)
        self.uses_values = any(isinstance(op, KernelOp) and (op.patches or max(op.grid_value) >= 0) for op in ops)
        self.plan_reads = sum(isinstance(op, KernelOp) and op.reads_plan for op in ops)

    def __call__(self, stream: int, values: tuple = ()) -> int:
        return self.lib.gmt_run(self.address, stream, *(tuple(values) + (0,) * VALUES)[:VALUES])

    def failure(self, rc: int) -> str:
        at = self._program.failed_op
        if at >= len(self.ops):
            return f"the native step loop's launch of its stitched graph failed: CUDA error {rc}"
        what = "update of" if self._program.stitched else "launch of"
        return f"the native step loop's {what} {self.ops[at].label} failed: CUDA error {rc}"

    # -- one graph for the whole program -------------------------------------------------------------------------
    @property
    def stitched(self) -> bool:
        return bool(self._program.stitched)

    @property
    def node_sets(self) -> int:
        """Kernel nodes the stitched graph's steps have set so far (none while steps keep their shape)."""
        return self._program.node_sets

    def stitch(self, builder) -> None:
        """One graph of every op in order (each piece a child graph node, each kernel a kernel node),
        instantiated once; from then on a step sets the kernel nodes whose step
        values changed and launches it. The pieces are cloned in, so it holds no reference to torch's graphs,
        but their pool memory must stay (it does: the entry keeps its steps while its loop lives).
        NotNative: why not, nothing kept."""
        missing = next((op for op in self.ops if isinstance(op, GraphOp) and not op.graph), None)
        if missing is not None:
            raise NotNative(f"{missing.label}: {missing.why_not or 'no CUgraph kept'}")
        graph, exec_handle, prev = builder.create(), None, []
        try:
            for i, op in enumerate(self.ops):
                if isinstance(op, GraphOp):
                    prev = [builder.add_child(graph, prev, op.graph)]
                    continue
                # the step's values come at the first launch (applied_valid is 0): a grid of 1 until then
                grid = [c if v < 0 else 1 for c, v in zip(op.grid_const, op.grid_value)]
                params = NodeParams(op.function, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(op.block, 1, 1))
                params.shared, params.params = op.shared, ctypes.addressof(op.params)
                self._ops[i].node = builder.add_kernel(graph, prev, params)
                prev = [self._ops[i].node]
            exec_handle = builder.instantiate(graph)
        except NotNative:
            builder.destroy(graph, exec_handle)
            raise
        self._program.node_set, self._program.stitched = builder.node_set, exec_handle
        self._program.applied_valid = 0
        self._finalizer = weakref.finalize(self, builder.destroy, graph, exec_handle)

    @contextlib.contextmanager
    def unstitched(self):
        """Steps launched op by op for a while (A/B timing); the stitched graph kept."""
        exec_handle, self._program.stitched = self._program.stitched, None
        try:
            yield
        finally:
            self._program.stitched, self._program.applied_valid = exec_handle, 0


# -- an entry's steps as native segments and Python steps -----------------------------------------------------------
class NativeSegment:
    """Consecutive steps of an entry launched by one program; a step the program refuses (a grid of 0 from the
    step, a value out of range: nothing launched) runs them the Python way instead."""

    def __init__(self, steps: list, program: NativeProgram, ctx, stream: Callable[[], int]):
        self.steps, self.program, self.ctx, self.stream = steps, program, ctx, stream

    def __call__(self) -> None:
        ctx, program = self.ctx, self.program
        values = (ctx.step_grid or ()) if program.uses_values else ()
        rc = program(self.stream(), values) if len(values) <= VALUES else EMPTY_GRID
        if rc == 0:
            if program.plan_reads:  # what the planned runners would have noted (ForwardContext.planned_with)
                ctx.planned_with.extend([ctx.signature] * program.plan_reads)
            return
        if rc in (EMPTY_GRID, INT_RANGE):
            for step in self.steps:
                step.replay()
            return
        raise RuntimeError(program.failure(rc))


class StepLoop:
    """An entry's replay: its parts (native segments and Python steps' replay) in entry.steps order."""

    def __init__(self, parts: list, path: str):
        self.parts, self.path = parts, path

    def __call__(self) -> None:
        for part in self.parts:
            part()


def _step_ops(step, ctx, driver: Driver) -> list:
    """The ops that launch a step, or NotNative with why."""
    exec_handle = getattr(step, "exec_handle", None)
    if exec_handle is not None:
        graph, why_not = None, ""
        try:
            graph = step.graph_handle() if hasattr(step, "graph_handle") else None
            why_not = "" if graph else f"{type(step).__name__} steps keep no CUgraph"
        except NotNative as e:
            why_not = str(e)
        return [GraphOp(exec_handle(), type(step).__name__, graph, why_not)]
    if getattr(step, "is_runner", False):
        launches = getattr(step.launch, "native_launches", None) if getattr(step, "launch", None) else None
        if launches is None:
            raise NotNative("a runner without bound Triton launches (torch attention, or an FX submodule run as is)")
        return [KernelOp(k, driver) for k in launches(ctx)]
    raise NotNative(f"{type(step).__name__} steps have no native launch")


def default_stream() -> Callable[[], int]:
    """The current CUDA stream's handle, as torch's replay and Triton's launches take it."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = torch.cuda.current_device()
    if raw is not None:
        return functools.partial(raw, index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


def build_step_loop(entry, driver: Driver | None = None, stream=None, lib=None) -> tuple[StepLoop | None, str]:
    """The entry's StepLoop and its launch path ("native", "native for N of M steps; python: why", or
    "python: why", then no loop; "pending: why" while a runner's kernel has not launched yet)."""
    if switched_off(ENV):
        return None, f"{PYTHON}: {ENV}={os.environ[ENV]}"
    if not any(getattr(s, "is_runner", False) for s in entry.steps):
        return None, f"{PYTHON}: no runners (one graph launch per step already)"
    graphs = [s for s in entry.steps if not getattr(s, "is_runner", False)]
    if not any(callable(getattr(s, "exec_handle", None)) for s in graphs):  # the CPU tape: nothing to launch
        return None, f"{PYTHON}: {type(graphs[0]).__name__ if graphs else 'no graph'} steps have no native launch"
    pending = [p for s in entry.steps for p in getattr(s, "launch_paths", ()) if p == PENDING]
    if pending:
        return None, f"{PENDING}: {len(pending)} runner kernels not launched yet"
    if lib is None:
        lib = library()
        if isinstance(lib, str):
            return None, f"{PYTHON}: {lib}"
    if driver is None:
        driver = cuda_driver()
        if isinstance(driver, str):
            return None, f"{PYTHON}: {driver}"
    planned, why = [], None  # per step: its ops, or None (Python)
    for step in entry.steps:
        try:
            planned.append(_step_ops(step, entry.ctx, driver))
        except NotNative as e:
            why = why or str(e)
            planned.append(None)
    # segments: runs of steps the loop launches; one without a runner (a graph between two Python runners) saves
    # nothing over torch's replay, and stays Python
    segments, run = [], []
    for i, step_ops in enumerate([*planned, None]):
        if step_ops is not None:
            run.append(i)
            continue
        if any(getattr(entry.steps[j], "is_runner", False) for j in run):
            segments.append(run)
        run = []
    if not segments:
        return None, f"{PYTHON}: {why}"
    stream = stream or default_stream()
    starts = {seg[0]: seg for seg in segments}
    parts, i, why_unstitched = [], 0, None
    stitch = driver.graphs is not None and not switched_off(STITCH_ENV)
    if not stitch:
        why_unstitched = (
            f"{STITCH_ENV}={os.environ.get(STITCH_ENV)}" if driver.graphs is not None else "the driver builds no graphs"
        )
    while i < len(entry.steps):
        seg = starts.get(i)
        if seg is None:
            parts.append(entry.steps[i].replay)
            i += 1
            continue
        ops = [op for j in seg for op in planned[j]]
        steps = [entry.steps[j] for j in seg]
        program = NativeProgram(ops, driver, lib)
        if stitch:
            try:
                program.stitch(driver.graphs)
            except NotNative as e:
                why_unstitched = why_unstitched or str(e)
        parts.append(NativeSegment(steps, program, entry.ctx, stream))
        i = seg[-1] + 1
    native = sum(map(len, segments))
    name = STITCHED if stitch and why_unstitched is None else NATIVE
    path = name if why is None else f"{name} for {native} of {len(entry.steps)} steps; {PYTHON}: {why}"
    if stitch and why_unstitched is not None:
        path += f" (not stitched: {why_unstitched})"
    return StepLoop(parts, path), path


@contextlib.contextmanager
def unstitched(entry):
    """Replays of `entry` through its native loop op by op for a while (A/B timing), its stitched graphs kept."""
    with contextlib.ExitStack() as stack:
        for part in getattr(entry.loop, "parts", ()):
            if isinstance(part, NativeSegment) and part.program.stitched:
                stack.enter_context(part.program.unstitched())
        yield


def node_sets(entry) -> int:
    """Kernel nodes entry's stitched graphs have set so far."""
    parts = getattr(entry.loop, "parts", ())
    return sum(p.program.node_sets for p in parts if isinstance(p, NativeSegment))


@contextlib.contextmanager
def python_path(entry):
    """Replays of `entry` through the Python loop for a while (A/B timing), its native loop kept."""
    loop, entry.loop = entry.loop, None
    try:
        yield
    finally:
        entry.loop = loop
