"""A rank of tests/test_rank_stream.py's two-node restart: opens the job's rank link (one capture rank a node), meets
every other rank, and appends its node's restart count to <out>/rank<RANK>; job rank 0 dies in the first start, so
torchrun restarts the job on both nodes. In the first start the other ranks wait without touching the link: a rank
that failed there would make its healthy node count a restart too, and the nodes' counts must differ for the test to
mean anything."""

import os
import sys
import time
from pathlib import Path

from dflash.extract.rank_link import open_link

if __name__ == "__main__":
    out, count, rank = Path(sys.argv[1]), os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    link = open_link(1, "cpu", 60.0, ranks_per_node=1)
    link.control.barrier().wait()  # every rank of this start reached every other
    first_start = not (out / f"rank{rank}").exists()  # counts can't tell: the healthy node's stays 0
    with open(out / f"rank{rank}", "a", encoding="utf-8") as f:
        f.write(count + "\n")
    if first_start:
        if rank == "0":
            os._exit(1)
        time.sleep(600)  # torchrun stops these: their node's rank failed, or the other node is back at the rendezvous
    link.control.barrier().wait()
