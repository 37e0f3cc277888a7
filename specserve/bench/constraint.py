"""Speculation under output constraints: acceptance and tokens per round with and without a grammar.

    python -m specserve.bench.constraint [--target DIR --draft DIR] [--prompts 8] [--max-tokens 64] [--k 4]

In process, greedy, fixed K, on the demo's held-out code prompts. One row per constraint: none, any
JSON object, a regex, and a forced tool call in `--tool-parser`'s format. A grammar masks the draft
as it masks the target (app/grammar.py), so a constraint that narrows the output narrows the draft's
guesses the same way: acceptance goes up, not down. Prints a line per row, then the rows as JSON.
"""

import argparse
import json

from app.engine import Engine
from app.openai.tool_calls import PARSERS, Tool, special_markers

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}})


def constraints(tokenizer, parser: str) -> dict[str, dict | None]:
    """The rows: a name -> the response_format that constrains it (None: free text)."""
    fmt = PARSERS[parser]
    call = fmt(specials=special_markers(tokenizer, fmt)).grammar([WEATHER], parallel=False)
    return {"none": None, "json_object": {"type": "json_object"},
            "regex": {"type": "regex", "regex": r"[a-z_]{1,12}\([a-z_, ]{0,40}\)"},
            f"tool call ({parser}, forced)": {"type": "grammar", "grammar": call}}


def measure(engine: Engine, prompts: list[str], fmt: dict | None, k: int, max_tokens: int) -> dict:
    results = engine.generate(prompts, dict(temperature=0, max_tokens=max_tokens, response_format=fmt,
                                            speculation={"num_tokens": k}))
    drafted = sum(r.speculation["drafted_tokens"] for r in results)
    rounds = [r.speculation["mean_accepted_length"] for r in results if r.speculation["drafted_rounds"]]
    return {"acceptance": sum(r.speculation["accepted_tokens"] for r in results) / drafted if drafted else 0.0,
            "tau": sum(rounds) / len(rounds) if rounds else 0.0,
            "tokens": sum(len(r.token_ids) for r in results)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.constraint", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target model: hub id or local directory (default: the demo pair)")
    p.add_argument("--draft", help="draft model (with --target)")
    p.add_argument("--prompts", type=int, default=8, help="held-out code prompts to run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--tool-parser", default="hermes", choices=sorted(PARSERS))
    args = p.parse_args(argv)
    from specserve.demo import models
    from specserve.demo.corpus import load_heldout_prompts

    engine = Engine.from_pretrained(*models(args.target, args.draft, "demo"))
    prompts = [p["prompt"] for p in load_heldout_prompts() if p["kind"] == "code"][: args.prompts]
    report = {}
    for name, fmt in constraints(engine.tokenizer, args.tool_parser).items():
        row = report[name] = measure(engine, prompts, fmt, args.k, args.max_tokens)
        print(f"{name:28s} acceptance {row['acceptance']:.3f}  tau {row['tau']:.2f}  tokens {row['tokens']}",
              flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
