"""Fresh processes for tests that need several, or one to SIGKILL: forked from a server process that imported torch
and dflash once (multiprocessing's forkserver) rather than each importing them again (spawn or `python -c`: ~6 s of
CPU per process, most of those tests' time). Either way a child starts with nothing of the test process's state: no
process group, threads, tensors or monkeypatches.

The server starts with the first child of a test process and its preload list then stays: one list for every user.
"""

from __future__ import annotations

import torch.multiprocessing as mp

PRELOAD = ["dflash.pipeline", "dflash.extract.capture_sender", "dflash.extract.feature_cache",
           "dflash.extract.linked_source", "dflash.extract.rank_link", "dflash.train.checkpoints",
           "tests.test_rank_stream", "tests.test_checkpoint_rank0_errors", "tests.test_fault_campaign"]


def process_context():
    """The multiprocessing context whose Process(...) is such a fresh process."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
