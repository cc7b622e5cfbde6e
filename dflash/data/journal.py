"""The data stage's journals: append-only JSON lines that make generation resumable.

A journal starts with a header {"header": {...settings}}; every other line is a record with an "id" and a
"status", and the latest line of an id is its state. A run checks the header against its own settings before
appending, so answers made under other settings are never mixed in: a journal of other settings is moved aside to
`<name>.<its header's fingerprint>.jsonl` (never deleted), and one moved aside earlier whose header matches the
settings now takes its place again, so going back to those settings reuses its answers. Records are written in
groups and fsynced (`JournalBuffer`), so a hard kill loses at most the last unwritten group; a partial last line is
dropped when the journal is opened again.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from dflash.run_files import fingerprint

logger = logging.getLogger(__name__)
JOURNAL_EVERY_S = 30.0  # the static engine streams every prompt in one call: write what finished this often

Index = dict[str, tuple[str, int, str | None]]  # id -> (status, byte offset of its latest line, prompt_hash)


def with_target(settings: dict, target: dict | None) -> dict:
    """`settings` plus the target's identity as it reads back from a JSON header (so comparing the two is exact).
    An unknown target (None) adds nothing, so settings recorded before targets were keep matching."""
    if target is None:
        return settings
    try:
        return {**settings, "target": json.loads(json.dumps(target, sort_keys=True))}
    except (TypeError, ValueError) as e:
        raise ValueError(f"target identity must be JSON-serialisable, got {target!r} ({e})") from None


def _journal_line(path: Path, lineno: int, line: bytes) -> dict:
    """A complete journal line read back: a header, or a record with a string "id" and "status"; a damaged line
    (not JSON, not UTF-8, not such an object) is a ValueError naming the file and line."""
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are no UTF-8
        raise ValueError(f"{path}:{lineno}: malformed journal line ({getattr(e, 'msg', None) or e})") from None
    if isinstance(record, dict) and ("header" in record or (isinstance(record.get("id"), str)
                                                            and isinstance(record.get("status"), str))):
        return record
    raise ValueError(f"{path}:{lineno}: malformed journal line (a header or a record with an id and a status "
                     f"expected, got {line[:80].decode(errors='replace').strip()!r})")


def _scan(path: Path) -> tuple[dict | None, Index, int]:
    """scan_journal, plus the byte length of the complete lines (where a partial last line starts)."""
    header, index, offset = None, {}, 0
    if not path.exists():
        return header, index, offset
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # the partial line of an interrupted write
            if line.strip():
                record = _journal_line(path, lineno, line)
                if "header" in record:
                    header = record["header"]
                else:
                    index[record["id"]] = (record["status"], offset, record.get("prompt_hash"))
            offset += len(line)
    return header, index, offset


def scan_journal(path: str | Path) -> tuple[dict | None, Index]:
    """(header settings or None, {id: (status, byte offset of its latest line, its prompt_hash or None)}); a partial
    last line is ignored.

    Streams the file and keeps no responses, so a journal of millions of long responses fits in memory.
    """
    header, index, _ = _scan(Path(path))
    return header, index


def read_record(f: Any, offset: int) -> dict:
    """The journal record at `offset` of the journal opened in binary mode as `f`."""
    f.seek(offset)
    return json.loads(f.readline())


def read_journal(path: str | Path) -> tuple[dict | None, dict[str, dict]]:
    """(header settings or None, {id: latest record}): the whole journal in memory, for inspection."""
    header, index = scan_journal(path)
    if not index:
        return header, {}
    with open(path, "rb") as f:
        return header, {pid: read_record(f, offset) for pid, (_, offset, _) in index.items()}


def setting_differences(header: dict, settings: dict, prefix: str = "") -> list[str]:
    """What differs between recorded settings (a journal's header, an evaluation's config) and the settings now:
    `key: then -> now`, nested keys dotted after `prefix`."""
    parts = []
    for key in sorted(set(header) | set(settings)):
        then = header[key] if key in header else "not recorded"
        now = settings[key] if key in settings else "not given"
        if isinstance(then, dict) and isinstance(now, dict):
            parts += setting_differences(then, now, f"{prefix}{key}.")
        elif then != now:
            parts.append(f"{prefix}{key}: {then!r} -> {now!r}")
    return parts


def _settings_differences(header: dict, settings: dict, unused: tuple[str, ...]) -> list[str]:
    """setting_differences of a header and the settings now, but for the top-level keys in `unused`."""
    return setting_differences({k: v for k, v in header.items() if k not in unused},
                        {k: v for k, v in settings.items() if k not in unused})


def _first_line(path: Path) -> bytes:
    """The first line of the file at `path` (b"" when there is none), its newline kept."""
    if not path.exists():
        return b""
    with open(path, "rb") as f:
        return f.readline()


def journal_header(path: str | Path) -> dict | None:
    """The settings of the journal at `path` (its first line's header), without reading the rest; None when there
    is no journal or its first line is no header."""
    return _header_of(_first_line(Path(path)))


def _header_of(line: bytes) -> dict | None:
    """The settings of a journal's header line, or None when the line is no header."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return record.get("header") if isinstance(record, dict) else None


def switch_journal(path: Path, settings: dict, unused: tuple[str, ...] = ()) -> None:
    """Make `path` the journal of `settings` (but for the top-level keys in `unused`): a journal there of other
    settings is moved aside to <stem>.<its header's fingerprint><suffix>, never deleted, and one moved aside
    earlier whose header matches takes its place, so going back to earlier settings reuses their records."""
    first = _first_line(path)
    if first.endswith(b"\n"):  # a journal is there (a partial first line: one killed before its header was out)
        header = _header_of(first)
        differences = _settings_differences(header, settings, unused) if header is not None else []
        if not differences:
            return  # this journal is the settings' own, or not a journal (open_journal names the bad line)
        stem = f"{path.stem}.{fingerprint(header)}"
        aside, k = path.with_name(stem + path.suffix), 2
        while aside.exists():  # a name taken (a copy made by hand) is never written over
            aside, k = path.with_name(f"{stem}-{k}{path.suffix}"), k + 1
        os.replace(path, aside)
        logger.info("%s was written with other settings (%s): moved aside to %s, whose records come back when "
                    "those settings do", path, "; ".join(differences), aside.name)
    # Matched by header, not by name: a journal also serves settings that differ from it only in `unused` keys.
    for earlier in sorted(path.parent.glob(f"{glob.escape(path.stem)}.*{path.suffix}")):
        header = _header_of(_first_line(earlier))
        if header is not None and not _settings_differences(header, settings, unused):
            os.replace(earlier, path)
            logger.info("%s: the records of these settings are back from %s", path, earlier.name)
            return


def open_journal(path: Path, settings: dict, unused: tuple[str, ...] = ()) -> tuple[Any, dict[str, str | None]]:
    """Open the journal of `settings` for appending after dropping a partial tail: a journal at `path` of other
    settings, but for the top-level keys in `unused` (settings that change no record, e.g. the seed of greedy
    answers; the header keeps the values it was written with), is moved aside first (switch_journal).

    Returns the open file and {id: prompt_hash (None in records from before hashes)} of the ids already done.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    switch_journal(path, settings, unused)
    header, index, complete = _scan(path)
    if path.exists() and path.stat().st_size > complete:
        # Appending after a partial line would glue the next record onto it: cut it off first.
        logger.warning("%s: dropping a partial last line (%d bytes) from an interrupted run", path,
                       path.stat().st_size - complete)
        with open(path, "r+b") as f:
            f.truncate(complete)
    f = open(path, "a", encoding="utf-8")
    if header is None:
        f.write(json.dumps({"header": settings}) + "\n")
    return f, {pid: digest for pid, (status, _, digest) in index.items() if status == "done"}


def append_lines(f: Any, records: list[dict]) -> None:
    """Append `records` as JSON lines to the journal opened as `f`, and make them durable (flush + fsync)."""
    f.write("".join(json.dumps(r) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


class JournalBuffer:
    """Records waiting to be appended to an open journal: written once `every` have gathered or JOURNAL_EVERY_S
    have passed since the last write, so a killed run loses little and the journal is not fsynced per record."""

    def __init__(self, journal: Any, every: int) -> None:
        self.journal, self.every = journal, every
        self.lines: list[dict] = []
        self.written = time.perf_counter()

    def add(self, record: dict) -> None:
        self.lines.append(record)
        if len(self.lines) >= self.every or time.perf_counter() - self.written > JOURNAL_EVERY_S:
            self.write()

    def write(self) -> None:
        """Append what is waiting and fsync the journal (also when nothing is waiting)."""
        append_lines(self.journal, self.lines)
        self.lines.clear()
        self.written = time.perf_counter()
