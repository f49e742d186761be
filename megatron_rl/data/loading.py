"""Reading and writing prompt sets. A prompt file is JSON Lines (.jsonl, one object per line),
Parquet (.parquet) or a directory holding a Hugging Face `datasets` split (`Dataset.save_to_disk`),
in any layout of megatron_rl/data/layouts.py (ours, verl's, question/answer), told apart by the
first row's columns. Files are written in our layout: JSON Lines (one `PromptRecord.to_json()`
object per line) or Parquet (the same columns through pyarrow; `tests`, `metadata` and a
conversation prompt's `messages` stored as JSON strings, since their shapes differ between rows
and Parquet wants one schema per column).

Every problem with a file raises PromptFileError, one line that starts with where it is
("FILE:LINE" for JSON Lines, "FILE row N" for tables, rows counted from 0) and ends with the fix.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.data.layouts import LAYOUT_READERS, detect_layout
from megatron_rl.data.records import PromptRecord

FORMATS = (".jsonl", ".parquet")  # and a directory: a `datasets` split saved with save_to_disk


class PromptFileError(ValueError):
    """A prompt file that cannot be used as it is; the message says where, what and the fix."""


@dataclasses.dataclass(frozen=True)
class PromptFile:
    """A prompt file's records in file order, with where each one is ("FILE:LINE" or "FILE row
    N") and the layout the file was read in."""

    path: Path
    layout: str
    records: list[PromptRecord]
    locations: list[str]


def read_prompt_file(path: str | os.PathLike) -> PromptFile:
    """All records of a prompt file (any accepted container and layout); ids must be unique."""
    path = Path(path)
    rows = list(_rows(path))
    if not rows:
        raise PromptFileError(f"{path}: no prompts (the file is empty); give a file with at "
                              "least one prompt per line / row (docs/data.md)")
    first, first_where = rows[0]
    try:
        layout = detect_layout(first)
    except ValueError as exc:
        raise PromptFileError(f"{first_where}: {exc}") from None
    read = LAYOUT_READERS[layout]
    read_as = "" if layout == "megatron_rl" else f" (read in {layout}'s layout, by its columns)"
    records, locations = [], []
    for index, (row, where) in enumerate(rows):
        if not isinstance(row, dict):
            raise PromptFileError(f"{where}: a prompt must be a JSON object, got "
                                  f"{type(row).__name__}; put one object per line")
        try:
            records.append(read(row, index=index, source=path))
        except ValueError as exc:
            raise PromptFileError(f"{where}: {exc}{read_as}") from None
        locations.append(where)
    _check_unique_ids(records, locations, layout=layout)
    return PromptFile(path=path, layout=layout, records=records, locations=locations)


def load_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """All records of a prompt file, in file order (read_prompt_file)."""
    return read_prompt_file(path).records


def _rows(path: Path) -> Iterator[tuple[Any, str]]:
    """(row, where) of every row of the file: a JSON value and "FILE:LINE", or a table row (a
    dict) and "FILE row N"."""
    if path.is_dir():
        yield from _dataset_rows(path)
        return
    if path.suffix not in FORMATS:
        raise PromptFileError(f"{path}: a prompt file must end in one of {FORMATS} or be a "
                              "directory written by datasets' save_to_disk")
    if not path.is_file():
        raise PromptFileError(f"{path}: no such file; check data.prompts")
    if path.suffix == ".jsonl":
        yield from ((obj, where.removesuffix(": ")) for obj, where in iter_jsonl(path))
        return
    import pyarrow
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise PromptFileError(f"{path}: not a Parquet file pyarrow can read ({exc}); write it "
                              "with pyarrow, pandas.to_parquet or datasets' to_parquet") from None
    for number, row in enumerate(rows):
        if "task" in row:  # our layout (save_prompts): JSON strings for the nested columns
            for column in ("tests", "messages"):
                if isinstance(row.get(column), str):
                    row[column] = json.loads(row[column])
            messages = row.pop("messages", None)
            if messages:
                row["prompt"] = messages
        yield row, f"{path} row {number}"


def _dataset_rows(path: Path) -> Iterator[tuple[dict, str]]:
    """The rows of a `datasets` split saved with save_to_disk."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise PromptFileError(f"{path}: a directory, but not one datasets' save_to_disk wrote "
                              f"({exc}); give a .jsonl / .parquet file or a saved split") from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = ", ".join(f"{path / name}" for name in dataset)
        raise PromptFileError(f"{path}: a dataset with several splits; point data.prompts at "
                              f"one of them: {splits}")
    for number, row in enumerate(dataset):
        yield row, f"{path} row {number}"


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[Any, str]]:
    """The JSON value of each non-blank line of a JSON Lines file, with a "file:line: " prefix for
    errors about it; a line that is not JSON raises PromptFileError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}: "
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}not valid JSON ({exc.msg} at column "
                                      f"{exc.colno}); each line must be one complete JSON "
                                      "object") from None
            yield obj, where


def save_prompts(records: Iterable[PromptRecord], path: str | os.PathLike) -> None:
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"prompt file {str(path)!r} must end in one of {FORMATS}")
    rows = [r.to_json() for r in records]
    if path.suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    def text(prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else prompt[-1]["content"]

    columns = {
        "id": [r["id"] for r in rows], "task": [r["task"] for r in rows],
        "prompt": [text(r["prompt"]) for r in rows], "answer": [r.get("answer") for r in rows],
        "tests": [json.dumps(r["tests"]) if "tests" in r else None for r in rows],
        "metadata": [json.dumps(r.get("metadata", {})) for r in rows],
        "messages": [None if isinstance(r["prompt"], str) else json.dumps(r["prompt"])
                     for r in rows],
    }
    schema = pa.schema([(name, pa.string()) for name in columns])
    pq.write_table(pa.table(columns, schema=schema), path)


def _check_unique_ids(records: list[PromptRecord], locations: list[str], *,
                      layout: str) -> None:
    first_seen: dict[str, str] = {}
    duplicates = []
    for record, where in zip(records, locations):
        if record.prompt_id in first_seen:
            duplicates.append((where, record.prompt_id, first_seen[record.prompt_id]))
        first_seen.setdefault(record.prompt_id, where)
    if duplicates:
        where, prompt_id, first = duplicates[0]
        fix = {"verl": "give every row its own extra_info.index",
               "question_answer": "give every row its own 'id' (or drop the id column)"}.get(
                   layout, "give every prompt its own 'id'")
        more = f" ({len(duplicates)} rows repeat an id)" if len(duplicates) > 1 else ""
        raise PromptFileError(f"{where}: prompt id {prompt_id!r} is already the id of {first}"
                              f"{more}; ids must be unique (the held-out split and the sampler "
                              f"key on them): {fix}")


def check_unique_ids(records: Iterable[PromptRecord], *, source: str = "prompts") -> None:
    seen: set[str] = set()
    duplicates = []
    for record in records:
        if record.prompt_id in seen:
            duplicates.append(record.prompt_id)
        seen.add(record.prompt_id)
    if duplicates:
        raise ValueError(f"{source}: duplicate prompt ids {sorted(set(duplicates))[:10]}; ids "
                         "must be unique (the held-out split and the sampler key on them)")
