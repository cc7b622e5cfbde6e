"""The MASK token: chosen among the tokenizer's special tokens clear of the chat template and the data, or a given
one checked (vocabulary before any stage, template and data at capture), and what the export records."""

from __future__ import annotations

import json

import datasets
import pytest

from dflash.config import ConfigError, compose, settings_from
from dflash.data.token_ids import token_ids_in
from dflash.models.targets.mask_token import choose_mask_token, mask_token_name, mask_token_problem, template_ids
from dflash.models.targets.tiny import build_builtin_tokenizer, build_tiny_target
from dflash.pipeline import Pipeline
from tests.test_target_hf import TINY, hf_folder


def tokenizer_with(*extra):
    tokenizer = build_builtin_tokenizer()
    tokenizer.add_tokens(list(extra), special_tokens=True)
    return tokenizer


def test_a_mask_named_token_comes_first_and_the_data_is_checked():
    tokenizer = tokenizer_with("<|reserved_0|>", "<tool>")
    assert choose_mask_token(tokenizer, 320, set()) == (3, "'<|mask|>', a mask token of the tokenizer")
    reserved = tokenizer.convert_tokens_to_ids("<|reserved_0|>")
    assert choose_mask_token(tokenizer, 320, {3}) == (reserved, "'<|reserved_0|>', a reserved special token")
    tool = tokenizer.convert_tokens_to_ids("<tool>")
    assert choose_mask_token(tokenizer, 320, {3, reserved}) == (tool, "'<tool>', a special token")


def test_template_tokens_and_the_tokenizers_own_are_never_chosen():
    tokenizer = build_builtin_tokenizer()
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert {start, end} <= template_ids(tokenizer)
    # <|mask|> taken by the data: <|im_start|> (bos, template) and <|endoftext|> (pad) are not candidates, so the
    # first embedding row past the tokenizer (260) is.
    assert choose_mask_token(tokenizer, 320, {3}) == (260, "a row of the embedding table past the tokenizer's "
                                                           "last id")
    with pytest.raises(ValueError, match="no free mask token"):
        choose_mask_token(tokenizer, len(tokenizer), {3})


def test_the_mask_tokens_name_is_the_text_that_gives_its_id_back():
    """What an engine that resolves the mask token by name (SGLang before it read mask_token_id) finds: the token's
    text, where that text looks up to the same id; none for a row past the tokenizer's last id."""
    tokenizer = tokenizer_with("<|reserved_0|>")
    assert mask_token_name(tokenizer, 3) == "<|mask|>"
    reserved = tokenizer.convert_tokens_to_ids("<|reserved_0|>")
    assert mask_token_name(tokenizer, reserved) == "<|reserved_0|>"
    assert mask_token_name(tokenizer, len(tokenizer)) is None and mask_token_name(tokenizer, -1) is None


def test_the_export_names_the_mask_token_for_engines_that_look_it_up_by_name(tmp_path):
    run_dir = tmp_path / "run"
    stages = "stages=[data,capture,train,export]"
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "data.limit=4", "train.epochs=1", stages])).run()
    target = json.loads((run_dir / "features" / "target.json").read_text())
    config = json.loads((run_dir / "export" / "config.json").read_text())["dflash_config"]
    assert config["mask_token_id"] == target["mask_token_id"] and config["mask_token"] == target["mask_token"]
    tokenizer = build_tiny_target("llama", tokenizer="builtin").tokenizer
    assert tokenizer.convert_tokens_to_ids(config["mask_token"]) == config["mask_token_id"]


def test_a_given_mask_token_is_checked():
    tokenizer = build_builtin_tokenizer()
    assert mask_token_problem(3, tokenizer, 320) is None
    assert mask_token_problem(320, tokenizer, 320) == "outside the target's vocabulary (0..319)"
    assert mask_token_problem(1, tokenizer, 320) == "'<|im_start|>' is produced by the chat template"
    letter = tokenizer.convert_tokens_to_ids("d")
    assert mask_token_problem(letter, tokenizer, 320, {letter}) == "'d' occurs in the training data"


def test_token_ids_of_a_dataset():
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [3, 4, 700]], "loss_mask": [[0, 1, 1]] * 2})
    assert token_ids_in(dataset) == {1, 2, 3, 4, 700} and token_ids_in(None) == set()


def test_a_mask_token_outside_the_vocabulary_is_refused_before_any_stage(tmp_path):
    folder = hf_folder(tmp_path, "phi3")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"target.mask_token_id=248070: outside the vocabulary of .* \(0..319\)"):
        Pipeline(compose(TINY + ["target=hf", f"target.path={folder}", "target.mask_token_id=248070",
                                 f"run_dir={run_dir}"])).run()
    assert not (run_dir / "data").exists()


@pytest.mark.parametrize("override,message", [
    ("drafter.target_layer_ids=[1,40]", r"drafter.target_layer_ids=\[1, 40\]: \[40\] outside the target's"),
    ("drafter.hidden_size=24", r"drafter.hidden_size=24: the target's hidden size is"),
])
def test_a_drafter_an_hf_target_cannot_feed_is_refused_before_any_stage(tmp_path, override, message):
    folder = hf_folder(tmp_path, "phi3")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        Pipeline(compose(TINY + ["target=hf", f"target.path={folder}", override, f"run_dir={run_dir}"])).run()
    assert not (run_dir / "data").exists()


@pytest.mark.parametrize("family", ["phi3", "qwen3_5", "gemma3_text"])
def test_a_targets_vocabulary_loads_without_its_weights(tmp_path, monkeypatch, family):
    from transformers import AutoModelForCausalLM

    from dflash.models.targets.load import load_target, load_target_vocabulary

    folder = hf_folder(tmp_path, family)
    target = load_target("hf", path=str(folder))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    vocabulary = load_target_vocabulary("hf", path=str(folder))
    assert vocabulary.vocab_size == target.vocab_size
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert vocabulary.tokenizer.apply_chat_template(messages, tokenize=False) == \
        target.tokenizer.apply_chat_template(messages, tokenize=False)
    assert template_ids(vocabulary.tokenizer) == template_ids(target.tokenizer)
    assert vocabulary.tokenizer.pad_token_id == target.tokenizer.pad_token_id is not None
    assert choose_mask_token(vocabulary.tokenizer, vocabulary.vocab_size, {3}) == \
        choose_mask_token(target.tokenizer, target.vocab_size, {3})


@pytest.mark.slow
def test_a_mask_token_the_data_produces_is_refused_at_capture(tmp_path):
    letter = build_tiny_target("llama", tokenizer="builtin").tokenizer.convert_tokens_to_ids("d")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"target.mask_token_id={letter}: 'd' occurs in the training data"):
        Pipeline(compose(TINY + [f"target.mask_token_id={letter}", f"run_dir={run_dir}", "data.limit=4",
                                 "stages=[data,capture]"])).run()
    assert not (run_dir / "features" / "done.json").exists()
    # What the message says to do: the data stage is kept (its marker not rewritten) and a free token is chosen.
    data_done = (run_dir / "data" / "done.json").stat().st_mtime_ns
    Pipeline(compose(TINY + ["target.mask_token_id=null", f"run_dir={run_dir}", "data.limit=4",
                             "stages=[data,capture]"])).run()
    assert (run_dir / "data" / "done.json").stat().st_mtime_ns == data_done
    assert json.loads((run_dir / "features" / "target.json").read_text())["mask_token_id"] != letter


def test_a_mixture_of_experts_target_without_a_dense_mlp_width_asks_for_the_drafters(tmp_path):
    """Qwen3.5/3.6-MoE configs have no intermediate_size (only the experts' widths): the drafter's MLP width cannot
    be taken from them, which is said before any stage instead of failing in a traceback."""
    folder = hf_folder(tmp_path, "qwen3_5_moe")
    config = json.loads((folder / "config.json").read_text())
    config.pop("intermediate_size", None)
    config.get("text_config", {}).pop("intermediate_size", None)
    (folder / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"drafter.intermediate_size=None: .* has no dense MLP width to take \(a "
                                          r"mixture of experts\): give the drafter's, e.g. drafter.intermediate_size="):
        Pipeline(compose(TINY + ["target=hf", f"target.path={folder}", f"run_dir={run_dir}"])).run()
    assert not run_dir.exists()
    # With the drafter's own width, the check passes (the data stage is what would run next).
    from dflash.models.targets.preflight import checkpoint_config, config_shape
    from dflash.stages.shapes import check_drafter_builds

    settings = settings_from(compose(TINY + ["target=hf", f"target.path={folder}", "drafter.intermediate_size=128",
                                             f"run_dir={run_dir}"]))
    check_drafter_builds(settings, config_shape(checkpoint_config(str(folder)).get_text_config()), str(folder))
