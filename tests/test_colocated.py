"""`capture=colocated`: each trainer rank runs the target itself; the losses equal the offline store's (CPU, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.data.dataset import load_dataset_dir
from dflash.data.feature_source import collate
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.extract.store import FeatureStore
from dflash.pipeline import Pipeline
from tests.host_waits import host_waits, ours

TINY = ["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]"]
STORED_CURVE = Path(__file__).parent / "data" / "tiny_loss_curve.json"


def losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("colocated")
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "capture=colocated"])).run()
    return run_dir


def test_colocated_run_trains_the_offline_losses_without_a_store(colocated_run):
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses(colocated_run)), torch.tensor(stored), rtol=2e-4, atol=2e-4)
    features = colocated_run / "features"
    assert not (features / "manifest.json").exists() and (features / "colocated.json").exists()
    assert (colocated_run / "export" / "done.json").exists()


def test_colocated_features_equal_the_offline_store(colocated_run, tmp_path):
    """Same rows, same taps: one padded forward per micro-batch gives the stored features (float noise aside)."""
    offline = tmp_path / "offline"
    Pipeline(compose(TINY + [f"run_dir={offline}", "stages=[data,capture]"])).run()
    store = FeatureStore(offline / "features")
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated"]))
    source = ColocatedFeatureSource(pipeline.adapter, load_dataset_dir(colocated_run / "data"),
                                    store.layer_ids, "bfloat16")
    picked = [3, 0, 7, 5]
    for index, sample in zip(picked, source.get_many(picked)):
        expected = store[index]
        assert torch.equal(sample["input_ids"], expected["input_ids"].long())
        assert torch.equal(sample["loss_mask"], expected["loss_mask"].long())
        torch.testing.assert_close(sample["hidden"].float(), expected["hidden"].float(), rtol=2e-2, atol=2e-2)
    assert source.tokens_captured == sum(len(store[i]["input_ids"]) for i in picked)


def test_colocated_refuses_fp8(colocated_run):
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated"]))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ColocatedFeatureSource(pipeline.adapter, load_dataset_dir(colocated_run / "data"), [1], "fp8")


def test_a_padded_batch_is_what_collate_makes_of_the_samples(colocated_run):
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated"]))
    source = pipeline.train.colocated_source()
    picked = [4, 1, 6]
    batch, lengths = source.get_batch(picked)
    assert lengths == [len(source.dataset[i]["input_ids"]) for i in picked]
    expected = collate(source.get_many(picked))
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key


def test_a_bad_feature_is_named_after_the_step_not_during_it(colocated_run, monkeypatch):
    """get_batch queues the check without waiting for the device; verify_features (the loop calls it after each
    step) raises, naming the sample and tap, and leaves the checks of the batches made ahead pending."""
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated", "capture.cache=false"]))
    source = pipeline.train.colocated_source()
    real = pipeline.adapter.capture
    monkeypatch.setattr(pipeline.adapter, "capture",
                        lambda *args: real(*args).index_fill(2, torch.tensor([0]), float("nan")))
    source.get_batch([2, 3])  # no error yet: the check is pending
    with pytest.raises(ValueError, match=f"sample '{source.dataset[2]['id']}': tap {source.layer_ids[0]} has "
                                         "non-finite"):
        source.verify_features()
    source.verify_features()  # a raised check is gone
    source.get_batch([4])
    source.get_batch([5])  # made ahead for the next step
    with pytest.raises(ValueError, match=f"sample '{source.dataset[4]['id']}'"):
        source.verify_features(leave=1)
    source.get_batch([6])
    with pytest.raises(ValueError, match=f"sample '{source.dataset[5]['id']}'"):
        source.verify_features(leave=1)  # the batch after a failed one stayed pending; the newest stays so now
    with pytest.raises(ValueError, match=f"sample '{source.dataset[6]['id']}'"):
        source.verify_features()
    source.verify_features()  # nothing left


def test_one_sample_in_check_every_is_compared_with_a_plain_forward(colocated_run, monkeypatch):
    """A capture that is finite and varied but wrong (a tap scaled by 1.2) passes the flags; the sampled plain
    forward catches it, naming the sample and tap, when its batch is verified. Counted in capture order."""
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated", "capture.cache=false"]))
    dataset, layer_ids = load_dataset_dir(colocated_run / "data"), pipeline.train.colocated_source().layer_ids
    right = ColocatedFeatureSource(pipeline.adapter, dataset, layer_ids, "float32", final_hidden=True, check_every=1)
    right.get_batch([0, 1, 2])
    right.verify_features()  # every sample, its taps and its final normed state, equal a plain forward's
    real = pipeline.adapter.capture
    hidden = pipeline.adapter.hidden_size
    monkeypatch.setattr(pipeline.adapter, "capture",
                        lambda *args: torch.cat([real(*args)[..., :hidden] * 1.2, real(*args)[..., hidden:]], -1))
    wrong = ColocatedFeatureSource(pipeline.adapter, dataset, layer_ids, "float32", check_every=2)
    wrong.get_batch([3])  # capture order 0: checked
    with pytest.raises(ValueError, match=f"sample '{dataset[3]['id']}': tap {layer_ids[0]} differs from "
                                         rf"output_hidden_states\[{layer_ids[0] + 1}\] of a plain forward"):
        wrong.verify_features()
    wrong.get_batch([4])  # capture order 1: not checked
    wrong.verify_features()
    wrong.get_batch([5, 6])  # 2 checked, 3 not
    with pytest.raises(ValueError, match=f"sample '{dataset[5]['id']}'"):
        wrong.verify_features()
    never = ColocatedFeatureSource(pipeline.adapter, dataset, layer_ids, "float32")  # check_every 0
    never.get_batch([3, 4])
    never.verify_features()


def test_a_wrong_final_state_is_caught_by_the_plain_forward(colocated_run, monkeypatch):
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated", "capture.cache=false"]))
    dataset, layer_ids = load_dataset_dir(colocated_run / "data"), pipeline.train.colocated_source().layer_ids
    real = pipeline.adapter.capture_with_final
    monkeypatch.setattr(pipeline.adapter, "capture_with_final",
                        lambda *args: (real(*args)[0], real(*args)[1] * 0.5))
    source = ColocatedFeatureSource(pipeline.adapter, dataset, layer_ids, "float32", final_hidden=True, check_every=1)
    source.get_batch([1])
    with pytest.raises(ValueError, match=f"sample '{dataset[1]['id']}': the final normed state differs from "
                                         r"output_hidden_states\[\d+\]"):
        source.verify_features()


@pytest.mark.parametrize("ahead,accum,captured,logged", [(True, 1, 3, 1), (False, 1, 2, 1), (True, 2, 4, 0),
                                                          (False, 2, 2, 0)])
def test_a_run_stops_on_the_step_whose_features_are_bad(tmp_path, monkeypatch, ahead, accum, captured, logged):
    """The second micro-batch's features are bad: with one micro-batch a step, step 2 is the bad one; with two,
    step 1. Made ahead (train.prepare_ahead), the next step's micro-batches were captured during the bad step and
    are dropped."""
    from dflash.extract import colocated

    real = colocated.feature_flags
    calls = []

    def bad_on_the_second_batch(features, lengths, layer_ids):
        calls.append(1)
        return real(features, lengths, layer_ids) * (0 if len(calls) == 2 else 1)

    monkeypatch.setattr(colocated, "feature_flags", bad_on_the_second_batch)
    with pytest.raises(ValueError, match="has non-finite hidden states"):
        Pipeline(compose(TINY + [f"run_dir={tmp_path}", "capture=colocated", f"train.prepare_ahead={ahead}",
                                 f"train.grad_accum={accum}"])).run()
    assert len(calls) == captured
    assert len(losses(tmp_path)) == logged  # the bad step was never logged (nor saved)


@pytest.mark.gpu(reason="pinned copies, events, SDPA kernels")
def test_on_cuda_the_padded_batch_and_the_deferred_check_work_the_same(tmp_path, monkeypatch):
    # The data and capture stages of a run of its own: a machine with a GPU refuses training with device=cpu, as the
    # module's run (colocated_run) has it.
    overrides = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "capture=colocated",
                 "device=cuda:0"]
    Pipeline(compose(overrides + ["stages=[data,capture]"])).run()
    pipeline = Pipeline(compose(overrides))
    source = pipeline.train.colocated_source()
    batch, _ = source.get_batch([4, 1, 6], pin_memory=True)
    assert batch["input_ids"].is_pinned() and batch["hidden"].device.type == "cuda"
    expected = collate(source.get_many([4, 1, 6]))
    for key, value in expected.items():
        assert torch.equal(batch[key].cpu(), value.cpu()), key
    # dflash's own code in get_batch never makes the host wait for the GPU (the target's modeling code may).
    with host_waits() as waits:
        source.get_batch([3, 4, 5], pin_memory=True)
    assert not ours(waits), ours(waits)
    # The target's attention runs SDPA's efficient/flash kernels, never cuDNN's (which plans each new width on the
    # host).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        source.get_batch([0, 5], pin_memory=True)
    names = {event.name for event in profiled.events()}
    assert not [name for name in names if "cudnn_attention" in name]
    assert [name for name in names if "scaled_dot_product" in name]
    source.verify_features()
    real = pipeline.adapter.capture
    monkeypatch.setattr(pipeline.adapter, "capture",
                        lambda *args: real(*args).index_fill(2, torch.tensor([0], device="cuda"), float("nan")))
    source.get_batch([2, 3])
    with pytest.raises(ValueError, match=f"sample '{source.dataset[2]['id']}'.*non-finite"):
        source.verify_features()


@pytest.mark.slow
def test_capture_compile_trains_the_same_losses_and_leaves_the_target_eager_for_eval(colocated_run, tmp_path,
                                                                                      one_thread):
    from torch._dynamo.utils import counters

    run = Pipeline(compose(TINY + [f"run_dir={tmp_path}", "capture=colocated", "capture.compile=true",
                                   "train.max_steps=3"]))
    torch._dynamo.reset()  # graphs an earlier test compiled for the same layer code would be reused, uncounted
    graphs = counters["stats"]["unique_graphs"]
    run.run()
    assert counters["stats"]["unique_graphs"] > graphs  # the target's layers ran compiled
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(colocated_run)[:3]),
                               rtol=1e-4, atol=1e-4)
    assert all("forward" not in vars(layer) for layer in run.adapter.decoder_layers())
    # Features do not depend on it, so a run that only turns it on reuses the capture stage.
    assert run.capture.fingerprint() == Pipeline(compose(TINY + [f"run_dir={tmp_path}", "capture=colocated",
                                                                 "train.max_steps=3"])).capture.fingerprint()


def test_capture_cuda_graphs_gives_the_source_a_static_capture_of_every_width(colocated_run, monkeypatch):
    """The train stage's wiring of capture.cuda_graphs (the graphs themselves need a GPU: tests/test_static_capture.py
    runs them eagerly on the CPU): a StaticCapture for the run's taps, sized by its longest sample."""
    import dflash.extract.static_capture as static_capture

    built = []

    class Recorder(static_capture.StaticCapture):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, cuda_graphs=False)
            built.append(self)

    monkeypatch.setattr(static_capture, "StaticCapture", Recorder)
    # stages without train: the composed config refuses CUDA graphs for a run that trains on the CPU.
    pipeline = Pipeline(compose(TINY + [f"run_dir={colocated_run}", "capture=colocated", "capture.cuda_graphs=true",
                                        "stages=[data,capture]"]))
    source = pipeline.train.colocated_source()
    assert source.static is built[0] and built[0].layer_ids == source.layer_ids
    longest = max(len(ids) for ids in source.dataset["input_ids"])
    assert built[0].max_width == built[0].rounded(longest)
    assert built[0].pad_id == pipeline.adapter.tokenizer.pad_token_id
    plain = ColocatedFeatureSource(pipeline.adapter, source.dataset, source.layer_ids,
                                   str(source.dtype).removeprefix("torch."))
    batch, expected = source.get_batch([4, 1, 6])[0], plain.get_batch([4, 1, 6])[0]
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(batch[key].float(), value.float(), rtol=2e-2, atol=2e-2, msg=key)
