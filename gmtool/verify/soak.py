"""The soak: one graph mode under one memory strategy, driven by the scheduler for N steps.

Every step replays whatever graph its batch's bucket key selects (captured on first use). Every K-th step is
checked: eager runs the exact batch first, then the replay runs with every unread buffer poisoned (poison.py),
and the check compares logits and the K/V written with eager (gmtool.measure.check), the device inputs with
the batch, and the K/V live requests held with what they held before. The first failing check stops the run
and is localized: which poisoned buffer changes the result on its own, and the first layer output where the
replay leaves eager.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch

from gmtool.core.auto import EagerStep
from gmtool.errors import InputsNotLoaded, first_line
from gmtool.measure.check import (
    capture_first,
    dispatch_fault,
    input_faults,
    judge,
    replay_once,
    slots_held,
    written_kv,
)
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from gmtool.measure.workbench import decoy_note
from gmtool.modes import GraphMode
from gmtool.verify.faults import Fault, inject
from gmtool.verify.poison import Buffer, Poisoner
from gmtool.verify.scheduler import Scheduler, Workload
from gmtool.verify.taps import LayerTaps


@dataclass
class Mismatch:
    step: int
    key: str
    composition: str
    captured_with: str
    reason: str
    input_faults: list[str]
    live_slots_changed: int  # K/V slots of live requests the replay overwrote
    buffers_read: list[str]  # poisoned alone, each of these changed the replay's result
    first_divergence: dict | None
    suspects: list[str]
    repro: str = ""


@dataclass
class SoakResult:
    mode: str
    strategy: str
    steps: int  # run (the run stops at the first mismatch, or at the time limit)
    checks: int
    graphs: int
    keys: list[str]
    finished_requests: int
    blocks_reused: int
    wall_s: float
    steps_per_min: float
    poison_skipped: dict[str, str]
    expected_unsafe: bool  # full-narrow: its mismatches are the finding it exists to show
    mismatch: Mismatch | None = None
    served_by: dict[str, int] = field(default_factory=dict)  # steps per what served them (auto: full, piecewise, eager)
    checked_by: dict[str, int] = field(default_factory=dict)  # checked steps per what served them
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


FIRST_CHECKS = 2  # a graph's first replay may be of its capture's batch (a value frozen then is still right)


@dataclass
class SoakOptions:
    steps: int
    check_every: int
    seed: int
    fault: Fault | None = None
    time_limit_s: float | None = None  # stop after this long (a figure run within a device budget)


class Soak:
    def __init__(self, bench, taps: LayerTaps, mode: GraphMode, memory, strategy: str, opts: SoakOptions):
        self.bench, self.taps, self.mode, self.strategy, self.opts = bench, taps, GraphMode(mode), strategy, opts
        self.ex = bench.executor(self.mode, memory)
        lm = bench.lm
        persistent = [*lm.model.parameters(), *lm.model.buffers(), *taps.buffers, bench.eager_inputs.arena]
        self.poisoner = Poisoner(self.ex, persistent, opts.seed)
        cfg = bench.cfg
        # a step's tokens: up to the largest bucket, or to --max-tokens where the mode runs larger steps eagerly
        budget = self.ex.policy.max_tokens if self.mode.composed_of else self.ex.policy.largest
        self.sched = Scheduler(
            Workload(budget, cfg.max_num_seqs, cfg.max_kv_len),
            bench.cache.num_blocks,
            cfg.block_size,
            lm.vocab_size,
            opts.seed,
        )
        self.tols = tolerances_for(cfg.torch_dtype)
        self._decoy = None  # the checked step's eager step of another batch (Workbench.decoy), for localization

    def run(self) -> SoakResult:
        opts, sched, ex = self.opts, self.sched, self.ex
        checks, keys, mismatch, step, served, checked, graph_checks = 0, {}, None, -1, {}, {}, {}
        fault = inject(opts.fault, ex) if opts.fault else contextlib.nullcontext()
        t0, skipped = time.perf_counter(), self.bench.decoys_skipped
        try:
            with fault:
                for step in range(opts.steps):
                    if opts.time_limit_s is not None and time.perf_counter() - t0 > opts.time_limit_s:
                        step -= 1
                        break
                    batch = sched.next_batch()
                    key = str(ex.key_for(batch))
                    keys.setdefault(key, None)
                    by = ex.served_by(batch)
                    served[by] = served.get(by, 0) + 1
                    # each graph's first replays are checked too: a graph that served only steps between checks
                    # went unjudged (auto's decode graphs, 5 steps of 80 at --check-every 3, one frozen at capture)
                    young = by != "eager" and graph_checks.get((by, key), 0) < FIRST_CHECKS
                    if young or (step + 1) % opts.check_every == 0:
                        if by != "eager":
                            graph_checks[(by, key)] = graph_checks.get((by, key), 0) + 1
                        checks += 1
                        checked[by] = checked.get(by, 0) + 1
                        mismatch = self._check(batch, step)
                        if mismatch is not None:
                            break
                    elif (why := self._unchecked_step(batch)) is not None:
                        checks += 1
                        checked[by] = checked.get(by, 0) + 1
                        # checked and localized; where the checked re-run is right, the step's own fault is the
                        # finding (a re-run loads in another order than the step did)
                        mismatch = self._check(batch, step) or self._unlocalized(
                            batch, step, f"an unchecked step {why}; its checked re-run was right", [], f"the step {why}"
                        )
                        break
                    sched.commit()
            ex.backend.synchronize()
            wall = time.perf_counter() - t0
            graphs = len(ex.graphs)
            wanted = self.bench.cfg.piecewise_impl  # the split asked for; a model fx cannot trace falls back
            fell_back = sorted({g.piecewise_impl for g in ex.graphs.values()} - {None, wanted})
        finally:
            ex.release()
        res = SoakResult(
            str(self.mode),
            self.strategy,
            step + 1,
            checks,
            graphs,
            list(keys),
            sched.finished,
            sched.reused_blocks,
            wall,
            60 * (step + 1) / wall if wall > 0 else 0.0,
            {str(k): v for k, v in self.poisoner.skipped.items()},
            # full-narrow's known bug is a prefill graph's frozen plan: a wrong decode replay, or any under an
            # injected fault, is a finding there too, not the expected one
            self.mode.expected_unsafe and opts.fault is None and (mismatch is None or not batch.is_decode),
            mismatch,
            served,
            checked,
        )
        res.notes += [f"piecewise graphs split by {impl}, not {wanted}" for impl in fell_back]
        if self.bench.decoys_skipped > skipped:
            res.notes.append(decoy_note(self.bench.decoys_skipped - skipped))
        if mismatch is None and step + 1 < opts.steps and opts.time_limit_s is not None:
            res.notes.append(
                f"stopped at the time limit ({opts.time_limit_s:.0f} s) after {step + 1} of {opts.steps} steps"
            )
        elif mismatch is not None and step + 1 < opts.steps:
            res.notes.append(
                f"stopped at the first wrong replay, at step {step} ({step + 1} of {opts.steps} steps run)"
            )
        return res

    def _unchecked_step(self, batch) -> str | None:
        """Run a step as an engine would (load, replay); None, or what went wrong: inputs staged that are not the
        batch's, or a replay that raised."""
        ex = self.ex
        try:
            entry = ex.prepare(batch)
            # wrong inputs reach the device only through the staging arena: caught there, a fault is checked and
            # localized before a replay can read out of bounds (on CUDA an illegal address would end the process,
            # not name the buffer)
            if faults := input_faults(ex, entry.key, batch, staged=True):
                return "staged inputs that are not its batch's: " + "; ".join(faults)
            entry.replay(batch, ex.refresh_runner_metadata)
            if why := self._served_fault(batch, entry):
                return why
            # what the replay read: a load that skipped its copy leaves the device inputs of an earlier batch
            if faults := input_faults(ex, entry.key, batch):
                return "read device inputs that are not its batch's: " + "; ".join(faults)
        except torch.OutOfMemoryError:
            raise
        # CPU tape: an index out of range; anywhere: a graph served for another bucket
        except (RuntimeError, IndexError, InputsNotLoaded) as e:
            return f"raised {first_line(e, typed=True)}"
        return None

    def _unlocalized(self, batch, step: int, reason: str, faults: list[str], *suspects: str) -> Mismatch:
        """A finding no replay can be localized for (the step raised, or its checked re-run was right)."""
        key = str(self.ex.key_for(batch))
        return Mismatch(step, key, batch.composition.label, "", reason, faults, 0, [], None, list(suspects))

    def _served_fault(self, batch, entry) -> str | None:
        """What ran against what the executor says serves batch (the soak's counts), and against auto's rule."""
        said = self.ex.served_by(batch)
        if entry.mode.served_by != said:
            return f"was served by {entry.mode.served_by} where the executor says {said} serves it"
        return dispatch_fault(self.ex, batch, entry)

    # -- one checked step ------------------------------------------------------------------------------
    def _check(self, batch, step: int) -> Mismatch | None:
        """The eager reference, then an eager step of another batch (Workbench.decoy: the reference alone, just
        before the replay, would refresh state an eager pass shares with the graph and hide a stale one), then the
        replay. The reference comes first: a wrong replay may overwrite the context it reads."""
        ex, live = self.ex, self.sched.live()
        ref, _ = self.bench.reference(batch)
        held = {b for table, _ in live for b in table} | batch.blocks
        self._decoy = self.bench.decoy(batch, keep=held)
        try:
            if self._decoy is not None:
                capture_first(ex, batch)
                self._decoy()
            read = replay_once(
                ex,
                batch,
                before_replay=lambda entry: self.poisoner.apply(entry, batch, live, step),
                after_replay=self.poisoner.after_replay,
                held_slots=slots_held(*zip(*live), ex.cache.spec.block_size) if live else None,
                held_by="live requests",
            )
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, IndexError) as e:  # its capture's warm-up raised (no graph to replay), or the load
            key = ex.key_for(batch)
            faults, where = input_faults(ex, key, batch), "loading" if key in ex.graphs else "capturing"
            reason = f"the step raised {first_line(e, typed=True)} ({where} the bucket)"
            raised = f"the {'copy-in' if where == 'loading' else 'eager warm-up of its capture'} raised"
            return self._unlocalized(batch, step, reason, faults, *(faults or [raised]))
        entry = read.entry
        try:
            check = judge(ex, batch, ref, read)
            reason, stale = check.failure(*self.tols), check.stale_metadata
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, IndexError) as e:  # the eager pass on the graph's own (wrong) inputs raised
            reason = f"the step raised {first_line(e, typed=True)}"
            entry, stale = ex.prepare(batch), False
        reason = reason or self._served_fault(batch, entry)
        self.poisoner.clean(entry, live)
        if reason is None:  # the check's reason covers the device inputs and the live K/V too
            return None
        return self._localize(entry, batch, live, step, reason, read, stale)

    # -- localization ------------------------------------------------------------------------------------
    def _replay(self, batch, live, step: int, only, decoy: bool = True):
        """Re-run the step with only these buffers poisoned (None: all of them), after the checked step's decoy
        (decoy=False: without it). Returns (logits, K/V, taps) or the error the replay raised."""
        ex = self.ex
        ex.inputs.invalidate()
        if decoy and self._decoy is not None:
            self._decoy()
        entry = ex.prepare(batch)
        self.poisoner.clean(entry, live)
        if only is None or only:
            self.poisoner.apply(entry, batch, live, step, only=only)
        try:
            entry.replay(batch, ex.refresh_runner_metadata)
        except (RuntimeError, IndexError, InputsNotLoaded) as e:
            return first_line(e, typed=True)
        if only is None or only:
            self.poisoner.after_replay(entry, only=only)
        n = batch.num_tokens
        return (
            ex.output(entry, batch).clone(),
            written_kv(ex.cache, batch),
            self.taps.graph_buf[:, :n].clone(),
        )

    def _buffers_read(self, batch, live, step: int) -> list[str]:
        """Each buffer poisoned alone against a clean replay: those that change the result are read, the one that
        changes it most first. A graph that reads stale metadata reads through it more than one poisoned buffer
        (frozen kv lengths read slots past each length, and the null block the padding lanes wrote): the
        buffer it reads directly turns the result into NaN or sentinels, the others move it less (H200)."""
        clean = self._replay(batch, live, step, set())
        read = []
        for buf in Buffer:
            if buf in self.poisoner.skipped:
                continue
            got = self._replay(batch, live, step, {buf})
            if isinstance(got, str) or isinstance(clean, str):
                read.append((float("inf"), str(buf)))
            elif (change := _change(got[:2], clean[:2])) > self.tols[0]:
                read.append((change, str(buf)))
        self.poisoner.clean(self.ex.prepare(batch), live)
        return [b for _, b in sorted(read, key=lambda r: -r[0])]

    def _localize(self, entry, batch, live, step, reason, seen, stale) -> Mismatch:
        """seen: what the checked replay left (gmtool.measure.check.ReplayRead)."""
        ex, taps = self.ex, self.taps
        eager_only = not_reproduced = False
        read = self._buffers_read(batch, live, step)
        got = self._replay(batch, live, step, None)  # the check's conditions
        first = None
        if not isinstance(got, str):
            try:
                with taps.into_eager():
                    fn, _ = self.bench.eager_fn(batch)
                    with torch.no_grad():
                        fn()
                    unpadded = taps.eager_buf[:, : batch.num_tokens].clone()
                    ex.eager_same_shape(batch)
                    same = taps.eager_buf[:, : batch.num_tokens].clone()
            except (RuntimeError, IndexError):  # the same-shape pass reads the same wrong inputs: compare unpadded
                same = unpadded.clone()
            div = taps.first_divergence(got[2], same, unpadded, batch.token_seq, self.tols, entry.mode.piecewise)
            first = div.to_dict() if div else None
            not_reproduced = div is None and _change(got[:2], (seen.out, seen.kv)) > self.tols[0]
            # right when the batch's own eager pass ran just before (as it has now), wrong after another batch's
            alone = self._replay(batch, live, step, None, decoy=False) if div and self._decoy else None
            if alone is not None and not isinstance(alone, str):
                tols, pw = self.tols, entry.mode.piecewise
                eager_only = taps.first_divergence(alone[2], same, unpadded, batch.token_seq, tols, pw) is None
        self.poisoner.clean(ex.prepare(batch), live)
        suspects = list(seen.input_faults)
        if isinstance(entry, EagerStep):
            suspects.append(
                "no graph ran this step (auto runs steps above the largest bucket eagerly): what the step prepares "
                "for its forward, its attention plan or lengths, is not this batch's (kept from another batch?)"
            )
        if not_reproduced:
            suspects.append(
                "did not reproduce: re-run under the checked step's conditions (its poisoning, its decoy), the "
                "replay matched eager; what the checked replay saw came from earlier steps (state they left that "
                "neither the decoy nor the load overwrote) or from a race"
            )
        if eager_only:
            suspects.append(
                "state only an eager pass refreshes: the replay is right just after this batch's own eager pass "
                "and wrong after another batch's (a plan or lengths kept outside the graph's inputs)"
            )
        handed = ex.output(entry, batch)
        if handed.untyped_storage().data_ptr() != ex.inputs.logits.untyped_storage().data_ptr():
            suspects.append(
                "output: the step's logits are handed out from graph memory, not the persistent output buffer; "
                "the pool counts it free, so other buckets' graphs overwrite it"
            )
        suspects += [f"{b}: the result changes when it alone is poisoned" for b in read]
        if stale:
            suspects.append(f"the attention plan frozen at capture (captured with {entry.captured_with})")
        if seen.context_changed:
            suspects.append(f"K/V slots live requests hold: {seen.context_changed} overwritten by this replay")
        if seen.stray_blocks:
            suspects.append(f"K/V blocks outside this step's new tokens: {seen.stray_blocks} written by this replay")
        if not suspects:
            # a full bucket has no padding lane to poison: a graph reading another token's row then shows nothing
            full = batch.num_tokens == entry.key.num_tokens > 1
            suspects.append(
                "no buffer identified: the device inputs hold this batch and no poisoned buffer changes "
                "the result, so the graph computes from something else (a value frozen at capture?"
                + (" This step fills its bucket, so no padding lane was poisoned: a row read from another token's "
                   "is as likely)" if full else ")")
            )  # fmt: skip
        return Mismatch(
            step,
            str(entry.key),
            batch.composition.label,
            entry.captured_with,
            reason,
            seen.input_faults,
            seen.context_changed,
            read,
            first,
            suspects,
        )


def _change(a: tuple, b: tuple) -> float:
    """How far a (logits, K/V written) moved from b: the largest relative error per sequence, inf where NaN
    appears or vanishes."""
    worst = 0.0
    for x, y in zip(a, b):
        nan_x, nan_y = torch.isnan(x), torch.isnan(y)
        if not torch.equal(nan_x, nan_y):
            return float("inf")
        err = rel_err_per_seq(torch.where(nan_x, 0, x), torch.where(nan_y, 0, y))
        worst = max(worst, float("inf") if err != err else err)
    return worst
