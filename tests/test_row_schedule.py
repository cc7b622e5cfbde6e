"""The refill schedule without a model: every prompt decoded once into its own slot, spans that cover every running
row, plain batches when refill is off, and the row utilisation on a length mix like SmolLM2's ShareGPT answers."""

from __future__ import annotations

import random

import pytest

from dflash.inference.row_schedule import ScheduleStats, run_schedule


class FakeRows:
    """A RowDecoder whose prompt i answers with answers[i] tokens (cut at its budget); checks the span it is given."""

    def __init__(self, rows: int, lengths: list[int], budgets: list[int], answers: list[int]) -> None:
        self.rows, self.lengths, self.budgets, self.answers = rows, lengths, budgets, answers
        self.state: list[dict | None] = [None] * rows
        self.spans: list[int] = []
        self.admitted: list[list[int]] = []

    def admit(self, rows, prompts):
        assert all(self.state[r] is None or self.state[r]["harvested"] for r in rows), "refilled a busy row"
        self.admitted.append(list(prompts))
        for r, i in zip(rows, prompts):
            self.state[r] = {"prompt": i, "made": 1, "column": self.lengths[i], "harvested": False,
                             "target": min(self.answers[i], self.budgets[i])}

    def decode(self, steps, span):
        self.spans.append(span)
        for _ in range(steps):
            for s in self.state:
                if s is not None and s["made"] < s["target"]:
                    assert s["column"] < span, "a running row writes outside the attention span"
                    s["made"] += 1
                    s["column"] += 1

    def finished(self):
        return [s is None or s["made"] >= s["target"] for s in self.state]

    def harvest(self, rows):
        out = []
        for r in rows:
            s = self.state[r]
            assert not s["harvested"]
            s["harvested"] = True
            out.append([s["prompt"]] * s["made"])
        return out


def run(rows, lengths, budgets, answers, refill, check_every=8, admit_min=None, quantum=128):
    fake = FakeRows(rows, lengths, budgets, answers)
    max_span = -(-max(p + b for p, b in zip(lengths, budgets)) // quantum) * quantum
    stats = ScheduleStats()
    results: list[list[int] | None] = [None] * len(lengths)
    for i, tokens in run_schedule(fake, lengths, budgets, refill=refill, check_every=check_every,
                                  admit_min=admit_min or max(1, rows // 16), span_quantum=quantum,
                                  max_span=max_span, stats=stats):
        assert results[i] is None, f"prompt {i} yielded twice"
        results[i] = tokens
    return fake, results, stats


def sharegpt_like(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt lengths and answer lengths shaped like the SmolLM2 recipe's data (mean answer ~255 tokens, about a
    third of the answers run into the 384-token cap)."""
    rng = random.Random(seed)
    lengths = [min(1000, int(rng.lognormvariate(5.0, 0.9)) + 8) for _ in range(n)]
    answers = [384 if rng.random() < 0.3 else rng.randrange(20, 384) for _ in range(n)]
    return lengths, answers


@pytest.mark.parametrize("refill", [True, False])
def test_every_prompt_decoded_once_in_input_order(refill):
    rng = random.Random(3)
    n = 40
    lengths = [rng.randrange(1, 200) for _ in range(n)]
    budgets = [rng.randrange(1, 60) for _ in range(n)]
    answers = [rng.randrange(1, 80) for _ in range(n)]
    fake, results, stats = run(5, lengths, budgets, answers, refill, check_every=3, admit_min=2)
    assert results == [[i] * min(a, b) for i, (a, b) in enumerate(zip(answers, budgets))]
    assert stats.tokens == sum(map(len, results)) and stats.prompts == n
    admitted = [i for group in fake.admitted for i in group]
    assert sorted(admitted) == list(range(n))
    assert [lengths[i] for i in admitted] == sorted(lengths, reverse=True)  # longest first
    if refill:
        assert len(fake.admitted) > n // 5 and any(len(g) < 5 for g in fake.admitted[:-1])
    else:
        assert [len(g) for g in fake.admitted] == [5] * 8  # plain batches of 5 rows


def test_an_admit_minimum_above_the_row_count_still_decodes_every_prompt():
    lengths, budgets, answers = [5, 9, 3, 7, 4], [4] * 5, [2, 6, 3, 1, 5]
    _, results, _ = run(2, lengths, budgets, answers, True, check_every=1, admit_min=4)
    assert results == [[i] * min(a, b) for i, (a, b) in enumerate(zip(answers, budgets))]


def test_spans_follow_the_longest_running_row():
    # Long prompts first, then short ones: the span shrinks once the long ones are done, never below a running
    # row's column (FakeRows asserts that).
    lengths = [900] * 2 + [30] * 20
    fake, _, _ = run(2, lengths, [40] * 22, [40] * 22, refill=True, check_every=8)
    assert max(fake.spans) == 1024 and fake.spans[-1] == 128


def test_refill_keeps_rows_busy_on_a_sharegpt_like_mix():
    lengths, answers = sharegpt_like(1200)
    budgets = [min(384, 1024 - p) for p in lengths]
    _, with_refill, on = run(64, lengths, budgets, answers, refill=True)
    _, plain, off = run(64, lengths, budgets, answers, refill=False)
    assert with_refill == plain
    ideal = sum(len(r) - 1 for r in plain) / 64
    print(f"\nrow utilisation, 64 rows, {len(lengths)} prompts: refill {on.utilisation:.3f} ({on.decode_steps} decode "
          f"steps, {on.admissions} prefills), plain batches {off.utilisation:.3f} ({off.decode_steps} steps); "
          f"ideal {ideal:.0f} steps")
    assert on.utilisation > 0.9 and off.utilisation < 0.75
    assert on.decode_steps < 0.75 * off.decode_steps


def test_bad_schedule_arguments():
    fake = FakeRows(2, [3], [4], [4])
    with pytest.raises(ValueError, match="budgets"):
        next(run_schedule(fake, [3], [4, 5], refill=True, check_every=1, admit_min=1, span_quantum=8, max_span=8))
    with pytest.raises(ValueError, match="check_every"):
        next(run_schedule(fake, [3], [4], refill=True, check_every=0, admit_min=1, span_quantum=8, max_span=8))
