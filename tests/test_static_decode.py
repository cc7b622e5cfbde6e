"""The static-cache decoding engine: token-for-token equal to HF greedy `generate` in float32, a right sampling
distribution, clear refusals, and the `engine` switch of regeneration and greedy continuations."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dflash.config.schema import schema_default
from dflash.data.prompts import Prompt
from dflash.data.regenerate import read_journal, regenerate
from dflash.inference.keyed_sampling import prompt_draws, sample_tokens
from dflash.inference.static_decode import StaticGenerator, resolve_engine, static_generate, supports_static_decode
from dflash.eval.replay import greedy_continuations
from dflash.models.targets import build_tiny_target, load_target
from dflash.models.targets import smollm2

LENGTHS = (5, 17, 9, 30, 1, 12)


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


def make_prompts(lengths=LENGTHS, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(adapter, prompts, max_new_tokens, stops):
    """Plain HF greedy generate, all prompts in one left-padded batch, model generation defaults neutralised."""
    return greedy_continuations(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                batch_size=len(prompts), engine="hf")


def mid_stop(continuations) -> int:
    """A token first generated at index >= 3 of some continuation: a stop token hit mid-batch."""
    for c in continuations:
        for i in range(3, len(c) - 2):
            if c[i] not in c[:i]:
                return c[i]
    raise AssertionError("no candidate stop token")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_matches_hf_greedy_token_for_token(target, family):
    adapter = target(family)
    prompts = make_prompts()
    free = hf_greedy(adapter, prompts, 20, [])
    assert len({tuple(c) for c in free}) == len(prompts)  # varied text, so equality means something
    got = static_generate(adapter, prompts, max_new_tokens=20, stop_token_ids=[], pad_id=0, batch_size=4)
    assert got == free

    # A stop token that ends some rows mid-batch while others keep going.
    stop = mid_stop(free)
    expected = hf_greedy(adapter, prompts, 20, [stop, 2])
    stopped = [c for c in expected if c[-1] == stop]
    assert stopped and any(len(c) < 20 for c in stopped) and any(stop not in c for c in expected)
    for batch_size in (1, 4, 8):
        got = static_generate(adapter, prompts, max_new_tokens=20, stop_token_ids=[stop, 2], pad_id=0,
                              batch_size=batch_size)
        assert got == expected, batch_size


# Very different prompt lengths and budgets: with 2-5 rows, rows are refilled many times, a short prompt often
# lands in a row whose previous occupant wrote far more columns (stale keys that must stay masked).
REFILL_LENGTHS = (1, 44, 3, 27, 60, 9, 2, 35, 14, 51, 6, 20, 5, 38)
REFILL_BUDGETS = [3 + (7 * i) % 23 for i in range(len(REFILL_LENGTHS))]


def early_stop(continuations, budgets) -> int:
    """The token that, as a stop token, ends the most continuations after their first token and before their
    budget."""
    ends = Counter()
    for c, budget in zip(continuations, budgets):
        firsts = {}
        for i, token in enumerate(c[:budget - 1]):
            firsts.setdefault(token, i)
        ends.update(t for t, i in firsts.items() if i >= 1)
    return ends.most_common(1)[0][0]


def hf_alone(adapter, prompts, budgets, stops):
    """Plain HF greedy generate of each prompt alone."""
    return [greedy_continuations(adapter, [p], max_new_tokens=b, stop_token_ids=stops, batch_size=1, engine="hf")[0]
            for p, b in zip(prompts, budgets)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_refilled_rows_match_hf_one_prompt_at_a_time(target, family):
    adapter = target(family)
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    stops = [early_stop(hf_greedy(adapter, prompts, max(REFILL_BUDGETS), []), REFILL_BUDGETS), 2]
    expected = hf_alone(adapter, prompts, REFILL_BUDGETS, stops)
    assert any(c[-1] in stops and len(c) < b for c, b in zip(expected, REFILL_BUDGETS))  # some stop early
    assert len({len(c) for c in expected}) > 6  # and stop times vary
    steps = {}
    for batch_size, refill in ((2, True), (3, True), (5, True), (5, False)):
        generator = StaticGenerator(adapter, refill=refill)
        got = generator.generate(prompts, max_new_tokens=REFILL_BUDGETS, stop_token_ids=stops, pad_id=0,
                                 batch_size=batch_size)
        assert got == expected, (batch_size, refill)
        stats = generator.last_stats
        assert stats.tokens == sum(map(len, expected)) and stats.rows == batch_size
        if refill:
            assert stats.admissions >= len(prompts) // batch_size
        steps[batch_size, refill] = stats
    # Refill needs fewer decode steps for the same tokens than plain batches of the same rows.
    assert steps[5, True].decode_steps < steps[5, False].decode_steps
    assert steps[5, True].utilisation > steps[5, False].utilisation


def test_sampling_follows_the_prompt_not_its_row(target):
    # Each prompt draws from its own seeded stream: rows, batch size and refill do not change its tokens.
    adapter = target("llama")
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    args = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0, temperature=1.0, top_p=0.9, seed=4)
    first = static_generate(adapter, prompts, batch_size=1, **args)
    for batch_size, refill in ((3, True), (4, False), (len(prompts), True)):
        assert static_generate(adapter, prompts, batch_size=batch_size, refill=refill, **args) == first
    assert first != static_generate(adapter, prompts, batch_size=3, **{**args, "seed": 5})
    assert first != hf_alone(adapter, prompts, REFILL_BUDGETS, [2])  # sampled, not greedy

    # prompt_seeds key each stream by the prompt itself: a call with a subset (a resumed run) repeats its tokens.
    seeds = [1000 + i for i in range(len(prompts))]
    keyed = static_generate(adapter, prompts, batch_size=3, prompt_seeds=seeds, **args)
    assert keyed != first
    assert static_generate(adapter, prompts[5:], batch_size=4, prompt_seeds=seeds[5:], **{
        **args, "max_new_tokens": REFILL_BUDGETS[5:]}) == keyed[5:]


def test_stream_yields_each_prompt_as_it_finishes(target):
    adapter = target("qwen3")
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    args = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0, batch_size=3)
    generator = StaticGenerator(adapter)
    streamed = list(generator.stream(prompts, **args))
    assert sorted(i for i, _ in streamed) == list(range(len(prompts)))
    assert [i for i, _ in streamed] != list(range(len(prompts)))  # completion order, not input order
    assert [t for _, t in sorted(streamed)] == generator.generate(prompts, **args)
    assert list(generator.stream([], **{**args, "max_new_tokens": 4})) == []
    with pytest.raises(ValueError, match="prompt_seeds has 1 seeds for 14 prompts"):
        next(generator.stream(prompts, **args, prompt_seeds=[3]))


def test_dummy_rows_do_not_change_the_tokens(target):
    # Under CUDA graphs every batch is padded to batch_size with dummy rows; the eager path can do the same.
    adapter = target("qwen3")
    prompts = make_prompts()
    generator = StaticGenerator(adapter)
    generator.fixed_rows = True
    got = generator.generate(prompts, max_new_tokens=12, stop_token_ids=[2], pad_id=0, batch_size=4)
    assert got == hf_greedy(adapter, prompts, 12, [2])
    assert generator._decoder.rows == 4


def test_compiled_step_gives_the_same_tokens():
    # torch.compile fuses the step's elementwise work; two layers keep the compile short.
    adapter = build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2, num_hidden_layers=2)
    prompts = make_prompts()
    expected = hf_greedy(adapter, prompts, 12, [2])
    got = static_generate(adapter, prompts, max_new_tokens=12, stop_token_ids=[2], pad_id=0, batch_size=3,
                          compile_step=True)
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_real_smollm2_matches_hf_greedy(attention):
    try:
        smollm2.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    adapter = load_target("smollm2")
    questions = ["What is the capital of France?", "Write a Python function that reverses a string.",
                 "Give me three tips for sleeping better.", "Explain photosynthesis to a ten year old, please."]
    prompts = [adapter.chat_ids([{"role": "user", "content": q}]) for q in questions]
    stops = adapter.stop_token_ids()
    expected = hf_greedy(adapter, prompts, 32, stops)
    assert any(len(c) < 32 and c[-1] in stops for c in expected)  # one answer stops early ("... Paris.")
    # 2 rows for 4 prompts: rows are refilled (the early stopper's row first).
    got = static_generate(adapter, prompts, max_new_tokens=32, stop_token_ids=stops,
                          pad_id=adapter.tokenizer.pad_token_id, batch_size=2, attention=attention)
    assert got == expected


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p distribution, by hand: most likely tokens until their mass reaches top_p, renormalised."""
    out = torch.zeros_like(probs)
    mass = 0.0
    for i in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        out[i] = probs[i]
        mass += float(probs[i])
    return out / out.sum()


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sample_tokens_follows_the_distribution(top_p):
    logits = torch.tensor([2.0, 0.5, 1.5, -1.0, 1.0, 0.0, -3.0])
    expected = nucleus(torch.softmax(logits / 0.8, dim=-1), top_p)
    n = 40000
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens = sample_tokens(logits.expand(n, -1), 0.8, top_p, uniform)
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected.double()).abs().max() < 0.01, (freq, expected)


def test_a_draw_of_zero_never_picks_a_token_of_zero_mass():
    logits = torch.tensor([[-1e4, 5.0, 4.0, 3.0], [2.0, -1e4, 1.0, 0.0]])
    for top_p in (1.0, 0.9):
        assert sample_tokens(logits, 1.0, top_p, torch.zeros(2)).tolist() == [1, 0]
    assert sample_tokens(logits, 1.0, 1.0, torch.full((2,), 1 - 2**-24)).tolist() == [3, 3]


def test_a_token_below_float32s_last_place_can_be_drawn():
    """Past a mass of 1 - 2e-8, a float32 running sum cannot step by 1e-8 (its last place there is 6e-8): tokens 1
    and 2 would never be drawn; the float64 CDF gives each its share of the draws."""
    logits = torch.tensor([[0.0, math.log(1e-8), math.log(1e-8)]]).expand(3, -1)
    uniform = torch.tensor([0.5, 1 - 1.5e-8, 1 - 0.5e-8], dtype=torch.float64)
    assert sample_tokens(logits, 1.0, 1.0, uniform).tolist() == [0, 1, 2]
    assert prompt_draws("a prompt", 3).dtype == torch.float64


def test_sampling_end_to_end(target):
    adapter = target("llama")
    prompt = make_prompts((7,))[0]
    n, temperature, top_p = 3000, 0.7, 0.5
    args = dict(max_new_tokens=1, stop_token_ids=[2], pad_id=0, batch_size=n, temperature=temperature, top_p=top_p)
    first = [c[0] for c in static_generate(adapter, [prompt] * n, **args, seed=3)]
    with torch.no_grad():
        logits = adapter.model(torch.tensor([prompt])).logits[0, -1].float()
    expected = nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
    freq = torch.bincount(torch.tensor(first), minlength=len(expected)).double() / n
    assert int((expected > 0).sum()) >= 3
    assert (freq[expected == 0] == 0).all()
    assert 0.5 * float((freq - expected.double()).abs().sum()) < 0.06

    # Seeded: the same seed repeats, another seed differs; a tiny nucleus is greedy.
    prompts = make_prompts()
    sampled = dict(max_new_tokens=8, stop_token_ids=[], pad_id=0, batch_size=4, temperature=1.0)
    once = static_generate(adapter, prompts, **sampled, seed=5)
    assert once == static_generate(adapter, prompts, **sampled, seed=5)
    assert once != static_generate(adapter, prompts, **sampled, seed=6)
    greedy = static_generate(adapter, prompts, max_new_tokens=8, stop_token_ids=[], pad_id=0, batch_size=4)
    assert static_generate(adapter, prompts, **{**sampled, "top_p": 1e-6}, seed=5) == greedy


def test_gdn_hybrids_are_refused(tiny_target, target):
    hybrid = tiny_target("qwen3_5")
    assert not supports_static_decode(hybrid)
    assert supports_static_decode(target("llama")) and supports_static_decode(target("qwen3"))
    with pytest.raises(ValueError, match="does not support this target.*qwen3_5"):
        static_generate(hybrid, [[5, 6]], max_new_tokens=2, stop_token_ids=[], pad_id=0, batch_size=1)
    with pytest.raises(ValueError, match="engine 'static' cannot decode"):
        resolve_engine("static", hybrid)
    assert resolve_engine("auto", hybrid) == "hf"
    assert resolve_engine("auto", target("llama")) == "hf"  # CPU: auto keeps plain generate
    with pytest.raises(ValueError, match="engine must be one of"):
        resolve_engine("fast", target("llama"))


def test_a_static_layout_problem_refuses_the_target(target, monkeypatch):
    """The engines refuse a target whose adapter's static_layout_problem() names a reason (that they run each HF
    decoder layer's own forward is tested in tests/test_engine_attention.py)."""
    adapter = target("llama")
    monkeypatch.setattr(adapter, "static_layout_problem", lambda: "its layer keeps a state")
    assert not supports_static_decode(adapter)
    with pytest.raises(ValueError, match="does not support this target: its layer keeps a state"):
        static_generate(adapter, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_token_ids=[], pad_id=0, batch_size=2)


def test_a_target_placed_over_several_devices_is_refused(target, monkeypatch):
    adapter = target("llama")
    monkeypatch.setattr(adapter.model, "hf_device_map", {"model.layers.0": 0, "model.layers.1": 1}, raising=False)
    assert not supports_static_decode(adapter)
    with pytest.raises(ValueError, match=r"placed over several devices \['0', '1'\]"):
        resolve_engine("static", adapter)
    monkeypatch.setattr(adapter.model, "hf_device_map", {"": 0}, raising=False)  # one device: fine
    assert supports_static_decode(adapter)


@pytest.mark.parametrize("change, name", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=[3, 0]), "max_new_tokens"),
    (dict(max_new_tokens=[3]), "max_new_tokens has 1 budgets for 2 prompts"), (dict(batch_size=0), "batch_size"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(pad_id=-1), "pad_id"), (dict(pad_id=10**6), "pad_id"), (dict(stop_token_ids=[2, 10**6]), "stop_token_ids"),
    (dict(prompts=[[5], []]), r"prompts\[1\]"), (dict(cuda_graphs=True), "cuda_graphs"),
])
def test_bad_arguments_name_the_argument(target, change, name):
    args = dict(prompts=[[5, 6], [7]], max_new_tokens=2, stop_token_ids=[2], pad_id=0, batch_size=2)
    args.update(change)
    with pytest.raises(ValueError, match=name):
        static_generate(target("llama"), **args)


def test_the_data_stage_passes_its_engine_settings_to_the_engine(target, tmp_path, monkeypatch):
    import dflash.data.regenerate as regenerate_module

    made = []

    class Recording(regenerate_module.StaticGenerator):
        def __init__(self, adapter, cuda_graphs=None, compile_step=False, refill=True, attention="sdpa"):
            made.append((compile_step, refill, attention))
            # eager here: compiling would only slow the test down
            super().__init__(adapter, cuda_graphs, refill=refill, attention=attention)

    monkeypatch.setattr(regenerate_module, "StaticGenerator", Recording)
    prompts = [Prompt("p0", [{"role": "user", "content": "hi"}], "test")]
    regenerate(prompts, target("llama"), tmp_path / "j.jsonl", max_length=40, max_new_tokens=4, batch_size=1,
               show_progress=False, engine="static", compile_step=True, refill=False, decode_attention="flex")
    assert made == [(True, False, "flex")]


def test_regenerate_engines_write_the_same_journal(target, tmp_path, monkeypatch):
    adapter = target("llama")
    texts = ["hi", "what is two plus two?", "tell me a story about a cat", "x" * 40, "ok then"]
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": t}], "test") for i, t in enumerate(texts)]
    # max_length cuts the longest prompt's response (finish "length") while others run to max_new_tokens.
    settings = dict(max_length=65, max_new_tokens=12, batch_size=2, show_progress=False,
                    refill=schema_default("data.refill"), decode_attention=schema_default("data.decode_attention"))
    hf = regenerate(prompts, adapter, tmp_path / "hf.jsonl", **settings, engine="hf")
    static = regenerate(prompts, adapter, tmp_path / "static.jsonl", **settings, engine="static")
    timing = ("engine", "generate_seconds", "generate_tokens_per_s", "template_seconds")
    assert {k: v for k, v in hf.items() if k not in timing} == {k: v for k, v in static.items() if k not in timing}
    assert (hf["engine"], static["engine"], hf["done"]) == ("hf", "static", len(prompts))
    assert read_journal(tmp_path / "hf.jsonl") == read_journal(tmp_path / "static.jsonl")
    records = read_journal(tmp_path / "static.jsonl")[1]
    longest = records["p3"]
    assert longest["finish"] == "length" and longest["prompt_len"] + len(longest["response_ids"]) == 65

    # A failing stream is retried prompt by prompt: one prompt that always fails is recorded as failed.
    bad = prompts[2]
    real_generate, real_stream = StaticGenerator.generate, StaticGenerator.stream

    def has_bad(batch):
        return any(len(ids) == records[bad.id]["prompt_len"] for ids in batch)

    def flaky_generate(self, batch, **kwargs):
        if has_bad(batch):
            raise RuntimeError("boom")
        return real_generate(self, batch, **kwargs)

    def flaky_stream(self, batch, **kwargs):
        for i, tokens in real_stream(self, batch, **kwargs):
            if has_bad(batch):  # mid-stream, after the first answer ended: every prompt not yet yielded is retried
                raise RuntimeError("boom")
            yield i, tokens

    monkeypatch.setattr(StaticGenerator, "generate", flaky_generate)
    monkeypatch.setattr(StaticGenerator, "stream", flaky_stream)
    stats = regenerate(prompts, adapter, tmp_path / "flaky.jsonl", **settings, engine="static")
    assert (stats["done"], stats["failed"]) == (4, 1) and stats["errors"][0]["id"] == bad.id
    assert "boom" in stats["errors"][0]["error"]


def test_greedy_continuations_engines_agree(target):
    adapter = target("qwen3")
    prompts = make_prompts((4, 11, 6))
    kwargs = dict(max_new_tokens=10, stop_token_ids=[2], batch_size=2)
    assert greedy_continuations(adapter, prompts, **kwargs, engine="static") == greedy_continuations(
        adapter, prompts, **kwargs, engine="hf")
    assert greedy_continuations(adapter, [], **kwargs, engine="static") == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_the_eager_step(target, dtype):
    adapter = target("qwen3", device="cuda", dtype=dtype)
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    # 3 rows for 14 prompts: rows are refilled many times, through one graph per attention span.
    args = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0, batch_size=3)
    graphed = static_generate(adapter, prompts, **args, cuda_graphs=True)
    assert graphed == static_generate(adapter, prompts, **args, cuda_graphs=False)
    if dtype == "float32":
        assert graphed == hf_alone(adapter, prompts, REFILL_BUDGETS, [2])
        assert static_generate(adapter, prompts, **args, refill=False) == graphed
        assert static_generate(adapter, prompts, **args, compile_step=True) == graphed
    sampled = dict(args, temperature=0.9, top_p=0.8, seed=1)
    assert static_generate(adapter, prompts, **sampled, cuda_graphs=True) == static_generate(
        adapter, prompts, **sampled, cuda_graphs=False)


def test_a_model_cast_after_a_static_run_decodes_in_its_new_dtype():
    # The engines size and type their caches by the adapter's layout: casting the model after a static run (as
    # bench/generate.py does for its float32 check) must give a layout of the new dtype, not the first one's.
    adapter = build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2, dtype="bfloat16")
    prompts = make_prompts()
    static_generate(adapter, prompts, max_new_tokens=4, stop_token_ids=[2], pad_id=0, batch_size=3)
    assert adapter.engine_layout.dtype == torch.bfloat16
    adapter.model.to(torch.float32)
    assert adapter.engine_layout.dtype == torch.float32
    got = static_generate(adapter, prompts, max_new_tokens=12, stop_token_ids=[2], pad_id=0, batch_size=3)
    assert got == hf_greedy(adapter, prompts, 12, [2])
