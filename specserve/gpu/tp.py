"""`gpu_check`'s tensor-parallel step: the target verified by two ranks as a served replica's rank workers
run it (deployments/tp.py: `load_runner` with `tp_size`, the budget agreed over the group, a warm-up
forward, verify calls in the same order on every rank), without Ray.

The ranks are processes started with torch.multiprocessing, one GPU each seen as `cuda:0` (as Ray
gives a rank its GPU), over NCCL; on a CPU two processes over gloo (`--device cpu --smoke`: the suite
runs it there). Each round proposes K tokens made from `generate`'s own continuation with one of them
wrong, so every round accepts some, rejects one and recovers the target's token: the rounds' output
must be `generate`'s (a first difference allowed only at a near-tie of a half-precision dtype, as in
gpu_check's identity step). It times a round at tensor_parallel_size 1 (in this process) and 2.
"""

import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.config import ModelSettings
from app.params import SamplingParams
from app.speculation.steps import Proposal, VerifyItem, verify
from specserve.gpu.models import llama, near_tie, prompts, tokenizer

WORLD = 2
K = 4
WRONG_AT = 2  # the proposal's token at this index is wrong: two accepted, one recovered a round


def _settings(device: str, dtype: torch.dtype) -> ModelSettings:
    cuda = device.startswith("cuda")
    return ModelSettings(dtype=str(dtype).removeprefix("torch."), device=device, compile="off",
                         memory_utilization=0.5, max_model_len=2048, max_cache_bytes=None if cuda else 64 << 20)


def _rounds(runner, batch: list[list[int]], reference: list[list[int]], vocab: int) -> tuple[list[list[int]], list[float], float]:
    """Verify rounds over the whole batch until every sequence has its reference's length; each
    proposal is the reference's next K tokens with the one at WRONG_AT replaced. Returns each
    sequence's emitted tokens, the seconds of each round (synced) and the draft tokens accepted per
    proposal (WRONG_AT where the ranks agree with the reference)."""
    params = SamplingParams(temperature=0, max_tokens=1 << 20)
    out = [[] for _ in batch]
    times, accepted = [], []
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    while any(len(o) < len(r) for o, r in zip(out, reference)):
        live = [i for i, (o, r) in enumerate(zip(out, reference)) if len(o) < len(r)]
        items = []
        for i in live:
            want = (reference[i][len(out[i]):] + [2] * K)[:K]
            tokens = [t if j != WRONG_AT else (t + 1) % vocab or 2 for j, t in enumerate(want)]
            proposal = Proposal(tokens, torch.tensor(tokens).unsqueeze(1), torch.ones(K, 1))
            items.append(VerifyItem(f"tp-{i}", batch[i] + out[i], proposal, params, 0))
        sync()
        t0 = time.perf_counter()
        verdicts = verify(runner, items)
        sync()
        times.append(time.perf_counter() - t0)
        for i, v in zip(live, verdicts):
            out[i].extend(v.tokens)
            accepted.append(v.accepted)
    for i in range(len(batch)):
        runner.forget(f"tp-{i}")
    return [o[: len(r)] for o, r in zip(out, reference)], times, statistics.mean(accepted)


def _rank(rank: int, port: int, job: dict, out) -> None:
    """One rank worker: RankWorker's start (deployments/tp.py) without Ray, then the rounds. `job`: the
    model's `path`, `device`, `dtype`, and the rounds' `batch`, `reference` and `vocab`."""
    from app.model.loading import load_runner, warm_up
    from app.model.memory import agree_on_budget

    device, dtype = job["device"], job["dtype"]
    cuda = device.startswith("cuda")
    if cuda:  # before CUDA starts in this process: this rank's GPU alone, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK="0" if cuda else str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    try:
        runner = load_runner(job["path"], _settings(device, dtype), 64, tp_size=WORLD)
        agree_on_budget(runner)
        warm_up(runner)
        tokens, times, accepted = _rounds(runner, job["batch"], job["reference"], job["vocab"])
        if rank == 0:
            out.put({"tokens": tokens, "times": times, "accepted": accepted,
                     "kv_budget_gib": round(runner.cache.max_bytes / 2**30, 2)})
    except BaseException as e:  # the parent waits on the queue: say why instead of leaving it waiting
        if rank == 0:
            out.put({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(job: dict, timeout_s: float) -> dict:
    """Rank 0's report of the rounds (`_rank`'s job) on WORLD rank processes, or its error."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, job, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _differences(model, batch, reference, tokens, exact: bool) -> tuple[int, list, list]:
    """(identical, near-ties, failures) of the ranks' tokens against the reference."""
    identical, ties, failed = 0, [], []
    for ids, want, got in zip(batch, reference, tokens):
        if got == want:
            identical += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        tie, gap = near_tie(model, ids + want, len(ids) + j)
        (ties if tie and not exact else failed).append({"position": j, "top2_gap": round(gap, 4)})
    return identical, ties, failed


def check_tensor_parallel(device: str, dtype: torch.dtype, smoke: bool, timeout_s: float = 600) -> dict:
    from app.engine import Engine
    from app.model.loading import load_runner
    from app.model.runner import ModelRunner
    from specserve.bench.runs import MODES, run_hf

    cuda = device.startswith("cuda")
    if cuda and torch.cuda.device_count() < WORLD:
        return {"ok": True, "skipped": f"needs {WORLD} GPUs; this machine has {torch.cuda.device_count()}"}
    # hidden 512: 8 heads and 2 key/value heads, which two ranks divide
    layers, hidden, vocab, n_tokens, n_seq = (2, 512, 512, 12, 3) if smoke else (8, 2048, 32000, 48, 8)
    target = llama(layers, hidden, vocab, 1, dtype, device)
    tok = tokenizer(vocab)
    batch = prompts(n_seq, 40, vocab, seed=13)
    reference = [run_hf(Engine(ModelRunner(target, tok)), ids, MODES["hf-target"], n_tokens).tokens for ids in batch]
    exact = dtype == torch.float32
    report = {"dtype": str(dtype).removeprefix("torch."), "sequences": n_seq, "k": K}
    with tempfile.TemporaryDirectory() as tmp:
        target.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        single = load_runner(tmp, _settings(device, dtype), 64)  # tensor_parallel_size 1, the same rounds
        one_tokens, one_times, one_accepted = _rounds(single, batch, reference, vocab)
        del single
        ranks = _ranks(dict(path=tmp, device=device, dtype=dtype, batch=batch, reference=reference, vocab=vocab),
                       timeout_s)
    if "error" in ranks:
        return {**report, "ok": False, "error": f"rank 0: {ranks['error']}"}
    for name, tokens, accepted in (("tp1", one_tokens, one_accepted), ("tp2", ranks["tokens"], ranks["accepted"])):
        identical, ties, failed = _differences(target, batch, reference, tokens, exact)
        report[name] = {"identical": identical, "near_ties": ties, "failed": failed,
                        "accepted_per_round": round(accepted, 2)}
    report["round_ms"] = {"tp1": round(statistics.median(one_times) * 1e3, 2),
                          "tp2": round(statistics.median(ranks["times"]) * 1e3, 2)}
    report["kv_budget_gib_per_rank"] = ranks["kv_budget_gib"]
    report["ok"] = not report["tp1"]["failed"] and not report["tp2"]["failed"]
    return report
