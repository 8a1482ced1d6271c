"""gmtool verify, from its options to its document: capturability, dynamic dimensions, then a soak per mode and
memory strategy. No terminal here (gmtool.cli.verify prints)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from gmtool.config import MAX_ITERS, PIECEWISE_IMPLS, PiecewiseImpl, SweepConfig
from gmtool.core.compositions import parse_composition
from gmtool.errors import GmtoolError
from gmtool.modes import CAPTURE_MODES, GraphMode
from gmtool.verify.faults import Fault, parse_fault
from gmtool.listopt import comma_items

# the CPU tape emulates: a small engine; on CUDA, the engines' scale
CPU_DEFAULTS = dict(buckets="1,2,4,8,16", max_num_seqs=4, max_kv_len=48, block_size=8)
GPU_DEFAULTS = dict(buckets="1,2,4,8,16,32,64,128,256", max_num_seqs=32, max_kv_len=512, block_size=16)
DEFAULT_STRATEGY = "default"  # the executor's own single graph pool


@dataclass
class VerifyConfig:
    model: str | None = None
    modes: str = "full,piecewise"
    steps: int = 200
    check_every: int = 10
    strategy: str = DEFAULT_STRATEGY
    seed: int = 0
    inject: str | None = None
    device: str = "auto"
    dtype: str | None = None
    buckets: str | None = None
    max_num_seqs: int | None = None
    max_kv_len: int | None = None
    block_size: int | None = None
    max_tokens: int | None = None  # auto's token budget per step: above the largest bucket it runs eagerly
    attention: str = "auto"
    piecewise_impl: str = "breakable"  # how piecewise graphs split: at run time, or by the compiler (fx)
    # derived
    graph_modes: tuple[GraphMode, ...] = field(init=False)
    strategies: tuple[str, ...] = field(init=False)
    sweep: SweepConfig = field(init=False, repr=False)
    fault: Fault | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        names = comma_items(self.modes, "--modes")
        bad = [m for m in names if m not in CAPTURE_MODES]
        if bad or not names:
            raise GmtoolError(
                f"--modes: {bad[0] if bad else '(none)'!r} is not a graph mode: choose from {', '.join(CAPTURE_MODES)}"
            )
        self.graph_modes = tuple(dict.fromkeys(GraphMode(m) for m in names))
        if self.steps <= 0 or self.check_every <= 0:
            raise GmtoolError("--steps and --check-every must be positive")
        if self.steps > MAX_ITERS:
            raise GmtoolError(f"--steps must be at most {MAX_ITERS:,}, got {self.steps:,}")
        if self.check_every > self.steps:  # the soak would check no step and still report clean
            raise GmtoolError(
                f"--check-every {self.check_every} is above --steps {self.steps}: no step would be checked"
            )
        from gmtool.memory.strategies import STRATEGIES

        self.strategies = tuple(dict.fromkeys(comma_items(self.strategy, "--strategy")))
        unknown = [s for s in self.strategies if s not in (DEFAULT_STRATEGY, *STRATEGIES)]
        if unknown or not self.strategies:
            raise GmtoolError(
                f"--strategy: unknown {unknown[0] if unknown else '(none)'!r}: choose from "
                f"{', '.join((DEFAULT_STRATEGY, *STRATEGIES))}"
            )
        opts = dict(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            scenario="decode",
            modes=("eager", *self.graph_modes),
            seed=self.seed,
            attention=self.attention,
        )
        probe = SweepConfig(**opts, buckets="1")  # resolves the device before the defaults that depend on it
        cuda = probe.torch_device.type == "cuda"
        if not cuda and any(s != DEFAULT_STRATEGY for s in self.strategies):
            raise GmtoolError(
                "--strategy: memory strategies choose CUDA graph pools; on the CPU backend only "
                f"{DEFAULT_STRATEGY!r} runs"
            )
        dflt = GPU_DEFAULTS if cuda else CPU_DEFAULTS
        for name in ("max_num_seqs", "max_kv_len", "block_size"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, dflt[name])
            elif value <= 0:
                raise GmtoolError(f"--{name.replace('_', '-')} must be positive")
        if self.max_num_seqs < 2:  # its capturability probe and prefill pair run two sequences a step
            raise GmtoolError(f"--max-num-seqs {self.max_num_seqs}: verify needs 2 or more (it checks mixed steps)")
        if self.buckets is None:  # given empty, it is refused below as capture refuses it
            self.buckets = dflt["buckets"]
        self.sweep = SweepConfig(
            **opts,
            buckets=self.buckets,
            max_num_seqs=self.max_num_seqs,
            max_kv_len=self.max_kv_len,
            block_size=self.block_size,
            max_tokens=self.max_tokens,
        )
        self.model = self.sweep.model
        if self.piecewise_impl not in PIECEWISE_IMPLS:
            raise GmtoolError(f"unknown --piecewise-impl {self.piecewise_impl!r}: use breakable or fx")
        if self.piecewise_impl != PiecewiseImpl.BREAKABLE:
            if not any(m.has_pieces for m in self.graph_modes):
                raise GmtoolError(
                    f"--piecewise-impl {self.piecewise_impl} splits piecewise graphs, and --modes "
                    f"{','.join(self.graph_modes)} has none: add piecewise or auto, or leave --piecewise-impl out"
                )
            # set after the sweep's checks: they see decode compositions only, where auto would run no piece,
            # but the soak's mixed and prefill steps are auto's piecewise work
            self.sweep.piecewise_impl = PiecewiseImpl(self.piecewise_impl)
        largest = self.sweep.bucket_sizes[-1]
        if self.max_tokens is not None and self.max_tokens > largest and GraphMode.AUTO not in self.graph_modes:
            raise GmtoolError(
                f"--max-tokens {self.max_tokens} is above the largest bucket {largest}: only auto serves steps above "
                "it (eagerly); the other modes' soaks schedule up to the largest bucket: add auto to --modes"
            )
        above = [b for b in self.sweep.bucket_sizes if b >= self.max_num_seqs]
        if above and above[0] != self.max_num_seqs:  # see SweepConfig.check_decode_seqs
            raise GmtoolError(
                f"a step of --max-num-seqs {self.max_num_seqs} decodes would run on bucket {above[0]} (a decode "
                f"graph holds one sequence per token): add {self.max_num_seqs} to --buckets or raise --max-num-seqs"
            )
        self.fault = parse_fault(self.inject)  # the layer is checked once the model is loaded
        if self.fault is not None and self.fault.name == "share-output-across-buckets":
            # any piecewise mode, before the probes: refused when its soak started, the full soak's finding was lost
            if any(GraphMode(m) == GraphMode.PIECEWISE for m in self.graph_modes):
                raise GmtoolError(
                    "--inject share-output-across-buckets: it is modeled on full graphs (piecewise ends with the LM "
                    "head's own write into the persistent logits); give --modes without piecewise: full, full-narrow "
                    "or auto"
                )

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("sweep", "fault")}
        d.update(
            modes=list(map(str, self.graph_modes)),
            strategies=list(self.strategies),
            device=str(self.sweep.torch_device),
            dtype=str(self.sweep.torch_dtype).replace("torch.", ""),
            inject=str(self.fault) if self.fault else None,
        )
        return d

    def repro(self, mode: str, strategy: str, steps: int) -> str:
        """The command that re-runs one soak up to a step (the workload depends on the seed alone). A step found
        between checks (a wrong input caught in the staging arena) may come before the first check: the command
        then checks its last step, as a --check-every above --steps is refused."""
        parts = [
            "gmtool verify",
            f"--model {self.model}",
            f"--modes {mode}",
            f"--strategy {strategy}",
            f"--seed {self.seed}",
            f"--steps {steps}",
            f"--check-every {min(self.check_every, steps)}",
            f"--device {self.sweep.torch_device.type}",
            f"--dtype {self.to_dict()['dtype']}",
            f"--buckets {self.buckets}",
            f"--max-num-seqs {self.max_num_seqs}",
            f"--max-kv-len {self.max_kv_len}",
            f"--block-size {self.block_size}",
        ]
        if self.max_tokens is not None:
            parts.append(f"--max-tokens {self.max_tokens}")
        if self.attention != "auto":  # on CUDA auto is Triton: a finding under torch's would not reproduce
            parts.append(f"--attention {self.attention}")
        if self.piecewise_impl != PiecewiseImpl.BREAKABLE and GraphMode(mode).has_pieces:
            parts.append(f"--piecewise-impl {self.piecewise_impl}")
        if self.fault:
            parts.append(f"--inject {self.fault}")
        return " ".join(parts)


def build_bench(cfg: VerifyConfig):
    from gmtool.measure.workbench import Workbench

    per_seq = -(-cfg.max_kv_len // cfg.block_size)
    # fewer blocks than every sequence at full length: requests wait for blocks and get freed ones; but the
    # dynamic-dimension decode pair (dyn_dim_batches: up to --max-num-seqs sequences of up to 3 blocks) is
    # made whole, which the 3/4 alone does not hold when a sequence has under 4 blocks (a large --block-size)
    blocks = max(per_seq + 1, cfg.max_num_seqs * per_seq * 3 // 4, cfg.max_num_seqs * min(3, per_seq)) + 1
    bench = Workbench.build(cfg.sweep, num_blocks=blocks)
    cfg.fault = parse_fault(cfg.inject, bench.lm.num_layers)
    return bench


def dyn_dim_batches(bench, cfg: VerifyConfig):
    """Two compositions per kind that share a bucket key: (kind, batch a, batch b). b holds one sequence (decode)
    or one token (prefill) fewer where the bucket still serves it: a count frozen at capture shows too."""
    bs, sizes = cfg.block_size, cfg.sweep.bucket_sizes
    k = max([s for s in sizes if s <= cfg.max_num_seqs] or [1])
    p1, p2 = min(bs + 1, cfg.max_kv_len - 1), min(3 * bs - 1, cfg.max_kv_len - 1)

    def fewer(n: int) -> int:  # n - 1 where the bucket of n serves it, else n
        return n - 1 if n - 1 > max([s for s in sizes if s < n] or [0]) else n

    # b at the longest context where the cache holds it whole: past a sliding window, a start block frozen at
    # capture shows too
    if fewer(k) * -(-cfg.max_kv_len // bs) <= bench.cache.num_blocks - 1:
        p2 = cfg.max_kv_len - 1
    out = [("decode", f"1*{k}@{p1}", f"1*{fewer(k)}@{p2}")]
    t = max([s for s in sizes if s <= cfg.max_kv_len] or [0])  # no bucket within the context: no prefill pair
    if t >= 4:  # b's first chunk after a cached block where the context allows: a frozen "fresh prefill" shows
        cached = f"@{bs}" if bs + t // 4 <= cfg.max_kv_len else ""
        out.append(("prefill", f"{t // 2}+{t - t // 2}", f"{t // 4}{cached}+{fewer(t) - t // 4}"))
    return [(kind, bench.batch(parse_composition(a, 1)), bench.batch(parse_composition(b, 2))) for kind, a, b in out]


def dyn_dim_work(bench, cfg: VerifyConfig, modes=None):
    """(mode, kind, batch a, batch b) per mode (default: the soak's) and kind. A composite mode's batches are
    captured by its parts (auto: full's decode graphs, piecewise's prefill ones), so its parts are analysed,
    once each."""
    done = set()
    for mode in map(GraphMode, modes or cfg.graph_modes):
        for kind, a, b in dyn_dim_batches(bench, cfg):
            part = mode.composed_of.get("decode" if kind == "decode" else "mixed", mode)
            if (part, kind) not in done:
                done.add((part, kind))
                yield part, kind, a, b


def run_verify(cfg: VerifyConfig, say=lambda text: None) -> dict:
    """Everything verify does; say(text) is told what starts. Returns the document (gmtool.verify.report)."""
    from gmtool.measure.sweep import machine_info
    from gmtool.memory.strategies import make_strategy
    from gmtool.verify.capturable import model_hazards
    from gmtool.verify.dyndims import dynamic_dims
    from gmtool.verify.report import finish_document
    from gmtool.verify.soak import Soak, SoakOptions
    from gmtool.verify.taps import LayerTaps

    t0 = time.perf_counter()
    bench = build_bench(cfg)
    doc = {
        "command": "verify",
        "config": cfg.to_dict(),
        "machine": machine_info(bench.device),
        "model": bench.model_info(),
        "capturability": [],
        "dynamic_dims": [],
        "runs": [],
        "notes": list(bench.lm.notes),  # how the model was loaded (random weights, its attention's features, ...)
    }
    say("capturability check")
    hazards = model_hazards(bench, ("1*2", "3+2"))
    doc["capturability"] = [f.to_dict() | {"breaks_capture": f.hazard.breaks_capture, "text": str(f)} for f in hazards]
    if any(f.hazard.breaks_capture for f in hazards):
        doc["notes"].append("the soak did not run: the model's forward cannot be captured")
        return finish_document(doc, cfg, time.perf_counter() - t0)
    taps = LayerTaps(bench.lm, bench.cfg.policy().max_tokens, bench.device)  # auto's eager steps run up to it
    try:
        for mode, kind, a, b in dyn_dim_work(bench, cfg):
            say(f"dynamic dimensions: {mode} {kind}")
            res = dynamic_dims(bench, mode, a, b)
            doc["dynamic_dims"].append(res.to_dict() | {"kind": kind, "expected_unsafe": mode.expected_unsafe})
        if not any(kind == "prefill" for kind, _, _ in dyn_dim_batches(bench, cfg)):
            doc["notes"].append(
                "dynamic dimensions: no prefill pair analysed (it needs a bucket of at least 4 tokens within "
                "--max-kv-len): only decode graphs were checked for baked-in values"
            )
        opts = SoakOptions(cfg.steps, cfg.check_every, cfg.seed, cfg.fault)
        for mode in cfg.graph_modes:
            for strategy in cfg.strategies:
                say(f"soak: {mode} under {strategy}")
                memory = None if strategy == "default" else make_strategy(strategy, bench.device)
                res = Soak(bench, taps, mode, memory, strategy, opts).run()
                if res.mismatch is not None:
                    res.mismatch.repro = cfg.repro(str(mode), strategy, res.mismatch.step + 1)
                doc["runs"].append(res.to_dict())
    except KeyboardInterrupt:  # what was measured is written: the finished soaks and analyses
        planned = len(cfg.graph_modes) * len(cfg.strategies)
        doc["partial"] = {"reason": "interrupted", "measured": len(doc["runs"]), "planned": planned, "unit": "soaks"}
        doc["notes"].append(
            f"interrupted after {len(doc['runs'])} of {planned} soaks: the soak under way is not in the runs"
        )
    finally:
        taps.remove()
    return finish_document(doc, cfg, time.perf_counter() - t0)
