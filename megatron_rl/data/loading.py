"""Reading and writing prompt sets: JSON Lines (one `PromptRecord.to_json()` object per line) and
Parquet (the same columns through pyarrow; `tests` and `metadata` stored as JSON strings, since
their shapes differ between tasks and Parquet wants one schema per column).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.data.records import PromptRecord

FORMATS = (".jsonl", ".parquet")


def _format_of(path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ValueError(f"prompt file {str(path)!r} must end in one of {FORMATS}")
    return path.suffix


def load_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """All records of a .jsonl or .parquet prompt file, in file order; ids must be unique."""
    path = Path(path)
    if _format_of(path) == ".jsonl":
        records = [PromptRecord.from_json(obj, where=where)
                   for obj, where in iter_jsonl(path)]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        records = []
        for number, row in enumerate(rows):
            if isinstance(row.get("tests"), str):
                row["tests"] = json.loads(row["tests"])
            records.append(PromptRecord.from_json(row, where=f"{path} row {number}: "))
    check_unique_ids(records, source=str(path))
    return records


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[Any, str]]:
    """The JSON value of each non-blank line of a JSON Lines file, with a "file:line: " prefix for
    errors about it; a line that is not JSON raises ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}: "
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}not valid JSON ({exc.msg})") from None
            yield obj, where


def save_prompts(records: Iterable[PromptRecord], path: str | os.PathLike) -> None:
    path = Path(path)
    rows = [r.to_json() for r in records]
    if _format_of(path) == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {
        "id": [r["id"] for r in rows], "task": [r["task"] for r in rows],
        "prompt": [r["prompt"] for r in rows], "answer": [r.get("answer") for r in rows],
        "tests": [json.dumps(r["tests"]) if "tests" in r else None for r in rows],
        "metadata": [json.dumps(r.get("metadata", {})) for r in rows],
    }
    schema = pa.schema([(name, pa.string()) for name in columns])
    pq.write_table(pa.table(columns, schema=schema), path)


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
