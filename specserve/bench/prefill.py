"""What a long prompt costs the streams already decoding beside it, with and without chunked prefill.

    python -m specserve.bench.prefill [--target DIR] [--streams 3] [--prompt-tokens 3000] [--chunk 512]

In process, target only, greedy: `--streams` requests decode while one long prompt arrives. Prints,
for whole-prompt prefill and for chunks of `--chunk` tokens, the decoding streams' median and longest
gap between two of their rounds, and how long the long request took.
"""

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from app.engine import Engine
from app.params import SamplingParams
from app.model import runner as model_runner

TEXT = Path(model_runner.__file__)  # any long text the tokenizer knows


async def _run(engine: Engine, streams: int, long_ids: list[int]) -> dict:
    text_ids = engine.tokenizer(TEXT.read_text())["input_ids"]
    short = [text_ids[i * 100 : i * 100 + 100] for i in range(streams)]
    gaps: list[float] = []

    async def decode(ids: list[int]) -> None:
        state = engine.new_request(ids, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        last = None
        async for _ in engine.stream(state):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def long_request() -> float:
        await asyncio.sleep(0.3)  # the streams are decoding by then
        state = engine.new_request(long_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        async for _ in engine.stream(state):
            pass
        return time.perf_counter() - t0

    *_, took = await asyncio.gather(*(decode(ids) for ids in short), long_request())
    gaps.sort()
    return {"gap_p50_ms": 1e3 * gaps[len(gaps) // 2], "gap_max_ms": 1e3 * gaps[-1], "long_request_s": took}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.prefill", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target model: hub id or local directory (default: the demo target)")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specserve.demo import models

    engine = Engine.from_pretrained(models(args.target, None, "demo", with_draft=False)[0])
    ids = engine.tokenizer(TEXT.read_text())["input_ids"][: args.prompt_tokens]
    report = {}
    for name, chunk in (("whole", None), (f"chunks of {args.chunk}", args.chunk)):
        engine.prefill_chunk = chunk
        r = report[name] = asyncio.run(_run(engine, args.streams, ids))
        print(f"{name}: {len(ids)}-token prompt beside {args.streams} decoding streams: their gaps p50 "
              f"{r['gap_p50_ms']:.1f} ms, longest {r['gap_max_ms']:.0f} ms; the long request took "
              f"{r['long_request_s']:.2f} s", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
