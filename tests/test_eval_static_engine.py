"""The static live engine (StaticTarget + StaticDrafter): verify logits/features equal CachedTarget's and drafter
outputs equal CachedDrafter's, also through the graph dispatch (CUDA graphs stood in for by replaying functions on
CPU); live decoding through it equals the target's own greedy output (tiny llama, tiny qwen3, real SmolLM2); T>0
samples the same tokens as the hf engine; engine selection keeps GDN hybrids on CachedTarget."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

from dflash.eval import live
from dflash.inference import static_objects as static_objects_module
from dflash.inference import static_drafter as static_drafter_module, static_target as static_target_module
from dflash.inference.drafter_cache import CachedDrafter, TargetHead
from dflash.inference.static_objects import _KEPT_PER_MODEL
from dflash.eval.live import live_decode, target_only_decode
from dflash.inference.static_drafter import StaticDrafter, static_drafter
from dflash.inference.static_target import StaticTarget, static_target
from dflash.inference.target_cache import CachedTarget
from dflash.models.targets import build_tiny_target, load_target, smollm2
from tests.schema_options import DRAFT_SAMPLING, LIVE_ENGINE, eval_options
from tests.test_eval_live import oracle, own_greedy

DENSE = ["llama", "qwen3"]


class ReplayedFunction:
    """A CPU stand-in for a CUDA graph: replay() re-runs the captured function on the static buffers and writes
    its results into the outputs of the capture, as a graph overwrites its static outputs."""

    def __init__(self, run, shape, outputs) -> None:
        self.run, self.shape, self.outputs, self.replays = run, shape, outputs, 0

    def replay(self) -> None:
        new = self.run(self.shape)
        pairs = zip(self.outputs, new) if isinstance(new, tuple) else [(self.outputs, new)]
        for old, fresh in pairs:
            if fresh is not None:
                old.copy_(fresh)
        self.replays += 1


@pytest.fixture
def cpu_graphs(monkeypatch):
    """cuda_graphs=True on CPU: capture = prepare + run once (the warm-up's garbage writes included)."""
    captured = []

    def capture(device, shapes, prepare, run):
        graphs = {}
        for shape in shapes:
            prepare(shape)
            outputs = run(shape)
            graphs[shape] = (ReplayedFunction(run, shape, outputs), outputs)
            captured.append(graphs[shape][0])
        return graphs

    for module in (static_target_module, static_drafter_module):
        monkeypatch.setattr(module, "capture_graphs", capture)
        monkeypatch.setattr(module, "replay", lambda graph, device: graph.replay())
    return captured


@pytest.fixture(scope="module")
def target():
    """Tiny dense targets with weights large enough that greedy text varies (std 0.02 repeats one token)."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2)
        return cache[family]

    return get


def prompt_of(adapter, text="What is two plus two?"):
    return adapter.chat_ids([{"role": "user", "content": text}])


@pytest.mark.parametrize("family,graphs", [("llama", False), ("qwen3", False), ("llama", True)])
def test_static_verify_equals_cached_target(family, graphs, target, request):
    adapter = target(family)
    taps = [0, 2, adapter.num_layers - 1]
    captured = request.getfixturevalue("cpu_graphs") if graphs else []
    # 120 prompt tokens: the verifies below cross the first 128-column attention span.
    chat = prompt_of(adapter)
    prompt = [4 + i % 50 for i in range(120 - len(chat))] + chat
    static = StaticTarget(adapter, taps, capacity=len(prompt) + 20, graph_sizes=(4,), cuda_graphs=graphs)
    assert static.capacity == 256 and len(captured) == (2 if graphs else 0)  # (4 tokens, span 128 and 256)
    cached = CachedTarget(adapter, taps)
    # Prefill: last logits only, features of every prompt position (capture()'s taps).
    (got_logits, got_features), (want_logits, want_features) = (
        t.forward(prompt, last_logits_only=True) for t in (static, cached))
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_features, want_features, atol=1e-4, rtol=1e-4)
    captured_features = adapter.capture(torch.tensor([prompt]), None, taps)[0]
    torch.testing.assert_close(got_features, captured_features, atol=1e-4, rtol=1e-4)
    # Verify blocks, roll back into them, verify again over the stale columns (one block a device tensor, one of
    # a size without a graph, the last across the span boundary).
    for block, keep in (([5, 6, 7, 8], 2), (torch.tensor([9, 10, 11]), 3), ([12, 13, 14, 15], 1)):
        got, want = static.verify(block), cached.verify(block)
        assert got[0].shape == (len(block), adapter.vocab_size)
        assert got[1].shape == (len(block), len(taps) * adapter.hidden_size)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        start = static.length - len(block)
        assert static.rollback(start + keep) is None and cached.rollback(start + keep) is None
        assert static.length == cached.length == start + keep
    assert [graph.replays for graph in captured] == ([1, 1] if graphs else [])
    # Without taps (target-only decoding) there are no features, and one-token forwards match.
    plain = StaticTarget(adapter, [], capacity=64)
    plain.forward(prompt[:40])
    logits, features = plain.forward([7])
    assert features is None
    reference = adapter.model(torch.tensor([prompt[:40] + [7]])).logits[0, -1:]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_verify_graphs_of_every_block_size_equal_eager(target, cpu_graphs):
    """Verifies of every block size (the shorter last blocks included) dispatched to graphs give the eager
    forward's numbers bit for bit, over both attention spans, the graphs of one size sharing their outputs."""
    adapter = target("llama")
    taps = [0, adapter.num_layers - 1]
    prompt = [4 + i % 50 for i in range(118)]
    graphed, eager = (StaticTarget(adapter, taps, capacity=160, graph_sizes=range(2, 5), cuda_graphs=graphs)
                      for graphs in (True, False))
    assert len(cpu_graphs) == 3 * 2  # sizes 2, 3, 4 over spans 128 and 256
    for n in (2, 3, 4):  # the graphs of one size write one set of outputs, whatever their span
        assert all(a is b for a, b in zip(graphed._graphs[(n, 128)][1], graphed._graphs[(n, 256)][1]))
    for static in (graphed, eager):
        static.forward(prompt, last_logits_only=True)
    for block, keep in (([5, 6], 1), ([7, 8, 9], 2), ([10, 11, 12, 13], 4), ([14, 15, 16], 1), ([17, 18], 2)):
        for got, want in zip(graphed.verify(block), eager.verify(block)):
            assert torch.equal(got, want)
        start = graphed.length - len(block)
        graphed.rollback(start + keep)
        eager.rollback(start + keep)
    assert sum(graph.replays for graph in cpu_graphs) == 5


def test_static_target_errors_and_reuse(target):
    adapter = target("llama")
    static = StaticTarget(adapter, [1], capacity=10)
    with pytest.raises(ValueError, match="no verify"):
        static.rollback(1)
    static.forward(list(range(4, 100)))
    static.verify([5, 6])
    with pytest.raises(ValueError, match="rollback keeps"):
        static.rollback(96)
    static.forward([7])
    with pytest.raises(ValueError, match="must follow a verify directly"):
        static.rollback(97)
    with pytest.raises(ValueError, match="exceed the static cache of 128"):
        static.forward(list(range(4, 40)))
    with pytest.raises(ValueError, match="at least one token"):
        static.forward([])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        StaticTarget(adapter, [1], capacity=10, graph_sizes=(1,), cuda_graphs=True)
    with pytest.raises(ValueError, match="does not support this target"):
        StaticTarget(load_target("tiny", tiny={"family": "qwen3_5", "seed": 0, "tokenizer": "builtin"}), [1], 10)
    # Kept per (model, taps, graph sizes) and reset, so graphs are captured once per process; rebuilt when longer.
    first = static_target(adapter, [1], length=50, graph_sizes=(4,))
    first.forward([5, 6])
    again = static_target(adapter, [1], length=900, graph_sizes=(4,))
    assert again is first and again.length == 0 and again.capacity == 1024
    assert static_target(adapter, [1], length=1500, graph_sizes=(4,)).capacity == 2048
    assert static_target(adapter, [2], length=50, graph_sizes=(4,)) is not first
    # The kept objects do not keep their target alive: dropping the target drops them (and their caches) too.
    own = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    count = len(_KEPT_PER_MODEL)
    kept = static_target(own, [1], length=50)
    assert len(_KEPT_PER_MODEL) == count + 1
    del own, kept
    gc.collect()
    assert len(_KEPT_PER_MODEL) == count


@pytest.mark.parametrize("family", DENSE)
def test_live_static_equals_target_greedy(family, target, make_drafter, monkeypatch):
    adapter = target(family)
    drafter = make_drafter(adapter, block_size=5)
    prompt = prompt_of(adapter)
    truth = own_greedy(adapter, prompt, 24)
    assert len(set(truth)) > 3, truth  # text that varies, so a wrong rollback shows
    # A real (random) drafter: mostly rejections, every step rolls the cache back.
    result = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    assert result.engine == "static" and result.continuation == truth
    plain = target_only_decode(adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="static")
    assert plain.engine == "static" and plain.continuation == truth
    # An oracle with errors: partial and full acceptance, rollbacks of every length; the same steps as hf.
    oracle(monkeypatch, adapter, prompt, truth)
    static = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    hf = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[], target_engine="hf",
                     draft_sampling=DRAFT_SAMPLING)
    assert static.continuation == hf.continuation == truth and hf.engine == "hf"
    assert static.trace == hf.trace and len(set(static.trace.committed)) >= 3, static.trace.committed
    # Stop tokens end both engines at the same place.
    stop = truth[10]
    ended = live_decode(drafter, adapter, prompt, max_new_tokens=24, stop_token_ids=[stop], target_engine="static",
                        draft_sampling=DRAFT_SAMPLING)
    assert ended.continuation == truth[: truth.index(stop) + 1]


@pytest.fixture
def graph_engine(cpu_graphs, monkeypatch):
    """The static engine of live.py with stand-in graphs (fresh objects: none kept from eager runs)."""
    monkeypatch.setattr(static_objects_module, "_KEPT_PER_MODEL", weakref.WeakKeyDictionary())
    monkeypatch.setattr(static_target_module, "StaticTarget", functools.partial(StaticTarget, cuda_graphs=True))
    monkeypatch.setattr(static_drafter_module, "StaticDrafter", functools.partial(StaticDrafter, cuda_graphs=True))
    return cpu_graphs


def test_live_through_graph_dispatch(target, make_drafter, graph_engine, monkeypatch):
    """The live loop with every fixed-shape step dispatched to a (stand-in) graph: still the target's greedy."""
    cpu_graphs = graph_engine
    adapter = target("qwen3")
    drafter = make_drafter(adapter, block_size=5)
    prompt = prompt_of(adapter)
    truth = own_greedy(adapter, prompt, 30)
    plain = target_only_decode(adapter, prompt, max_new_tokens=30, stop_token_ids=[], target_engine="static")
    assert plain.continuation == truth
    assert sum(graph.replays for graph in cpu_graphs) == 29  # every one-token step after the prefill
    # A real drafter: per step a drafted block, a verify and a context extend (none after the last step), all
    # replayed, the shorter last blocks near max_new_tokens included.
    before = sum(graph.replays for graph in cpu_graphs)
    static = live_decode(drafter, adapter, prompt, max_new_tokens=30, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    assert static.continuation == truth
    assert min(static.trace.drafted) < 4  # shorter blocks were met
    assert sum(graph.replays for graph in cpu_graphs) - before == 3 * static.trace.num_steps - 1
    # An oracle (no drafter forward): acceptance lengths of every size, the same steps as the hf engine.
    oracle(monkeypatch, adapter, prompt, truth)
    hf = live_decode(drafter, adapter, prompt, max_new_tokens=30, stop_token_ids=[], target_engine="hf",
                     draft_sampling=DRAFT_SAMPLING)
    before = sum(graph.replays for graph in cpu_graphs)
    static = live_decode(drafter, adapter, prompt, max_new_tokens=30, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    assert static.continuation == hf.continuation == truth and static.trace == hf.trace
    assert len(set(static.trace.committed)) >= 4, static.trace.committed
    assert sum(graph.replays for graph in cpu_graphs) - before == 2 * static.trace.num_steps - 1


@pytest.mark.parametrize("graphs", [False, True])
def test_static_engine_matches_hf_engine(graphs, target, make_drafter, monkeypatch, request):
    """The static engine (StaticTarget + StaticDrafter) drafts and verifies the same numbers as the hf engine
    (CachedTarget + CachedDrafter): the same drafter logits at every step at T=0 (the context extended by every
    step's kept positions), and at T>0 the same rejection sampling on (nearly) the same probabilities, so the same
    seed gives the same tokens. With stand-in graphs too."""
    if graphs:
        request.getfixturevalue("graph_engine")
    adapter = target("llama")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    prompt = prompt_of(adapter, "Write a haiku about the sea, please.")
    drafted: dict[str, list] = {"static": [], "hf": []}
    real = live.draft_block
    for engine, record in drafted.items():
        def recording(*args, record=record):
            logits, drafts = real(*args)
            record.append(logits.clone())  # the static engine's are graph buffers, rewritten by the next block
            return logits, drafts

        monkeypatch.setattr(live, "draft_block", recording)
        live_decode(drafter, adapter, prompt, max_new_tokens=20, stop_token_ids=[], target_engine=engine,
                    draft_sampling=DRAFT_SAMPLING)
    # One block per step; the last blocks are cut by max_new_tokens (graphs of their own sizes).
    assert len(drafted["static"]) == len(drafted["hf"]) == 19 and drafted["hf"][-1].shape[0] == 1
    for got, want in zip(drafted["static"], drafted["hf"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(live, "draft_block", real)
    runs = {}
    for engine in ("static", "hf"):
        generator = torch.Generator().manual_seed(3)
        result = live_decode(drafter, adapter, prompt, max_new_tokens=20, stop_token_ids=[], temperature=0.9,
                             generator=generator, target_engine=engine, draft_sampling="sampled")
        plain = target_only_decode(adapter, prompt, max_new_tokens=20, stop_token_ids=[], temperature=0.9,
                                   generator=torch.Generator().manual_seed(3), target_engine=engine)
        runs[engine] = (result.continuation, result.trace, plain.continuation)
    assert runs["static"] == runs["hf"]
    assert len(runs["static"][0]) == 20


def test_engine_selection(tiny_target, make_drafter):
    dense, hybrid = tiny_target("llama"), tiny_target("qwen3_5")
    prompt = prompt_of(dense)
    # On CPU "auto" keeps the HF engine (static pays off with CUDA graphs); hybrids can only run hf.
    assert target_only_decode(dense, prompt, max_new_tokens=2, stop_token_ids=[], target_engine="auto").engine == "hf"
    drafter = make_drafter(hybrid)
    assert live_decode(drafter, hybrid, prompt_of(hybrid), max_new_tokens=3, stop_token_ids=[],
                       target_engine="auto", draft_sampling=DRAFT_SAMPLING).engine == "hf"
    with pytest.raises(ValueError, match="engine 'static' cannot decode this target"):
        live_decode(drafter, hybrid, prompt_of(hybrid), max_new_tokens=3, stop_token_ids=[], target_engine="static",
                    draft_sampling=DRAFT_SAMPLING)
    with pytest.raises(ValueError, match="engine must be one of"):
        target_only_decode(dense, prompt, max_new_tokens=2, stop_token_ids=[], target_engine="fast")


@pytest.mark.slow
def test_real_smollm2_static_live_is_lossless(make_drafter):
    try:
        smollm2.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    adapter = load_target("smollm2")
    prompt = prompt_of(adapter, "Write a Python function that reverses a string.")
    truth = own_greedy(adapter, prompt, 16)
    drafter = make_drafter(adapter, block_size=4)
    result = live_decode(drafter, adapter, prompt, max_new_tokens=16, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    assert result.continuation == truth
    assert target_only_decode(adapter, prompt, max_new_tokens=16, stop_token_ids=[],
                              target_engine="static").continuation == truth


@pytest.mark.parametrize("layer_types,graphs", [(("sliding_attention", "full_attention"), False),
                                                (("full_attention",), False),
                                                (("sliding_attention", "full_attention"), True)])
def test_static_drafter_equals_cached_drafter(layer_types, graphs, tiny_target, make_drafter, request):
    adapter = tiny_target("llama")
    captured = request.getfixturevalue("cpu_graphs") if graphs else []
    drafter = make_drafter(adapter, layer_types=layer_types, window=6, std=0.2, block_size=4)
    chat = adapter.chat_ids([{"role": "user", "content": "Write a haiku about the sea, please."}])
    prompt = [4 + i % 50 for i in range(150 - len(chat))] + chat
    features = adapter.capture(torch.tensor([prompt]), None, drafter.target_layer_ids)[0]
    head = TargetHead.of(adapter)
    static = StaticDrafter(drafter, head, capacity=len(prompt), cuda_graphs=graphs)
    eager = StaticDrafter(drafter, head, capacity=len(prompt), cuda_graphs=False)
    cached = CachedDrafter(drafter, head)
    # Graphs: extend of 1..4 positions, blocks of 2, 3 and 4 positions over spans 128 and 256.
    assert static.capacity == 256 and len(captured) == (4 + 3 * 2 if graphs else 0)
    steps = [120, 1, 4, 2, 3, 1]  # a prompt, then the verified positions of steps; the context crosses 128
    for n in steps:
        for context in (static, eager, cached):
            context.extend(features[context.length: context.length + n])
        assert static.length == cached.length
        anchor = prompt[static.length]
        for size in (4, 2):  # a full block and a last block cut by max_new_tokens
            logits, drafts = (t.clone() for t in static.draft(anchor, size))
            want_logits, want_drafts = eager.draft(anchor, size)
            # The graph dispatch runs the eager step's math: embedding, drafter, head and argmax.
            assert torch.equal(logits, want_logits) and torch.equal(drafts, want_drafts)
            assert drafts.shape == (size - 1,) and torch.equal(drafts, logits.argmax(dim=-1))
            torch.testing.assert_close(logits, cached.draft(anchor, size)[0], atol=1e-5, rtol=1e-4)
    if graphs:  # every step but the prompt's extend replayed a graph, short blocks included
        assert sum(graph.replays for graph in captured) == (len(steps) - 1) + 2 * len(steps)
        # A graphed block's outputs are the buffers of its size, which the next draft of that size rewrites.
        first = static.draft(prompt[static.length], 3)
        assert static.draft(prompt[static.length] + 1, 3)[0] is first[0]
    with pytest.raises(ValueError, match="features must be"):
        static.extend(features[:2, :5])
    with pytest.raises(ValueError, match="exceed the static drafter context of 256"):
        static.extend(features[:130])
    with pytest.raises(ValueError, match="a drafted block has 2..4 positions, got 5"):
        static.draft(anchor, 5)
    with pytest.raises(ValueError, match="context is empty"):
        StaticDrafter(drafter, head, capacity=8).draft(anchor, 2)


def test_static_drafter_is_kept_per_drafter(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter)
    head = TargetHead.of(adapter)
    first = static_drafter(drafter, head, length=40)
    first.extend(torch.zeros(3, drafter.config.num_taps * drafter.config.hidden_size))
    again = static_drafter(drafter, TargetHead.of(adapter), length=1000)
    assert again is first and again.length == 0 and again.capacity == 1024
    assert static_drafter(drafter, head, length=1025).capacity == 2048
    # Another target's head is drafted through by an object of its own (the graphs hold the head they captured).
    other = tiny_target("qwen3")
    assert static_drafter(drafter, TargetHead.of(other), length=40).head.embedding is other.embed_tokens()
    assert static_drafter(drafter, head, length=40).head.embedding is adapter.embed_tokens()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        StaticDrafter(drafter, head, capacity=8, cuda_graphs=True)
    # The kept object does not keep its drafter alive: dropping the drafter drops it too.
    count = len(_KEPT_PER_MODEL)
    del drafter, first, again
    gc.collect()
    assert len(_KEPT_PER_MODEL) == count - 1


def test_evaluate_live_engine(target, make_drafter):
    from dflash.eval.evaluate import evaluate

    adapter = target("qwen3")
    drafter = make_drafter(adapter, block_size=4, std=0.2)
    sets = {"a": [prompt_of(adapter), prompt_of(adapter, "Hi")]}
    static = evaluate(drafter, adapter, sets, max_new_tokens=10, show_progress=False,
                      **eval_options(mode="live", live_engine="static"))
    replayed = evaluate(drafter, adapter, sets, max_new_tokens=10, show_progress=False, **eval_options())
    assert static["live_engine"] == "static" and "live_engine" not in replayed
    assert static["overall"]["lossless_mismatches"] == 0
    for key in ("tau", "per_position", "committed_histogram", "num_steps"):
        assert static["overall"][key] == replayed["overall"][key], key
    auto = evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False,
                    **eval_options(mode="live", measure_target=False))
    assert auto["live_engine"] == "hf"  # CPU
    with pytest.raises(ValueError, match="engine must be one of"):
        evaluate(drafter, adapter, sets, max_new_tokens=4, show_progress=False,
                 **eval_options(mode="live", live_engine="vllm"))
