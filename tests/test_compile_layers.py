"""train.compile: compiled drafter layers train like eager ones and keep the parameter names (CPU)."""

from __future__ import annotations

import torch

from dflash.models.drafter import DFlashDraftModel
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
