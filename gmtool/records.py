"""What a run measured, typed once: a row's status, its timings, its record, the document the rows make (JSON in
and out, checked on the way in), and the exit code a document earns."""

from __future__ import annotations

import datetime as _dt
import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import StrEnum

from gmtool.errors import GmtoolError
from gmtool.modes import GraphMode
from gmtool import json_text

SCHEMA_VERSION = 1


class Status(StrEnum):
    """Ordered by severity: a bucket's summary shows the worst status of its rows."""

    OK = "ok"
    SKIPPED = "skipped"  # not run: an earlier failure of the same mode, or a mode that does not apply
    ERROR = "error"
    OOM = "oom"
    UNSAFE = "UNSAFE"  # the replay differs from eager: it gets no latency and no speedup

    @property
    def severity(self) -> int:
        return list(Status).index(self)

    @property
    def failed(self) -> bool:
        """The run could not measure it (exit code 1)."""
        return self in (Status.ERROR, Status.OOM)

    @property
    def style(self) -> str:
        return _STYLE[self]


_STYLE = {
    Status.OK: "green",
    Status.SKIPPED: "yellow",
    Status.ERROR: "red",
    Status.OOM: "red",
    Status.UNSAFE: "bold red",
}


def style_of(status: str) -> str:
    """Rich style of a status; yellow for one outside a sweep's (memreport's "unavailable")."""
    return _STYLE.get(status, "yellow")


def worst(statuses) -> Status:
    return max((Status(s) for s in statuses), key=lambda s: s.severity, default=Status.OK)


@dataclass(kw_only=True)
class Timing:
    """One timed quantity over its samples (milliseconds or microseconds, as the record field's name says)."""

    median: float
    p90: float
    p99: float
    min: float
    iqr: float
    n: int
    noisy: bool  # the spread is too wide to trust the median (gmtool.measure.timing.NOISY_IQR_FRACTION)


@dataclass(kw_only=True)
class Record:
    """One row: a mode on one composition of one bucket. Only mode, bucket, composition and status are always
    set; the rest is None where the row did not get that far (an UNSAFE replay has no latency)."""

    mode: GraphMode
    bucket: int
    key: str | None = None  # the graph the batch ran on (BucketKey as text)
    composition: str
    num_tokens: int | None = None
    num_seqs: int | None = None
    status: Status
    impl: str | None = None  # the attention implementation the graph ran
    piecewise_impl: str | None = None
    max_rel_err: float | None = None  # against eager on the exact, unpadded batch
    tolerance: float | None = None
    max_rel_err_same_shape: float | None = None  # against eager on the same padded batch and kernels
    tolerance_same_shape: float | None = None
    kv_rel_err: float | None = None
    kv_rel_err_same_shape: float | None = None
    stale_metadata: bool | None = None
    capture_s: float | None = None  # set on the row whose batch captured the graph
    compile_s: float | None = None
    graph_mem_bytes: int | None = None
    pool_growth_bytes: int | None = None
    outside_pool_bytes: int | None = None  # device memory the capture took outside the pool (CUDA only)
    # the rest of the graph memory ledger (gmtool.memory.ledger), on the row that captured its bucket
    inputs_bytes: int | None = None  # the bucket's slice of the persistent input buffers
    workspace_bytes: int | None = None  # cuBLAS workspace of the capture stream (CUDA; its first graph)
    ledger_total_bytes: int | None = None  # pool growth + outside the pool + inputs + workspace
    kv_tokens_given_up: int | None = None  # ledger_total_bytes / the KV cache's bytes per token
    pieces: int | None = None
    runners: int | None = None
    latency_ms: Timing | None = None
    eager_latency_ms: float | None = None
    speedup: float | None = None
    host_us: Timing | None = None  # copy-in + launch from an idle device
    host_copy_us: Timing | None = None  # copy-in alone
    host_steady_us: Timing | None = None  # copy-in + launch while the device runs the previous step
    captured_with: str | None = None
    served_by: str | None = None  # what ran the batch: full, piecewise or eager (auto picks per batch)
    floor_ms: float | None = None  # the least time the step could take here (gmtool.measure.floor)
    replay_over_floor: float | None = None  # latency_ms median / floor_ms
    floor_bandwidth_ms: float | None = None  # floor_bytes / the device's measured copy bandwidth
    floor_launch_ms: float | None = None  # kernels x the measured cost of one graph node
    floor_bytes: int | None = None  # weights + K/V read + activations
    kernels: int | None = None  # kernels one replay runs (ATen ops on the CPU)
    time_by_class_ms: dict | None = None  # --trace: ms per replay by kernel class (GEMM, attention, ...)
    error: str | None = None
    notes: str | None = None
    baseline: dict | None = None  # the matching row of an older run (gmtool.report.baseline)
    rank: int = 0  # --tp: the rank that measured the row (every rank's rows are kept)

    def __post_init__(self):
        self.mode, self.status = GraphMode(self.mode), Status(self.status)

    def to_dict(self) -> dict:
        return asdict(self)

    def flat(self) -> dict:
        """One CSV row: each timing spread over <field>_median, <field>_p90, ... (empty where it has none),
        the baseline over baseline_<key>, the traced time per kernel class over time_by_class_ms_<class>."""
        row = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in TIMING_FIELDS:
                row.update({f"{f.name}_{t.name}": getattr(v, t.name) if v else None for t in fields(Timing)})
            elif f.name == "baseline":  # columns only where a baseline was attached
                row.update({f"baseline_{k}": sv for k, sv in (v or {}).items()})
            elif f.name == "time_by_class_ms":  # --trace: a column per kernel class, not a dict's repr in a cell
                row.update({f"time_by_class_ms_{k}": ms for k, ms in (v or {}).items()})
            else:
                row[f.name] = v
        return row


RECORD_FIELDS = tuple(f.name for f in fields(Record))
TIMING_FIELDS = ("latency_ms", "host_us", "host_copy_us", "host_steady_us")
REQUIRED = ("mode", "bucket", "composition", "status")  # what every report reads of a record


@dataclass(kw_only=True)
class Partial:
    """A run that stopped before its plan was done: what it measured is kept, and says so."""

    reason: str  # "interrupted", "stopped by <exception>", or "unfinished" (read back from the journal alone)
    measured: int
    planned: int
    unit: str = "rows"

    @property
    def summary(self) -> str:
        return f"{self.reason} after {self.measured} of {self.planned} {self.unit}"


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(kw_only=True)
class Document:
    """results.json: the machine, model and config of a run, its records, and whatever went wrong outside them."""

    schema_version: int = SCHEMA_VERSION
    tool: str = "gmtool"
    command: str | None = None
    created: str | None = field(default_factory=now_utc)
    wall_s: float | None = 0.0
    machine: dict
    model: dict
    config: dict
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    baseline: dict | None = None  # set by gmtool.report.baseline.attach_baseline
    partial: Partial | None = None

    def unexpected_unsafe(self) -> list[Record]:
        """UNSAFE rows of modes that should be safe (full-narrow's are the finding it exists to show)."""
        return [r for r in self.records if r.status == Status.UNSAFE and not r.mode.expected_unsafe]

    def exit_code(self) -> int:
        """0 ok; 1 a mode failed or ran out of memory somewhere, or the run stopped short of its plan; 3 a replay
        that should be safe differed from eager; 130 the run was interrupted (as the run itself exited: gmtool
        report of its results exits alike)."""
        if self.partial is not None and self.partial.reason == "interrupted":
            return 130
        if self.errors or self.partial is not None or any(r.status.failed for r in self.records):
            return 1
        return 3 if self.unexpected_unsafe() else 0

    def mark_partial(self, reason: str, planned: int) -> None:
        self.partial = Partial(reason=reason, measured=len(self.records), planned=planned)
        self.notes.append(f"partial run: {self.partial.summary}")

    def to_dict(self) -> dict:
        """The plain JSON form every renderer reads; baseline and partial only when there is one."""
        d = asdict(self)
        for k in ("baseline", "partial"):
            if d[k] is None:
                del d[k]
        return d

    def to_json(self) -> str:
        return json_text.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d) -> Document:
        """A checked document: GmtoolError naming the first missing key or value of the wrong type."""
        if not isinstance(d, dict) or d.get("tool") != "gmtool" or not isinstance(d.get("records"), list):
            raise GmtoolError("not a gmtool results file")
        version = d.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise GmtoolError(
                f"a results file of schema version {version}, from a newer gmtool (this one reads {SCHEMA_VERSION})"
            )
        for key in ("model", "config", "machine"):
            if not isinstance(d.get(key), dict):
                raise GmtoolError(f"not a complete gmtool results file: no {key!r} section")
        for i, r in enumerate(d["records"]):
            missing = [k for k in REQUIRED if not isinstance(r, dict) or k not in r]
            if missing:
                raise GmtoolError(f"record {i + 1} lacks {', '.join(missing)}")
        doc = from_plain(cls, d)
        check_values(doc)
        return doc

    @classmethod
    def from_json(cls, text: str) -> Document:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError as e:  # bad JSON
            raise GmtoolError(f"not JSON: {e}") from None


# -- checked reading: each value against its field's annotation ------------------------------------------
def from_plain(cls, value):
    """A dataclass of this module's kind built from its JSON form, each value checked against its annotation."""
    return _typed(value, cls, "")


_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "an object",
    list: "a list",
}


def _typed(value, hint, where: str):
    """value as the annotation hint asks (X | None, int, float, str, bool, dict, list[X], a StrEnum or one of
    the dataclasses above); GmtoolError naming where it is otherwise."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _typed(value, hint, where)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise GmtoolError(f"{where} is not a list")
        return [
            _typed(v, args[0], f"{where}[{i}]" if where != "records" else f"record {i + 1}")
            for i, v in enumerate(value)
        ]
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        try:
            return hint(value)
        except ValueError:
            raise GmtoolError(f"{where} is {value!r}, not one of {', '.join(hint)}") from None
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise GmtoolError(f"{where} is not an object")
        hints = typing.get_type_hints(hint)
        kw = {}
        for f in fields(hint):
            if f.name in value:
                kw[f.name] = _typed(value[f.name], hints[f.name], f"{where}: {f.name}".lstrip(": "))
        try:
            return hint(**kw)  # keys of a newer gmtool are left out; a missing required one is named
        except TypeError as e:
            missing = str(e).rsplit(":", 1)[-1].strip()
            raise GmtoolError(f"{where or 'document'} lacks {missing}") from None
    ok = isinstance(value, hint) and not (hint in (int, float) and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise GmtoolError(f"{where} is {json.dumps(value)[:40]}, not {_NAMES.get(hint, hint.__name__)}")
    return value


# -- checked values: what a measurement can be ---------------------------------------------------------------
# A file edited by hand (or damaged) can hold well-typed values no run writes: a negative latency became a
# negative plan, and a NaN error on an ok row was shown as ok (or vanished from a bucket's maximum).
_AT_LEAST_ZERO = (
    "eager_latency_ms",
    "speedup",
    "capture_s",
    "compile_s",
    "floor_ms",
    "replay_over_floor",
    "floor_bandwidth_ms",
    "floor_launch_ms",
    "graph_mem_bytes",
    "inputs_bytes",
    "workspace_bytes",
    "floor_bytes",
    "kernels",
    "pieces",
    "runners",
)
_ERRORS = (  # (error, its tolerance): NaN only where the replay failed
    ("max_rel_err", "tolerance"),
    ("max_rel_err_same_shape", "tolerance_same_shape"),
    ("kv_rel_err", "tolerance"),
    ("kv_rel_err_same_shape", "tolerance_same_shape"),
)
# the sections' values the reports and the planner compute with: (key, type, least value)
_SECTION_VALUES = {
    "config": (
        ("tp", int, 1),
        ("bucket_sizes", list, None),
        ("eager_sizes", list, None),
        ("modes", list, None),
        ("num_iters", int, 0),
        ("num_iters_warmup", int, 0),
        ("max_kv_len", int, 1),
    ),
    "model": (("params", int, 0),),
}


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


MAX_SIZE = 2**31  # a bucket, tokens or sequences: no step of a run comes near (the plots take their log2)
MAX_TIME = 1e12  # ms or us of one step: about 30 years


def check_values(doc: Document) -> None:
    """GmtoolError naming the first value no run writes: a negative or non-finite time, size or count, an ok row
    whose error is not a number or above its tolerance, a bucket below 1, a section value of the wrong kind."""
    damaged = "(the file was edited or damaged)"
    if doc.wall_s is not None and not (_finite(doc.wall_s) and doc.wall_s >= 0):
        raise GmtoolError(f"wall_s is {doc.wall_s}: a time is a finite number, at least 0 {damaged}")
    for section, keys in _SECTION_VALUES.items():
        values = getattr(doc, section)
        for key, kind, least in keys:
            v = values.get(key)
            if v is None:
                continue
            if kind is list:
                if not isinstance(v, list) or not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v):
                    raise GmtoolError(f"{section}: {key} is {json.dumps(v)[:40]}, not a list {damaged}")
            elif not isinstance(v, kind) or isinstance(v, bool) or v < least:
                raise GmtoolError(f"{section}: {key} is {json.dumps(v)[:40]}, not {_NAMES[kind]} >= {least} {damaged}")
    b = doc.baseline
    if b is not None:
        ok = all(isinstance(b.get(k), int) and not isinstance(b.get(k), bool) for k in ("matched", "unmatched"))
        buckets = b.get("buckets", [])
        ok = ok and isinstance(buckets, list) and all(isinstance(x, dict) for x in buckets)
        if not (ok and isinstance(b.get("path"), str)):
            raise GmtoolError(f"baseline lacks its path, matched and unmatched counts or buckets {damaged}")
    for i, r in enumerate(doc.records):
        where = f"record {i + 1} ({r.mode}, bucket {r.bucket}, {r.composition})"
        for name in ("bucket", "num_tokens", "num_seqs"):
            v = getattr(r, name)
            if v is not None and not 1 <= v < MAX_SIZE:
                raise GmtoolError(f"{where}: {name} is {v}: a size from 1 to {MAX_SIZE - 1:,} {damaged}")
        for name in ("latency_ms", "host_us", "host_copy_us", "host_steady_us"):
            t = getattr(r, name)
            for f in fields(Timing) if t is not None else ():
                v = getattr(t, f.name)
                if not isinstance(v, bool) and not (_finite(v) and 0 <= v < MAX_TIME):
                    raise GmtoolError(
                        f"{where}: {name} {f.name} is {v}: a finite number, from 0 to below {MAX_TIME:g} {damaged}"
                    )
        for name in _AT_LEAST_ZERO:
            v = getattr(r, name)
            if v is not None and not (_finite(v) and v >= 0):
                raise GmtoolError(f"{where}: {name} is {v}: a finite number, at least 0 {damaged}")
        for name, tol_name in _ERRORS:
            v, tol = getattr(r, name), getattr(r, tol_name)
            if v is not None and v < 0:
                raise GmtoolError(f"{where}: {name} is {v}: a relative error is at least 0 {damaged}")
            if r.status == Status.OK and v is not None and tol is not None and not v <= tol:
                raise GmtoolError(
                    f"{where}: status ok but {name} {v} is not within its {tol_name} {tol}: a row with that "
                    f"error is UNSAFE {damaged}"
                )
