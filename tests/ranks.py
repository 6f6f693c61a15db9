"""Run a test's body on several spawned ranks of one process group and judge it by what every rank reports.

Each rank sends one report down its own pipe ("ok", or the traceback of what failed) and then leaves with
`os._exit`, so none of torch.distributed's C++ teardown runs in it: gloo's and c10d's threads and the static
destructors at interpreter exit. That teardown aborted a rank now and then with "terminate called without an active
exception" (on CI, and in 3 of 43 runs of test_distributed.py's two tests on a 2-core machine) and took the run's
verdict with it, though it runs after every check (the aborting rank had no Python frame left). The parent waits for
every rank (it does not kill the others when the first one ends, as torch.multiprocessing's join does, which loses
their reports), and when a rank fails it gives the rest a short grace to report their own failure before they are
killed.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OK = "ok"
GRACE_S = 30.0  # how long the others may still report once one rank has failed


def free_port() -> int:
    """A port no one listens on now, picked by the OS (one drawn from a fixed range can meet a port in use)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(body: Callable[[int, int], None], rank: int, world: int, port: int, backend: str, report) -> None:
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack to the test's stderr
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    outcome = OK
    try:
        # A generous timeout: on a 2-core machine busy with other work a rank can fall minutes behind its peer. NCCL
        # is told its rank's GPU, so its collectives (the barrier below) need not guess it.
        device = torch.device("cuda", rank) if backend == "nccl" else None
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600),
                                device_id=device)
        body(rank, world)
        dist.barrier()  # no rank leaves while a peer may still be receiving from it
    except BaseException:  # noqa: BLE001 - the parent reports it
        outcome = traceback.format_exc()
    report.send(outcome)
    report.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if outcome == OK else 1)


def run_ranks(body: Callable[[int, int], None], world: int, *, backend: str = "gloo", timeout_s: float = 900.0) -> None:
    """Runs `body(rank, world)` on `world` spawned processes joined in one `backend` process group; fails the test,
    naming every rank that did not report success and what it said, unless all of them did. `body` must be a
    module-level function (spawn pickles it by name)."""
    context = mp.get_context("spawn")
    port = free_port()
    readers, processes = {}, []
    for rank in range(world):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, args=(body, rank, world, port, backend, writer), daemon=True)
        process.start()
        writer.close()  # the child holds the only writer: its exit reads as end-of-file here
        readers[reader] = rank
        processes.append(process)

    reports: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while readers:
        remaining = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(readers), timeout=max(0.0, remaining)) if remaining > 0 else []
        if not ready:
            break
        for reader in ready:
            rank = readers.pop(reader)
            try:
                reports[rank] = reader.recv()
            except EOFError:
                reports[rank] = "ended without a report"
            if reports[rank] != OK:
                deadline = min(deadline, time.monotonic() + GRACE_S)

    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for rank in readers.values():
        reports[rank] = f"no report within the time allowed (killed; {timeout_s:.0f} s, or {GRACE_S:.0f} s after a " \
                        "peer failed)"
    failures = {rank: f"exit code {processes[rank].exitcode}: {message}"
                for rank, message in sorted(reports.items()) if message != OK}
    assert not failures, "\n".join(f"rank {rank}: {message}" for rank, message in failures.items())
