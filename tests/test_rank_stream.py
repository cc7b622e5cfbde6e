"""capture=online over the job's process group, the protocol alone: micro-batch units in the BatchPlan's order, their
wire form, and capture ranks sending them to trainer ranks over gloo (CPU) with credits, early stops and a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from dflash.data.batch_plan import BatchPlan
from dflash.data.feature_source import collate
from dflash.extract.fp8 import quantize_fp8
from dflash.extract.rank_stream import UnitHeader, UnitStream, encode_unit
from dflash.extract.sample_format import decode_single, sample_tensors
from tests.forked import run_ranks

LENGTHS = [5 + (7 * i) % 11 for i in range(13)]
WIDTH = 6


def stored_sample(index: int, fp8: bool = False) -> dict[str, torch.Tensor]:
    """Sample `index`'s stored tensors: features that name the sample, so a misrouted one cannot pass."""
    length = LENGTHS[index]
    generator = torch.Generator().manual_seed(index)
    hidden = torch.randn(length, WIDTH, generator=generator) + index
    ids = torch.arange(length, dtype=torch.int64) + 100 * index
    mask = (torch.arange(length) % 3 != 0).long()
    scales = None
    if fp8:
        hidden, scales = quantize_fp8(hidden, 2)
    return sample_tensors(hidden, ids, mask, torch.tensor([0, length]), scales)


def test_units_deal_the_batch_plan_and_split_between_capture_and_trainer_ranks():
    plan = BatchPlan(len(LENGTHS), micro_batch_size=2, world_size=3, grad_accum=2, seed=5)
    stream = UnitStream(plan, epochs=2)
    for step in range(2 * plan.steps_per_epoch):
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        for rank in range(3):
            mine = list(stream.trainer_units(rank, step))[:plan.grad_accum]
            expected = [[i for i, _ in micro] for micro in plan.micro_batches(epoch, in_epoch, rank)]
            assert [stream.indices(u) for u in mine] == expected
    for first_step in (0, 3):
        every = sorted(u for c in range(2) for u in stream.capture_units(c, 2, first_step))
        assert every == list(range(stream.first_unit(first_step), stream.num_units))
        assert sorted(u for r in range(3) for u in stream.trainer_units(r, first_step)) == every
        assert all(u % 2 == c for c in range(2) for u in stream.capture_units(c, 2, first_step))  # one group: u % C


def test_every_node_layout_keeps_each_nodes_units_on_its_own_capture_ranks():
    """2 nodes of 3 ranks, the last of each capturing: trainers 0, 1 on job ranks 0, 1 (node 0) and 2, 3 on 3, 4
    (node 1); each node's units go round-robin over its own capture ranks, none made twice, from any step."""
    from dflash.extract.rank_link import every_node_layout, last_ranks_layout

    layout = every_node_layout(6, 3, 1)
    assert (layout.trainer_ranks, layout.capture_ranks) == ((0, 1, 3, 4), (2, 5))
    assert [(g.trainers, g.captures) for g in layout.groups] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    assert layout.group_of(4) == layout.group_of(5) == layout.groups[1]
    assert every_node_layout(4, 4, 2) == last_ranks_layout(4, 2)  # one node: the job's last ranks
    plan = BatchPlan(len(LENGTHS), micro_batch_size=1, world_size=4, grad_accum=2, seed=5)
    stream = UnitStream(plan, epochs=2)
    for first_step in (0, 3):
        for trainers in (range(0, 2), range(2, 4)):
            made = [list(stream.capture_units(c, 2, first_step, trainers)) for c in range(2)]  # 2 capture ranks
            assert all(stream.maker(u, 2, trainers) == c for c, units in enumerate(made) for u in units)
            assert all(units == sorted(units) for units in made)
            assert sorted(made[0] + made[1]) == sorted(u for r in trainers for u in stream.trainer_units(r, first_step))
            assert len(made[0]) == len(made[1])  # a node's capture ranks share its units evenly


@pytest.mark.parametrize("fp8", [False, True])
def test_a_unit_travels_as_a_header_and_its_tensors_into_the_padded_micro_batch(fp8):
    indices = [4, 1, 4]
    stored = [stored_sample(i, fp8) for i in indices]
    header, *tensors = encode_unit(17, indices, stored)
    unit = UnitHeader.parse(header)
    assert (unit.unit, unit.indices, unit.lengths) == (17, indices, [LENGTHS[i] for i in indices])
    sent = iter(tensors)

    def recv(buffer):
        tensor = next(sent)
        assert (buffer.shape, buffer.dtype) == (tensor.shape, tensor.dtype)
        buffer.copy_(tensor)
    batch = unit.receive(recv, torch.device("cpu"))
    assert next(sent, None) is None
    expected = collate([decode_single(s) for s in stored])
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key


def _role(captures: int, spec: dict, results) -> None:
    """A rank of run_roles's job; with spec["nodes"] the job's ranks are split into that many nodes, each node's last
    captures / nodes ranks capturing (capture.ranks_per_node)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nodes = spec.get("nodes")
    if nodes:
        local_world_size = world_size // nodes
        os.environ.update({"LOCAL_RANK": str(rank % local_world_size), "LOCAL_WORLD_SIZE": str(local_world_size)})
    from dflash.extract.capture_sender import CaptureSender
    from dflash.extract.feature_cache import FeatureCache
    from dflash.extract.linked_source import LinkedFeatureSource
    from dflash.extract.rank_link import open_link

    time.sleep(spec.get("late", {}).get(rank, 0.0))  # a rank whose start took that much longer
    link = open_link(captures, "cpu", spec["timeout_s"], ranks_per_node=captures // nodes if nodes else None)
    plan = BatchPlan(len(LENGTHS), spec["micro_batch_size"], link.trainers, spec["grad_accum"], seed=3)
    stream = UnitStream(plan, spec["epochs"])
    cache = FeatureCache(spec["cache_dir"]) if spec.get("cache_dir") else None
    try:
        if link.is_capture:
            if link.capture_index == spec.get("hang"):
                # Silent until every trainer rank has given up (well past their timeout at most).
                deadline = time.monotonic() + spec["timeout_s"] * 3
                while time.monotonic() < deadline and not all(r in results for r in link.layout.trainer_ranks):
                    time.sleep(0.05)
                return
            captured = UnitStream(plan, 1) if cache is not None else stream  # with a cache: the first epoch only
            sender = CaptureSender(link, captured, spec["first_step"], lambda ids: [stored_sample(i) for i in ids],
                                   LENGTHS, batch_tokens=spec["batch_tokens"], in_flight=spec["in_flight"])
            sender.run()
            results[f"done-{rank}"] = True
            results[rank] = sender.units_sent
            return
        trainer = link.trainer_index
        source = LinkedFeatureSource(link, stream, trainer, spec["first_step"], spec["in_flight"], cache)
        read = []
        for step in range(spec["first_step"], spec.get("stop_at", spec["epochs"] * plan.steps_per_epoch)):
            epoch, in_epoch = divmod(step, plan.steps_per_epoch)
            if cache is not None and epoch > 0 and f"captures-done-{rank}" not in results:
                # The capture ranks must be done once the captured epoch is taken, not wait for this rank's stop
                # until it finishes reading the cached epochs (longer than their receive timeout in a real run).
                deadline = time.monotonic() + 60
                while not all(f"done-{c}" in results for c in link.layout.capture_ranks):
                    assert time.monotonic() < deadline, "the capture ranks still wait while the cache is read"
                    time.sleep(0.05)
                results[f"captures-done-{rank}"] = True
            for micro in plan.micro_batches(epoch, in_epoch, trainer):
                indices = [i for i, _ in micro]
                batch = source.micro_batch(indices)
                expected = torch.stack([torch.nn.functional.pad(decode_single(stored_sample(i))["hidden"],
                                                                (0, 0, 0, batch["hidden"].shape[1] - LENGTHS[i]))
                                        for i in indices])
                assert torch.equal(batch["hidden"], expected)
                read.append(indices)
        source.close()
        results[rank] = read
    except Exception as error:  # noqa: BLE001 (reported to the test)
        results[rank] = f"{type(error).__name__}: {error}"


def run_roles(captures: int, trainers: int, **spec) -> dict:
    spec = {"micro_batch_size": 2, "grad_accum": 2, "epochs": 2, "first_step": 0, "in_flight": 1,
            "batch_tokens": 30, "timeout_s": 30.0, **spec}
    results = mp.Manager().dict()
    run_ranks(_role, captures + trainers, captures, spec, results)
    return dict(results)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_capture_ranks_feed_two_trainer_ranks_every_micro_batch_once_from_the_resumed_step():
    results = run_roles(2, 2, first_step=2)
    plan = BatchPlan(len(LENGTHS), 2, 2, 2, seed=3)
    for rank in range(2):
        expected = [[i for i, _ in micro] for step in range(2, 2 * plan.steps_per_epoch)
                    for micro in plan.micro_batches(*divmod(step, plan.steps_per_epoch), rank)]
        assert results[rank] == expected
    assert results[2] + results[3] == 2 * (2 * plan.steps_per_epoch - 2) * 2  # units sent, none twice


@pytest.mark.slow
@pytest.mark.multiproc
def test_on_two_nodes_each_nodes_capture_rank_feeds_the_nodes_trainers():
    """Two nodes of 2 trainers + 1 capture rank (capture.ranks_per_node=1): job ranks 0, 1 | 2 and 3, 4 | 5;
    trainers 2 and 3 run on job ranks 3 and 4 and read every micro-batch of theirs once, from node 1's capture
    rank only."""
    results = run_roles(2, 4, first_step=1, nodes=2, in_flight=2, micro_batch_size=1)
    plan = BatchPlan(len(LENGTHS), 1, 4, 2, seed=3)
    steps = 2 * plan.steps_per_epoch
    for trainer, job_rank in enumerate([0, 1, 3, 4]):
        expected = [[i for i, _ in micro] for step in range(1, steps)
                    for micro in plan.micro_batches(*divmod(step, plan.steps_per_epoch), trainer)]
        assert results[job_rank] == expected, results
    assert results[2] == results[5] == (steps - 1) * 2 * 2  # each node's units: 2 micro-steps x 2 trainers a step


@pytest.mark.slow
@pytest.mark.multiproc
def test_with_a_cache_the_capture_ranks_finish_with_the_first_epoch_and_a_resume_reads_the_cache(tmp_path):
    """Trainer ranks keep the first epoch's samples and read the second from the cache; the capture ranks end as
    soon as the first epoch is taken (each trainer waits for that before reading the cache), and a resume inside
    the cached epoch needs nothing captured: the capture ranks end at once."""
    plan = BatchPlan(len(LENGTHS), 2, 2, 2, seed=3)
    steps = 2 * plan.steps_per_epoch
    for first_step in (0, plan.steps_per_epoch + 1):
        results = run_roles(2, 2, first_step=first_step, cache_dir=str(tmp_path / "cache"))
        for rank in range(2):
            expected = [[i for i, _ in micro] for step in range(first_step, steps)
                        for micro in plan.micro_batches(*divmod(step, plan.steps_per_epoch), rank)]
            assert results[rank] == expected, results
        units_of_first_epoch = plan.steps_per_epoch * 2 * 2
        assert results[2] + results[3] == (units_of_first_epoch if first_step == 0 else 0)


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainers_that_stop_early_end_the_stream_cleanly():
    results = run_roles(1, 2, stop_at=2, in_flight=3)
    assert all(isinstance(results[r], list) and len(results[r]) == 4 for r in range(2)), results
    assert isinstance(results[2], int)  # the capture rank ended without an error


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hung_capture_rank_ends_in_a_timeout_naming_it():
    results = run_roles(1, 1, hang=0, timeout_s=3.0)
    assert "TimeoutError" in results[0] and "capture rank 1" in results[0], results


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_rank_that_starts_later_than_the_receive_timeout_still_joins():
    # capture.timeout_s is how long a rank waits for a hung peer's message; the ranks of a start arrive as far apart
    # as their startup takes (more on a loaded machine), which must not count against it.
    results = run_roles(1, 1, timeout_s=2.0, late={1: 5.0})
    assert isinstance(results[0], list) and isinstance(results[1], int), results


def test_a_job_without_room_for_both_roles_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from dflash.config import compose
    from dflash.pipeline import run_command

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["+experiment=tiny", "capture=online", "capture.ranks=2",
                   f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exited:
        run_command(cfg)
    assert exited.value.code == 2
    assert "capture.ranks=2 capture rank(s) and at least one trainer rank in one job, but this job has 2 process(es)" \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_capture_rank_of_several_gpus_takes_them_after_the_trainers_one_each(monkeypatch):
    """One node, CUDA_VISIBLE_DEVICES = the 3 trainer GPUs, then 2 capture ranks of 2 GPUs each (launch/one_node.sh)."""
    from dflash.config import ConfigError
    from dflash.extract import rank_link

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    _, local_trainers = rank_link.job_layout(5, 4, 4, 2, None)
    layout = [rank_link.rank_devices("auto", r, local_trainers, 2) for r in range(5)]
    assert [[str(d) for d in devices] for devices in layout] == [
        ["cuda:0"], ["cuda:1"], ["cuda:2"], ["cuda:3", "cuda:4"], ["cuda:5", "cuda:6"]]
    assert [str(d) for d in rank_link.rank_devices("auto", 4, 3, 1)] == ["cuda:4"]  # one GPU each: LOCAL_RANK
    assert [str(d) for d in rank_link.rank_devices("cuda:0", 4, 3, 2)] == ["cuda:0"]  # a named device as named
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # 6 ranks over two nodes: each node's layout is the same
    _, local_trainers = rank_link.job_layout(6, 5, 2, 1, ranks_per_node=1)
    assert [str(d) for d in rank_link.rank_devices("auto", 2, local_trainers, 2)] == ["cuda:2", "cuda:3"]
    _, local_trainers = rank_link.job_layout(6, 5, 2, 2, None)  # the job's last 2 ranks: node 1 only
    with pytest.raises(ConfigError, match="one node only; on several nodes set capture.ranks_per_node"):
        rank_link.rank_devices("auto", 2, local_trainers, 2)


def test_every_node_layout_needs_the_same_ranks_on_every_node_and_a_trainer_on_each(monkeypatch):
    from dflash.config import ConfigError
    from dflash.extract import rank_link

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="same number of ranks on every node"):
        rank_link.job_layout(5, 4, 1, 1, ranks_per_node=1)  # 3 + 2 ranks
    with pytest.raises(ConfigError, match="capture.ranks_per_node=3 capture rank.* on every node, but a node of "
                                          "this job has 3 process"):
        rank_link.job_layout(6, 0, 0, 1, ranks_per_node=3)


def test_the_capture_gpus_must_make_whole_capture_ranks(monkeypatch):
    from types import SimpleNamespace

    from dflash.config import ConfigError
    from dflash.extract.rank_link import capture_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    target = {"kind": "tiny"}
    def capture(devices, ranks, ranks_per_node=None):
        return SimpleNamespace(devices=devices, gpus_per_worker=2, ranks=ranks, ranks_per_node=ranks_per_node)
    assert capture_gpus(capture([0, 1, 2, 3], 2), target) == 2
    assert capture_gpus(capture(None, 3), target) == 2
    assert capture_gpus(capture([4, 5, 6, 7], 1, ranks_per_node=2), target) == 2  # a node's capture GPUs
    with pytest.raises(ConfigError, match="capture.devices lists 4 GPU.*capture.ranks=1 .* need 2"):
        capture_gpus(capture([0, 1, 2, 3], 1), target)


def test_each_start_of_a_job_takes_store_keys_no_earlier_start_wrote():
    """In torchrun's agent store, which outlives the starts, the restart count names the start on one node; on
    several nodes (counts per node) a job that may restart is refused before it opens. A store of the ranks' own
    (a store per start, or no torchrun) is new at every start: a fixed prefix."""
    from dflash.config import ConfigError
    from dflash.extract.rank_link import start_prefix

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2",
              "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert start_prefix(shared, one_node=True) == "dflash/start2"
    with pytest.raises(ConfigError, match="several nodes with torchrun --max-restarts needs a store per start"):
        start_prefix(shared, one_node=False)
    assert start_prefix({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}, one_node=False) == "dflash/start2"
    assert start_prefix({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}, one_node=False) == "dflash/start"
    assert start_prefix({}, one_node=False) == "dflash/start"


@pytest.mark.slow
def test_a_job_on_two_nodes_meets_again_after_a_restart(tmp_path):
    """Two torchrun agents (two "nodes" of 2 ranks, c10d rendezvous, a store per start as launch/multi_node.sh sets):
    job rank 0 dies in the first start, torchrun restarts both nodes with restart counts 1 and 0, and every rank of
    the second start opens its link. With one store for every start the nodes' prefixes differed and the second
    start hung until capture.timeout_s."""
    import subprocess
    import sys

    from tests.test_trainer import held_rendezvous, launcher_env

    child = os.path.join(os.path.dirname(__file__), "rank_link_restart_child.py")
    env = {**launcher_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # The rendezvous store is the test's, both agents its clients: a port found free and handed on could be taken.
    with held_rendezvous() as rendezvous:
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                                    "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                    f"127.0.0.1:{rendezvous['MASTER_PORT']}", "--rdzv-conf", "is_host=false",
                                    "--rdzv-id", "restart", "--max-restarts", "1", "--monitor-interval", "1", child,
                                    str(tmp_path)],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for _ in range(2)]
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), outputs[0][-2000:] + outputs[1][-2000:]
    counts = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(counts) == ["rank0", "rank1", "rank2", "rank3"] and all(len(c) == 2 for c in counts.values())
    # Both starts met on both nodes: the failed node's two ranks came back with restart count 1, the healthy node's
    # with 0 (the rendezvous may number the nodes either way in the second start).
    assert [c[0] for c in counts.values()] == ["0"] * 4
    assert sorted(c[1] for c in counts.values()) == ["0", "0", "1", "1"]


def test_a_send_or_receive_posted_to_a_peer_that_is_gone_names_it():
    """Posting to a closed connection fails at once (gloo: "Connection closed by peer"), before any wait: the error
    names the peer as a failed wait does."""
    from types import SimpleNamespace

    from dflash.extract.capture_sender import CaptureSender

    def closed(*args):
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")

    link = SimpleNamespace(rank=3, timeout_s=60.0, trainer_rank=lambda trainer: trainer,
                           name=lambda peer: f"trainer rank {peer}", control=SimpleNamespace(recv=closed, send=closed))
    sender = object.__new__(CaptureSender)
    sender.link = link
    with pytest.raises(RuntimeError, match=r"^online capture, rank 3: the next credit with trainer rank 1 failed "
                                           r"\(rank 1 is gone\?\): .*Connection closed by peer"):
        sender._post_credit(1)
