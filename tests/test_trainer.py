"""The trainer: accumulation and data parallelism give the gradient of one big batch; resume continues exactly."""

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import trainer_harness
from tests.forked import run_ranks
from dflash.data.batch_plan import BatchPlan


def test_batch_plan_deals_the_same_global_batches_whatever_the_split():
    one = BatchPlan(num_samples=7, micro_batch_size=1, world_size=1, grad_accum=4, seed=3)
    two = BatchPlan(num_samples=7, micro_batch_size=2, world_size=2, grad_accum=1, seed=3)
    assert one.steps_per_epoch == two.steps_per_epoch == 2
    for step in range(2):
        flat_one = [slot for micro in one.micro_batches(0, step, 0) for slot in micro]
        flat_two = [slot for rank in (0, 1) for micro in two.micro_batches(0, step, rank) for slot in micro]
        assert sorted(flat_one) == sorted(flat_two)
    real = [i for step in range(2) for micro in one.micro_batches(0, step, 0) for i, is_real in micro if is_real]
    assert sorted(real) == list(range(7))  # every sample exactly once per epoch, placeholders not counted


LENGTHS = (5, 90, 12, 60, 33, 7, 81, 20, 44, 71, 3, 58, 26, 95, 14, 38, 66)


def padded_tokens(plan: BatchPlan, epoch: int) -> int:
    """Tokens a run would pad to: per micro-batch, its size x its longest sample."""
    total = 0
    for step in range(plan.steps_per_epoch):
        for rank in range(plan.world_size):
            for micro in plan.micro_batches(epoch, step, rank):
                total += len(micro) * max(plan.lengths[i] for i, _ in micro)
    return total


def test_grouped_batches_cover_every_sample_once_with_less_padding():
    plain = BatchPlan(len(LENGTHS), 2, 1, 1, seed=5, lengths=LENGTHS)
    grouped = BatchPlan(len(LENGTHS), 2, 1, 1, seed=5, group_by_length=4, lengths=LENGTHS)
    for epoch in range(3):
        order = grouped.epoch_order(epoch)
        assert sorted(order) == list(range(len(LENGTHS)))
        assert order[-1] == grouped.epoch_order(epoch)[-1]  # deterministic; the odd sample closes the epoch
        assert padded_tokens(grouped, epoch) < padded_tokens(plain, epoch)
    assert grouped.epoch_order(0) != grouped.epoch_order(1)  # still shuffled per epoch
    # One run spanning the epoch: the full batches are neighbours in the length order, in a shuffled order.
    whole = BatchPlan(len(LENGTHS), 2, 1, 1, seed=5, group_by_length=16, lengths=LENGTHS)
    by_length = sorted(range(len(LENGTHS)), key=lambda i: -LENGTHS[i])
    order = whole.epoch_order(0)
    batches = [order[b : b + 2] for b in range(0, 16, 2)]
    assert sorted(batches) == sorted(by_length[b : b + 2] for b in range(0, 16, 2))
    assert order[-1] == by_length[-1] and batches != [by_length[b : b + 2] for b in range(0, 16, 2)]


def test_grouped_plans_deal_the_same_global_batches_whatever_the_split():
    one = BatchPlan(len(LENGTHS), 1, 1, 4, seed=2, group_by_length=2, lengths=LENGTHS)
    two = BatchPlan(len(LENGTHS), 2, 2, 1, seed=2, group_by_length=2, lengths=LENGTHS)
    for step in range(one.steps_per_epoch):
        flat_one = [slot for micro in one.micro_batches(1, step, 0) for slot in micro]
        flat_two = [slot for rank in (0, 1) for micro in two.micro_batches(1, step, rank) for slot in micro]
        assert sorted(flat_one) == sorted(flat_two)


def test_grouping_needs_every_length_and_plans_differ_by_their_lengths():
    with pytest.raises(ValueError, match="needs the length of each of the 17 samples"):
        BatchPlan(len(LENGTHS), 2, 1, 1, seed=0, group_by_length=2)
    with pytest.raises(ValueError, match="group_by_length must be >= 0"):
        BatchPlan(len(LENGTHS), 2, 1, 1, seed=0, group_by_length=-1, lengths=LENGTHS)
    a = BatchPlan(len(LENGTHS), 2, 1, 1, seed=0, group_by_length=2, lengths=LENGTHS)
    b = BatchPlan(len(LENGTHS), 2, 1, 1, seed=0, group_by_length=2, lengths=LENGTHS[::-1])
    assert a != b and a == BatchPlan(len(LENGTHS), 2, 1, 1, seed=0, group_by_length=2, lengths=tuple(LENGTHS))


def test_two_accumulated_micro_batches_equal_one_double_batch(tmp_path):
    losses_acc, state_acc = trainer_harness.run(str(tmp_path / "acc"), micro_batch_size=1, grad_accum=2)
    losses_big, state_big = trainer_harness.run(str(tmp_path / "big"), micro_batch_size=2, grad_accum=1)
    assert len(losses_acc) == len(losses_big) == 6
    torch.testing.assert_close(torch.tensor(losses_acc), torch.tensor(losses_big), rtol=1e-5, atol=1e-6)
    for name in state_big:
        torch.testing.assert_close(state_acc[name], state_big[name], rtol=1e-4, atol=1e-5)
    assert losses_big[-1] < losses_big[0]  # it learns


def test_resume_from_a_mid_run_checkpoint_gives_the_same_drafter(tmp_path):
    out = str(tmp_path / "run")
    full_losses, full_state = trainer_harness.run(out, 2, 1, save_every=2)  # 6 steps, checkpoints at 2, 4, 6
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write("step2")  # as if the run had been killed during step 3
    os.remove(os.path.join(out, "metrics.jsonl"))
    resumed_losses, resumed_state = trainer_harness.run(out, 2, 1, save_every=2)
    # Data order, anchors, optimizer and LR schedule all resume: steps 3..6 repeat exactly.
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(full_losses[2:]), rtol=1e-6, atol=1e-7)
    for name in full_state:
        torch.testing.assert_close(resumed_state[name], full_state[name], rtol=1e-6, atol=1e-7)


def free_port() -> int:
    """A port nothing listens on now. Only for a listener that must be told its port before it starts (a static
    rendezvous): another one may take it first, so launch_two_nodes retries. A process that is to meet others gets
    the store of held_rendezvous instead, or torchrun --standalone."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def held_rendezvous() -> Iterator[dict[str, str]]:
    """Inside: the variables that make a process started now a rank of a job whose store this process holds, as
    torchrun gives its ranks the store its agent holds (tests/forked.py's run_ranks does the same for forked ranks).
    The store listens before any rank starts: a port merely found free and handed on could be taken by another
    listener (the other xdist worker's gloo pairs and stores) in the seconds before the rank bound it. One job per
    store: its keys would meet the next job's."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0"}
    finally:
        del store


PROCESS_THAT_TRAINS_THEN_STARTS_ANOTHER = """
import os, subprocess, sys
from dflash.train.engine import init_distributed
init_distributed()
assert "MASTER_PORT" not in os.environ, "the single process's rendezvous address leaked into the environment"
child = "from dflash.train.engine import init_distributed; print(init_distributed())"
done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
assert done.returncode == 0, done.stderr[-2000:]
print(done.stdout.strip().splitlines()[-1])
"""


def test_a_single_process_leaves_its_rendezvous_to_itself():
    """A plain process meets only itself at a port the OS picks, and keeps that address out of the environment:
    a process it starts later (a second run from a notebook or a test) does a rendezvous of its own instead
    of inheriting an address this one already listens on."""
    env = {key: value for key, value in launcher_env().items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", PROCESS_THAT_TRAINS_THEN_STARTS_ANOTHER], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "(0, 1, 0)"


def test_a_single_process_given_only_a_port_meets_itself_there():
    """MASTER_PORT without MASTER_ADDR (a port reserved by a scheduler, say): the address is this machine's, as a
    launcher would give it; DeepSpeed otherwise looks for MPI."""
    with held_rendezvous() as rendezvous:
        env = {**launcher_env(), **rendezvous}
        env.pop("MASTER_ADDR")
        done = subprocess.run([sys.executable, "-c", "from dflash.train.engine import init_distributed; "
                               "print(init_distributed())"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "(0, 1, 0)"


def launcher_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The 1-process reference: 1 sample x 2 accumulation steps = the 2-rank global batch."""
    return trainer_harness.run(str(tmp_path_factory.mktemp("one")), micro_batch_size=1, grad_accum=2)


def assert_same_training(result, one_process):
    one_losses, one_state = one_process
    # Same global batches and the same global normalisation: only the float summation order differs
    # (all-reduce vs local accumulation), so losses agree to ~1e-6 and weights after 6 Adam steps to ~1e-5.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(one_losses), rtol=1e-4, atol=1e-5)
    for name in one_state:
        torch.testing.assert_close(result["state"][name], one_state[name], rtol=1e-3, atol=1e-4)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.slow
def test_two_process_zero_matches_one_process_and_resumes_on_one(tmp_path, zero_stage, one_process):
    """ZeRO 1 (optimizer state), 2 (+ gradients), 3 (+ parameters, gathered for the final state dict); then the
    2-rank checkpoint of step 2 resumes on 1 rank (through a universal checkpoint) to the same end."""
    # The 2 ranks fork from a server that imported the trainer once (tests/forked.py): torchrun's processes would each
    # import it again, most of this test's time. The next test launches this harness with torchrun.
    assert run_ranks(trainer_harness.main, 2, str(tmp_path), 1, 1, zero_stage, save_every=2) == [0, 0]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert set(result["state"]) == set(one_process[1])  # ZeRO-3 consolidation returns every full tensor
    assert_same_training(result, one_process)

    with open(tmp_path / "checkpoints" / "latest", "w") as f:
        f.write("step2")  # as if the 2-rank run had died during step 3
    os.remove(tmp_path / "metrics.jsonl")
    losses, state = trainer_harness.run(str(tmp_path), 1, 2, zero_stage=zero_stage, save_every=2)
    assert_same_training({"losses": [0.0, 0.0] + losses, "state": state},
                         ([0.0, 0.0] + one_process[0][2:], one_process[1]))


def launch_two_nodes(out: Path, logs: Path) -> tuple[list[int | None], list[str]]:
    """Two torchrun invocations as node 0 and node 1 (one rank each) of a static rendezvous at a port found free
    here; their exit codes and output. Node 1 is stopped once node 0 has failed: it would wait for it."""
    port = str(free_port())
    logs.mkdir()
    nodes = []
    for node in (0, 1):
        with open(logs / f"node{node}.log", "w", encoding="utf-8") as log:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                 "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                 "tests/trainer_harness.py", str(out), "1", "1", "2"],
                env=launcher_env(), stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [nodes[0].wait(timeout=600)]
        codes.append(nodes[1].wait(timeout=600) if codes[0] == 0 else None)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    return codes, [(logs / f"node{node}.log").read_text(encoding="utf-8") for node in (0, 1)]


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_nodes_on_localhost_match_one_process(tmp_path, one_process):
    """Two torchrun invocations as node 0 and node 1 (one rank each) meeting at the same master, as
    launch/multi_node.sh launches by default (a static rendezvous)."""
    codes, outputs = launch_two_nodes(tmp_path, tmp_path / "launch1")
    if codes[0] != 0 and "address already in use" in outputs[0]:
        # Node 0's agent listens at the port both nodes are given before they start; in the seconds torchrun takes
        # to get there, another listener on this machine (the other xdist worker's) can take it. Not a fault of the
        # run: once more at another port.
        codes, outputs = launch_two_nodes(tmp_path, tmp_path / "launch2")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_training(torch.load(tmp_path / "result.pt", weights_only=True), one_process)


@pytest.mark.gpu(devices=2)
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_gpus_over_nccl_match_one_gpu(tmp_path, zero_stage):
    """The same run as the gloo tests on DeepSpeed's CUDA accelerator: 2 ranks on cuda:0 and cuda:1 talking over
    NCCL against 1 rank accumulating 2 micro-batches on cuda:0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    env.pop("DS_ACCELERATOR", None)
    results = []
    for nproc, accum in ((1, 2), (2, 1)):
        out = tmp_path / f"ranks{nproc}"
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
             "tests/trainer_harness.py", str(out), "1", str(accum), str(zero_stage), "--device", "cuda"],
            check=True, env=env, timeout=600,
        )
        result = torch.load(out / "result.pt", weights_only=True, map_location="cpu")
        assert all(tensor.dtype == torch.float32 for tensor in result["state"].values())
        results.append(result)
    assert len(results[0]["losses"]) == 6
    assert_same_training(results[1], (results[0]["losses"], results[0]["state"]))


def test_entry_accepts_the_deepspeed_local_rank_argument():
    from dflash.config.command_line import strip_local_rank

    env = {key: value for key, value in os.environ.items() if key != "LOCAL_RANK"}
    # --cfg job: Hydra composes and prints the config, then exits: the argument got past Hydra's parser.
    done = subprocess.run(
        [sys.executable, "-m", "dflash.train", "--local_rank=0", "+experiment=tiny", "train.epochs=5", "--cfg", "job"],
        env={**env, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "epochs: 5" in done.stdout
    previous = os.environ.pop("LOCAL_RANK", None)
    try:
        assert strip_local_rank(["--local_rank", "3", "a=1"]) == ["a=1"] and os.environ["LOCAL_RANK"] == "3"
        with pytest.raises(ValueError, match="local_rank"):
            strip_local_rank(["--local_rank=x"])
    finally:
        os.environ.pop("LOCAL_RANK", None)
        if previous is not None:
            os.environ["LOCAL_RANK"] = previous
