"""Journaled answers -> dataset rows: each prompt in the target's chat template, its response, and the loss mask."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from dflash.data.chat import encode_conversation
from dflash.data.journal import Index, read_record
from dflash.data.prompts import Prompt

COLUMNS = ("id", "input_ids", "loss_mask", "prompt_set")
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    # 0/1 flags: int8 keeps the mask a quarter of the ids' size on disk.
    "loss_mask": datasets.Sequence(datasets.Value("int8")),
    "prompt_set": datasets.Value("string"),
})
ENCODE_CHUNK = 10_000  # samples per in-memory Arrow chunk (bounds the Python-list memory while encoding)


@dataclass
class Rows:
    """The rows of one split, as Python lists until `seal` moves them into an Arrow chunk."""

    columns: dict[str, list] = field(default_factory=lambda: {c: [] for c in COLUMNS})
    chunks: list[datasets.Dataset] = field(default_factory=list)
    samples: int = 0
    num_tokens: int = 0
    num_response_tokens: int = 0
    sampled: int = 0  # rows whose answer was sampled (the others are greedy)

    def add(self, prompt: Prompt, input_ids: list[int], loss_mask: list[int], sampled: bool = False) -> None:
        for column, value in zip(COLUMNS, (prompt.id, input_ids, loss_mask, prompt.prompt_set)):
            self.columns[column].append(value)
        self.samples += 1
        self.sampled += sampled
        self.num_tokens += len(input_ids)
        self.num_response_tokens += sum(loss_mask)

    def seal(self) -> None:
        """Move the rows into an Arrow chunk once they make a whole ENCODE_CHUNK."""
        if len(self.columns["id"]) >= ENCODE_CHUNK:
            self._seal()

    def dataset(self) -> datasets.Dataset:
        """Every row added, as one dataset (there is at least one)."""
        if self.columns["id"]:
            self._seal()
        return datasets.concatenate_datasets(self.chunks) if len(self.chunks) > 1 else self.chunks[0]

    def _seal(self) -> None:
        self.chunks.append(datasets.Dataset.from_dict(self.columns, features=FEATURES))
        self.columns = {c: [] for c in COLUMNS}


@dataclass
class Encoded:
    """The done prompts' rows: training, held out, and how many had no loss token."""

    train: Rows = field(default_factory=Rows)
    heldout: Rows = field(default_factory=Rows)
    dropped: int = 0
    heldout_copies: int = 0  # training prompts dropped as token-for-token copies of a held-out prompt


def encode_answers(finished: list[Prompt], templated: Mapping[str, list[int]], index: Index, journal_path: Path,
                   tokenizer: Any, max_length: int, held: set[str],
                   is_sampled: Callable[[str], bool] | None = None) -> Encoded:
    """Rows of the `finished` prompts (done in the journal, `index` from scan_journal), in their order, from their
    templated ids (`templated`, by prompt id: what regeneration answered); the ids in `held` go to the held-out
    rows, and a training prompt whose templated ids equal a held-out prompt's is dropped (a source can repeat a
    prompt; its copy would be learned and then replayed as held out). Reads one record at a time. is_sampled:
    whether a prompt id's answer was sampled, counted per split (None: none was)."""
    encoded = Encoded()
    held_prompts = {tuple(templated[i]) for i in held}
    with open(journal_path, "rb") as journal:
        for first in range(0, len(finished), ENCODE_CHUNK):
            for p in finished[first : first + ENCODE_CHUNK]:
                record = read_record(journal, index[p.id][1])
                input_ids, loss_mask = encode_record(tokenizer, p, templated[p.id], record, max_length, journal_path)
                sampled = is_sampled is not None and is_sampled(p.id)
                if not any(loss_mask):
                    encoded.dropped += 1
                elif p.id not in held and tuple(templated[p.id]) in held_prompts:
                    encoded.heldout_copies += 1
                elif p.id in held:
                    encoded.heldout.add(p, input_ids, loss_mask, sampled)
                else:
                    encoded.train.add(p, input_ids, loss_mask, sampled)
            encoded.train.seal()
    return encoded


def encode_record(tokenizer: Any, prompt: Prompt, prompt_tokens: list[int], record: dict, max_length: int,
                  journal_path: Path) -> tuple[list[int], list[int]]:
    """encode_conversation of a journal record, checked against what the generation saw."""
    input_ids, loss_mask = encode_conversation(tokenizer, prompt.messages, record["response_ids"], prompt_tokens)
    # A record with a prompt_hash matches its prompt: regenerate answered again every prompt whose tokens changed.
    # A record from before prompt hashes can only be checked by its length.
    if "prompt_hash" not in record and len(prompt_tokens) != record["prompt_len"]:
        raise ValueError(f"prompt {prompt.id!r} encodes to {len(prompt_tokens)} tokens but its journaled answer "
                         f"was generated from {record['prompt_len']}: the prompt's messages or the chat template "
                         f"changed since; delete {journal_path} (it predates prompt hashes, which would have "
                         f"answered the changed prompt again)")
    if len(input_ids) > max_length:
        raise ValueError(f"prompt {prompt.id!r}: {len(input_ids)} tokens > max_length {max_length} "
                         f"in {journal_path}")
    return input_ids, loss_mask
