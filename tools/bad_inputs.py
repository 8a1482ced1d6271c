"""The bad-input table of issue 13: every case of tests/test_bad_inputs.py run as a user runs it (a fresh
`python -m gmtool` process on the CPU), as Markdown: case, command, exit code, the message line.

    PYTHONPATH=. python tools/bad_inputs.py > bad-inputs.md
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_bad_inputs import CASES, argv_of, make_inputs  # noqa: E402


def main() -> int:
    print("| case | command | exit | message (stderr) |\n|---|---|---|---|")
    for case in CASES:
        name, args, _ = case.values if hasattr(case, "values") else case
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            make_inputs(tmp)
            argv = argv_of(args, tmp)
            p = subprocess.run(
                [sys.executable, "-m", "gmtool", *argv], capture_output=True, text=True, cwd=ROOT, timeout=600
            )
            lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
            said = " / ".join(lines) if lines else "(nothing)"
            shown = " ".join(
                "gmtool" if i == 0 else a.replace(d, "$TMP") if a else "''" for i, a in enumerate(["gmtool", *argv])
            )
            cell = said.replace(d, "$TMP").replace("|", "\\|")
            print(f"| {name} | `{shown}` | {p.returncode} | {cell} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
