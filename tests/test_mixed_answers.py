"""Mixed answers (data.sampled_share): greedy answers for some prompts, sampled ones for the others, in one data set;
the choice is a function of the prompt id, survives an interrupted regeneration, and leaves the default data alone."""

import pytest

from dflash.config import ConfigError, compose, fingerprints, settings_from
from dflash.data.dataset import build_dataset, format_stats, heldout_ids, load_heldout_dir
from dflash.data.journal import JournalBuffer, read_journal
from dflash.data.prompts import Prompt
from dflash.data.regenerate import answer_is_sampled, regenerate
from tests.schema_options import answer_options

TEXTS = ["hi", "what is two plus two?", "tell me a story about a cat", "name three colours", "ok then",
         "why is the sky blue?", "write a haiku", "count to five", "say something kind", "list two fruits"]
PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": t}], "test") for i, t in enumerate(TEXTS)]
# Both engines sample each prompt from its own stream, so an answer does not depend on its batch.
GEN = answer_options(max_length=64, max_new_tokens=10, batch_size=3, show_progress=False, engine="static", seed=3)
ENGINES = pytest.mark.parametrize("engine", ["static", "hf"])


def answers(journal) -> dict[str, list[int]]:
    return {i: r["response_ids"] for i, r in read_journal(journal)[1].items()}


def test_the_choice_is_a_seeded_function_of_the_id():
    ids = [f"prompt-{i}" for i in range(400)]
    assert not any(answer_is_sampled(i, 0, 0.0) for i in ids)
    assert all(answer_is_sampled(i, 0, 1.0) for i in ids)
    half = {i for i in ids if answer_is_sampled(i, 0, 0.5)}
    assert 160 < len(half) < 240
    assert half == {i for i in reversed(ids) if answer_is_sampled(i, 0, 0.5)}
    assert half != {i for i in ids if answer_is_sampled(i, 1, 0.5)}  # the seed draws another choice
    assert {i for i in ids if answer_is_sampled(i, 0, 0.25)} <= half  # a smaller share is a subset
    # Not the held-out choice's hash: the held-out prompts get the mix too.
    held = heldout_ids(ids, 40, 0)
    assert 0 < len(held & half) < 40


@ENGINES
def test_greedy_and_sampled_answers_are_those_of_the_unmixed_runs(tiny_target, tmp_path, engine):
    adapter = tiny_target("llama")
    GEN = dict(globals()["GEN"], engine=engine)
    greedy = answers_of(regenerate(PROMPTS, adapter, tmp_path / "greedy.jsonl", temperature=0.0, **GEN),
                        tmp_path / "greedy.jsonl")
    sampled = answers_of(regenerate(PROMPTS, adapter, tmp_path / "sampled.jsonl", temperature=1.0, **GEN),
                         tmp_path / "sampled.jsonl")
    regenerate(PROMPTS, adapter, tmp_path / "mixed.jsonl", temperature=1.0, sampled_share=0.5, **GEN)
    mixed = answers(tmp_path / "mixed.jsonl")
    chosen = {p.id for p in PROMPTS if answer_is_sampled(p.id, GEN["seed"], 0.5)}
    assert 0 < len(chosen) < len(PROMPTS)
    assert mixed == {i: (sampled if i in chosen else greedy)[i] for i in mixed}
    assert any(greedy[i] != sampled[i] for i in chosen)  # sampling changed something
    assert read_journal(tmp_path / "mixed.jsonl")[0]["sampled_share"] == 0.5
    # Unmixed journals record no share: those written before the setting keep resuming.
    assert "sampled_share" not in read_journal(tmp_path / "sampled.jsonl")[0]


def answers_of(stats: dict, journal) -> dict[str, list[int]]:
    assert stats["done"] == len(PROMPTS)
    return answers(journal)


@ENGINES
def test_an_interrupted_mixed_regeneration_resumes_to_the_same_answers(tiny_target, tmp_path, monkeypatch, engine):
    adapter = tiny_target("llama")
    settings = dict(GEN, temperature=1.0, sampled_share=0.5, engine=engine)
    regenerate(PROMPTS, adapter, tmp_path / "one_go.jsonl", **settings)
    added, real_add = [], JournalBuffer.add

    def interrupted_add(self, record):
        if len(added) == 4:  # a Ctrl-C in the middle of the greedy part (its answers come first)
            raise KeyboardInterrupt
        added.append(record["id"])
        real_add(self, record)

    monkeypatch.setattr(JournalBuffer, "add", interrupted_add)
    with pytest.raises(KeyboardInterrupt):
        regenerate(PROMPTS, adapter, tmp_path / "resumed.jsonl", **settings)
    monkeypatch.undo()
    assert len(answers(tmp_path / "resumed.jsonl")) == 4
    again = regenerate(PROMPTS, adapter, tmp_path / "resumed.jsonl", **settings)
    assert again["generated"] == len(PROMPTS) - 4
    assert answers(tmp_path / "resumed.jsonl") == answers(tmp_path / "one_go.jsonl")
    # Another share is other settings: it answers every prompt in a journal of its own.
    other = regenerate(PROMPTS, adapter, tmp_path / "resumed.jsonl", **{**settings, "sampled_share": 0.25})
    assert other["generated"] == len(PROMPTS) and len(list(tmp_path.glob("resumed.*.jsonl"))) == 1


def test_both_engines_sample_the_same_answer_for_a_prompt(tiny_target, tmp_path):
    """The hf engine draws each prompt's tokens from the stream the static engine draws them from (keyed_sampling.py):
    in float32 the two give the same sampled answers, in batches of any size."""
    adapter = tiny_target("llama")
    static = dict(GEN, temperature=1.0, top_p=0.9)
    regenerate(PROMPTS, adapter, tmp_path / "static.jsonl", **static)
    regenerate(PROMPTS, adapter, tmp_path / "hf.jsonl", **dict(static, engine="hf", batch_size=4))
    regenerate(PROMPTS, adapter, tmp_path / "hf1.jsonl", **dict(static, engine="hf", batch_size=1))
    assert answers(tmp_path / "hf.jsonl") == answers(tmp_path / "static.jsonl") == answers(tmp_path / "hf1.jsonl")
    greedy = answers_of(regenerate(PROMPTS, adapter, tmp_path / "greedy.jsonl", **dict(GEN, engine="hf")),
                        tmp_path / "greedy.jsonl")
    assert greedy != answers(tmp_path / "hf.jsonl")  # sampled, not greedy


def test_the_dataset_counts_greedy_and_sampled_answers(tiny_target, tmp_path):
    adapter = tiny_target("llama")
    build = answer_options(max_length=64, max_new_tokens=10, batch_size=3, show_progress=False, seed=3, heldout=4)
    plain = build_dataset(PROMPTS, adapter, tmp_path / "plain", temperature=1.0, **build)
    explicit = build_dataset(PROMPTS, adapter, tmp_path / "explicit", temperature=1.0, sampled_share=1.0, **build)
    assert plain["fingerprint"] == explicit["fingerprint"] and "answer_mix" not in plain
    stats = build_dataset(PROMPTS, adapter, tmp_path / "mixed", temperature=1.0, sampled_share=0.5, **build)
    assert stats["fingerprint"] != plain["fingerprint"] and stats["settings"]["sampled_share"] == 0.5
    held = set(load_heldout_dir(tmp_path / "mixed")["id"])
    chosen = {p.id for p in PROMPTS if answer_is_sampled(p.id, 3, 0.5)}
    assert stats["answer_mix"] == {
        "samples": {"greedy": 6 - len(chosen - held), "sampled": len(chosen - held)},
        "heldout": {"greedy": 4 - len(chosen & held), "sampled": len(chosen & held)}}
    table = format_stats(stats)
    mix = stats["answer_mix"]
    assert f"{mix['heldout']['greedy']} greedy and {mix['heldout']['sampled']} sampled answers" in table
    assert f"{mix['samples']['greedy']} greedy and {mix['samples']['sampled']} sampled answers" in table
    assert "greedy and" not in format_stats(plain)


def test_the_setting_is_checked_fingerprinted_and_named_where_unused(tmp_path):
    tiny = ["+experiment=tiny", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"data.sampled_share=1.5: expected a number in \[0, 1\]"):
        settings_from(compose(tiny + ["data.sampled_share=1.5"]))
    sampled = settings_from(compose(tiny + ["data.temperature=1.0"]))
    mixed = settings_from(compose(tiny + ["data.temperature=1.0", "data.sampled_share=0.5"]))
    assert "sampled_share" not in fingerprints.stage_settings(sampled.data, "data")
    assert fingerprints.data_fingerprint(mixed) != fingerprints.data_fingerprint(sampled)
    assert mixed.ignored() == []
    greedy = settings_from(compose(tiny + ["data.sampled_share=0.5"]))
    assert greedy.ignored() == ["data.sampled_share=0.5 is ignored: data.temperature is 0 (every answer greedy)"]
    # ... and it leaves the greedy data's fingerprint as it was: the answers are the same.
    plain = settings_from(compose(tiny))
    assert fingerprints.data_fingerprint(greedy) == fingerprints.data_fingerprint(plain)
    none_sampled = settings_from(compose(tiny + ["data.temperature=1.0", "data.sampled_share=0"]))
    assert "data.temperature=1.0 is ignored: data.sampled_share is 0" in " ".join(none_sampled.ignored())
