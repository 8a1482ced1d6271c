"""Writes the built-in synthetic workloads of `gmtool plan` under profiles/workloads (seeded: re-running it
gives the same files). Each file is `num_tokens,num_seqs,count` per distinct step shape of 100,000 steps.

- chat: decode-heavy chat serving: pure decode steps (one token per sequence), batch sizes around 24 with a
  tail to 256 (log-normal), and 2% prefill chunks of 64 to 512 tokens.
- long-context: mixed prefill under a 2048-token step budget: 70% decode steps of 1 to 32 sequences, 30% steps
  where a chunk of a long prompt rides with the decode batch (one more sequence): three in four fill the budget
  (2048 tokens), the rest are a prompt's last chunk (decode + 1 to 2047 tokens).
- bursty: quiet periods of 1 to 8 sequences and bursts of 160 to 256 (a batch job arriving), 60/40.

Usage: python tools/make_workloads.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

STEPS = 100_000


def _decode(sizes: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"num_tokens": sizes, "num_seqs": sizes})


def chat(rng) -> pd.DataFrame:
    n_pre = STEPS // 50
    dec = np.clip(np.rint(rng.lognormal(np.log(24), 0.8, STEPS - n_pre)), 1, 256).astype(int)
    chunks = rng.integers(64, 513, n_pre)
    return pd.concat([_decode(dec), pd.DataFrame({"num_tokens": chunks, "num_seqs": 1})])


def long_context(rng) -> pd.DataFrame:
    n_mixed = STEPS * 3 // 10
    dec = rng.integers(1, 33, STEPS - n_mixed)
    riders = rng.integers(0, 33, n_mixed)
    tokens = np.where(rng.random(n_mixed) < 0.75, 2048, np.minimum(2048, riders + rng.integers(1, 2048, n_mixed)))
    return pd.concat([_decode(dec), pd.DataFrame({"num_tokens": tokens, "num_seqs": riders + 1})])


def bursty(rng) -> pd.DataFrame:
    quiet = rng.integers(1, 9, STEPS * 6 // 10)
    burst = rng.integers(160, 257, STEPS - len(quiet))
    return _decode(np.concatenate([quiet, burst]))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, make) in enumerate((("chat", chat), ("long-context", long_context), ("bursty", bursty))):
        steps = make(np.random.default_rng(1000 + i))
        table = steps.groupby(["num_tokens", "num_seqs"]).size().rename("count").reset_index()
        head = f"# {name}: built by tools/make_workloads.py ({STEPS} steps, seed {1000 + i}); see its docstring\n"
        (out / f"{name}.csv").write_text(head + table.to_csv(index=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "profiles" / "workloads")
