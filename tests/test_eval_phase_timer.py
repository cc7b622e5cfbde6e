"""PhaseTimer.for_prompt_set: phases are charged to the set of the `with` block, and leaving it (also by an
exception) restores the set that was current before."""

from __future__ import annotations

import pytest

from dflash.eval.evaluate import load_prompt_sets
from dflash.eval.metrics import PhaseTimer
from tests.schema_options import EVAL_BATCH


def test_for_prompt_set_charges_and_restores():
    timer = PhaseTimer()
    timer.add("outside", 1.0)
    with timer.for_prompt_set("a"):
        timer.add("x", 2.0)
        with timer.for_prompt_set("b"):
            timer.add("x", 3.0)
        assert timer.prompt_set == "a"
        timer.add("y", 4.0)
    assert timer.prompt_set is None
    with pytest.raises(RuntimeError, match="boom"):
        with timer.for_prompt_set("c"):
            timer.add("x", 5.0)
            raise RuntimeError("boom")
    assert timer.prompt_set is None
    timer.add("outside", 1.0)
    assert timer.per_set == {"a": {"x": 2.0, "y": 4.0}, "b": {"x": 3.0}, "c": {"x": 5.0}}
    assert timer.totals == {"outside": 2.0, "x": 10.0, "y": 4.0}


def test_failing_prompt_set_leaves_no_set_current(tiny_target):
    timer = PhaseTimer()
    specs = {"gsm8k": {"source": "gsm8k", "limit": 1}, "broken": {"source": "no_such_source"}}
    with pytest.raises(ValueError, match="no_such_source"):
        load_prompt_sets(tiny_target("llama"), specs, max_new_tokens=4, timer=timer, batch_size=EVAL_BATCH)
    assert timer.prompt_set is None
    # The failed set's loading time is still charged to it, and nothing after it to any set.
    assert set(timer.per_set) == {"gsm8k", "broken"} and set(timer.totals) == {"load_prompts"}
