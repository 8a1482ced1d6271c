"""Running a command's work on N ranks: gmtool spawns them itself (`--tp N`), or this process is one rank of a
group torchrun started (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment).

Each rank builds the same config on its own device (cuda:LOCAL_RANK; the CPU with gloo), joins the group, runs
the command's function and leaves the group; rank 0's return value comes back. The sweep releases its graphs
before the function returns, and that order matters: destroying an NCCL group while a captured graph is alive
hangs. A rank that fails sends its one-line error to the parent, which gives the other ranks --tp-timeout
seconds to finish or fail on their own (a collective waiting for the dead rank times out after as long), then
stops them and reports the failed rank. Ctrl-C or SIGTERM, to this process or to its whole group (timeout, a
batch system), stops every rank as Ctrl-C does, rank 0 writing what was measured; a rank never outlives this
process. NCCL_NVLS_ENABLE stays as the machine sets it, 0 when unset: NVLink
multicast is never switched on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import pickle
import queue as queue_mod
import signal
import socket
import time
from pathlib import Path

import torch

from gmtool.errors import GmtoolError, Interrupted, RunFailure, first_line
from gmtool.parallel.comm import Place, set_place

RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600  # --tp-timeout's range
FAIL_ENV = "GMTOOL_TP_FAIL_RANK"  # fault injection (the tests): rank N fails once it has joined the group; N:kill dies
DEFAULT_TIMEOUT_S = 120.0
MAX_WORLD = 1 << 16  # ranks in a group torchrun may start


def torchrun_world() -> int | None:
    """The group size when a launcher such as torchrun started this process as one rank, else None."""
    if not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    missing = [k for k in RENDEZVOUS_ENV if not os.environ.get(k)]
    if missing:
        raise GmtoolError(
            f"incomplete rendezvous: {', '.join(missing)} not set while "
            f"{', '.join(k for k in RENDEZVOUS_ENV + ('LOCAL_RANK',) if k in os.environ)} set; "
            "start gmtool under torchrun, or unset them and give --tp"
        )
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        if k in os.environ and not (os.environ[k].isascii() and os.environ[k].isdigit()):
            raise GmtoolError(f"incomplete rendezvous: {k}={os.environ[k]!r} is not a number")
    rank, world, port = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if not 1 <= world <= MAX_WORLD or rank >= world:  # a rank past the group would wait for it until the timeout
        raise GmtoolError(
            f"incomplete rendezvous: RANK={rank} in a group of WORLD_SIZE={world} (ranks 0 to {world - 1})"
        )
    if not 1 <= port <= 65535:
        raise GmtoolError(f"incomplete rendezvous: MASTER_PORT={port} is not a TCP port (1 to 65535)")
    return world


def writes_here() -> bool:
    """False in a torchrun rank other than 0: that process measures and writes nothing of its own."""
    return torchrun_world() is None or int(os.environ["RANK"]) == 0


@contextlib.contextmanager
def out_dir_for(out: Path, force: bool):
    """The output directory as gmtool.report.results.output_dir makes it, on the process that writes; a
    torchrun rank other than 0 gets the path untouched."""
    from gmtool.report.results import output_dir

    if not writes_here():
        yield Path(out)
        return
    with output_dir(out, force) as path:
        yield path


def resolve_tp(tp: int | None) -> int | None:
    """--tp as the run takes it: torchrun's WORLD_SIZE when launched by it (a different --tp is refused)."""
    world = torchrun_world()
    if world is None:
        if tp is not None and tp < 1:
            raise GmtoolError(f"--tp must be 1 or more, got {tp}")
        return tp
    if tp is not None and tp != world:
        raise GmtoolError(f"--tp {tp} but torchrun started {world} ranks (WORLD_SIZE): give the same number")
    return world


def check_request(cfg, visible_gpus: int | None = None, count_gpus: bool = True) -> None:
    """Refuse, before any process starts, a --tp the device cannot hold or the model cannot be split by.
    count_gpus=False under torchrun: its ranks may span hosts, each rank checks its own device."""
    from gmtool.memory.estimate import _model_config
    from gmtool.parallel.shard import tp_refusal

    tp = cfg.tp
    if cfg.torch_device.type == "cuda" and count_gpus:
        visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
        if tp > visible:
            raise GmtoolError(f"--tp {tp} needs {tp} GPUs, {visible} visible (CUDA_VISIBLE_DEVICES)")
        if cfg.torch_device.index not in (None, 0):
            raise GmtoolError(f"--tp puts rank r on cuda:r: give --device cuda, not {cfg.torch_device}")
    config = _model_config(cfg.model)
    why = config is not None and tp_refusal(config, tp)
    if why:
        raise GmtoolError(why)


def run(fn, cfg, *args, timeout: float | None = None, **kwargs):
    """fn(cfg, *args, **kwargs) on each of cfg.tp ranks; rank 0's result. Without --tp, a plain call. timeout:
    --tp-timeout (None: not given, DEFAULT_TIMEOUT_S), refused where no rank waits for another."""
    if timeout is not None:
        # a NaN or negative wait is never meant; below a second the group cannot even form (c10d's own error and
        # its C++ stack), above a week the seconds overflow the C int the process group takes
        if not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:
            raise GmtoolError(f"--tp-timeout must be {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:,} seconds, got {timeout:g}")
        if cfg.tp == 1:  # no other rank to wait for (under torchrun, cfg.tp is its WORLD_SIZE)
            raise GmtoolError("--tp-timeout applies to ranks waiting for each other: give --tp N too, or leave it out")
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if torchrun_world() is not None:
        return _torchrun_rank(fn, cfg, args, kwargs, timeout)
    if cfg.tp == 1:
        return fn(cfg, *args, **kwargs)
    check_request(cfg)
    # callbacks (progress bars, a strategy's line) stay in this process: the ranks report through rank 0's result
    return _spawn(fn, cfg, args, {k: v for k, v in kwargs.items() if not callable(v)}, timeout)


def _init_kwargs(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _as_rank(place: Place, init_method: str, fn, cfg_kwargs: dict, args, kwargs, timeout: float):
    import torch.distributed as dist

    from gmtool.config import SweepConfig

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cfg = SweepConfig(**cfg_kwargs)
    cuda = cfg.torch_device.type == "cuda"
    if cuda:
        if place.local_rank >= torch.cuda.device_count():
            raise GmtoolError(f"rank {place.rank} wants cuda:{place.local_rank}, {torch.cuda.device_count()} visible")
        cfg = SweepConfig(**{**cfg_kwargs, "device": f"cuda:{place.local_rank}"})
        torch.cuda.set_device(cfg.torch_device)
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init_method,
            rank=place.rank,
            world_size=place.world,
            timeout=datetime.timedelta(seconds=timeout),
            **({"device_id": cfg.torch_device} if cuda else {}),
        )
    except (dist.DistError, ValueError) as e:  # an address that does not resolve, ranks that never came
        where = (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            if init_method == "env://"
            else init_method
        )
        raise GmtoolError(f"rank {place.rank} could not join the process group at {where}: {first_line(e)}") from None
    set_place(place)
    if os.environ.get(FAIL_ENV) == str(place.rank):
        raise RunFailure(f"injected failure ({FAIL_ENV}={place.rank})")
    if (fail := os.environ.get(FAIL_ENV, "")).endswith(":kill"):  # as the OOM killer ends a rank: no word from it
        if fail == f"{place.rank}:kill":
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # the others are in a collective when it dies: its error reaches the parent first
    result = fn(cfg, *args, **kwargs)
    gc.collect()  # anything a graph still held goes before the group
    if cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group()
    set_place(Place())
    return result


def _exit_code(e: BaseException) -> int:
    if isinstance(e, GmtoolError):
        return 1 if isinstance(e, RunFailure) else 2
    return 130 if isinstance(e, (KeyboardInterrupt, Interrupted)) else 1


def _torchrun_rank(fn, cfg, args, kwargs, timeout: float):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.tp != world:  # the commands take --tp through resolve_tp, which makes them equal
        raise GmtoolError(f"--tp {cfg.tp} but torchrun started {world} ranks (WORLD_SIZE)")
    if world > 1:
        check_request(cfg, count_gpus=False)
    addr = os.environ["MASTER_ADDR"]
    try:  # c10d would retry an address that does not resolve until the timeout, logging each try
        socket.getaddrinfo(addr, None)
    except OSError as e:
        raise GmtoolError(f"incomplete rendezvous: MASTER_ADDR={addr!r} does not resolve ({e.strerror or e})") from None
    if rank:  # one progress bar on the terminal, rank 0's
        kwargs = {k: v for k, v in kwargs.items() if not callable(v)}
    place = Place(rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    result = _as_rank(place, "env://", fn, _init_kwargs(cfg), args, kwargs, timeout)
    if rank:
        raise SystemExit(0)  # rank 0 prints and writes; the others are done
    return result


def _die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """A rank outlives a parent killed outright (SIGKILL, the OOM killer) by nothing: Linux's parent-death signal,
    and an exit where the parent died before it was set (while spawn imported gmtool). SIGKILL once the rank
    ignores SIGTERM (its report sent): a parent gone while the report still filled the pipe left the rank
    waiting on it for good."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _interrupt_once(*_) -> None:
    """A rank's Ctrl-C or SIGTERM (a terminal's, the parent's forwarded one, or a group kill by timeout or a batch
    system): the run stops as on Ctrl-C, rank 0 writing what was measured; the next signal is ignored, so that
    a second one cannot cut that writing short (the parent kills a rank that takes too long)."""
    # a no-op, not SIG_IGN: a signal already on its way would come out as "OSError: Signal 15 ignored due to race
    # condition" wherever the rank is, its report to the parent included
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    raise KeyboardInterrupt


def _ignore(*_) -> None:
    pass


def _worker(rank: int, world: int, port: int, fn, cfg_kwargs, args, kwargs, timeout, messages, stop, parent) -> None:
    try:
        signal.signal(signal.SIGINT, _interrupt_once)
        signal.signal(signal.SIGTERM, _interrupt_once)
        # started with Ctrl-C blocked (no traceback from an import it cut short): one held back arrives here
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        _die_with_parent(parent)
        if stop.is_set():  # Ctrl-C came while this rank was starting
            raise Interrupted("interrupted while the ranks started: nothing was measured")
        result = _as_rank(Place(rank, world, rank), f"tcp://127.0.0.1:{port}", fn, cfg_kwargs, args, kwargs, timeout)
        # done: once it has every report, the parent may stop this rank while its exit joins the queue's feeder
        # thread; raised there, a KeyboardInterrupt printed a traceback after a run that went well
        _die_with_parent(parent, signal.SIGKILL)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        # plain pickle: torch's queue would share tensors by memory this process takes with it when it exits
        messages.put((rank, 0, pickle.dumps(result) if rank == 0 else None))
    except BaseException as e:  # everything becomes the parent's one line; no traceback from a rank
        _die_with_parent(parent, signal.SIGKILL)
        for sig in (signal.SIGINT, signal.SIGTERM):  # the parent's stop (SIGTERM, then SIGKILL) ends the report
            signal.signal(sig, _ignore)
        messages.put((rank, _exit_code(e), "interrupted" if isinstance(e, KeyboardInterrupt) else first_line(e)))
        messages.close()
        messages.join_thread()
        os._exit(1)  # no teardown: a group whose other rank is stuck can hang in it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, cfg, args, kwargs, timeout: float):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    messages, stop = ctx.Queue(), ctx.Event()
    world, port = cfg.tp, _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, port, fn, _init_kwargs(cfg), args, kwargs, timeout, messages, stop, os.getpid()),
            name=f"gmtool-rank{r}",
        )
        for r in range(world)
    ]

    # SIGTERM (timeout, a batch system) stops the ranks as Ctrl-C does, rank 0 writing what was measured; before,
    # they ran on without their parent and wrote a whole run
    def interrupt(*_):
        raise KeyboardInterrupt

    term = signal.signal(signal.SIGTERM, interrupt)
    done: dict[int, tuple[int, object]] = {}
    failed, deadline = None, None
    try:
        _start(procs)
        while len(done) < world:
            try:
                # ranks seen ended before the read: the read holds their reports (each is in the pipe before its
                # rank exits), so a rank that reported and exited is never taken for one that died without a word
                exited = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
                _read(messages, done, wait=0.2)
                # a death by a signal has no report to wait for: seen after the read too (killed during the wait,
                # the others' "connection reset" came in the same wait)
                exited |= {r: p.exitcode for r, p in enumerate(procs) if (p.exitcode or 0) < 0}
                if failed is None and (failed := _failure(done, exited)):
                    deadline = time.monotonic() + timeout
            except KeyboardInterrupt:  # rank 0 writes what was measured and says so
                if deadline is not None:
                    break  # a second Ctrl-C: stop waiting
                stop.set()
                # a terminal's Ctrl-C reached the ranks already, a signal to this process alone did not; a rank
                # ignores the second (_interrupt_once)
                for p in procs:
                    if p.is_alive():
                        with contextlib.suppress(OSError):
                            os.kill(p.pid, signal.SIGINT)
                failed, deadline = (0, 130, "interrupted"), time.monotonic() + timeout
            if failed and (time.monotonic() > deadline or all(p.exitcode is not None for p in procs)):
                _read(messages, done, wait=0)  # the last reports: a rank that reported is not "stopped" below
                break
            # interrupted: rank 0 has written what was measured; the others have nothing to write, and one may be
            # stuck in c10d's rendezvous retries (they outlast signals) until --tp-timeout
            if failed and failed[1] == 130 and 0 in done:
                break
    except KeyboardInterrupt:  # while the ranks started (or between two waits): they are stopped below
        stop.set()
        failed = (0, 130, "interrupted")
    finally:
        signal.signal(signal.SIGTERM, term)
        _stop(procs)
    if failed and failed[1] == 130:
        code, msg = done.get(0, (130, "interrupted"))
        raise Interrupted(msg if code == 130 else "interrupted")
    if failed:
        rank, code, msg = failed
        stopped = [r for r in range(world) if r != rank and r not in done]
        extra = f" (rank {', '.join(map(str, stopped))} stopped after --tp-timeout)" if stopped else ""
        raise (GmtoolError if code == 2 else RunFailure)(f"rank {rank} of {world} failed: {msg}{extra}")
    return pickle.loads(done[0][1])


def _read(messages, done: dict, wait: float) -> None:
    """Every report queued into done (rank -> (code, value)), after waiting up to wait seconds for the first."""
    with contextlib.suppress(queue_mod.Empty):
        rank, code, value = messages.get(timeout=wait) if wait else messages.get_nowait()
        done[rank] = (code, value)
        while True:
            rank, code, value = messages.get_nowait()
            done[rank] = (code, value)


def _failure(done: dict, exited: dict) -> tuple | None:
    """What failed the run, as (rank, code, why), from the reports read and the ranks that ended before they were
    read (exited: rank -> exit code). A rank killed outright (a signal, the OOM killer) first: what the others
    then report follows from it (gloo's "connection reset"); else the first failure reported; else a rank that
    exited without a word."""
    silent = {r: c for r, c in exited.items() if c != 0 and r not in done}
    if (killed := next((r for r, c in silent.items() if c < 0), None)) is not None:
        c = -silent[killed]
        name = signal.Signals(c).name if c in signal.valid_signals() else c
        oom = " (out of host memory? the OOM killer sends it)" if c == signal.SIGKILL else ""
        return killed, 1, f"killed by signal {name}{oom}"
    if reported := next(((r, c, v) for r, (c, v) in done.items() if c), None):
        return reported
    return next(((r, 1, f"exited with code {c} without a word") for r, c in silent.items()), None)


def _start(procs) -> None:
    """Start the ranks with Ctrl-C and SIGTERM blocked, as their spawn inherits (through fork and exec) until
    _worker takes them: one that cut short spawn's import of gmtool printed a traceback per rank. This process
    records either meanwhile (the block holds only this thread; torch's threads would take them) and raises it
    once the ranks are started."""
    got = []
    held = {s: signal.signal(s, lambda n, _: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.pthread_sigmask(signal.SIG_BLOCK, set(held))
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(held))
        for s, h in held.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # an interrupt may come before every rank was started
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
