"""The `specserve` command: build the demo pair, generate in process, serve, benchmark."""

import argparse
import json
import sys


def _models(args) -> tuple[str, str | None]:
    """The target and draft to use: the ones given, else the demo pair (built on first use)."""
    if args.target:
        return args.target, args.draft
    from app.demo import demo_pair

    target, draft = demo_pair(quick=getattr(args, "quick", False))
    return target, args.draft or draft


def cmd_generate(args) -> int:
    from app.engine import Engine
    from app.params import SamplingParams

    target, draft = _models(args)
    engine = Engine.from_pretrained(target, None if args.no_draft else draft, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            speculation={"num_tokens": "auto" if args.k is None else args.k})
    for prompt, r in zip(args.prompt, engine.generate(args.prompt, params)):
        print(json.dumps({"prompt": prompt, "text": r.text, "finish_reason": r.finish_reason,
                          "speculation": r.speculation}, indent=2))
    return 0


def cmd_demo_models(args) -> int:
    from app.demo import build_cli

    return build_cli(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate in process (no Ray) for one or more prompts")
    g.add_argument("prompt", nargs="*", default=["def quicksort(items):\n"], help="prompts (default: a code prompt)")
    g.add_argument("--target", help="target model: hub id or local directory (default: the demo target)")
    g.add_argument("--draft", help="draft model: hub id or local directory (default: the demo draft)")
    g.add_argument("--no-draft", action="store_true", help="plain target decoding")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("-k", type=int, help="draft tokens per round (default: adaptive)")
    g.add_argument("--quick", action="store_true", help="use the small, quickly built demo pair")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo-models", help="build (or find in the cache) the demo draft/target pair")
    d.add_argument("--quick", action="store_true", help="a small pair that builds in about a minute")
    d.add_argument("--rebuild", action="store_true", help="build again even when cached")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--cache-dir", help="where to keep the pair (default: $SPECSERVE_CACHE or the user cache)")
    d.set_defaults(func=cmd_demo_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
