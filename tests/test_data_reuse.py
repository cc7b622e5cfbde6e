"""When the data stage may reuse what it journaled: only answers of the same target to the same prompt tokens."""

import json

import pytest
import torch

from dflash.data.dataset import build_dataset, load_dataset_dir
from dflash.data.prompts import Prompt
from dflash.data.regenerate import read_journal, regenerate
from dflash.data.synthetic import synthesize_prompts
from dflash.models.targets import load_target
from tests.schema_options import answer_options, synthetic_options

GEN = answer_options(max_length=96, max_new_tokens=6, batch_size=2, show_progress=False)


def identity(seed):
    """What the pipeline passes as `target`: the target config without mask_token_id."""
    return {"kind": "tiny", "path": None, "dtype": "float32", "cache_dir": None,
            "tiny": {"family": "llama", "seed": seed, "tokenizer": "builtin"}}


@pytest.fixture(scope="module")
def targets():
    """Two tiny targets that differ only in their random weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield [load_target(**{k: v for k, v in identity(seed).items() if k != "cache_dir"}) for seed in (0, 1)]
    torch.set_num_threads(threads)


def user(text):
    return [{"role": "user", "content": text}]


def prompts_of(*texts):
    return [Prompt(f"q-{i}", user(t), "f") for i, t in enumerate(texts)]


def latest(journal, pid):
    return read_journal(journal)[1][pid]


# Issue: another target's answers ------------------------------------------------------------------------------

def test_a_build_for_another_target_is_neither_reused_nor_resumed(targets, tmp_path):
    a, b = targets
    prompts = prompts_of("What is the capital of France?", "Sort a list.")
    first = build_dataset(prompts, a, tmp_path, target=identity(0), **GEN)
    assert first["settings"]["target"] == identity(0)
    first_ids = load_dataset_dir(tmp_path)["input_ids"]
    # The stored stats are not returned: the fingerprint covers the target, so the journal is checked, and moved
    # aside: the other target answers every prompt itself.
    other = build_dataset(prompts, b, tmp_path, target=identity(1), **GEN)
    assert other["fingerprint"] != first["fingerprint"] and other["generated_tokens"] > 0
    # The other target's answers really differ: reusing them would have been wrong data.
    assert load_dataset_dir(tmp_path)["input_ids"] != first_ids
    # Back to the first target: its journal comes back, and nothing is answered again.
    again = build_dataset(prompts, a, tmp_path, target=identity(0), **GEN)
    assert again["fingerprint"] == first["fingerprint"] and again["generated_tokens"] == 0
    assert load_dataset_dir(tmp_path)["input_ids"] == first_ids


def test_a_journal_matches_only_the_same_recorded_target(targets, tmp_path):
    a, _ = targets
    prompts = prompts_of("Hello there.")
    unknown, known = tmp_path / "unknown.jsonl", tmp_path / "known.jsonl"
    regenerate(prompts, a, unknown, **GEN)  # as before targets were recorded: no target in the header
    assert "target" not in json.loads(unknown.read_text().splitlines()[0])["header"]
    assert regenerate(prompts, a, unknown, **GEN)["generated"] == 0
    # A journal that names no target is not taken for a known one (nor one of a target for none): answered again.
    assert regenerate(prompts, a, unknown, target=identity(0), **GEN)["generated"] == 1

    regenerate(prompts, a, known, target=identity(0), **GEN)
    assert regenerate(prompts, a, known, target=identity(0), **GEN)["generated"] == 0
    assert regenerate(prompts, a, known, **GEN)["generated"] == 1
    assert regenerate(prompts, a, known, target=identity(0), **{**GEN, "max_new_tokens": 7})["generated"] == 1
    # Greedy answers do not depend on the seed or top_p (say, data.seed changed to draw another held-out set).
    assert regenerate(prompts, a, known, target=identity(0), **{**GEN, "seed": 5, "top_p": 0.5})["generated"] == 0
    sampled = tmp_path / "sampled.jsonl"
    regenerate(prompts, a, sampled, target=identity(0), **{**GEN, "temperature": 0.7})
    reseeded = regenerate(prompts, a, sampled, target=identity(0), **{**GEN, "temperature": 0.7, "seed": 5})
    assert reseeded["generated"] == 1


def test_synthetic_draws_of_another_target_are_not_reused(targets, tmp_path):
    a, b = targets
    journal = tmp_path / "synthetic.jsonl"
    options = synthetic_options(max_new_tokens=8, min_chars=4, batch_size=4, max_oversample=2.0, show_progress=False)
    synthesize_prompts(a, 2, ["You write Python."], journal, target=identity(0), **options)
    before = journal.read_bytes()
    _, stats = synthesize_prompts(b, 2, ["You write Python."], journal, target=identity(1), **options)
    assert stats["reused"] == 0 and stats["generated_tokens"] > 0
    _, stats = synthesize_prompts(a, 2, ["You write Python."], journal, target=identity(0), **options)
    assert stats["generated_tokens"] == 0 and journal.read_bytes() == before  # the same target: every draw reused


# Issue: an edited prompt under the same id ---------------------------------------------------------------------

def test_an_edited_prompt_with_the_same_id_and_length_is_answered_again(targets, tmp_path):
    a, _ = targets
    before = prompts_of("What is the capital of France?", "Sort a list.")
    after = prompts_of("Write a haiku about the sea!!!", "Sort a list.")  # same id, same length, new text
    build_dataset(before, a, tmp_path, **GEN)
    stats = build_dataset(after, a, tmp_path, **GEN)
    assert (stats["stale"], stats["done"], stats["samples"]) == (1, 2, 2)
    build_dataset(after, a, tmp_path / "fresh", **GEN)
    assert load_dataset_dir(tmp_path)["input_ids"] == load_dataset_dir(tmp_path / "fresh")["input_ids"]
    assert latest(tmp_path / "journal.jsonl", "q-0") == latest(tmp_path / "fresh" / "journal.jsonl", "q-0")


def test_toggling_the_system_message_answers_again_instead_of_blaming_the_template(targets, tmp_path):
    a, _ = targets
    system = [{"role": "system", "content": "You are a Python programming assistant."}]
    build_dataset([Prompt("syn-0-3", system + user("How do I reverse a list?"), "synthetic")], a, tmp_path, **GEN)
    stats = build_dataset([Prompt("syn-0-3", user("How do I reverse a list?"), "synthetic")], a, tmp_path, **GEN)
    assert (stats["stale"], stats["samples"]) == (1, 1)
    row = load_dataset_dir(tmp_path)[0]
    assert "system" not in a.tokenizer.decode(row["input_ids"])


def test_an_edited_prompt_now_too_long_is_skipped_not_paired_with_its_old_answer(targets, tmp_path):
    a, _ = targets
    build_dataset(prompts_of("Short.", "Sort a list."), a, tmp_path, **GEN)
    stats = build_dataset(prompts_of("x" * 200, "Sort a list."), a, tmp_path, **GEN)
    assert (stats["stale"], stats["skipped"], stats["done"], stats["samples"]) == (1, 1, 1, 1)
    assert load_dataset_dir(tmp_path)["id"] == ["q-1"]
    assert latest(tmp_path / "journal.jsonl", "q-0")["status"] == "stale"
    # The next run finds no done answer for it: still skipped, nothing stale left.
    again = regenerate(prompts_of("x" * 200, "Sort a list."), a, tmp_path / "journal.jsonl", **GEN)
    assert (again["stale"], again["skipped"], again["generated"]) == (0, 1, 0)


def test_records_from_before_prompt_hashes_keep_the_length_check(targets, tmp_path):
    a, _ = targets
    journal = tmp_path / "journal.jsonl"
    build_dataset(prompts_of("What is the capital of France?"), a, tmp_path, **GEN)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for line in lines:
        line.pop("prompt_hash", None)
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "stats.json").unlink()
    assert build_dataset(prompts_of("What is the capital of France?"), a, tmp_path, **GEN)["generated_tokens"] == 0
    with pytest.raises(ValueError, match=r"'q-0' encodes to \d+ tokens .* the prompt's messages or the chat template"):
        build_dataset(prompts_of("What is the capital of Spain? Madrid?"), a, tmp_path, **GEN)


def test_a_changed_chat_template_answers_every_prompt_again(targets, tmp_path, monkeypatch):
    a, _ = targets
    prompts = prompts_of("What is the capital of France?", "Sort a list.")
    build_dataset(prompts, a, tmp_path, **GEN)
    template = a.tokenizer.chat_template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n\n'")
    assert template != a.tokenizer.chat_template
    monkeypatch.setattr(a.tokenizer, "chat_template", template)
    stats = build_dataset(prompts, a, tmp_path, **GEN)
    assert (stats["stale"], stats["done"], stats["samples"]) == (2, 2, 2)
    build_dataset(prompts, a, tmp_path / "fresh", **GEN)
    assert load_dataset_dir(tmp_path)["input_ids"] == load_dataset_dir(tmp_path / "fresh")["input_ids"]
