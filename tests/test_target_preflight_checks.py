"""Settings the target preflight refuses before any stage runs (dflash/stages/context.refuse_unusable_target): a
tiny target's spec (dflash/models/targets/tiny.check_tiny_spec) and taps the target cannot give
(dflash/stages/shapes.check_drafter_fits), each in one line naming the key and what it takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dflash.config import ConfigError, compose, settings_from
from dflash.models.targets import load_target
from dflash.stages.context import refuse_unusable_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["+experiment=tiny"]


def preflight(*overrides: str) -> None:
    refuse_unusable_target(settings_from(compose(TINY + list(overrides))))


@pytest.mark.parametrize("override,line", [
    ("target.tiny.family=lama", "target.tiny.family='lama': expected one of 'cohere', 'deepseek_v3', "),
    ("target.tiny.family=null", "target.tiny.family=null: expected one of 'cohere', "),
    ("target.tiny.tokenizer=nonexistent", "target.tiny.tokenizer='nonexistent': expected one of 'auto', 'builtin', "
                                          "'smollm2'"),
    ("target.tiny.tokenizer=null", "target.tiny.tokenizer=null: expected one of 'auto', "),
    ("target.tiny.seed=abc", "target.tiny.seed='abc': expected an int"),
    ("target.tiny.seed=1.5", "target.tiny.seed=1.5: expected an int"),
    ("+target.tiny.hidden_size=abc", "target.tiny.hidden_size='abc': expected an int >= 1"),
    ("+target.tiny.num_hidden_layers=abc", "target.tiny.num_hidden_layers='abc': expected an int >= 1"),
    ("+target.tiny.hidden_size=-8", "target.tiny.hidden_size=-8: expected an int >= 1"),
    ("+target.tiny.num_hidden_layers=0", "target.tiny.num_hidden_layers=0: expected an int >= 1"),
    ("+target.tiny.famly=llama", "target.tiny.famly='llama': expected one of family, seed, tokenizer or a field of "
                                 "transformers' LlamaConfig (did you mean target.tiny.family?)"),
    ("+target.tiny.dtype=float32", "target.tiny.dtype='float32': set by target.dtype, not by target.tiny"),
    ("+target.tiny.hiden_size=32", "target.tiny.hiden_size=32: expected one of family, seed, tokenizer or a field of "
                                   "transformers' LlamaConfig (did you mean target.tiny.hidden_size?)"),
])
def test_a_tiny_spec_that_builds_no_target_is_refused(override, line):
    with pytest.raises(ConfigError, match="^" + re.escape(line)):
        preflight(override)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused():
    # The builtin tokenizer (260 tokens), whether or not a SmolLM2 one is cached, which "auto" would take.
    with pytest.raises(ConfigError, match="^" + re.escape("target.tiny.vocab_size=100: expected an int >= 260, the "
                                                          "size of the tiny target's tokenizer")):
        preflight("+target.tiny.vocab_size=100", "target.tiny.tokenizer=builtin")
    preflight("+target.tiny.vocab_size=260", "target.tiny.tokenizer=builtin")


def test_a_smollm2_tokenizer_that_is_not_cached_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^target.tiny.tokenizer='smollm2': expected 'auto' or 'builtin': no "
                                          r"SmolLM2 tokenizer is cached in "):
        preflight("target.tiny.tokenizer=smollm2", f"target.cache_dir={tmp_path}")


def test_a_tiny_spec_of_config_fields_passes():
    preflight("+target.tiny.num_hidden_layers=6", "+target.tiny.rms_norm_eps=1e-5", "target.tiny.seed=3")
    preflight("target.tiny.family=qwen3_5", "+target.tiny.linear_num_value_heads=2")
    # What the config's constructor reads into other fields (transformers 5: rope_theta into rope_parameters), its
    # attention implementation, and a family's own default (granite's head_dim, no attribute of GraniteConfig()).
    preflight("+target.tiny.rope_theta=500000", "+target.tiny.attn_implementation=eager")
    preflight("target.tiny.family=granite", "+target.tiny.head_dim=32")


def test_loading_a_tiny_target_checks_its_spec():
    with pytest.raises(ConfigError, match=r"^target.tiny.seed=1.5: expected an int"):
        load_target("tiny", tiny={"family": "llama", "seed": 1.5, "tokenizer": "builtin"})


def test_more_taps_than_the_default_spread_finds_are_refused():
    """The tiny llama's 8 layers: the default spread taps layers 1..5, so 5 taps at most."""
    with pytest.raises(ConfigError, match=r"^drafter.num_taps=100: expected at most 5 for a target of 8 layers "):
        preflight("drafter.num_taps=100")
    with pytest.raises(ConfigError, match=r"^drafter.num_taps=6: expected at most 5 "):
        preflight("drafter.num_taps=6")
    preflight("drafter.num_taps=5")
    preflight("drafter.num_taps=6", "+target.tiny.num_hidden_layers=9")


def test_a_tap_named_twice_is_refused():
    with pytest.raises(ConfigError, match=r"^drafter.target_layer_ids=\[1, 1\]: expected distinct layer ids"):
        preflight("drafter.target_layer_ids=[1,1]")
    preflight("drafter.target_layer_ids=[1,7]")


def test_the_command_refuses_a_tiny_family_before_any_stage(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "dflash.train", *TINY, f"run_dir={run_dir}", "target.tiny.family=lama"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": "", "HYDRA_FULL_ERROR": ""})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash: error: target.tiny.family='lama': expected one of "), lines
    assert not (run_dir / "data").exists()
