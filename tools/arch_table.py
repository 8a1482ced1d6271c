"""The table of every causal-LM architecture transformers ships, as issue 14's closing note shows it: each tiny
config (tests/arch_configs.py) through the same CPU compare of eager, full and piecewise as
tests/test_architectures.py (one mix, `4@8+1@9`), with its status: ok (every replay equal to eager), refused
(gmtool's one line), not tried (transformers' own config class rejects the tiny config), or TRACEBACK (a bug).

An ok row is also checked against transformers' own eager attention and masks: one 40-token prompt (past every
window), the last token's logits within 1e-4 (what eager-versus-graph checks cannot see: both sides use gmtool's
attention). Random weights can hide a difference a trained model shows (a parameter initialised to zero).

Usage (about 10 minutes on one CPU core):
    GMTOOL_CPU_THREADS=1 PYTHONPATH=. python3 tools/arch_table.py --out arch-table.md [--only llama,gemma2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from gmtool.errors import GmtoolError
from gmtool.records import Status
from tests.arch_configs import causal_lm_types
from tests.helpers import against_transformers
from tests.test_architectures import COMPOSITIONS, _run


def _matches_transformers(path: Path) -> str:
    """gmtool's attention against transformers' eager attention on one 40-token prompt, in words."""
    ours, theirs = against_transformers(str(path))
    err = (ours - theirs).abs().max().item()
    return f"= transformers eager ({err:.0e})" if err <= 1e-4 else f"DIFFERS from transformers eager by {err:.1e}"


def status(model_type: str, folder: Path) -> tuple[str, str]:
    try:
        res = _run(model_type, folder)
    except pytest.skip.Exception as e:
        return "not tried", str(e).split(": ", 1)[-1]
    except GmtoolError as e:
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 (the table says what a traceback would have been: a bug to fix)
        return "TRACEBACK", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    bad = [f"{r.mode} {r.composition}: {r.status}" for r in res.records if r.status != Status.OK]
    if res.errors or bad or len(res.records) != 3:
        return "FAILED", "; ".join(map(str, res.errors)) + "; ".join(bad)
    try:
        return "ok", _matches_transformers(folder / f"{model_type}.json")
    except Exception as e:  # noqa: BLE001 (transformers' own eager forward on a tiny config)
        return "ok", f"transformers' eager forward failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated model_types (default: every one)")
    args = ap.parse_args()
    import transformers

    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    rows, t0 = [], time.time()
    for mt in types:
        with tempfile.TemporaryDirectory() as d:
            st, why = status(mt, Path(d))
        rows.append((mt, st, why))
        print(f"{mt}: {st}: {why}", flush=True)
    counts = Counter(st for _, st, _ in rows)
    lines = [
        "# Architectures tried on the CPU (issue 14)",
        "",
        f"Every model_type in transformers {transformers.__version__}'s MODEL_FOR_CAUSAL_LM_MAPPING ({len(types)}), "
        "as a tiny random config built from its own config class (tests/arch_configs.py: 2 layers, hidden 64, "
        f"sliding windows shrunk to 6 tokens), through `compare eager,full,piecewise --scenario prefill` on the CPU "
        f"backend with the mix `{COMPOSITIONS}` (bucket 8): a 4-token chunk after 8 cached tokens (crossing the "
        "window) beside a decode token, as tests/test_architectures.py runs it. ok = every replay equal to eager; "
        "the detail of an ok row compares gmtool's attention with transformers' eager attention on a 40-token "
        "prompt (last token's logits, max abs difference).",
        f"Made by `tools/arch_table.py` in {time.time() - t0:.0f} s.",
        "",
        "Totals: " + ", ".join(f"{n} {st}" for st, n in counts.most_common()) + ".",
        "",
        "| architecture | status | detail |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {mt} | {st} | {why.replace('|', '/')} |" for mt, st, why in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{args.out}: " + ", ".join(f"{n} {st}" for st, n in counts.most_common()))


if __name__ == "__main__":
    main()
