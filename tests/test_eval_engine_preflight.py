"""eval.live_engine=static on a target the static engines cannot decode is refused in one line before any work: from
the target's config when its family says so (a GDN hybrid), else once the target is loaded, before the prompt sets
are answered; evaluate() refuses it before its warm-up."""

from __future__ import annotations

import os

import pytest
import transformers

from dflash.config import ConfigError, compose
from dflash.eval.evaluate import evaluate
from dflash.models.targets.tiny import TINY_FAMILIES
from dflash.pipeline import Pipeline

TINY = ["+experiment=tiny", "show_progress=false"]
STATIC = ["eval.mode=live", "eval.live_engine=static"]


def test_a_gdn_hybrid_tiny_target_is_refused_before_any_stage_runs(tmp_path):
    run_dir = tmp_path / "run"
    command = TINY + [f"run_dir={run_dir}", "target.tiny.family=qwen3_5", "target.mask_token_id=null", *STATIC]
    with pytest.raises(ConfigError, match=r"^eval.live_engine=static: .*'qwen3_5_text'.*eval.live_engine=auto or hf$"):
        Pipeline(compose(command)).run()
    assert not run_dir.exists()


def test_a_gdn_hybrid_checkpoint_is_refused_from_its_config(tmp_path):
    checkpoint, run_dir = tmp_path / "checkpoint", tmp_path / "run"
    name, sizes = TINY_FAMILIES["qwen3_5"]
    getattr(transformers, name)(**sizes, vocab_size=512).save_pretrained(checkpoint)  # its config alone, no weights
    command = ["target=hf", f"target.path={checkpoint}", "device=cpu", f"run_dir={run_dir}", *STATIC]
    with pytest.raises(ConfigError, match=r"^eval.live_engine=static: .*'qwen3_5_text'"):
        Pipeline(compose(command)).run()
    assert not run_dir.exists()


def test_a_target_the_engine_refuses_once_loaded_is_refused_before_its_prompts_are_answered(tmp_path, monkeypatch):
    run = TINY + [f"run_dir={tmp_path}", "train.epochs=1"]
    Pipeline(compose(run + ["stages=[data,capture,train,export]"])).run()

    def must_not_answer(*args, **kwargs):
        raise AssertionError("the prompt sets were loaded and answered")

    # A dense family (the preflight lets it pass) whose loaded model the static engines refuse.
    monkeypatch.setattr("dflash.models.targets.base.TargetAdapter.static_layout_problem", lambda self: "a reason")
    monkeypatch.setattr("dflash.eval.evaluate.load_prompt_sets", must_not_answer)
    with pytest.raises(ConfigError, match="^eval.live_engine=static: .*a reason"):
        Pipeline(compose(run + ["stages=[eval]", *STATIC])).run()
    assert not os.path.exists(tmp_path / "eval" / "summary.json")


def test_evaluate_refuses_the_engine_before_its_warm_up(tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target("qwen3_5")

    def must_not_decode(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr("dflash.eval.evaluate.live_decode", must_not_decode)
    prompt = adapter.chat_ids([{"role": "user", "content": "Hi"}])
    with pytest.raises(ConfigError, match="^eval.live_engine=static: "):
        evaluate(make_drafter(adapter), adapter, {"set": [prompt]}, max_new_tokens=8, batch_size=1, mode="live",
                 measure_target=True, live_engine="static", draft_sampling="greedy", show_progress=False)
