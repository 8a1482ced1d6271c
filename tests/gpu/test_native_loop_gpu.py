"""The native step loop on CUDA (gmtool.kernels.native_loop): a piecewise entry's steps launch through one C call
per step, stitched into one graph launch (its attention kernel nodes set to the step's grid and num_seqs when
they change), and its replays equal the Python loop's and the op-by-op loop's bit for bit and eager within
tolerance, the step's own metadata (grid, num_seqs) taken each step. Host times are printed, not asserted:
tools/native_loop_timing.py and make bench's lean stage measure them."""

import time

import pytest
import torch

from gmtool.core.compositions import parse_composition
from gmtool.kernels.native_loop import (
    STITCHED,
    cuda_driver,
    library,
    node_sets,
    python_path,
    unstitched,
)
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from tests.gpu.rigs import piecewise_rig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_loop_builds_here():
    """The C compiler and the driver's entry points are there (else every entry says why, in launch_path)."""
    lib, driver = library(), cuda_driver()
    assert not isinstance(lib, str), lib
    assert not isinstance(driver, str), driver
    assert driver.graphs is not None, "the driver has no graph-building entry points"
    print(f"cuFuncGetParamInfo: {'checked' if driver.param_info else 'absent: layouts not checked'}")


@pytest.mark.parametrize(
    "scenario,bucket,comps,impl",
    [
        # one bucket, many mixes: each step's grid (num_seqs, query tiles) and num_seqs differ from the capture's
        ("prefill", "128", ["64+64", "32*4", "16*8", "100+28@512", "128", "1+127@300", "64+64"], "breakable"),
        ("decode", "8", ["1*8@700", "1*5", "1*8@100", "1*3@900"], "breakable"),  # split + combine
        ("prefill", "128", ["64+64", "16*8", "100+28@512"], "fx"),  # FX runners write K/V: two launches each
    ],
)
def test_native_replays_equal_the_python_loop_bit_for_bit(scenario, bucket, comps, impl):
    bench, ex = piecewise_rig(scenario, bucket, impl)
    tol_same, tol = tolerances_for(torch.bfloat16)
    for i, text in enumerate(comps):
        b = bench.batch(parse_composition(text, seed=i))
        sets = sum(node_sets(e) for e in ex.graphs.values())
        native = ex.step(b).clone()
        (entry,) = ex.graphs.values()
        assert entry.launch_path == STITCHED, entry.launch_path
        with python_path(entry):
            python = ex.step(b).clone()
        with unstitched(entry):
            by_op = ex.step(b).clone()
        fn, logits = bench.eager_fn(b)
        fn()
        err = rel_err_per_seq(native, logits)
        same = (torch.equal(native, python), torch.equal(by_op, python))
        print(
            f"{scenario} {impl} {text}: stitched, op by op == python: {same}, rel err {err:.2e}, "
            f"nodes set {node_sets(entry) - sets}"
        )
        assert same == (True, True), text
        assert err < tol and rel_err_per_seq(native, ex.eager_same_shape(b)) < tol_same, text
    ex.release()


def test_host_time_per_step_native_vs_python():
    """Printed: the host time of one piecewise prefill step's launches (device busy, syncs not timed)."""
    bench, ex = piecewise_rig("prefill", "128", "breakable")
    b = bench.batch(parse_composition("64+32*2", seed=0))
    ex.step(b)
    (entry,) = ex.graphs.values()

    def median_us(n=60) -> float:
        out = []
        torch.cuda.synchronize()
        for i in range(n):
            t0 = time.perf_counter()
            entry.replay(b)
            out.append((time.perf_counter() - t0) * 1e6)
            if i % 8 == 7:
                torch.cuda.synchronize()
        return sorted(out)[n // 2]

    stitched = median_us()
    with unstitched(entry):
        by_op = median_us()
    with python_path(entry):
        python = median_us()
    print(
        f"prefill 128, {entry.runners} runners: stitched {stitched:.0f} us per step, op by op {by_op:.0f} us, "
        f"python {python:.0f} us"
    )
    assert entry.launch_path == STITCHED
    ex.release()
