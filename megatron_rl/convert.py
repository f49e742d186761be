"""Checkpoint conversion between Hugging Face folders and Megatron dist_checkpointing, streamed
tensor by tensor (the trainer loads a converted checkpoint with megatron_rl/trainer/checkpoint.py
`load_model_weights`, re-exported here).

HF -> Megatron writes one *global* torch_dist checkpoint: the "model" part of what the trainer
saves (same ShardedTensor keys, global shapes and per-expert prepended axes, taken from the
family's GPTModel built on the meta device at TP1/EP1/PP1), which Megatron reshards on load to any
TP/EP/PP. torch.distributed.checkpoint writes it through a save planner whose `resolve_data` reads
each tensor from safetensors only when it is written, one file per Megatron parameter, so memory
stays near one weight group (e.g. one layer's fused experts). Megatron -> HF loads a few
parameters at a time through Megatron's own loader (any saved layout) and streams them into
safetensors shards whose headers are planned up front. The family's `models/<name>/convert.py`
supplies the name/layout mapping; the HF config.json and tokenizer files travel in `hf/` inside
the Megatron checkpoint so that the way back needs no other input.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

# The trainer loads a converted checkpoint through its own checkpoint code (re-exported here for
# the tools and tests that start a model from a conversion).
from megatron_rl.trainer.checkpoint import MODEL_SHARDED_METADATA, load_model_weights  # noqa: F401

HF_FILES_DIR = "hf"  # inside a converted Megatron checkpoint: config.json, tokenizer files
COMMON_KEY = "megatron_rl_convert"  # the converter's record in the checkpoint's common state
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_SAFETENSORS = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
_SAFETENSORS_INDEX = "model.safetensors.index.json"


class ConversionError(ValueError):
    """Bad input to a conversion; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConversionReport:
    output_dir: str
    family: str
    num_tensors: int  # written: Megatron parameters (to Megatron) or HF tensors (to HF)
    num_bytes: int
    seconds: float
    validated: bool
    skipped_hf_tensors: tuple[str, ...] = ()  # e.g. a multimodal checkpoint's vision tower

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / max(self.seconds, 1e-9)


# ----------------------------------------------------------------------------- HF side


class HFCheckpoint:
    """An HF model folder: config.json and safetensors shards, read one tensor at a time."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{self.directory} has no config.json: point the converter at "
                                  "a Hugging Face model folder (config.json + *.safetensors)")
        self.config = _read_json(config_path)
        self.files = self._weight_files()
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for file in sorted(set(self.files.values())):
            with _open_safetensors(self.directory / file) as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    if view.get_dtype() not in _FROM_SAFETENSORS:
                        raise ConversionError(
                            f"{name} in {file} has dtype {view.get_dtype()}, which the converter "
                            "does not read (quantized checkpoints are not supported): convert "
                            "the bf16 release of the model")
                    self._meta[name] = (_FROM_SAFETENSORS[view.get_dtype()],
                                        tuple(view.get_shape()))
        self._meta = {n: m for n, m in self._meta.items() if n in self.files}
        missing = sorted(set(self.files) - set(self._meta))
        if missing:
            raise ConversionError(f"{_SAFETENSORS_INDEX} in {self.directory} lists tensors that "
                                  f"its shards lack: {', '.join(missing)}")

    def _weight_files(self) -> dict[str, str]:
        index = self.directory / _SAFETENSORS_INDEX
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no weight_map: re-download or re-copy it")
            return dict(weight_map)
        shards = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not shards:
            others = sorted(p.name for p in self.directory.iterdir()
                            if p.suffix in (".bin", ".pt", ".pth"))
            hint = (f" (found {others}: re-save with save_pretrained(safe_serialization=True))"
                    if others else "")
            raise ConversionError(f"{self.directory} has no *.safetensors weights{hint}")
        files = {}
        for shard in shards:
            with _open_safetensors(self.directory / shard) as handle:
                files.update({name: shard for name in handle.keys()})
        return files

    def names(self) -> list[str]:
        return list(self._meta)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        # A fresh handle per tensor: the file mapping is released as soon as the tensor is read,
        # so mapped pages of earlier tensors do not accumulate in the resident set.
        with _open_safetensors(self.directory / self.files[name]) as handle:
            return handle.get_tensor(name)


# A damaged download or copy is the usual cause of an unreadable input file: the fix to name.
_RECOPY = ("re-download or re-copy it and compare its size with the source's (the hub's file "
           "list)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path} is not valid JSON ({err}): it is truncated or damaged; "
                              f"{_RECOPY}") from None


@contextlib.contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """safe_open, with a missing, truncated or damaged file as a ConversionError naming it."""
    try:
        with safe_open(path, framework="pt") as handle:
            yield handle
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing (weight files must all be present, including "
                              f"every shard {_SAFETENSORS_INDEX} names)") from None
    except SafetensorError as err:
        raise ConversionError(f"{path} is not a readable safetensors file "
                              f"({_safetensors_damage(path)}; safetensors: {err}): {_RECOPY}"
                              ) from None


def _safetensors_damage(path: Path) -> str:
    """What the file's own header says is wrong with it, e.g. its size against the size its
    header describes (safetensors: 8-byte header length, JSON header, then the data)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            return f"{size:,} bytes, shorter than the 8-byte header length"
        (header_bytes,) = struct.unpack("<Q", prefix)
        if 8 + header_bytes > size:
            return (f"{size:,} bytes, truncated in its header: the header alone needs "
                    f"{8 + header_bytes:,}")
        try:
            header = json.loads(file.read(header_bytes))
            data_bytes = max((entry["data_offsets"][1] for key, entry in header.items()
                              if key != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"{size:,} bytes, with a header that is not valid safetensors JSON"
    expected = 8 + header_bytes + data_bytes
    if expected != size:
        cut = "truncated" if size < expected else "longer than that"
        return f"{size:,} bytes, {cut}: its header describes {expected:,}"
    return f"{size:,} bytes, as its header describes, but damaged"


def _family_of(config: dict[str, Any]):
    import models

    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ConversionError(f"config.json must name exactly one architecture, got "
                              f"{architectures!r}")
    try:
        family = models.model_family_for_hf_architecture(architectures[0])
    except ValueError:
        supported = sorted(a for name in models.list_model_families()
                           for a in models.get_model_family(name).hf_architectures)
        raise ConversionError(f"unsupported architecture {architectures[0]!r}; supported: "
                              f"{', '.join(supported)}") from None
    return family, family.converter()


# ----------------------------------------------------------------------------- Megatron side


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Param:
    """Where one TP1 Megatron parameter lives in its global checkpoint tensor."""

    key: str                       # ShardedTensor key (the DCP fqn)
    shape: tuple[int, ...]         # the full parameter
    global_shape: tuple[int, ...]  # includes prepended axes (e.g. [experts, out, in])
    offset: tuple[int, ...]        # of the parameter in the global tensor


@dataclasses.dataclass(kw_only=True, slots=True)
class _Layout:
    """A family's TP1 Megatron model on the meta device: names, checkpoint keys, mapping."""

    family: str
    hf_config: Any                 # the transformers config object
    hf_prefix: str
    ignored_prefixes: tuple[str, ...]
    groups: list                   # models.convert_common.WeightGroup
    params: dict[str, _Param]
    sharded: dict[str, Any]        # Megatron's sharded_state_dict entries (meta data)
    objects: list                  # ShardedObjects (e.g. per-module _extra_state)


@contextlib.contextmanager
def _single_rank_megatron() -> Iterator[None]:
    """Megatron's parallel state at TP1/EP1/PP1 (started here, torn down after, when absent)."""
    from megatron_rl.platform import activate_cpu_compat, destroy_distributed, init_distributed

    activate_cpu_compat()
    from megatron.core import parallel_state

    started = False
    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed()
        started = True
    sizes = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size())
    try:
        if sizes != (1, 1, 1):
            raise ConversionError(f"conversion runs at TP/PP/EP 1/1/1 but this process has "
                                  f"{sizes}: run it in its own process (the tools do)")
        yield
    finally:
        if started:
            destroy_distributed()


def _layout(config: dict[str, Any], *, config_path: Path, text_only: bool = False) -> _Layout:
    """The TP1 layout of `config`'s model (read from `config_path`); `text_only` maps to the
    names a text-only CausalLM has (Megatron -> HF writes those, e.g. for a multimodal Llama-4
    source)."""
    from huggingface_hub.errors import StrictDataclassError
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    from models.convert_common import meta_device

    family, converter = _family_of(config)
    try:
        hf_config = converter.hf_text_config_from_dict(config)
    except (ValueError, TypeError, StrictDataclassError) as err:
        # transformers' strict configs reject wrongly typed fields; one line naming the file.
        raise ConversionError(f"{config_path} is not a valid {family.name} config: "
                              f"{' '.join(str(err).split())}") from None
    with meta_device():
        model = converter.build_model(hf_config, converter.megatron_config(hf_config))
    params, objects = {}, []
    sharded = model.sharded_state_dict(metadata=dict(MODEL_SHARDED_METADATA))
    for name, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            objects.append(entry)
            continue
        if isinstance(entry, ShardedTensorFactory):
            chunks = list(nested_values(entry.build()))
        elif isinstance(entry, ShardedTensor):
            chunks = [entry]
        else:
            raise NotImplementedError(f"{name}: non-sharded model state ({type(entry).__name__}) "
                                      "is not handled by the converter")
        params[name] = _param_of(name, chunks, tuple(model.state_dict()[name].shape))
    prefix = "" if text_only else converter.hf_weight_prefix(config)
    groups = converter.weight_groups(hf_config, prefix=prefix)
    mapped = [n for group in groups for n in group.megatron_names]
    if sorted(mapped) != sorted(params):
        raise AssertionError(f"{family.name} mapping and model disagree: "
                             f"{sorted(set(mapped) ^ set(params))}")
    return _Layout(family=family.name, hf_config=hf_config, hf_prefix=prefix,
                   ignored_prefixes=converter.hf_ignored_prefixes(config), groups=groups,
                   params=params, sharded=sharded, objects=objects)


def _param_of(name: str, chunks: list, shape: tuple[int, ...]) -> _Param:
    keys = {chunk.key for chunk in chunks}
    if len(keys) != 1:
        raise NotImplementedError(f"{name} spans several checkpoint keys {sorted(keys)}")
    # The parameter's corner in the global tensor: the smallest offset of its TP1 chunks
    # (a GLU fc1 is written as two chunks, gate rows then up rows).
    offset = tuple(min(c.global_offset[d] for c in chunks)
                   for d in range(len(chunks[0].global_offset)))
    if sum(c.data.numel() for c in chunks) != torch.Size(shape).numel():
        raise NotImplementedError(f"{name}: TP1 chunks do not tile the parameter")
    return _Param(key=keys.pop(), shape=shape, global_shape=tuple(chunks[0].global_shape),
                  offset=offset)


def _num_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return torch.Size(tuple(shape)).numel() * dtype.itemsize


def _checksum(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=16).hexdigest()


def _progress(total_bytes: int, enabled: bool, description: str):
    """A byte bar in a terminal; in a log, one line per 10 s of conversion (console.progress)."""
    from megatron_rl.console import progress

    return progress(total=total_bytes, unit="B", unit_scale=True, desc=description,
                    disable=not enabled, file=sys.stderr, line_every_s=10.0)


def _prepare_output(output_dir: str | os.PathLike, overwrite: bool) -> Path:
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ConversionError(f"output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise ConversionError(f"output folder {output} is not empty; choose an empty or new "
                                  "folder, or pass --overwrite to replace its contents")
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    return output


def _copy_hf_side_files(source: Path, destination: Path) -> None:
    """config.json, generation config, tokenizer files: everything but the weights."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES \
                and path.name != _SAFETENSORS_INDEX:
            shutil.copy2(path, destination / path.name)


# ----------------------------------------------------------------------------- HF -> Megatron


def _expected_hf_tensors(layout: _Layout) -> dict[str, tuple[int, ...]]:
    """HF names and shapes implied by the config: the mapping run on the meta model."""
    from models.convert_common import iterate_megatron_to_hf

    meta = {name: torch.empty(p.shape, device="meta") for name, p in layout.params.items()}
    return {name: tuple(t.shape) for name, t in iterate_megatron_to_hf(layout.groups, meta.get)}


def _check_hf_weights(source: HFCheckpoint, layout: _Layout) -> tuple[str, ...]:
    """Raises on missing / unexpected / mis-shaped weights; returns the ignored names."""
    expected = _expected_hf_tensors(layout)
    found = set(source.names())
    ignored = tuple(sorted(n for n in found - set(expected)
                           if n.startswith(layout.ignored_prefixes)))
    if layout.hf_config.tie_word_embeddings:
        # Tied checkpoints sometimes still store the head; Megatron's head is the embedding.
        ignored += tuple(n for n in (f"{layout.hf_prefix}lm_head.weight",) if n in found)
    missing = sorted(set(expected) - found)
    unexpected = sorted(found - set(expected) - set(ignored))
    problems = []
    if missing:
        problems.append(f"missing from {source.directory}: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected in {source.directory}: {', '.join(unexpected)}")
    mismatched = [f"{n}: weights {source.shape(n)} vs config {expected[n]}"
                  for n in sorted(set(expected) & found) if source.shape(n) != expected[n]]
    if mismatched:
        problems.append("config.json does not match the weights (wrong config.json, or weights "
                        "of another model size): " + "; ".join(mismatched))
    if problems:
        raise ConversionError(f"{layout.family} weights do not match config.json:\n  "
                              + "\n  ".join(problems))
    return ignored


class _LazyGroups:
    """Megatron tensors of one weight group at a time, read from HF on first request."""

    def __init__(self, layout: _Layout, source: HFCheckpoint, dtype: torch.dtype | None, *,
                 with_checksums: bool):
        self.layout, self.source, self.dtype = layout, source, dtype
        self.with_checksums = with_checksums
        self.group_of = {n: i for i, g in enumerate(layout.groups) for n in g.megatron_names}
        self.current: tuple[int, dict[str, torch.Tensor]] | None = None
        self.checksums: dict[str, str] = {}

    def dtype_of(self, name: str) -> torch.dtype:
        group = self.layout.groups[self.group_of[name]]
        return self.dtype or self.source.dtype(group.hf_names[0])

    def get(self, name: str) -> torch.Tensor:
        index = self.group_of[name]
        if self.current is None or self.current[0] != index:
            self.current = None  # drop the previous group before reading the next
            group = self.layout.groups[index]
            hf = {n: self.source.get(n) for n in group.hf_names}
            tensors = group.to_megatron(hf)
            del hf
            self.current = (index, {n: t.to(self.dtype_of(n)) for n, t in tensors.items()})
        return self.current[1][name]


class _StreamingSavePlanner(DefaultSavePlanner):
    """A torch.distributed.checkpoint SavePlanner over prepared write items whose data is
    produced by `resolve(item)` only when the writer reaches the item."""

    def __init__(self, items: list, resolve: Callable):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items, self.resolve = items, resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def resolve_data(self, write_item):
        return self.resolve(write_item)


def _write_items(layout: _Layout, tensors: _LazyGroups, common: dict) -> tuple[list, Callable]:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items, by_index = [], {}
    for group in layout.groups:  # group order: each group is read from HF once
        for name in group.megatron_names:
            param = layout.params[name]
            prepend = len(param.global_shape) - len(param.shape)
            sizes = torch.Size((1,) * prepend + param.shape)
            index = MetadataIndex(param.key, torch.Size(param.offset))
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(param.offset), sizes=sizes),
                properties=TensorProperties(dtype=tensors.dtype_of(name)),
                size=torch.Size(param.global_shape))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            by_index[(param.key, tuple(param.offset))] = (name, sizes)
    # Megatron stores ShardedObjects (and its common state) as torch.save'd lists of their data.
    objects = {obj.unique_key: [obj.data] for obj in layout.objects}
    objects[ShardedObject("common_state", None, (1,), (0,)).unique_key] = [common]
    for key in objects:
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))

    def resolve(item) -> torch.Tensor | io.BytesIO:
        if item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(objects[item.index.fqn], buffer)
            buffer.seek(0)
            return buffer
        name, sizes = by_index[(item.index.fqn, tuple(item.index.offset))]
        tensor = tensors.get(name).contiguous()
        if tensors.with_checksums:
            tensors.checksums[name] = _checksum(tensor)
        return tensor.view(sizes)

    return items, resolve


def converted_once(hf_dir: str | os.PathLike, target: str | os.PathLike, *,
                   progress: bool = True) -> str:
    """`hf_dir` converted into `target` unless a finished conversion is there already (a run's
    start checkpoint: converted once per run directory); returns `target`, absolute."""
    target = Path(target)
    if not (target / "metadata.json").is_file():
        convert_hf_to_megatron(hf_dir, target, overwrite=True, progress=progress)
    return str(target.resolve())


def convert_hf_to_megatron(hf_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                           dtype: torch.dtype | None = None, validate: bool = False,
                           overwrite: bool = False, progress: bool = True) -> ConversionReport:
    """HF folder -> a global Megatron torch_dist checkpoint loadable at any TP/EP/PP.

    `dtype` None keeps each tensor's stored dtype. `validate` reloads every parameter through
    Megatron's loader and compares checksums with what was written.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    start = time.perf_counter()
    source = HFCheckpoint(hf_dir)
    with _single_rank_megatron():
        layout = _layout(source.config, config_path=source.directory / "config.json")
        skipped = _check_hf_weights(source, layout)
        output = _prepare_output(output_dir, overwrite)
        tensors = _LazyGroups(layout, source, dtype, with_checksums=validate)
        common = {COMMON_KEY: {"family": layout.family, "format_version": 1,
                               "hf_config": json.dumps(source.config),
                               "dtype": str(dtype) if dtype else "as stored"}}
        items, resolve = _write_items(layout, tensors, common)
        total = sum(_num_bytes(p.shape, tensors.dtype_of(n)) for n, p in layout.params.items())
        with _progress(total, progress, "hf -> megatron") as bar:
            def resolve_and_count(item):
                data = resolve(item)
                if isinstance(data, torch.Tensor):
                    bar.update(data.numel() * data.element_size())
                return data

            writer = dcp.FileSystemWriter(str(output), single_file_per_rank=False,
                                          sync_files=False)
            dcp.save({}, storage_writer=writer, no_dist=True,
                     planner=_StreamingSavePlanner(items, resolve_and_count))
        tensors.current = None
        save_config(CheckpointingConfig("torch_dist", 1), str(output))
        _copy_hf_side_files(source.directory, output / HF_FILES_DIR)
        if validate:
            _validate_megatron(output, layout, tensors.checksums)
    return ConversionReport(output_dir=str(output), family=layout.family,
                            num_tensors=len(layout.params), num_bytes=total,
                            seconds=time.perf_counter() - start, validated=validate,
                            skipped_hf_tensors=skipped)


def _validate_megatron(directory: Path, layout: _Layout, checksums: dict[str, str]) -> None:
    dtypes = _checkpoint_dtypes(directory, layout)
    bad = []
    for batch in _batches(layout, _load_units(layout), dtypes):
        for name, tensor in _load_megatron(directory, layout, batch, dtypes).items():
            if _checksum(tensor) != checksums[name]:
                bad.append(name)
    if bad:
        raise ConversionError(f"validation failed: {len(bad)} tensors read back from {directory} "
                              f"differ from what was written: {', '.join(bad[:20])}")


# ----------------------------------------------------------------------------- Megatron -> HF


def _checkpoint_dtypes(directory: Path, layout: _Layout) -> dict[str, torch.dtype]:
    """dtype of every TP1 parameter in the checkpoint; missing keys and wrong shapes raise."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    missing = sorted({p.key for p in layout.params.values()} - set(stored))
    if missing:
        raise ConversionError(f"{directory} lacks {len(missing)} model tensors the "
                              f"{layout.family} config implies: {', '.join(missing)}")
    mismatched = [f"{p.key}: checkpoint {tuple(stored[p.key].global_shape)} vs config "
                  f"{p.global_shape}" for p in layout.params.values()
                  if tuple(stored[p.key].global_shape) != p.global_shape]
    if mismatched:
        raise ConversionError("the HF config does not match the checkpoint's tensors: "
                              + "; ".join(sorted(set(mismatched))))
    return {name: stored[p.key].dtype for name, p in layout.params.items()}


def _load_units(layout: _Layout) -> list[list[str]]:
    """Megatron names in group order, cut into units that hold every parameter of each
    checkpoint key they touch: Megatron's loader needs all chunks of a prepended-axis key
    (e.g. all experts of a layer) in one request when it runs on a single rank."""
    units: list[list[str]] = []
    open_keys: set[str] = set()
    remaining = {}
    for param in layout.params.values():
        remaining[param.key] = remaining.get(param.key, 0) + 1
    for group in layout.groups:
        if not open_keys:
            units.append([])
        for name in group.megatron_names:
            key = layout.params[name].key
            units[-1].append(name)
            remaining[key] -= 1
            if remaining[key]:
                open_keys.add(key)
            else:
                open_keys.discard(key)
    return units


def _batches(layout: _Layout, units: list[list[str]],
             dtypes: dict[str, torch.dtype]) -> Iterator[list[str]]:
    """Consecutive units merged up to the size of the largest unit: one Megatron load call per
    batch (each call has a fixed cost), memory bounded by about one large unit."""
    sizes = [sum(_num_bytes(layout.params[n].shape, dtypes[n]) for n in u) for u in units]
    budget = max(sizes, default=0)
    batch, batch_bytes = [], 0
    for unit, size in zip(units, sizes):
        if batch and batch_bytes + size > budget:
            yield batch
            batch, batch_bytes = [], 0
        batch += unit
        batch_bytes += size
    if batch:
        yield batch


def _load_megatron(directory: Path, layout: _Layout, names: list[str],
                   dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Full TP1 parameters `names`, through Megatron's loader (any saved TP/EP/PP layout)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request = {}
    for name in names:
        entry = layout.sharded[name]
        data = torch.empty(layout.params[name].shape, dtype=dtypes[name])
        if isinstance(entry, ShardedTensor):
            request[name] = dataclasses.replace(entry, data=data, dtype=data.dtype)
        else:
            request[name] = dataclasses.replace(entry, data=data)
    # A partial request by design: Megatron's check that every shard is read must be off.
    loaded = dist_checkpointing.load(request, str(directory), validate_access_integrity=False)
    return {name: loaded[name] for name in names}  # without the merged-in common state


class _SafetensorsShardWriter:
    """Writes planned safetensors files: header first (shapes known in advance), then each
    tensor's bytes as it arrives, so no shard is ever held in memory. safetensors' own API only
    serialises a complete dict; the file format (8-byte header length, JSON header, raw bytes)
    is written here by hand and read back with safetensors in the tests and by --validate."""

    def __init__(self, output: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int):
        self.output = output
        self.shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        shard_bytes = 0
        for entry in plan:
            size = _num_bytes(entry[2], entry[1])
            if self.shards[-1] and shard_bytes + size > max_shard_bytes:
                self.shards.append([])
                shard_bytes = 0
            self.shards[-1].append(entry)
            shard_bytes += size
        count = len(self.shards)
        self.file_names = (["model.safetensors"] if count == 1 else
                           [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self.file_of = {name: i for i, shard in enumerate(self.shards) for name, _, _ in shard}
        self.position = {name: j for shard in self.shards for j, (name, _, _) in enumerate(shard)}
        self.handle, self.shard_index, self.next_entry = None, -1, 0

    def _open(self, index: int) -> None:
        if self.handle is not None:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in self.shards[index]:
            size = _num_bytes(shape, dtype)
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # 8-byte aligned data, as safetensors writes
        self.handle = open(self.output / self.file_names[index], "wb")
        self.handle.write(struct.pack("<Q", len(encoded)) + encoded)
        self.shard_index, self.next_entry = index, 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index = self.file_of[name]
        if index != self.shard_index:
            if index != self.shard_index + 1 or (self.shard_index >= 0 and self.next_entry
                                                 != len(self.shards[self.shard_index])):
                raise AssertionError("tensors must arrive in plan order")
            self._open(index)
        expected_name, dtype, shape = self.shards[index][self.next_entry]
        if (expected_name, dtype, tuple(shape)) != (name, tensor.dtype, tuple(tensor.shape)):
            raise AssertionError(f"expected {expected_name} {dtype} {shape}, got {name} "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
        self.handle.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.next_entry += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if len(self.shards) > 1:
            total = sum(_num_bytes(s, d) for shard in self.shards for _, d, s in shard)
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: self.file_names[i] for n, i in self.file_of.items()}}
            (self.output / _SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _hf_files_for(checkpoint: Path, hf_config_dir: str | os.PathLike | None) -> Path:
    if hf_config_dir is not None:
        directory = Path(hf_config_dir)
    else:
        directory = checkpoint / HF_FILES_DIR
        if not directory.is_dir():
            raise ConversionError(
                f"{checkpoint} has no {HF_FILES_DIR}/ folder (it was not written by "
                "hf-to-megatron): pass --hf-config DIR, a folder with the model's config.json "
                "and tokenizer files")
    if not (directory / "config.json").is_file():
        raise ConversionError(f"{directory} has no config.json")
    return directory


def convert_megatron_to_hf(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                           hf_config_dir: str | os.PathLike | None = None,
                           dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                           validate: bool = False, overwrite: bool = False,
                           progress: bool = True) -> ConversionReport:
    """A Megatron checkpoint (converted, or saved by the trainer at any layout) -> HF folder.

    Config and tokenizer files come from `hf_config_dir`, default the checkpoint's `hf/` folder.
    `dtype` None keeps the checkpoint's dtypes. `validate` re-reads every written tensor with
    safetensors and compares checksums.
    """
    from models.convert_common import iterate_megatron_to_hf

    start = time.perf_counter()
    checkpoint = Path(checkpoint_dir)
    if not (checkpoint / "metadata.json").is_file():
        raise ConversionError(f"{checkpoint} is not a Megatron dist_checkpointing folder (no "
                              "metadata.json)")
    hf_files = _hf_files_for(checkpoint, hf_config_dir)
    config = _read_json(hf_files / "config.json")
    with _single_rank_megatron():
        layout = _layout(config, config_path=hf_files / "config.json", text_only=True)
        dtypes = _checkpoint_dtypes(checkpoint, layout)
        meta = {n: torch.empty(p.shape, dtype=dtypes[n], device="meta")
                for n, p in layout.params.items()}
        plan = [(n, dtype or t.dtype, tuple(t.shape))
                for n, t in iterate_megatron_to_hf(layout.groups, meta.get)]
        output = _prepare_output(output_dir, overwrite)
        writer = _SafetensorsShardWriter(output, plan, max_shard_bytes)
        total = sum(_num_bytes(shape, d) for _, d, shape in plan)
        checksums = {}
        with _progress(total, progress, "megatron -> hf") as bar:
            group_index = 0
            for batch in _batches(layout, _load_units(layout), dtypes):
                loaded = _load_megatron(checkpoint, layout, batch, dtypes)
                while group_index < len(layout.groups) and \
                        layout.groups[group_index].megatron_names[0] in loaded:
                    group = layout.groups[group_index]
                    hf = group.to_hf({n: loaded.pop(n) for n in group.megatron_names})
                    for name, tensor in hf.items():
                        tensor = tensor.to(dtype or tensor.dtype).contiguous()
                        if validate:
                            checksums[name] = _checksum(tensor)
                        writer.write(name, tensor)
                        bar.update(tensor.numel() * tensor.element_size())
                    group_index += 1
                del loaded
        writer.close()
        _copy_hf_side_files(hf_files, output)
        out_config = _family_of(config)[1].text_only_hf_config(config)
        out_dtype = str(dtype or next(iter(dtypes.values()))).removeprefix("torch.")
        out_config["dtype"] = out_dtype
        if "torch_dtype" in out_config:
            out_config["torch_dtype"] = out_dtype
        (output / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
        if validate:
            _validate_hf(output, checksums)
    return ConversionReport(output_dir=str(output), family=layout.family, num_tensors=len(plan),
                            num_bytes=total, seconds=time.perf_counter() - start,
                            validated=validate)


def _validate_hf(output: Path, checksums: dict[str, str]) -> None:
    written = HFCheckpoint(output)
    missing = sorted(set(checksums) - set(written.names()))
    bad = [n for n in checksums if n not in missing and _checksum(written.get(n)) != checksums[n]]
    if missing or bad:
        raise ConversionError(f"validation failed for {output}: missing {missing}, "
                              f"differing {bad[:20]}")


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl convert",
        description="Convert checkpoints between Hugging Face folders and Megatron "
                    "dist_checkpointing (streamed; the Megatron side loads at any TP/EP/PP).")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="HF folder -> Megatron torch_dist checkpoint")
    to_mg.add_argument("hf_dir", help="folder with config.json, *.safetensors, tokenizer files")
    to_mg.add_argument("output_dir")
    to_hf = sub.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF safetensors folder")
    to_hf.add_argument("checkpoint_dir")
    to_hf.add_argument("output_dir")
    to_hf.add_argument("--hf-config", dest="hf_config_dir", default=None,
                       help="folder with config.json + tokenizer (default: CHECKPOINT/hf)")
    to_hf.add_argument("--max-shard-size-gb", type=float, default=5.0)
    for command in (to_mg, to_hf):
        command.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                             help="output dtype (default: keep the stored dtypes)")
        command.add_argument("--validate", action="store_true",
                             help="re-read everything written and compare checksums")
        command.add_argument("--overwrite", action="store_true",
                             help="replace the contents of a non-empty output folder")
        command.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.direction == "hf-to-megatron":
            report = convert_hf_to_megatron(args.hf_dir, args.output_dir, dtype=dtype,
                                            validate=args.validate, overwrite=args.overwrite,
                                            progress=not args.no_progress)
        else:
            report = convert_megatron_to_hf(
                args.checkpoint_dir, args.output_dir, hf_config_dir=args.hf_config_dir,
                dtype=dtype, max_shard_bytes=int(args.max_shard_size_gb * 2**30),
                validate=args.validate, overwrite=args.overwrite, progress=not args.no_progress)
    except ConversionError as err:
        print(f"megatron-rl convert: error: {err}", file=sys.stderr)
        return 2
    print(f"{report.family}: {report.num_tensors} tensors, {report.num_bytes / 1e9:.3f} GB in "
          f"{report.seconds:.1f} s ({report.gb_per_s:.2f} GB/s) -> {report.output_dir}"
          + (" (validated)" if report.validated else ""))
    if report.skipped_hf_tensors:
        print(f"skipped {len(report.skipped_hf_tensors)} non-text tensors (e.g. "
              f"{report.skipped_hf_tensors[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
