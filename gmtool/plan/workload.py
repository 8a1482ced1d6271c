"""A workload: the step shapes a server runs, as `num_tokens,num_seqs,count` rows (CSV or JSONL).

`count` is optional (each row is then one step, so a log of steps can be pasted as it is). Rows with the same
shape are summed. A built-in workload is named by its file's stem under profiles/workloads.
"""

from __future__ import annotations

import json
from difflib import get_close_matches
from pathlib import Path

import numpy as np
import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.profiles import PROFILES_DIR
from gmtool.records import MAX_SIZE

WORKLOADS_DIR = PROFILES_DIR / "workloads"
COLUMNS = ("num_tokens", "num_seqs", "count")
COUNT_LIKE = {"weight", "weights", "freq", "frequency", "occurrences", "steps", "num_steps", "n", "times", "share"}


def builtin_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.csv"))


def resolve(spec: str) -> Path:
    path = Path(spec)
    if path.exists():
        return path
    builtin = WORKLOADS_DIR / f"{spec}.csv"
    if builtin.is_file():
        return builtin
    raise GmtoolError(f"no workload file {spec!r} (built-in: {', '.join(builtin_workloads())})")


def _read(path: Path) -> pd.DataFrame:
    try:
        if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
            rows = []
            for n, ln in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):  # a BOM, as CSV takes it
                try:
                    rows += [json.loads(ln)] if ln.strip() else []
                except json.JSONDecodeError as e:  # json's own "line 1" counts within the line: the file's line
                    raise ValueError(f"line {n}, column {e.colno}: {e.msg}") from None
            if not all(isinstance(r, dict) for r in rows):
                raise ValueError("each line must be a JSON object")
            for n, r in enumerate(rows, 1):  # json reads NaN and Infinity; null is a count left out (one step)
                bad = [k for k in COLUMNS if isinstance(r.get(k), float) and not np.isfinite(r[k])]
                if bad:
                    raise GmtoolError(f"workload {path}, row {n}: {bad[0]} must be a whole number, got {r[bad[0]]}")
            return pd.DataFrame(rows)
        # only an empty field is missing (a count left out: one step); "NaN", "NA" or "null" are values, refused
        return pd.read_csv(path, comment="#", skipinitialspace=True, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except (OSError, UnicodeDecodeError) as e:
        raise GmtoolError(f"cannot read workload {path}: {getattr(e, 'strerror', None) or e}") from None
    except (ValueError, pd.errors.ParserError) as e:
        raise GmtoolError(
            f"workload {path} is not valid {'JSONL' if path.suffix != '.csv' else 'CSV'}: {str(e).splitlines()[0]}"
        ) from None


def _booleans(col: pd.Series) -> pd.Series:
    """Which values of a column are booleans: all of a bool column, the bool objects of a mixed one."""
    if col.dtype == bool:
        return pd.Series(True, index=col.index)
    if col.dtype == object:
        return col.map(lambda v: isinstance(v, (bool, np.bool_)))
    return pd.Series(False, index=col.index)


def load_workload(spec: str) -> tuple[pd.DataFrame, Path]:
    """(steps, the file read): one row per distinct (num_tokens, num_seqs) with its count and the index of its
    first step in the file's order, sorted by size."""
    path = resolve(spec)
    if path.is_dir():
        raise GmtoolError(f"workload {path} is a directory, not a CSV or JSONL file")
    df = _read(path)
    if not len(df.columns):
        raise GmtoolError(f"workload {path} is empty (need num_tokens,num_seqs[,count] rows)")
    if not isinstance(df.index, pd.RangeIndex):  # pandas takes the fields beyond the header's as the rows' index
        raise GmtoolError(f"workload {path}: its rows have more fields than its header (num_tokens,num_seqs[,count])")
    df.columns = [str(c).strip() for c in df.columns]
    # other columns (a log's timestamps, the index pandas' to_csv writes) are not the workload's; a misspelt
    # count is: dropped, every row would be taken as one step
    misspelt = [(c, m[0]) for c in df.columns if c not in COLUMNS and (m := get_close_matches(c, COLUMNS, 1, 0.75))]
    if "count" not in df.columns:  # another name for how often a row occurs: its rows would be one step each
        misspelt += [(c, "count") for c in df.columns if c.lower() in COUNT_LIKE]
    elif also := [c for c in df.columns if c.lower() in COUNT_LIKE]:  # one of them would be dropped unsaid
        raise GmtoolError(f"workload {path}: columns 'count' and {also[0]!r} both say how often a row occurs: keep one")
    if misspelt:
        c, meant = misspelt[0]
        raise GmtoolError(f"workload {path}: unknown column {c!r} (did you mean {meant!r}?)")
    missing = [c for c in COLUMNS[:2] if c not in df.columns]
    if missing:
        raise GmtoolError(f"workload {path}: missing column {', '.join(missing)} (need num_tokens,num_seqs[,count])")
    if df.empty:
        raise GmtoolError(f"workload {path} has no steps")
    df["count"] = df["count"].fillna(1) if "count" in df.columns else 1  # a row without a count is one step
    df = df[list(COLUMNS)]
    flags = df.apply(_booleans)  # pandas reads true/false as booleans: not counts
    numeric = df.apply(pd.to_numeric, errors="coerce").mask(flags)
    # a whole number an int64 holds (inf, 1e30 or twenty digits would fail in the cast or wrap around)
    huge = numeric.abs() >= 2**62
    bad = numeric.isna() | (numeric != numeric.round()) | huge
    if bad.any().any():
        row, col = next((r, c) for r in range(len(df)) for c in COLUMNS if bad.iloc[r][c])
        limit = " below 2**62" if huge.iloc[row][col] else ""
        raise GmtoolError(
            f"workload {path}, row {row + 1}: {col} must be a whole number{limit}, got {str(df.iloc[row][col])!r}"
        )
    df = numeric.astype("int64")
    for col, low in (("num_tokens", 1), ("num_seqs", 1), ("count", 0)):
        below = df.index[df[col] < low]
        if len(below):
            r = below[0]
            raise GmtoolError(
                f"workload {path}, row {r + 1}: {col} must be {'positive' if low else '0 or more'}, got {df.at[r, col]}"
            )
    for col in ("num_tokens", "num_seqs"):  # a size no bucket, candidate or results row can hold
        if len(above := df.index[df[col] >= MAX_SIZE]):
            r = above[0]
            raise GmtoolError(f"workload {path}, row {r + 1}: {col} must be below {MAX_SIZE:,}, got {df.at[r, col]:,}")
    over = df.index[df["num_seqs"] > df["num_tokens"]]
    if len(over):
        r = over[0]
        raise GmtoolError(
            f"workload {path}, row {r + 1}: {df.at[r, 'num_seqs']} sequences cannot share "
            f"{df.at[r, 'num_tokens']} tokens (each sequence has at least one)"
        )
    total = sum(int(c) for c in df["count"])  # Python's ints: int64 sums would wrap around
    if total >= 2**62:
        raise GmtoolError(f"workload {path}: its counts add up to {total:,} steps, more than 2**62")
    # where in the trace (the file's order, counts expanded) each shape first appears: lazy capture's first hits
    df["first_step"] = df["count"].cumsum() - df["count"]
    steps = (
        df[df["count"] > 0]
        .groupby(["num_tokens", "num_seqs"], as_index=False)
        .agg(count=("count", "sum"), first_step=("first_step", "min"))
    )
    steps = steps[steps["count"] > 0].sort_values(["num_tokens", "num_seqs"]).reset_index(drop=True)
    if steps.empty:
        raise GmtoolError(f"workload {path} has no steps (every count is 0)")
    return steps, path


def by_size(steps: pd.DataFrame) -> pd.Series:
    """Step counts per num_tokens: what the cost of a capture set depends on."""
    return steps.groupby("num_tokens")["count"].sum().sort_index()


def is_decode(steps: pd.DataFrame) -> bool:
    return bool((steps["num_tokens"] == steps["num_seqs"]).all())
