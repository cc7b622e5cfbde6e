"""A journal of other settings is moved aside under its header's fingerprint, never deleted, and comes back when
its settings do: a changed generation setting in a run folder starts a journal of its own, and going back reuses
the first one's answers."""

import json

from dflash.config import compose
from dflash.data.journal import append_lines, open_journal, read_journal
from dflash.pipeline import Pipeline
from dflash.run_files import fingerprint

A = {"max_new_tokens": 8, "temperature": 0.0, "seed": 0}
B = {**A, "max_new_tokens": 16}


def write(path, settings, *ids):
    journal, done = open_journal(path, settings)
    with journal:
        append_lines(journal, [{"id": i, "status": "done", "prompt_hash": "h"} for i in ids])
    return done


def test_a_journal_of_other_settings_moves_aside_and_comes_back(tmp_path):
    path = tmp_path / "journal.jsonl"
    write(path, A, "a1", "a2")
    assert write(path, B, "b1") == {}  # another journal: nothing of A's is taken for B
    aside = tmp_path / f"journal.{fingerprint(A)}.jsonl"
    assert read_journal(aside) == (A, {"a1": {"id": "a1", "status": "done", "prompt_hash": "h"},
                                       "a2": {"id": "a2", "status": "done", "prompt_hash": "h"}})
    assert read_journal(path)[0] == B
    assert write(path, A) == {"a1": "h", "a2": "h"}  # back to A: its answers again, B's kept aside
    assert read_journal(path)[0] == A
    assert sorted(read_journal(tmp_path / f"journal.{fingerprint(B)}.jsonl")[1]) == ["b1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["journal.jsonl", f"journal.{fingerprint(B)}.jsonl"])


def test_settings_that_change_no_record_keep_the_journal_and_find_it_aside(tmp_path):
    path = tmp_path / "journal.jsonl"
    write(path, A, "a1")
    journal, done = open_journal(path, {**A, "seed": 5}, unused=("seed",))  # greedy: the seed changes no answer
    journal.close()
    assert done == {"a1": "h"} and read_journal(path)[0] == A
    write(path, B)
    journal, done = open_journal(path, {**A, "seed": 7}, unused=("seed",))  # A's journal serves it from aside
    journal.close()
    assert done == {"a1": "h"}


def test_moving_aside_never_writes_over_a_file(tmp_path):
    path = tmp_path / "journal.jsonl"
    write(path, A, "a1")
    taken = tmp_path / f"journal.{fingerprint(A)}.jsonl"
    taken.write_text(json.dumps({"header": {"other": 1}}) + "\n")
    write(path, B)
    assert json.loads(taken.read_text()) == {"header": {"other": 1}}
    assert sorted(read_journal(tmp_path / f"journal.{fingerprint(A)}-2.jsonl")[1]) == ["a1"]


def test_a_changed_generation_setting_in_a_run_folder_keeps_both_journals(tmp_path, monkeypatch):
    run = ["+experiment=tiny", "show_progress=false", "stages=[data]", f"run_dir={tmp_path}"]
    Pipeline(compose(run)).run()
    first = read_journal(tmp_path / "data" / "journal.jsonl")
    Pipeline(compose(run + ["data.max_new_tokens=16"])).run()
    assert read_journal(tmp_path / "data" / "journal.jsonl")[0]["max_new_tokens"] == 16
    monkeypatch.setattr("dflash.data.regenerate._static_results", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("answered again")))
    monkeypatch.setattr("dflash.data.regenerate._hf_results", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("answered again")))
    Pipeline(compose(run)).run()  # back to the first settings: every answer from their journal
    assert read_journal(tmp_path / "data" / "journal.jsonl") == first
    [aside] = (tmp_path / "data").glob("journal.*.jsonl")  # the second settings' journal, kept
    assert read_journal(aside)[0]["max_new_tokens"] == 16 and len(read_journal(aside)[1]) == len(first[1])
