"""capture.cuda_graphs (dflash/extract/static_capture.py): the colocated target forward over fixed shapes gives
TargetAdapter.capture's features and final states on every real position, runs no layer past the deepest tap it
needs, and (on a GPU) replays CUDA graphs that give the eager forward's numbers, one per (rows, width step)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from dflash.config import ConfigError, compose, settings_from
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.extract.static_capture import StaticCapture

LENGTHS = (5, 17, 9, 30)
FAMILIES = ["llama", "qwen3", "mistral", "gemma2", "gemma3_text"]
cuda = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(varied_target):
    return varied_target


def padded_batch(adapter, lengths=LENGTHS, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids [rows, max(lengths)] (the target's pad token on the padding) and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, adapter.vocab_size, (len(lengths), width), generator=g)
    ids = ids.masked_fill(mask == 0, adapter.tokenizer.pad_token_id)
    return ids.to(adapter.device), mask.to(adapter.device)


def assert_real_positions_close(got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor, **tolerance) -> None:
    real = mask.bool()
    torch.testing.assert_close(got[real].float(), expected[real].float(), **tolerance)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_features_and_final_states_are_the_adapters(target, family):
    adapter = target(family)
    ids, mask = padded_batch(adapter)
    layer_ids = [1, 4, 6]
    static = StaticCapture(adapter, layer_ids, final_hidden=True, max_width=40,
                           pad_id=adapter.tokenizer.pad_token_id, cuda_graphs=False)
    features, final = static(ids)
    expected_features, expected_final = adapter.capture_with_final(ids, mask, layer_ids)
    assert features.shape == expected_features.shape and final.shape == expected_final.shape
    assert_real_positions_close(features, expected_features, mask, rtol=1e-4, atol=1e-4)
    assert_real_positions_close(final, expected_final, mask, rtol=1e-4, atol=1e-4)
    alone, none = StaticCapture(adapter, layer_ids, final_hidden=False, max_width=40,
                                pad_id=adapter.tokenizer.pad_token_id, cuda_graphs=False)(ids)
    assert none is None
    assert_real_positions_close(alone, adapter.capture(ids, mask, layer_ids), mask, rtol=1e-4, atol=1e-4)


def test_no_layer_past_the_deepest_tap_runs_without_the_final_state(target):
    adapter = target("qwen3")
    ran = []
    handles = [layer.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
               for i, layer in enumerate(adapter.decoder_layers())]
    try:
        StaticCapture(adapter, [0, 3], final_hidden=False, max_width=32, pad_id=0, cuda_graphs=False)(
            padded_batch(adapter)[0])
        assert ran == [0, 1, 2, 3]
        ran.clear()
        StaticCapture(adapter, [0, 3], final_hidden=True, max_width=32, pad_id=0, cuda_graphs=False)(
            padded_batch(adapter)[0])
        assert ran == list(range(len(adapter.decoder_layers())))
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.slow
def test_the_real_smollm2_features_are_the_adapters():
    from dflash.models.targets import load_target, smollm2

    try:
        smollm2.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    adapter = load_target("smollm2")
    ids, mask = padded_batch(adapter, (24, 7, 40))
    layer_ids = [1, 8, 15, 22, 28]
    features, final = StaticCapture(adapter, layer_ids, True, max_width=64, pad_id=adapter.tokenizer.pad_token_id,
                                    cuda_graphs=False)(ids)
    expected_features, expected_final = adapter.capture_with_final(ids, mask, layer_ids)
    assert_real_positions_close(features, expected_features, mask, rtol=1e-4, atol=1e-4)
    assert_real_positions_close(final, expected_final, mask, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_layers_compile_once_for_every_layer_and_width(target, one_thread):
    """capture.compile with the static forward: every layer gets the same attend function, so the layers' one code
    compiles a graph or two (dynamic shapes) for all layers and widths, not one per layer or per call."""
    from torch._dynamo.utils import counters

    from dflash.models.targets.compile_target import target_layers_compiled

    adapter = target("qwen3")
    static = StaticCapture(adapter, [1, 4, 6], True, max_width=128, pad_id=adapter.tokenizer.pad_token_id,
                           cuda_graphs=False)
    batches = [padded_batch(adapter, lengths, seed) for seed, lengths in
               enumerate([LENGTHS, (70, 3, 66, 12), (8, 31, 2, 29), (41, 77, 5, 100)])]
    expected = [static(ids) for ids, _ in batches]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with target_layers_compiled(adapter):
        got = [static(ids) for ids, _ in batches]
    assert 0 < counters["stats"]["unique_graphs"] - before <= 2
    for (_, mask), (features, final), (want_features, want_final) in zip(batches, got, expected):
        assert_real_positions_close(features, want_features, mask, rtol=1e-4, atol=1e-4)
        assert_real_positions_close(final, want_final, mask, rtol=1e-4, atol=1e-4)


def test_what_it_refuses(target):
    with pytest.raises(ValueError, match="capture.cuda_graphs.*cuda_graphs=false"):
        StaticCapture(target("qwen3_5"), [1], final_hidden=False, max_width=32, pad_id=0, cuda_graphs=False)
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        StaticCapture(target("llama"), [1], final_hidden=False, max_width=32, pad_id=0, cuda_graphs=True)
    static = StaticCapture(target("llama"), [1], final_hidden=False, max_width=20, pad_id=0, cuda_graphs=False)
    assert static.max_width == 64  # rounded up to the width step
    with pytest.raises(ValueError, match="65 tokens wide"):
        static(torch.zeros(2, 65, dtype=torch.long))


def token_dataset(adapter, lengths=LENGTHS) -> Dataset:
    ids, mask = padded_batch(adapter, lengths)
    rows = [row[:n].tolist() for row, n in zip(ids.cpu(), lengths)]
    return Dataset.from_dict({"id": [f"s{i}" for i in range(len(rows))], "input_ids": rows,
                              "loss_mask": [[0] * 3 + [1] * (len(r) - 3) for r in rows]})


@pytest.mark.parametrize("final_hidden", [False, True])
def test_the_colocated_source_makes_the_same_batch_with_it(target, final_hidden):
    adapter = target("llama")
    dataset, layer_ids = token_dataset(adapter), [1, 5]
    plain = ColocatedFeatureSource(adapter, dataset, layer_ids, "float32", final_hidden=final_hidden)
    static = StaticCapture(adapter, layer_ids, final_hidden, max_width=30, pad_id=adapter.tokenizer.pad_token_id,
                           cuda_graphs=False)
    fixed = ColocatedFeatureSource(adapter, dataset, layer_ids, "float32", final_hidden=final_hidden, static=static)
    picked = [2, 0, 3]
    expected, lengths = plain.get_batch(picked)
    batch, fixed_lengths = fixed.get_batch(picked)
    assert fixed_lengths == lengths and batch.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(batch[key], value, rtol=1e-4, atol=1e-4, msg=key)
    fixed.verify_features()
    with pytest.raises(ValueError, match=r"taps \[1, 5\] \(final_hidden=False\), not \[1, 6\]"):
        ColocatedFeatureSource(adapter, dataset, [1, 6], "float32",
                               static=StaticCapture(adapter, [1, 5], False, 30, 0, cuda_graphs=False))


def test_the_setting_is_checked_when_the_config_is_composed():
    base = ["+experiment=tiny", "capture=colocated", "capture.cuda_graphs=true"]
    with pytest.raises(ConfigError, match="capture.cuda_graphs=true.*trains on the CPU.*cuda_graphs=false"):
        settings_from(compose(base + ["device=cpu"]))
    settings_from(compose(base + ["device=cpu", "stages=[data]"]))  # no training here: nothing to refuse


class EagerGraph:
    """Stands in for a CUDA graph on the CPU: each replay runs the captured function again."""

    def __init__(self, run, shape):
        self.run, self.shape = run, shape


def test_the_replay_path_on_the_cpu_with_graphs_that_run_eagerly(target, monkeypatch):
    """The buffers' bookkeeping of the graphed path, the graphs replaced by eager runs of what they capture: the
    first micro-batch of a row count captures every width of it, the columns past a micro-batch's width hold the pad
    token, every result is a copy that later replays leave alone."""
    import dflash.extract.static_capture as static_capture

    captured = []

    def capture_graphs(device, shapes, prepare, run, warmups=1, pool=None):
        captured.extend(shapes)
        return {shape: (EagerGraph(run, shape), None) for shape in shapes}

    monkeypatch.setattr(static_capture, "capture_graphs", capture_graphs)
    monkeypatch.setattr(static_capture, "replay", lambda graph, device: graph.run(graph.shape))
    adapter = target("llama")
    pad = adapter.tokenizer.pad_token_id
    eager = StaticCapture(adapter, [1, 4], True, max_width=128, pad_id=pad, cuda_graphs=False)
    graphed = StaticCapture(adapter, [1, 4], True, max_width=128, pad_id=pad, cuda_graphs=False)
    graphed.cuda_graphs = True
    batches = [padded_batch(adapter, lengths, seed) for seed, lengths in
               enumerate([(70, 3, 66, 12), LENGTHS, (8, 31, 2, 29), (41, 77, 5)])]
    results = [graphed(ids) for ids, _ in batches]
    assert (graphed.buffers[4]["ids"][:, 31:64] == pad).all()  # the 70-wide batch's ids were overwritten
    for (ids, mask), (features, final) in zip(batches, results):
        want_features, want_final = eager(ids)
        assert_real_positions_close(features, want_features, mask, rtol=1e-5, atol=1e-5)
        assert_real_positions_close(final, want_final, mask, rtol=1e-5, atol=1e-5)
    assert captured == [(4, 64), (4, 128), (3, 64), (3, 128)]
    assert graphed.capture(4) == 0 and graphed.capture(2) == 2 and captured[4:] == [(2, 64), (2, 128)]
    assert eager.capture(4) == 0  # without CUDA graphs there is nothing to capture


@cuda
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_graphs_replay_the_eager_forward(target, family):
    adapter = target(family, "cuda", "float32")
    layer_ids, pad = [1, 4, 6], adapter.tokenizer.pad_token_id
    eager = StaticCapture(adapter, layer_ids, True, max_width=200, pad_id=pad, cuda_graphs=False)
    graphed = StaticCapture(adapter, layer_ids, True, max_width=200, pad_id=pad)
    batches = [padded_batch(adapter, lengths, seed) for seed, lengths in
               enumerate([LENGTHS, (70, 3, 66, 12), (8, 31, 2, 29), (41, 77, 5)])]
    results = [graphed(ids) for ids, _ in batches]  # all before any is read: each result is its own copy
    for (ids, mask), (features, final) in zip(batches, results):
        want_features, want_final = eager(ids)
        assert_real_positions_close(features, want_features, mask, rtol=1e-4, atol=1e-4)
        assert_real_positions_close(final, want_final, mask, rtol=1e-4, atol=1e-4)
        # The eager forward at the graphs' rounded width matched to 1e-4; the adapter's own forward runs at the
        # batch's width, where cuBLAS picks other fp32 kernels: on an H100 2 of 28,992 values, small ones, were
        # 1.4e-4 apart.
        assert_real_positions_close(features, adapter.capture(ids, mask, layer_ids), mask, rtol=1e-4, atol=1e-3)
    # The first batch of 4 rows and the first of 3 captured every width up to 256 (200 rounded up) of theirs.
    assert sorted(graphed.graphs) == [(rows, width) for rows in (3, 4) for width in (64, 128, 192, 256)]


@cuda
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_layers_replay_in_the_graphs_without_recompiling(target, family):
    """capture.compile under capture.cuda_graphs: the layers compile in the first width's warm-up, every other width
    and every capture reuses that code, and the graphs give the forward's numbers."""
    from torch._dynamo.utils import counters

    from dflash.models.targets.compile_target import target_layers_compiled

    adapter = target(family, "cuda", "float32")
    layer_ids, pad = [1, 4, 6], adapter.tokenizer.pad_token_id
    batches = [padded_batch(adapter, lengths, seed) for seed, lengths in
               enumerate([LENGTHS, (70, 3, 66, 12), (8, 31, 2, 29), (41, 77, 5, 100)])]
    expected = [StaticCapture(adapter, layer_ids, True, 128, pad, cuda_graphs=False)(ids) for ids, _ in batches]
    torch._dynamo.reset()
    with target_layers_compiled(adapter):
        StaticCapture(adapter, layer_ids, True, 128, pad, cuda_graphs=False)(batches[0][0])  # compiles at width 64
        compiled = counters["stats"]["unique_graphs"]
        graphed = StaticCapture(adapter, layer_ids, True, max_width=128, pad_id=pad)
        got = [graphed(ids) for ids, _ in batches]  # the first captures widths 64 and 128
    assert compiled > 0 and counters["stats"]["unique_graphs"] == compiled
    assert sorted(graphed.graphs) == [(4, 64), (4, 128)]
    for (_, mask), (features, final), (want_features, want_final) in zip(batches, got, expected):
        assert_real_positions_close(features, want_features, mask, rtol=1e-4, atol=1e-4)
        assert_real_positions_close(final, want_final, mask, rtol=1e-4, atol=1e-4)


@cuda
def test_bf16_graphs_stay_close_to_the_adapter(target):
    adapter = target("qwen3", "cuda", "bfloat16")
    ids, mask = padded_batch(adapter, (40, 7, 63, 21))
    graphed = StaticCapture(adapter, [2, 5], False, max_width=64, pad_id=adapter.tokenizer.pad_token_id)
    features, _ = graphed(ids)
    # bf16 rounds differently at another padded width (64 here, 63 for the adapter): compare by the norm.
    real = mask.bool()
    got, expected = features[real].float(), adapter.capture(ids, mask, [2, 5])[real].float()
    assert (got - expected).norm() / expected.norm() < 1e-2


@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_a_colocated_run_with_it_trains_the_losses_of_one_without(tmp_path, compiled):
    import json

    from dflash.pipeline import Pipeline

    def losses(run_dir):
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            return [json.loads(line)["loss"] for line in f]

    base = ["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]", "capture=colocated",
            "device=cuda:0", "train.max_steps=4", f"capture.compile={str(compiled).lower()}"]
    Pipeline(compose(base + [f"run_dir={tmp_path / 'plain'}"])).run()
    graphed = Pipeline(compose(base + [f"run_dir={tmp_path / 'graphed'}", "capture.cuda_graphs=true"]))
    graphed.run()
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "graphed")), torch.tensor(losses(tmp_path / "plain")),
                               rtol=1e-2, atol=1e-2)
    console = "".join(path.read_text() for path in (tmp_path / "graphed" / "logs").glob("*.log"))
    assert "the colocated target's forward as CUDA graphs:" in console


def test_the_colocated_forward_bench_runs(tmp_path):
    """bench/colocated_forward.py --tiny: both paths timed on the CPU (the static one eagerly), JSON written."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "forward.json"
    done = subprocess.run([sys.executable, os.path.join(repo, "bench", "colocated_forward.py"), "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"adapter", "static"}
    assert all(figures["host_ms"] > 0 and figures["wall_ms"] > 0 for figures in report["paths"].values())
