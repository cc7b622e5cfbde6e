"""`target=hf target.path=<folder or .gguf>`: what is refused before any stage (one line each), a GGUF file
converted once and cached, and the whole pipeline on an HF folder of a family no other pipeline test uses."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import transformers

from dflash.config import ConfigError, compose, settings_from
from dflash.config.errors import ConfigPathError
from dflash.models.targets import gguf, load_target, smollm2
from dflash.models.targets.preflight import checkpoint_config
from dflash.models.targets.tiny import build_builtin_tokenizer, build_tiny_target
from dflash.pipeline import Pipeline

TINY = ["+experiment=tiny", "show_progress=false"]
# Less work per family than the tiny experiment's (12 of its 32 prompts, one prompt per eval set): every stage still
# runs on each family, in half the time.
FEWER = ["data.limit=12", "eval.prompt_sets.humaneval.limit=1", "eval.prompt_sets.mtbench.limit=1",
         "eval.prompt_sets.gsm8k.limit=1"]


def hf_folder(tmp_path, family="gemma2", **overrides):
    """A tiny random checkpoint of `family` saved as a user's HF folder (weights, config, tokenizer)."""
    adapter = build_tiny_target(family, seed=0, tokenizer="builtin", **overrides)
    folder = tmp_path / family
    adapter.model.save_pretrained(folder)
    adapter.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("path,problem", [
    (None, r"target.path=null: expected a Hugging Face checkpoint folder or a .gguf file \(kind=hf\)"),
    ("/nonexistent/model", "no such folder"),
    ("/nonexistent/model.gguf", "no such GGUF file"),
])
def test_missing_paths_are_refused_in_one_line(path, problem):
    with pytest.raises(ConfigError, match=problem) as refused:
        Pipeline(compose(TINY + ["target=hf"] + ([f"target.path={path}"] if path else [])))
    assert "\n" not in str(refused.value)


def test_unreadable_files_are_refused_in_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigPathError, match=r"not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"):
        Pipeline(compose(TINY + ["target=hf", f"target.path={fake}"]))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigPathError, match="a folder without config.json"):
        Pipeline(compose(TINY + ["target=hf", f"target.path={tmp_path / 'folder'}"]))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ConfigPathError, match="a file, but not a .gguf one: give a checkpoint folder or a .gguf file$"):
        Pipeline(compose(TINY + ["target=hf", f"target.path={notes}"]))
    chunk = tmp_path / "model.gguf.part00"
    chunk.write_bytes(b"GGUF")
    with pytest.raises(ConfigPathError, match=r"one chunk of a GGUF file split in parts: join them into one \.gguf "
                                              r"first \(.*python -m dflash.models.targets.gemma3_270m\)"):
        Pipeline(compose(TINY + ["target=hf", f"target.path={chunk}"]))


def test_a_stateful_family_is_refused_before_any_stage(tmp_path):
    folder = tmp_path / "jamba"
    transformers.JambaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, num_experts=2).save_pretrained(folder)
    build_builtin_tokenizer().save_pretrained(folder)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "dflash.train", *TINY, "target=hf", f"target.path={folder}",
               f"run_dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("dflash: error:")]
    assert len(error) == 1 and "target 'jamba' (JambaForCausalLM) keeps recurrent state" in error[0], done.stderr
    assert not os.path.exists(run_dir / "data")  # refused before the data stage


def test_a_command_that_loads_no_target_reads_no_checkpoint_config(tmp_path):
    from dflash.stages.context import refuse_unusable_target

    folder = tmp_path / "jamba"
    transformers.JambaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(folder)
    export = settings_from(compose(TINY + ["target=hf", f"target.path={folder}", "stages=[export]"]))
    refuse_unusable_target(export)  # the export reads the drafter's checkpoints alone
    with pytest.raises(ConfigError, match="keeps recurrent state"):
        refuse_unusable_target(dataclasses.replace(export, stages=["eval"]))


def test_an_hf_folder_loads_through_the_generic_adapter(tmp_path):
    folder = hf_folder(tmp_path, "olmo2")
    adapter = load_target("hf", path=str(folder))
    assert type(adapter).__name__ == "GenericTargetAdapter" and adapter.model_type == "olmo2"
    assert checkpoint_config(str(folder)).model_type == "olmo2"


def test_a_bpe_tokenizer_that_asks_for_the_space_clean_up_decodes_without_a_warning(tmp_path, caplog):
    """transformers (5.7 on) skips that clean-up for BPE and warns at the first decode (SmolLM2's config asks for it
    on some releases): the target's tokenizer and its vocabulary's have it off, the text is the same."""
    from dflash.models.targets.base import without_bpe_cleanup
    from dflash.models.targets.load import load_target_vocabulary

    folder = hf_folder(tmp_path, "olmo2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    for tokenizer in (load_target("hf", path=str(folder)).tokenizer,
                      load_target_vocabulary("hf", path=str(folder)).tokenizer):
        assert tokenizer.clean_up_tokenization_spaces is False
        with caplog.at_level("WARNING"):
            assert tokenizer.decode(tokenizer("Hello , world !")["input_ids"]) == "Hello , world !"
    assert "clean_up_tokenization_spaces" not in caplog.text
    forced = load_target("hf", path=str(folder)).tokenizer  # a tokenizer that asks for the clean-up whatever it does
    forced.clean_up_tokenization_spaces = True
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert without_bpe_cleanup(forced).clean_up_tokenization_spaces is True


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_cached(tmp_path, monkeypatch):
    import gguf as gguf_package

    source = smollm2.gguf_path()
    cache = str(tmp_path / "cache")  # fresh: the suite's one real conversion (the others load the user's cache)
    assert checkpoint_config(str(source), cache).model_type == "llama"  # from the GGUF's metadata
    parses, reader = [], gguf_package.GGUFReader
    monkeypatch.setattr(gguf_package, "GGUFReader", lambda *args: parses.append(args) or reader(*args))
    adapter = load_target("hf", path=str(source), cache_dir=cache)
    # transformers' loader reads the file for the config, the weights and the tokenizer: one parse serves all three.
    assert len(parses) == 1
    folder = gguf.cached_folder(source, cache)
    assert gguf.is_converted(folder) and adapter.num_layers == 30 and adapter.vocab_size == 49152
    info = json.loads((folder / gguf.SOURCE_FILE).read_text())
    assert info["gguf"] == str(source.resolve()) and info["dtype"] == "float32"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    load_target("hf", path=str(source), cache_dir=cache)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # read from the cache, not converted again
    assert checkpoint_config(str(source), cache).model_type == "llama"
    # An interrupted conversion (no completion marker) is converted again in its place, through one swap that
    # leaves nothing beside the cache folder.
    (folder / gguf.SOURCE_FILE).unlink()
    (folder / "stray").write_text("")
    load_target("hf", path=str(source), cache_dir=cache)
    assert gguf.is_converted(folder) and not (folder / "stray").exists()
    assert sorted(os.listdir(folder.parent)) == [f".{folder.name}.lock", folder.name]  # and the conversion's lock


# The export's config carries the target's final logit transform, as the reference drafter reads it.
EXPORTED_TRANSFORMS = {"gemma2": {"final_logit_softcapping": 2.0}, "granite": {"output_multiplier": 0.125},
                       "gemma3_text": {"final_logit_softcapping": 30.0}, "cohere": {"output_multiplier": 0.5}}


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [("gemma2", {"final_logit_softcapping": 2.0}), ("gpt_oss", {}),
                                              ("deepseek_v3", {}), ("granite", {"logits_scaling": 8.0}),
                                              ("gemma3_text", {}), ("phi3", {}), ("olmo2", {}), ("glm4", {}),
                                              ("cohere", {}), ("stablelm", {})])
def test_every_stage_runs_on_an_hf_folder_with_no_mask_token_given(tmp_path, family, overrides):
    folder = hf_folder(tmp_path, family, **overrides)
    run_dir = tmp_path / "run"
    summary = Pipeline(compose(TINY + FEWER + ["target=hf", f"target.path={folder}", f"run_dir={run_dir}"])).run()
    assert 1.0 <= summary["overall"]["tau"] <= 4.0
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == 3  # <|mask|> of the built-in tokenizer, chosen
    transform = {k: v for k, v in exported["dflash_config"].items()
                 if k in ("output_multiplier", "final_logit_softcapping")}
    assert transform == EXPORTED_TRANSFORMS.get(family, {})


ROPE_HEAD = 16  # head_dim of the tiny families


@pytest.mark.parametrize("family,overrides,limit", [
    ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=64,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0] * (ROPE_HEAD // 2), "long_factor": [4.0] * (ROPE_HEAD // 2),
                                   "original_max_position_embeddings": 64}),
     64),
    ("llama", dict(max_position_embeddings=96, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                "rope_theta": 10000.0}), 96),
])
def test_a_rope_that_changes_with_the_forwards_length_is_held_below_it(tmp_path, family, overrides, limit):
    """longrope and dynamic NTK pick their frequencies per forward from its longest sequence: past that length a
    sample's answer and features would depend on the samples beside it, so data.max_length must stay within it."""
    folder = hf_folder(tmp_path, family, **overrides)
    command = TINY + ["target=hf", f"target.path={folder}"]
    rope = json.loads((folder / "config.json").read_text()).get("rope_parameters") or {}
    assert rope.get("rope_type") in ("longrope", "dynamic")
    from dflash.stages.context import refuse_unusable_target

    with pytest.raises(ConfigError, match=rf"data.max_length=192, data.max_new_tokens=32: target.path=.* has "
                                          rf"rope_type '{rope['rope_type']}', whose frequencies change once a "
                                          rf"forward's longest sequence passes {limit} tokens.*reach 223 tokens"):
        refuse_unusable_target(settings_from(compose(command)))
    # A batch's longest prompt runs on for its shortest prompt's answer budget: max_length alone is not the bound.
    within = [f"data.max_length={limit - 31}", "data.max_new_tokens=32"]
    refuse_unusable_target(settings_from(compose(command + within)))
    with pytest.raises(ConfigError, match=rf"reach {limit + 1} tokens"):
        refuse_unusable_target(settings_from(compose(command + [f"data.max_length={limit - 30}"])))
    refuse_unusable_target(settings_from(compose(command + ["stages=[eval]"])))  # an evaluation makes no data


def test_the_first_rope_switch_of_any_layer_type_counts():
    from dflash.models.targets.preflight import length_dependent_rope

    config = transformers.LlamaConfig(max_position_embeddings=131072)
    config.rope_parameters = {"full_attention": {"rope_type": "dynamic", "factor": 4.0},
                              "sliding_attention": {"rope_type": "longrope", "original_max_position_embeddings": 4096}}
    assert length_dependent_rope(config) == ("longrope", 4096)
    config.rope_parameters = {"full_attention": {"rope_type": "longrope", "original_max_position_embeddings": 4096},
                              "sliding_attention": None}  # a type without its own set
    assert length_dependent_rope(config) == ("longrope", 4096)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    assert length_dependent_rope(config) is None
