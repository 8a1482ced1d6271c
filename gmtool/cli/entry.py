"""The gmtool command's entry point. Loading the commands loads torch and transformers (seconds). A Ctrl-C then
ends the process at once, with a line and exit 130, as one during a run does: raised inside those imports, the
KeyboardInterrupt came out as a traceback, or torch's C++ swallowed it while it imported numpy, and the run went on
with a half-imported numpy and died of an AttributeError later. Nothing is written before the commands load, so
there is nothing to finish."""

from __future__ import annotations

import os
import signal


def _interrupted_while_loading(signum, frame) -> None:
    os.write(2, b"interrupted\n")
    os._exit(130)


def main() -> None:
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # ignored (started in the background by a shell): stays ignored
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from gmtool.cli.main import main as run

    signal.signal(signal.SIGINT, previous)
    run()
