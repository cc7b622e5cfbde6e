"""The DFlash objective: training forward == inference forward per anchor, and mask/labels vs a loop reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.train.forward import training_forward
from dflash.train.objective import (
    block_attention_masks,
    block_targets,
    loss_rows,
    sample_anchors,
    valid_anchor_positions,
    weighted_block_loss,
)

HIDDEN, TAPS, VOCAB, BLOCK = 32, 3, 50, 4


def make_drafter(layer_types, window=None, seed=0):
    config = DrafterConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_target_layers=6, target_layer_ids=[0, 2, 4],
        mask_token_id=VOCAB - 1, block_size=BLOCK, layer_types=layer_types, sliding_window=window,
    )
    drafter = DFlashDraftModel(config).double()
    drafter.init_weights(seed, std=0.2)
    return drafter.double()


def inference_forward(drafter, embed_weight, input_ids, target_hidden, anchor):
    """What decoding does for one block: context = features[:anchor], block alone, default masks."""
    block = torch.full((1, BLOCK), drafter.config.mask_token_id)
    block[0, 0] = input_ids[0, anchor]
    positions = torch.arange(anchor + BLOCK)[None]
    return drafter(positions, F.embedding(block, embed_weight), target_hidden[:, :anchor])


@pytest.mark.parametrize(
    "layer_types,window",
    [
        (["full_attention", "full_attention"], None),
        (["sliding_attention", "sliding_attention"], 6),  # window shorter than the context: the window matters
        (["sliding_attention", "full_attention"], 5),
    ],
)
def test_training_forward_equals_inference_forward_for_every_anchor(layer_types, window):
    torch.manual_seed(0)
    seq_len = 14
    drafter = make_drafter(layer_types, window)
    embed_weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    input_ids = torch.randint(0, VOCAB - 1, (1, seq_len))
    target_hidden = torch.randn(1, seq_len, TAPS * HIDDEN, dtype=torch.float64)
    anchors = torch.arange(seq_len)[None]  # every anchor at once, overlapping blocks included
    with torch.no_grad():
        trained = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors).view(seq_len, BLOCK, -1)
        for anchor in range(seq_len):
            expected = inference_forward(drafter, embed_weight, input_ids, target_hidden, anchor)[0]
            torch.testing.assert_close(trained[anchor], expected, rtol=1e-10, atol=1e-10)


def test_training_forward_in_a_padded_batch_matches_each_sequence_alone():
    torch.manual_seed(1)
    drafter = make_drafter(["sliding_attention", "full_attention"], 5)
    embed_weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    lengths = [12, 7]
    input_ids = torch.randint(0, VOCAB - 1, (2, 12))
    target_hidden = torch.randn(2, 12, TAPS * HIDDEN, dtype=torch.float64)
    anchors = torch.tensor([[2, 5, 9], [1, 3, 6]])
    with torch.no_grad():
        batched = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors)
        for row, length in enumerate(lengths):
            alone = training_forward(
                drafter, embed_weight, input_ids[row : row + 1, :length], target_hidden[row : row + 1, :length],
                anchors[row : row + 1],
            )
            torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-10, atol=1e-10)


def reference_mask(anchors, context_len, layer_type, window):
    """Loop-based statement of method.md §4, one (query, key) pair at a time."""
    queries = [(j, k, a + k, a) for j, a in enumerate(anchors) for k in range(BLOCK)]
    keys = [("ctx", None, c) for c in range(context_len)] + [("blk", j, a + k) for j, a in enumerate(anchors)
                                                                for k in range(BLOCK)]
    mask = torch.zeros(len(queries), len(keys), dtype=torch.bool)
    for qi, (j, k, q_pos, anchor) in enumerate(queries):
        for ki, (kind, key_block, k_pos) in enumerate(keys):
            if kind == "ctx":
                visible = k_pos < anchor
            else:
                visible = key_block == j
                if layer_type == "sliding_attention":
                    visible = visible and k_pos <= q_pos
            if layer_type == "sliding_attention":
                visible = visible and q_pos - k_pos < window
            mask[qi, ki] = visible
    return mask


@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 6)])
def test_block_mask_matches_loop_reference(layer_type, window):
    anchors = [0, 3, 4, 9]
    masks = block_attention_masks(torch.tensor([anchors]), 12, BLOCK, [layer_type], window)
    torch.testing.assert_close(masks[layer_type][0, 0], reference_mask(anchors, 12, layer_type, window))


def test_labels_and_weights_match_loop_reference():
    gamma = 2.0
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    anchors = torch.tensor([[2, 4, 6, 0]])
    valid = torch.tensor([[True, True, True, False]])
    labels, weights = block_targets(input_ids, loss_mask, anchors, valid, BLOCK, gamma)
    for j, anchor in enumerate(anchors[0].tolist()):
        for k in range(BLOCK):
            pos = anchor + k
            expected_weight = 0.0
            if k > 0 and pos < 8 and loss_mask[0, pos] and valid[0, j]:
                expected_weight = math.exp(-(k - 1) / gamma)
                assert labels[0, j, k] == input_ids[0, pos]  # same-position label, not shifted
            assert weights[0, j, k].item() == pytest.approx(expected_weight)


def test_anchor_sampling_is_valid_distinct_and_seeded():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    assert valid_anchor_positions(loss_mask[0]).nonzero().flatten().tolist() == [2, 3, 4, 7]
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    anchors, valid = sample_anchors(loss_mask, 3, generators)
    assert set(anchors[0].tolist()) <= {2, 3, 4, 7} and len(set(anchors[0].tolist())) == 3
    assert valid[0].all() and valid[1].tolist() == [True, False, False] and anchors[1, 0] == 1
    again, _ = sample_anchors(loss_mask, 3, [torch.Generator().manual_seed(s) for s in (0, 1)])
    assert torch.equal(anchors, again)


def test_chunked_loss_equals_dense_cross_entropy_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3 * BLOCK, HIDDEN, dtype=torch.float64, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 3, BLOCK))
    weights = torch.rand(2, 3, BLOCK, dtype=torch.float64) * (torch.rand(2, 3, BLOCK) > 0.3)
    loss_sum, weight_sum, correct, counts = weighted_block_loss(hidden, head, labels, weights.float(), chunk_size=5)
    dense = (F.cross_entropy((hidden @ head.t()).reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
             * weights.reshape(-1).float()).sum()
    torch.testing.assert_close(loss_sum, dense.float(), rtol=1e-5, atol=1e-5)
    (grad_chunked,) = torch.autograd.grad(loss_sum, hidden)
    (grad_dense,) = torch.autograd.grad(dense, hidden)
    torch.testing.assert_close(grad_chunked, grad_dense, rtol=1e-4, atol=1e-6)
    assert counts.sum() == (weights > 0).sum() and weight_sum == pytest.approx(weights.float().sum().item())


@pytest.mark.parametrize("weighting, kl", [("exp_decay", 0.0), ("dpace", 0.0), ("exp_decay", 0.5)])
def test_loss_rows_from_the_host_give_the_same_loss(weighting, kl):
    """The trainer hands weighted_block_loss the loss rows found on the host (prepare_micro_batch); the result is
    the one it computes itself from the weights, bit for bit."""
    torch.manual_seed(1)
    hidden = torch.randn(2, 3 * BLOCK, HIDDEN, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, 3, BLOCK))
    weights = torch.rand(2, 3, BLOCK) * (torch.rand(2, 3, BLOCK) > 0.3)
    weights[1] = 0  # a placeholder sequence
    target = torch.randn(2, 3 * BLOCK, HIDDEN) if kl else None
    args = (hidden, head, labels, weights, 5, weighting, 0.5, kl, target)
    own = weighted_block_loss(*args)
    given = weighted_block_loss(*args, rows=loss_rows(weights))
    for a, b in zip(own, given):
        assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(own[0], hidden)[0], torch.autograd.grad(given[0], hidden)[0])
    anchors, valid = sample_anchors(torch.zeros(0, 8, dtype=torch.long), 3, [])  # an empty batch: empty anchors
    assert anchors.shape == valid.shape == (0, 3)


def test_rope_angles_survive_a_bf16_cast():
    """Module.to(bfloat16) must not round the RoPE frequencies (angles would be off by radians at long positions)."""
    drafter = make_drafter(["full_attention"])
    positions = torch.tensor([[8000]])
    cos32, _ = drafter.rotary_emb(positions, torch.float32)
    drafter.to(torch.bfloat16)
    cos16, _ = drafter.rotary_emb(positions, torch.float32)
    torch.testing.assert_close(cos16, cos32)


# FlexAttention path: the same equivalences through BlockMasks (eager flex on CPU: it applies the mask_mod to every
# element; the tile lists that the CUDA kernels skip by are checked against the dense mask separately).

FLEX_CASES = [
    (["full_attention", "full_attention"], None),
    (["sliding_attention", "sliding_attention"], 6),
    (["sliding_attention", "full_attention"], 5),
]


@pytest.mark.parametrize("layer_types,window", FLEX_CASES)
def test_flex_training_forward_equals_inference_forward_for_every_anchor(layer_types, window):
    torch.manual_seed(0)
    seq_len = 14
    drafter = make_drafter(layer_types, window)
    embed_weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    input_ids = torch.randint(0, VOCAB - 1, (1, seq_len))
    target_hidden = torch.randn(1, seq_len, TAPS * HIDDEN, dtype=torch.float64)
    anchors = torch.arange(seq_len)[None]
    with torch.no_grad():
        trained = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors, attention="flex")
        trained = trained.view(seq_len, BLOCK, -1)
        for anchor in range(seq_len):
            expected = inference_forward(drafter, embed_weight, input_ids, target_hidden, anchor)[0]
            torch.testing.assert_close(trained[anchor], expected, rtol=1e-10, atol=1e-10)


def test_flex_and_sdpa_agree_on_a_padded_batch():
    # Forward only: torch has no FlexAttention backward on CPU (the CUDA path trains through it).
    torch.manual_seed(1)
    drafter = make_drafter(["sliding_attention", "full_attention"], 5)
    embed_weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    input_ids = torch.randint(0, VOCAB - 1, (2, 12))
    target_hidden = torch.randn(2, 12, TAPS * HIDDEN, dtype=torch.float64)
    anchors = torch.tensor([[2, 5, 9], [1, 3, 0]])  # row 1 ends with a padding anchor, as sample_anchors pads
    with torch.no_grad():
        sdpa = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors, attention="sdpa")
        flex = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors, attention="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-10, atol=1e-10)


def _tiles(num_blocks, indices, kv_tiles):
    """Dense [batch, q_tiles, kv_tiles] bool from a BlockMask's (num_blocks, indices) pair (head 0)."""
    batch, _, q_tiles = num_blocks.shape
    dense = torch.zeros(batch, q_tiles, kv_tiles, dtype=torch.bool)
    for b in range(batch):
        for qt in range(q_tiles):
            dense[b, qt, indices[b, 0, qt, : num_blocks[b, 0, qt]].long()] = True
    return dense


@pytest.mark.parametrize("tile", [4, 5, 8])
@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 6),
                                               ("sliding_attention", 3)])
def test_flex_block_mask_tiles_and_mask_mod_match_the_dense_mask(tile, layer_type, window):
    from torch.nn.attention.flex_attention import create_mask

    from dflash.train.flex_mask import flex_block_masks

    context_len = 21
    anchors = torch.tensor([[0, 3, 4, 9, 15, 19], [2, 6, 7, 0, 0, 0]])  # sorted, then padding zeros
    dense = block_attention_masks(anchors, context_len, BLOCK, [layer_type], window)[layer_type][:, 0]
    block_mask = flex_block_masks(anchors, context_len, BLOCK, [layer_type], window, tile=tile)[layer_type]
    num_q, num_kv = dense.shape[1:]
    elementwise = create_mask(block_mask.mask_mod, 2, 1, num_q, num_kv, device="cpu")[:, 0]
    assert torch.equal(elementwise, dense)
    q_tiles, kv_tiles = -(-num_q // tile), -(-num_kv // tile)
    # Rows and columns past the ends pad the last tiles; kernels ignore them, so they count as neither.
    padded_any = torch.zeros(2, q_tiles * tile, kv_tiles * tile, dtype=torch.bool)
    padded_all = torch.ones(2, q_tiles * tile, kv_tiles * tile, dtype=torch.bool)
    padded_any[:, :num_q, :num_kv] = padded_all[:, :num_q, :num_kv] = dense
    any_visible = padded_any.view(2, q_tiles, tile, kv_tiles, tile).any(4).any(2)
    all_visible = padded_all.view(2, q_tiles, tile, kv_tiles, tile).all(4).all(2)
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, kv_tiles)
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_tiles)
    assert not (partial & full).any()
    assert torch.equal(any_visible & ~(partial | full), torch.zeros_like(any_visible))  # no visible key skipped
    assert torch.equal(full & ~all_visible, torch.zeros_like(full))  # "full" tiles really are full
    assert (~(partial | full)).any()  # the case exercises skipping
    assert full.any() or layer_type == "sliding_attention"  # no tile is fully inside a window this short


def test_activation_checkpointing_gives_the_same_loss_and_gradients(monkeypatch):
    from dflash.models.drafter import DFlashMLP
    from dflash.train.activation_checkpointing import apply_activation_checkpointing

    calls = []
    mlp_forward = DFlashMLP.forward
    # Counted in the method itself: module hooks do not fire while checkpointing recomputes a layer.
    monkeypatch.setattr(DFlashMLP, "forward", lambda self, x: (calls.append(1), mlp_forward(self, x))[1])

    torch.manual_seed(3)
    plain = make_drafter(["sliding_attention", "full_attention"], 6)
    checkpointed = apply_activation_checkpointing(make_drafter(["sliding_attention", "full_attention"], 6))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    embed_weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    input_ids = torch.randint(0, VOCAB - 1, (2, 12))
    target_hidden = torch.randn(2, 12, TAPS * HIDDEN, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 7], [0, 2, 8]])
    labels = torch.randint(0, VOCAB, (2, 3, BLOCK))
    weights = torch.rand(2, 3, BLOCK)
    grads, mlp_calls = [], []
    for drafter in (plain, checkpointed):
        calls.clear()
        hidden = training_forward(drafter, embed_weight, input_ids, target_hidden, anchors)
        loss, *_ = weighted_block_loss(hidden, head, labels, weights)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
        mlp_calls.append(len(calls))
    assert mlp_calls == [2, 4]  # two layers; checkpointed ones run again in backward
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)
