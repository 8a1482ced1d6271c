"""Programmatic Dependent Launch (PDL) for the fused decode chain: a kernel may start before the one ahead of it
ends, so the next projection's weights are on their way into L2 while the small kernel before it still runs.

A decode step at small batch is a chain of short kernels, each of which starts cold: the GEMMs request their
weight bytes (which depend on no earlier kernel) only once they start. Launched with PDL (`launch_pdl=True`,
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; a CUDA graph capture keeps it as a programmatic edge on
CUDA 12.3+), a kernel's programs may be scheduled as soon as every program of the kernel before it has called
`gdc_launch_dependents()` (or exited). The rule that keeps results right: only memory read after `gdc_wait()`
is guaranteed complete, since the wait returns once the kernel before has finished and its writes are visible.
So every PDL-aware kernel calls `gdc_wait()` unconditionally, on every path, before it reads or writes anything
another kernel touches; only reads of what no kernel writes run ahead of the wait: the GEMM's L2 prefetch of its
(read-only) weight, the decode split kernel's read of kv_lens, and the QK-norm+RoPE kernel's of the positions,
slots, RoPE table and norm weights (step inputs are copied in before the graph's first kernel). Because
each kernel waits before it can finish, "the kernel before has finished" carries down the chain.

Modes (the kernels' PDL constexpr): OFF compiles the kernels as before (no griddepcontrol instruction) and
launches them plainly. AFTER_WAIT: wait, then let the next kernel launch (one kernel ahead at a time).
EARLY, what --pdl runs: the element-wise kernels let the next kernel launch before their own wait, so a GEMM
after them can prefetch while the kernel two ahead still runs; the GEMM itself still triggers only after its
wait, which stops the cascade at each GEMM, and so does the decode combine (o_proj launched during the split
kernel's K/V reads was slower: gmtool.kernels.decode_attention). Still right: a kernel finishes only after its
own wait returned, so "the kernel before has finished" still carries down the chain. qwen3-0.6b's decode step
at B=1 kv 1024 on an H200: 0.989 ms against 1.041 for AFTER_WAIT (2026-12-01, tools/pdl_decode.py, one process).

Prefetching further ahead was slower. A tiny kernel in the chain after each QKV GEMM, bulk-prefetching the
layer's o_proj, gate/up and down weights into L2 (`cp.async.bulk.prefetch.L2`) so attention's latency-bound
kernels overlap their streaming: 1.126-1.128 ms against 0.936-0.959, 1.31-1.51 with a second such kernel a
layer (qwen3-0.6b B=1 kv 1024, H200, 2026-12-01, .diag/lookahead.py). Presumably the next kernel's wait then
covers the prefetching kernel's end, which comes after its prefetches drain. A side stream doing the same had
been slower too (1.086-1.125 against 1.041 ms). So was letting the decode attention read its kv lengths and
first block-table row, and prefetch that tile's K/V into L2, before its wait: 0.935-0.936 ms against 0.908-0.909
at B=1, 2.353 against 2.198 at B=32 (the same call, trees alternated); the kv lengths alone, so that the splits
past a sequence's tokens end without waiting, were faster (2026-12-02: gmtool.kernels.decode_attention). Slower
again: the GEMMs letting the next kernel launch before their own wait (2026-12-02, .diag/gemmearly.py, B=1 kv 1,023):
all of them 0.888-0.894 ms against 0.846-0.850, o_proj's alone 0.888-0.889, each other GEMM's within 5 us of the
step without. So was loading (not prefetching) before the wait: W's first tile into registers in both one-row
GEMMs, 0.886-0.887 ms against 0.823-0.825; the decode split's first tile of pages and older K/V, 0.894-0.895
(1.677 against 1.210 at B=8) (2026-12-02, .diag/prewab.py, max kv 4,224).

Triton 3.6 and 3.9 both have `triton.language.extra.cuda.gdc_wait` / `gdc_launch_dependents` and the
`launch_pdl` launch option. The interpreter has neither griddepcontrol nor inline assembly: there, before
Hopper, or without those names, `problem()` says why and the fused layers run with PDL off.
"""

from __future__ import annotations

import contextlib
import os
from enum import IntEnum

import torch
import triton
import triton.language as tl

try:  # triton >= 3.4; checked by problem() before any PDL variant compiles
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_wait = gdc_launch_dependents = None


class Pdl(IntEnum):
    OFF = 0
    AFTER_WAIT = 1
    EARLY = 2


L2_LINE = 128  # bytes: the prefetch granularity


def problem(device: torch.device | None = None) -> str | None:
    """Why PDL cannot run here (None when it can): the fused layers then run the plain variants, saying so."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter has no griddepcontrol or inline assembly"
    if gdc_wait is None:
        return f"triton {triton.__version__} has no triton.language.extra.cuda.gdc_wait (3.4 or later has)"
    device = device or torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return "PDL needs a CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"PDL needs sm_90 (Hopper) or later, this device is sm_{major}x"
    return None


def launch_options(mode: int) -> dict:
    """kernel[grid] keyword arguments for a launch in this mode: none when off, so the plain launch is unchanged
    (and the interpreter, which knows no launch_pdl, never sees one)."""
    return {"launch_pdl": True} if mode else {}


_scope = Pdl.OFF  # what launchers without an explicit mode use (the attention kernels, reached through ctx)


def current() -> Pdl:
    return _scope


@contextlib.contextmanager
def launches(mode: int):
    """PDL launches for gmtool's attention kernels (write_kv, decode attention) called inside: the fused layers
    reach them through the forward context and the attention backend, which take no launch options."""
    global _scope
    prev, _scope = _scope, Pdl(mode)
    try:
        yield
    finally:
        _scope = prev


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-aware kernel's first statement: wait for the kernel before (its writes visible), and let the next one
    launch, before (EARLY) or after (AFTER_WAIT) the wait. OFF: nothing at all (also under the interpreter)."""
    trigger_early(PDL)
    wait(PDL)


@triton.jit
def trigger_early(PDL: tl.constexpr):
    """enter's first half: EARLY lets the next kernel launch. A kernel that reads what no kernel before writes
    ahead of its wait puts this first, then those reads, then wait()."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """enter's second half: the wait, then AFTER_WAIT's trigger."""
    if PDL != 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding ptrs: no register waits on it, so a program can prefetch its whole
    weight slice before gdc_wait. The asm's result is a dummy (inline asm must return a value)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
