"""build_dataset and data.heldout: a held-out set of every prompt that data.max_length leaves room to answer is
refused in one line before any answer is generated."""

from __future__ import annotations

import pytest

from dflash.config.errors import ConfigError
from dflash.data.dataset import build_dataset, load_dataset_dir, load_heldout_dir
from dflash.data.prompts import Prompt
from tests.schema_options import answer_options

GEN = answer_options(max_length=160, max_new_tokens=6, batch_size=3, show_progress=False)


def prompts() -> list[Prompt]:
    """Three prompts that fit max_length=160 and four that do not."""
    short = [Prompt(f"s{i}", [{"role": "user", "content": f"Question {i}?"}], "test") for i in range(3)]
    long = [Prompt(f"l{i}", [{"role": "user", "content": f"Question {i}: " + "word " * 200}], "test")
            for i in range(4)]
    return short + long


def test_a_heldout_set_of_every_prompt_that_fits_is_refused_before_answering(tiny_target, tmp_path, monkeypatch):
    adapter = tiny_target("llama")
    monkeypatch.setattr("dflash.data.dataset.regenerate", lambda *a, **k: pytest.fail("answers were generated"))
    with pytest.raises(ConfigError) as error:
        build_dataset(prompts(), adapter, tmp_path / "a", heldout=3, **GEN)
    assert str(error.value) == ("data.heldout=3: expected fewer than the 3 prompts left after skipping the 4 longer "
                                "than data.max_length - 1 = 159 tokens once templated")


def test_a_heldout_set_smaller_than_the_prompts_that_fit_is_built(tiny_target, tmp_path):
    stats = build_dataset(prompts(), tiny_target("llama"), tmp_path / "a", heldout=2, **GEN)
    assert (stats["done"], stats["skipped"], stats["samples"], stats["heldout"]) == (3, 4, 1, 2)
    assert len(load_dataset_dir(tmp_path / "a")) == 1 and len(load_heldout_dir(tmp_path / "a")) == 2


@pytest.mark.parametrize("source", ["file", "sharegpt"])
def test_without_a_limit_a_heldout_set_of_every_prompt_is_refused_before_any_work(tmp_path, source):
    """data.limit=null: the schema cannot count the prompts, so the data stage's preflight does, before the run
    folder is made and the target loaded (it failed with a traceback after both)."""
    from dflash.config import compose
    from dflash.pipeline import Pipeline

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(f'{{"id": "p{i}", "prompt": "Question {i}?"}}\n' for i in range(3)))
    given = ["data.source=file", f"data.path={prompts_file}", "data.heldout=3"] if source == "file" else \
        ["data.heldout=100000"]
    run_dir = tmp_path / "run"
    command = ["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", "data.limit=null", *given]
    expected = ("data.heldout=3: expected fewer than the 3 prompts the data stage can answer (3 from "
                "data.source=file, data.path, 0 synthetic)") if source == "file" else \
        ("data.heldout=100000: expected fewer than the 11137 prompts the data stage can answer (11137 from "
         "data.source=sharegpt")
    with pytest.raises(ConfigError) as error:
        Pipeline(compose(command)).run()
    assert str(error.value).startswith(expected) and not run_dir.exists()
