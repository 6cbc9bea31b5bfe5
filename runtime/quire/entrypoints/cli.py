"""`quire generate` (a quick try) and `quire serve` (the OpenAI-compatible server).

Engine flags come from engine_args.py (one flag per EngineArgs field); the serve subcommand's
own flags from serve.py, which imports the server's dependencies only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from quire.entrypoints.engine_args import add_engine_flags, engine_args_from, model_help
from quire.entrypoints.serve import MissingDependency, add_serve_parser


def cmd_generate(ns: argparse.Namespace) -> int:
    from quire.entrypoints.llm import LLM
    from quire.sampling_params import SamplingParams
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
    gen.add_argument("--model", default=None, help=model_help())
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

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
    except (ValueError, MissingDependency) as e:  # bad input or setup: say what, no traceback
        print(f"quire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
