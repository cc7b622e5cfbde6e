"""eval.compile_drafter: live decoding through the drafter's compiled layers (dflash/train/compile_layers.py), which
fuse a drafting step's small kernels, decodes what the eager drafter decodes, and the eval stage compiles them only
for a live evaluation."""

from __future__ import annotations

import copy
import json

import pytest

from dflash.config import compose
from dflash.eval.live import live_decode
from dflash.inductor_settings import COMPILED_MARK
from dflash.pipeline import Pipeline
from dflash.train.compile_layers import compile_layers

# A short evaluation (no MT-Bench second turns) of a drafter trained for one epoch.
TINY = ["+experiment=tiny", "show_progress=false", "train.epochs=1", "~eval.prompt_sets.mtbench"]


@pytest.mark.slow
def test_a_compiled_drafter_decodes_live_what_the_eager_one_does(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    eager = make_drafter(adapter, block_size=4, std=0.2)
    compiled = compile_layers(copy.deepcopy(eager))
    for text in ("Hi", "What is two plus two?"):
        prompt = adapter.chat_ids([{"role": "user", "content": text}])
        runs = [live_decode(drafter, adapter, prompt, max_new_tokens=16, stop_token_ids=adapter.stop_token_ids(),
                            target_engine="auto", draft_sampling="greedy") for drafter in (eager, compiled)]
        assert runs[0].continuation == runs[1].continuation and runs[0].trace == runs[1].trace
    assert all(getattr(layer, COMPILED_MARK, False) for layer in compiled.layers)


@pytest.mark.slow
def test_the_eval_stage_compiles_the_drafter_for_a_live_evaluation_only(tmp_path, monkeypatch):
    import dflash.train.compile_layers as compile_module

    compiled = []
    monkeypatch.setattr(compile_module, "compile_layers", lambda drafter: compiled.append(drafter) or drafter)
    run = TINY + [f"run_dir={tmp_path}", "eval.compile_drafter=true"]
    Pipeline(compose(run)).run()  # replay: the setting is ignored
    assert compiled == []
    Pipeline(compose(run + ["stages=[eval]", "eval.mode=live", f"eval.out_dir={tmp_path / 'eval_live'}"])).run()
    assert len(compiled) == 1
    assert json.loads((tmp_path / "eval_live" / "summary.json").read_text())["compile_drafter"] is True
