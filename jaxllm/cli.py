"""The `jaxllm` command: serve, generate, bench, convert."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(args: argparse.Namespace) -> None:
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.llm import LLM
    from jaxllm.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def _convert(args: argparse.Namespace) -> None:
    from jaxllm.loader.convert import convert

    print(convert(None if args.model == "default" else args.model, args.out, args.dtype))


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.engine.args import EngineArgs

    parser.add_argument("--model", default=None,
                        help="a local HF model directory, a .gguf file, or a dummy preset name "
                             "(default: the built-in SmolLM2-135M-Instruct)")
    EngineArgs.add_cli_args(parser)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(prog="jaxllm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion for one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sample-seed", type=int, default=None)
    generate.add_argument("--raw", action="store_true",
                          help="complete the prompt as is, without the chat template")
    _add_model_args(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    from jaxllm.server.cli import add_serve_args, run_serve
    add_serve_args(serve)
    serve.set_defaults(handler=run_serve)

    convert = commands.add_parser(
        "convert", help="save a model's loaded weights as an Orbax checkpoint directory "
                        "(then LLM(model=OUT) / jaxllm serve OUT restore it into the mesh)")
    convert.add_argument("model", help="a local HF model directory, a .gguf file, or 'default' "
                                       "for the built-in SmolLM2-135M-Instruct")
    convert.add_argument("out", help="the checkpoint directory to write")
    convert.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16",
                                                             "float32"])
    convert.set_defaults(handler=_convert)

    from jaxllm.bench.cli import add_bench_args
    add_bench_args(commands)

    from jaxllm.engine.args import parse_cli_args

    args = parse_cli_args(parser, argv)
    try:
        args.handler(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
