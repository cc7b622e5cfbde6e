"""Chat encoding + loss mask, resumable regeneration and its counts, and the dataset on disk."""

import json
import logging

import pytest
import torch

from dflash.config.errors import ConfigError
from dflash.data.chat import encode_conversation, prompt_ids, prompt_ids_many
from dflash.data.dataset import build_dataset, load_dataset_dir
from dflash.data.prompts import Prompt, load_prompts
from dflash.data.regenerate import read_journal, regenerate
from dflash.models.targets import load_target
from tests.schema_options import answer_options

GEN = answer_options(max_length=160, max_new_tokens=6, batch_size=3, show_progress=False)


@pytest.fixture(scope="module")
def tiny():
    # Built-in byte-level tokenizer: deterministic and independent of any cache.
    target = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    # A model this small runs fastest on one thread, and does not fight parallel test runs for the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target
    torch.set_num_threads(threads)


def make_prompts(n, prefix="q"):
    """Prompts of different lengths (the byte-level tokenizer makes one token per character)."""
    return [Prompt(f"{prefix}{i}", [{"role": "user", "content": f"Question {i}: " + "word " * (i % 4)}], "test")
            for i in range(n)]


def record_generate(adapter, monkeypatch):
    """Wrap model.generate; returns the list of calls, each the list of unpadded prompt rows it received."""
    calls = []
    real = adapter.model.generate

    def generate(input_ids, attention_mask, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            first = mask.index(1)
            assert mask == [0] * first + [1] * (len(mask) - first), "prompts must be LEFT padded"
            rows.append(tuple(ids[first:]))
        calls.append(rows)
        return real(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(adapter.model, "generate", generate)
    return calls


def journal_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# Chat encoding -----------------------------------------------------------------------------------------------

def test_loss_mask_covers_exactly_the_response(tiny):
    tok = tiny.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    response = tok.encode("Blue.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ids, mask = encode_conversation(tok, messages, response)
    prompt = prompt_ids(tok, messages)
    assert prompt == tiny.chat_ids(messages)  # same ids as the adapter's contract
    assert ids == prompt + response
    assert mask == [0] * len(prompt) + [1] * len(response)
    assert tok.decode(ids[len(prompt):]) == "Blue.<|im_end|>"
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": "Blue."}], tokenize=False)
    assert full == tok.decode(ids) + "\n"  # the template closes the turn with im_end + newline
    assert encode_conversation(tok, messages, None) == (prompt, [0] * len(prompt))


def test_encoding_needs_a_final_user_turn(tiny):
    with pytest.raises(ValueError, match="end with a user turn"):
        encode_conversation(tiny.tokenizer, [{"role": "assistant", "content": "hi"}], [1])


@pytest.mark.slow
def test_real_smollm2_template_and_regeneration(tmp_path):
    """The real SmolLM2 chat template: prompt + response ids reproduce the full templated conversation."""
    target = load_target("smollm2")
    tok = target.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    conversations = [
        ([{"role": "user", "content": "What is the capital of France?"}], "The capital of France is Paris."),
        ([{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Sky colour?"}], "Blue"),
    ]
    for messages, answer in conversations:
        response = tok.encode(answer, add_special_tokens=False) + [end]
        ids, mask = encode_conversation(tok, messages, response)
        full = messages + [{"role": "assistant", "content": answer}]
        text = tok.apply_chat_template(full, tokenize=False)
        full_ids = tok.apply_chat_template(full, tokenize=True, return_dict=True)["input_ids"]
        assert tok.decode(ids) + "\n" == text
        assert full_ids[: len(ids)] == ids and tok.decode(full_ids[len(ids):]) == "\n"
        assert sum(mask) == len(response) and mask[-len(response):] == [1] * len(response)

    # A short real greedy regeneration through the whole stage.
    prompts = [Prompt("paris", conversations[0][0], "real")]
    stats = build_dataset(prompts, target, tmp_path, max_length=256, max_new_tokens=12, batch_size=1,
                          show_progress=False, **answer_options())
    assert (stats["done"], stats["samples"]) == (1, 1)
    row = load_dataset_dir(tmp_path)[0]
    n_prompt = row["loss_mask"].index(1)
    assert row["input_ids"][:n_prompt] == prompt_ids(tok, conversations[0][0])
    assert "Paris" in tok.decode(row["input_ids"][n_prompt:])


@pytest.mark.parametrize("real", [False, True])
def test_batched_prompt_ids_equal_the_chat_template_one_by_one(tiny, real):
    """The data stage tokenises rendered templates in one batch; it must equal apply_chat_template(tokenize=True)."""
    tok = load_target("smollm2").tokenizer if real else tiny.tokenizer
    prompts = load_prompts("sharegpt", turns="all", limit=40, seed=1)
    conversations = [p.messages for p in prompts] + [[{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi <|im_end|> there"}]]
    expected = [list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True,
                                             return_dict=True)["input_ids"]) for m in conversations]
    assert any(len(m) > 1 for m in conversations)  # multi-turn contexts are covered
    assert prompt_ids_many(tok, conversations) == expected
    assert prompt_ids_many(tok, []) == []
    with pytest.raises(ValueError, match=r"conversation #1 \(roles \['assistant'\]\): .*end with a user turn"):
        prompt_ids_many(tok, [conversations[0], [{"role": "assistant", "content": "x"}]])


def test_a_template_error_names_the_prompt(tiny, monkeypatch):
    """A template that refuses one record (say, two user turns in a row under an alternating template) stops the
    data stage naming that prompt, not with a bare jinja error."""
    from jinja2.exceptions import TemplateError

    tok = tiny.tokenizer
    render = type(tok).apply_chat_template

    def alternating(self, messages, **kwargs):
        if [m["role"] for m in messages] == ["user", "user"]:
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return render(self, messages, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", alternating)
    prompts = [Prompt("fine", [{"role": "user", "content": "q"}], "s"),
               Prompt("sharegpt-7#2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "s")]
    with pytest.raises(ValueError, match=r"conversation sharegpt-7#2 \(roles \['user', 'user'\]\): the chat "
                                         r"template refused it \(TemplateError: Conversation roles must alternate"):
        prompt_ids_many(tok, [p.messages for p in prompts], names=[p.id for p in prompts])


# Regeneration ------------------------------------------------------------------------------------------------

def test_interrupted_run_resumes_without_generating_twice(tiny, tmp_path, monkeypatch, caplog):
    prompts = make_prompts(7)
    calls = record_generate(tiny, monkeypatch)
    journal = tmp_path / "journal.jsonl"

    counts = ("total", "done", "skipped", "failed", "generated", "errors")
    first = regenerate(prompts[:4], tiny, journal, **GEN)
    assert {k: first[k] for k in counts} == {"total": 4, "done": 4, "skipped": 0, "failed": 0, "generated": 4,
                                             "errors": []}
    assert first["engine"] == "hf" and first["generated_tokens"] > 0 and first["generate_tokens_per_s"] > 0
    # Simulate a crash in the middle of writing a line.
    with open(journal, "a") as f:
        f.write('{"id": "q5", "status": "do')
    with caplog.at_level("INFO", logger="dflash.data.regenerate"):
        second = regenerate(prompts, tiny, journal, **GEN)
    assert {k: second[k] for k in counts} == {"total": 7, "done": 7, "skipped": 0, "failed": 0, "generated": 3,
                                              "errors": []}
    # Said, as the bar counts only what is left.
    assert f"[data] 4 answer(s) kept from the journal ({journal}); answering the other 3" in caplog.messages
    third = regenerate(prompts, tiny, journal, **GEN)
    assert third["generated"] == 0 and third["done"] == 7

    generated_rows = [row for call in calls for row in call]
    expected_rows = [tuple(prompt_ids(tiny.tokenizer, p.messages)) for p in prompts]
    assert sorted(generated_rows) == sorted(expected_rows)  # every prompt exactly once
    assert all(len(call) <= GEN["batch_size"] for call in calls)
    lines = journal_lines(journal)  # the partial line is gone; everything parses
    assert "header" in lines[0]
    assert sorted(r["id"] for r in lines[1:]) == sorted(p.id for p in prompts)

    # The resumed journal holds the same greedy responses as one uninterrupted run (batch 1: no padding effects).
    one_go, resumed = tmp_path / "one_go.jsonl", tmp_path / "resumed.jsonl"
    settings = {**GEN, "batch_size": 1}
    regenerate(prompts, tiny, one_go, **settings)
    regenerate(prompts[2:5], tiny, resumed, **settings)
    regenerate(prompts, tiny, resumed, **settings)
    assert ({i: r["response_ids"] for i, r in read_journal(one_go)[1].items()}
            == {i: r["response_ids"] for i, r in read_journal(resumed)[1].items()})


def test_batches_are_sorted_by_length(tiny, tmp_path, monkeypatch):
    calls = record_generate(tiny, monkeypatch)
    regenerate(make_prompts(8), tiny, tmp_path / "j.jsonl", **GEN)
    longest = [max(len(row) for row in call) for call in calls]
    assert longest == sorted(longest, reverse=True)
    for call in calls:  # rows of a batch are the closest lengths available
        assert max(map(len, call)) - min(map(len, call)) <= 10


def test_too_long_prompt_is_skipped_and_counted(tiny, tmp_path, caplog):
    prompts = make_prompts(3) + [Prompt("long", [{"role": "user", "content": "x" * 400}], "test")]
    with caplog.at_level(logging.WARNING, logger="dflash.data.regenerate"):
        stats = regenerate(prompts, tiny, tmp_path / "j.jsonl", **GEN)
    assert (stats["total"], stats["done"], stats["skipped"], stats["failed"]) == (4, 3, 1, 0)
    assert "long" in caplog.text and "skipped 1 prompt" in caplog.text
    _, records = read_journal(tmp_path / "j.jsonl")
    assert "long" not in records
    # The boundary: templated length + 1 == max_length still fits exactly one response token.
    n = len(prompt_ids(tiny.tokenizer, prompts[0].messages))
    stats = regenerate(prompts[:1], tiny, tmp_path / "edge.jsonl", max_length=n + 1, max_new_tokens=6,
                       batch_size=1, show_progress=False, **answer_options())
    assert stats["done"] == 1
    assert len(read_journal(tmp_path / "edge.jsonl")[1]["q0"]["response_ids"]) == 1
    stats = regenerate(prompts[:1], tiny, tmp_path / "over.jsonl", max_length=n, max_new_tokens=6, batch_size=1,
                       show_progress=False, **answer_options())
    assert (stats["done"], stats["skipped"]) == (0, 1)


def test_responses_fit_max_length(tiny, tmp_path):
    prompts = make_prompts(6)
    lengths = {p.id: len(prompt_ids(tiny.tokenizer, p.messages)) for p in prompts}
    max_length = min(lengths.values()) + 3
    prompts = [p for p in prompts if lengths[p.id] < max_length]
    regenerate(prompts, tiny, tmp_path / "j.jsonl", max_length=max_length, max_new_tokens=20, batch_size=4,
               show_progress=False, **answer_options())
    for pid, record in read_journal(tmp_path / "j.jsonl")[1].items():
        assert 1 <= len(record["response_ids"]) and lengths[pid] + len(record["response_ids"]) <= max_length
        assert record["prompt_len"] == lengths[pid]


def test_response_stops_at_the_first_stop_token(tiny, tmp_path, monkeypatch):
    stop = tiny.stop_token_ids()[0]
    pad = tiny.tokenizer.pad_token_id

    def generate(input_ids, attention_mask, generation_config):
        assert generation_config.eos_token_id == tiny.stop_token_ids()
        assert generation_config.do_sample is False
        tail = torch.tensor([[40, 41, stop, pad, pad]] * len(input_ids))
        return torch.cat([input_ids, tail], dim=1)

    monkeypatch.setattr(tiny.model, "generate", generate)
    regenerate(make_prompts(2), tiny, tmp_path / "j.jsonl", **GEN)
    for record in read_journal(tmp_path / "j.jsonl")[1].values():
        assert record["response_ids"] == [40, 41, stop] and record["finish"] == "stop"


def failing_on(tiny, prompt: Prompt):
    """tiny.model.generate that raises (as out of memory would) on any batch holding `prompt`."""
    bad = tuple(prompt_ids(tiny.tokenizer, prompt.messages))
    real = tiny.model.generate

    def generate(input_ids, attention_mask, **kwargs):
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            if tuple(i for i, m in zip(ids, mask) if m) == bad:
                raise RuntimeError("simulated out of memory")
        return real(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    return generate


def test_a_failing_generation_is_counted_and_retried_later(tiny, tmp_path, monkeypatch):
    prompts = make_prompts(5)
    real = tiny.model.generate
    monkeypatch.setattr(tiny.model, "generate", failing_on(tiny, prompts[2]))
    journal = tmp_path / "j.jsonl"
    stats = regenerate(prompts, tiny, journal, **GEN)
    assert (stats["total"], stats["done"], stats["skipped"], stats["failed"]) == (5, 4, 0, 1)
    assert stats["errors"] == [{"id": "q2", "error": "RuntimeError: simulated out of memory"}]
    monkeypatch.setattr(tiny.model, "generate", real)
    stats = regenerate(prompts, tiny, journal, **GEN)
    assert (stats["done"], stats["failed"], stats["generated"]) == (5, 0, 1)


def test_a_build_with_failed_prompts_is_not_reused_but_retried(tiny, tmp_path, monkeypatch):
    prompts = make_prompts(4)
    real = tiny.model.generate
    monkeypatch.setattr(tiny.model, "generate", failing_on(tiny, prompts[1]))
    first = build_dataset(prompts, tiny, tmp_path, **GEN)
    assert (first["failed"], first["samples"]) == (1, 3)
    monkeypatch.setattr(tiny.model, "generate", real)
    second = build_dataset(prompts, tiny, tmp_path, **GEN)
    assert (second["failed"], second["samples"], second["generated_tokens"] > 0) == (0, 4, True)
    third = build_dataset(prompts, tiny, tmp_path, **GEN)
    assert third == {**second, "reused": True}  # complete now: reused


def test_answers_finished_before_an_interrupt_are_journaled(tiny, tmp_path, monkeypatch):
    import dflash.data.regenerate as regenerate_module

    def two_then_interrupted(adapter, pending, *args, **part):
        yield 0, [40, 41]
        yield 1, [42]
        raise KeyboardInterrupt  # Ctrl-C while the third answer is generated

    monkeypatch.setattr(regenerate_module, "_hf_results", two_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate(make_prompts(5), tiny, tmp_path / "j.jsonl", **GEN)  # 2 answers < a batch of 3: not yet written
    records = read_journal(tmp_path / "j.jsonl")[1]
    assert len(records) == 2 and all(r["status"] == "done" for r in records.values())


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(tiny, tmp_path):
    prompts = make_prompts(3)
    settings = {**GEN, "max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95}
    state = torch.random.get_rng_state()
    responses = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        regenerate(prompts, tiny, tmp_path / f"{name}.jsonl", seed=seed, **settings)
        responses.append({i: r["response_ids"] for i, r in read_journal(tmp_path / f"{name}.jsonl")[1].items()})
    assert torch.equal(state, torch.random.get_rng_state())
    assert responses[0] == responses[1]
    assert responses[0] != responses[2]


def test_journal_from_other_settings_is_moved_aside(tiny, tmp_path):
    regenerate(make_prompts(1), tiny, tmp_path / "j.jsonl", **GEN)
    first = (tmp_path / "j.jsonl").read_bytes()
    assert regenerate(make_prompts(1), tiny, tmp_path / "j.jsonl", **{**GEN, "max_new_tokens": 7})["generated"] == 1
    [aside] = tmp_path.glob("j.*.jsonl")
    assert aside.read_bytes() == first


@pytest.mark.parametrize("damage", [b"{not json", b"\xff\xfe not UTF-8", b"[1, 2]", b"null", b'{"id": "p0"}',
                                    b'{"status": "done", "response": "x"}'])
def test_malformed_journal_line_names_the_line(tiny, tmp_path, damage):
    """Any damage to a complete line (not JSON, not UTF-8, not a record) is named by file and line, not a bare
    KeyError or TypeError."""
    journal = tmp_path / "j.jsonl"
    regenerate(make_prompts(2), tiny, journal, **GEN)
    lines = journal.read_bytes().splitlines()
    journal.write_bytes(b"\n".join([lines[0], damage, *lines[1:]]) + b"\n")
    with pytest.raises(ValueError, match=r"j\.jsonl:2: malformed journal line"):
        regenerate(make_prompts(2), tiny, journal, **GEN)


def test_duplicate_prompt_ids_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="unique"):
        regenerate(make_prompts(2) + make_prompts(1), tiny, tmp_path / "j.jsonl", **GEN)


# Dataset on disk ---------------------------------------------------------------------------------------------

def test_dataset_round_trips_and_is_reused(tiny, tmp_path, monkeypatch):
    prompts = make_prompts(5) + [Prompt("long", [{"role": "user", "content": "x" * 400}], "other")]
    stats = build_dataset(prompts, tiny, tmp_path, **GEN)
    assert (stats["total"], stats["done"], stats["skipped"], stats["failed"]) == (6, 5, 1, 0)
    assert stats["samples"] == 5 and stats["dropped_no_loss"] == 0
    assert json.loads((tmp_path / "stats.json").read_text()) == stats

    ds = load_dataset_dir(tmp_path)
    assert ds.column_names == ["id", "input_ids", "loss_mask", "prompt_set"]
    assert ds["id"] == [f"q{i}" for i in range(5)]  # prompt order, not generation order
    assert set(ds["prompt_set"]) == {"test"}
    _, records = read_journal(tmp_path / "journal.jsonl")
    for row, prompt in zip(ds, prompts):
        assert (row["input_ids"], row["loss_mask"]) == encode_conversation(
            tiny.tokenizer, prompt.messages, records[prompt.id]["response_ids"])
        assert len(row["input_ids"]) <= GEN["max_length"]
    assert stats["num_tokens"] == sum(len(r) for r in ds["input_ids"])
    assert stats["num_response_tokens"] == sum(sum(m) for m in ds["loss_mask"])

    # Same inputs: reused without generating; one more prompt: only that one is generated.
    calls = record_generate(tiny, monkeypatch)
    assert build_dataset(prompts, tiny, tmp_path, **GEN) == {**stats, "reused": True}
    assert calls == []
    more = build_dataset(prompts + make_prompts(1, prefix="new"), tiny, tmp_path, **GEN)
    assert len(calls) == 1 and len(calls[0]) == 1
    assert (more["total"], more["samples"]) == (7, 6)
    assert load_dataset_dir(tmp_path)["id"][-1] == "new0"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_samples_without_a_response_token_are_dropped(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny.model, "generate", lambda input_ids, attention_mask, generation_config: input_ids)
    # A user's to mend (one line on the console, no traceback), naming the settings that decide it.
    with pytest.raises(ConfigError, match=r"no samples to write: of 2 prompts 0 were too long \(a prompt may have at "
                                          r"most data.max_length - 1 = \d+ tokens\), 0 failed, 2 had no response "
                                          r"token and 0 were held out \(data.heldout\)"):
        build_dataset(make_prompts(2), tiny, tmp_path, **GEN)
    assert not (tmp_path / "stats.json").exists() and not (tmp_path / "dataset").exists()


def test_a_build_templates_each_prompt_once(tiny, tmp_path, monkeypatch):
    """Regeneration and encoding share one templating of the prompts (a data stage of tens of thousands of
    multi-turn prompts spent as long encoding them again as generating); the rows are what templating gives."""
    prompts = make_prompts(4) + [Prompt("long", [{"role": "user", "content": "x" * 400}], "other")]
    rendered = []
    real = tiny.tokenizer.apply_chat_template

    def apply_chat_template(messages, *args, **kwargs):
        rendered.append(messages[-1]["content"])
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(tiny.tokenizer, "apply_chat_template", apply_chat_template)
    stats = build_dataset(prompts, tiny, tmp_path, **GEN)
    assert sorted(rendered) == sorted(p.messages[-1]["content"] for p in prompts)
    assert stats["samples"] == 4 and stats["template_seconds"] >= 0
    _, records = read_journal(tmp_path / "journal.jsonl")
    for row, prompt in zip(load_dataset_dir(tmp_path), prompts):
        assert row["input_ids"] == prompt_ids(tiny.tokenizer, prompt.messages) + records[prompt.id]["response_ids"]


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dataset at .*dataset: run build_dataset"):
        load_dataset_dir(tmp_path)
