"""What the data stage shows a person: generation bars that move with the tokens (not once per batch) and end
full, for both engines and for the synthetic prompts; and the stats as a short table (format_stats)."""

from __future__ import annotations

import pytest
import torch

from dflash.data.dataset import build_dataset, format_stats
from dflash.data.prompts import Prompt
from dflash.data.regenerate import regenerate
from dflash.data.synthetic import synthesize_prompts
from dflash.models.targets import build_tiny_target
from tests.schema_options import answer_options, synthetic_options

PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": "tell me " + "more " * i}], "test") for i in range(5)]
GEN = answer_options(max_length=96, max_new_tokens=12, batch_size=3, show_progress=True)


class RecordingBar:
    """Stands in for tqdm: records every update and the last postfix."""

    made: list[RecordingBar] = []

    def __init__(self, total=0, desc="", **kwargs):
        self.total, self.desc, self.n, self.updates, self.postfix, self.closed = total, desc, 0, [], "", False
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.n += n
        self.updates.append((n, self.postfix))

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    RecordingBar.made = []
    monkeypatch.setattr("dflash.data.progress.tqdm", RecordingBar)
    return RecordingBar.made


@pytest.fixture(scope="module")
def tiny():
    # Weights large enough that the tiny target's answers differ in length (some end before max_new_tokens).
    return build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_regeneration_bar_moves_with_the_answers_and_ends_full(tiny, tmp_path, bars, engine):
    stats = regenerate(PROMPTS, tiny, tmp_path / "j.jsonl", **{**GEN, "engine": engine})
    (bar,) = bars
    batches = -(-len(PROMPTS) // GEN["batch_size"])
    moves = [n for n, _ in bar.updates if n > 0]
    assert len(moves) > batches, bar.updates
    # The bar counts token budgets: full once every answer has ended, whatever their lengths.
    assert bar.n == bar.total == len(PROMPTS) * GEN["max_new_tokens"] and bar.closed
    assert bar.desc == "regenerate" and bar.postfix.startswith(f"{len(PROMPTS)}/{len(PROMPTS)} answers, ")
    assert bar.postfix.endswith(" tok/s") and stats["done"] == len(PROMPTS)


def test_hf_bar_moves_every_step_of_a_batch(tiny, tmp_path, bars):
    """One batch of every prompt: the bar moves with the generated tokens while no answer has ended yet."""
    regenerate(PROMPTS, tiny, tmp_path / "j.jsonl", **{**GEN, "batch_size": len(PROMPTS)})
    (bar,) = bars
    before_any_answer = [n for n, postfix in bar.updates if n > 0 and postfix.startswith(f"0/{len(PROMPTS)} ")]
    assert len(before_any_answer) >= 2 and sum(before_any_answer) >= 2 * len(PROMPTS), bar.updates


def test_a_failed_batch_is_taken_back_from_the_bar(tiny, tmp_path, bars, monkeypatch):
    """A batch that raises mid-way is retried prompt by prompt: the bar still ends exactly full."""
    real = tiny.model.generate
    calls = []

    def generate(input_ids, attention_mask, **kwargs):
        calls.append(len(input_ids))
        if len(calls) == 1:
            kwargs["streamer"].put(input_ids)  # the prompts, then one step's tokens, then the batch fails
            kwargs["streamer"].put(torch.full((len(input_ids),), 7))
            raise RuntimeError("simulated out of memory")
        return real(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(tiny.model, "generate", generate)
    stats = regenerate(PROMPTS, tiny, tmp_path / "j.jsonl", **GEN)
    (bar,) = bars
    assert calls[:4] == [3, 1, 1, 1] and stats["done"] == len(PROMPTS)
    assert bar.n == bar.total and bar.postfix.startswith(f"{len(PROMPTS)}/{len(PROMPTS)} answers")


def test_the_real_bar_prints_answers_and_tokens_per_second(tiny, tmp_path, capsys):
    regenerate(PROMPTS, tiny, tmp_path / "j.jsonl", **GEN)
    err = capsys.readouterr().err
    assert "regenerate: 100%" in err and f"{len(PROMPTS)}/{len(PROMPTS)} answers" in err and "tok/s" in err


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_synthetic_prompt_bar_moves_per_draw_or_token(tiny, tmp_path, bars, engine):
    prompts, stats = synthesize_prompts(tiny, 4, ["You write Python.", ""], tmp_path / "synthetic.jsonl",
                                        **synthetic_options(max_new_tokens=16, min_chars=1, batch_size=4,
                                                            max_oversample=2.0, engine=engine, show_progress=True))
    (bar,) = bars
    assert bar.desc == "synthesize prompts" and bar.closed
    assert len([n for n, _ in bar.updates if n > 0]) > stats["draws"] // 4, bar.updates
    assert bar.n == bar.total > 0 and " draws, " in bar.postfix and bar.postfix.endswith(" tok/s")


def test_the_bar_shows_the_time_left_only_once_a_twentieth_of_it_is_done():
    """The first tokens come with the engine's warm-up: an estimate from them read 1:24:07 for an 84 s stage."""
    from dflash.data.progress import GenerationProgress

    with GenerationProgress("regenerate", "answers", show=True) as progress:
        progress.expect({"a": 60, "b": 40})
        progress.running({"a": 4})
        assert "<" not in str(progress.bar) and "4%" in str(progress.bar)
        progress.running({"a": 5})
        assert "<" in str(progress.bar) and "5%" in str(progress.bar)


def test_format_stats_renders_a_build(tiny, tmp_path):
    stats = build_dataset(PROMPTS, tiny, tmp_path, max_length=96, max_new_tokens=12, batch_size=3, heldout=1,
                          show_progress=False, **answer_options())
    table = format_stats(stats)
    lines = table.splitlines()
    assert [line.split()[0] for line in lines] == ["prompts", "held", "samples", "answers", "time"]
    assert lines[0].split(None, 1)[1].strip() == "total 5 | done 5 | skipped 0 (too long) | failed 0"
    assert f"{stats['generated_tokens']:,} tokens generated at " in table and "tok/s (hf engine)" in table
    assert f"samples   {stats['samples']} ({stats['num_tokens']:,} tokens" in table
    # One column of labels, then every value at the same place.
    for line, label in zip(lines, ["prompts", "held out", "samples", "answers", "time"]):
        assert line.startswith(label.ljust(len("held out")) + "  ") and line[len("held out") + 2] != " "


def test_format_stats_names_failures_staleness_and_reuse():
    stats = {"total": 1200, "done": 1100, "skipped": 90, "failed": 10, "stale": 3, "samples": 1099,
             "dropped_no_loss": 1, "num_tokens": 1234567, "num_response_tokens": 456789, "engine": "static",
             "errors": [{"id": "p7", "error": "RuntimeError: " + "x" * 300}], "generated_tokens": 0,
             "generate_tokens_per_s": None, "generate_seconds": 0.0, "template_seconds": 1.5,
             "before_answers": {"prompts": 1.0, "target": 20.3, "synthetic": 30.0, "overlap": 4.5}}
    table = format_stats(stats)
    assert ("before that  55.8 s: reading prompts 1.0 s, loading the target 20.3 s, synthetic prompts 30.0 s, overlap "
            "check 4.5 s") in table
    assert "total 1,200 | done 1,100 | skipped 90 (too long) | failed 10 | stale 3 (prompt changed" in table
    assert "1,099 (1,234,567 tokens, 456,789 in answers), 1 dropped (no answer token)" in table
    assert "none generated: every answer was in the journal" in table
    assert "1.5 s to answer (template 1.5 s, generate 0.0 s)" in table
    assert "first error  p7: RuntimeError: xxx" in table and "(all in stats.json)" in table
    assert "held out" not in table and max(len(line) for line in table.splitlines()) < 120


def test_synthetic_draws_read_as_one_line_and_join_the_stats_table(tmp_path, capfd):
    from dflash.data.synthetic import format_synthetic

    stats = {"requested": 5000, "kept": 5000, "per_system": [1000] * 5, "draws": 5737, "reused": 0,
             "dropped": {"length": 710, "short": 2, "duplicate": 16, "surplus": 9}, "engine": "static",
             "generated_tokens": 1319831, "generate_seconds": 40.0, "generate_tokens_per_s": 32997.2}
    assert format_synthetic(stats) == ("5,000 of 5,000 kept from 5,737 draws; dropped: 710 too long, 2 too short, "
                                       "16 duplicates, 9 surplus; 1,319,831 tokens at 32,997.2 tok/s")
    reused = dict(stats, reused=5737, dropped={}, generated_tokens=0, generate_tokens_per_s=None)
    assert format_synthetic(reused) == "5,000 of 5,000 kept from 5,737 draws (5,737 from the journal)"
    # The data stage keeps the full dict in stats.json and shows the line in its table, not a dict dump.
    import json

    from dflash.config import compose
    from dflash.pipeline import Pipeline

    overrides = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data]", "data.limit=3",
                 "data.synthetic.count=2",
                 "data.synthetic.max_new_tokens=24", "data.synthetic.min_chars=1", "data.synthetic.max_oversample=8"]
    Pipeline(compose(overrides)).run()
    console = capfd.readouterr()
    saved = json.loads((tmp_path / "data" / "stats.json").read_text())
    assert saved["synthetic"]["requested"] == 2 and saved["synthetic"]["draws"] >= saved["synthetic"]["kept"]
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in format_stats(saved).splitlines()}
    assert rows["synthetic"] == format_synthetic(saved["synthetic"])
    # Where the stage's time went before the answers: the prompts, the target's load, the draws, the overlap check.
    assert list(saved["before_answers"]) == ["prompts", "target", "synthetic", "overlap"]
    assert all(seconds >= 0 for seconds in saved["before_answers"].values())
    assert "s: reading prompts " in rows["before that"]
    text = console.out + console.err
    assert f"[data] synthetic prompts: {format_synthetic(saved['synthetic'])}" in text and "{'requested'" not in text
