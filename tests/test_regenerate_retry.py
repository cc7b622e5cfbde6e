"""The one-by-one retry both regeneration engines fall back to when a batch (or stream) raises."""

from __future__ import annotations

import logging

import pytest

from dflash.data.regenerate import _retry_one_by_one


def test_a_failing_prompt_fails_alone_and_the_rest_are_generated(caplog):
    def generate_one(i: int) -> list[int]:
        if i == 5:
            raise RuntimeError("prompt 5 is bad")
        return [i, i]

    with caplog.at_level(logging.WARNING, logger="dflash.data.regenerate"):
        results = list(_retry_one_by_one(ValueError("batch too big"), generate_one, [4, 5, 6]))
    assert [i for i, _ in results] == [4, 5, 6]
    assert (results[0][1], results[2][1]) == ([4, 4], [6, 6])
    assert isinstance(results[1][1], RuntimeError) and str(results[1][1]) == "prompt 5 is bad"
    assert "ValueError: batch too big" in caplog.text and "retrying 3 prompt(s) one by one" in caplog.text


def test_an_interrupt_is_not_recorded_as_a_failed_prompt():
    def interrupted(i: int) -> list[int]:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(_retry_one_by_one(RuntimeError("batch failed"), interrupted, [0, 1]))


def test_the_failed_stream_is_released_before_the_retries():
    """After a CUDA out-of-memory error the retries need the memory the failed call held: its frames (and the
    caches in them) must be gone before the first retry runs, not kept alive by the exception's traceback."""
    import weakref

    from dflash.data.regenerate import _static_results

    class Cache:  # stands for a KV cache the failed call allocated
        pass

    class Generator:
        cache = None

        def stream(self, prompts, **kwargs):
            cache = Cache()
            self.cache = weakref.ref(cache)
            yield 0, [7]
            raise RuntimeError(f"out of memory with {len(prompts)} rows")

        def generate(self, prompts, **kwargs):
            assert self.cache() is None, "the failed stream's frame is still alive during the retry"
            return [[8]]

    class Prompt:
        id = "p"

    pending = [(Prompt(), [1, 2]), (Prompt(), [3, 4])]
    results = list(_static_results(Generator(), pending, batch_size=2, max_new_tokens=4, max_length=16,
                                   stop_ids=[0], pad_id=0, temperature=0.0, top_p=1.0, seed=0))
    assert results == [(0, [7]), (1, [8])]
