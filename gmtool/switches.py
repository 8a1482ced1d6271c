"""gmtool's environment switches (GMTOOL_COMPILE_AHEAD, GMTOOL_COMPILE_FORK, GMTOOL_EARLY_COMPILE,
GMTOOL_GEMM_WARMUP, GMTOOL_NATIVE_LOOP, GMTOOL_STITCH): each is on unless set to one of the off words, the same
words for every switch. A run refuses any other value as it builds its model (check_switches): a typo must not
leave a switch on without a word."""

from __future__ import annotations

import os

from gmtool.errors import GmtoolError

OFF = ("0", "false", "off", "no")
ON = ("", "1", "true", "on", "yes")
SWITCHES = (
    "GMTOOL_COMPILE_AHEAD",
    "GMTOOL_COMPILE_FORK",
    "GMTOOL_EARLY_COMPILE",
    "GMTOOL_GEMM_WARMUP",
    "GMTOOL_NATIVE_LOOP",
    "GMTOOL_STITCH",
)


def switched_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in OFF


def check_switches() -> None:
    """Every switch set in the environment holds an on or an off word."""
    for name in SWITCHES:
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in OFF + ON:
            raise GmtoolError(f"{name}={value!r}: give {'/'.join(OFF)} to turn it off, or {'/'.join(ON[1:])} for on")
