"""Engine flags for every subcommand: derived from EngineArgs' fields, so every knob is a flag
with the same name (`max_num_seqs` -> `--max-num-seqs`) and the same validation. Both
`quire generate` (cli.py) and `quire serve` (serve.py) use this module; neither imports the
other's."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from quire.config import EngineArgs


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        extra = {"help": f.metadata.get("help", ""), "default": f.default}
        if "choices" in f.metadata:
            extra["choices"] = f.metadata["choices"]
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **extra)
        else:
            group.add_argument(flag, type=byte_size if "memory" in f.name and base is int
                               else base, **extra)


def model_help() -> str:
    return EngineArgs.__dataclass_fields__["model"].metadata["help"]


def engine_args_from(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if hasattr(ns, f.name)}
    values["model"] = model
    return EngineArgs(**values)


def byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G (powers of 1024) suffix: 512M, 4G."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 4G or 512M)") from None
