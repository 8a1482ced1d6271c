"""memreport.json typed: one row per memory strategy, the document they make, and the exit code it earns.
gmtool.memory.report measures and derives the rows; this says what they hold."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from gmtool.modes import GraphMode
from gmtool.records import SCHEMA_VERSION, Partial, Status, now_utc, from_plain
from gmtool import json_text

UNAVAILABLE = "unavailable"  # a strategy this machine cannot run (no VMM support, say): not a failure
FAILED = (Status.ERROR, Status.OOM, Status.UNSAFE)  # a strategy row with one of these fails the run


def _detail(factory=list):
    """A field memreport.json keeps and memreport.csv leaves out (lists per shape and per replay)."""
    return field(default_factory=factory, metadata={"csv": False})


@dataclass(kw_only=True)
class StrategyRow:
    strategy: str
    status: str  # a Status value, or UNAVAILABLE
    order: str = "descending"  # the order buckets were captured in
    mode: GraphMode | None = None
    captures: int | None = None
    graph_pool_bytes: int | None = None  # what the allocator's graph pools hold
    physical_bytes: int | None = None  # physical memory behind the graphs (VMM: whole chunks)
    virtual_reserved_bytes: int | None = None
    virtual_mapped_bytes: int | None = None
    device_used_bytes: int | None = None  # device memory the captures took, summed over shapes
    nvml_used_bytes: int | None = None
    sum_shape_bytes: int | None = None  # every shape's own need added up: no sharing at all
    max_shape_bytes: int | None = None  # the largest shape's need: the floor any sharing can reach
    physical_over_max: float | None = None
    physical_over_sum: float | None = None
    physical_over_max_pool: float | None = None
    input_arena_bytes: int | None = None
    input_per_shape_bytes: int | None = None
    capture_s: float | None = None
    replay_ms_median: float | None = None
    eager_ms_median: float | None = None
    max_rel_err: float | None = None
    replays: int | None = None
    replays_ok: int | None = None
    shuffled_replays: int | None = None
    shuffled_ok: int | None = None
    shuffled_max_rel_err: float | None = None
    warnings: int | None = None
    ledger_total_bytes: int | None = None  # the ledger's total over every captured bucket (gmtool.memory.ledger)
    kv_tokens_given_up: int | None = None  # ledger_total_bytes in KV-cache tokens
    after_release_bytes: int | None = None  # device memory not given back once the strategy's run was released
    wall_s: float | None = None
    reason: str | None = None  # why the status is not ok
    per_key: list[dict] = _detail()
    shuffled: list[dict] = _detail()
    records: list[dict] = _detail()  # the sweep's rows (gmtool.records.Record, as JSON)
    ledger: list[dict] = _detail()  # per captured bucket: the ledger's parts, total and KV tokens given up
    errors: list[str] = _detail()
    warning_list: list[str] = _detail()
    vmm: dict | None = _detail(lambda: None)
    traces: dict | None = _detail(lambda: None)  # each capture's allocator events (gmtool.memory.alloctrace)
    nvml_source: str | None = _detail(lambda: None)

    def csv_row(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("csv", True)}


ROW_FIELDS = tuple(f.name for f in fields(StrategyRow) if f.metadata.get("csv", True))  # memreport.csv's columns


@dataclass(kw_only=True)
class Prediction:
    """One strategy's memory for the whole bucket list, predicted from the sampled buckets (gmtool.memory.ledger),
    and with --check the memory a capture of every bucket held, and the error."""

    strategy: str
    first_bucket: int  # captured first: its pool as measured
    first_bytes: float
    slope: float | None  # line: what each later capture added: slope * bucket + intercept bytes (allocsim: None)
    intercept: float | None
    sample_bytes: float  # what the sampled captures added up to
    predicted_bytes: float
    measured_bytes: float | None = None
    error_pct: float | None = None
    method: str = "line"  # line (gmtool.memory.ledger.predict) | allocsim (gmtool.memory.allocsim, from traces)
    notes: list[str] = field(default_factory=list)  # the simulator's: buckets whose events were not interpolated


@dataclass(kw_only=True)
class MemDocument:
    schema_version: int = SCHEMA_VERSION
    tool: str = "gmtool"
    command: str = "memreport"
    created: str | None = field(default_factory=now_utc)
    machine: dict
    model: dict
    config: dict
    mode: GraphMode
    scenario: str
    strategies: list[StrategyRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sum_shape_bytes: int | None = None
    max_shape_bytes: int | None = None
    max_shape_pool_bytes: int | None = None  # the largest shape's own pool as the allocator holds it
    sampled_buckets: list[int] | None = None  # --sample/--check: the buckets the prediction was fitted on
    prediction: list[Prediction] = field(default_factory=list)  # per strategy, with --sample or --check
    partial: Partial | None = None

    def exit_code(self) -> int:
        """0: every available strategy measured cleanly; 3: a replay differed from eager; 1: anything else."""
        rows = self.strategies
        if any(r.status == Status.UNSAFE for r in rows):
            return 3
        if any(r.status in FAILED for r in rows) or all(r.status == UNAVAILABLE for r in rows):
            return 1
        return 0

    def mark_partial(self, reason: str, planned: int) -> None:
        self.partial = Partial(reason=reason, measured=len(self.strategies), planned=planned, unit="strategies")
        self.notes.append(f"partial run: {self.partial.summary}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["partial"] is None:
            del d["partial"]
        return d

    def to_json(self) -> str:
        return json_text.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: dict) -> MemDocument:
        return from_plain(cls, d)
