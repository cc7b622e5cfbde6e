"""`capture=colocated`: each trainer rank runs the target itself; the losses equal the offline store's (CPU, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.data.dataset import load_dataset_dir
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.extract.store import FeatureStore
from dflash.pipeline import Pipeline

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
