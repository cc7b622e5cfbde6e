"""Answers of a target in the plain "User: / Assistant:" format (a base model, no chat template) end where the next
turn would begin: a base model has no end-of-turn token and goes on with made-up turns, which are not its answer.
The cut holds in regeneration (training data), in the evaluator's greedy and sampled continuations, and not for a
target with a chat template of its own."""

from __future__ import annotations

import pytest
import torch

from dflash.data.prompts import Prompt
from dflash.data.regenerate import read_journal, regenerate
from dflash.eval.replay import greedy_continuations
from dflash.eval.replay_estimate import sampled_continuations
from dflash.inference.generation import cut_at_stop_strings, cut_response
from dflash.models.targets import load_target
from dflash.models.targets.chat_template import PLAIN_TEMPLATE
from tests.schema_options import answer_options

ANSWER, GOES_ON = "Paris.", "\n\nUser: and Spain?\n\nAssistant: Madrid."


def tiny_target(plain: bool):
    target = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    if plain:
        target.tokenizer.chat_template = PLAIN_TEMPLATE
    return target


def ids(target, text: str) -> list[int]:
    return target.tokenizer.encode(text, add_special_tokens=False)


def answering(target, text: str, monkeypatch) -> None:
    """target.model.generate continues every prompt with `text` (right-padded to the longest row)."""
    def generate(input_ids, attention_mask=None, **kwargs):
        tail = torch.tensor([ids(target, text)] * len(input_ids))
        return torch.cat([input_ids, tail], dim=1)

    monkeypatch.setattr(target.model, "generate", generate)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_target("smollm2").tokenizer


@pytest.mark.parametrize("text, kept", [
    ("The capital of France is Paris.\n\nUser: and Spain?", "The capital of France is Paris."),
    ("Paris.\n\n\nUser: x", "Paris.\n"),  # "\n\n\n" may be one token: it goes with the stop string
    ("def f():\n    return 1\n\nprint(f())", "def f():\n    return 1\n\nprint(f())"),
    ("\n\nUser: hello", ""),
])
def test_tokens_end_before_the_stop_string(smollm2_tokenizer, text, kept):
    tokens = smollm2_tokenizer.encode(text, add_special_tokens=False)
    cut, found = cut_at_stop_strings(tokens, ["\n\nUser:"], smollm2_tokenizer)
    assert found == (kept != text)
    assert tokens[:len(cut)] == cut and "\n\nUser:" not in smollm2_tokenizer.decode(cut)
    assert kept.startswith(smollm2_tokenizer.decode(cut)) and len(kept) - len(smollm2_tokenizer.decode(cut)) <= 2


def test_a_stop_string_ends_a_response_as_a_stop_token_does():
    target = tiny_target(plain=True)
    tokens = ids(target, ANSWER + GOES_ON)
    assert cut_response(tokens, set(), 100, ["\n\nUser:"], target.tokenizer) == (ids(target, ANSWER), "stop")
    assert cut_response(tokens, set(), 3, ["\n\nUser:"], target.tokenizer) == (tokens[:3], "length")


@pytest.mark.parametrize("plain", [True, False])
def test_regeneration_journals_the_answer_without_the_made_up_turns(tmp_path, monkeypatch, plain):
    target = tiny_target(plain)
    answering(target, ANSWER + GOES_ON, monkeypatch)
    prompts = [Prompt(f"q{i}", [{"role": "user", "content": f"Question {i}"}], "test") for i in range(2)]
    regenerate(prompts, target, tmp_path / "j.jsonl",
               **answer_options(max_length=200, max_new_tokens=64, batch_size=2, show_progress=False))
    header, records = read_journal(tmp_path / "j.jsonl")
    expected = ids(target, ANSWER) if plain else ids(target, ANSWER + GOES_ON)
    assert [r["response_ids"] for r in records.values()] == [expected] * 2
    assert [r["finish"] for r in records.values()] == ["stop" if plain else "length"] * 2
    # The stop string is a setting of the answers: a journal of a target without one keeps its header as before.
    assert header.get("stop_strings") == (["\n\nUser:"] if plain else None)


@pytest.mark.parametrize("plain", [True, False])
def test_the_evaluator_s_continuations_end_before_the_next_turn(monkeypatch, plain):
    target = tiny_target(plain)
    answering(target, ANSWER + GOES_ON, monkeypatch)
    prompt = target.chat_ids([{"role": "user", "content": "Capital of France?"}])
    expected = ids(target, ANSWER) if plain else ids(target, ANSWER + GOES_ON)
    options = dict(max_new_tokens=64, stop_token_ids=target.stop_token_ids(), batch_size=1, engine="hf")
    assert greedy_continuations(target, [prompt], **options) == [expected]
    assert sampled_continuations(target, [prompt], temperature=1.0, seed=0, **options) == [expected]


def byte_fallback_tokenizer():
    """A tokenizer that spells every character outside a-z (and a few more) in UTF-8 byte tokens, as Gemma's and
    Llama 2's do for rare ones, decoding an incomplete byte sequence to one replacement character per byte."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for char in [*"abcdefghijklmnopqrstuvwxyzUS:\n", "\u2581"]:
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("kept", ["漢字テスト", "a 🎉🎉", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ok 𝔘𝔫 é", "déjà vu",
                                  "x \ufffd\ufffd", "é\ufffd"])  # replacement characters of the text itself kept
def test_byte_fallback_characters_before_the_stop_string_are_kept_whole(kept):
    tokenizer = byte_fallback_tokenizer()
    tokens = tokenizer.encode(kept + "\n\nUser: more", add_special_tokens=False)
    assert any(token.startswith("<0x") for token in tokenizer.convert_ids_to_tokens(tokens))  # spelled in bytes
    cut, found = cut_at_stop_strings(tokens, ["\n\nUser:"], tokenizer)
    assert found and tokenizer.decode(cut) == kept
