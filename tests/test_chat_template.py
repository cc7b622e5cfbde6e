"""Chat templates of targets: a base model without one gets the plain format, a user's template file replaces the
tokenizer's own, each said in one line; a missing file is refused before any stage."""

from __future__ import annotations

import json
import logging
import re

import pytest

from dflash.config import compose
from dflash.config.errors import ConfigPathError
from dflash.data.dataset import load_dataset_dir
from dflash.models.targets import load_target
from dflash.data.chat import prompt_ids
from dflash.models.targets.chat_template import PLAIN_TEMPLATE, PLAIN_TEMPLATE_WITH_BOS, set_chat_template
from dflash.models.targets.tiny import build_builtin_tokenizer
from dflash.pipeline import Pipeline
from tests.schema_options import answer_options
from tests.test_target_hf import TINY, hf_folder

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def base_model_folder(tmp_path):
    """An HF folder whose tokenizer has no chat template, as a base model's."""
    folder = hf_folder(tmp_path, "stablelm")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_plain_format_for_a_tokenizer_without_a_template():
    tokenizer = build_builtin_tokenizer()
    assert set_chat_template(tokenizer, None, "llama") is None  # its own ChatML stays
    tokenizer.chat_template = None
    line = set_chat_template(tokenizer, None, "llama")
    assert line.startswith("[target] llama has no chat template (a base model): prompts use the plain format")
    assert tokenizer.chat_template == PLAIN_TEMPLATE
    text = tokenizer.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=True)
    assert text == "Be brief.\n\nUser: Hi\n\nAssistant:"


def bos_adding_tokenizer():
    """The built-in tokenizer, putting its BOS token (<|im_start|>) before plain text as Gemma's and Llama's do."""
    from tokenizers import processors

    tokenizer = build_builtin_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    assert tokenizer("Hi").input_ids[0] == tokenizer.bos_token_id
    return tokenizer


def test_the_plain_format_starts_with_bos_where_the_tokenizer_puts_one_before_text(tmp_path):
    """Prompts are tokenized without special tokens, so only the template can give them the BOS token that a base
    model such as Gemma 3 was trained with (it degenerates without)."""
    tokenizer = bos_adding_tokenizer()
    tokenizer.chat_template = None
    line = set_chat_template(tokenizer, None, "gemma3_text")
    assert "prompts use the plain format '<|im_start|>User: ...' / 'Assistant:'" in line
    assert tokenizer.chat_template == PLAIN_TEMPLATE_WITH_BOS
    ids = prompt_ids(tokenizer, TURNS)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids[1:]) == "Be brief.\n\nUser: Hi\n\nAssistant:"
    # Through load_target, as a base model's HF folder whose tokenizer adds a BOS token.
    folder = base_model_folder(tmp_path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    adapter = load_target("hf", path=str(folder))
    ids = adapter.chat_ids(TURNS)
    assert ids[0] == adapter.tokenizer.bos_token_id and ids.count(adapter.tokenizer.bos_token_id) == 1


def test_a_template_file_without_the_bos_the_tokenizer_adds_is_warned_about_once(tmp_path, caplog):
    without, starting = tmp_path / "without.jinja", tmp_path / "starting.jinja"
    body = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    without.write_text(body)
    starting.write_text("{{ bos_token }}" + body)
    for _ in range(2):
        set_chat_template(bos_adding_tokenizer(), str(without), "gemma3_text")
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warned == [f"[target] warning: the chat template {without} (target.chat_template) does not start with the "
                      "BOS token '<|im_start|>', which the gemma3_text tokenizer puts before plain text; prompts are "
                      "tokenized without special tokens, so they will lack it"]
    set_chat_template(bos_adding_tokenizer(), str(starting), "gemma3_text")
    plain = tmp_path / "plain.jinja"
    plain.write_text(body)
    set_chat_template(build_builtin_tokenizer(), str(plain), "llama")  # a tokenizer that adds no BOS
    assert [record.levelno for record in caplog.records] == [logging.WARNING]


def test_a_template_file_replaces_the_tokenizers_own(tmp_path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    adapter = load_target("hf", path=str(hf_folder(tmp_path)), chat_template=str(template))
    assert f"prompts use the chat template of {template} (target.chat_template)" in capsys.readouterr().out
    ids = adapter.chat_ids(TURNS)
    assert adapter.tokenizer.decode(ids) == "[system] Be brief.\n[user] Hi\n[assistant]"


def test_a_missing_template_file_is_refused_before_any_stage():
    with pytest.raises(ConfigPathError, match=r"target.chat_template='/nowhere.jinja': no such file"):
        Pipeline(compose(TINY + ["target.chat_template=/nowhere.jinja"]))


@pytest.mark.parametrize("text,problem", [
    ("{% for m in messages %}{{ m.content }\n", "not a Jinja template: line 1: unexpected '}'"),
    ("# My notes\n\nNot a template at all.\n", "renders a conversation without its messages' text"),
    ("caf\xe9 {{ messages }}", "not UTF-8 text (invalid continuation byte at byte 3)"),
])
def test_a_template_file_that_renders_no_conversation_is_refused_before_any_stage(tmp_path, text, problem):
    from dflash.config import ConfigError

    template = tmp_path / "template.jinja"
    template.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match="^" + re.escape(f"target.chat_template={str(template)!r}: {problem}")):
        Pipeline(compose(TINY + [f"target.chat_template={template}", f"run_dir={tmp_path / 'run'}"])).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text,overrides", [
    # Its own refusal of a conversation without a system turn: the run's prompts may all have one.
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}"
     "{% for m in messages %}{{ m['content'] }}{% endfor %}", []),
    # An argument the command gives the template, and one it does not (the stage renders with the tokenizer's).
    ("{{ persona }}: {% for m in messages %}{{ m['content'] }}{% endfor %}", ["+data.chat_template_kwargs.persona=x"]),
    ("{{ sep_token + 'x' }}{% for m in messages %}{{ m['content'] }}{% endfor %}", []),
])
def test_a_template_this_check_cannot_render_is_left_to_the_stage_that_renders(tmp_path, text, overrides):
    from dflash.stages.context import refuse_unusable_target

    template = tmp_path / "template.jinja"
    template.write_text(text)
    refuse_unusable_target(Pipeline(compose(TINY + [f"target.chat_template={template}", *overrides])).context.settings)


def test_a_base_model_regenerates_its_answers_in_the_plain_format(tmp_path, capsys):
    run_dir = tmp_path / "run"
    Pipeline(compose(TINY + ["target=hf", f"target.path={base_model_folder(tmp_path)}", f"run_dir={run_dir}",
                             "data.limit=3", "data.max_new_tokens=4", "stages=[data]"])).run()
    assert "[target] stablelm has no chat template (a base model)" in capsys.readouterr().out
    tokenizer = load_target("hf", path=str(tmp_path / "stablelm")).tokenizer
    first = load_dataset_dir(run_dir / "data")[0]
    prompt = [i for i, m in zip(first["input_ids"], first["loss_mask"]) if not m]
    assert tokenizer.decode(prompt).startswith("User: ") and tokenizer.decode(prompt).endswith("\n\nAssistant:")


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_template_options_reach_regeneration(tmp_path):
    from dflash.data.dataset import build_dataset
    from dflash.data.prompts import Prompt

    adapter = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin"})
    adapter.tokenizer.chat_template = THINKING
    prompts = [Prompt(f"q{i}", [{"role": "user", "content": f"Question {i}"}], "test") for i in range(3)]
    options = answer_options(max_length=160, max_new_tokens=4, batch_size=3, show_progress=False)
    plain = build_dataset(prompts, adapter, tmp_path / "plain", **options)
    off = build_dataset(prompts, adapter, tmp_path / "off", template_kwargs={"enable_thinking": False}, **options)
    assert plain["fingerprint"] != off["fingerprint"]
    for folder, marked in (("plain", False), ("off", True)):
        row = load_dataset_dir(tmp_path / folder)[0]
        prompt = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if not m]
        assert adapter.tokenizer.decode(prompt).endswith("assistant\n<think></think>") == marked
    # Without options a build keeps the fingerprint it had before the setting existed.
    again = build_dataset(prompts, adapter, tmp_path / "plain", template_kwargs={}, **options)
    assert again["fingerprint"] == plain["fingerprint"]


def test_a_template_the_target_does_not_carry_travels_with_the_export(tmp_path, capsys):
    """A base model's plain format (or a template file) is recorded by the data stage and exported beside the
    drafter, checksummed, and the closing block names it; a target's own template is not written."""
    from dflash.run_files import checksum_problem, read_json

    run_dir = tmp_path / "run"
    Pipeline(compose(TINY + ["target=hf", f"target.path={base_model_folder(tmp_path)}", f"run_dir={run_dir}",
                             "data.limit=3", "data.max_new_tokens=4", "train.max_steps=2"])).run()
    recorded = (run_dir / "data" / "chat_template.jinja").read_text()
    assert recorded in (PLAIN_TEMPLATE, PLAIN_TEMPLATE_WITH_BOS)
    assert (run_dir / "export" / "chat_template.jinja").read_text() == recorded
    assert "chat_template.jinja" in read_json(str(run_dir / "export" / "checksums.json"))
    assert checksum_problem(str(run_dir / "export")) is None
    closing = capsys.readouterr().out.split("\n")
    # The tiny drafter mixes sliding and full layers, which not every vLLM serves.
    assert any(f"serve it with SGLang, or a vLLM with PR 40898 for mixed sliding and full drafter layers, with the "
               f"chat template {run_dir / 'export' / 'chat_template.jinja'} and the stop string '\\n\\nUser:' "
               f"(docs/serving.md)" in line for line in closing)

    own = tmp_path / "own"
    Pipeline(compose(TINY + ["target=hf", f"target.path={hf_folder(tmp_path)}", f"run_dir={own}",
                             "data.limit=3", "data.max_new_tokens=4", "stages=[data]"])).run()
    assert not (own / "data" / "chat_template.jinja").exists()


def test_a_run_folder_from_before_the_record_gets_it_and_its_export_carries_it(tmp_path, capsys):
    """A build whose stats.json predates the record gets data/chat_template.jinja from the tokenizer alone when it
    is kept, and the export, whole but without the file, is exported again with it."""
    from dflash.run_files import read_json, write_checksums, write_json

    run_dir = tmp_path / "run"
    command = TINY + ["target=hf", f"target.path={base_model_folder(tmp_path)}", f"run_dir={run_dir}",
                      "data.limit=6", "data.heldout=2", "data.max_new_tokens=4", "train.max_steps=2"]
    Pipeline(compose(command)).run()
    recorded = (run_dir / "data" / "chat_template.jinja").read_text()
    stats = read_json(str(run_dir / "data" / "stats.json"))
    write_json(str(run_dir / "data" / "stats.json"), {k: v for k, v in stats.items() if k != "chat_template_recorded"})
    (run_dir / "data" / "chat_template.jinja").unlink()
    for export in ("export", "export_best"):  # as an older version wrote them: whole, without the file
        (run_dir / export / "chat_template.jinja").unlink()
        write_checksums(str(run_dir / export))
    capsys.readouterr()
    Pipeline(compose(command)).run()
    out = capsys.readouterr().out
    assert "[data] up to date" in out and "[train] up to date" in out  # nothing trained again
    assert (run_dir / "data" / "chat_template.jinja").read_text() == recorded
    assert (run_dir / "export" / "chat_template.jinja").read_text() == recorded
    assert (run_dir / "export_best" / "chat_template.jinja").read_text() == recorded
    assert read_json(str(run_dir / "data" / "stats.json"))["chat_template_recorded"] is True
