"""The evaluation's input files: the prompt files of eval.prompt_sets and the chat template file
(target.chat_template) are recorded by their sha256 in the evaluation's done.json, and an edit to either measures
again (tests/test_pipeline.py runs it with a prompt file)."""

import os

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.run_files import file_sha256, write_json
from dflash.stages.evaluation import EvalStage, changed_eval_inputs, eval_input_files

TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_an_edited_chat_template_file_makes_a_finished_evaluation_out_of_date(tmp_path, monkeypatch, caplog):
    template, prompts = tmp_path / "chat.jinja", tmp_path / "p.jsonl"
    template.write_text(TEMPLATE)
    prompts.write_text('{"id": "p0", "prompt": "Hi?"}\n')
    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}", "stages=[eval]",
                                 f"target.chat_template={template}",
                                 f"+eval.prompt_sets.mine={{source: file, path: '{prompts}'}}"]))
    stage = pipeline.eval
    monkeypatch.setattr(EvalStage, "measured", lambda self: (os.path.join(str(tmp_path / "run"), "export"), "KEY"))
    recorded = eval_input_files(pipeline.settings)
    assert recorded == {"eval.prompt_sets.mine.path": {"path": str(prompts), "sha256": file_sha256(prompts)},
                        "target.chat_template": {"path": str(template), "sha256": file_sha256(template)}}
    os.makedirs(stage.out)
    write_json(os.path.join(stage.out, "summary.json"), {})
    write_json(os.path.join(stage.out, "done.json"), {"fingerprint": stage.fingerprint(), "input_files": recorded})
    assert stage.up_to_date()

    template.write_text(TEMPLATE.replace("'<|im_start|>' + message['role']", "'<|im_start|>' + message['role'] + ':'"))
    assert [change[0] for change in changed_eval_inputs(pipeline.settings, stage.out)] == ["target.chat_template"]
    assert not stage.up_to_date()
    assert f"target.chat_template {template} changed since this evaluation" in caplog.text
    # A marker from before the record is trusted as it is.
    write_json(os.path.join(stage.out, "done.json"), {"fingerprint": stage.fingerprint()})
    assert stage.up_to_date()
