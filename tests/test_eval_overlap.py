"""Training prompts that overlap the evaluation prompts are dropped by the data stage (dflash/data/eval_overlap.py):
by hand, and a GSM8K question planted in the training prompts of the tiny pipeline does not reach its dataset."""

from __future__ import annotations

import json
import re
import unicodedata

import pytest

from dflash.config import compose
from dflash.data.dataset import format_stats, load_dataset_dir
from dflash.data.eval_overlap import EvalIndex, drop_eval_overlaps, words
from dflash.data.prompts import Prompt, load_prompts
from dflash.pipeline import Pipeline
from dflash.run_files import read_json

QUESTION = ("A farmer has 17 sheep and buys 5 more every week for the next 9 weeks, then sells half of the flock at "
            "the market; how many sheep does the farmer keep?")


def user(prompt_id: str, text: str, system: str | None = None, prompt_set: str = "train") -> Prompt:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return Prompt(prompt_id, messages, prompt_set)


def test_overlap_by_hand():
    """13 shared words in a row drop a prompt whatever the case, punctuation or surrounding text; 12 do not; a short
    eval question counts when whole; the eval template shared by many eval prompts does not count."""
    template = "Answer with a number on the last line of your reply, after working it out step by step please."
    evals = [user("q", QUESTION + "\n\n" + template, prompt_set="math"), user("short", "Name three rivers of Europe "
                                                                                      "and the seas they reach.")]
    evals += [user(f"other{i}", f"Question {i} about apples. " + template) for i in range(6)]
    index = EvalIndex(evals, n=13)
    shared = words(QUESTION)
    planted = " ".join(shared[4:17]).upper() + "!!"  # 13 words of the question, another case and punctuation
    prompts = [user("a", "Hello there. " + planted + " Thanks."),
               user("b", "Hello there. " + " ".join(shared[4:16])),                # 12 words only
               user("c", "Please: name three rivers of Europe, and the seas they reach?"),
               user("d", "Tell me a story. " + template),                           # the eval template only
               user("e", "Be brief.", system="You copy this: " + QUESTION, prompt_set="synthetic")]
    kept, report = drop_eval_overlaps(prompts, index)
    assert [p.id for p in kept] == ["b", "d"]
    assert report["checked"] == {"train": 4, "synthetic": 1} and report["dropped"] == {"train": 2, "synthetic": 1}
    assert [(e["prompt"], e["eval"]) for e in report["examples"]] == [("a", "math/q"), ("c", "train/short"),
                                                                      ("e", "math/q")]


def test_verbatim_chinese_and_japanese_eval_prompts_are_found():
    """Each ideograph, kana or Thai letter is a word (a run of them is a clause): a Chinese or Japanese evaluation
    prompt copied into a training prompt is found, 12 characters of it are not enough, and a short one counts when
    whole; punctuation of those scripts is no word, and Hangul, written with spaces, keeps its words."""
    chinese = "小明有五个苹果，他给了小红两个，又买了三个，请问小明现在有几个苹果？"
    japanese = "次の文章を読んで、筆者が最も伝えたいことを三十字以内で説明してください。"
    evals = [user("zh", chinese, prompt_set="zh"), user("ja", japanese, prompt_set="ja"),
             user("short", "東京タワーの高さは？", prompt_set="ja")]  # 9 words, fewer than n
    prompts = [user("a", chinese), user("b", "请帮我：" + japanese + "谢谢"), user("c", "有五个苹果，他给了小红两个"),
               user("d", "質問：東京タワーの高さを教えて"), user("e", "東京タワーの高さは？")]
    kept, report = drop_eval_overlaps(prompts, EvalIndex(evals, n=13))
    assert [p.id for p in kept] == ["c", "d"]
    assert [(e["prompt"], e["eval"]) for e in report["examples"]] == [("a", "zh/zh"), ("b", "ja/ja"),
                                                                      ("e", "ja/short")]
    assert words("東京・タワー。ไทย 한국어 문장") == ["東", "京", "タ", "ワ", "ー", "ไ", "ท", "ย", "한국어", "문장"]
    assert words("AI模型") == ["ai", "模", "型"]


def test_texts_without_those_scripts_split_as_runs_of_letters_and_digits():
    """Outside ideographs, kana and Thai a word is a run of letters and digits, as it always was: the shipped
    evaluation prompts (English) and other alphabets split the same, so the same training prompts are dropped."""
    texts = [m["content"] for name in ("humaneval", "mtbench", "gsm8k") for p in load_prompts(name)
             for m in p.messages]
    texts += ["Ünïcode café_au_lait 3.14 Привет, мир! Γειά σου ١٢٣ Ｆｕｌｌ"]
    for text in texts:
        if not any("\u3040" <= c <= "\u9fff" for c in text):
            assert words(text) == re.findall(r"[^\W_]+", unicodedata.normalize("NFKC", text).lower())


def test_an_eval_prompt_in_other_unicode_forms_is_found():
    """Accents typed as combining marks (NFD) and full-width letters read as the composed and plain letters: a
    copy of an evaluation prompt in either form is dropped."""
    french = ("Un fermier possède dix-sept moutons et en achète cinq de plus chaque semaine pendant neuf semaines, "
              "combien en a-t-il à la fin de la période évoquée ?")
    index = EvalIndex([user("fr", french, prompt_set="fr"), user("en", QUESTION, prompt_set="en")], n=13)
    full_width = QUESTION.translate({c: c + 0xFEE0 for c in range(0x21, 0x7F)})  # ASCII -> full-width forms
    prompts = [user("nfd", unicodedata.normalize("NFD", french)), user("wide", full_width),
               user("keep", "Un fermier possède des moutons.")]
    kept, _ = drop_eval_overlaps(prompts, index)
    assert [p.id for p in kept] == ["keep"]
    assert words(unicodedata.normalize("NFD", "pondérée")) == ["pondérée"]


def test_texts_passed_over_by_their_word_pairs_are_those_a_gram_by_gram_search_clears(tmp_path):
    """match_text skips a text with no run of a gram's length - 1 word pairs seen in the grams: on texts made of the
    evaluation prompts' own words, cut and shuffled (many near misses), it names what trying every gram at every
    word names."""
    import random

    evals = [p for name in ("humaneval", "mtbench", "gsm8k") for p in load_prompts(name, name=name)]
    index = EvalIndex(evals, n=13)

    rng = random.Random(0)
    pool = [words(m["content"]) for p in evals for m in p.messages]
    short = [list(gram) for gram in index.grams if len(gram) < index.n]  # whole texts of 8 to 12 words
    assert short
    texts = []
    for _ in range(400):
        source = rng.choice(pool if rng.random() < 0.8 else short)
        start, length = rng.randrange(len(source)) // 4, rng.choice([6, 9, 12, 13, 14, 30])
        piece = source[start:start + length]
        if rng.random() < 0.5:  # break the run at one place
            piece.insert(rng.randrange(len(piece) + 1), rng.choice(rng.choice(pool)))
        texts.append(" ".join(rng.choice(pool)[:5] + piece + rng.choice(pool)[-5:]))
    found = [index.match_text(text) for text in texts]
    assert found == [index.search(words(text)) for text in texts]
    assert 50 < sum(f is not None for f in found) < 350  # both kinds are there
    assert {index.sources[tuple(gram)] for gram in short} & set(found)  # a short text found whole


def planted_prompts(tmp_path) -> tuple[str, object]:
    """A prompt file of five training prompts and one GSM8K question of the eval set; (its path, that question)."""
    gsm8k = load_prompts("gsm8k")[7]
    question = gsm8k.messages[-1]["content"].split("\n\n")[0]  # the question without the eval's instruction
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Write one sentence about topic {i}."}]}
            for i in range(5)]
    rows.insert(2, {"id": "planted", "conversations": [{"from": "human", "value": "Help me: " + question}]})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), gsm8k


def test_a_planted_eval_prompt_is_dropped_by_the_data_stage(tmp_path):
    """The tiny pipeline's data stage with a GSM8K question of the eval set planted among its training prompts:
    it is dropped, counted in stats.json and the console table, and is not in the dataset; the others are."""
    path, gsm8k = planted_prompts(tmp_path)
    run_dir = tmp_path / "run"
    Pipeline(compose(["+experiment=tiny", "show_progress=false", "stages=[data]", f"run_dir={run_dir}",
                      "data.source=file", f"data.path={path}", "data.limit=null"])).run()
    stats = read_json(str(run_dir / "data" / "stats.json"))
    overlap = stats["eval_overlap"]
    assert overlap["dropped"] == {"prompts": 1} and overlap["checked"] == {"prompts": 6}
    assert overlap["examples"] == [{"prompt": "planted", "set": "prompts", "eval": f"gsm8k/{gsm8k.id}"}]
    assert overlap["eval_sets"]["gsm8k"] > 2  # the whole set, not only the evaluated subset
    assert "1 of 6 training prompts dropped" in format_stats(stats)
    assert sorted(load_dataset_dir(str(run_dir / "data"))["id"]) == [f"p{i}" for i in range(5)]


def test_an_eval_set_added_after_the_build_is_checked_from_the_journal(tmp_path, monkeypatch, capsys):
    path, _ = planted_prompts(tmp_path)
    run = ["+experiment=tiny", "show_progress=false", "stages=[data]", f"run_dir={tmp_path / 'run'}",
           "data.source=file", f"data.path={path}", "data.limit=null", "data.max_length=512"]
    Pipeline(compose(run + ["~eval.prompt_sets.gsm8k"])).run()  # built without GSM8K among the eval sets
    data = tmp_path / "run" / "data"
    assert "planted" in load_dataset_dir(str(data))["id"]

    def must_not_generate(*args, **kwargs):
        raise AssertionError("answered again")

    monkeypatch.setattr("dflash.data.regenerate._static_results", must_not_generate)
    monkeypatch.setattr("dflash.data.regenerate._hf_results", must_not_generate)
    capsys.readouterr()
    Pipeline(compose(run)).run()
    assert "not checked for overlap with gsm8k" in "".join(capsys.readouterr())
    assert sorted(load_dataset_dir(str(data))["id"]) == [f"p{i}" for i in range(5)]
    assert read_json(str(data / "stats.json"))["eval_overlap"]["dropped"] == {"prompts": 1}
    Pipeline(compose(run)).run()  # checked now: kept
    assert "not checked for overlap" not in "".join(capsys.readouterr())


def test_an_eval_set_that_reads_another_source_or_file_since_is_checked_again(tmp_path, monkeypatch, capsys):
    """The overlap check records each set's source and file, not only its name: a set renamed onto another source,
    or whose file changed, is checked again from the journal."""
    path, gsm8k = planted_prompts(tmp_path)
    run = ["+experiment=tiny", "show_progress=false", "stages=[data]", f"run_dir={tmp_path / 'run'}",
           "data.source=file", f"data.path={path}", "data.limit=null", "data.max_length=512"]
    Pipeline(compose(run + ["eval.prompt_sets.gsm8k.source=humaneval"])).run()  # "gsm8k" read HumanEval
    data = tmp_path / "run" / "data"
    assert "planted" in load_dataset_dir(str(data))["id"]
    monkeypatch.setattr("dflash.data.regenerate._static_results", lambda *a, **k: pytest.fail("answered again"))
    monkeypatch.setattr("dflash.data.regenerate._hf_results", lambda *a, **k: pytest.fail("answered again"))
    capsys.readouterr()
    Pipeline(compose(run)).run()
    assert "not checked for overlap with gsm8k" in "".join(capsys.readouterr())
    assert "planted" not in load_dataset_dir(str(data))["id"]
    evals = tmp_path / "eval.jsonl"  # a file set, then the same file with GSM8K's question in it
    evals.write_text(json.dumps({"id": "e", "conversations": [{"from": "human", "value": "Say hi."}]}) + "\n")
    mine = ["eval.prompt_sets.humaneval.source=file", f"eval.prompt_sets.humaneval.path={evals}"]
    Pipeline(compose(run + mine)).run()
    capsys.readouterr()
    Pipeline(compose(run + mine)).run()
    assert "not checked for overlap" not in "".join(capsys.readouterr())
    evals.write_text(evals.read_text() + json.dumps(
        {"id": "q", "conversations": [{"from": "human", "value": gsm8k.messages[-1]["content"]}]}) + "\n")
    Pipeline(compose(run + mine)).run()
    assert "not checked for overlap with humaneval" in "".join(capsys.readouterr())
