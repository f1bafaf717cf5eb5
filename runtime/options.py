"""`EngineOptions`: every option of `open_model`, with its default, valid values and help, declared once.

The commands that open a model (`colibri run`, `serve`, `smoke`, `imatrix`, `plan`'s
`--kv-quant`) build their engine flags from these fields (`add_engine_flags`): the flag of
field `kv_quant` is `--kv-quant`, its choices and help are the field's; `engine_options` turns
the parsed flags back into one EngineOptions, which goes to `open_model` whole.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from colibri.runtime.expert_store import DEFAULT_IO, IO_MODES, POLICIES
from colibri.runtime.kv_cache import KV_KINDS
from colibri.runtime.memory import parse_size, size_argument

MOST_PARALLEL = 32  # KV slots the fitted default gives at most
AUTO_THREADS = "auto"  # --threads auto: runtime.thread_tuner chooses


class OptionError(ValueError):
    """An option outside its valid values; the message names its flag."""


def _option(default, help: str, *, choices: tuple | None = None, kind: str = "int", metavar: str | None = None):
    """A field of EngineOptions: its default, and for its flag the help, choices and value kind
    ("int", "size" (bytes, e.g. 24G), "choice", "switch" (on / off), "threads" (a count or auto))."""
    return field(default=default, metadata={"help": help, "choices": choices, "kind": kind, "metavar": metavar})


@dataclass(frozen=True)
class EngineOptions:
    """How `open_model` runs a model (the defaults are what a plain `open_model(path)` gets)."""

    threads: int | str | None = _option(AUTO_THREADS, "compute threads, or auto: as many as decode fastest now, "
                                                      "found by timing a few steps at each count every few hundred "
                                                      "(fewer when another process takes a core; default: auto)",
                                        kind="threads", metavar="N|auto")
    ctx: int = _option(4096, "context length in tokens, per KV slot; the KV cache is preallocated for it "
                             "(default: %(default)s)")
    ram_budget: int | None = _option(None, "RAM the runtime may use for weights, KV cache, expert cache and scratch, "
                                           "e.g. 24G (default: 80%% of RAM)", kind="size", metavar="SIZE")
    expert_cache: int | None = _option(None, "bytes of hot experts kept in RAM, e.g. 4G (default: what the budget "
                                             "leaves)", kind="size", metavar="SIZE")
    kv_quant: str = _option("f16", "KV cache storage (default: %(default)s)", choices=KV_KINDS, kind="choice")
    cache_policy: str = _option("lru", "expert cache eviction: least recently used, or frequency with ageing "
                                       "(default: %(default)s)", choices=tuple(POLICIES), kind="choice")
    prefetch: bool = _option(False, "read the experts the next layer's router picks for the current hidden state "
                                    "while this layer computes; pays when its accuracy (printed) is high and the disk "
                                    "is not the bottleneck (default: off)", kind="switch")
    io: str = _option(DEFAULT_IO, "how experts are read: " + "; ".join(f"{mode} = {text}" for mode, text in IO_MODES.items())
                      + " (default: %(default)s; `colibri plan` says which suits this machine)", choices=tuple(IO_MODES),
                      kind="choice")
    parallel: int | None = _option(None, "sequences decoded together, each in a KV slot of --ctx positions; each step "
                                         "reads an expert once for all of them (default: as many slots as a quarter of "
                                         f"the RAM left after the resident weights holds, at most {MOST_PARALLEL} and "
                                         "the number of sequences the job has)", metavar="N")

    def __post_init__(self):
        if self.threads is not None and self.threads != AUTO_THREADS and not (isinstance(self.threads, int) and self.threads >= 1):
            raise OptionError(f"--threads must be at least 1 or auto, got {self.threads}")
        if self.parallel is not None and self.parallel < 1:
            raise OptionError(f"--parallel must be at least 1, got {self.parallel}")
        if self.ctx < 1:
            raise OptionError(f"--ctx must be at least 1, got {self.ctx}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise OptionError(f"--{flag_name(f.name)} {value!r} unknown (known: {', '.join(f.metadata['choices'])})")
            if f.metadata["kind"] == "size" and isinstance(value, str):
                object.__setattr__(self, f.name, parse_size(value))  # "24G" as bytes

    def replace(self, **changes) -> EngineOptions:
        return dataclasses.replace(self, **changes)


def option_names(*without: str) -> tuple[str, ...]:
    """The names of EngineOptions' fields but `without`, for a command that sets those itself."""
    return tuple(f.name for f in dataclasses.fields(EngineOptions) if f.name not in without)


def flag_name(name: str) -> str:
    """The command-line flag of an option, without its dashes: kv_quant -> kv-quant."""
    return name.replace("_", "-")


SWITCH = {"on": True, "off": False}


def _switch(text: str) -> bool:
    if text not in SWITCH:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from on, off)")
    return SWITCH[text]


def _threads(text: str) -> int | str:
    return AUTO_THREADS if text == AUTO_THREADS else int(text)


VALUE_TYPES = {"int": int, "size": size_argument, "choice": str, "switch": _switch, "threads": _threads}


def add_engine_flags(p: argparse.ArgumentParser, names: tuple[str, ...] | None = None, **defaults) -> None:
    """Add the flags of the EngineOptions fields `names` (default: all) to `p`; `defaults`
    replace a field's default for this command (its help says so through %(default)s)."""
    for f in dataclasses.fields(EngineOptions):
        if names is not None and f.name not in names:
            continue
        meta, default = f.metadata, defaults.get(f.name, f.default)
        p.add_argument(f"--{flag_name(f.name)}", dest=f.name, default=default, type=VALUE_TYPES[meta["kind"]],
                       choices=meta["choices"], metavar="{on,off}" if meta["kind"] == "switch" else meta["metavar"],
                       help=meta["help"])


def engine_options(args: argparse.Namespace, command: str, **fixed) -> EngineOptions:
    """The EngineOptions the parsed flags give (a field without a flag keeps its default;
    `fixed` sets fields the command decides); a value out of range exits with one line."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions) if hasattr(args, f.name)}
    try:
        return EngineOptions(**{**values, **fixed})
    except OptionError as e:
        raise SystemExit(f"colibri {command}: error: {e}") from None
