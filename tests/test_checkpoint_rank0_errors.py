"""What every rank raises when rank 0 cannot read the checkpoint folder (two gloo processes on CPU): a corrupt file
(a ConfigError naming it) as itself, so that each rank's command ends with the same one line; any other error as a
ValueError that names it, so no rank waits in a collective until it times out."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.config.errors import CorruptFile
from tests.forked import process_context

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _rank(rank: int, store_file: str, failure: str, results) -> None:
    from dflash.run_files import from_rank0

    # A file store, not a TCP one: a port found free and handed to rank 0 could be taken by another listener first.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)

    def read():
        if failure == "corrupt":
            raise CorruptFile("checkpoints/best/model.safetensors differs from when it was saved; move best/ aside")
        raise OSError("disk gone")

    try:
        from_rank0(read, "the checkpoint folder")
        results[rank] = "no error"
    except Exception as error:  # noqa: BLE001 (the test compares what each rank raised)
        results[rank] = (type(error).__name__, str(error))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("failure,kind,text", [
    ("corrupt", "CorruptFile", "checkpoints/best/model.safetensors differs from when it was saved; move best/ aside"),
    ("other", "ValueError", "rank 0 could not read the checkpoint folder: OSError: disk gone"),
])
def test_every_rank_raises_what_rank_0_met(tmp_path, failure, kind, text):
    results = mp.Manager().dict()
    context = process_context()
    processes = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), failure, results)) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert dict(results) == {0: (kind, text), 1: (kind, text)}
