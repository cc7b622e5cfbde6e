"""The data stage's input files: the prompt file (data.path) and the chat template file (target.chat_template) are
recorded by their sha256 in data/stats.json, and an edit to either rebuilds the dataset (the answers of unchanged
prompts from the journal), and so reruns the capture that reads it."""

import json
import os
import re

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.data.dataset import load_dataset_dir
from dflash.run_files import file_sha256, read_json, write_json

TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def prompt_file(path, texts):
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n" for i, text in enumerate(texts)))
    return path


def data_command(tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    return ["+experiment=tiny", "show_progress=false", "stages=[data]", f"run_dir={tmp_path / 'run'}",
            "data.source=file", f"data.path={prompts}", "data.limit=null", "data.eval_overlap_ngram=0", *extra]


def count_generated(monkeypatch) -> list[int]:
    """The number of prompts each regenerate call answers (not reused from the journal)."""
    import dflash.data.regenerate as regenerate

    answered, sort_out = [], regenerate._sort_out

    def counted(*args, **kwargs):
        work = sort_out(*args, **kwargs)
        answered.append(len(work.pending))
        return work

    monkeypatch.setattr(regenerate, "_sort_out", counted)
    return answered


def test_an_edited_prompt_file_rebuilds_the_dataset_from_the_journal(tmp_path, monkeypatch, capsys):
    path = prompt_file(tmp_path / "prompts.jsonl", [f"Tell me about the number {i}." for i in range(4)])
    command = data_command(tmp_path)
    Pipeline(compose(command)).run()
    data = tmp_path / "run" / "data"
    recorded = read_json(str(data / "stats.json"))["input_files"]
    assert recorded == {"data.path": {"path": str(path), "sha256": file_sha256(path)}}
    answered = count_generated(monkeypatch)
    prompt_file(path, [f"Tell me about the number {i}." for i in range(4)] + ["A new question?"])
    capsys.readouterr()
    Pipeline(compose(command)).run()
    shown = "".join(capsys.readouterr()).splitlines()
    assert len([line for line in shown if f"data.path {path} changed since the dataset was built" in line]) == 1
    assert answered == [1]  # only the new prompt: the others' answers come from the journal
    assert sorted(load_dataset_dir(str(data))["id"]) == [f"p{i}" for i in range(5)]
    Pipeline(compose(command)).run()  # recorded now: up to date
    assert answered == [1]


def test_an_edited_chat_template_file_rebuilds_the_dataset_and_the_capture_after_it(tmp_path):
    prompt_file(tmp_path / "prompts.jsonl", [f"Tell me about the number {i}." for i in range(4)])
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    command = data_command(tmp_path, f"target.chat_template={template}")
    Pipeline(compose(command)).run()
    capture = Pipeline(compose(command)).capture.fingerprint()
    before = read_json(str(tmp_path / "run" / "data" / "stats.json"))
    assert before["input_files"]["target.chat_template"]["sha256"] == file_sha256(template)
    template.write_text(TEMPLATE.replace("'<|im_start|>' + message['role']", "'<|im_start|>' + message['role'] + ':'"))
    assert not Pipeline(compose(command)).data.current()
    Pipeline(compose(command)).run()
    after = read_json(str(tmp_path / "run" / "data" / "stats.json"))
    assert after["fingerprint"] != before["fingerprint"] and after["stale"] == 4
    assert Pipeline(compose(command)).capture.fingerprint() != capture  # what follows the data stage reruns


def test_a_build_that_recorded_no_input_files_is_trusted(tmp_path):
    path = prompt_file(tmp_path / "prompts.jsonl", [f"Tell me about the number {i}." for i in range(4)])
    command = data_command(tmp_path)
    Pipeline(compose(command)).run()
    stats_path = str(tmp_path / "run" / "data" / "stats.json")
    stats = read_json(stats_path)
    del stats["input_files"]  # as a data stage wrote it before the files were recorded
    write_json(stats_path, stats)
    prompt_file(path, ["Another question."])
    assert Pipeline(compose(command)).data.current()


def test_a_malformed_prompt_file_is_refused_before_the_run_folder_is_made(tmp_path, capsys):
    """A user's prompt file is read whole before any work; the stage's header counts what it holds."""
    import pytest

    from dflash.config import ConfigError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "Hi"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=rf"^data.path: {prompts}:2: malformed JSON line"):
        Pipeline(compose(data_command(tmp_path))).run()
    assert not (tmp_path / "run").exists()
    prompt_file(prompts, ["Hi", "Hello", "Hey"])
    Pipeline(compose(data_command(tmp_path, "data.limit=32"))).run()
    assert f"[data] 3 prompts of {prompts}, answered greedily" in capsys.readouterr().out


def test_a_malformed_evaluation_prompt_file_is_refused_before_any_stage(tmp_path):
    """An evaluation set's own file is read before the data stage (whose overlap check would read it after the
    synthetic prompts) and before an evaluation alone (which would read it after loading the target and drafter);
    the error names the set's key, the file and its line."""
    import pytest

    from dflash.config import ConfigError

    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"messages": []}) + "\n")
    own_set = f"+eval.prompt_sets.mine={{source: file, path: {bad}}}"
    commands = [["+experiment=tiny", f"run_dir={tmp_path / 'run'}", own_set],
                ["+experiment=tiny", f"run_dir={tmp_path / 'run'}", own_set, "data.eval_overlap_ngram=0"]]
    for command in commands:
        with pytest.raises(ConfigError, match=rf"^eval.prompt_sets.mine.path: {bad}:2: record has no user turn"):
            Pipeline(compose(command)).run()
        assert not (tmp_path / "run").exists()


def test_a_prompt_file_of_another_format_than_its_source_reads_is_refused_naming_both_keys(tmp_path):
    """data.path with a packaged set's source (sharegpt, the default) is read in that set's format, before any stage;
    a file of prompts given there is refused naming data.path and the source that reads it."""
    import pytest

    from dflash.config import ConfigError

    prompts = prompt_file(tmp_path / "prompts.jsonl", ["Hi", "Hello"])
    command = ["+experiment=tiny", f"run_dir={tmp_path / 'run'}", f"data.path={prompts}"]
    line = (f"data.path: {prompts}: a ShareGPT file must hold a JSON list (read as data.source=sharegpt's format; "
            f"data.source=file reads a .jsonl or .json file of prompts)")
    with pytest.raises(ConfigError, match="^" + re.escape(line)):
        Pipeline(compose(command)).run()
    assert not (tmp_path / "run").exists()


def test_an_evaluation_set_file_is_read_once_by_the_preflights_of_one_command(tmp_path, monkeypatch):
    """The data stage's preflight (its overlap check reads the evaluation sets) and the evaluation's both check an
    evaluation set's own file: one command reads it once."""
    import dflash.data.prompts as prompts_module

    own = prompt_file(tmp_path / "mine.jsonl", ["What is two plus three?", "Name a colour."])
    read, load = [], prompts_module.load_prompts

    def counted(source, path=None, *args, **kwargs):
        if path is not None and os.path.realpath(path) == os.path.realpath(own):
            read.append(path)
        return load(source, path, *args, **kwargs)

    monkeypatch.setattr(prompts_module, "load_prompts", counted)
    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}",
                                 f"+eval.prompt_sets.mine={{source: file, path: {own}}}"]))
    pipeline.data.preflight(True)
    pipeline.eval.preflight(True)
    assert len(read) == 1
