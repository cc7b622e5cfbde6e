"""The replay's fixed-shape drafting step (dflash/eval/chunk_drafts.py) drafts what the gathered step drafts."""

from __future__ import annotations

import pytest
import torch

from dflash.eval.chunk_drafts import ChunkDrafts
from dflash.eval.metrics import acceptance_metrics
from dflash.eval.replay import DrafterProposer, greedy_continuations, replay_steps, target_pass
from dflash.models.targets.tiny import build_tiny_target

FAMILIES = ["llama", "qwen3_5"]
TEXTS = ["Hi", "What is two plus two?", "Write a haiku about the sea, please.", "Name three colours.",
         "Tell me a long story about a dragon who learns to code in Python."]


def chunk(adapter, drafter, device="cpu", lengths=(23, 9, 17, 1, 23)):
    """(sequences, greedy tokens, prompt lengths, features) of the test prompts, continuations cut to `lengths`
    generated tokens so that rows finish at different steps."""
    prompts = [adapter.chat_ids([{"role": "user", "content": t}]) for t in TEXTS]
    continuations = greedy_continuations(adapter, prompts, max_new_tokens=max(lengths), stop_token_ids=[],
                                         batch_size=8)
    sequences = [p + c[:n] for p, c, n in zip(prompts, continuations, lengths)]
    features, greedy = target_pass(adapter, sequences, drafter.target_layer_ids)
    return sequences, [g.cpu() for g in greedy], [len(p) for p in prompts], [f.to(device) for f in features]


class Both:
    """A Proposer that drafts with the gathered step (which the walk follows) and the fixed-shape one, and records
    both."""

    def __init__(self, gathered: DrafterProposer, fixed: DrafterProposer) -> None:
        self.gathered, self.fixed, self.steps = gathered, fixed, []

    def __call__(self, rows, starts, sizes):
        drafts = self.gathered(rows, starts, sizes)
        self.steps.append((list(rows), list(sizes), drafts, self.fixed(rows, starts, sizes)))
        return drafts


def walk(adapter, drafter, block_size, max_new_tokens=23, device="cpu"):
    sequences, greedy, prompt_lens, features = chunk(adapter, drafter, device)
    gathered = DrafterProposer(drafter, adapter, sequences, features, fixed_shape=False)
    fixed = DrafterProposer(drafter, adapter, sequences, features, fixed_shape=True)
    both = Both(gathered, fixed)
    traces = replay_steps(sequences, greedy, prompt_lens, both, block_size=block_size, max_new_tokens=max_new_tokens)
    return both.steps, traces


@pytest.mark.parametrize("family", FAMILIES)
def test_every_step_of_a_replay_walk_drafts_what_the_gathered_step_drafts(family, tiny_target, make_drafter):
    # Sliding window 8 shorter than the contexts, rows of different context lengths in one step, blocks shortened
    # near max_new_tokens (23 generated tokens is not a multiple of the block), and rows that finish early.
    adapter = tiny_target(family)
    drafter = make_drafter(adapter, block_size=5, std=0.2)
    steps, traces = walk(adapter, drafter, block_size=5)
    shortened = finished = 0
    for rows, sizes, gathered, fixed in steps:
        assert fixed.shape == gathered.shape == (len(rows), max(sizes) - 1)
        for i, size in enumerate(sizes):
            assert fixed[i, : size - 1].tolist() == gathered[i, : size - 1].tolist()
        shortened += min(sizes) < 5
        finished += len(rows) < len(TEXTS)
    assert shortened and finished and len(steps) > 5
    # Drafts that vary across rows and steps: the comparison is not of constants.
    assert len({tuple(row) for _, _, drafts, _ in steps for row in drafts.tolist()}) > 10
    assert acceptance_metrics(traces, 5)["num_steps"] == sum(len(rows) for rows, _, _, _ in steps)


@pytest.mark.parametrize("name", ["embedding", "lm_head"])
def test_the_target_weights_must_be_on_the_drafters_device(name, tiny_target, make_drafter):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter)
    sequences, _, _, features = chunk(adapter, drafter)
    context = DrafterProposer(drafter, adapter, sequences, features).context
    weights = {"embedding": adapter.embed_tokens().weight, "lm_head": adapter.lm_head_weight()}
    weights[name] = torch.empty_like(weights[name], device="meta")
    with pytest.raises(ValueError, match=f"needs the target's {name} on the drafter's device cpu, got meta"):
        ChunkDrafts(drafter, weights["embedding"], weights["lm_head"], context, sequences, cuda_graph=False)


def test_blocks_longer_than_the_drafters_are_refused(tiny_target, make_drafter):
    # The gathered step drafts any block size; the fixed-shape one has the drafter's block_size columns.
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4)
    sequences, _, prompt_lens, features = chunk(adapter, drafter)
    proposer = DrafterProposer(drafter, adapter, sequences, features, fixed_shape=True)
    assert proposer([0, 1], prompt_lens[:2], [4, 2]).shape == (2, 3)
    with pytest.raises(ValueError, match="blocks of 5 positions: .* at most the drafter's block_size 4"):
        proposer([0, 1], prompt_lens[:2], [5, 2])


@pytest.mark.gpu(reason="CUDA graphs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_graphed_step_on_cuda_drafts_what_the_gathered_step_drafts(dtype, make_drafter):
    # On the GPU the fixed-shape step replays one graph a chunk. In float32 it drafts what the gathered step drafts;
    # in bf16 the two round differently (other kernels, other key counts): nearly all of it.
    adapter = build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2, device="cuda", dtype=dtype)
    drafter = make_drafter(adapter, block_size=5, std=0.2).to("cuda", getattr(torch, dtype))
    sequences, _, _, features = chunk(adapter, drafter, device="cuda")
    assert DrafterProposer(drafter, adapter, sequences, features, fixed_shape=True).chunk_drafts.graph is not None
    steps, _ = walk(adapter, drafter, block_size=5, device="cuda")
    same = total = 0
    for rows, sizes, gathered, fixed in steps:
        for i, size in enumerate(sizes):
            same += fixed[i, : size - 1].tolist() == gathered[i, : size - 1].tolist()
            total += 1
    assert total > 20 and (same == total if dtype == "float32" else same >= 0.9 * total)


def test_the_default_on_the_cpu_is_the_gathered_step(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, block_size=4)
    sequences, _, _, features = chunk(adapter, drafter)
    assert DrafterProposer(drafter, adapter, sequences, features).fixed_shape is False


@pytest.mark.gpu(reason="CUDA graphs")
def test_the_default_on_cuda_is_the_graph_unless_the_target_pieces_are_elsewhere(make_drafter):
    # The evaluator's replay and the trainer's held-out replay build their proposers without fixed_shape.
    adapter = build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2, device="cuda",
                                dtype="bfloat16")
    drafter = make_drafter(adapter, block_size=5, std=0.2).to("cuda", torch.bfloat16)
    sequences, _, _, features = chunk(adapter, drafter, device="cuda")
    assert DrafterProposer(drafter, adapter, sequences, features).fixed_shape is True
    elsewhere = DrafterProposer(drafter.to("cpu", torch.float32), adapter, sequences, features)
    assert elsewhere.fixed_shape is False


@pytest.mark.gpu(reason="CUDA graphs")
def test_a_drafter_with_compiled_layers_is_graphed_too(make_drafter):
    # The trainer replays held-out prompts with the drafter it trains, whose layers train.compile compiled (dynamic
    # shapes): under the fixed-shape step the compilation happens in the capture's warm-up, outside the graph.
    from torch._dynamo.utils import counters

    from dflash.train.compile_layers import compile_layers

    adapter = build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2, device="cuda",
                                dtype="bfloat16")
    eager = make_drafter(adapter, block_size=5, std=0.2).to("cuda", torch.bfloat16)
    compiled = compile_layers(make_drafter(adapter, block_size=5, std=0.2).to("cuda", torch.bfloat16))
    sequences, greedy, prompt_lens, features = chunk(adapter, eager, device="cuda")
    counters.clear()
    fixed = DrafterProposer(compiled, adapter, sequences, features, fixed_shape=True)
    both = Both(DrafterProposer(eager, adapter, sequences, features, fixed_shape=False), fixed)
    replay_steps(sequences, greedy, prompt_lens, both, block_size=5, max_new_tokens=23)
    assert fixed.chunk_drafts.graph is not None and counters["stats"]["unique_graphs"] > 0
    same = total = 0
    for rows, sizes, gathered, drafts in both.steps:
        for i, size in enumerate(sizes):
            same += drafts[i, : size - 1].tolist() == gathered[i, : size - 1].tolist()
            total += 1
    assert total > 20 and same >= 0.9 * total


@pytest.mark.gpu(reason="CUDA graphs")
def test_the_trainers_drafter_under_deepspeed_is_graphed_too(make_drafter):
    # The held-out replay drafts with the module the DeepSpeed engine wraps, whose forward hooks run inside the
    # capture: none of them may wait for the device (dflash/train/engine.py turns DeepSpeed's throughput timer off).
    from dflash.config.schema import DeepSpeedSettings
    from dflash.train.engine import TrainEngine, init_distributed
    from tests import trainer_harness

    _, world_size, _ = init_distributed()
    adapter = build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2, device="cuda",
                                dtype="bfloat16")
    settings = trainer_harness.settings(micro_batch_size=1, grad_accum=1)
    engine = TrainEngine(make_drafter(adapter, block_size=5, std=0.2).to("cuda", torch.bfloat16), settings,
                         DeepSpeedSettings(zero_stage=2), total_steps=8, world_size=world_size, bf16=True)
    config = engine.config
    for _ in range(3):  # DeepSpeed's timer would start waiting at its third step
        hidden = engine(torch.arange(7, device="cuda")[None],
                        torch.randn(1, 4, config.hidden_size, device="cuda", dtype=torch.bfloat16),
                        target_hidden=torch.randn(1, 3, config.num_taps * config.hidden_size, device="cuda",
                                                  dtype=torch.bfloat16))
        engine.backward(hidden.float().square().mean() * 1e-3)
        engine.step()
    drafter = engine.module.eval()
    sequences, greedy, prompt_lens, features = chunk(adapter, drafter, device="cuda")
    fixed = DrafterProposer(drafter, adapter, sequences, features)
    both = Both(DrafterProposer(drafter, adapter, sequences, features, fixed_shape=False), fixed)
    replay_steps(sequences, greedy, prompt_lens, both, block_size=5, max_new_tokens=23)
    assert fixed.chunk_drafts.graph is not None
    same = sum(d[i, : s - 1].tolist() == g[i, : s - 1].tolist()
               for _, sizes, g, d in both.steps for i, s in enumerate(sizes))
    assert same >= 0.9 * sum(len(sizes) for _, sizes, _, _ in both.steps)
