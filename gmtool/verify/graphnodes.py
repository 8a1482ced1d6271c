"""The nodes of a captured CUDA graph, read with cuda-bindings' driver API, and the module that issued each one.

- The graph: torch's raw handle, `CUDAGraph(keep_graph=True).raw_cuda_graph()` (the backend keeps the handle when
  `keep_graph` is set); nodes come from cuGraphGetNodes, kernels' launch shapes from cuGraphKernelNodeGetParams,
  names from cuFuncGetName.
- Scalar arguments: kernelParams holds one pointer per argument and cuFuncGetParamInfo (CUDA 12.4+) gives each
  argument's size; an argument is read as 8-byte words (a 4-byte scalar is one word). A word that lies in a device
  allocation (cuPointerGetAttribute finds its range) is an address, not a scalar, and becomes PTR: buffers move
  between captures, what matters is the scalars. Without cuFuncGetParamInfo the number and sizes of the arguments
  cannot be known, so arguments are not compared, and the result says so.
- By-value structs of C++ kernels (mangled names: ATen's elementwise, reduce and cat kernels) are compared by
  size only. Their unused slots are never written (OffsetCalculator's MAX_DIMS arrays, an empty functor's byte),
  so they carry whatever the host stack held, which differs with the Python path a composition took (seen on the
  H200: 5,000 such words per decode graph, and dozens a control capture did not catch). Which arguments are
  structs comes from the demangled signature (libstdc++'s __cxa_demangle): only builtin scalars and pointers are
  compared word by word, whatever their size (a 4-byte lambda was read as a scalar and flagged one layer of 28 on
  the H200). Without a demangler, or where its parameter list does not match the driver's, any argument that is
  not 4 or 8 bytes counts as a struct. Launch shapes, and every argument of Triton kernels (plain scalars and
  pointers), are still compared.
- Modules: while capturing, the node count of the graph being captured is read at every ATen op and every module
  entry and exit (cuStreamGetCaptureInfo, then cuGraphGetNodes asking for the count only); the nodes added since
  the previous reading were issued under the module that was running. Triton launches, which no ATen hook sees,
  are attributed this way too. This relies on cuGraphGetNodes listing nodes in the order capture added them.
"""

from __future__ import annotations

import bisect
import ctypes

import torch

from gmtool.verify.nodediff import PTR, Node

STRUCT = "struct"  # a C++ kernel's by-value struct argument: compared by its size only
STRUCTS_NOTE = (
    "by-value struct arguments of C++ kernels (ATen's) compared by size only: their unused slots hold host bytes"
)
_SMALL = 1 << 20  # words below this are sizes, counts and strides; no device allocation lives there
# x86-64 user space near its top, where host stacks, libraries and pinned memory live: a kernel argument struct
# copied from the host stack can carry such addresses (seen in ATen's CatArrayBatchedCopy metadata), which differ
# from one capture to the next without meaning anything for the composition
_HOST_ADDRESS, _ADDRESS_END = 0x7E00_0000_0000, 0x8000_0000_0000


def load_driver():
    """cuda-bindings' driver API: cuda.bindings.driver, or cuda.cuda in cuda-python before 12.6. None if absent."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError:
            return None
    return driver


def unavailable(device: torch.device) -> str | None:
    """Why graph nodes cannot be read on this device (None: they can)."""
    if device.type != "cuda":
        return "graph nodes are read on CUDA only"
    if load_driver() is None:
        return "graph nodes not read: the cuda-bindings package is not installed (pip install cuda-bindings)"
    try:
        torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph
    except (TypeError, AttributeError):
        return f"graph nodes not read: torch {torch.__version__} has no raw CUDA graph handle (CUDAGraph(keep_graph=))"
    return None


class DriverError(RuntimeError):
    pass


def _call(driver, name: str, *args):
    """What a driver call returns after its status (one value, or a tuple); DriverError unless it succeeded."""
    res = getattr(driver, name)(*args)
    if int(res[0]) != 0:
        raise DriverError(f"{name} failed: {res[0]}")
    return res[1] if len(res) == 2 else res[1:]


_SCALARS = {
    *(f"{u}{t}" for u in ("", "unsigned ", "signed ") for t in ("char", "short", "int", "long", "long long")),
    "bool",
    "float",
    "double",
    "long double",
    "wchar_t",
    "char16_t",
    "char32_t",
}


def _cxa_demangle():
    """libstdc++'s demangler through ctypes, or None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        fn, free = lib.__cxa_demangle, ctypes.CDLL(None).free
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p]

    def demangle(name: str) -> str | None:
        status = ctypes.c_int(1)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if not ptr or status.value != 0:
            return None
        try:
            return ctypes.string_at(ptr).decode(errors="replace")
        finally:
            free(ptr)

    return demangle


_DEMANGLE = _cxa_demangle()


def scalar_params(mangled: str, demangle=_DEMANGLE) -> list[bool] | None:
    """Per parameter of a C++ kernel: True where it is a builtin scalar or a pointer (compared word by word), False
    for a class, lambda or array passed by value (compared by size). None: not demangled."""
    text = demangle(mangled) if demangle is not None and mangled.startswith("_Z") else None
    if not text or not text.endswith(")"):
        return None
    depth, i = 0, len(text) - 1
    for i in range(len(text) - 1, -1, -1):  # the '(' that opens the parameter list closed by the last ')'
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            break
    params, depth, cur = [], 0, ""
    for ch in text[i + 1 : -1]:
        depth += {"<": 1, "(": 1, "[": 1, "{": 1, ">": -1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip() and cur.strip() != "void":
        params.append(cur.strip())
    return [p.endswith("*") or p.removesuffix(" const") in _SCALARS for p in params]


def _kind(node_type) -> str:
    name = getattr(node_type, "name", str(node_type))
    return name.rsplit("CU_GRAPH_NODE_TYPE_", 1)[-1].lower()


class NodeSampler:
    """Which module issued each node of the graphs captured while it samples."""

    def __init__(self, driver, tracker):
        self.driver, self.tracker = driver, tracker
        self.marks: dict[int, tuple[list[int], list[str]]] = {}  # graph -> (node counts, module of the nodes below)
        self.failed: str | None = None
        self._info = getattr(driver, "cuStreamGetCaptureInfo_v2", None) or driver.cuStreamGetCaptureInfo

    def sample(self) -> None:
        d = self.driver
        try:
            res = self._info(d.CUstream(init_value=torch.cuda.current_stream().cuda_stream))
            if int(res[0]) != 0 or res[1] != d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
                return
            graph = res[3]
            _, n = _call(d, "cuGraphGetNodes", graph, 0)
        except Exception as e:  # an older binding's signature, a driver refusal: nodes stay unattributed
            self.failed = self.failed or f"nodes not attributed to modules: {type(e).__name__}: {e}"
            return
        counts, modules = self.marks.setdefault(int(graph), ([], []))
        if n > (counts[-1] if counts else 0):
            counts.append(n)
            modules.append(self.tracker.current)

    def module_of(self, raw_graph: int):
        counts, modules = self.marks.get(int(raw_graph), ([], []))
        return lambda i: modules[k] if (k := bisect.bisect_right(counts, i)) < len(modules) else ""


class NodeReader:
    """Reads captured graphs into Node records; caches per kernel (argument sizes) and per address."""

    def __init__(self, driver=None):
        self.driver = driver or load_driver()
        self.notes: set[str] = set()
        self._sizes: dict[int, list[int] | None] = {}
        self._names: dict[int, str] = {}
        self._device: dict[int, bool] = {}

    def sampler(self, tracker) -> NodeSampler:
        return NodeSampler(self.driver, tracker)

    def entry_nodes(self, entry, sampler: NodeSampler | None = None) -> list[Node]:
        """Every node of a captured entry's graphs, in replay order (attention runners are not graphs)."""
        out = []
        for step in entry.steps:
            graph = getattr(step, "graph", None)
            if graph is not None:
                raw = int(graph.raw_cuda_graph())
                out += self.graph_nodes(raw, sampler.module_of(raw) if sampler else None)
        if sampler is not None and sampler.failed:
            self.notes.add(sampler.failed)
        return out

    def graph_nodes(self, raw_graph: int, module_of=None) -> list[Node]:
        d = self.driver
        graph = d.CUgraph(init_value=int(raw_graph))
        _, n = _call(d, "cuGraphGetNodes", graph, 0)
        handles, n = _call(d, "cuGraphGetNodes", graph, n)
        return [self.node(h, module_of(i) if module_of else "") for i, h in enumerate(list(handles)[:n])]

    def node(self, handle, module: str = "") -> Node:
        d = self.driver
        kind = _kind(_call(d, "cuGraphNodeGetType", handle))
        if kind == "kernel":
            p = _call(d, "cuGraphKernelNodeGetParams", handle)
            func, getter = p.func, "cuFunc"
            if not int(func) and int(getattr(p, "kern", 0) or 0):  # a library kernel, not a context's function
                func, getter = p.kern, "cuKernel"
            return Node(
                kind,
                self._name(func, getter),
                module,
                (p.gridDimX, p.gridDimY, p.gridDimZ),
                (p.blockDimX, p.blockDimY, p.blockDimZ),
                int(p.sharedMemBytes),
                self._args(func, getter, int(p.kernelParams or 0), cpp=self._name(func, getter)),
            )
        if kind == "memset":
            p = _call(d, "cuGraphMemsetNodeGetParams", handle)
            return Node(
                kind, "", module, args=((int(p.value),), (int(p.elementSize),), (int(p.width),), (int(p.height),))
            )
        if kind == "memcpy":
            p = _call(d, "cuGraphMemcpyNodeGetParams", handle)
            return Node(kind, "", module, args=((int(p.WidthInBytes),), (int(p.Height),), (int(p.Depth),)))
        return Node(kind, "", module)

    def _name(self, func, getter: str) -> str:
        key = int(func)
        if key not in self._names:
            try:
                name = _call(self.driver, f"{getter}GetName", func)
                self._names[key] = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:
                self._names[key] = f"<function {key:#x}>"
        return self._names[key]

    def _param_sizes(self, func, getter: str) -> list[int] | None:
        key = int(func)
        if key not in self._sizes:
            sizes: list[int] | None = []
            info = getattr(self.driver, f"{getter}GetParamInfo", None)
            try:
                while info is not None and len(sizes) < 4096:
                    res = info(func, len(sizes))
                    if int(res[0]) != 0:  # past the last argument; at 0 anything but INVALID_VALUE: unsupported
                        if not sizes and int(res[0]) != int(self.driver.CUresult.CUDA_ERROR_INVALID_VALUE):
                            sizes = None
                        break
                    sizes.append(int(res[2]))
            except Exception:  # a binding without the symbol in the driver
                sizes = None
            self._sizes[key] = None if info is None else sizes
        return self._sizes[key]

    def _args(self, func, getter: str, params: int, cpp: str = "") -> tuple[tuple, ...]:
        """cpp: the kernel's mangled name when it is a C++ kernel (its by-value structs are compared by size)."""
        sizes = self._param_sizes(func, getter)
        if sizes is None:
            self.notes.add(
                "scalar kernel arguments not compared: argument sizes need cuFuncGetParamInfo "
                "(CUDA 12.4+ driver and cuda-bindings); grids, blocks and kernels still are"
            )
            return ()
        if not params:
            self.notes.add("a kernel launched with packed 'extra' arguments: its arguments are not compared")
            return ()
        slots = (ctypes.c_void_p * len(sizes)).from_address(params)
        scalar = scalar_params(cpp) if cpp.startswith("_Z") else None
        if scalar is not None and len(scalar) != len(sizes):
            scalar = None
        out = []
        for i, size in enumerate(sizes):
            struct = (not scalar[i]) if scalar is not None else cpp.startswith("_Z") and size not in (4, 8)
            if struct:
                self.notes.add(STRUCTS_NOTE)
                out.append((f"{STRUCT} of {size} bytes",))
            else:
                out.append(self.words(ctypes.string_at(slots[i], size)) if slots[i] else ())
        return tuple(out)

    def words(self, raw: bytes) -> tuple:
        """An argument's bytes as little-endian 8-byte words, device addresses replaced by PTR."""
        out = []
        for off in range(0, len(raw), 8):
            w = int.from_bytes(raw[off : off + 8], "little")
            out.append(PTR if len(raw) - off >= 8 and (_HOST_ADDRESS <= w < _ADDRESS_END or self._is_device(w)) else w)
        return tuple(out)

    def _is_device(self, value: int) -> bool:
        """An address the driver maps (device or managed memory)."""
        if value < _SMALL:
            return False
        hit = self._device.get(value)
        if hit is None:
            d = self.driver
            try:
                res = d.cuPointerGetAttribute(
                    d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d.CUdeviceptr(value)
                )
                hit = int(res[0]) == 0
            except Exception:
                hit = False
            self._device[value] = hit
        return hit
