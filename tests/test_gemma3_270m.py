"""The second real target, Gemma 3 270M from its PyPI chunk packages, through `target=hf target.path=<gguf>`: the
file joined and checked, the generic adapter's logits equal to the model's, and every stage on the CPU with no mask
token and no chat template given (slow: the first conversion of the GGUF takes minutes, later runs read the cache
under ~/.cache/dflash)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.config import compose
from dflash.models.targets import gemma3_270m, load_target
from dflash.pipeline import Pipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf():
    try:
        return gemma3_270m.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


def test_the_joined_file_loads_as_a_generic_target(gguf):
    adapter = load_target("hf", path=str(gguf))
    assert type(adapter).__name__ == "GenericTargetAdapter" and adapter.model_type == "gemma3_text"
    assert adapter.num_layers == 18 and adapter.vocab_size == 262144
    ids = adapter.tokenizer("def factorial(n):", return_tensors="pt").input_ids
    out = adapter.model.generate(ids, max_new_tokens=20, do_sample=False)
    # A real model, not random weights: "\n    if n == 0 or n == 1:\n        return 1"
    assert "return 1" in adapter.tokenizer.decode(out[0, ids.shape[1]:])
    # No chat template: prompts take the plain format, after the <bos> the tokenizer puts before plain text (the
    # model degenerates without it).
    prompt = adapter.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt[0] == adapter.tokenizer.bos_token_id and prompt.count(adapter.tokenizer.bos_token_id) == 1
    out = adapter.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert "Paris" in adapter.tokenizer.decode(out[0, len(prompt):])
    features, final = adapter.capture_with_final(ids, None, [1, 9, 15])
    with torch.no_grad():
        logits = adapter.model(ids).logits
    torch.testing.assert_close(adapter.logit_transform(final @ adapter.lm_head_weight().T), logits,
                               rtol=1e-4, atol=1e-3)


def test_every_stage_on_the_cpu(gguf, tmp_path):
    run_dir = tmp_path / "run"
    summary = Pipeline(compose([
        "+experiment=tiny", "show_progress=false", "target=hf", f"target.path={gguf}", "target.dtype=float32",
        f"run_dir={run_dir}", "data.limit=6", "data.max_new_tokens=16", "train.epochs=2", "eval.max_new_tokens=8",
        "eval.prompt_sets.humaneval.limit=1", "eval.prompt_sets.mtbench.limit=1", "eval.prompt_sets.gsm8k.limit=1",
    ])).run()
    assert 1.0 <= summary["overall"]["tau"] <= 4.0
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == 4  # <mask> of the Gemma tokenizer, chosen
    assert exported["vocab_size"] == 262144 and exported["hidden_size"] == 640

