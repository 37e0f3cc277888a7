"""Per-round verify time of the target at tensor_parallel_size 1 and N, on this machine's devices.

    python -m specserve.bench.tp --target DIR [--tp 2] [--k 4] [--batch 1,8] [--rounds 20]

On CPU the ranks are processes over gloo: this shows that sharding is correct and what it costs,
not a speed-up (two ranks share the same cores). The ranks are started with torch.multiprocessing,
the same way the Serve rank workers form their group, without Ray.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.params import SamplingParams
from app.model.runner import ModelRunner, weights_dtype
from app.speculation.steps import Proposal, VerifyItem, verify


def _rounds(runner: ModelRunner, k: int, batch: int, rounds: int) -> list[float]:
    """Seconds per verify round of `batch` sequences with K draft tokens each (greedy)."""
    params = SamplingParams(temperature=0, max_tokens=1 << 20)
    seqs = {f"s{i}": list(range(3, 3 + 64 + i)) for i in range(batch)}
    times = []
    for r in range(rounds + 2):  # two warm-up rounds
        items = [VerifyItem(sid, ids, Proposal(list(range(10, 10 + k)), torch.zeros(k, 1, dtype=torch.long),
                                               torch.ones(k, 1)), params, 0) for sid, ids in seqs.items()]
        t0 = time.perf_counter()
        verdicts = verify(runner, items)
        if r >= 2:
            times.append(time.perf_counter() - t0)
        for (sid, ids), v in zip(seqs.items(), verdicts):
            ids.extend(v.tokens)
    return times


def _worker(rank: int, world: int, port: int, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, args.threads // world))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": weights_dtype(args.target, args.dtype)}
    if world > 1:
        from transformers.distributed import DistributedConfig

        dist.init_process_group("gloo", rank=rank, world_size=world)
        kwargs["distributed_config"] = DistributedConfig(tp_size=world)
    model = AutoModelForCausalLM.from_pretrained(args.target, **kwargs).eval().requires_grad_(False)
    runner = ModelRunner(model, AutoTokenizer.from_pretrained(args.target))
    result = {b: _rounds(runner, args.k, b, args.rounds) for b in args.batch}
    if rank == 0:
        out.put(result)
    if world > 1:
        dist.destroy_process_group()


def measure(args, world: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29600 + world
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory or hub id")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="auto: bf16 where this CPU does it natively, else float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all (split over the ranks)")
    args = p.parse_args(argv)
    report = {}
    for world in (1, args.tp):
        times = measure(args, world)
        for b, ts in times.items():
            report[f"tp{world}_batch{b}_ms"] = {"p50": 1e3 * statistics.median(ts), "mean": 1e3 * statistics.mean(ts)}
            print(f"tensor_parallel_size={world} batch={b} K={args.k}: verify round p50 "
                  f"{1e3 * statistics.median(ts):.1f} ms", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
