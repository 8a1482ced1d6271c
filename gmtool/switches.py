"""gmtool's environment switches (GMTOOL_COMPILE_AHEAD, GMTOOL_COMPILE_FORK, GMTOOL_EARLY_COMPILE,
GMTOOL_GEMM_WARMUP, GMTOOL_NATIVE_LOOP, GMTOOL_STITCH): each is on unless set to one of the off words, the same words for every switch."""

from __future__ import annotations

import os

OFF = ("0", "false", "off", "no")


def switched_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in OFF
