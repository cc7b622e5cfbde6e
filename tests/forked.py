"""Fresh processes for tests that need several, or one to SIGKILL: forked from a server process that imported torch
and dflash once (multiprocessing's forkserver) rather than each importing them again (spawn or `python -c`: ~6 s of
CPU per process, most of those tests' time). Either way a child starts with nothing of the test process's state: no
process group, threads, tensors or monkeypatches.

The server starts with the first child of a test process and its preload list then stays: one list for every user.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

PRELOAD = ["dflash.pipeline", "dflash.extract.capture_sender", "dflash.extract.feature_cache",
           "dflash.extract.linked_source", "dflash.extract.rank_link", "dflash.train.checkpoints",
           "tests.test_rank_stream", "tests.test_checkpoint_rank0_errors", "tests.test_fault_campaign",
           "tests.trainer_harness", "tests.test_heldout", "tests.test_time_budget", "tests.test_pipeline",
           "tests.test_step_profile", "tests.test_online_ranks"]


def process_context():
    """The multiprocessing context whose Process(...) is such a fresh process."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ranks(target: Callable, world_size: int, *args, **kwargs) -> list[int | None]:
    """target(*args, **kwargs) in `world_size` such processes, the ranks of one job on this machine, given the
    variables torchrun gives its ranks; returns their exit codes (a rank still running after 300 s is killed).

    As under torchrun, the ranks meet in a store the launcher holds (here this process, listening before any rank
    starts): a port merely found free and handed on could be taken by another test's listener before rank 0 bound
    it."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    context = process_context()
    processes = [context.Process(target=_as_rank, args=(rank, world_size, store.port, target, args, kwargs))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    del store
    return [process.exitcode for process in processes]


def _as_rank(rank: int, world_size: int, port: int, target: Callable, args: tuple, kwargs: dict) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"})
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for the launched processes of the other tests
    target(*args, **kwargs)
