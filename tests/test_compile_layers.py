"""train.compile: compiled drafter layers train like eager ones and keep the parameter names (CPU)."""

from __future__ import annotations

import pytest
import torch

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.train.batches import prepare_micro_batch
from dflash.train.compile_layers import compile_layers
from dflash.train.forward import training_forward
from dflash.train.objective import weighted_block_loss
from tests import trainer_harness


def loss_and_grads(model: DFlashDraftModel, batch: dict) -> tuple[float, list[torch.Tensor]]:
    embed, head = trainer_harness.frozen_head()
    hidden = training_forward(model, embed, batch["input_ids"], batch["hidden"], batch["anchors"], attention="sdpa")
    loss, *_ = weighted_block_loss(hidden, head, batch["labels"], batch["weights"], 7)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_compiled_layers_give_the_eager_loss_and_gradients(one_thread):
    config = trainer_harness.drafter_config()  # one sliding + one full layer
    eager = DFlashDraftModel(config)
    eager.init_weights(0)
    compiled = DFlashDraftModel(config)
    compiled.load_state_dict(eager.state_dict())
    assert compile_layers(compile_layers(compiled)) is compiled  # applying twice changes nothing
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints keep their names
    store = trainer_harness.synthetic_store()
    # Two padded lengths: the dynamic-shape graph serves both without a wrong result.
    for slots in ([(0, True), (3, True)], [(5, True), (1, True)]):
        batch = prepare_micro_batch(store, slots, epoch=0, seed=0, num_anchors=4, block_size=4, gamma=4.0)
        for model in (eager, compiled):
            model.zero_grad()
        loss, grads = loss_and_grads(eager, batch)
        compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
        assert abs(loss - compiled_loss) <= 1e-5 * abs(loss)
        for grad, compiled_grad in zip(grads, compiled_grads):
            torch.testing.assert_close(compiled_grad, grad, rtol=1e-4, atol=1e-6)


def new_graphs(run) -> int:
    """Graphs dynamo compiled while run() ran."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    run()
    return counters["stats"]["unique_graphs"] - before


def test_a_first_length_equal_to_the_query_count_does_not_pin_later_lengths(one_thread):
    # Duck sizing gave equal sizes one symbol: a first micro-batch padded to exactly as many tokens as it has
    # queries (anchors x block size; 1,024 in the recipe) tied the two, and every later length recompiled.
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, vocab_size=64, num_target_layers=4,
                           target_layer_ids=[0, 2], mask_token_id=63, block_size=4)
    torch._dynamo.reset()
    model = compile_layers(DFlashDraftModel(config))
    embed = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)

    def step(length: int, anchors: int) -> None:
        samples = [{"input_ids": torch.randint(0, 63, (n,), generator=generator),
                    "loss_mask": torch.ones(n, dtype=torch.long),
                    "hidden": torch.randn(n, 2 * 32, generator=generator)} for n in (length, length - 3)]
        batch = prepare_micro_batch(samples, [(0, True), (1, True)], epoch=0, seed=0, num_anchors=anchors,
                                    block_size=4, gamma=4.0)
        assert batch["input_ids"].shape[1] == length
        training_forward(model, embed, batch["input_ids"], batch["hidden"], batch["anchors"],
                         attention="sdpa").sum().backward()

    assert new_graphs(lambda: step(32, 8)) >= 1  # 32 tokens, 8 anchors x 4 = 32 queries
    assert new_graphs(lambda: step(27, 8)) == 0
    assert new_graphs(lambda: step(40, 5)) == 0


@pytest.mark.gpu(reason="inductor's Triton kernels")
def test_compiled_layers_serve_changing_shapes_on_cuda():
    """The recipe's case that crashed inductor's generated backward on an H200: bf16 layers of the SmolLM2 drafter
    shape (head_dim 64), flex attention, micro-batches whose padded length and anchor count change every step.
    Every shape must run, and the compiled layers must be as close to a float32 reference as the eager bf16
    layers are: bf16 alone puts single gradient entries far apart (an H200 run saw 0.3 between eager and compiled),
    so each is measured against float32 rather than against the other."""
    config = DrafterConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=512, num_target_layers=4,
                           target_layer_ids=[0, 2], mask_token_id=511, block_size=16)
    device = torch.device("cuda")
    # Alone or after the CPU test above, the same: graphs compiled there for the same layer code are dropped.
    torch._dynamo.reset()
    torch.manual_seed(0)
    with device:
        reference = DFlashDraftModel(config)
        eager = DFlashDraftModel(config).to(torch.bfloat16)
        compiled = DFlashDraftModel(config).to(torch.bfloat16)
    eager.load_state_dict(reference.state_dict())
    compiled.load_state_dict(reference.state_dict())
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    compile_layers(compiled)
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(512, 576, generator=generator) * 0.02).to(device, torch.bfloat16)
    head = (torch.randn(512, 576, generator=generator) * 0.02).to(device, torch.bfloat16)
    anchors_seen: list[int] = []
    for lengths, anchors in (([512] * 8, 64), ([577, 300] * 4, 64), ([1024, 900] * 4, 32), ([129] * 8, 32),
                             ([700, 650] * 4, 64)):
        samples = [{"input_ids": torch.randint(0, 511, (n,), generator=generator),
                    "loss_mask": torch.ones(n, dtype=torch.long),
                    "hidden": torch.randn(n, 2 * 576, generator=generator).to(torch.bfloat16)} for n in lengths]
        batch = prepare_micro_batch(samples, [(i, True) for i in range(len(samples))], epoch=0, seed=0,
                                    num_anchors=anchors, block_size=16, gamma=7.0)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        losses = []

        def train_pass(model) -> None:
            dtype = next(model.parameters()).dtype
            model.zero_grad()
            hidden = training_forward(model, embed.to(dtype), batch["input_ids"], batch["hidden"].to(dtype),
                                      batch["anchors"], attention="flex")
            loss, *_ = weighted_block_loss(hidden, head.to(dtype), batch["labels"], batch["weights"], 7)
            loss.backward()
            losses.append(loss.item())

        train_pass(reference)
        train_pass(eager)
        graphs = new_graphs(lambda: train_pass(compiled))
        # The graphs of the first shape serve every later one: a new anchor count (the 64 slots once shared a
        # symbol with head_dim 64) or length recompiled before (16 s at step 2 and 27 s at step 74 on an H200).
        assert graphs >= 1 if anchors_seen == [] else graphs == 0, (lengths, anchors, graphs)
        anchors_seen.append(anchors)
        assert abs(losses[2] - losses[0]) <= 2e-2 * abs(losses[0]), (lengths, anchors, losses)
    for (name, p_ref), p_eager, p_compiled in zip(reference.named_parameters(), eager.parameters(),
                                                  compiled.parameters()):
        scale = p_ref.grad.norm()
        eager_error = float((p_eager.grad.float() - p_ref.grad).norm() / scale)
        compiled_error = float((p_compiled.grad.float() - p_ref.grad).norm() / scale)
        assert compiled_error <= 2 * eager_error + 1e-3, (name, compiled_error, eager_error)


@pytest.mark.slow
def test_a_float_of_the_layers_is_a_constant_of_their_graphs_not_a_tensor_made_each_call(one_thread, monkeypatch):
    """By default dynamo turns a Python float that reaches a graph (an RMSNorm's epsilon) into a 0-d tensor input,
    made on the host at every call; compiled here, the epsilons are constants and no call makes one."""
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, vocab_size=64, num_target_layers=4,
                           target_layer_ids=[0, 2], mask_token_id=63, block_size=4)
    made = []
    as_tensor = torch._as_tensor_fullprec  # what dynamo's generated code calls on such a float, at every call

    def counted(value):
        made.append(value)
        return as_tensor(value)

    monkeypatch.setattr(torch, "_as_tensor_fullprec", counted)
    torch._dynamo.reset()
    model = compile_layers(DFlashDraftModel(config))
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 63, (n,), generator=generator),
                "loss_mask": torch.ones(n, dtype=torch.long),
                "hidden": torch.randn(n, 2 * 32, generator=generator)} for n in (20, 17)]
    batch = prepare_micro_batch(samples, [(0, True), (1, True)], epoch=0, seed=0, num_anchors=4, block_size=4,
                                gamma=4.0)
    embed = torch.randn(64, 32, generator=generator)
    for _ in range(2):
        training_forward(model, embed, batch["input_ids"], batch["hidden"], batch["anchors"],
                         attention="sdpa").sum().backward()
    assert made == []
