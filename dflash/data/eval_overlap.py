"""Training prompts that overlap the evaluation prompts: found by shared word n-grams and left out of training.

Texts are normalised to lower-case words (runs of letters and digits; punctuation, case and spacing do not count),
after Unicode's compatibility composition (NFKC): an accent typed as a combining mark and a full-width letter read
as the composed and the plain letter.
In the scripts written without spaces between words (Chinese and Japanese ideographs, kana, Thai) each letter is a
word of its own.
A training prompt overlaps an evaluation prompt when they share an n-gram of n consecutive words (n =
data.eval_overlap_ngram, 13 in the schema, the contamination test of GPT-3, arXiv 2005.14165 appendix C); an
evaluation prompt shorter than n words overlaps when its whole word sequence appears in the training prompt, if it
has at least MIN_WORDS words (fewer, such as "Why?", say nothing about where a prompt came from). Every message of
a prompt counts (system, user and earlier turns), and an evaluation prompt's later turns (MT-Bench turn 2) too.

N-grams found in more than BOILERPLATE evaluation prompts are the evaluation's own template (the instruction every
HumanEval or GSM8K prompt starts with), not a question: a training prompt that shares only those is kept.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence

from dflash.data.prompts import Prompt

BOILERPLATE = 5
MIN_WORDS = 8
# Scripts written without spaces: a run of their letters is a clause, not a word, so each letter counts as one.
# Hangul is written with spaces between words: its runs stay words.
_LETTER_WORDS = ("\u0e00-\u0e7f"  # Thai
                 "\u3005-\u3007"  # the ideographic iteration and closing marks, ideographic zero
                 "\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f"  # hiragana, katakana (full and half width)
                 "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003ffff")  # CJK ideographs
# The lookahead keeps the punctuation and marks of those blocks (the katakana middle dot ・, ฿) out, as elsewhere.
_WORD = re.compile(rf"(?=[^\W_])[{_LETTER_WORDS}]|[^\W_{_LETTER_WORDS}]+")
_ASCII_WORD = re.compile(r"[a-z0-9]+")  # what _WORD finds in lower-case ASCII text, a quarter faster


def words(text: str) -> list[str]:
    """The normalised words of `text` (NFKC): lower-case runs of letters and digits, and each letter of a script
    written without spaces (ideographs, kana, Thai)."""
    if text.isascii():
        return _ASCII_WORD.findall(text.lower())
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def prompt_words(prompt: Prompt) -> list[str]:
    """The normalised words of every message of `prompt` and of its later turns, one sequence per text joined with
    an empty word between texts, so no n-gram spans two of them."""
    texts = [m["content"] for m in prompt.messages] + list(prompt.follow_ups)
    joined: list[str] = []
    for text in texts:
        joined += words(text) + [""]
    return joined


def _grams(sequence: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The n-grams of `sequence` that do not cross a text boundary (the empty word)."""
    return {gram for gram in (tuple(sequence[i : i + n]) for i in range(len(sequence) - n + 1)) if "" not in gram}


class EvalIndex:
    """The n-grams of a collection of evaluation prompts, to test training prompts against."""

    def __init__(self, eval_prompts: Iterable[Prompt], n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        counts: Counter = Counter()
        self.sources: dict[tuple[str, ...], str] = {}  # n-gram -> the first evaluation prompt's set and id
        for prompt in eval_prompts:
            sequence = prompt_words(prompt)
            # A text shorter than n words is one gram: its whole word sequence.
            grams = _grams(sequence, self.n) | {tuple(t) for t in _texts(sequence) if MIN_WORDS <= len(t) < self.n}
            counts.update(grams)
            for gram in grams:
                self.sources.setdefault(gram, f"{prompt.prompt_set}/{prompt.id}")
        self.grams = {gram for gram, count in counts.items() if count <= BOILERPLATE}
        # The lengths of the whole short texts, by their first word: only positions starting with one are tried.
        self.short: dict[str, set[int]] = {}
        for gram in self.grams:
            if len(gram) < self.n:
                self.short.setdefault(gram[0], set()).add(len(gram))
        # A text can share a gram of L words only where L - 1 of its word pairs in a row are pairs of some gram: most
        # texts have no such run, and are passed over without trying a gram at each of their words.
        self.pairs = {pair for gram in self.grams for pair in zip(gram, gram[1:])}
        self.run = b"\x01" * (min(len(gram) for gram in self.grams) - 1) if self.grams else None

    def match(self, prompt: Prompt, seen: dict[str, str | None] | None = None) -> str | None:
        """The set/id of an evaluation prompt that `prompt` overlaps, or None. `seen`: results of texts already
        checked, filled in (conversations that share their earlier turns are checked once per text)."""
        seen = {} if seen is None else seen
        for text in [m["content"] for m in prompt.messages] + list(prompt.follow_ups):
            if text not in seen:
                seen[text] = self.match_text(text)
            if seen[text] is not None:
                return seen[text]
        return None

    def match_text(self, text: str) -> str | None:
        """The set/id of an evaluation prompt that one text overlaps, or None."""
        sequence = words(text)
        if self.run is None or self.run not in bytes(map(self.pairs.__contains__, zip(sequence, sequence[1:]))):
            return None
        return self.search(sequence)

    def search(self, sequence: list[str]) -> str | None:
        """The set/id of the evaluation prompt whose gram comes first in a text's words, trying the grams at each
        word; None when none is there."""
        for i, word in enumerate(sequence):
            for length in (self.n, *self.short.get(word, ())):
                gram = tuple(sequence[i : i + length])
                if len(gram) == length and gram in self.grams:
                    return self.sources[gram]
        return None


def _texts(sequence: list[str]) -> list[list[str]]:
    """The per-text word lists of a prompt_words sequence."""
    texts, current = [], []
    for word in sequence:
        if word == "":
            texts.append(current)
            current = []
        else:
            current.append(word)
    return texts


def drop_eval_overlaps(prompts: list[Prompt], index: EvalIndex) -> tuple[list[Prompt], dict]:
    """(the prompts that overlap no evaluation prompt, a report): the report counts the prompts checked and dropped
    per training prompt set, and names up to 20 dropped prompts with the evaluation prompt each overlaps."""
    kept, dropped, seen = [], [], {}
    for prompt in prompts:
        found = index.match(prompt, seen)
        if found is None:
            kept.append(prompt)
        else:
            dropped.append((prompt, found))
    checked = Counter(p.prompt_set for p in prompts)
    removed = Counter(p.prompt_set for p, _ in dropped)
    report = {"ngram": index.n, "checked": dict(checked), "dropped": {name: removed.get(name, 0) for name in checked},
              "examples": [{"prompt": p.id, "set": p.prompt_set, "eval": found} for p, found in dropped[:20]]}
    return kept, report
