"""JSON as every reader takes it: standard JSON has no Infinity or NaN (Python writes them, JavaScript's
JSON.parse and strict readers refuse the file). A non-finite figure (a replay that left NaN has an infinite
relative error) is written as null; the row's status and error text say what it was."""

from __future__ import annotations

import json
import math


def finite(value):
    """value with every non-finite float, at any depth of dicts, lists and tuples, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps of finite(value), refusing any non-finite float left (one inside an object `default` turns)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
