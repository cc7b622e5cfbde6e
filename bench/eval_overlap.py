"""Time the data stage's overlap check (dflash/data/eval_overlap.py) on the recipe's ShareGPT prompts; print JSON.

    python bench/eval_overlap.py                  # every ShareGPT turn (data.turns=all), 2 repeats
    python bench/eval_overlap.py --repeats 1

Times, alternating which goes first: `match_text` as it is (a text without a run of word pairs long enough to
hold a gram is passed over) and `every_gram` (`EvalIndex.search` of every text's words: a gram tried at each word,
as before that), over the
texts of the prompts against the shipped evaluation sets (HumanEval, MT-Bench, GSM8K); also `words` alone (the
regular expression every text goes through). Both must name the same evaluation prompt for every text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.data.eval_overlap import EvalIndex, words  # noqa: E402
from dflash.data.prompts import load_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompts = load_prompts("sharegpt", turns="all")
    texts = list(dict.fromkeys(m["content"] for p in prompts for m in p.messages))  # each text checked once
    evals = [p for name in ("humaneval", "mtbench", "gsm8k") for p in load_prompts(name, name=name, turns="first")]
    index = EvalIndex(evals, n=13)
    variants = {"match_text": index.match_text, "every_gram": lambda text: index.search(words(text)), "words": words}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    found = {}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            began = time.perf_counter()
            found[name] = [variants[name](text) for text in texts]
            seconds[name].append(round(time.perf_counter() - began, 3))
    assert found["match_text"] == found["every_gram"], "the two searches disagree"
    best = {name: min(values) for name, values in seconds.items()}
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
                      "prompts": len(prompts), "texts": len(texts),
                      "overlapping_texts": sum(f is not None for f in found["match_text"]), "seconds": seconds,
                      "speedup_of_best": round(best["every_gram"] / best["match_text"], 2)}, indent=2))


if __name__ == "__main__":
    main()
