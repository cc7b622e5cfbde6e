"""Static live decoding on a GPU with real CUDA graphs: the graph replays of the target's verify and one-token
forwards and of the drafter's extend and block steps equal eager runs over the same static buffers, and live
decoding through them is lossless. Skipped without CUDA; on the GPU machine:

    PYTHONPATH=. python -m pytest tests/test_eval_cuda_graphs.py tests/test_eval_replay_contexts.py -q -rs
"""

from __future__ import annotations

import pytest
import torch

from dflash.inference.drafter_cache import CachedDrafter, TargetHead
from dflash.eval.live import live_decode, target_only_decode
from dflash.inference.static_drafter import StaticDrafter
from dflash.inference.static_target import StaticTarget
from dflash.models.targets import build_tiny_target
from tests.host_waits import host_waits
from tests.schema_options import DRAFT_SAMPLING

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(scope="module")
def adapter():
    """A float32 tiny llama on the GPU, weights large enough that greedy text varies."""
    return build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2, device=DEVICE, dtype="float32")


def long_prompt(adapter, length: int) -> list[int]:
    chat = adapter.chat_ids([{"role": "user", "content": "What is two plus two?"}])
    return [4 + i % 50 for i in range(length - len(chat))] + chat


def test_target_graphs_equal_eager(adapter):
    taps = [0, 2, adapter.num_layers - 1]
    prompt = long_prompt(adapter, 120)
    graphed, eager = (StaticTarget(adapter, taps, capacity=len(prompt) + 20, graph_sizes=(1, 4), cuda_graphs=graphs)
                      for graphs in (True, False))
    assert graphed._graphs and not eager._graphs
    for target in (graphed, eager):
        target.forward(prompt, last_logits_only=True)
    # Verifies of 4 (graphed) with rollbacks into them; the last crosses the 128-column span.
    blocks = (([5, 6, 7, 8], 2), (torch.tensor([9, 10, 11, 12], device=DEVICE), 3), ([12, 13, 14, 15], 1))
    for block, keep in blocks:
        for got, want in zip(graphed.verify(block), eager.verify(block)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        start = graphed.length - len(block)
        graphed.rollback(start + keep)
        eager.rollback(start + keep)
    for token in (7, 8):  # one-token forwards (graphed)
        for got, want in zip(graphed.forward([token]), eager.forward([token])):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_drafter_graphs_equal_eager(adapter, make_drafter):
    drafter = make_drafter(adapter, window=6, std=0.2, block_size=4).to(DEVICE)
    prompt = long_prompt(adapter, 150)
    features = adapter.capture(torch.tensor([prompt], device=DEVICE), None, drafter.target_layer_ids)[0]
    head = TargetHead.of(adapter)
    graphed, eager = (StaticDrafter(drafter, head, capacity=len(prompt), cuda_graphs=graphs)
                      for graphs in (True, False))
    assert graphed._graphs and not eager._graphs
    cached = CachedDrafter(drafter, head)
    for n in (120, 1, 4, 2, 3, 1):  # a prompt, then the verified positions of steps; the context crosses 128
        for context in (graphed, eager, cached):
            context.extend(features[context.length : context.length + n])
        anchor = prompt[graphed.length]
        logits, drafts = graphed.draft(anchor, 4)
        torch.testing.assert_close(logits, eager.draft(anchor, 4)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, cached.draft(anchor, 4)[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(drafts, logits.argmax(dim=-1))


def test_live_through_graphs_is_lossless(adapter, make_drafter):
    drafter = make_drafter(adapter, std=0.2).to(DEVICE)
    prompt = adapter.chat_ids([{"role": "user", "content": "Write a haiku about the sea, please."}])
    truth = target_only_decode(adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="hf")
    plain = target_only_decode(adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="static")
    assert plain.engine == "static" and plain.continuation == truth.continuation
    for engine in ("static", "hf"):
        result = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine=engine,
                             draft_sampling=DRAFT_SAMPLING)
        assert result.engine == engine and result.continuation == truth.continuation


def test_short_block_graphs_equal_eager_bitwise(adapter, make_drafter):
    """The shorter last blocks near max_new_tokens replay graphs of their own sizes, bit for bit the eager math
    (the drafter's graphs from the block's tokens to its drafts)."""
    taps = [0, adapter.num_layers - 1]
    prompt = long_prompt(adapter, 118)
    graphed, eager = (StaticTarget(adapter, taps, capacity=160, graph_sizes=range(2, 5), cuda_graphs=graphs)
                      for graphs in (True, False))
    for target in (graphed, eager):
        target.forward(prompt, last_logits_only=True)
    for block, keep in (([5, 6], 1), ([7, 8, 9], 2), ([10, 11, 12, 13], 4), ([14, 15, 16], 1)):
        for got, want in zip(graphed.verify(block), eager.verify(block)):
            assert torch.equal(got, want)
        start = graphed.length - len(block)
        graphed.rollback(start + keep)
        eager.rollback(start + keep)
    drafter = make_drafter(adapter, window=6, std=0.2, block_size=4).to(DEVICE)
    features = adapter.capture(torch.tensor([prompt], device=DEVICE), None, drafter.target_layer_ids)[0]
    graphed, eager = (StaticDrafter(drafter, TargetHead.of(adapter), capacity=len(prompt), cuda_graphs=graphs)
                      for graphs in (True, False))
    for n in (100, 3, 1, 4):
        for context in (graphed, eager):
            context.extend(features[context.length: context.length + n])
        for size in (2, 3, 4):  # the whole drafting step: embedding, drafter, head and argmax
            for got, want in zip(graphed.draft(prompt[graphed.length], size), eager.draft(prompt[eager.length], size)):
                assert torch.equal(got, want)


def test_sample_draws_what_multinomial_draws_on_cuda():
    from dflash.inference.sampling import sample

    for case in range(50):
        probs = torch.softmax(3 * torch.randn(1 + case % 3, 1000 + case, device=DEVICE), dim=-1)
        ours = torch.Generator(device=DEVICE).manual_seed(case)
        theirs = torch.Generator(device=DEVICE).manual_seed(case)
        assert torch.equal(sample(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(-1)), case


@pytest.mark.parametrize("temperature,draft_sampling", [(0.0, "greedy"), (0.9, "greedy"), (0.9, "sampled")])
def test_one_host_sync_per_live_step(adapter, make_drafter, temperature, draft_sampling):
    """Per speculative step one device sync (the acceptance's decision coming back), counted as the warnings of
    the sync debug mode; the prefill adds a few (the prompt's copy to the device, its first token)."""
    drafter = make_drafter(adapter, std=0.2).to(DEVICE)
    prompt = adapter.chat_ids([{"role": "user", "content": "Write a haiku about the sea, please."}])
    options = dict(max_new_tokens=24, stop_token_ids=[], target_engine="static", temperature=temperature,
                   draft_sampling=draft_sampling)
    generator = torch.Generator(device=DEVICE).manual_seed(0) if temperature > 0 else None
    live_decode(drafter, adapter, prompt, generator=generator, **options)  # graphs captured before counting
    with host_waits() as waits:
        result = live_decode(drafter, adapter, prompt, generator=generator, **options)
    assert len(waits) <= result.trace.num_steps + 4, waits[:5]
