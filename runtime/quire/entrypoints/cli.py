"""`quire generate` (a quick try) and `quire serve` (the OpenAI-compatible server).

Engine flags are derived from EngineArgs' fields, so every knob is a flag with the same name
(`max_num_seqs` -> `--max-num-seqs`) and the same validation.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
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
            group.add_argument(flag, type=_byte_size if "memory" in f.name and base is int
                               else base, **extra)


def engine_args_from(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if hasattr(ns, f.name)}
    values["model"] = model
    return EngineArgs(**values)


def _byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G (powers of 1024) suffix: 512M, 4G."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 4G or 512M)") from None


def cmd_generate(ns: argparse.Namespace) -> int:
    from quire import LLM, SamplingParams
    llm = LLM.from_engine_args(engine_args_from(ns, ns.model))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens,
                            seed=ns.sampling_seed)
    prompts = ns.prompts or ["Hello, my name is", "The capital of France is",
                             "The future of AI is"]
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"Prompt: {prompt!r}\nOutput: {out.outputs[0].text!r}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quire", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a few prompts and print them")
    gen.add_argument("prompts", nargs="*", help="prompts (default: three examples)")
    gen.add_argument("--model", default=None, help=EngineArgs.__dataclass_fields__["model"]
                     .metadata["help"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    try:
        from quire.entrypoints.serve import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    from quire.router.cli import add_router_parser  # `quire router`: the cluster router
    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as e:  # bad input: say what, not a traceback
        print(f"quire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
