#!/usr/bin/env python3
"""make mutants: break the correctness paths on purpose, one at a time, and check that a test notices.

Each mutant is one exact text replacement in one file, with the tests that must kill it. For each mutant the
tree (gmtool, tests, profiles, pyproject.toml) is copied to a scratch directory, the replacement is applied
there (the old text must occur exactly once: the list must stay in sync with the code), and pytest runs the
mutant's tests with PYTHONPATH set to that copy. Killed: pytest failed. Survived: every test passed, so no
test can tell the broken code from the real one.

Before the mutants, the same tests run once on an unmutated copy: a test that fails anyway kills nothing.

    tools/mutants.py                 # every mutant, one at a time
    tools/mutants.py -j 2            # two at a time
    tools/mutants.py --only relerr-mean,tape-replay-noop
    tools/mutants.py --list          # the list (and a check that every old text is still in the code)
    tools/mutants.py --markdown mutants.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ("gmtool", "tests", "profiles", "pyproject.toml")
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files; the first that fails is the one named
    desc: str


def M(id, file, old, new, tests, desc) -> Mutant:
    return Mutant(id, file, old, new, tuple([tests] if isinstance(tests, str) else tests), desc)


JUDGE = "tests/test_judge.py::"
KILLS = "tests/test_mutant_kills.py::"
EXEC = "tests/test_executor.py::"
FEAT = "tests/test_attention_features.py::"
INPUTS = "tests/test_inputs.py::"
BUCKETS = "tests/test_buckets.py::"
VMM = "tests/test_vmm_bookkeeping.py::"
REPORT = "tests/test_report.py::"
ALLOCSIM = "tests/test_allocsim.py::"

MUTANTS: list[Mutant] = [
    # -- copy-in: fields and padding (gmtool/core/inputs.py, gmtool/core/batch.py) -----------------------------------
    M(
        "inputs-inplace-pad-dead",
        "gmtool/core/inputs.py",
        "        before = self._written if self._written_key is key else None\n"
        "        self._written_key = self._layout_key = None  # a write that raises part-way leaves nothing to trust\n",
        "        self._written_key = self._layout_key = None  # a write that raises part-way leaves nothing to trust\n"
        "        before = self._written if self._written_key is key else None\n",
        INPUTS + "test_staging_written_in_place_equals_a_fresh_write",
        "copy-in's in-place padding branch is dead: every load pads in full",
    ),
    M(
        "inputs-inplace-keeps-old-tokens",
        "gmtool/core/inputs.py",
        "        if n0 > n:\n            tok[:, n:n0] = _TOKEN_PAD\n",
        "        if n0 > n:\n            pass\n",
        INPUTS + "test_staging_written_in_place_equals_a_fresh_write",
        "in-place padding leaves the previous batch's tokens (and their slots) past the new batch",
    ),
    M(
        "inputs-inplace-keeps-old-seqs",
        "gmtool/core/inputs.py",
        "            seq[:, b:b0] = 0\n            bt[b:b0] = 0\n",
        "            bt[b:b0] = 0\n",
        INPUTS + "test_staging_written_in_place_equals_a_fresh_write",
        "in-place padding leaves the previous batch's kv lens / logits indices in padded sequences",
    ),
    M(
        "inputs-full-pad-keeps-wide-rows",
        "gmtool/core/inputs.py",
        "            bt[:b, w:] = 0\n            bt[b:] = 0\n            return\n",
        "            bt[b:] = 0\n            return\n",
        INPUTS + "test_staging_written_in_place_equals_a_fresh_write",
        "full padding leaves block-table entries past this batch's width",
    ),
    M(
        "inputs-cu-tail-zero",
        "gmtool/core/inputs.py",
        "            seq[:, b:] = 0\n            cu[b + 1 :] = n\n",
        "            seq[:, b:] = 0\n            cu[b + 1 :] = 0\n",
        KILLS + "test_copy_in_writes_every_field_and_pads_the_rest",
        "cu_q's padded tail is 0 instead of the token count",
    ),
    M(
        "inputs-failed-load-trusted",
        "gmtool/core/inputs.py",
        "        self._written_key = self._layout_key = None  # a write that raises part-way leaves nothing to trust\n",
        "        self._layout_key = None\n",
        INPUTS + "test_a_load_that_fails_part_way_is_not_trusted_for_padding",
        "a load that raised part-way is still trusted by the next in-place padding",
    ),
    M(
        "inputs-block-tables-not-copied",
        "gmtool/core/inputs.py",
        "        end = tok.size + seq.size + cu.size + bt.size\n",
        "        end = tok.size + seq.size + cu.size\n",
        KILLS + "test_copy_in_writes_every_field_and_pads_the_rest",
        "the host-to-device copy stops before the block tables",
    ),
    M(
        "inputs-kv-lens-not-copied",
        "gmtool/core/inputs.py",
        "        seq[:, :b] = batch.seq_fields\n",
        "        seq[0, :b] = batch.seq_fields[0]\n",
        KILLS + "test_copy_in_writes_every_field_and_pads_the_rest",
        "copy-in writes logits indices but not kv lens",
    ),
    M(
        "graph-without-copy-in",
        "gmtool/core/executor.py",
        "            self.backend.begin()\n            self.inputs.copy_in(entry.key)\n",
        "            self.backend.begin()\n",
        EXEC + "test_graph_copies_its_own_inputs",
        "the copy-in is not the graph's first node: replays read the capture batch's inputs",
    ),
    M(
        "batch-slot-ignores-prefix",
        "gmtool/core/batch.py",
        "* bs + positions % bs",
        "* bs + (positions - np.asarray(prefixes, dtype=np.int64)[token_seq]) % bs",
        EXEC + "test_slot_mapping_follows_block_tables",
        "slot mapping drops the prefix's offset inside its block",
    ),
    M(
        "batch-logits-first-token",
        "gmtool/core/batch.py",
        "self.logits_indices = self.cu_q[1:] - 1",
        "self.logits_indices = self.cu_q[:-1]",
        KILLS + "test_gmtool_eager_matches_hf_attention_on_prefill",
        "logits taken at each sequence's first token, not its last",
    ),
    # -- bucket key and graph lookup (gmtool/core/buckets.py, executor prepare/key_for) ------------------------
    M(
        "bucket-bisect-right",
        "gmtool/core/buckets.py",
        "i = bisect.bisect_left(self.sizes, num_tokens)",
        "i = bisect.bisect_right(self.sizes, num_tokens)",
        BUCKETS + "test_policy_picks_smallest_fitting_bucket",
        "a batch that fills a bucket exactly goes to the next one",
    ),
    M(
        "bucket-wide-key-dropped",
        "gmtool/core/buckets.py",
        "return BucketKey(bucket, num_seqs if wide else None, decode)",
        "return BucketKey(bucket, None, decode)",
        (
            BUCKETS + "test_wide_key_only_for_non_decode_batches",
            JUDGE + "test_keys_sharing_a_token_count_get_their_own_graphs",
        ),
        "the wide prefill key loses num_seqs",
    ),
    M(
        "bucket-key-cache-ignores-seqs",
        "gmtool/core/buckets.py",
        "asked = (num_tokens, num_seqs, decode, pinned)",
        "asked = (num_tokens, decode, pinned)",
        JUDGE + "test_keys_sharing_a_token_count_get_their_own_graphs",
        "the key cache answers by token count: every mix of a bucket gets the first key",
    ),
    M(
        "bucket-wide-for-decode",
        "gmtool/core/buckets.py",
        "wide = self.wide_key and not decode",
        "wide = self.wide_key",
        BUCKETS + "test_wide_key_only_for_non_decode_batches",
        "decode batches get the wide key too (a graph per sequence count)",
    ),
    M(
        "lookup-by-num-tokens",
        "gmtool/core/executor.py",
        "        entry = self.graphs.get(key)\n",
        "        entry = next((g for k, g in self.graphs.items() if k.num_tokens == key.num_tokens), None)\n",
        JUDGE + "test_keys_sharing_a_token_count_get_their_own_graphs",
        "graph lookup by num_tokens only",
    ),
    M(
        "full-mode-narrow-key",
        "gmtool/modes.py",
        "        return self is GraphMode.FULL\n",
        "        return False\n",
        JUDGE + "test_keys_sharing_a_token_count_get_their_own_graphs",
        "full prefill graphs keyed by num_tokens alone (the classic bug, in the safe mode)",
    ),
    M(
        "baked-plan-after-upload",
        "gmtool/core/executor.py",
        "entry.baked_plans = planned",
        "entry.baked_plans = list(ctx.planned_with)",
        EXEC + "test_the_upload_replay_at_capture_keeps_the_baked_plan",
        "the baked plan is read after the upload replay re-prepared the context: narrow graphs go unflagged on CUDA",
    ),
    M(
        "lm-head-logits-in-the-pool",
        "gmtool/model/loading.py",
        "torch.matmul(hidden_rows, w.t(), out=out)",
        "out.copy_(torch.matmul(hidden_rows, w.t()))",
        "tests/test_lean_piecewise.py::test_the_lm_head_ends_the_last_graph_writing_the_persistent_logits",
        "the LM head's padded logits land in the last piece's pool (most of the pieces' memory on the H200)",
    ),
    M(
        "fast-launch-ignores-alignment",
        "gmtool/kernels/launcher.py",
        "key.append((a.dtype, v % 16 == 0))",
        "key.append((a.dtype,))",
        "tests/test_fast_launch.py::test_what_triton_specializes_on_goes_through_triton_first",
        "a misaligned tensor launches the variant compiled for 16-byte-aligned pointers",
    ),
    M(
        "fast-launch-ignores-int-one",
        "gmtool/kernels/launcher.py",
        "return (v == 1, v % 16 == 0, -_I32 <= v < _I32, v < _I64)",
        "return (v % 16 == 0, -_I32 <= v < _I32, v < _I64)",
        "tests/test_fast_launch.py::test_what_triton_specializes_on_goes_through_triton_first",
        "an int equal to 1 (a constant in Triton's variant) launches the variant compiled for other values",
    ),
    M(
        "fast-launch-falls-back-inside-the-try",
        "gmtool/kernels/launcher.py",
        "                        unkeyed = True\n                        break\n",
        "                        return self.kernel[grid](*args, **kwargs)\n",
        "tests/test_fast_launch.py::test_an_argument_of_another_kind_goes_through_triton_once_and_its_error_is_the_caller_s",
        "a TypeError Triton raises for an unkeyed argument launches the kernel through Triton a second time",
    ),
    M(
        "fast-launch-runs-during-compile-ahead",
        "gmtool/kernels/launcher.py",
        'getattr(self.kernel.run, "__func__", None) is self._run',
        "True",
        "tests/test_fast_launch.py::test_hooks_a_replaced_run_and_an_unconventional_kernel_keep_triton_s_path",
        "a known variant launches for real while compile-ahead's pass has made launches compiles only",
    ),
    M(
        "fast-launch-keeps-the-pass-s-run",
        "gmtool/kernels/launcher.py",
        'self._run = getattr(kind.run, "__wrapped__", kind.run)',
        "self._run = kind.run",
        "tests/test_fast_launch.py::test_a_first_launch_inside_compile_ahead_s_pass_leaves_the_direct_path_for_after",
        "a kernel first launched inside compile-ahead's pass launches directly during it, and never after",
    ),
    M(
        "fast-launch-keywords-by-value-only",
        "gmtool/kernels/launcher.py",
        "key += (tuple(kwargs.items()), tuple(map(type, kwargs.values())))",
        "key += (tuple(kwargs.items()), ())",
        "tests/test_fast_launch.py::test_keywords_key_by_type_and_value_and_triton_s_per_call_options_count",
        "n=3.0 by keyword launches the variant compiled for n=3 (i32), with 3 frozen in",
    ),
    M(
        "upload-trusts-a-refused-upload",
        "gmtool/core/executor.py",
        "if not (alone and all(s.upload() for s in self.steps)):",
        "if not (alone and [s.upload() for s in self.steps]):",
        "tests/test_executor.py::test_capture_uploads_whole_graphs_without_running_them",
        "a graph the driver would not upload is left for the timed path's first launch, out of the ledger",
    ),
    M(
        "capture-bench-keeps-the-best-process",
        "gmtool/measure/bench.py",
        "return {**ordered[(len(ordered) - 1) // 2], ",
        "return {**ordered[0], ",
        "tests/test_bench_summary.py::test_capture_stage_runs_cold_then_warm_processes_on_one_new_triton_cache",
        "the capture bench reports its fastest process as the figure, not the median of its samples",
    ),
    M(
        "tp-timeout-accepted-without-ranks",
        "gmtool/parallel/launch.py",
        "if cfg.tp == 1:  # no other rank to wait for (under torchrun, cfg.tp is its WORLD_SIZE)",
        "if False:",
        "tests/test_bad_inputs.py::test_every_bad_input_is_one_line_and_exit_2",
        "--tp-timeout on a one-rank run is taken and ignored",
    ),
    M(
        "norm-sums-a-partial-too-few",
        "gmtool/kernels/layers.py",
        "for s in tl.static_range(SPLIT):",
        "for s in tl.static_range(SPLIT - 1):",
        "tests/test_layer_kernels.py::test_layer_kernels_under_interpreter",
        "the kernel after a split-K projection (norm, QK-norm+RoPE, SiLU) drops its last slice of K",
    ),
    M(
        "norm-drops-the-partials-bias",
        "gmtool/kernels/layers.py",
        "        if HAS_BIAS:\n            acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)",
        "        if HAS_BIAS:\n            acc += 0.0",
        "tests/test_layer_kernels.py::test_layer_kernels_under_interpreter",
        "a projection's bias is lost where its partial sums go to the next kernel",
    ),
    M(
        "replay-over-another-bucket-s-inputs",
        "gmtool/core/inputs.py",
        "return self._layout_key is key or self._layout_key == key",
        "return True",
        "tests/test_executor.py::test_a_replay_over_another_bucket_s_inputs_is_refused",
        "a graph replays over another bucket's arena layout, reading its token ids as positions",
    ),
    M(
        "load-keeps-the-layout-key-on-failure",
        "gmtool/core/inputs.py",
        "self._written_key = self._layout_key = None  # a write",
        "self._written_key = None  # a write",
        "tests/test_inputs.py::test_a_load_that_fails_part_way_leaves_no_layout_to_replay",
        "a load that raised part-way leaves the arena half rewritten, and a graph of the old key replays over it",
    ),
    M(
        "qk-kernel-writes-no-v",
        "gmtool/kernels/layers.py",
        "num_heads + (2 if cache else 1) * num_kv_heads",
        "num_heads + num_kv_heads",
        "tests/test_layer_kernels.py::test_layer_kernels_under_interpreter",
        "the QK-norm + RoPE kernel that writes the cache launches no v heads: V never reaches the cache",
    ),
    M(
        "fused-kv-write-to-layer-0",
        "gmtool/model/fused.py",
        "kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]",
        "kc, vc = ctx.cache.k[0], ctx.cache.v[0]",
        "tests/test_layer_kernels.py::test_layer_kernels_under_interpreter",
        "every fused layer writes its K/V into layer 0's cache",
    ),
    M(
        "eager-step-skips-the-input-check",
        "gmtool/core/auto.py",
        "self.check_inputs()  # its views are the arena's at this key's offsets, as a graph's",
        "pass",
        "tests/test_auto.py::test_an_eager_step_over_another_bucket_s_inputs_is_refused",
        "auto's eager step runs over another bucket's arena layout",
    ),
    M(
        "piecewise-layers-write-kv",
        "gmtool/core/executor.py",
        "layers_write_kv=not self.mode.piecewise,",
        "layers_write_kv=True,",
        "tests/test_auto.py::test_fused_layers_write_k_v_only_where_the_attention_is_in_the_graph",
        "a piecewise executor's warm-ups launch --fuse's cache-writing QK kernel, which its capture never records",
    ),
    M(
        "combine-reads-every-split",
        "gmtool/kernels/decode_attention.py",
        "s_ok = (s < num_splits) & (s * per_split < kv_len - first)",
        "s_ok = s < num_splits",
        "tests/test_attention_features.py::test_kernels_under_the_interpreter",
        "the decode combine reads the partials of splits past a sequence's tokens, which wrote none",
    ),
    M(
        "pdl-past-small-m",
        "gmtool/model/fused.py",
        "return self.pdl if x.numel() <= self.small_m * x.shape[-1] else 0",
        "return self.pdl",
        "tests/test_pdl.py::test_fused_ops_pass_the_mode_on",
        "steps above the small-M GEMM's rows launch with PDL, which only costs there (no weight prefetch)",
    ),
    M(
        "logit-rule-not-in-place",
        "gmtool/model/families.py",
        "return logits.div_(cap).tanh_().mul_(cap) if in_place else",
        "return torch.tanh(logits / cap) * cap if in_place else",
        "tests/test_lean_piecewise.py::test_logits_into_writes_in_place_else_through_a_copy",
        "the LM head's soft-cap makes new logits instead of overwriting the persistent ones: they go unwritten",
    ),
    M(
        "release-keeps-held-entries",
        "gmtool/core/executor.py",
        "        for entry in self.graphs.values():\n            entry.steps.clear()\n",
        "        for entry in self.graphs.values():\n            pass\n",
        EXEC + "test_release_leaves_no_graph_alive_through_an_entry_a_caller_holds",
        "an entry a caller holds keeps its graphs and their pool alive past release (VMM cannot unmap)",
    ),
    M(
        "no-poison-after-replay",
        "gmtool/verify/soak.py",
        "                after_replay=self.poisoner.after_replay,\n",
        "                after_replay=None,\n",
        "tests/test_verify.py::test_a_graph_output_handed_out_from_pool_memory_is_caught_and_named",
        "graph memory is not poisoned between a replay and the read of its result: outputs left in pool memory pass",
    ),
    M(
        "key-ignores-decode",
        "gmtool/core/executor.py",
        "batch.num_tokens, batch.num_seqs, batch.is_decode, batch.composition.bucket",
        "batch.num_tokens, batch.num_seqs, False, batch.composition.bucket",
        EXEC + "test_full_decode_graph_matches_eager_for_many_compositions[tiny-qwen3]",
        "decode batches take the prefill key (and its host-planned attention)",
    ),
    M(
        "impl-masked-planned-swapped",
        "gmtool/core/executor.py",
        'return "masked" if key.num_seqs is not None else "planned"',
        'return "planned" if key.num_seqs is not None else "masked"',
        EXEC + "test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe",
        "the wide key gets the host-planned attention, the narrow one the masked",
    ),
    # -- runner metadata (CapturedGraph.replay, AttentionRunner, gmtool/model/attention.py) ---------------------
    M(
        "replay-keeps-capture-plan",
        "gmtool/core/executor.py",
        "        if refresh_metadata:\n            self.ctx.prepare(batch.plan)\n",
        "        if refresh_metadata:\n            pass\n",
        (
            EXEC + "test_piecewise_matches_eager_for_prefill_mixes[tiny-qwen3]",
            EXEC + "test_runner_with_stale_metadata_gives_wrong_result",
        ),
        "replay never refreshes ctx.plan: runners attend with the capture batch's plan",
    ),
    M(
        "runner-frozen-context",
        "gmtool/core/forwards.py",
        "AttentionRunner(layer, q_in, out, scale, entry.ctx, opts)",
        'AttentionRunner(layer, q_in, out, scale, __import__("copy").copy(entry.ctx), opts)',
        EXEC + "test_piecewise_matches_eager_for_prefill_mixes[tiny-qwen3]",
        "runners hold a snapshot of the capture's context, not the live one",
    ),
    M(
        "step-grid-not-refreshed",
        "gmtool/model/attention.py",
        "        self.step_grid = self.backend.step_grid(self.signature)\n        self.planned_with.clear()\n",
        "        self.planned_with.clear()\n",
        "tests/test_launcher.py::test_planned_runner_launches_with_the_current_steps_grid",
        "prepare keeps the capture's launch grid: bound Triton runners launch with a stale grid",
    ),
    M(
        "bound-launch-stale-ints",
        "gmtool/kernels/launcher.py",
        "        for i, v in zip(self.slots, values):\n            a[i] = v\n        run(",
        "        for i, v in zip(self.slots, values):\n            pass\n        run(",
        "tests/test_launcher.py::test_first_call_compiles_through_triton_then_launches_directly",
        "a direct launch passes the first call's num_seqs, not this call's",
    ),
    M(
        "compile-ahead-launches",
        "gmtool/kernels/compile_ahead.py",
        "                launch(kernel, *args, grid=grid, warmup=True, **kwargs)\n",
        "                launch(kernel, *args, grid=grid, warmup=False, **kwargs)\n",
        "tests/test_compile_ahead.py::test_launches_inside_compile_instead_of_running",
        "the compile-ahead forward runs its Triton kernels instead of only compiling them",
    ),
    M(
        "compile-ahead-holds-other-threads",
        "gmtool/kernels/compile_ahead.py",
        "        if threading.get_ident() != owner:\n",
        "        if False:\n",
        "tests/test_early_compile.py::test_compiling_only_holds_its_own_thread_s_launches_and_runs_another_thread_s",
        "while the early compile holds its launches, the build's other threads' Triton launches are held and dropped",
    ),
    M(
        "compile-ahead-windows-overlap",
        "gmtool/kernels/compile_ahead.py",
        "    with _WINDOW, _compiling_only(device, workers, held_out) as children:\n",
        "    with _compiling_only(device, workers, held_out) as children:\n",
        "tests/test_early_compile.py::test_two_threads_compiling_only_take_turns_and_leave_triton_s_run_as_found",
        "two threads' compiling_only windows overlap: the one that ends last puts back the other's stand-in for good",
    ),
    M(
        "early-compile-not-joined-on-refusal",
        "gmtool/measure/workbench.py",
        "            if early is not None:  # outlive a refused build\n                early.join()\n",
        "            pass\n",
        "tests/test_early_compile.py::test_a_refused_build_waits_for_the_early_compile_before_it_raises",
        "a refused build raises while the early compile still holds Triton's launch path",
    ),
    M(
        "taps-llama-names-only",
        "gmtool/model/families.py",
        "    return next((m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)\n",
        "    return None\n",
        "tests/test_verify.py::test_a_family_with_other_module_names_is_tapped_and_localized",
        "verify's taps find a decoder stack only under Llama's name `layers`",
    ),
    M(
        "plan-candidates-past-max-tokens",
        "gmtool/plan/run.py",
        "        measured, top = [b for b in measured if b <= inp.max_tokens], inp.max_tokens\n",
        "        pass\n",
        "tests/test_plan.py::test_max_tokens_bounds_the_candidates_and_is_checked_before_measuring",
        "plan keeps measured buckets above --max-tokens among its candidates",
    ),
    M(
        "plan-keeps-mixes-of-cut-buckets",
        "gmtool/cli/plan.py",
        "        (kept if (c.bucket or policy.bucket_for(c.num_tokens)) in buckets else left).append(text.strip())\n",
        "        kept.append(text.strip())\n",
        "tests/test_plan.py::test_plan_keeps_a_profile_s_mixes_on_the_buckets_it_measures_and_says_which_it_leaves",
        "plan keeps a profile's mixes on the buckets it leaves out, and refuses its own built-in profile",
    ),
    M(
        "switch-takes-any-word",
        "gmtool/switches.py",
        "        if value is not None and value.strip().lower() not in OFF + ON:\n",
        "        if False:\n",
        "tests/test_bad_inputs.py::test_a_switch_set_to_neither_an_on_nor_an_off_word_is_refused",
        "a GMTOOL_* switch set to a word neither on nor off is read as on",
    ),
    M(
        "workload-count-sum-wraps",
        "gmtool/plan/workload.py",
        "    if total >= 2**62:\n",
        "    if False:\n",
        "tests/test_plan.py::test_workload_counts_that_overflow_or_are_booleans_are_refused",
        "a workload whose counts add up past int64 wraps around to a negative number of steps",
    ),
    M(
        "early-compile-one-bucket",
        "gmtool/kernels/early_compile.py",
        "            for size in g.sizes:\n",
        "            for size in g.sizes[-1:]:\n",
        "tests/test_early_compile.py::test_each_decode_bucket_s_write_and_attention_are_launched_smallest_first_over_the_executor_s_layout",
        "the early compile launches the largest decode bucket's kernels only (the others compile in the pass)",
    ),
    M(
        "early-compile-guesses-windows",
        "gmtool/kernels/early_compile.py",
        "    if windowed or any(",
        "    if False and any(",
        "tests/test_early_compile.py",
        "the early compile guesses plain attention for a model with a sliding window or capped logits",
    ),
    M(
        "cold-capture-no-retry",
        "gmtool/core/executor.py",
        "            except CaptureError:\n                if warm:\n",
        "            except CaptureError:\n                if True:\n",
        "tests/test_compile_ahead.py::test_only_the_first_capture_warms_up_and_a_failed_cold_capture_is_warmed_and_retried",
        "a shape whose cold capture fails is not warmed up and captured again",
    ),
    M(
        "compile-ahead-drops-held-launches",
        "gmtool/kernels/compile_ahead.py",
        "                for kernel, args, grid, kwargs in by_compile_cost(held.values()):\n",
        "                for kernel, args, grid, kwargs in by_compile_cost(held.values())[:0]:\n",
        "tests/test_compile_ahead.py::test_launches_inside_compile_instead_of_running",
        "compile-ahead's pass holds its forwards' launches and never compiles them",
    ),
    M(
        "compile-ahead-holds-every-repeat",
        "gmtool/kernels/compile_ahead.py",
        "            key = (id(self), made[1], grid,",
        "            key = (len(held), made[1], grid,",
        "tests/test_compile_ahead.py::test_a_launch_like_one_held_is_held_once_and_the_longest_kernel_s_launches_replay_first",
        "compile-ahead's pass replays every layer's launches through Triton's binder, not each distinct one once",
    ),
    M(
        "compile-ahead-merges-other-ints",
        "gmtool/kernels/compile_ahead.py",
        "            key = (id(self), made[1], grid,",
        "            key = (id(self), grid,",
        "tests/test_compile_ahead.py::test_a_launch_like_one_held_is_held_once_and_the_longest_kernel_s_launches_replay_first",
        "a launch whose ints (or tensors' alignment) differ from one held is dropped: its variant never compiles ahead",
    ),
    M(
        "compile-ahead-launch-order",
        "gmtool/kernels/compile_ahead.py",
        '    return sorted(launches, key=lambda h: -len(getattr(h[0], "src", "") or ""))\n',
        "    return list(launches)\n",
        "tests/test_compile_ahead.py::test_a_launch_like_one_held_is_held_once_and_the_longest_kernel_s_launches_replay_first",
        "the longest compile is forked last, as its launches came",
    ),
    M(
        "compile-child-not-awaited",
        "gmtool/kernels/compile_ahead.py",
        "                if child is not None:\n                    children.wait(child)\n",
        "                if child is not None:\n                    pass\n",
        "tests/test_compile_ahead.py::test_a_compile_child_builds_the_launcher_in_a_process_of_its_own_beside_the_compile",
        "the worker compiles without waiting for the child compiling the same variant: both compile, the fork buys nothing",
    ),
    M(
        "compile-child-per-submit",
        "gmtool/kernels/compile_children.py",
        "        if key in self._keys or self.closed",
        "        if key is None or self.closed",
        "tests/test_compile_ahead.py::test_child_compiles_run_each_variant_once_in_another_process_and_say_which_failed",
        "a variant submitted again forks a second child, which nothing waits for",
    ),
    M(
        "compile-child-barrier-skipped",
        "gmtool/kernels/compile_children.py",
        "        if not self._started.wait(self.STARTED_TIMEOUT_S):\n",
        "        if False:\n",
        "tests/test_compile_ahead.py::test_every_child_is_forked_before_any_worker_compiles",
        "a worker compiles while the main thread still forks children: a fork may copy a lock the compile holds",
    ),
    M(
        "compile-child-killed-alone",
        "gmtool/kernels/compile_children.py",
        "            os.killpg(pid, 9)\n",
        "            os.kill(pid, 9)\n",
        "tests/test_compile_ahead.py::test_a_child_past_its_time_is_killed_with_its_own_children",
        "a compile child past its time is killed but its launcher build and ptxas run on",
    ),
    M(
        "compile-ahead-merges-other-types",
        "gmtool/kernels/compile_ahead.py",
        ", _types(made[1]), _types(made[3].values()))\n",
        ")\n",
        "tests/test_compile_ahead.py::test_a_launch_like_one_held_is_held_once_and_the_longest_kernel_s_launches_replay_first",
        "a launch with True where one held had 1 is dropped: Triton's variant for it compiles at its first launch",
    ),
    M(
        "rope-rows-trigger-behind-loads",
        "gmtool/kernels/layers.py",
        "        pdl_mod.trigger_early(PDL)\n        row = tl.load(pos_ptr + t).to(tl.int64)\n",
        "        row = tl.load(pos_ptr + t).to(tl.int64)\n        pdl_mod.trigger_early(PDL)\n",
        "tests/test_pdl.py::test_pdl_variants_compile_for_hopper_and_wait_before_reading",
        "EARLY's trigger waits behind the QK kernel's early loads (B=1 kv 1,024 0.818 against 0.794 ms on the H200)",
    ),
    M(
        "rope-rows-read-after-the-wait",
        "gmtool/kernels/layers.py",
        "        pdl_mod.trigger_early(PDL)\n        row = tl.load(pos_ptr + t).to(tl.int64)\n",
        "        pdl_mod.trigger_early(PDL)\n        pdl_mod.wait(PDL)\n        row = tl.load(pos_ptr + t).to(tl.int64)\n",
        "tests/test_pdl.py::test_pdl_variants_compile_for_hopper_and_wait_before_reading",
        "the QK kernel waits before reading its step inputs and the RoPE table: the reads no longer overlap the kernel ahead",
    ),
    M(
        "compile-ahead-runs-two-shapes",
        "gmtool/kernels/compile_ahead.py",
        "    return [k for k in dict.fromkeys(keys) if k != key]\n",
        "    return [k for k in dict.fromkeys(keys) if k != key][:1]\n",
        "tests/test_compile_ahead.py::test_the_pass_runs_every_decode_bucket_s_forward_smallest_first_and_the_captured_shape_last",
        "compile-ahead's pass runs only the smallest and the captured shape: a middle bucket's variant compiles in its capture",
    ),
    M(
        "compile-ahead-past-the-sequence-slots",
        "gmtool/kernels/compile_ahead.py",
        " if s <= ex.inputs.max_seqs)",
        ")",
        "tests/test_compile_ahead.py::test_the_pass_runs_every_decode_bucket_s_forward_smallest_first_and_the_captured_shape_last",
        "the pass runs decode buckets past the sequence slots (with torch attention the whole pass fails)",
    ),
    M(
        "compile-ahead-own-shape-on-the-zeroed-arena",
        "gmtool/kernels/compile_ahead.py",
        "                ex.inputs.invalidate()\n                ex.inputs.load(batch, key)\n            fn()",
        "                ex.inputs.invalidate()\n            fn()",
        "tests/test_compile_ahead.py::test_the_pass_runs_every_decode_bucket_s_forward_smallest_first_and_the_captured_shape_last",
        "the captured shape's forward in the pass reads the zeroed arena, not its batch",
    ),
    M(
        "capture-cost-note-without-compile-ahead",
        "gmtool/measure/sweep.py",
        "    if ahead:\n",
        "    if False:\n",
        "tests/test_judge.py::test_a_sweep_notes_what_each_mode_s_captures_cost",
        "a run's notes leave out the Triton kernels compiled ahead of its first capture",
    ),
    M(
        "capture-gc-not-frozen",
        "gmtool/core/executor.py",
        "        with gc_frozen(), forward_context(ctx), torch.no_grad():\n",
        "        with forward_context(ctx), torch.no_grad():\n",
        "tests/test_executor.py::test_capture_runs_with_the_gc_frozen_and_leaves_it_as_it_was",
        "a full collection inside a capture walks the whole model's objects again",
    ),
    M(
        "gc-thaws-a-caller-s-freeze",
        "gmtool/core/executor.py",
        "    if gc.get_freeze_count():\n",
        "    if False:\n",
        "tests/test_executor.py::test_capture_runs_with_the_gc_frozen_and_leaves_it_as_it_was",
        "a capture under an engine's own gc.freeze() thaws everything the engine froze",
    ),
    M(
        "errors-alike-not-grouped",
        "gmtool/cli/run_sweep.py",
        '        groups.setdefault(re.sub(r"\\d+(\\.\\d+)?", "#", e), [e, -1])[1] += 1\n',
        "        groups.setdefault(e, [e, -1])[1] += 1\n",
        "tests/test_compare.py::test_errors_alike_but_for_their_numbers_print_once_with_their_count",
        "a too-small KV cache prints one error line per batch, each alike but for its block count",
    ),
    M(
        "run-notes-not-printed",
        "gmtool/cli/run_sweep.py",
        "        if note not in shown:\n",
        "        if note in shown:\n",
        (
            "tests/test_cli_capture.py::test_capture_on_cpu_writes_results",
            "tests/test_cli_capture.py::test_capture_prints_what_it_did_not_apply_once",
        ),
        "capture and compare keep the run's notes (what the captures cost, an option not applied) out of the terminal",
    ),
    M(
        "compile-ahead-runs-every-layer",
        "gmtool/kernels/compile_ahead.py",
        "    config.num_hidden_layers = pass_layers(config)\n",
        "    config.num_hidden_layers = n\n",
        "tests/test_compile_ahead.py::test_leading_layers_shortens_the_forward_and_restores_it",
        "compile-ahead's forwards run all layers again (the main thread kept busy while compiles wait)",
    ),
    M(
        "fused-forward-runs-every-layer",
        "gmtool/model/fused.py",
        "zip(layers[:depth], norms, mlp_kw)",
        "zip(layers, norms, mlp_kw)",
        "tests/test_compile_ahead.py::test_leading_layers_shortens_the_forward_and_restores_it",
        "--fuse's forward ignores the depth compile-ahead's pass sets",
    ),
    M(
        "compile-ahead-no-launcher-beside-compile",
        "gmtool/kernels/compile_ahead.py",
        "            builders.submit(_build_launcher, src)\n",
        "            pass\n",
        "tests/test_compile_ahead.py::test_each_compile_in_the_pass_builds_its_launcher_beside_it_and_only_in_the_pass",
        "a compile's C launcher is built after it, at its load, not beside it",
    ),
    M(
        "rope-table-check-skipped",
        "gmtool/model/rotary_table.py",
        "w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g) for w, g in zip(want, got)",
        "False for w, g in zip(want, got)",
        "tests/test_rotary_table.py::test_a_table_that_differs_from_the_module_is_not_used",
        "a RoPE table that differs from the module's own values is used: every layer's q/k rotate wrongly",
    ),
    M(
        "rope-table-for-dynamic-rope",
        "gmtool/model/rotary_table.py",
        "    if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE_TYPES:\n",
        "    if rope_type is None:\n",
        "tests/test_rotary_table.py::test_a_rope_that_follows_the_sequence_length_is_left_to_the_module",
        "a RoPE whose frequencies follow the sequence length is frozen into a table",
    ),
    M(
        "rope-table-gathers-other-rows",
        "gmtool/model/rotary_table.py",
        "index_select(1, self.positions)",
        "index_select(1, self.positions.flip(0))",
        "tests/test_rotary_table.py::test_the_table_gives_the_module_s_values_bit_for_bit",
        "the table hands each token another token's cos/sin",
    ),
    M(
        "rope-rows-read-by-token",
        "gmtool/kernels/layers.py",
        "        row = tl.load(pos_ptr + t).to(tl.int64)\n",
        "        row = t\n",
        "tests/test_layer_kernels.py::test_layer_kernels_under_interpreter",
        "the QK kernel rotates each token by the table's row of its index in the step, not of its position",
    ),
    M(
        "rope-table-for-any-forward",
        "gmtool/model/rotary_table.py",
        "    if params != FORWARD_PARAMS:\n",
        "    if params is None:\n",
        "tests/test_rotary_table.py::test_a_forward_that_takes_more_than_the_positions_is_left_to_the_module",
        "a rotary module called with more than the positions (the layer type) gets a table that takes only those",
    ),
    M(
        "rope-table-ignores-x-dtype",
        "gmtool/model/rotary_table.py",
        "(x.dtype == self.cos_sin.dtype and x.device == self.cos_sin.device)",
        "(x.device == self.cos_sin.device)",
        "tests/test_rotary_table.py::test_an_x_of_another_dtype_gets_the_module_s_own_values",
        "an x of another dtype than the table's gets the table's dtype, not x's as the module gives",
    ),
    M(
        "build-leaves-the-gemm-warmup-running-on-error",
        "gmtool/measure/workbench.py",
        "                rank = _shard_and_fuse(cfg, lm)\n            finally:",
        "                rank = _shard_and_fuse(cfg, lm)\n            except Exception:\n                raise\n            else:",
        "tests/test_gemm_warmup.py::test_a_build_that_fails_after_the_load_waits_for_the_warm_up_first",
        "a build that fails after the load leaves the GEMM warm-up thread running into the caller's captures",
    ),
    M(
        "fuse-takes-an-interleaved-rotate-half",
        "gmtool/model/fused.py",
        "return torch.equal(half(x), torch.tensor([-2.0, -3.0, 0.0, 1.0]))",
        "return True",
        "tests/test_fused.py::test_a_block_that_computes_more_than_the_fused_forward_is_left_to_the_model",
        "an attention whose rotate_half pairs neighbours (Cohere, ERNIE 4.5, Helium) is fused: q/k rotate wrongly",
    ),
    M(
        "fuse-ignores-extra-parts",
        "gmtool/model/fused.py",
        "    names = children + [n for n, _ in m.named_parameters(recurse=False)]\n",
        "    names = []\n",
        "tests/test_fused.py::test_a_block_that_computes_more_than_the_fused_forward_is_left_to_the_model",
        "an attention or MLP with a gate, a sub-norm or learned scales is fused without them",
    ),
    M(
        "fuse-counts-weightless-parts",
        "gmtool/model/fused.py",
        "if next(c.parameters(), None) is not None]",
        "]",
        "tests/test_fused.py::test_only_parts_that_hold_weights_count_as_more_than_the_fused_forward",
        "a function the kernels hub attaches as a child module stops --fuse for every layer",
    ),
    M(
        "gemm-warmup-skips-fused-shapes",
        "gmtool/model/gemm_warmup.py",
        "            if all(type(p) is torch.nn.Linear for p in parts) and len({p.in_features for p in parts}) == 1:\n",
        "            if False:\n",
        "tests/test_gemm_warmup.py::test_the_shapes_are_every_projection_and_the_fused_ones",
        "--fuse's QKV and gate/up shapes are not warmed up: their first uses stay in the capture",
    ),
    M(
        "gemm-warmup-skips-the-lm-head",
        "gmtool/model/gemm_warmup.py",
        "        for m in head_rows:  # as LoadedModel.logits_into runs it\n",
        "        for m in ():  # as LoadedModel.logits_into runs it\n",
        "tests/test_gemm_warmup.py::test_each_shape_runs_once_at_each_row_count",
        "the LM head's first uses (3-4 ms a row count) stay in the capture",
    ),
    M(
        "fuse-ignores-conditional-rope",
        "gmtool/model/fused.py",
        "    if _rope_under_a_condition(m):",
        "    if False:",
        "tests/test_fused.py::test_a_block_that_computes_more_than_the_fused_forward_is_left_to_the_model",
        "Flint's and EXAONE 4's global layers, which skip RoPE, are fused with RoPE: another model",
    ),
    M(
        "fused-check-never-fails",
        "gmtool/measure/fused_check.py",
        "    if not checked.ok:\n",
        "    if False:\n",
        "tests/test_fused_check.py::test_a_fused_block_that_computes_another_model_fails_the_run",
        "a --fuse run whose fused layers compute another model passes: every row agrees with itself",
    ),
    M(
        "fused-check-against-itself",
        "gmtool/measure/fused_check.py",
        "        with unfused(bench.lm.fused):\n",
        "        with unfused(None):\n",
        "tests/test_fused_check.py::test_a_fused_block_that_computes_another_model_fails_the_run",
        "the fused layers checked against themselves: nothing can differ",
    ),
    M(
        "held-launch-keeps-its-tensors",
        "gmtool/kernels/compile_ahead.py",
        "tuple(map(stand_ins, args))",
        "args",
        "tests/test_compile_ahead.py::test_a_held_launch_keeps_stand_ins_of_its_tensors_not_the_tensors",
        "compile-ahead's held launches keep the forwards' activations alive until the pass ends",
    ),
    M(
        "bound-kernel-learns-from-a-held-launch",
        "gmtool/kernels/launcher.py",
        "if self.path == PENDING and compiled is not HELD:",
        "if self.path == PENDING:",
        "tests/test_launcher.py::test_a_launch_held_by_compile_ahead_decides_nothing",
        "a runner first launched inside compile-ahead's pass leaves the direct path for good",
    ),
    M(
        "native-loop-stale-ints",
        "gmtool/kernels/step_loop.c",
        "            memcpy(pt->dst, &x, 4);\n",
        "            (void)x;\n",
        "tests/test_native_loop.py::test_a_second_step_patches_its_own_num_seqs",
        "the native step loop launches with the packed num_seqs of its build, not the step's",
    ),
    M(
        "stitched-compares-one-value",
        "gmtool/kernels/step_loop.c",
        "memcmp(p->applied, v, sizeof p->applied)",
        "memcmp(p->applied, v, sizeof(int64_t))",
        "tests/test_native_loop.py::test_a_stitched_step_launches_what_the_python_loop_launches",
        "a stitched step sets its kernel nodes only when num_seqs changed, not when another grid value did",
    ),
    M(
        "stitched-sets-once",
        "gmtool/kernels/step_loop.c",
        "if (!p->applied_valid || memcmp(",
        "if (!p->applied_valid && memcmp(",
        "tests/test_native_loop.py::test_a_stitched_step_launches_what_the_python_loop_launches",
        "a stitched graph's kernel nodes keep the launch shape of the first step",
    ),
    M(
        "native-loop-reversed",
        "gmtool/kernels/step_loop.c",
        "        const gmt_op *op = &p->ops[i];\n        if (op->kind == GMT_GRAPH) {\n            rc =",
        "        const gmt_op *op = &p->ops[p->num_ops - 1 - i];\n        if (op->kind == GMT_GRAPH) {\n            rc =",
        "tests/test_native_loop.py::test_native_step_launches_what_the_python_loop_launches",
        "the native step loop launches a step's graphs and kernels in reverse order",
    ),
    M(
        "masked-attention-no-diagonal",
        "gmtool/model/attention.py",
        "seen = kv_pos[None, :] <= positions[:, None]",
        "seen = kv_pos[None, :] < positions[:, None]",
        EXEC + "test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe",
        "masked varlen attention: a token does not attend to itself",
    ),
    M(
        "decode-attention-one-past",
        "gmtool/model/attention.py",
        "valid = pos[None, :] < lens",
        "valid = pos[None, :] <= lens",
        "tests/test_compare.py::test_peer_static_cache_matches_gmtool_eager",
        "decode attention reads one slot past kv_len (eager and graph alike: only HF can tell)",
    ),
    # -- per-layer attention options (attention.LayerOpts) --------------------------------------------------
    M(
        "window-one-too-wide",
        "gmtool/model/attention.py",
        "seen &= kv_pos[None, :] > positions[:, None] - opts.window",
        "seen &= kv_pos[None, :] >= positions[:, None] - opts.window",
        FEAT + "test_chunked_prefill_reference[window-per_token]",
        "sliding window: a token sees one position more than the model's window",
    ),
    M(
        "decode-window-ignored",
        "gmtool/model/attention.py",
        "valid &= pos[None, :] >= lens - opts.window",
        "valid &= pos[None, :] >= 0",
        FEAT + "test_decode_reference[window]",
        "decode attention reads the whole context of a sliding-window layer",
    ),
    M(
        "sinks-dropped",
        "gmtool/model/attention.py",
        "    if opts.sinks is None:\n        return torch.nan_to_num(",
        "    if True:\n        return torch.nan_to_num(",
        FEAT + "test_decode_reference[sinks]",
        "learned attention sinks left out of the softmax",
    ),
    M(
        "softcap-ignored",
        "gmtool/model/attention.py",
        "    if opts.softcap is None:\n        return scores",
        "    if True:\n        return scores",
        FEAT + "test_chunked_prefill_reference[softcap-planned]",
        "attention-logit soft-cap not applied",
    ),
    M(
        "final-logit-softcap-dropped",
        "gmtool/model/families.py",
        "    if not cap:\n        return logits\n",
        "    if True:\n        return logits\n",
        "tests/test_architectures.py::test_gmtool_attention_computes_what_transformers_does[tiny-gemma2]",
        "Gemma 2's final logit soft-cap not applied by gmtool's forward",
    ),
    M(
        "sparse-attention-not-refused",
        "gmtool/model/probe.py",
        '    "Indexer": "sparse attention',
        '    "NoSuchPart": "sparse attention',
        "tests/test_architectures.py::test_keys_the_attention_picks_itself_are_refused_before_weights",
        "DeepSeek sparse attention (a top-k indexer) not refused before the weights are built",
    ),
    M(
        "logits-check-dropped",
        "gmtool/model/probe.py",
        "    if why := _logits_refusal(lm, arch, ids, pos, logits):\n        raise GmtoolError(why)\n",
        "",
        "tests/test_architectures.py::test_a_logit_rule_gmtool_lacks_is_refused",
        "a causal LM whose forward post-processes its logits beyond gmtool's families runs, silently wrong",
    ),
    # -- the KV write (attention.write_kv, check.poison_kv) -----------------------------------------------
    M(
        "kv-write-dropped",
        "gmtool/model/attention.py",
        "    kc.index_copy_(0, slots, k)\n    vc.index_copy_(0, slots, v)\n",
        "",
        JUDGE + "test_the_kv_comparison_itself_sees_a_missing_write",
        "write_kv writes nothing",
    ),
    M(
        "kv-write-v-gets-k",
        "gmtool/model/attention.py",
        "    vc.index_copy_(0, slots, v)\n",
        "    vc.index_copy_(0, slots, k)\n",
        KILLS + "test_gmtool_eager_matches_hf_attention_on_prefill",
        "write_kv stores K in the V cache",
    ),
    M(
        "poison-k-only",
        "gmtool/measure/check.py",
        '    for t in cache.k + cache.v:\n        t.view(-1, *t.shape[2:])[slots] = float("nan")\n',
        '    for t in cache.k:\n        t.view(-1, *t.shape[2:])[slots] = float("nan")\n',
        JUDGE + "test_a_graph_that_writes_k_but_not_v_is_unsafe",
        "the judge poisons K but not V",
    ),
    # -- stale-metadata detection -------------------------------------------------------------------------
    M(
        "stale-never",
        "gmtool/core/executor.py",
        "        return any(p != sig for p in self.baked_plans)\n",
        "        return False\n",
        EXEC + "test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe",
        "stale_metadata always says no",
    ),
    M(
        "baked-plans-not-kept",
        "gmtool/core/executor.py",
        "        if not self.mode.piecewise:  # runners read the plan at replay",
        "        if self.mode.piecewise:  # runners read the plan at replay",
        EXEC + "test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe",
        "a full graph does not keep the host plans it froze",
    ),
    M(
        "stale-ignores-batch",
        "gmtool/core/executor.py",
        "        sig = self.ctx.plan_signature(batch.plan)\n",
        "        sig = self.ctx.plan_signature(self.ctx.plan)\n",
        EXEC + "test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe",
        "stale_metadata compares with the context's current plan, not the batch asked about",
    ),
    M(
        "plan-signature-triton-no-max-q",
        "gmtool/kernels/__init__.py",
        "        return (len(plan), max((q for q, _ in plan), default=0))\n",
        "        return (len(plan),)\n",
        KILLS + "test_triton_plan_signature_is_the_launch_grid",
        "with Triton, a frozen max_q_len is not part of the plan signature",
    ),
    # -- tolerances and error metrics (gmtool/measure/timing.py, gmtool/measure/check.py, gmtool/measure/sweep.py) ---------------
    M(
        "relerr-mean",
        "gmtool/measure/timing.py",
        "    return float((num / den).max())\n",
        "    return float((num / den).mean())\n",
        JUDGE + "test_one_wrong_sequence_of_eight_is_the_error",
        "relative error: mean over sequences instead of max",
    ),
    M(
        "relerr-vs-replay-norm",
        "gmtool/measure/timing.py",
        "    den = r.norm(dim=-1).clamp_min(1e-30)\n",
        "    den = o.norm(dim=-1).clamp_min(1e-30)\n",
        JUDGE + "test_one_wrong_sequence_of_eight_is_the_error",
        "relative error divides by the replay's norm, not eager's",
    ),
    M(
        "relerr-nan-not-inf",
        "gmtool/measure/timing.py",
        "    if o.shape != r.shape or not torch.isfinite(o).all():\n",
        "    if o.shape != r.shape:\n",
        JUDGE + "test_one_wrong_sequence_of_eight_is_the_error",
        "a non-finite replay gives a NaN error instead of inf",
    ),
    M(
        "summary-mean",
        "gmtool/measure/timing.py",
        '"median": float(med),',
        '"median": float(a.mean()),',
        JUDGE + "test_latency_summary_is_the_median_not_the_mean",
        "latency summary uses the mean instead of the median",
    ),
    M(
        "tolerance-fp32-loose",
        "gmtool/measure/timing.py",
        "torch.float32: (1e-5, 1e-3)",
        "torch.float32: (1e-3, 1e-3)",
        JUDGE + "test_a_replay_off_by_1e_4_is_unsafe_in_fp32",
        "fp32 same-shape tolerance 1e-3 instead of 1e-5",
    ),
    M(
        "sweep-tolerance-of-bf16",
        "gmtool/measure/sweep.py",
        "tol_same, tol = tolerances_for(cfg.torch_dtype)",
        "tol_same, tol = tolerances_for(torch.bfloat16)",
        JUDGE + "test_a_replay_off_by_1e_4_is_unsafe_in_fp32",
        "the sweep judges every dtype with bf16's tolerances",
    ),
    M(
        "failure-same-shape-loose",
        "gmtool/measure/check.py",
        "        elif not self.max_rel_err_same_shape <= tol_same:\n",
        "        elif not self.max_rel_err_same_shape <= tol:\n",
        (
            JUDGE + "test_failure_applies_each_tolerance_to_its_own_comparison",
            JUDGE + "test_a_replay_off_by_1e_4_is_unsafe_in_fp32",
        ),
        "same-shape error judged with the loose (unpadded) tolerance",
    ),
    M(
        "failure-unpadded-tight",
        "gmtool/measure/check.py",
        "        elif not self.max_rel_err <= tol:\n",
        "        elif not self.max_rel_err <= tol_same:\n",
        JUDGE + "test_failure_applies_each_tolerance_to_its_own_comparison",
        "unpadded error judged with the tight (same-shape) tolerance",
    ),
    M(
        "failure-kv-or",
        "gmtool/measure/check.py",
        "not (self.kv_rel_err_same_shape <= tol_same and self.kv_rel_err <= tol)",
        "not (self.kv_rel_err_same_shape <= tol_same or self.kv_rel_err <= tol)",
        JUDGE + "test_failure_names_the_kv_when_only_the_kv_differs",
        "K/V fails only when both its comparisons fail",
    ),
    M(
        "failure-stale-ignored",
        "gmtool/measure/check.py",
        "        if self.stale_metadata:\n",
        "        if False:\n",
        JUDGE + "test_failure_names_the_kv_when_only_the_kv_differs",
        "a graph that froze a host plan is not flagged by itself",
    ),
    M(
        "failure-replay-error-ignored",
        "gmtool/measure/check.py",
        "        if self.replay_error:\n",
        "        if False:\n",
        JUDGE + "test_a_replay_that_raises_is_unsafe_not_a_crash",
        "a replay that raised is judged on its (poisoned) outputs, its error unsaid",
    ),
    M(
        "replay-error-crashes",
        "gmtool/measure/check.py",
        "    except (RuntimeError, IndexError, InputsNotLoaded) as e:",
        "    except (IndexError, InputsNotLoaded) as e:",
        JUDGE + "test_a_replay_that_raises_is_unsafe_not_a_crash",
        "a replay that raises RuntimeError crashes the sweep",
    ),
    M(
        "same-shape-is-second-replay",
        "gmtool/measure/check.py",
        "    same = ex.eager_same_shape(batch).clone()\n",
        "    entry.replay(batch, ex.refresh_runner_metadata)\n    same = ex.inputs.logits[: batch.num_seqs].clone()\n",
        JUDGE + "test_same_shape_error_is_measured_against_eager_not_a_second_replay",
        "the same-shape check compares the replay with a second replay",
    ),
    M(
        "no-output-poison",
        "gmtool/measure/check.py",
        '    ex.inputs.logits.fill_(float("nan"))  # every row: a replay must write its own\n',
        "",
        JUDGE + "test_a_graph_that_never_writes_its_logits_is_unsafe",
        "outputs are not poisoned before a checked replay",
    ),
    M(
        "no-kv-poison",
        "gmtool/measure/check.py",
        "    poison_kv(ex.cache, slots)\n    if before_replay",
        "    if before_replay",
        JUDGE + "test_a_graph_that_never_writes_kv_is_unsafe_in_decode",
        "the batch's KV slots are not poisoned before a checked replay",
    ),
    M(
        "unsafe-gets-latency",
        "gmtool/measure/sweep.py",
        "            return rec  # an unsafe replay gets no latency and no speedup\n",
        "",
        JUDGE + "test_a_graph_that_is_never_replayed_is_unsafe",
        "an UNSAFE replay is still timed and gets a speedup",
    ),
    M(
        "exit-code-ignores-unsafe",
        "gmtool/records.py",
        "        return 3 if self.unexpected_unsafe() else 0\n",
        "        return 0\n",
        JUDGE + "test_a_graph_that_is_never_replayed_is_unsafe",
        "a run with UNSAFE replays of a safe mode exits 0",
    ),
    M(
        "tape-replay-noop",
        "gmtool/core/backends/cpu.py",
        "    def replay(self) -> None:\n        with torch.no_grad():\n",
        "    def replay(self) -> None:\n        return\n        with torch.no_grad():\n",
        (
            EXEC + "test_tape_replay_reruns_over_the_same_tensors",
            JUDGE + "test_sanity_the_same_sweep_passes_with_a_working_replay",
        ),
        "the tape replay does nothing",
    ),
    # -- VMM mapping (gmtool/memory/vmm_allocator.cpp on the fake driver, vmm.py, strategies.py) ----------
    M(
        "vmm-chunks-at-base",
        "gmtool/memory/vmm_allocator.cpp",
        "  u64 va = r.base + i * S.chunk;\n",
        "  u64 va = r.base;\n",
        VMM + "test_chunks_grow_only_past_the_previous_max_and_every_range_maps_them_all",
        "every chunk is mapped at the range's base",
    ),
    M(
        "vmm-new-range-maps-nothing",
        "gmtool/memory/vmm_allocator.cpp",
        "  for (size_t i = 0; i < S.chunks.size(); ++i) {\n    if (!map_chunk(r, i)) {\n",
        "  for (size_t i = 0; i < S.chunks.size() && false; ++i) {\n    if (!map_chunk(r, i)) {\n",
        VMM + "test_chunks_grow_only_past_the_previous_max_and_every_range_maps_them_all",
        "a new range maps the existing chunks only later, during capture",
    ),
    M(
        "vmm-physical-in-granules",
        "gmtool/memory/vmm_allocator.cpp",
        "return S.chunks.size() * S.chunk; }",
        "return S.chunks.size() * S.gran; }",
        KILLS + "test_vmm_physical_bytes_count_whole_chunks",
        "physical bytes counted in granules, not in chunks",
    ),
    M(
        "vmm-align-256",
        "gmtool/memory/vmm_allocator.cpp",
        "const size_t ALIGN = 512;",
        "const size_t ALIGN = 256;",
        VMM + "test_offsets_are_bumped_and_aligned",
        "segments aligned to 256 bytes instead of 512",
    ),
    M(
        "vmm-growth-not-relaxed",
        "gmtool/memory/vmm_allocator.cpp",
        "    RelaxedCapture relaxed;\n    while (r.mapped < need)\n",
        "    while (r.mapped < need)\n",
        VMM + "test_growth_runs_with_stream_capture_relaxed",
        "chunks made during capture without the relaxed capture mode",
    ),
    M(
        "vmm-shutdown-unmaps-live",
        "gmtool/memory/vmm_allocator.cpp",
        "  if (!S.live.empty() && !force)\n",
        "  if (false)\n",
        VMM + "test_shutdown_waits_for_torch_then_releases_everything",
        "shutdown unmaps memory torch still holds",
    ),
    M(
        "vmm-failed-map-keeps-chunk",
        "gmtool/memory/vmm_allocator.cpp",
        "  if (created) {\n    DRIVER.release(S.chunks.back());\n    S.chunks.pop_back();\n  }\n",
        "",
        VMM + "test_failed_map_releases_the_new_chunk",
        "a chunk whose mapping failed stays allocated",
    ),
    M(
        "vmm-stats-used-mapped-swapped",
        "gmtool/memory/vmm.py",
        "L.gmtool_vmm_range_used(i), L.gmtool_vmm_range_mapped(i)",
        "L.gmtool_vmm_range_mapped(i), L.gmtool_vmm_range_used(i)",
        VMM + "test_one_range_per_begin",
        "VmmLibrary.stats swaps a range's used and mapped bytes",
    ),
    M(
        "vmm-check-flags-held",
        "gmtool/memory/strategies.py",
        '                if any(lo < start + b["size"] and start < hi for lo, hi in held):\n'
        "                    continue  # a tensor a graph step reads and writes itself (piecewise attention inputs)\n",
        "",
        VMM + "test_check_flags_live_blocks_and_foreign_segments_in_the_shared_ranges",
        "Vmm.check warns about tensors a graph step owns",
    ),
    # -- memreport ----------------------------------------------------------------------------------------
    M(
        "memreport-shuffled-always-ok",
        "gmtool/memory/report.py",
        '    rec["status"] = Status.UNSAFE if why else Status.OK\n',
        '    rec["status"] = Status.OK\n',
        VMM + "test_memsweep_shuffled_check_flags_a_broken_graph",
        "memreport's shuffled-replay check always says ok",
    ),
    M(
        "memreport-status-ignores-shuffled",
        "gmtool/memory/report.py",
        '        row["status"], row["reason"] = _status(graph, sh, row["errors"])\n',
        '        row["status"], row["reason"] = _status(graph, [], row["errors"])\n',
        VMM + "test_status_names_the_failure",
        "a strategy whose shuffled replays failed is reported ok",
    ),
    # -- report rows (gmtool/report/*) --------------------------------------------------------------------
    M(
        "summary-unsafe-shows-latency",
        "gmtool/report/summary.py",
        "replay = statistics.median(lat) if lat and status != Status.UNSAFE else None",
        "replay = statistics.median(lat) if lat else None",
        REPORT + "test_unsafe_buckets_show_no_latency_or_speedup_anywhere",
        "a bucket UNSAFE for one mix shows the latency of the others",
    ),
    M(
        "summary-best-status",
        "gmtool/records.py",
        "    return max((Status(s) for s in statuses), key=lambda s: s.severity, default=Status.OK)\n",
        "    return min((Status(s) for s in statuses), key=lambda s: s.severity, default=Status.OK)\n",
        REPORT + "test_unsafe_buckets_show_no_latency_or_speedup_anywhere",
        "a bucket's status is its best composition's, not its worst",
    ),
    M(
        "summary-min-error",
        "gmtool/report/summary.py",
        '"max_rel_err": (float("nan") if any(e != e for e in errs) else max(errs)) if errs else None,',
        '"max_rel_err": (float("nan") if any(e != e for e in errs) else min(errs)) if errs else None,',
        KILLS + "test_bucket_summary_reports_the_worst_composition",
        "a bucket's max rel err is its best composition's",
    ),
    M(
        "markdown-unsafe-lists-errors",
        "gmtool/report/markdown.py",
        '        if r["status"] == Status.UNSAFE\n    ]',
        '        if r["status"] != Status.OK\n    ]',
        REPORT + "test_markdown_sections",
        "report.md's UNSAFE section lists error and skipped rows too",
    ),
    M(
        "csv-flattening-loses-timings",
        "gmtool/records.py",
        'row.update({f"{f.name}_{t.name}": getattr(v, t.name) if v else None for t in fields(Timing)})',
        "row.update({f.name: getattr(v, t.name) if v else None for t in fields(Timing)})",
        KILLS + "test_results_csv_flattens_every_timing",
        "results.csv keeps one field of each timing dict under the dict's name",
    ),
    M(
        "baseline-conflates-repeated-labels",
        "gmtool/report/summary.py",
        "        keys.append(k + (seen[ranked],))\n",
        "        keys.append(k + (1,))\n",
        REPORT + "test_baseline_matches_rows_by_occurrence",
        "baseline rows matched by label only: repeated mixes collapse",
    ),
    M(
        "baseline-ranks-counted-together",
        "gmtool/report/summary.py",
        '        ranked = k + (r.get("rank") or 0,)\n',
        "        ranked = k\n",
        REPORT + "test_baseline_joins_each_tp_rank_and_counts_rows_only_in_the_baseline",
        "--baseline: a --tp run's rank 1 rows are counted on after rank 0's and join no baseline row",
    ),
    M(
        "baseline-delta-sign",
        "gmtool/report/baseline.py",
        "(new - old) / old * 100.0",
        "(old - new) / old * 100.0",
        REPORT + "test_baseline_matches_rows_by_occurrence",
        "the baseline change has the wrong sign",
    ),
    M(
        "tp-no-all-reduce",
        "gmtool/parallel/shard.py",
        "y = torch.ops.gmtool.all_reduce(F.linear(x, self.weight))",
        "y = F.linear(x, self.weight)",
        "tests/test_parallel.py::test_tp2_matches_tp1_eager_within_tolerance",
        "--tp: a row-parallel layer's partial products are not summed over the ranks",
    ),
    M(
        "tp-kv-cache-all-heads",
        "gmtool/core/kv_cache.py",
        "t.copy_(full.normal_(generator=g).chunk(world, 2)[rank])",
        "t.copy_(full.normal_(generator=g).chunk(world, 2)[0])",
        "tests/test_parallel.py::test_tp2_matches_tp1_eager_within_tolerance",
        "--tp: every rank's cached prefixes hold rank 0's KV heads",
    ),
    M(
        "pdl-write-kv-reads-before-wait",
        "gmtool/kernels/kv_write.py",
        "    pdl_mod.enter(PDL)  # before the slot test: a program that returns early has waited too\n"
        "    t = tl.program_id(0)\n"
        "    slot = tl.load(slot_ptr + t)\n",
        "    t = tl.program_id(0)\n    slot = tl.load(slot_ptr + t)\n    pdl_mod.enter(PDL)\n",
        "tests/test_pdl.py::test_pdl_variants_compile_for_hopper_and_wait_before_reading",
        "--pdl: the K/V write reads its slot before waiting for the kernel before it (a race under PDL)",
    ),
    M(
        "pdl-prefetch-misses-a-line",
        "gmtool/kernels/small_m.py",
        "        prefetch_l2(w_rows + tl.minimum(k0 + kk + BLOCK_K - 1, K - 1))\n",
        "",
        "tests/test_pdl.py::test_pdl_under_interpreter",
        "--pdl: the small-M GEMM's prefetch leaves the last line of a step out where a row does not start on a line",
    ),
    M(
        "pdl-combine-launches-next-early",
        "gmtool/kernels/decode_attention.py",
        "        late = min(int(mode), pdl_mod.Pdl.AFTER_WAIT)\n",
        "        late = int(mode)\n",
        "tests/test_pdl.py::test_decode_combine_lets_the_next_kernel_launch_only_after_its_wait",
        "--pdl: the decode combine lets o_proj launch before its wait, its prefetch beside the split's K/V reads",
    ),
    M(
        "decode-combine-dims-not-offset",
        "gmtool/kernels/decode_attention.py",
        "    d = tl.program_id(2) * DC + tl.arange(0, DC)\n",
        "    d = tl.arange(0, DC)\n",
        "tests/test_kernels.py::test_triton_kernels_under_interpreter",
        "every combine program of a head combines its first dims: the others' are never written",
    ),
    M(
        "small-m-wide-k-ignores-stages",
        "gmtool/kernels/small_m.py",
        "    if few and cdiv(steps, split) > _stages(block_n, block_k, elem_bytes):\n",
        "    if few and cdiv(steps, split) > 8:\n",
        "tests/test_small_m.py::test_pick_by_shape",
        "down_proj's slice stays at 6 steps of 128 against a 4-stage pipeline",
    ),
    # -- the folded one-row GEMM (gmtool/kernels/folded.py) ------------------------------------------------------
    M(
        "fold-norm-without-residual",
        "gmtool/kernels/folded.py",
        "    s = (s + tl.load(r_ptr + cols, mask=cmask, other=0.0).to(tl.float32)).to(dt)\n",
        "    s = s.to(dt)\n",
        "tests/test_folded.py::test_folded_under_interpreter",
        "the folded GEMM's first pass leaves the residual out: the norm's scale and the residual sum are wrong",
    ),
    M(
        "fold-total-never-written",
        "gmtool/kernels/folded.py",
        "    if (pid_n == 0) & (pid_k == 0):\n",
        "    if (pid_n == 0) & (pid_k == -1):\n",
        "tests/test_folded.py::test_folded_under_interpreter",
        "no program of the folded GEMM stores the residual sum: the next add reads stale memory",
    ),
    M(
        "fold-stream-keeps-old-residual",
        "gmtool/model/fused.py",
        "            return row, row.total\n",
        "            return row, residual\n",
        "tests/test_folded.py::test_folded_under_interpreter",
        "the fused layers carry the old residual past a folded norm: each block's add is lost",
    ),
    M(
        "silu-down-reads-gate-as-up",
        "gmtool/kernels/folded.py",
        "        up = _row_block(x_ptr, xb_ptr, row, 1, 2 * K, 2 * K, K + k, k_ok, dt, X_SPLIT, X_BIAS)\n",
        "        up = _row_block(x_ptr, xb_ptr, row, 1, 2 * K, 2 * K, k, k_ok, dt, X_SPLIT, X_BIAS)\n",
        "tests/test_folded.py::test_folded_under_interpreter",
        "the down projection's SiLU-and-mul multiplies by the gate where the up projection belongs",
    ),
    M(
        "embedded-row-not-gathered",
        "gmtool/kernels/folded.py",
        "        row = tl.load(ids_ptr).to(tl.int64)\n",
        "        row = (pid_n * 0).to(tl.int64)\n",
        "tests/test_folded.py::test_folded_under_interpreter",
        "the first QKV GEMM reads the embedding table's row 0 whatever the token: every B=1 step sees token 0",
    ),
    M(
        "logits-rows-first-for-every-key",
        "gmtool/core/forwards.py",
        '    return views.logits.shape[0] if current_context().impl == "decode" else views.logits_indices\n',
        "    return views.logits.shape[0]\n",
        "tests/test_executor.py::test_piecewise_matches_eager_for_prefill_mixes",
        "a prefill step's logits taken from its first rows, not each sequence's last token",
    ),
    # -- the caching-allocator simulator (gmtool/memory/allocsim.py) ------------------------------------------
    M(
        "allocsim-no-coalescing",
        "gmtool/memory/allocsim.py",
        "            if other is not None and not other.allocated:\n",
        "            if other is not None and not other.allocated and False:\n",
        ALLOCSIM + "test_freed_neighbours_coalesce_into_one_block",
        "a freed block never merges with its free neighbours: the pool fragments",
    ),
    M(
        "allocsim-large-segment-unrounded",
        "gmtool/memory/allocsim.py",
        "    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)\n",
        "    return size\n",
        ALLOCSIM + "test_sizes_round_to_512_and_segments_by_kind",
        "a segment for a request of 10 MiB or more is not rounded up to 2 MiB",
    ),
    M(
        "outside-pool-without-upload",
        "gmtool/core/executor.py",
        "    upload()  # the driver uploads a graph at its first launch: memory outside the pool too\n",
        "",
        "tests/test_ledger.py::test_outside_pool_is_the_free_drop_beyond_the_pool_growth",
        "the graph's upload falls outside the memory reading: the driver's copy of it goes uncounted",
    ),
    M(
        "overlap-reads-before-the-worker",
        "gmtool/core/overlap.py",
        "            done.result()  # its failure",
        "            pass  # its failure",
        "tests/test_overlap.py::test_each_graph_gets_the_driver_bytes_of_its_own_instantiation_and_upload",
        "capture_all reads free memory without waiting for the worker: a graph's instantiation falls to the next",
    ),
    M(
        "overlap-keeps-the-pool-growth",
        "gmtool/core/overlap.py",
        "    return (free_before - free_after) - reserved_growth\n",
        "    return free_before - free_after\n",
        "tests/test_overlap.py::test_each_graph_gets_the_driver_bytes_of_its_own_instantiation_and_upload",
        "capture_all counts what torch reserved for the next capture as the driver's bytes outside the pool",
    ),
    M(
        "hub-rope-not-unwrapped",
        "gmtool/model/fused.py",
        "    return inner if inspect.isfunction(inner) else fn\n",
        "    return fn\n",
        "tests/test_fused.py::test_fused_layers_match_hf_layers",
        "with transformers 5.25's kernels wrapper, --fuse no longer sees Llama's RoPE and fuses no attention block",
    ),
    M(
        "alibi-not-refused",
        "gmtool/model/probe.py",
        '    if any(getattr(cfg, name, False) is True for name in ("alibi", "use_alibi")):\n',
        "    if False:\n",
        "tests/test_architectures.py::test_alibi_configs_are_refused_by_name",
        "an ALiBi model reaches the probe, which falls over instead of naming what gmtool cannot do",
    ),
    M(
        "default-mixes-ignore-max-seqs",
        "gmtool/core/compositions.py",
        "    fit = [c for c in comps if max_seqs is None or c.num_seqs <= max_seqs]\n",
        "    fit = list(comps)\n",
        BUCKETS + "test_default_mixes_stay_within_max_num_seqs",
        "gmtool's own prefill mixes hold more sequences than --max-num-seqs allows: every such row an error",
    ),
    M(
        "bucket-range-unbounded",
        "gmtool/core/buckets.py",
        "    if held + len(sizes) > MAX_BUCKETS:\n",
        "    if False:\n",
        "tests/test_bad_inputs.py::test_every_bad_input_is_one_line_and_exit_2",
        "a bucket range of ten billion sizes is built before anything refuses it (the run is killed for memory)",
    ),
    M(
        "capture-left-open-on-other-errors",
        "gmtool/core/executor.py",
        "            self.backend.abort()  # whatever ended it (Ctrl-C too): the stream or the tape must not stay capturing\n",
        "            pass\n",
        "tests/test_executor.py::test_a_capture_that_raises_leaves_the_backend_usable",
        "a capture that raises leaves the tape recording every later op of the process",
    ),
    M(
        "fx-fallback-swallows-oom",
        "gmtool/core/forwards.py",
        "        except (torch.OutOfMemoryError, OutOfMemory, CaptureError):  # the run's to handle, not a trace's\n",
        "        except (OutOfMemory, CaptureError):  # the run's to handle, not a trace's\n",
        "tests/test_executor.py::test_fx_fallback_is_for_a_model_it_cannot_trace_not_for_a_shape_that_fails",
        "out of memory at one bucket turns fx into the runtime split for the rest of the run, blamed on tracing",
    ),
    M(
        "tape-misses-mask-indexing",
        "gmtool/core/backends/cpu.py",
        "    if name in _MASK_INDEXED_OPS and len(args) > 1:\n",
        "    if False:\n",
        "tests/test_executor.py::test_tape_refuses_what_a_cuda_capture_would_wait_for",
        "the CPU tape captures a boolean-mask index, which a CUDA capture refuses (a host sync)",
    ),
    M(
        "tape-list-of-one-as-tensor",
        "gmtool/core/backends/cpu.py",
        "            out = outs[0] if len(outs) == 1 and _returns_a_tensor(func) else tuple(outs)\n",
        "            out = outs[0] if len(outs) == 1 else tuple(outs)\n",
        "tests/test_executor.py::test_tape_replays_an_op_that_returns_a_list_of_one",
        "a split into one piece replays as a list where a tensor was recorded: a false UNSAFE row",
    ),
    M(
        "failed-capture-drops-the-graph-before",
        "gmtool/core/executor.py",
        "                    overlap.finish()  # the worker's last graph, if it finished well, is kept with its driver bytes\n",
        "                    pass\n",
        "tests/test_overlap.py::test_a_failed_capture_keeps_the_graph_before_it_with_its_driver_bytes",
        "capture_all's failure leaves the graph before it unread: outside_pool_bytes None",
    ),
    M(
        "upload-reservations-as-driver-bytes",
        "gmtool/core/executor.py",
        "    uploaded = allocator()[3] - before_upload\n",
        "    uploaded = 0\n",
        "tests/test_ledger.py::test_what_an_upload_replay_reserves_through_torch_is_not_the_driver_s",
        "a piecewise upload replay's torch attention temporaries are counted as the graph's driver bytes",
    ),
    M(
        "auto-inputs-without-runner-buffers",
        "gmtool/memory/ledger.py",
        "    owner = next((p for p in parts_of(ex) if key in p.graphs), ex)\n",
        "    owner = ex\n",
        "tests/test_ledger.py::test_inputs_bytes_count_the_buffers_of_the_part_that_serves_the_key",
        "auto's mixed buckets leave the runners' q, output and last-hidden buffers out of their inputs bytes",
    ),
    M(
        "checkpoint-index-before-single-file",
        "gmtool/model/checkpoint.py",
        'PRECEDENCE = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")',
        'PRECEDENCE = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json")',
        "tests/test_checkpoints.py::test_model_safetensors_wins_over_an_index_beside_it_and_an_empty_or_escaping_index_is_refused",
        "a stale index and its shards are read where transformers reads the model.safetensors beside them",
    ),
    M(
        "checkpoint-broken-link-is-no-file",
        "gmtool/model/checkpoint.py",
        "        if p.is_symlink() and not p.exists():\n",
        "        if False:\n",
        "tests/test_checkpoints.py::test_weights_that_are_no_weights_are_refused_by_what_they_are",
        "a weight file linked to nothing counts as no weights: the run goes on random weights",
    ),
    M(
        "checkpoint-nan-weights-pass",
        "gmtool/model/checkpoint.py",
        "    if bad is not None:\n        if dtype == torch.float16:",
        "    if False:\n        if dtype == torch.float16:",
        "tests/test_checkpoints.py::test_weights_that_are_no_weights_are_refused_by_what_they_are",
        "a NaN in a stored weight is blamed on the architecture's logits rule (or not seen)",
    ),
    M(
        "checkpoint-missing-weights-random",
        "gmtool/model/checkpoint.py",
        "    if missing:\n        raise",
        "    if False:\n        raise",
        "tests/test_checkpoints.py::test_weights_that_do_not_fit_the_config_are_refused",
        "weights the model has and the files lack stay random, without a word",
    ),
    M(
        "checkpoint-mismatched-shapes-kept",
        "gmtool/model/checkpoint.py",
        '    if info.get("mismatched_keys"):\n',
        "    if False:\n",
        "tests/test_checkpoints.py::test_weights_that_do_not_fit_the_config_are_refused",
        "a stored weight of another shape is left random (ignore_mismatched_sizes) without a word",
    ),
    M(
        "profile-name-reaches-past-its-folder",
        "gmtool/profiles.py",
        '    if "/" in name or name.startswith(".") or name.endswith(".json"):\n',
        '    if name.endswith(".json") and not path.is_file():\n',
        "tests/test_checkpoints.py::test_a_model_named_as_a_path_is_a_path_never_a_profile",
        "an absolute path without .json is read as a profile (a traceback), ./name runs the built-in profile",
    ),
    M(
        "estimate-reads-auto-map",
        "gmtool/memory/estimate.py",
        "        return loading._config_from_dict(loading.read_config(spec)[0])\n",
        "        from transformers import AutoConfig\n\n        return AutoConfig.from_pretrained(spec, local_files_only=True)\n",
        "tests/test_checkpoints.py::test_a_config_file_is_read_as_a_folder_would_be",
        "the memory estimate reads a folder's config through AutoConfig, which may ask to run its auto_map code",
    ),
    M(
        "verify-poisons-longrope-positions",
        "gmtool/verify/poison.py",
        '        if "longrope" in families.rope_types(ex.lm.config):\n',
        "        if False:\n",
        "tests/test_verify.py::test_a_longrope_model_is_clean_and_its_padding_positions_are_not_poisoned",
        "verify poisons the positions a longrope model reads, and reports its exact replays wrong",
    ),
    M(
        "learned-positions-in-the-vision-tower",
        "gmtool/model/families.py",
        "        if any(w in path for w in OTHER_TOWERS):  # a multimodal model's vision or audio tower: not the text's\n",
        "        if False:\n",
        "tests/test_architectures.py::test_only_the_text_model_s_learned_position_table_bounds_max_kv_len",
        "a vision tower's position table (Gemma 3's 196 patches) refuses every run above 196 tokens",
    ),
    M(
        "learned-positions-unchecked",
        "gmtool/measure/workbench.py",
        "    if table is not None and table[1] < max_kv_len:\n",
        "    if False:\n",
        "tests/test_bad_inputs.py",
        "a learned position table shorter than --max-kv-len is indexed past (a traceback)",
    ),
    M(
        "trace-split-on-every-mix",
        "gmtool/measure/trace.py",
        " and rec.composition == composition:\n",
        ":\n",
        "tests/test_floor.py::test_compare_rows_carry_their_floor_and_the_report_plots_it",
        "--trace's one traced step is stamped on every mix of the bucket, auto's other executor's too",
    ),
    M(
        "journal-finished-reads-partial",
        "gmtool/report/results.py",
        "    if isinstance(planned, int) and len(records) >= planned and tp == 1:",
        "    if False:",
        "tests/test_nothing_lost.py::test_the_journal_of_a_finished_run_reads_as_finished",
        "a finished run's journal reads as a partial run 'unfinished after 4 of 4 rows'",
    ),
    M(
        "sweep-graph-modes-above-the-largest-bucket",
        "gmtool/measure/sweep.py",
        "                    if bucket in cfg.eager_sizes and mode != GraphMode.AUTO:\n",
        "                    if False:\n",
        "tests/test_auto.py::test_a_sweep_runs_auto_above_the_largest_bucket_eagerly_and_says_so",
        "full and piecewise are run on a mix above their largest bucket: error rows, not skipped ones",
    ),
    M(
        "baseline-ranks-pooled",
        "gmtool/report/baseline.py",
        '            o = per_rank.get((s["mode"], s["bucket"], s["rank"]), o)\n',
        "            pass\n",
        "tests/test_report.py::test_a_tp_run_s_rank_rows_each_get_their_own_change_and_capture_seconds_are_not_summed_over_ranks",
        "under --tp every rank's summary row shows the ranks' pooled change against the baseline",
    ),
    M(
        "cpu-floor-tape-op",
        "gmtool/measure/floor.py",
        "        node_ms = min(node_ms, _median_ms(",
        "        node_ms = max(node_ms, _median_ms(",
        "tests/test_floor.py::test_the_cpu_launch_floor_is_the_cheaper_of_a_tape_op_and_an_eager_op",
        "the CPU launch floor is a tape op's cost, above the eager op's: eager rows beat their floor",
    ),
    M(
        "error-line-read-as-markup",
        "gmtool/cli/main.py",
        'err_console.print(f"[bold red]error:[/] {escape(str(e))}"',
        'err_console.print(f"[bold red]error:[/] {e}"',
        "tests/test_bad_inputs.py",
        "an error quoting '[/b]' is a rich markup traceback instead of the error",
    ),
    M(
        "tp-split-heads-unchecked",
        "gmtool/model/probe.py",
        "    if split != {(lm.rank_heads, lm.rank_kv_heads, lm.rank_kv_heads)}:\n",
        "    if False:\n",
        "tests/test_parallel.py::test_a_family_whose_layers_do_not_split_by_heads_is_refused_in_one_line",
        "a family whose attention does not split by heads (OLMo 2) fails in the sweep with a raw torch error",
    ),
    M(
        "index-outside-by-links",
        "gmtool/model/checkpoint.py",
        '    outside = next((s for s in shards if Path(s).is_absolute() or os.path.normpath(s).startswith("..")), None)\n',
        "    outside = next((s for s in shards if not (ckpt / s).resolve().is_relative_to(ckpt.resolve())), None)\n",
        "tests/test_checkpoints.py::test_a_hugging_face_cache_snapshot_loads_and_is_named_by_its_repository",
        "a Hugging Face cache snapshot's shards, links into ../../blobs, are refused as outside the folder",
    ),
    # -- the twenty-fourth session: the replay check reads the device inputs and the context K/V -------------------
    M(
        "check-ignores-input-faults",
        "gmtool/measure/check.py",
        "        elif self.input_faults:\n",
        "        elif False:\n",
        JUDGE + "test_a_stale_kv_length_under_the_tolerance_is_unsafe",
        "a copy-in that keeps last step's kv_lens passes as ok (the same-shape pass reads the same stale lengths)",
    ),
    M(
        "check-context-never-changed",
        "gmtool/measure/check.py",
        "    faults, changed = input_faults(ex, entry.key, batch), held.changed()",
        "    faults, changed = input_faults(ex, entry.key, batch), 0",
        JUDGE + "test_a_replay_that_overwrites_the_batchs_context_is_unsafe",
        "a replay that overwrites K/V the batch's sequences hold passes when the logits stay within tolerance",
    ),
    M(
        "padding-rule-unchecked",
        "gmtool/measure/check.py",
        "    if ((pad < 0) | (pad >= bs)).any():\n",
        "    if False:\n",
        JUDGE + "test_padding_left_from_the_previous_batch_is_unsafe",
        "padding lanes that write K/V into a live block pass as ok",
    ),
    M(
        "ok-row-error-unchecked",
        "gmtool/records.py",
        "            if r.status == Status.OK and v is not None and tol is not None and not v <= tol:\n",
        "            if False:\n",
        "tests/test_report_values.py::test_values_no_run_writes_are_refused_naming_the_record",
        "a hand-edited ok row with a NaN error is shown as ok",
    ),
    M(
        "baseline-over-every-old-row",
        "gmtool/report/baseline.py",
        "    for s in bucket_summary(new_rows) + (bucket_summary(new_rows, True) if several else []):\n",
        "    for s in bucket_summary(rows) + (bucket_summary(rows, True) if several else []):\n",
        "tests/test_report_values.py::test_baseline_bucket_changes_are_over_the_rows_both_runs_measured",
        "a bucket's baseline change compares different sets of mixes",
    ),
    M(
        "verify-auto-budget-largest",
        "gmtool/verify/soak.py",
        "        budget = self.ex.policy.max_tokens if self.mode.composed_of else self.ex.policy.largest\n",
        "        budget = self.ex.policy.largest\n",
        "tests/test_verify.py::test_auto_with_max_tokens_soaks_and_checks_steps_above_the_largest_bucket",
        "verify --max-tokens never schedules a step above the largest bucket: auto's eager path goes unchecked",
    ),
    M(
        "verify-live-kv-unwatched",
        "gmtool/verify/soak.py",
        "                held_slots=slots_held(*zip(*live), ex.cache.spec.block_size) if live else None,\n",
        "                held_slots=None,\n",
        "tests/test_verify.py::test_a_replay_that_overwrites_another_live_requests_kv_is_caught",
        "verify watches only the batch's own context: a replay overwriting a waiting request's K/V passes",
    ),
    M(
        "eager-not-finite-accepted",
        "gmtool/measure/workbench.py",
        "        if bad:\n",
        "        if False:\n",
        "tests/test_judge.py::test_a_model_whose_eager_output_is_not_finite_is_an_error_not_unsafe_graphs",
        "a NaN eager reference is compared with: every graph row reads UNSAFE, blaming graphs for the model",
    ),
    M(
        "report-of-interrupted-run-exits-0",
        "gmtool/records.py",
        "            return 130\n",
        "            return 0\n",
        "tests/test_nothing_lost.py::test_ctrl_c_keeps_what_was_measured",
        "gmtool report of an interrupted run exits 0, as if every planned row had been measured",
    ),
    M(
        "workload-nan-count-one-step",
        "gmtool/plan/workload.py",
        '        return pd.read_csv(path, comment="#", skipinitialspace=True, keep_default_na=False, na_values=[""])\n',
        '        return pd.read_csv(path, comment="#", skipinitialspace=True)\n',
        "tests/test_plan.py::test_bad_workloads_are_one_line",
        "a workload count written NaN or null is read as one step",
    ),
    M(
        "plan-mode-picked-silently",
        "gmtool/plan/costs.py",
        "    if asked is None and others:\n",
        "    if False:\n",
        "tests/test_plan.py::test_results_of_both_planned_modes_say_which_one_is_costed",
        "plan --from a run of full and piecewise costs full without a word",
    ),
    M(
        "capture-from-the-checked-batch",
        "gmtool/measure/sweep.py",
        "            if fresh:\n                self._capture_from_sibling(ex, key, batch)\n",
        "",
        (
            JUDGE + "test_a_graph_that_froze_its_capture_batch_fails_with_the_default_mixes",
            "tests/test_compare.py::test_results_json_schema",
        ),
        "each key is captured from the first batch it checks: a value frozen from that batch passes its checks",
    ),
    M(
        "sibling-as-many-sequences",
        "gmtool/core/batch.py",
        "    if fewer and batch.is_decode and len(q) > 1:\n",
        "    if False:\n",
        JUDGE + "test_a_graph_that_froze_its_capture_batch_fails_with_the_default_mixes",
        "a decode key's sibling holds as many sequences: a batch size frozen at capture passes",
    ),
    M(
        "dyndims-pair-one-count",
        "gmtool/verify/run.py",
        '    out = [("decode", f"1*{k}@{p1}", f"1*{fewer(k)}@{p2}")]\n',
        '    out = [("decode", f"1*{k}@{p1}", f"1*{k}@{p2}")]\n',
        "tests/test_verify.py::test_the_decode_pair_differs_in_its_count_of_sequences_and_shows_a_frozen_count",
        "verify's decode pair holds one count of sequences: a frozen batch size shows no difference",
    ),
    M(
        "stray-blocks-unwatched",
        "gmtool/measure/check.py",
        "        return int((_changed(self._digest(), self.before) & ~self.allowed).sum())\n",
        "        return 0\n",
        JUDGE + "test_a_replay_that_writes_into_a_block_its_batch_does_not_hold_is_unsafe",
        "a replay writing K/V into another request's block (padding sent to a slot frozen at capture) passes",
    ),
    M(
        "sibling-keeps-chunk-prefixes",
        "gmtool/core/batch.py",
        "    prefix = [p // 2 if n == 1 else 0 for n, p in zip(q, prefix)]\n",
        "    prefix = [p // 2 for p in prefix]\n",
        JUDGE + "test_a_fast_path_frozen_on_fresh_prefills_fails_where_a_mix_has_a_cached_prefix",
        "a prefill sibling keeps its chunks' cached prefixes: a graph frozen on 'fresh prefill' is never met",
    ),
    M(
        "dyndims-prefill-pair-fresh",
        "gmtool/verify/run.py",
        '        cached = f"@{bs}" if bs + t // 4 <= cfg.max_kv_len else ""\n',
        '        cached = ""\n',
        "tests/test_verify.py::test_the_prefill_pair_has_a_cached_prefix_and_shows_a_frozen_fresh_prefill_branch",
        "verify's prefill pair has no cached prefix: a frozen fresh-prefill branch shows no difference",
    ),
    M(
        "dyndims-decode-pair-short",
        "gmtool/verify/run.py",
        "        p2 = cfg.max_kv_len - 1\n",
        "        p2 = p2\n",
        "tests/test_verify.py::test_the_decode_pair_reaches_past_a_sliding_window_and_shows_a_frozen_start_block",
        "verify's decode pair stays inside a sliding window: a start block frozen at capture shows no difference",
    ),
    M(
        "ckpt-float8-cast",
        "gmtool/model/checkpoint.py",
        '    if d.startswith(("f8", "float8", "f4", "float4")):\n',
        '    if d.startswith(("f8x", "float8x", "f4", "float4")):\n',
        "tests/test_checkpoints.py::test_quantized_weights_are_refused_whatever_the_config_says",
        "float8 weights beside a config without quantization_config are cast to --dtype unscaled: another model",
    ),
    M(
        "ckpt-int8-cast",
        "gmtool/model/checkpoint.py",
        'PACKED_NAMES = ("weight", "qweight", "weight_packed", "W_q")',
        'PACKED_NAMES = ("qweight", "weight_packed", "W_q")',
        "tests/test_checkpoints.py::test_quantized_weights_are_refused_whatever_the_config_says",
        "int8 weights are cast to --dtype unscaled: another model, reported ok",
    ),
    M(
        "multimodal-base-whole",
        "gmtool/model/families.py",
        "    return text if isinstance(text, torch.nn.Module) else base\n",
        "    return base\n",
        "tests/test_verify.py::test_a_multimodal_model_is_tapped_in_its_language_model",
        "a multimodal model's base is the whole model beside its vision tower: verify's taps and --tp find no layers",
    ),
    M(
        "decoy-skipped",
        "gmtool/measure/check.py",
        "        capture_first(ex, batch)\n        decoy()\n",
        "        capture_first(ex, batch)\n",
        "tests/test_judge.py::test_a_graph_reading_what_only_the_eager_pass_refreshes_is_unsafe",
        "the eager reference of the batch runs just before its checked replay: state only eager refreshes looks fresh",
    ),
    M(
        "soak-decoy-skipped",
        "gmtool/verify/soak.py",
        "                self._decoy()\n            read = replay_once(",
        "            read = replay_once(",
        "tests/test_verify.py::test_a_soak_runs_an_eager_step_of_another_batch_before_its_checked_replay",
        "verify's checked step runs the batch eagerly just before its replay: a graph reading eager-only state passes",
    ),
    M(
        "soak-unchecked-fault-clean",
        "gmtool/verify/soak.py",
        "                        mismatch = self._check(batch, step) or self._unlocalized(",
        "                        mismatch = self._check(batch, step) and self._unlocalized(",
        "tests/test_verify.py::test_an_unchecked_step_s_own_fault_is_a_finding_when_its_checked_rerun_is_right",
        "a step that staged wrong inputs ends the soak as clean when its checked re-run comes out right",
    ),
    M(
        "prefill-mixes-unpadded",
        "gmtool/core/compositions.py",
        "        fresh = bucket - chunk - decodes - (bucket - 1 > below and bucket - chunk - decodes > 2)\n",
        "        fresh = bucket - chunk - decodes\n",
        "tests/test_judge.py::test_a_prefill_pad_lane_left_on_a_live_slot_is_unsafe_with_default_compositions",
        "every default prefill mix fills its bucket: no checked prefill replay meets a padding lane",
    ),
    M(
        "unsafe-replay-nan-kept",
        "gmtool/core/kv_cache.py",
        "            t.nan_to_num_(0.0, 0.0, 0.0)\n",
        "            pass\n",
        "tests/test_judge.py::test_nan_an_unsafe_replay_spreads_over_the_cache_does_not_fail_later_mixes",
        "NaN a wrong replay wrote stays in the cache: later mixes' eager references are refused as the model's fault",
    ),
    M(
        "decoy-before-capture",
        "gmtool/measure/check.py",
        "    if ex.key_for(batch) not in ex.graphs and ex.served_by(batch) != GraphMode.EAGER.served_by:\n",
        "    if False:\n",
        "tests/test_judge.py::test_a_key_captured_at_its_check_is_captured_before_the_decoy",
        "a key captured at its check is captured after the decoy: its own forward refreshes what the decoy left",
    ),
    M(
        "reference-kept-after-unsafe",
        "gmtool/measure/sweep.py",
        "                        ref = self._after_unsafe(bench, ex, batch, ref)\n",
        "                        pass\n",
        "tests/test_judge.py::test_nan_an_unsafe_replay_spreads_over_the_cache_does_not_fail_later_mixes",
        "after an unsafe replay overwrote the context, the mix's next mode is judged against the old reference",
    ),
    M(
        "decoy-fallback-dropped",
        "gmtool/measure/workbench.py",
        'for comp in (sibling_of(batch), parse_composition("1*1", batch.composition.seed + 7919)):',
        "for comp in (sibling_of(batch),):",
        "tests/test_judge.py::test_checks_without_a_decoy_are_counted_in_the_notes",
        "where no sibling fits, no decoy runs, though one decode token would fit",
    ),
    M(
        "decoy-skips-unnoted",
        "gmtool/measure/workbench.py",
        "            self.decoys_skipped += 1  # the caller's notes say how many checks ran without one\n",
        "            pass\n",
        "tests/test_judge.py::test_checks_without_a_decoy_are_counted_in_the_notes",
        "checks that ran without a decoy are not counted: the notes say nothing of them",
    ),
    M(
        "auto-dispatch-unchecked",
        "gmtool/measure/check.py",
        "    if not kinds:\n        return None\n",
        "    return None\n",
        (
            "tests/test_judge.py::test_auto_serving_a_prefill_with_full_graphs_is_unsafe_in_the_sweep",
            "tests/test_verify.py::test_auto_serving_a_prefill_with_its_full_graphs_is_caught",
        ),
        "auto serving a prefill batch with its full decode graphs passes wherever the numbers come out right",
    ),
    M(
        "unreproduced-unsaid",
        "gmtool/verify/soak.py",
        "            not_reproduced = div is None and _change(got[:2], (seen.out, seen.kv)) > self.tols[0]\n",
        "            not_reproduced = False\n",
        "tests/test_verify.py::test_a_wrong_replay_that_does_not_reproduce_says_so",
        "a finding whose re-run was right blames a value frozen at capture instead of saying it did not reproduce",
    ),
    M(
        "eager-step-suspect-dropped",
        "gmtool/verify/soak.py",
        "        if isinstance(entry, EagerStep):\n",
        "        if False:\n",
        "tests/test_verify.py::test_a_stale_plan_in_autos_eager_steps_is_caught",
        "a wrong eager step of auto is blamed on poisoned buffers, not on what the step prepared",
    ),
    M(
        "plan-eager-guess-unmarked",
        "gmtool/plan/optimizer.py",
        "            int(eager[self.e_guess].sum()),\n",
        "            0,\n",
        "tests/test_plan.py::test_steps_beyond_the_measured_buckets_are_named_and_extrapolated_lists_marked",
        "steps run eager at extrapolated eager latencies leave the plan and all-eager rows unmarked",
    ),
    M(
        "baseline-shape-unchecked",
        "gmtool/report/baseline.py",
        "        if shape and old.get(k) is not None",
        "        if False and old.get(k) is not None",
        "tests/test_report.py::test_report_refuses_baseline_of_another_model",
        "a baseline of another model with the same folder name and parameter count is compared",
    ),
    M(
        "md-cell-unescaped",
        "gmtool/report/markdown.py",
        '    return md_text(text).replace("\\n", " ")\n',
        '    return str(text).replace("|", "\\\\|").replace("\\n", " ")\n',
        "tests/test_report.py::test_markdown_sections",
        "an error's <...> opens an HTML tag in report.md",
    ),
    M(
        "partial-not-on-top",
        "gmtool/report/markdown.py",
        "    if partial:  # said at the top",
        "    if False:  # said at the top",
        "tests/test_report.py::test_a_partial_run_says_so_before_its_tables",
        "a partial run's report reads as the whole sweep until its notes",
    ),
    M(
        "plan-failed-size-candidate",
        "gmtool/plan/run.py",
        " & ~sizes.index.isin(list(failed))]",
        "]",
        "tests/test_plan.py::test_a_size_that_replayed_wrong_is_never_a_capture_size",
        "a workload size whose bucket replayed UNSAFE comes back as a candidate, costed by interpolation",
    ),
    M(
        "plan-decode-only-ignored",
        "gmtool/plan/run.py",
        "problem.evaluate(d.sizes, d.padding, d.decode_only)",
        "problem.evaluate(d.sizes, d.padding)",
        "tests/test_plan.py::test_decode_only_engines_rows_count_the_mixed_steps_eager",
        "SGLang's and TensorRT-LLM's rows put prefill and mixed steps on their decode graphs",
    ),
    M(
        "batch-seed-ignored",
        "gmtool/core/batch.py",
        "(1000 + comp.seed + 1_000_003 * run_seed) % 2**63",
        "1000 + comp.seed",
        "tests/test_sibling.py::test_the_runs_seed_draws_other_tokens_contexts_and_blocks",
        "--seed leaves token ids, contexts and block placement as they were",
    ),
    M(
        "verdict-counts-unrun-replays",
        "gmtool/report/summary.py",
        'r["mode"] != GraphMode.EAGER and r["status"] in (Status.OK, Status.UNSAFE)',
        'r["status"] != Status.SKIPPED',
        "tests/test_output.py::test_verdict_counts_the_replays_checked_against_eager",
        "rows that failed before any replay are counted as replays checked against eager",
    ),
    M(
        "partial-wall-unset",
        "gmtool/measure/sweep.py",
        "            res.wall_s = time.perf_counter() - t_start  # a partial run's document says how long it ran too\n",
        "",
        "tests/test_nothing_lost.py::test_ctrl_c_keeps_what_was_measured",
        "a stopped run's report says it took 0.0 s",
    ),
    M(
        "md-summary-ranks-pooled",
        "gmtool/report/markdown.py",
        "    rows = bucket_summary(records, by_rank)\n",
        "    rows = bucket_summary(records)\n",
        "tests/test_report.py::test_a_tp_run_s_rank_rows_each_get_their_own_change_and_capture_seconds_are_not_summed_over_ranks",
        "report.md's --tp summary shows a median pooled over ranks, which no rank measured",
    ),
    M(
        "tp-sigterm-orphans",
        "gmtool/parallel/launch.py",
        "    term = signal.signal(signal.SIGTERM, interrupt)\n",
        "    term = signal.getsignal(signal.SIGTERM)\n",
        "tests/test_parallel.py::test_a_tp_run_stopped_while_its_ranks_start_leaves_nothing_running_and_no_traceback",
        "a SIGTERM to a --tp run leaves its ranks running without it",
    ),
    M(
        "plan-measure-unjournaled",
        "gmtool/app.py",
        '    with _keeping(out_dir, "compare", planned, sweep, lambda doc: write_results(out_dir, doc)):\n',
        "    with contextlib.nullcontext():\n",
        "tests/test_nothing_lost.py::test_ctrl_c_while_plan_measures_keeps_what_was_measured",
        "a Ctrl-C while plan measures keeps no results file",
    ),
    M(
        "verify-interrupt-lost",
        "gmtool/verify/run.py",
        "    except KeyboardInterrupt:  # what was measured is written: the finished soaks and analyses\n",
        "    except ZeroDivisionError:  # what was measured is written: the finished soaks and analyses\n",
        "tests/test_nothing_lost.py::test_ctrl_c_in_verify_keeps_the_soaks_that_finished",
        "a Ctrl-C in verify writes no verify.json",
    ),
    M(
        "verify-partial-clean",
        "gmtool/verify/report.py",
        '    elif doc.get("partial"):  # not clean: what it did not run was not checked\n',
        "    elif False:  # not clean: what it did not run was not checked\n",
        "tests/test_nothing_lost.py::test_ctrl_c_in_verify_keeps_the_soaks_that_finished",
        "an interrupted verify says clean",
    ),
    M(
        "tp-start-signal-dropped",
        "gmtool/parallel/launch.py",
        "    if got:\n        raise KeyboardInterrupt\n",
        "",
        "tests/test_parallel.py::test_a_signal_while_the_ranks_start_is_held_until_all_started_then_raised",
        "a Ctrl-C while the ranks start is lost: the run goes on",
    ),
    M(
        "tp-rank-sigterm-kills",
        "gmtool/parallel/launch.py",
        "        signal.signal(signal.SIGTERM, _interrupt_once)\n",
        "",
        "tests/test_parallel.py::test_a_tp_run_stopped_mid_sweep_writes_what_was_measured",
        "a group SIGTERM kills the ranks outright: nothing measured is written",
    ),
    M(
        "plan-gain-any-batch",
        "gmtool/plan/document.py",
        "_gain(res.plan_decode_only if d.decode_only else p, c)",
        "_gain(p, c)",
        "tests/test_plan.py::test_decode_only_engines_rows_count_the_mixed_steps_eager",
        "the plan is credited against SGLang with graphs SGLang never runs",
    ),
    M(
        "tp-death-blamed-on-survivor",
        "gmtool/parallel/launch.py",
        "(killed := next((r for r, c in silent.items() if c < 0), None)) is not None",
        "(killed := next((r for r, c in silent.items() if c < 0), None)) is not None and not done",
        "tests/test_parallel.py::test_a_failed_rank_is_named_and_the_others_stop",
        "a rank killed outright goes unnamed: the error is the survivor's gloo message",
    ),
    M(
        "entry-interrupt-traceback",
        "gmtool/cli/entry.py",
        "        signal.signal(signal.SIGINT, _interrupted_while_loading)\n",
        "        pass\n",
        "tests/test_entry.py::test_ctrl_c_while_the_commands_load_ends_with_a_line_not_a_traceback",
        "a Ctrl-C while torch loads prints a traceback (or is swallowed by torch's numpy import)",
    ),
    M(
        "help-summary-broken",
        "gmtool/cli/main.py",
        "app.command(name, short_help=_summary(fn))(fn)",
        "app.command(name)(fn)",
        "tests/test_cli_capture.py::test_the_command_list_shows_each_summary_as_flowing_text",
        "gmtool --help breaks a command's summary where its docstring's lines break",
    ),
    M(
        "judge-kv-lens-lane-skipped",
        "gmtool/measure/check.py",
        'if got["kv_lens"][b:].any():',
        'if got["kv_lens"][b + 1 :].any():',
        "tests/test_judge.py::test_each_padding_lane_a_graph_reads_is_checked",
        "the stale length a shrinking decode batch leaves in its first padding lane goes unseen",
    ),
    M(
        "judge-block-rows-unchecked",
        "gmtool/measure/check.py",
        'if got["block_tables"][:b, w:].any() or got["block_tables"][b:].any():',
        'if got["block_tables"][:b, w:].any():',
        "tests/test_judge.py::test_each_padding_lane_a_graph_reads_is_checked",
        "padded sequences' block-table rows may point at live blocks unreported",
    ),
    M(
        "poison-tail-off-by-one",
        "gmtool/verify/poison.py",
        "tails.append(slots.reshape(-1)[length:])",
        "tails.append(slots.reshape(-1)[length + 1 :])",
        "tests/test_verify.py::test_the_poisoned_kv_tail_starts_at_the_first_slot_past_each_length",
        "a graph reading one slot past kv_len reads a clean zero, not poison",
    ),
    M(
        "verify-unchecked-dispatch-unseen",
        "gmtool/verify/soak.py",
        "            entry.replay(batch, ex.refresh_runner_metadata)\n            if why := self._served_fault(batch, entry):\n                return why\n",
        "            entry.replay(batch, ex.refresh_runner_metadata)\n",
        "tests/test_verify.py::test_auto_serving_a_prefill_with_its_full_graphs_is_caught_on_an_unchecked_step",
        "auto's wrong dispatch is seen only on checked steps",
    ),
    M(
        "key-per-batch-size",
        "gmtool/core/buckets.py",
        "key = self._keys[asked] = self._one.setdefault(key, key)",
        "key = self._keys[asked] = key",
        "tests/test_buckets.py::test_batches_of_one_bucket_get_its_one_key_object",
        "every change of batch size pads in full: the in-place padding never runs in a real run",
    ),
    M(
        "tp-success-traceback",
        "gmtool/parallel/launch.py",
        "        for sig in (signal.SIGINT, signal.SIGTERM):\n            signal.signal(sig, _ignore)\n        # plain pickle: torch's queue",
        "        # plain pickle: torch's queue",
        "tests/test_parallel.py::test_a_rank_that_reported_its_result_ignores_the_parent_s_stop",
        "a --tp run that went well prints a rank's KeyboardInterrupt traceback",
    ),
    M(
        "tp-reported-rank-orphaned",
        "gmtool/parallel/launch.py",
        "        _die_with_parent(parent, signal.SIGKILL)\n        for sig in (signal.SIGINT, signal.SIGTERM):\n            signal.signal(sig, _ignore)\n        # plain pickle",
        "        for sig in (signal.SIGINT, signal.SIGTERM):\n            signal.signal(sig, _ignore)\n        # plain pickle",
        "tests/test_parallel.py::test_a_rank_that_reported_its_result_ignores_the_parent_s_stop",
        "a rank whose parent dies while its report fills the pipe waits on it for good",
    ),
    M(
        "verify-repro-drops-attention",
        "gmtool/verify/run.py",
        '        if self.attention != "auto":',
        "        if False:",
        "tests/test_verify.py::test_the_reproduce_command_is_one_verify_accepts",
        "a finding under --attention torch reproduces under Triton: another run",
    ),
    M(
        "no-eager-note-unsaved",
        "gmtool/config.py",
        "        if GraphMode.EAGER not in self.modes:  # a list or a profile without it",
        "        if False:  # a list or a profile without it",
        "tests/test_compare.py::test_a_run_without_eager_says_so_in_its_files_too",
        "a run without eager leaves its speedup columns empty without a word in its files",
    ),
    M(
        "inject-uncaught-clean",
        "gmtool/verify/report.py",
        "        if fault:  # a self-test that found nothing is no clean bill",
        "        if False:",
        "tests/test_verify.py::test_an_injected_fault_nothing_caught_is_said_in_the_verdict",
        "an injected fault nothing caught is reported as a plain clean soak",
    ),
    M(
        "profile-value-blamed-on-flag",
        "gmtool/cli/run_sweep.py",
        "    given = [k for k in keys if k in prof and opts.get(k) is None]",
        "    given = []",
        "tests/test_profiles.py::test_a_refusal_of_a_profile_s_value_says_it_came_from_the_profile",
        "a profile's value is refused as a command-line flag the user never gave",
    ),
    M(
        "verify-young-graphs-unchecked",
        "gmtool/verify/soak.py",
        "                    if young or (step + 1) % opts.check_every == 0:",
        "                    if (step + 1) % opts.check_every == 0:",
        "tests/test_verify.py::test_a_graph_that_serves_only_steps_between_checks_is_still_checked",
        "a graph that serves only steps between checks is never judged",
    ),
    M(
        "share-output-mixed-modes-late",
        "gmtool/verify/run.py",
        "            if any(GraphMode(m) == GraphMode.PIECEWISE for m in self.graph_modes):",
        "            if all(GraphMode(m) == GraphMode.PIECEWISE for m in self.graph_modes):",
        "tests/test_bad_inputs.py::test_every_bad_input_is_one_line_and_exit_2",
        "the default modes with share-output end in an error after the full soak, its finding lost",
    ),
    M(
        "inject-mode-miss-unsaid",
        "gmtool/verify/report.py",
        '    if fault and doc["findings"] and missed:',
        "    if False:",
        "tests/test_verify.py::test_a_mode_whose_soak_missed_the_injected_fault_is_named_when_another_caught_it",
        "a mode whose soak missed the injected fault goes unsaid when another mode caught it",
    ),
    M(
        "row-read-unsuggested",
        "gmtool/verify/soak.py",
        "            full = batch.num_tokens == entry.key.num_tokens > 1",
        "            full = False",
        "tests/test_verify.py::test_a_wrong_replay_of_a_step_that_fills_its_bucket_names_a_row_read_from_another_token",
        "a graph reading another token's row, on a step with no padding, is blamed on a value frozen at capture alone",
    ),
    M(
        "bin-not-torch-unsaid",
        "gmtool/model/checkpoint.py",
        '        if len(head) > 8 and head[8:9] == b"{":',
        "        if False:",
        "tests/test_checkpoints.py::test_a_bin_file_that_is_no_torch_file_is_refused_by_name",
        "a safetensors file named .bin is refused as an unreadable pickle",
    ),
    M(
        "verify-fx-dropped",
        "gmtool/verify/run.py",
        "            self.sweep.piecewise_impl = PiecewiseImpl(self.piecewise_impl)\n",
        "            pass\n",
        "tests/test_verify.py::test_verify_soaks_fx_split_piecewise_graphs_where_asked_and_says_where_it_fell_back",
        "verify --piecewise-impl fx soaks graphs split at run time",
    ),
    M(
        "verify-fx-recorded-outside",
        "gmtool/verify/dyndims.py",
        "        fx = fx_split()\n        if fx is None:\n",
        "        fx = fx_split()\n        if True:\n",
        "tests/test_verify.py::test_verify_soaks_fx_split_piecewise_graphs_where_asked_and_says_where_it_fell_back",
        "verify's op recorder around an fx split's call: torch.compile skips the code, every split falls back",
    ),
    M(
        "verify-fx-fallback-unrecorded",
        "gmtool/verify/dyndims.py",
        '        fx = getattr(getattr(ex.forward_impl, "active", None), "fx", None)\n',
        '        fx = getattr(getattr(ex.forward_impl, "primary", None), "fx", None)\n',
        "tests/test_verify.py::test_verify_soaks_fx_split_piecewise_graphs_where_asked_and_says_where_it_fell_back",
        "an fx split that fell back to the run-time one: dynamic dimensions record no op and read clean",
    ),
    M(
        "fx-shared-code",
        "gmtool/model/fx_split.py",
        "        self._code = fn.__code__.replace()\n",
        "        self._code = fn.__code__\n",
        "tests/test_verify.py::test_fx_splits_do_not_pile_up_in_dynamos_cache_across_verify_runs",
        "every fx split's compiled entries on one code object: past dynamo's accumulated limit all fall back",
    ),
    M(
        "fx-entries-kept",
        "gmtool/core/executor.py",
        "        self.forward_impl.release()\n",
        "",
        "tests/test_verify.py::test_fx_splits_do_not_pile_up_in_dynamos_cache_across_verify_runs",
        "a released executor's fx split keeps dynamo's compiled entries, and with them its model",
    ),
    M(
        "dyndims-nothing-compared-clean",
        "gmtool/verify/report.py",
        '        if d["clean"] and not d.get("compared", True):\n',
        "        if False:\n",
        "tests/test_verify.py::test_a_dynamic_dimension_analysis_that_recorded_no_op_is_not_called_clean",
        "a dynamic-dimension analysis that recorded no op reads clean in the table",
    ),
    M(
        "fx-head-unrecorded",
        "gmtool/core/forwards.py",
        "        with self.fx.piece_mode or contextlib.nullcontext():  # verify's op recorder sees the head as a piece\n",
        "        with contextlib.nullcontext():\n",
        "tests/test_verify.py::test_dynamic_dimensions_of_an_fx_split_record_its_lm_head",
        "verify's dynamic dimensions of an fx split leave out the LM head: a value baked into it goes unseen",
    ),
    M(
        "fx-hooks-traced",
        "gmtool/verify/dyndims.py",
        "        entry = ex.capture(ex.key_for(batch), batch)\n",
        "        with tracker.active():\n            entry = ex.capture(ex.key_for(batch), batch)\n",
        "tests/test_verify.py::test_fx_dynamic_dimensions_with_a_node_reader_trace_none_of_its_hooks",
        "the tracker's hooks active while an fx split traces: dynamo traces them, recompiles, fails on the sampler",
    ),
    M(
        "auto-fx-entries-kept",
        "gmtool/core/auto.py",
        "            ex.forward_impl.release()\n",
        "",
        "tests/test_verify.py::test_fx_splits_do_not_pile_up_in_dynamos_cache_across_verify_runs",
        "a released auto executor's fx split keeps dynamo's compiled entries",
    ),
    M(
        "verify-fx-fallback-unsaid",
        "gmtool/verify/soak.py",
        "            fell_back = sorted({g.piecewise_impl for g in ex.graphs.values()} - {None, wanted})\n",
        "            fell_back = []\n",
        "tests/test_verify.py::test_verify_soaks_fx_split_piecewise_graphs_where_asked_and_says_where_it_fell_back",
        "verify soaks run-time split graphs where fx could not trace, and calls them fx",
    ),
    M(
        "verify-repro-without-fx",
        "gmtool/verify/run.py",
        '            parts.append(f"--piecewise-impl {self.piecewise_impl}")\n',
        "            pass\n",
        "tests/test_verify.py::test_verify_takes_piecewise_impl_only_with_a_mode_it_splits_and_reproduces_with_it",
        "verify's reproduce line drops --piecewise-impl: an fx finding re-runs on the run-time split",
    ),
    M(
        "verify-soak-notes-unsaid",
        "gmtool/verify/report.py",
        '    doc["notes"] += [f"{r[\'mode\']} under {r[\'strategy\']}: {n}" for r in doc["runs"] for n in r.get("notes", [])]\n',
        "",
        "tests/test_verify.py::test_a_soaks_own_notes_reach_the_documents_notes",
        "a soak's notes (a fallback split, skipped decoys, a stop) stay in verify.json, unsaid in the terminal",
    ),
]


# -- running ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | error
    killed_by: str = ""
    note: str = ""
    seconds: float = 0.0
    output: str = ""
    why: str = ""  # the first failure's one-line reason, as pytest's summary gives it


def check_sync(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """Every mutant's old text must occur exactly once in its file, and differ from its new text."""
    problems = []
    seen = set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: no file {m.file}")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            problems.append(f"{m.id}: the old text occurs {n} times in {m.file} (must be exactly once)")
        if m.old == m.new:
            problems.append(f"{m.id}: old and new text are the same")
        if not m.tests:
            problems.append(f"{m.id}: no tests")
    return problems


def scratch_copy(prefix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f"gmtool-mutant-{prefix}-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp / name, ignore=ignore)
        else:
            shutil.copy2(src, tmp / name)
    return tmp


def apply(m: Mutant, tree: Path) -> None:
    path = tree / m.file
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.id}: the old text occurs {n} times in {m.file}: update tools/mutants.py")
    path.write_text(text.replace(m.old, m.new))


def child_env(tree: Path, jobs: int) -> dict:
    # COLUMNS: pytest cuts its short summary lines to the terminal's width; the node id and reason are wanted whole
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", COLUMNS="1000")
    env.pop("PYTEST_ADDOPTS", None)
    if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


_procs: set = set()
_procs_lock = threading.Lock()


def run_pytest(tree: Path, tests: tuple[str, ...], timeout: float, jobs: int) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output, seconds). The child gets its own process group: a timeout
    ends it and anything it started."""
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests]
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd,
        cwd=tree,
        env=child_env(tree, jobs),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    with _procs_lock:
        _procs.add(p)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    finally:
        with _procs_lock:
            _procs.discard(p)
    return rc, out, time.perf_counter() - t0


def first_failure(output: str) -> tuple[str, str]:
    """The first FAILED/ERROR node id of pytest's short summary, and its one-line reason."""
    for line in output.splitlines():
        for tag in ("FAILED ", "ERROR "):
            if line.startswith(tag):
                node, _, why = line[len(tag) :].partition(" - ")
                return node.strip() + (" (error)" if tag == "ERROR " else ""), why.strip()
    return "", ""


def run_mutant(m: Mutant, timeout: float, jobs: int, keep: bool) -> Outcome:
    tree = scratch_copy(m.id)
    try:
        apply(m, tree)
        rc, out, secs = run_pytest(tree, m.tests, timeout, jobs)
    finally:
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)
    if rc is None:
        return Outcome(m, "killed", "timeout", f"no result within {timeout:.0f} s", secs, out)
    if rc == 0:
        return Outcome(m, "survived", "", "", secs, out)
    if rc in (1, 2):  # 1: a test failed; 2: interrupted, e.g. the mutant broke an import at collection
        by, why = first_failure(out)
        return Outcome(m, "killed", by or f"pytest exit {rc}", "collection error" if rc == 2 else "", secs, out, why)
    # 3 internal error, 4 usage error (a node id that does not exist), 5 no tests: the list is wrong
    return Outcome(
        m, "error", "", f"pytest exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}", secs, out
    )


def baseline(mutants: list[Mutant], timeout: float, jobs: int) -> tuple[bool, str, float]:
    """The mutants' tests on the unmutated tree: all must pass, or a kill means nothing."""
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    tree = scratch_copy("baseline")
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import gmtool; print(gmtool.__file__)"],
            cwd=tree,
            env=child_env(tree, jobs),
            capture_output=True,
            text=True,
        )
        where = probe.stdout.strip()
        if not where.startswith(str(tree)):
            return False, f"gmtool imports from {where or probe.stderr.strip()}, not from the scratch copy {tree}", 0.0
        rc, out, secs = run_pytest(tree, tests, timeout * 3, jobs)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if rc != 0:
        return False, out[-4000:] if rc is not None else "baseline timed out", secs
    return True, "", secs


# -- reporting ----------------------------------------------------------------------------------------------
def esc(text: str) -> str:
    """Node ids hold [params]: rich would read them as markup."""
    from rich.markup import escape

    return escape(text)


def result_cell(o: Outcome) -> str:
    return o.status + (f" ({o.note})" if o.note else "")


def rich_table(outcomes: list[Outcome]):
    from rich.table import Table

    t = Table(title="gmtool mutants")
    for col in ("mutant", "file", "description", "result", "killed by", "s"):
        t.add_column(col, justify="right" if col == "s" else "left", overflow="fold")
    style = {"killed": "green", "survived": "bold red", "error": "red"}
    for o in outcomes:
        t.add_row(
            o.mutant.id,
            o.mutant.file.removeprefix("gmtool/"),
            esc(o.mutant.desc),
            f"[{style[o.status]}]{esc(result_cell(o))}[/]",
            esc(o.killed_by) or "-",
            f"{o.seconds:.1f}",
        )
    return t


def markdown(outcomes: list[Outcome], score: str) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| mutant | file | description | result | killed by | s |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(
            f"| `{o.mutant.id}` | {o.mutant.file} | {cell(o.mutant.desc)} | {cell(result_cell(o))} | "
            f"{'`' + cell(o.killed_by) + '`' if o.killed_by else '-'} | {o.seconds:.1f} |"
        )
    return "\n".join(lines + ["", score, ""])


def list_table(mutants: list[Mutant]):
    from rich.table import Table

    t = Table(title=f"gmtool mutants: {len(mutants)}")
    for col in ("mutant", "file", "description", "tests"):
        t.add_column(col, overflow="fold")
    for m in mutants:
        t.add_row(m.id, m.file, esc(m.desc), esc("\n".join(m.tests)))
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--list", action="store_true", help="print the mutants and check they apply; run nothing")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant (a timeout counts as killed)")
    ap.add_argument("--markdown", type=Path, help="also write the result table as Markdown to this file")
    ap.add_argument("--no-baseline", action="store_true", help="skip running the tests on the unmutated tree")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (debugging)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output of every mutant")
    args = ap.parse_args(argv)

    from rich.console import Console

    console = Console(width=max(160, Console().width))
    mutants = MUTANTS
    if args.only:
        want = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in want if w not in {m.id for m in MUTANTS}]
        if unknown:
            console.print(f"[red]unknown mutant id(s): {', '.join(unknown)}[/]")
            return 2
        mutants = [m for m in MUTANTS if m.id in want]
    problems = check_sync(mutants)
    if problems:
        console.print("[bold red]the mutant list is out of sync with the code:[/]")
        for p in problems:
            console.print(f"  {p}")
        return 2
    if args.list:
        console.print(list_table(mutants))
        return 0

    t_start = time.perf_counter()
    if not args.no_baseline:
        console.print(
            f"baseline: the {len({t for m in mutants for t in m.tests})} test selections on the unmutated tree ..."
        )
        ok, why, secs = baseline(mutants, args.timeout, 1)
        if not ok:
            console.print(f"[bold red]baseline failed: the tests must pass before mutants mean anything[/]\n{why}")
            return 2
        console.print(f"baseline: all pass ({secs:.0f} s)")

    outcomes: dict[str, Outcome] = {}
    jobs = max(1, args.jobs)
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_mutant, m, args.timeout, jobs, args.keep): m for m in mutants}
            for fut in as_completed(futures):
                o = fut.result()
                outcomes[o.mutant.id] = o
                color = {"killed": "green", "survived": "bold red", "error": "red"}[o.status]
                console.print(
                    f"\\[{len(outcomes):>2}/{len(mutants)}] {o.mutant.id}: [{color}]{esc(result_cell(o))}[/]"
                    f"{' by ' + esc(o.killed_by) if o.killed_by else ''} ({o.seconds:.1f} s)"
                )
                if o.why:
                    console.print(f"        {o.why[:200]}", markup=False, highlight=False)
                if args.verbose or o.status == "error":
                    console.print(o.output[-3000:], markup=False, highlight=False)
    except KeyboardInterrupt:
        with _procs_lock:
            for p in list(_procs):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        raise

    ordered = [outcomes[m.id] for m in mutants]
    killed = sum(o.status == "killed" for o in ordered)
    survived = sum(o.status == "survived" for o in ordered)
    errors = sum(o.status == "error" for o in ordered)
    wall = time.perf_counter() - t_start
    score = (
        f"{killed} killed, {survived} survived of {len(ordered)}"
        + (f" ({errors} could not run)" if errors else "")
        + f" in {wall / 60:.1f} min, -j {jobs}"
    )
    console.print(rich_table(ordered))
    console.print(score)
    if args.markdown:
        args.markdown.write_text(markdown(ordered, score))
        console.print(f"markdown: {args.markdown}")
    return 0 if survived == 0 and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
