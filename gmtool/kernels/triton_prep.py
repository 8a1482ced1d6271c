"""What Triton's first kernel launch in a process would do (its installation's hash, its first-launch imports, its
driver), started in threads at the model's load so that it overlaps the build; and the imports a compile makes
at its first use, made before another thread forks compile children."""

from __future__ import annotations

import importlib
import os
import threading

first_launch_work: list[threading.Thread] = []  # started at model load; joined before the first capture

# Triton 3.6's first argument specialization imports its Gluon package (to know its tensor descriptor type):
# 0.12 s inside the first warm-up on the H200's host (cProfile, 2026-12-01), where no .pyc was cached
FIRST_LAUNCH_IMPORTS = ("triton.experimental.gluon",)
# what a compile imports at its first use (Triton 3.9 imports its code generator, and through it Gluon, inside
# its first compile): imported before a compile child is forked from a thread other than the main one, else the
# child could inherit the lock of a module another thread was importing and wait on it until it is killed
COMPILE_IMPORTS = ("triton.compiler.code_generator",) + FIRST_LAUNCH_IMPORTS


def import_compile_modules() -> None:
    """COMPILE_IMPORTS imported (0.04 s once Triton is). Called on the main thread before another thread starts
    compiling: imported in that thread while the main one imports transformers (whose torch._dynamo imports
    Triton's modules too), two imports in a cycle would leave one thread a partly initialized module."""
    for name in COMPILE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # another Triton: its compile imports what it needs
            pass


def import_for_compiles() -> None:
    """Triton's first-launch work (prepare_triton_in_background) done and COMPILE_IMPORTS imported, here."""
    prepare_triton_in_background()
    join_first_launch_work()
    import_compile_modules()


def prepare_triton_in_background() -> None:
    """Start, in two threads, what Triton's first kernel launch in a process would do, so that it overlaps the
    model's build; before_first_capture waits for both, so nothing is done twice.
    - Triton's hash of its own installation (libtriton.so and its sources): 0.4-0.7 s on the H200's host
      (profiled, 2026-12-01), inside the first warm-up. hashlib releases the GIL over large buffers.
    - The imports of FIRST_LAUNCH_IMPORTS, then the driver, whose C helpers (cuda_utils) an empty cache compiles
      with cc. With both in the first launch, 0.45 s passed in a cold process's pass before its first compile
      began; with them here, 0.19 s (H200, 2026-12-01, one process each)."""
    if first_launch_work or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def key():
        try:
            triton_key()
        except Exception:  # the first kernel computes it then, and says what is wrong
            pass

    def imports_and_driver():
        for name in FIRST_LAUNCH_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # another Triton: its first launch imports what it needs
                pass
        try:
            from triton.runtime import driver

            driver.active
        except Exception:  # the first launch creates it, and says what is wrong
            pass

    for name, fn in (("key", key), ("driver", imports_and_driver)):
        first_launch_work.append(threading.Thread(target=fn, name=f"gmtool-triton-{name}", daemon=True))
        first_launch_work[-1].start()


def join_first_launch_work() -> None:
    """Wait for prepare_triton_in_background's threads: nothing of Triton's first launch is done twice."""
    for work in first_launch_work:
        work.join()
