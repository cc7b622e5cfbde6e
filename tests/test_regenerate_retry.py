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
        cache = last_stats = None

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


def test_a_failed_stream_retries_its_rows_alone_and_streams_the_rest(caplog, monkeypatch):
    """One failing refill of 20 prompts in 3 rows: the prompts that were in rows go one by one, the ones the stream
    had not reached go on in a new stream (not one by one), and every answer is the uninterrupted run's."""
    from dflash.data.regenerate import _static_results
    from dflash.inference import static_decode
    from dflash.inference.static_decode import StaticGenerator
    from dflash.models.targets.tiny import build_tiny_target

    class Prompt:
        def __init__(self, i):
            self.id = f"p{i}"

    adapter = build_tiny_target("llama", 0, tokenizer="builtin", initializer_range=0.2)
    pending = [(Prompt(i), [5 + i % 7] * (2 + i % 5)) for i in range(20)]
    options = dict(batch_size=3, max_new_tokens=5, max_length=32, stop_ids=[2], pad_id=0, temperature=0.0,
                   top_p=1.0, seed=0)
    expected = dict(_static_results(StaticGenerator(adapter), pending, **options))
    admit, calls = static_decode._Decoder.admit, []

    def fails_once(self, rows, prompts):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise RuntimeError("out of memory in a refill")
        return admit(self, rows, prompts)

    monkeypatch.setattr(static_decode._Decoder, "admit", fails_once)
    with caplog.at_level(logging.WARNING, logger="dflash.data.regenerate"):
        got = list(_static_results(StaticGenerator(adapter), pending, **options))
    assert dict(got) == expected and sorted(i for i, _ in got) == list(range(20))
    retried = [int(m.split("retrying ")[1].split(" ")[0]) for m in caplog.messages if "retrying" in m]
    assert len(retried) == 1 and 1 <= retried[0] <= 3
