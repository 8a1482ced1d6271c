"""The sweep configuration: what the user asked for, with derived fields filled in __post_init__."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum

import torch

from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS, BucketPolicy, parse_buckets
from gmtool.core.compositions import Composition, assign_buckets, default_compositions, parse_compositions
from gmtool.core.kv_cache import blocks_needed
from gmtool.errors import GmtoolError
from gmtool.model.loading import parse_dtype, resolve_device
from gmtool.modes import SWEEP_MODES, GraphMode


class Scenario(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"


class PiecewiseImpl(StrEnum):
    BREAKABLE = "breakable"  # end capture at each attention call
    FX = "fx"  # torch.compile's FX graph split at the attention op


class AttentionChoice(StrEnum):
    AUTO = "auto"  # Triton on CUDA when it can run, else the torch reference
    TORCH = "torch"
    TRITON = "triton"


SCENARIOS = tuple(Scenario)
PIECEWISE_IMPLS = tuple(PiecewiseImpl)
CPU_DEFAULT_MODEL = "tiny-qwen3"
GPU_DEFAULT_MODEL = "qwen3-0.6b"
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_KV_CACHE_GB = 1_000_000  # far past any device; above it the bytes overflow the sizing arithmetic
# timed or warm-up replays per row, and verify's steps: far past any useful run (a row of 1 ms replays would take
# 28 hours); a larger count is a typo that would otherwise run silently for days
MAX_ITERS = 100_000
CPU_DEFAULT_BUCKETS = {"decode": [1, 2, 4, 8], "prefill": [16, 32, 64]}  # the CPU backend emulates: a small sweep


def kv_len(p) -> int:
    """The context a part's sequences reach: its prefix (a decode without one gets a random prefix of at least
    one cached token, gmtool.core.batch) plus its new tokens."""
    prefix = p.prefix if p.prefix is not None else (1 if p.new_tokens == 1 else 0)
    return prefix + p.new_tokens


@dataclass
class SweepConfig:
    """Every sweep option's default is written here and only here: the commands' options default to None (not
    given), a sweep profile fills what the command line left out, and these defaults fill the rest."""

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    scenario: str = "decode"
    buckets: str | None = None
    compositions: str | None = None
    modes: tuple[str, ...] = ("eager", "full")
    piecewise_impl: str = "breakable"
    compile: bool = False  # Inductor-compile the non-attention parts before capture
    fuse: bool = False  # gmtool.model.fused: fewer kernels per decoder layer
    small_m_gemm: bool = False  # with fuse: decode projections on gmtool.kernels.small_m instead of cuBLAS
    pdl: bool = False  # with small_m_gemm: Programmatic Dependent Launch for the fused layers (gmtool.kernels.pdl)
    attention: str = "auto"  # attention kernels: auto (triton on CUDA when available) | torch | triton
    max_kv_len: int | None = None
    max_tokens: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    kv_cache_gb: float | None = None
    num_iters: int = 20
    num_iters_warmup: int = 3
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks, each with 1/tp of the heads and MLP width (gmtool.parallel)
    # derived
    torch_device: torch.device = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False, repr=False)
    attention_backend: str = field(init=False)  # torch | triton: what --attention resolved to
    bucket_sizes: list[int] = field(init=False)
    compositions_by_bucket: dict[int, list[Composition]] = field(init=False, repr=False)
    # auto's eager sizes: mixes above the largest bucket, each its own row group (no graph; auto runs them eagerly)
    eager_sizes: list[int] = field(init=False, default_factory=list)
    notes: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise GmtoolError(f"unknown scenario {self.scenario!r}: choose from {', '.join(SCENARIOS)}")
        bad = [m for m in self.modes if m not in SWEEP_MODES]
        if bad or not self.modes:
            raise GmtoolError(f"unknown mode {bad[0] if bad else '(none)'!r}: choose from {', '.join(SWEEP_MODES)}")
        self.modes = tuple(GraphMode(m) for m in self.modes)
        if GraphMode.EAGER not in self.modes:  # a list or a profile without it: the speedup columns stay empty
            note = "eager is not among the modes: the graph modes get no speedup"
            if note not in self.notes:  # a config copied with dataclasses.replace runs this again
                self.notes.append(note)
        if self.piecewise_impl not in PIECEWISE_IMPLS:
            raise GmtoolError(f"unknown --piecewise-impl {self.piecewise_impl!r}: use breakable or fx")
        pieces = [m for m in self.modes if m.has_pieces]
        if self.piecewise_impl != PiecewiseImpl.BREAKABLE and not pieces:  # it would shape nothing of this run
            raise GmtoolError(
                f"--piecewise-impl {self.piecewise_impl} splits piecewise graphs, and this run has none (modes "
                f"{', '.join(self.modes)}): add the piecewise or auto mode, or leave --piecewise-impl out"
            )
        for name in ("num_iters", "block_size", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise GmtoolError(f"--{name.replace('_', '-')} must be positive")
        if self.tp < 1:
            raise GmtoolError(f"--tp must be 1 or more, got {self.tp}")
        if self.num_iters_warmup < 0:
            raise GmtoolError("--num-iters-warmup must be 0 or more")
        for name in ("num_iters", "num_iters_warmup"):
            if getattr(self, name) > MAX_ITERS:
                raise GmtoolError(
                    f"--{name.replace('_', '-')} must be at most {MAX_ITERS:,}, got {getattr(self, name):,}"
                )
        if self.kv_cache_gb is not None and not 0 < self.kv_cache_gb <= MAX_KV_CACHE_GB:
            raise GmtoolError(
                f"--kv-cache-gb must be positive and at most {MAX_KV_CACHE_GB:,} (GiB), got {self.kv_cache_gb}"
            )
        if not SEED_MIN <= self.seed <= SEED_MAX:  # torch's generators take no other seed
            raise GmtoolError(f"--seed must be between {SEED_MIN} and {SEED_MAX}, got {self.seed}")
        if self.compositions is not None and not str(self.compositions).strip():
            raise GmtoolError("empty composition list: give mixes like '1*8,4+4', or leave --compositions out")
        self.torch_device = resolve_device(self.device)
        cuda = self.torch_device.type == "cuda"
        if self.compile and not cuda:
            # Inductor's CPU code runs its own C++ loops, not the ATen ops the tape records: nothing to capture
            raise GmtoolError("--compile needs CUDA: the CPU tape backend cannot capture Inductor's CPU kernels")
        if self.small_m_gemm and not self.fuse:
            raise GmtoolError("small_m_gemm runs the fused layers' projections: it needs fuse (--fuse) as well")
        if self.pdl and not self.small_m_gemm:
            raise GmtoolError(
                "pdl overlaps the small-M GEMM's weight reads: it needs small_m_gemm (--small-m-gemm) too"
            )
        if self.model is None:
            self.model = GPU_DEFAULT_MODEL if cuda else CPU_DEFAULT_MODEL
            if not cuda:
                self.notes.append(
                    "no CUDA here: CPU tape backend and the tiny-qwen3 profile (timings are not GPU figures)"
                )
        self.torch_dtype = parse_dtype(self.dtype if self.dtype is not None else ("bf16" if cuda else "fp32"))
        from gmtool import kernels

        if self.attention == "auto":
            self.attention_backend = "triton" if cuda and kernels.available() else "torch"
        elif self.attention in kernels.BACKENDS:
            kernels.attention_backend(self.attention)  # a clear error when triton cannot run here
            self.attention_backend = self.attention
        else:
            raise GmtoolError(f"unknown --attention {self.attention!r}: use auto, torch or triton")
        default = DEFAULT_DECODE_BUCKETS if self.scenario == "decode" else DEFAULT_PREFILL_BUCKETS
        if self.buckets is not None:
            self.bucket_sizes = parse_buckets(self.buckets)
        elif cuda:
            self.bucket_sizes = default
        else:
            self.bucket_sizes = list(CPU_DEFAULT_BUCKETS["decode" if self.scenario == "decode" else "prefill"])
        if self.max_tokens is not None:  # BucketPolicy would refuse it too, without naming the option
            if self.max_tokens <= 0:
                raise GmtoolError(f"--max-tokens must be positive, got {self.max_tokens}")
            above = [b for b in self.bucket_sizes if b > self.max_tokens]
            if self.buckets is None and above:  # defaults the user never chose: those a step can reach
                if len(above) == len(self.bucket_sizes):
                    raise GmtoolError(
                        f"--max-tokens {self.max_tokens} is below every default {self.scenario} bucket (the smallest "
                        f"is {self.bucket_sizes[0]}): give --buckets up to {self.max_tokens}"
                    )
                self.bucket_sizes = [b for b in self.bucket_sizes if b <= self.max_tokens]
                note = f"default buckets above --max-tokens {self.max_tokens} left out: {', '.join(map(str, above))}"
                if note not in self.notes:  # a config copied with dataclasses.replace runs this again
                    self.notes.append(note)
            if self.max_tokens < self.bucket_sizes[-1]:
                raise GmtoolError(
                    f"--max-tokens {self.max_tokens} is below bucket {self.bucket_sizes[-1]}: the buffers sized by "
                    "it must hold the largest bucket; raise --max-tokens or lower --buckets"
                )
        policy = self.policy()
        comps = parse_compositions(self.compositions) if self.compositions else []
        crowded = next((c for c in comps if c.num_seqs > self.max_num_seqs), None)
        if crowded is not None:
            raise GmtoolError(
                f"composition {crowded.label} has {crowded.num_seqs} sequences, above --max-num-seqs "
                f"{self.max_num_seqs}"
            )
        over = [c for c in comps if c.bucket is None and c.num_tokens > policy.largest]
        if over:
            self._eager_above(over, policy)
        graphed = [c for c in comps if c not in over]  # the mixes graphs serve: auto runs the others eagerly
        self.compositions_by_bucket = {b: [] for b in policy.sizes}
        for b, cs in assign_buckets(graphed, policy).items():
            self.compositions_by_bucket[b].extend(cs)
        below, defaulted = 0, []
        for b in sorted(self.compositions_by_bucket):
            if not self.compositions_by_bucket[b]:
                self.compositions_by_bucket[b].extend(
                    default_compositions(b, self.scenario, below, self.max_num_seqs, self.max_kv_len)
                )
                defaulted.append(b)
            below = b
        if comps and defaulted:  # the user's mixes all went elsewhere: say why these buckets ran others
            note = (
                f"no --compositions mix runs on bucket{'s' if len(defaulted) > 1 else ''} "
                f"{', '.join(map(str, defaulted))} (each mix runs on the smallest bucket that holds it, or the one "
                f"B= pins): {'they' if len(defaulted) > 1 else 'it'} replayed the default mixes"
            )
            if note not in self.notes:  # a config copied with dataclasses.replace runs this again
                self.notes.append(note)
        for c in over:  # after the buckets' defaults: each size is its own group, above them all
            self.compositions_by_bucket.setdefault(c.num_tokens, []).append(c)
        self.eager_sizes = sorted({c.num_tokens for c in over})
        if self.buckets is not None and graphed and not defaulted:
            self._scenario_of(graphed)
        every = [c for b, cs in self.compositions_by_bucket.items() if b not in self.eager_sizes for c in cs]
        only_auto = GraphMode.PIECEWISE not in self.modes  # pieces: auto's; it serves decode with full graphs
        if self.piecewise_impl != PiecewiseImpl.BREAKABLE and only_auto and all(c.is_decode for c in every):
            raise GmtoolError(
                f"--piecewise-impl {self.piecewise_impl} splits piecewise graphs, and auto serves every batch of "
                "this run with full graphs (all are decode steps): give prefill or mixed compositions "
                "(--scenario prefill), or leave --piecewise-impl out"
            )
        longest = max(kv_len(p) for cs in self.compositions_by_bucket.values() for c in cs for p in c.parts)
        if self.max_kv_len is None:
            self.max_kv_len = max(1024 if cuda else 128, longest)
        if self.max_kv_len <= 0:
            raise GmtoolError("--max-kv-len must be positive")
        if longest > self.max_kv_len:
            b, c = next(
                (b, c)
                for b, cs in self.compositions_by_bucket.items()
                for c in cs
                if any(kv_len(p) == longest for p in c.parts)
            )
            bare = any(p.prefix is None and p.new_tokens == 1 for p in c.parts)
            given = any(c is g for g in comps)
            raise GmtoolError(
                (f"composition {c.label}" if given else f"bucket {b}'s default {self.scenario} mix {c.label}")
                + f": prefix + new tokens = {longest} exceeds --max-kv-len {self.max_kv_len}"
                + (" (a decode reads at least one cached token)" if bare and longest == 2 else "")
                + ("" if given else f": raise --max-kv-len to {longest} or give --compositions")
            )

    def _eager_above(self, over: list[Composition], policy: BucketPolicy) -> None:
        """Mixes above the largest bucket: auto runs them eagerly on their exact shape (as engines do), within the
        buffers --max-tokens sizes; no other mode has anything to run for them."""
        c = over[0]
        if GraphMode.AUTO not in self.modes:
            raise GmtoolError(
                f"composition {c.label}: a batch of {c.num_tokens} tokens fits no bucket (largest is "
                f"{policy.largest}): add a bucket (capture and compare also take it with mode auto and --max-tokens: auto "
                "serves it eagerly)"
            )
        big = max(over, key=lambda c: c.num_tokens)
        if big.num_tokens > policy.max_tokens:
            raise GmtoolError(
                f"composition {big.label}: {big.num_tokens} tokens, above the largest bucket {policy.largest}, "
                f"which auto runs eagerly in the input buffers --max-tokens sizes ({policy.max_tokens}): raise "
                f"--max-tokens to {big.num_tokens} or more"
                # a bucket is memreport's way out (it measures graphs): without --max-tokens, it raises the buffers too
                + (f", or add a bucket of {big.num_tokens} or more" if self.max_tokens is None else "")
            )
        others = [str(m) for m in self.modes if m.captures and m != GraphMode.AUTO]
        note = (
            f"{'the mixes' if len(over) > 1 else 'the mix'} {', '.join(dict.fromkeys(c.label for c in over))} "
            f"{'are' if len(over) > 1 else 'is'} above the largest bucket "
            f"({policy.largest}): auto runs {'them' if len(over) > 1 else 'it'} eagerly (served_by eager)"
            + (
                f"; no {', '.join(others)} graph serves {'them' if len(over) > 1 else 'it'} (skipped rows)"
                if others
                else ""
            )
        )
        if note not in self.notes:
            self.notes.append(note)

    def _scenario_of(self, comps: list[Composition]) -> None:
        """--scenario chooses the default buckets and mixes; where the user gave both, it chose nothing, and the
        run records the scenario its mixes make (a report's baseline and plan read it): decode steps only, or
        not."""
        decode = all(c.is_decode for c in comps)
        if decode == (self.scenario == Scenario.DECODE):
            return
        given = self.scenario
        if decode:
            self.scenario = Scenario.DECODE
        else:
            mixed = any(len({p.new_tokens == 1 for p in c.parts}) == 2 for c in comps)
            self.scenario = Scenario.MIXED if mixed else Scenario.PREFILL
        note = (
            f"scenario {self.scenario}, as the --compositions are (--scenario {given} chooses default buckets "
            "and mixes, and every bucket ran the given ones)"
        )
        if note not in self.notes:  # a config copied with dataclasses.replace runs this again
            self.notes.append(note)

    def check_decode_seqs(self) -> None:
        """A decode graph has one sequence per token: a decode batch on a bucket above --max-num-seqs has no
        sequence slots for the graph's tokens (its capture fails, or its replays are wrong). The sweeps check
        their compositions here (build_config); verify's soak, which makes its own batches, checks the bucket a
        step of --max-num-seqs decodes lands on (VerifyConfig)."""
        for b, cs in sorted(self.compositions_by_bucket.items()):
            c = next((c for c in cs if c.is_decode), None)
            if b > self.max_num_seqs and c is not None:
                raise GmtoolError(
                    f"decode composition {c.label} runs on bucket {b}, above --max-num-seqs {self.max_num_seqs} "
                    "(a decode graph holds one sequence per token): raise --max-num-seqs or lower --buckets"
                )

    def policy(self, wide_key: bool = False) -> BucketPolicy:
        return BucketPolicy(self.bucket_sizes, self.max_tokens, wide_key)

    @property
    def most_seqs(self) -> int:
        """The most sequences one batch of the config holds: the KV cache is sized for them."""
        return max(c.num_seqs for cs in self.compositions_by_bucket.values() for c in cs)

    @property
    def kv_blocks_needed(self) -> int:
        """The KV blocks the run's cache is sized for, the null block included (gmtool.core.kv_cache)."""
        most_tokens = max(c.num_tokens for cs in self.compositions_by_bucket.values() for c in cs)
        per_seq = -(-self.max_kv_len // self.block_size)
        return blocks_needed(self.most_seqs, per_seq, most_tokens, self.block_size)

    @property
    def largest_graph_bucket(self) -> int:
        """The largest bucket graphs serve (auto's eager sizes lie above it)."""
        return max(b for b in self.compositions_by_bucket if b not in self.eager_sizes)

    @property
    def graph_modes(self) -> list[GraphMode]:
        return [m for m in self.modes if m.captures]

    def to_dict(self) -> dict:
        d = {
            k: v for k, v in asdict(self).items() if k not in ("compositions_by_bucket", "torch_device", "torch_dtype")
        }
        d["device"] = str(self.torch_device)
        d["dtype"] = str(self.torch_dtype).replace("torch.", "")
        d["compositions_by_bucket"] = {str(b): [c.label for c in cs] for b, cs in self.compositions_by_bucket.items()}
        return d


SWEEP_OPTIONS = tuple(f.name for f in fields(SweepConfig) if f.init)  # what a sweep profile may set
PROFILE_EXTRA_KEYS = ("description",)  # read by people, not by the sweep


def option_default(name: str):
    """SweepConfig's default for one option (what --help shows)."""
    return SweepConfig.__dataclass_fields__[name].default


def _json_types(hint) -> list[tuple[type, str]]:
    """The JSON values a field of this type takes from a profile: (Python type, how to say it)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for h in typing.get_args(hint) for t in _json_types(h)]
    if typing.get_origin(hint) is tuple:
        return [(list, "a list of strings")]
    return [
        (
            hint,
            {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
                hint, getattr(hint, "__name__", str(hint))
            ),
        )
    ]


def _fits(value, typ: type) -> bool:
    if typ is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if isinstance(value, bool):  # JSON true/false is not a number here
        return typ is bool
    if typ is float:
        return isinstance(value, (int, float))
    return isinstance(value, typ)


def check_profile(prof, source: str) -> dict:
    """A sweep profile's settings as SweepConfig keyword arguments; an unknown key or a value of the wrong type
    is refused, naming it."""
    if not isinstance(prof, dict):
        raise GmtoolError(f"sweep profile {source} must be a JSON object of option: value")
    hints = typing.get_type_hints(SweepConfig)
    out = {}
    for key, value in prof.items():
        if key in PROFILE_EXTRA_KEYS:
            continue
        if key not in SWEEP_OPTIONS:
            raise GmtoolError(
                f"sweep profile {source}: unknown key {key!r} (known: {', '.join(PROFILE_EXTRA_KEYS + SWEEP_OPTIONS)})"
            )
        allowed = _json_types(hints[key])
        if not any(_fits(value, t) for t, _ in allowed):
            raise GmtoolError(
                f"sweep profile {source}: {key} must be {' or '.join(w for _, w in allowed)}, got {json.dumps(value)}"
            )
        out[key] = tuple(value) if isinstance(value, list) else value
    return out
