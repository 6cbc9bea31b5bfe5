"""Engine flags for every subcommand: derived from EngineArgs' fields, so every knob is a flag
with the same name (`max_num_seqs` -> `--max-num-seqs`) and the same validation. Both
`quire generate` (cli.py) and `quire serve` (serve.py) use this module; neither imports the
other's. A bad value's error names its flag (`--max-loras: max_loras must be ...`).

--lora-modules takes vLLM's two spellings, any number of them:
    name=path
    '{"name": "...", "path": "...", "base_model_name": "..."}'   (base_model_name optional:
                                                   the adapter's parent in /v1/models)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import NamedTuple

from quire.config import EngineArgs
from quire.validation import QuireValidationError


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip or not f.init:
            continue
        if f.name == "lora_modules":  # a dict in EngineArgs; a list of name=path here
            group.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                               metavar="NAME=PATH", help=f.metadata["help"] + " (name=path, "
                               "or vLLM's JSON {\"name\", \"path\", \"base_model_name\"})")
            continue
        if f.name in ("speculative_config", "kv_events_config", "limit_mm_per_prompt"):
            # dicts; JSON here, as vLLM's
            group.add_argument("--" + f.name.replace("_", "-"), type=str, default=None,
                               metavar="JSON", help=f.metadata["help"])
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
    """EngineArgs from the flags; a ValueError names the flag at fault."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if f.init and hasattr(ns, f.name)}
    values["model"] = model
    if values.get("lora_modules") is not None:
        values["lora_modules"] = lora_modules_dict(values["lora_modules"])
    try:
        return EngineArgs(**values)
    except QuireValidationError as e:
        if e.field not in values:  # not a flag's fault
            raise
        flag = "--" + e.field.replace("_", "-")
        raise QuireValidationError(e.field, f"{flag}: {e}", e.value) from None


class LoRAModule(NamedTuple):
    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoRAModule:
    """One --lora-modules value: name=path, or vLLM's JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e})") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown key {sorted(unknown)[0]!r} in {text!r}; the keys are name, path "
                f"and base_model_name")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        for key, value in (("name", name), ("path", path)):
            if not isinstance(value, str) or not value.strip():
                raise argparse.ArgumentTypeError(
                    f"{key!r} must be a non-empty string in {text!r}")
        if base is not None and (not isinstance(base, str) or not base.strip()):
            raise argparse.ArgumentTypeError(
                f"'base_model_name' must be a non-empty string in {text!r}")
        return LoRAModule(name.strip(), path.strip(), base and base.strip())
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected name=path or a JSON object {{\"name\": ..., \"path\": ...}}, got "
            f"{text!r}")
    return LoRAModule(name.strip(), path.strip())


def lora_modules_dict(modules: list[LoRAModule]) -> dict[str, str]:
    """name -> path, refusing a name given twice."""
    out: dict[str, str] = {}
    for m in modules:
        if m.name in out:
            raise QuireValidationError(
                "lora_modules", f"--lora-modules: the adapter name {m.name!r} is given twice",
                m.name)
        out[m.name] = m.path
    return out


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
