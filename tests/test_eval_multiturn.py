"""MT-Bench on both turns: turn 2 is asked on top of the target's own greedy answer to turn 1."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dflash.data.prompts import SOURCES, Prompt, load_prompts
from dflash.eval.categories import mtbench_categories
from dflash.eval.evaluate import evaluate, format_table, load_prompt_sets, summary_csv
from dflash.eval.multiturn import second_turn_conversations
from tests.schema_options import EVAL_BATCH, eval_options

ANSWER_TOKENS = 6
SPECS = {"mtbench": {"source": "mtbench", "limit": 2, "turns": 2}}


def template(adapter, messages):
    ids = adapter.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]


@torch.inference_mode()
def plain_greedy(adapter, prompt, num_tokens):
    """Greedy decoding by full forwards, no cache and no generate(): an independent reference."""
    ids, stops = list(prompt), set(adapter.stop_token_ids())
    for _ in range(num_tokens):
        token = int(adapter.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in stops:
            break
    return ids[len(prompt):]


def test_mtbench_prompts_carry_their_second_turn():
    package, relative, _ = SOURCES["mtbench"]
    path = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / relative
    with open(path, encoding="utf-8") as f:
        turns = {f"mtbench-{r['question_id']}": r["turns"] for r in map(json.loads, f)}
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    for p in prompts:
        assert p.messages == [{"role": "user", "content": turns[p.id][0]}]
        assert p.follow_ups == (turns[p.id][1],)
    assert load_prompts("gsm8k", limit=1)[0].follow_ups == ()
    with pytest.raises(ValueError, match="follow_ups"):
        Prompt("x", [{"role": "user", "content": "hi"}], "set", follow_ups=["a list"])


def test_turn2_prompt_is_the_conversation_with_the_targets_own_answer(tiny_target):
    adapter = tiny_target("llama")
    prompts = load_prompts("mtbench", limit=2)
    sets, categories, _ = load_prompt_sets(adapter, SPECS, max_new_tokens=ANSWER_TOKENS, batch_size=EVAL_BATCH)
    assert list(sets) == ["mtbench", "mtbench_turn2"]
    assert sets["mtbench"] == [template(adapter, p.messages) for p in prompts]
    answers = []
    for prompt, first_ids, second_ids in zip(prompts, sets["mtbench"], sets["mtbench_turn2"]):
        answer = plain_greedy(adapter, first_ids, ANSWER_TOKENS)
        if answer[-1] in adapter.stop_token_ids():
            answer = answer[:-1]
        text = adapter.tokenizer.decode(answer, skip_special_tokens=True)
        answers.append(text)
        conversation = [*prompt.messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": prompt.follow_ups[0]}]
        assert second_ids == template(adapter, conversation)
        # The answer is really in the prompt: without it the ids differ.
        assert second_ids != template(adapter, [*prompt.messages, {"role": "assistant", "content": ""},
                                                {"role": "user", "content": prompt.follow_ups[0]}])
    assert any(answers), "the tiny target answered nothing; the test would not see the answer"
    labels = mtbench_categories()
    assert categories["mtbench"] == categories["mtbench_turn2"] == [labels[p.id] for p in prompts]


def test_both_turns_are_reported_with_categories(tiny_target, make_drafter):
    adapter = tiny_target("llama")
    sets, categories, ids = load_prompt_sets(adapter, SPECS, max_new_tokens=8, batch_size=EVAL_BATCH)
    summary = evaluate(make_drafter(adapter), adapter, sets, max_new_tokens=8, show_progress=False,
                       categories=categories, prompt_ids=ids, **eval_options())
    for name in ("mtbench", "mtbench_turn2"):
        metrics = summary["prompt_sets"][name]
        assert metrics["num_prompts"] == 2 and metrics["num_steps"] > 0 and 1.0 <= metrics["tau"] <= 4.0
        by_category = summary["categories"][name]
        assert sum(m["num_steps"] for m in by_category.values()) == metrics["num_steps"]
    assert summary["overall"]["num_prompts"] == 4
    # MT-Bench as the method's authors count it: both turns pooled into one tau.
    first, second = summary["prompt_sets"]["mtbench"], summary["prompt_sets"]["mtbench_turn2"]
    both = summary["both_turns"]["mtbench"]
    for key in ("num_prompts", "num_steps", "num_tokens", "num_accepted", "greedy_mismatches"):
        assert both[key] == first[key] + second[key]
    assert both["tau"] == pytest.approx(both["num_tokens"] / both["num_steps"])
    assert min(first["tau"], second["tau"]) <= both["tau"] <= max(first["tau"], second["tau"])
    assert list(summary["both_turns"]) == ["mtbench"]
    csv_rows = [line.split(",")[0] for line in summary_csv(summary).splitlines()]
    assert csv_rows[:5] == ["prompt_set", "mtbench", "mtbench_turn2", "mtbench_both_turns", "overall"]
    assert "mtbench_both_turns" in format_table(summary)
    assert "(mtbench: its first turns; mtbench_turn2: its second turns" in format_table(summary)  # said under it
    # One row per prompt, in each set's order, with its category: they add up to the set's figures.
    rows = summary["per_prompt"]
    assert [(r["prompt_set"], r["index"]) for r in rows] == [(n, i) for n in ("mtbench", "mtbench_turn2")
                                                             for i in (0, 1)]
    assert [r["category"] for r in rows] == categories["mtbench"] + categories["mtbench_turn2"]
    assert [r["id"] for r in rows] == ids["mtbench"] * 2 and len(set(ids["mtbench"])) == 2  # a turn 2 is its turn 1's
    for name in ("mtbench", "mtbench_turn2"):
        mine = [r for r in rows if r["prompt_set"] == name]
        for key, total in (("steps", "num_steps"), ("tokens", "num_tokens"), ("accepted", "num_accepted")):
            assert sum(r[key] for r in mine) == summary["prompt_sets"][name][total]
        assert summary["prompt_sets"][name]["tau_prompt_mean"] == pytest.approx(sum(r["tau"] for r in mine) / 2)
    only_first = evaluate(make_drafter(adapter), adapter, {"mtbench": sets["mtbench"]}, max_new_tokens=8,
                          show_progress=False, **eval_options())
    assert "both_turns" not in only_first


def test_bad_multiturn_specs_are_refused(tiny_target):
    adapter = tiny_target("llama")
    with pytest.raises(ValueError, match="no second user turn"):
        load_prompt_sets(adapter, {"gsm8k": {"source": "gsm8k", "limit": 1, "turns": 2}}, max_new_tokens=4,
                         batch_size=EVAL_BATCH)
    with pytest.raises(ValueError, match="turns must be 1 or 2"):
        load_prompt_sets(adapter, {"mtbench": {"source": "mtbench", "limit": 1, "turns": 3}}, max_new_tokens=4,
                         batch_size=EVAL_BATCH)
    with pytest.raises(ValueError, match="rename one"):
        load_prompt_sets(adapter, {**SPECS, "mtbench_turn2": {"source": "gsm8k", "limit": 1}}, max_new_tokens=4,
                         batch_size=EVAL_BATCH)
    with pytest.raises(ValueError, match="no second user turn"):
        second_turn_conversations(adapter, load_prompts("humaneval", limit=1), max_new_tokens=4,
                                  batch_size=EVAL_BATCH)
