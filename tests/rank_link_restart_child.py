"""A rank of tests/test_rank_stream.py's two-node restart: opens the job's rank link (one capture rank a node), meets
every other rank, and appends its node's restart count to <out>/rank<RANK>; job rank 0 dies in the first start, so
torchrun restarts the job on both nodes (the healthy node's restart count stays 0)."""

import os
import sys
from pathlib import Path

from dflash.extract.rank_link import open_link

if __name__ == "__main__":
    out, count, rank = Path(sys.argv[1]), os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    link = open_link(1, "cpu", 60.0, ranks_per_node=1)
    link.control.barrier().wait()  # every rank of this start reached every other
    with open(out / f"rank{rank}", "a", encoding="utf-8") as f:
        f.write(count + "\n")
    if rank == "0" and count == "0":
        os._exit(1)
    link.control.barrier().wait()  # in the first start, the ranks left behind fail here and are restarted
