"""The target's labels (train.labels=target, capture=colocated): each loss position's CE label is the target's argmax
token after the stored prefix, the stored token where that is the target's greedy choice and not elsewhere."""

import json

import pytest
import torch

from dflash.config import ConfigError, compose, fingerprints, settings_from
from dflash.data.dataset import build_dataset, load_dataset_dir
from dflash.data.prompts import Prompt
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.pipeline import Pipeline
from dflash.train.batches import prepare_micro_batch
from dflash.train.objective import loss_rows, target_labels
from tests.schema_options import answer_options

TEXTS = ["hi", "what is two plus two?", "tell me a story about a cat", "name three colours", "ok then",
         "why is the sky blue?"]
PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": t}], "test") for i, t in enumerate(TEXTS)]
BLOCK, ANCHORS = 4, 6


def test_labels_are_the_targets_argmax_at_the_position_before_each_predicted_token():
    generator = torch.Generator().manual_seed(0)
    batch, seq_len, hidden, vocab = 2, 13, 8, 17
    final = torch.randn(batch, seq_len, hidden, generator=generator)
    head = torch.randn(vocab, hidden, generator=generator)
    anchors = torch.tensor([[0, 3, 9, 11], [1, 2, 6, 0]])
    labels = torch.randint(0, vocab, (batch, 4, BLOCK), generator=generator)
    weights = torch.rand(batch, 4, BLOCK, generator=generator)
    weights[:, :, 0] = 0
    weights[1, 3] = 0  # a padding anchor
    weights[0, 3, 2:] = 0  # past the sequence end
    expected = labels.clone()
    for b in range(batch):
        for n in range(4):
            for k in range(BLOCK):
                if weights[b, n, k]:
                    expected[b, n, k] = (final[b, anchors[b, n] + k - 1] @ head.T).argmax()
    for chunk_size in (1, 3, 1000):
        assert torch.equal(target_labels(labels, weights, final, anchors, head, chunk_size), expected)
    rows = loss_rows(weights)
    assert torch.equal(target_labels(labels, weights, final, anchors, head, 5, rows), expected)
    none = torch.zeros_like(weights)
    assert torch.equal(target_labels(labels, none, final, anchors, head), labels)


def labels_of(adapter, data_dir):
    """(answer labels, target labels, the target's argmax at a+k-1 from HF logits, loss weights) of one
    micro-batch of every sample of the data set in data_dir."""
    dataset = load_dataset_dir(data_dir)
    source = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", final_hidden=True)
    slots = [(i, True) for i in range(len(dataset))]
    batch = prepare_micro_batch(source, slots, epoch=0, seed=0, num_anchors=ANCHORS, block_size=BLOCK, gamma=4.0)
    mine = target_labels(batch["labels"], batch["weights"], batch["target_final"], batch["anchors"],
                         adapter.lm_head_weight(), chunk_size=7, rows=batch["loss_rows"])
    argmax = torch.zeros_like(batch["labels"])
    for row in range(len(dataset)):
        ids = torch.tensor(dataset[row]["input_ids"])[None]
        with torch.no_grad():
            greedy = adapter.model(input_ids=ids, use_cache=False).logits[0].argmax(-1)
        positions = (batch["anchors"][row, :, None] + torch.arange(BLOCK) - 1).clamp(0, ids.shape[1] - 1)
        argmax[row] = greedy[positions]
    return batch["labels"], mine, argmax, batch["weights"] != 0


def test_on_sampled_answers_the_labels_differ_exactly_where_the_answer_left_the_argmax(tiny_target, tmp_path):
    adapter = tiny_target("llama")
    build = answer_options(max_length=64, max_new_tokens=16, batch_size=3, show_progress=False)
    # At T=1 the random tiny target almost never samples its argmax; at 0.1 about 60% of the tokens leave it.
    build_dataset(PROMPTS, adapter, tmp_path / "sampled", temperature=0.1, **build)
    answer, target, argmax, loss = labels_of(adapter, tmp_path / "sampled")
    assert torch.equal(target[loss], argmax[loss])
    off_path = loss & (answer != argmax)
    assert off_path.any() and (~off_path & loss).any()  # sampling left the argmax somewhere, not everywhere
    assert torch.equal(target != answer, off_path)  # the labels differ there and only there
    build_dataset(PROMPTS, adapter, tmp_path / "greedy", temperature=0.0, **build)
    answer, target, argmax, loss = labels_of(adapter, tmp_path / "greedy")
    assert torch.equal(target, answer) and torch.equal(target[loss], argmax[loss])


TINY = ["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]", "data.limit=8",
        "train.max_steps=4"]


def test_a_colocated_run_trains_on_the_targets_labels(tmp_path):
    run = TINY + [f"run_dir={tmp_path}", "capture=colocated", "train.labels=target", "data.temperature=1.0",
                  "data.sampled_share=0.5"]
    pipeline = Pipeline(compose(run))
    pipeline.run()
    assert pipeline.train.colocated_source().final_hidden
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert 0 < len(records) <= 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    stats = json.loads((tmp_path / "data" / "stats.json").read_text())
    mix = stats["answer_mix"]["samples"]
    assert mix["greedy"] > 0 and mix["sampled"] > 0 and mix["greedy"] + mix["sampled"] == stats["samples"]


def test_the_setting_is_refused_without_the_target_and_fingerprinted(tmp_path):
    tiny = ["+experiment=tiny", f"run_dir={tmp_path / 'run'}"]
    for capture in ("offline", "online"):
        with pytest.raises(ConfigError, match=f"train.labels=target needs the target's logits .* capture={capture}"):
            settings_from(compose(tiny + [f"capture={capture}", "train.labels=target"]))
    with pytest.raises(ConfigError, match="train.labels='argmax': expected one of 'answer', 'target'"):
        settings_from(compose(tiny + ["train.labels=argmax"]))
    assert not (tmp_path / "run").exists()
    answer = settings_from(compose(tiny + ["capture=colocated"]))
    target = settings_from(compose(tiny + ["capture=colocated", "train.labels=target"]))
    assert "labels" not in fingerprints.stage_settings(answer.train, "train")
    assert fingerprints.capture_fingerprint(target, {}) == fingerprints.capture_fingerprint(answer, {})
    assert fingerprints.settings_fingerprint(target) != fingerprints.settings_fingerprint(answer)
