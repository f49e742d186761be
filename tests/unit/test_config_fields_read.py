"""Every RunConfig field is read by some code path: a user who sets a field gets its effect (or an
error), never silence.

A static check over the package and the tools (config.py itself excluded: validating a field is
not using it). Only code on the main path counts: `megatron-rl train | fit | ...` and the tools/
command-line scripts. An example reading a field does not make the main path honour it (the demo
driver read eval.warmup_compute_gpu_hours while `megatron-rl fit` ignored it, issue 29.6), and the
model families get their settings from the trainer, not from RunConfig. A field `section.name`
counts as read where code accesses `.name` on something named after its section
(`cfg.rollout.name`, `rollout.name`, or a local alias assigned from `<x>.rollout`), or through a
derived property of config.py that reads it and is itself read elsewhere (`cfg.checkpoint_dir`
reads `checkpoint.dir`). Top-level fields count when read from `cfg` or `run`.
"""
import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_rl.config import RunConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILE = ROOT / "megatron_rl" / "config.py"
SOURCE_DIRS = ("megatron_rl", "tools")
TOP_LEVEL_NAMES = {"cfg", "run"}

# Fields no code reads yet, each with the issue that wires it in. Empty since the Pipeline-RL
# loop landed (megatron_rl/train.py); keep it empty.
WIRED_IN_BY_THE_PIPELINE_RL_LOOP: set[str] = set()


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(hints[f.name])}


def _base_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _aliases(tree: ast.AST, sections: dict[str, type]) -> dict[str, set[str]]:
    """Section -> names that refer to it in this file (`optim = run.optimizer`)."""
    aliases = {name: {name} for name in sections}
    aliases[""] = set(TOP_LEVEL_NAMES)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        pairs = [(t, node.value) for t in node.targets]
        if isinstance(node.value, ast.Tuple):
            pairs = [(t, v) for target in node.targets if isinstance(target, ast.Tuple)
                     for t, v in zip(target.elts, node.value.elts)]
        for target, value in pairs:
            if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) \
                    and value.attr in sections:
                aliases[value.attr].add(target.id)
    return aliases


def _reads(files: list[Path] | None = None) -> set[tuple[str, str]]:
    """(section, attribute) pairs read outside config.py; section "" is the top level."""
    sections = _sections()
    reads = set()
    if files is None:
        files = [path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py")
                 if path != CONFIG_FILE]
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _aliases(tree, sections)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                base = _base_name(node.value)
                reads.update((section, node.attr) for section, names in aliases.items()
                             if base in names)
    # Derived properties of config.py pass their reads on when they are read themselves.
    classes = {cls.__name__: name for name, cls in sections.items()} | {"RunConfig": ""}
    for node in ast.parse(CONFIG_FILE.read_text()).body:
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        section = classes[node.name]
        for item in node.body:
            is_property = isinstance(item, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
            if not is_property or (section, item.name) not in reads:
                continue
            for inner in ast.walk(item):
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) \
                        and inner.value.id == "self":
                    reads.add((section, inner.attr))
                elif isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Attribute) \
                        and _base_name(inner.value.value) == "self":
                    reads.add((inner.value.attr, inner.attr))
    return reads


def _all_fields() -> list[str]:
    names = [f.name for f in dataclasses.fields(RunConfig)
             if not dataclasses.is_dataclass(typing.get_type_hints(RunConfig)[f.name])]
    for section, cls in _sections().items():
        names += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return names


def test_every_config_field_is_read():
    reads = _reads()
    unread = [name for name in _all_fields()
              if tuple(name.rpartition(".")[::2]) not in reads
              and name not in WIRED_IN_BY_THE_PIPELINE_RL_LOOP]
    assert not unread, (
        f"RunConfig fields that no code reads: {unread}. A user who sets them gets nothing: "
        "read them where they take effect, or refuse them with a ConfigError")


def test_the_allow_list_names_only_unread_fields():
    """A field the loop has wired in must leave the list (so the list empties as it lands)."""
    reads = _reads()
    assert WIRED_IN_BY_THE_PIPELINE_RL_LOOP <= set(_all_fields())
    stale = [name for name in WIRED_IN_BY_THE_PIPELINE_RL_LOOP
             if tuple(name.rpartition(".")[::2]) in reads]
    assert not stale, f"now read by code: remove {stale} from the allow-list"


def test_examples_do_not_count_as_readers():
    """The demo driver reads eval.warmup_compute_gpu_hours, which once hid that `megatron-rl
    fit` did not (issue 29.6): examples and model families are not readers."""
    demo = ROOT / "examples" / "demo" / "run.py"
    assert ("eval", "warmup_compute_gpu_hours") in _reads([demo])
    assert not {"examples", "models"} & set(SOURCE_DIRS)


def test_the_check_tells_a_read_from_a_namesake(tmp_path):
    """The check can fail: only reads through the section (or its alias) count."""
    source = tmp_path / "driver.py"
    source.write_text("def f(cfg, other):\n"
                      "    optim = cfg.optimizer\n"
                      "    return cfg.train.lr, optim.adam_eps, other.weight_decay\n")
    reads = _reads([source])
    assert ("train", "lr") in reads and ("optimizer", "adam_eps") in reads
    assert ("optimizer", "weight_decay") not in reads
    assert ("checkpoint", "dir") in _reads()  # through the checkpoint_dir property
