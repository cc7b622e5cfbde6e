"""The data stage run again for one reason does not redo what another setting left as it was: a setting that changes
no answer (top_p of greedy answers, the temperature when no answer is sampled) leaves the dataset's fingerprint and
its journal alone; a reused dataset says its answers' counts are the earlier build's; an evaluation set read from
`~/...` is recorded by its file's hash; and what the stage cannot do is one line naming the setting, before any answer:
too many held-out prompts once the overlap check has dropped some, a template that refuses a steering system prompt,
a build killed while saving its held-out split leaves no copy behind when the next one holds none out."""

import json
import os

import pytest

from dflash.config import ConfigError, compose
from dflash.data.dataset import _save_splits, format_stats
from dflash.data.encode import Rows
from dflash.data.prompts import Prompt
from dflash.data.synthetic import steering_prefixes
from dflash.pipeline import Pipeline
from dflash.run_files import read_json

TINY = ["+experiment=tiny", "show_progress=false", "stages=[data]", "data.limit=6", "data.max_new_tokens=4"]


def eval_file(path, texts) -> str:
    path.write_text("".join(json.dumps({"id": f"e{i}", "conversations": [{"from": "human", "value": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    return f"+eval.prompt_sets.mine={{source: file, path: {path}}}"


def data_run(run_dir, *overrides) -> dict:
    Pipeline(compose(TINY + [f"run_dir={run_dir}", *overrides])).run()
    return read_json(os.path.join(run_dir, "data", "stats.json"))


def set_aside(data_dir) -> list[str]:
    """The journals a rerun moved aside (journal.<fingerprint>.jsonl) beside the one in use."""
    return sorted(name for name in os.listdir(data_dir) if name.startswith("journal.") and name != "journal.jsonl")


@pytest.mark.parametrize("ignored", [["data.top_p=0.9"], ["data.temperature=0.7", "data.sampled_share=0"]],
                         ids=["top_p of greedy answers", "temperature with no answer sampled"])
def test_a_setting_that_changes_no_answer_leaves_the_data_as_it_was(tmp_path, ignored):
    run_dir = tmp_path / "run"
    first = data_run(run_dir)
    # An added evaluation set runs the stage again (its overlap check), now with the ignored setting given too.
    again = data_run(run_dir, *ignored, eval_file(tmp_path / "mine.jsonl", ["Completely unrelated words here."]))
    assert again["fingerprint"] == first["fingerprint"]
    assert again.get("reused") is True
    assert set_aside(run_dir / "data") == []  # the journal was kept: no answer made again


def test_a_reused_dataset_says_its_answer_figures_are_the_earlier_builds(tmp_path):
    run_dir = tmp_path / "run"
    first = data_run(run_dir)
    assert "earlier build" not in format_stats(first)
    again = data_run(run_dir, eval_file(tmp_path / "mine.jsonl", ["Completely unrelated words here."]))
    table = format_stats(again)
    assert again["generated_tokens"] == first["generated_tokens"]  # kept, as that build measured them
    assert "(the earlier build's: this run reused its dataset)" in table.splitlines()[-2]


def test_an_eval_set_under_the_home_folder_is_recorded_by_its_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    run_dir = tmp_path / "run"
    eval_file(tmp_path / "ev.jsonl", ["Completely unrelated words here."])
    stats = data_run(run_dir, "+eval.prompt_sets.mine={source: file, path: '~/ev.jsonl'}")
    assert stats["eval_overlap"]["eval_set_sources"]["mine"]["sha256"] is not None
    # Edited, it is checked again (it used to say "up to date", leaving the new overlap in training).
    with open(tmp_path / "ev.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "e9", "conversations": [{"from": "human", "value": "More words."}]}) + "\n")
    again = data_run(run_dir, "+eval.prompt_sets.mine={source: file, path: '~/ev.jsonl'}")
    assert again["eval_overlap"]["eval_set_sources"] != stats["eval_overlap"]["eval_set_sources"]


def test_too_many_held_out_prompts_after_the_overlap_check_is_one_line_before_any_answer(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = [f"Tell me about topic number {i} in a few words please." for i in range(5)]
    eval_set = eval_file(tmp_path / "mine.jsonl", [texts[0]])  # one training prompt is an evaluation prompt
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "conversations": [{"from": "human", "value": t}]}) + "\n"
                               for i, t in enumerate(texts)))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"data.heldout=4: expected fewer than the 4 training prompts the overlap "
                                          r"check kept \(1 of 5 dropped"):
        data_run(run_dir, "data.source=file", f"data.path={prompts}", "data.limit=null", "data.heldout=4",
                 eval_set)
    assert not (run_dir / "data" / "journal.jsonl").exists()  # no answer was made


def test_a_template_that_refuses_a_system_prompt_names_it(tiny_target, monkeypatch):
    tokenizer = tiny_target("llama").tokenizer
    refusing = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(tokenizer, "chat_template", refusing)
    assert steering_prefixes(tokenizer, [""]) == [""]
    with pytest.raises(ConfigError, match=r"data.synthetic.system_prompts\[1\]='Be brief.': the chat template cannot "
                                          r"start a user turn after it \(TemplateError: System role not supported\)"):
        steering_prefixes(tokenizer, ["", "Be brief."])


def test_a_build_holding_nothing_out_removes_a_killed_held_out_save(tmp_path):
    # A kill inside the held-out split's swap left its temp copy (a full dataset); a later build without a held-out
    # set used to keep it for good.
    (tmp_path / ".heldout.tmp-123").mkdir()
    (tmp_path / ".heldout.old-45").mkdir()
    (tmp_path / "heldout").mkdir()
    rows = Rows()
    rows.add(Prompt("p0", [{"role": "user", "content": "hi"}], "test"), [1, 2, 3], [0, 1, 1])
    _save_splits(tmp_path, rows.dataset(), Rows())
    assert sorted(os.listdir(tmp_path)) == ["dataset"]


def test_a_build_fingerprinted_with_an_ignored_setting_as_given_is_kept(tmp_path, monkeypatch):
    # Builds made while the stage passed the setting as given (top_p=0.9 of greedy answers) hold the same answers:
    # rerun for another reason, the stage keeps them and their fingerprint (the features stay captured).
    import dflash.stages.data as data_stage

    run_dir = tmp_path / "run"
    real = data_stage.fingerprints.in_effect
    monkeypatch.setattr(data_stage.fingerprints, "in_effect", lambda s: s)  # the stage as it passed them before
    first = data_run(run_dir, "data.top_p=0.9")
    monkeypatch.setattr(data_stage.fingerprints, "in_effect", real)
    again = data_run(run_dir, "data.top_p=0.9", eval_file(tmp_path / "mine.jsonl", ["Completely unrelated words."]))
    assert again["fingerprint"] == first["fingerprint"] and again.get("reused") is True
