"""Triton launches bound once per call site, then handed straight to the compiled kernel.

`kernel[grid](...)` binds the arguments, works out the specialization (dtypes, pointer alignment, ints equal to
1 or divisible by 16, constexprs), looks the compiled variant up and checks the kernel's globals on every call:
tens of microseconds of host time, paid by each attention runner of each piecewise step. A runner launches the
same kernel on the same tensors every step (the shared q and output buffers, its layer's K/V cache, the step's
metadata buffers); only the grid and a few ints follow the batch, and those are declared do_not_specialize in
the kernel, so no value of theirs selects another variant. `BoundKernel` takes Triton's path on its first call,
keeps the CompiledKernel that call returns, and afterwards hands the stored arguments (pointers as addresses),
the call's grid and ints directly to that kernel's launcher: nothing is re-checked per call.

The direct path relies on Triton 3.x's launcher convention, which 3.6 and 3.9 share: `compiled.run(gx, gy, gz,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *every parameter in order)`, the
constexpr ones included (the launcher skips them), pointers as tensors or addresses. Where that is not what the
installed Triton offers, under the interpreter (TRITON_INTERPRET=1 compiles nothing), or with a launch hook set
when the binding is made (a profiler; the direct path passes none), every call goes through kernel[grid] and
`path` says why. A hook added after a runner was bound does not see that runner's launches.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

PENDING = "pending"  # not launched yet
HELD = object()  # what a launch returns while compile-ahead's pass holds it (compiled later, never run)
DIRECT = "direct"  # launches go straight to the compiled kernel
VIA_TRITON = "triton"  # every launch goes through kernel[grid]; path is "triton: <why>"


def _stream_source():
    """(the current-stream getter, the device) as Triton's own launch finds them."""
    from triton.runtime import driver

    return driver.active.get_current_stream, driver.active.get_current_device()


def _launch_hooks() -> tuple:
    """Triton's launch hooks (profilers set them); a Triton without `knobs` predates the convention used here."""
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _hooked(hook) -> bool:
    """A launch hook that does something: Triton 3.6/3.9 keep an empty HookChain (a list of calls) when unset."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launch_problem(kernel, compiled, varying: tuple[str, ...] = ()) -> str | None:
    """Why `compiled` (what kernel[grid](...) returned) cannot be launched directly; None when it can."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter runs kernels as Python (TRITON_INTERPRET=1): no compiled kernel"
    if compiled is None:
        return "kernel[grid] returned no compiled kernel"
    missing = [a for a in ("run", "function", "packed_metadata", "src") if not hasattr(type(compiled), a)]
    missing = [a for a in missing if a not in getattr(compiled, "__dict__", {})]
    if missing:
        return f"this Triton's compiled kernel has no {', '.join(missing)}"
    signature = getattr(compiled.src, "signature", None)
    if not isinstance(signature, dict) or list(signature) != list(kernel.arg_names):
        return "this Triton's launcher takes another argument layout than the kernel's parameters in order"
    fixed = [n for n in varying if signature[n] == "constexpr"]
    if fixed:
        return f"{', '.join(fixed)} compiled as constants: a direct launch would not pass their values"
    try:
        hooks = _launch_hooks()
    except (ImportError, AttributeError):
        return "this Triton has no knobs.runtime launch hooks (the 3.x launcher convention)"
    if any(_hooked(h) for h in hooks):
        return "a Triton launch hook is set (a profiler): launches go through Triton to call it"
    return None


def direct_head(compiled) -> tuple:
    """What the launcher takes between the stream and the parameters: the function and its packed metadata, then
    no launch metadata and no enter/exit hooks (a direct path runs only where no hook is set)."""
    return (compiled.function, compiled.packed_metadata, None, None, None)


class BoundKernel:
    """One call site of a Triton kernel, its arguments fixed but the grid and the `varying` ints.

    args: the positional arguments (the kernel's leading parameters); constexprs: the rest of its parameters by
    name; options: launch options (num_warps, num_stages). varying: names of positional ints given anew at each
    call, in that order, after the grid; the kernel must declare them do_not_specialize (or no value of theirs
    could change the compiled variant), and they must stay in int32 range. The tensors are held for the
    binding's life: their addresses are what the direct path passes.
    """

    __slots__ = (
        "kernel",
        "args",
        "constexprs",
        "options",
        "slots",
        "path",
        "compiled",
        "_run",
        "_head",
        "_direct",
        "_stream",
    )

    def __init__(self, kernel, args: tuple, constexprs: dict, options: dict, varying: tuple[str, ...] = ()):
        names = list(kernel.arg_names)
        tail = names[len(args) :]
        if sorted(tail) != sorted(constexprs):
            raise ValueError(f"{kernel}: constexprs {sorted(constexprs)} are not its parameters after the positional")
        self.slots = tuple(names.index(v) for v in varying)
        if any(i >= len(args) for i in self.slots):
            raise ValueError(f"{kernel}: varying arguments must be positional: {varying}")
        params = getattr(kernel, "params", None)  # the interpreter's functions have none
        if params is not None:
            fixed = [names[i] for i in self.slots if not params[i].do_not_specialize]
            if fixed:
                raise ValueError(f"{kernel}: {', '.join(fixed)} vary per call: declare them do_not_specialize")
        self.kernel, self.args, self.options = kernel, list(args), options
        self.constexprs = {n: constexprs[n] for n in tail}  # in parameter order: the direct path passes them so
        self.path = PENDING
        self.compiled = None  # the CompiledKernel of the direct path (gmtool.kernels.native_loop reads it)
        self._run = None

    def __call__(self, grid: tuple, *values) -> None:
        run = self._run
        if run is None:
            return self._through_triton(grid, values)
        a = self._direct
        for i, v in zip(self.slots, values):
            a[i] = v
        run(grid[0], grid[1], grid[2], self._stream[0](self._stream[1]), *self._head, *a)

    def _through_triton(self, grid: tuple, values: tuple) -> None:
        a = self.args
        for i, v in zip(self.slots, values):
            a[i] = v
        compiled = self.kernel[grid](*a, **self.constexprs, **self.options)
        if self.path == PENDING and compiled is not HELD:
            self._go_direct(compiled)

    def _go_direct(self, compiled) -> None:
        names = self.kernel.arg_names
        why = direct_launch_problem(self.kernel, compiled, tuple(names[i] for i in self.slots))
        if why is not None:
            self.path = f"{VIA_TRITON}: {why}"
            return
        # addresses instead of tensors: the launcher then neither calls data_ptr() nor asks the driver about them
        self._direct = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args]
        self._direct += list(self.constexprs.values())
        self._head = direct_head(compiled)
        self._stream = _stream_source()
        self._run = compiled.run
        self.compiled = compiled
        self.path = DIRECT


# -- what a bound launch offers the native step loop (gmtool.kernels.native_loop) -----------------------------------
class StepValue(NamedTuple):
    """A value that follows the step, given to every launch of it: index into ForwardContext.step_grid."""

    index: int


STEP_SEQS, STEP_TILES = StepValue(0), StepValue(1)  # TritonAttention.step_grid: (num_seqs, query tiles)


class KernelLaunch(NamedTuple):
    """One launch of a bound kernel as a runner makes it: grid and the varying ints (in `bound.slots` order),
    each an int fixed at binding or a StepValue. reads_plan: the launch consumes the step's plan (a planned
    runner notes ctx.signature in ctx.planned_with)."""

    bound: BoundKernel
    grid: tuple
    ints: tuple = ()
    reads_plan: bool = False


class NotNative(Exception):
    """A launch the native step loop cannot make; the message says why."""


# -- FastLaunch: kernel[grid](...) with Triton's per-call work done once per variant ---------------------------------
_I32, _I64 = 2**31, 2**63


def _int_key(v: int) -> tuple:
    # what Triton specializes an int on: equal to 1, divisible by 16, and its type (i32, i64, u64) by range
    return (v == 1, v % 16 == 0, -_I32 <= v < _I32, v < _I64)


class FastLaunch:
    """`FastLaunch(kernel)[grid](*args, **kwargs)` launches as `kernel[grid](*args, **kwargs)` does, minus its
    per-call work: Triton binds the arguments, computes the specialization key, looks the variant up and checks
    the kernel's globals on every call (60 us of host time per launch on a busy H200 host, 197 launches per
    --fuse decode forward, 2026-12-01). Here a call keys its arguments on what Triton specializes them on,
    or finer: a tensor's dtype and 16-byte alignment; an int's being 1, divisible by 16 and its type's range;
    constexpr parameters and launch options by value. The first call of a key goes through Triton and keeps the
    CompiledKernel it returns; later calls of that key hand the addresses and values straight to its launcher
    (the convention BoundKernel relies on). A finer key only means more first calls through Triton, each
    finding the variant Triton already has.

    Not checked per call, unlike Triton: that the globals a kernel read when compiled are unchanged, and that a
    tensor lives on the launching device. Always through Triton: under the interpreter, with a launch hook set
    (a profiler), a stages-inspection hook or a pre-run hook on the kernel, while the kernel's run is replaced (compile-ahead's pass turns launches into compiles; a test's spy
    sees every launch), for a grid given as a function, and for an argument of another kind (a tuple, a
    descriptor)."""

    __slots__ = (
        "kernel",
        "variants",
        "const_at",
        "tail",
        "path",
        "_run",
        "_device",
        "_stream",
        "_hooks",
        "_compilation",
    )

    def __init__(self, kernel):
        self.kernel, self.variants, self.path = kernel, {}, PENDING  # set up at the first launch (not at import)

    def _setup(self) -> None:
        params = getattr(self.kernel, "params", None)
        kind = type(self.kernel)
        if (
            os.environ.get("TRITON_INTERPRET") == "1"
            or kind.__name__ != "JITFunction"  # the interpreter's function, an autotuner or heuristics wrapper
            or params is None
            or not all(hasattr(p, "is_constexpr") and hasattr(p, "has_default") for p in params)
        ):
            self.path = f"{VIA_TRITON}: not a compiled Triton JIT function (the interpreter, or a wrapper)"
            return
        from triton import knobs

        self.const_at = frozenset(i for i, p in enumerate(params) if p.is_constexpr)
        self.tail = [(p.name, p.default if p.has_default else _MISSING) for p in params]
        # Triton's run: replaced while compile-ahead's pass runs (its stand-in names the original in __wrapped__,
        # as functools.wraps does) or by a spy; while replaced, Triton takes every launch
        self._run = getattr(kind.run, "__wrapped__", kind.run)
        self._hooks, self._compilation = knobs.runtime, getattr(knobs, "compilation", None)
        active = _active_driver()
        self._stream, self._device = active.get_current_stream, active.get_current_device
        self.path = "ready"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if self.path is PENDING:
            self._setup()
        if self.path.startswith(VIA_TRITON) or not self._direct_allowed() or callable(grid):
            return self.kernel[grid](*args, **kwargs)
        device = self._device()
        # one pass over the arguments: their addresses or values, and what Triton specializes each on (a method
        # call per argument cost about a third of a launch's host time: H200 host, cProfile, 2026-12-02)
        const_at, values, unkeyed = self.const_at, [], False
        key = [device, self._options(), len(args)]
        try:
            # by value and type: 3 and 3.0, 1 and True are other variants
            key += (tuple(kwargs.items()), tuple(map(type, kwargs.values())))
            for i, a in enumerate(args):
                if i in const_at:
                    values.append(a)
                    key.append(("c", a))
                elif isinstance(a, torch.Tensor):
                    v = a.data_ptr()
                    values.append(v)
                    key.append((a.dtype, v % 16 == 0))
                else:
                    values.append(a)
                    t = type(a)
                    if t is int:
                        key.append(_int_key(a))
                    elif t is float or a is None:
                        key.append(t)
                    elif t is bool:
                        key.append((t, a))
                    else:  # another kind: Triton's own path takes it
                        unkeyed = True
                        break
            key = tuple(key)
            variant = None if unkeyed else self.variants.get(key)
        except TypeError:  # an unhashable keyword value
            unkeyed = True
        if unkeyed:  # outside the try: a TypeError Triton raises is the caller's, not a second launch
            return self.kernel[grid](*args, **kwargs)
        if variant is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self._learn(key, compiled, args, kwargs)
            return compiled
        compiled, head, tail = variant
        n = len(grid)
        compiled.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(device), *head, *values, *tail
        )
        return compiled

    def _direct_allowed(self) -> bool:
        h = self._hooks
        return (
            getattr(self.kernel.run, "__func__", None) is self._run  # a run replaced on the class or the kernel
            and not getattr(self.kernel, "pre_run_hooks", None)
            and not _hooked(h.launch_enter_hook)
            and not _hooked(h.launch_exit_hook)
            and getattr(h, "add_stages_inspection_hook", None) is None
        )

    def _options(self) -> tuple:
        """The compile options Triton's run reads from its knobs on every call (a change compiles anew)."""
        c = self._compilation
        return (
            getattr(self.kernel, "debug", None),
            getattr(self._hooks, "debug", None),
            getattr(c, "instrumentation_mode", None),
            getattr(c, "fpsan_homomorphic_casts", None),
        )

    def _learn(self, key, compiled, args, kwargs) -> None:
        """Keep the variant when its launcher takes the direct call: the parameters after the positional ones,
        in order (the launcher skips constexprs but counts them), from the keywords or their defaults."""
        if direct_launch_problem(self.kernel, compiled) is not None:
            return  # not kept: a later call asks Triton again (compile-ahead's futures come back this way)
        tail = []
        for name, default in self.tail[len(args) :]:
            v = kwargs.get(name, default)
            if v is _MISSING:
                return
            tail.append(v.data_ptr() if isinstance(v, torch.Tensor) else v)
        if any(isinstance(kwargs.get(n), torch.Tensor) for n, _ in self.tail[len(args) :]):
            return  # a tensor by keyword: its address would be frozen into the tail; leave it to Triton
        self.variants[key] = (compiled, direct_head(compiled), tail)
        self.path = DIRECT


_MISSING = object()


def _active_driver():
    from triton.runtime import driver

    return driver.active
