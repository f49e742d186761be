"""What our entry points (the `megatron-rl` CLI, the demo, tools/) print before their own output.

Importing torch, megatron-core and transformers on a CPU machine (or a GPU one without Apex)
prints about thirty lines of warnings that are expected and harmless here, burying the first line
of progress. `quiet_known_warnings()` silences exactly those: each is matched by its category (or
logger) AND the literal start of its message, with the reason it is harmless written next to it,
so our own warnings and every unknown third-party one still show. `environment_summary()` says in one line
what those warnings were telling (which backends are absent). Verbose mode (`-v` on the entry
points, or MEGATRON_RL_VERBOSE=1) keeps everything. Library code never calls this: it changes
process-wide warning filters, which belong to the program. `report_console()` and
`print_table()` print rich tables whole when the output is a log file rather than a terminal, and
`progress()` is tqdm's bar in a terminal but plain lines in a log (a Slurm or Ray job's output,
`make demo > log`), where a bar's carriage returns would pile every update onto one line.

Call it before the first `import torch`: torch warns at import time.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable
from numbers import Number
from typing import IO, Any

VERBOSE_ENV = "MEGATRON_RL_VERBOSE"


@dataclasses.dataclass(frozen=True, slots=True)
class KnownWarning:
    """A third-party warning known to be harmless: `warnings.warn(category)` when `logger` is
    None, else a WARNING record of that logger; its message starts with `prefix`, a literal
    long enough to name that one warning."""

    prefix: str
    why: str
    category: type[Warning] = UserWarning
    logger: str | None = None


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        "The pynvml package is deprecated. Please install nvidia-ml-py instead.",
        "torch probes pynvml at import; nvidia-ml-py is installed too (SGLang's list) and the "
        "GPU path uses it", category=FutureWarning),
    KnownWarning(
        "Transformer Engine and Apex are not installed. Falling back to ",
        "CPU machines have neither (CPU_STACK.md); the torch fallbacks are what the CPU path "
        "uses, and the GPU image (Dockerfile) has both"),
    KnownWarning(
        "Apex is not installed. Falling back to Torch Norm",
        "the local layer spec uses torch norms on CPU by design (platform/)"),
    KnownWarning(
        "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
        "megatron-core 0.19.2's own default (cuda_graph_modules='full') triggers it; CUDA graphs "
        "are off (cuda_graph_impl='none')"),
    KnownWarning(
        "MimoModelConfig is experimental and still under active development.",
        "emitted when megatron-core's model package is imported; we do not use MIMO models"),
    KnownWarning(
        "`torch.distributed.reduce_scatter_tensor` is deprecated.",
        "megatron-core 0.19.2's distributed optimizer calls it; torch 2.13 still supports it",
        category=FutureWarning),
    KnownWarning(
        "`torch.distributed.all_gather_into_tensor` is deprecated.",
        "megatron-core 0.19.2's distributed optimizer calls it; torch 2.13 still supports it",
        category=FutureWarning),
    KnownWarning(
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
        "",
        "megatron-core saves / loads a checkpoint's common (non-sharded) state without a process "
        "group (and the HF converter runs as one process); the sharded tensors go collectively"),
    KnownWarning(
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.",
        "megatron-core 0.19.2's distributed optimizer zero_grad reads .grad of its fp32 shard "
        "params, which for fp32 models are views of the model params (non-leaf); it only tests "
        "for None, and the gradients live in main_grad"),
    KnownWarning(
        "TypedStorage is deprecated. It will be removed in the future",
        "megatron-core 0.19.2's offload_grad_buffers / restore_grad_buffers (colocated runs "
        "free the trainer's gradient buffers between steps) resize them through "
        "tensor.storage(); torch 2.13 still supports it"),
    KnownWarning(
        "The argument order of load has been changed.",
        "megatron-core 0.19.2 calls torch.distributed.checkpoint.load with keywords"),
    KnownWarning(
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        "megatron-core 0.19.2's torch_dist checkpoint format is built on ShardedTensor",
        category=FutureWarning),
    KnownWarning(
        "MCore's async save is deprecated",
        "megatron-core's checkpoint writer names its own internal path; saves here are "
        "synchronous", logger="megatron.core.dist_checkpointing.strategies.torch"),
    KnownWarning(
        "GPTModel IS DEPRECATED.",
        "megatron-core 0.19.2 steers new code to HybridModel; GPTModel is the supported model of "
        "this version's RL and checkpoint paths", logger="megatron.core.models.gpt.gpt_model"),
    KnownWarning(
        "DistributedDataParallel: full_param_layout not provided with "
        "use_distributed_optimizer=True.",
        "megatron-core computes the layout itself (its backward-compatible path)",
        logger="megatron.core.distributed.distributed_data_parallel"),
    KnownWarning(
        "`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor, got "
        "high_freq_factor=1.0 and low_freq_factor=1.0",
        "Llama-4's released configs set both factors to 1.0 (transformers' llama3 RoPE handles "
        "it: no medium-frequency band); our llama4 family copies them",
        logger="transformers.modeling_rope_utils"),
    KnownWarning(
        "Token authentication is enabled for this Ray cluster.",
        "Ray 2.60 announces that the local cluster it starts requires its auth token (the safe "
        "default, kept; the cluster also listens on loopback only: cluster/runtime.py)",
        logger="ray._private.authentication.authentication_token_setup"),
)


class _KnownRecords(logging.Filter):
    def __init__(self, prefixes: list[str]):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING or \
            not record.getMessage().startswith(self.prefixes)


def verbose_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(verbose?, argv without -v / --verbose); MEGATRON_RL_VERBOSE=1 also asks for it."""
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    return len(rest) != len(argv) or os.environ.get(VERBOSE_ENV, "") not in ("", "0"), rest


def quiet_known_warnings(*, verbose: bool = False) -> None:
    """Silence KNOWN_WARNINGS in this process and in the Python processes it starts (through
    PYTHONWARNINGS: dist_checkpointing and SGLang spawn interpreters that import torch again);
    nothing when `verbose`. Idempotent."""
    if verbose:
        return
    by_logger: dict[str, list[str]] = {}
    child_filters = []
    for known in KNOWN_WARNINGS:
        if known.logger is None:
            warnings.filterwarnings("ignore", message=re.escape(known.prefix),
                                    category=known.category)
            # PYTHONWARNINGS splits on "," and ":": a child gets the literal text before them.
            child_prefix = re.split(r"[,:]", known.prefix)[0]
            child_filters.append(f"ignore:{child_prefix}:{known.category.__name__}")
        else:
            by_logger.setdefault(known.logger, []).append(known.prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownRecords) for f in logger.filters):
            logger.addFilter(_KnownRecords(prefixes))
    inherited = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    os.environ["PYTHONWARNINGS"] = ",".join(
        dict.fromkeys(inherited + child_filters))  # deduplicated, the user's first


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_summary() -> str:
    """One line: the device, the key library versions and which GPU-only backends are absent
    (what the silenced warnings were saying). Imports torch."""
    import torch

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU ({torch.get_num_threads()} threads)"
    parts = [f"torch {torch.__version__.split('+')[0]}"]
    for package, label in (("megatron-core", "megatron-core"), ("sglang", "sglang"),
                           ("transformers", "transformers"), ("ray", "ray")):
        version = _version(package)
        if version:
            parts.append(f"{label} {version}")
    absent = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                        ("Apex", "apex"))
              if importlib.util.find_spec(module) is None]
    line = f"megatron_rl on {device}: {', '.join(parts)}"
    if absent:
        line += f"; {' and '.join(absent)} absent (local layer spec, torch optimizers)"
    return line


def notice(message: str, *, program: str = "megatron-rl train") -> None:
    """A line for the operator on stderr that leaves a tqdm progress bar intact."""
    from tqdm import tqdm

    tqdm.write(f"{program}: {message}", file=sys.stderr)


def report_console():
    """A rich Console for the tables and lines of our reports (`megatron-rl fit`, the demo). In a
    terminal, rich's own. Anywhere else (a pipe, a log file) nothing is wrapped or cut at a
    width nobody sees: text keeps its lines (soft wrap) and `print_table` prints a table at
    its full width."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(soft_wrap=True)


def print_table(console, table) -> None:
    """Print a rich Table: in a terminal fitted to its width (rich shrinks the columns), anywhere
    else at the table's natural width, every column and border whole."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    unbounded = console.options.update_width(1_000_000)
    width, console.width = console.width, Measurement.get(console, unbounded, table).maximum
    try:
        console.print(table)
    finally:
        console.width = width


# ------------------------------------------------------------------------------ progress

# One log line: the fields of tqdm's bar (description, count, elapsed < remaining, rate, postfix)
# without the bar itself.
LINE_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, " \
    "{rate_fmt}{postfix}]"
LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def is_terminal(stream: IO[str]) -> bool:
    """Whether `stream` is an interactive terminal (where a progress bar may redraw itself)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None,
             unit: str = "it", unit_scale: bool = False, file: IO[str] | None = None,
             disable: bool = False, line_every_s: float | None = None):
    """A progress bar over `iterable` (or driven by `update(n)`) for our entry points, on `file`
    (default stderr). In a terminal, tqdm's bar. Anywhere else, a `LineProgress`: one plain line
    per update with the bar's fields and postfix, or with `line_every_s` at most one line per
    that many seconds (for fine-grained work such as bytes converted). Both take tqdm's calls:
    iteration, update, set_postfix, refresh, close, and the `n` attribute."""
    file = sys.stderr if file is None else file
    if disable or is_terminal(file):
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale,
                    file=file, disable=disable)
    return LineProgress(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale,
                        file=file, line_every_s=line_every_s)


class LineProgress:
    """tqdm's interface as our call sites use it, for output that is not a terminal: no carriage
    returns and no redrawing, each line complete (the fields formatted by tqdm.format_meter).
    A line is written when the count advances (at most once per `line_every_s` when given), on
    `refresh()`, and on `close()` if the last advance was not written yet. `set_postfix` only
    records its fields: they appear on the next line, as a bar shows them at its next redraw."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str,
                 total: float | None = None, unit: str = "it", unit_scale: bool = False,
                 file: IO[str] | None = None, line_every_s: float | None = None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.desc, self.total = iterable, desc, total
        self.unit, self.unit_scale, self.line_every_s = unit, unit_scale, line_every_s
        self.file = sys.stderr if file is None else file
        self.n = 0
        self.postfix = ""
        self._start = self._last_line_t = time.monotonic()
        self._last_line_n: float | None = None
        self._closed = False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if n and (self.line_every_s is None
                  or time.monotonic() - self._last_line_t >= self.line_every_s):
            self._line()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        """The same text as tqdm's postfix: keyword fields sorted, numbers through
        tqdm.format_num. Written with the next line, not now (`refresh` is accepted for
        tqdm's signature)."""
        from tqdm import tqdm

        fields = dict(ordered_dict or {}) | {key: kwargs[key] for key in sorted(kwargs)}
        self.postfix = ", ".join(
            f"{key}={tqdm.format_num(value) if isinstance(value, Number) else str(value).strip()}"
            for key, value in fields.items())

    def refresh(self) -> None:
        self._line()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._last_line_n != self.n:
                self._line()

    def format_line(self) -> str:
        from tqdm import tqdm

        return tqdm.format_meter(
            self.n, self.total, time.monotonic() - self._start, prefix=self.desc,
            unit=self.unit, unit_scale=self.unit_scale, postfix=self.postfix or None,
            bar_format=LINE_FORMAT if self.total else LINE_FORMAT_NO_TOTAL)

    def _line(self) -> None:
        self.file.write(self.format_line() + "\n")
        self.file.flush()
        self._last_line_t, self._last_line_n = time.monotonic(), self.n
