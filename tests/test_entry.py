"""The gmtool command's entry point: a Ctrl-C while the commands load."""

from __future__ import annotations

import subprocess
import sys

# Ctrl-C arrives while gmtool.cli.main is being imported (the seconds torch and transformers take)
INTERRUPTED_IMPORT = """
import builtins, os, signal, sys, time
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
real = builtins.__import__
def importing(name, *args, **kwargs):
    if name == "gmtool.cli.main":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    return real(name, *args, **kwargs)
builtins.__import__ = importing
sys.argv[1:] = ["--version"]
from gmtool.cli.entry import main
main()
"""


def _run(sigint: str):
    return subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, sigint], capture_output=True, text=True, timeout=120
    )


def test_ctrl_c_while_the_commands_load_ends_with_a_line_not_a_traceback():
    r = _run("default")
    assert (r.returncode, r.stderr, r.stdout) == (130, "interrupted\n", "")


def test_a_process_started_with_sigint_ignored_keeps_ignoring_it_while_loading():
    r = _run("ignored")
    assert r.returncode == 0 and r.stdout.startswith("gmtool ") and "interrupted" not in r.stderr
