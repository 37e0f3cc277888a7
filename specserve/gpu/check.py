"""`make gpu-check`: the engine on one GPU, checked and timed; exits non-zero on any failure.

Runs on the engine alone (no Ray, no network: every model is built here from a config of a real
architecture, with random weights scaled so its distributions are peaked like a trained model's):

1. greedy identity: the engine's speculative output equals Hugging Face `generate` of the target
   alone, in float32 and bfloat16. bf16 near-tie policy: where the two first differ, the target's
   top two logits at that position (in the reference's own forward) must lie within one bf16
   rounding step of each other, i.e. the tie is one that batched and stepwise forwards may break
   differently; any other difference fails.
2. sampling: the rejection sampler on the device reproduces p (chi-square over many seeded draws).
3. attention: the GPU's attention paths (per_sequence, varlen) against `generate`, and their step times
   at batch 1, 8 and 32.
4. served path: the engine pieces a served replica runs, together: a batch of requests (two share a
   long prompt, so the second borrows the first's KV blocks by reference), drafting ahead, paged
   KV, and compiled steps (`compile="default"`, then the CUDA-graph mode `reduce-overhead` on a
   GPU); greedy output equals the eager engine's and HF `generate`'s, and the compiled step's time
   is set against the eager one's.
5. production path: the pair loaded as a replica loads it (the budget from the device's memory), bf16,
   compiled, 32 requests (greedy and seeded sampled), recompiles an error once warm, syncs counted
   (torch.cuda.set_sync_debug_mode); a second run must give the same tokens.
6. tensor parallel (specserve/gpu/tp.py): two ranks started as a replica's rank workers start (NCCL, one
   GPU each; gloo on a CPU), verify rounds that accept, reject and recover, against `generate`, and a
   round's time at tensor_parallel_size 1 and 2; skipped, saying so, with fewer than two GPUs.
7. benchmark: a Llama-shaped target of about 1B parameters and a 2-layer draft in bf16 (float32 on a
   CPU without native bf16, where the bf16 identity check is skipped too: `app.model.dtypes`); the K+1
   verify cost against one step at batch 1, 8 and 32, the cost ratio c, and tok/s of speculative
   decoding against HF `generate` and HF assisted generation.

`--smoke` shrinks every size so the same code runs in seconds on a CPU (the suite runs it there).
"""

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo

from app.model import dtypes
from specserve.gpu.models import blend, llama, near_tie, prompts, tokenizer
from specserve.gpu.tp import check_tensor_parallel
from specserve.bench.runs import K_MATCHED, MODES, Mode, forward_ms, run_engine, run_hf
from app.speculation.driver import DraftPolicy
from app.engine import Engine, EngineSettings
from app.params import SamplingParams
from app.model.runner import Execution, ModelRunner, SeqInput
from app.speculation.sampling import process_logits, rejection_sample

log = logging.getLogger("specserve.gpu.check")  # not __name__: run as __main__
VOCAB = 32000
NO_NATIVE_BF16 = "this device has no native bf16 matmul (torch would take its scalar fallback): not run"


# --- 1. greedy identity ------------------------------------------------------------------------

def check_identity(dtype: torch.dtype, device: str, smoke: bool) -> dict:
    layers, hidden, vocab, n_tokens = (2, 64, 512, 24) if smoke else (4, 512, VOCAB, 64)
    target = llama(layers, hidden, vocab, 1, dtype, device)
    draft = blend(target, 1, 2, dtype, device)
    tok = tokenizer(vocab)
    engine = Engine(ModelRunner(target, tok), ModelRunner(draft, tok))
    report = {"dtype": str(dtype).removeprefix("torch."), "prompts": 0, "identical": 0, "near_ties": [], "failed": []}
    for ids in prompts(3 if smoke else 8, 40, vocab):
        out = run_engine(engine, ids, MODES["spec-k4"], n_tokens).tokens
        ref = run_hf(engine, ids, MODES["hf-target"], n_tokens).tokens
        report["prompts"] += 1
        if out == ref:
            report["identical"] += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
        tie, gap = near_tie(target, ids + ref, len(ids) + j)
        entry = {"position": j, "top2_gap": gap}
        (report["near_ties"] if tie and dtype != torch.float32 else report["failed"]).append(entry)
    report["ok"] = not report["failed"]
    return report


# --- 2. sampling -------------------------------------------------------------------------------

def check_sampling(device: str, smoke: bool) -> dict:
    """Draft q and target p over a small vocabulary; the first emitted token's frequencies over many
    seeds must match p (the rejection sampler's promise), on the device."""
    from scipy import stats

    v, n = 12, (20_000 if smoke else 400_000)
    g = torch.Generator().manual_seed(3)
    p_logits, q_logits = torch.randn(1, v, generator=g) * 1.5, torch.randn(1, v, generator=g) * 1.5
    dev = torch.device(device)
    p = process_logits(p_logits.to(dev), torch.tensor([0.9], device=dev), torch.tensor([0], device=dev),
                       torch.tensor([1.0], device=dev))  # [1, V]
    q = torch.softmax(q_logits.to(dev) / 0.9, -1)
    seeds = torch.arange(n, device=dev)
    # one draft token per row, drawn from q with the draft's own uniforms
    u = ((seeds * 0x9E3779B1 + 12345) % (1 << 31)).double() / (1 << 31)
    draft = torch.searchsorted(q.double().cumsum(-1).expand(n, v).contiguous(), u.unsqueeze(-1)).clamp(max=v - 1)
    target_probs = p.expand(n, v).unsqueeze(1).repeat(1, 2, 1)  # [n, K+1 = 2, V]
    ids = torch.arange(v, device=dev).expand(n, 1, v)
    accepted, tokens = rejection_sample(
        target_probs, draft, ids, q.expand(n, 1, v), num_draft=torch.ones(n, dtype=torch.long, device=dev),
        greedy=torch.zeros(n, dtype=torch.bool, device=dev), seeds=seeds, start_pos=torch.zeros_like(seeds))
    first = tokens[:, 0].cpu()  # the emitted token: the accepted draft token or the recovered one
    counts = torch.bincount(first, minlength=v).double().numpy()
    expected = p[0].double().cpu().numpy() * n
    pvalue = float(stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue)
    return {"draws": n, "acceptance": accepted.double().mean().item(), "chi2_pvalue": pvalue, "ok": pvalue > 1e-4}


# --- 3. the served path's engine pieces ---------------------------------------------------------

def step_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Milliseconds of one ragged step of `batch` sequences of `context` cached positions (synced), on the
    runner's forward thread, where its CUDA graphs were recorded (replayed from another thread they would
    be recorded again)."""
    return runner.on_thread(_step_ms, runner, batch, context, steps)


@torch.inference_mode()
def _step_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    seqs = [SeqInput(f"step-{i}", prompts(1, context, runner.vocab_size, seed=i)[0], 1) for i in range(batch)]
    runner.forward(seqs)

    def step():
        rows = [SeqInput(s.seq_id, s.token_ids + [2], 1) for s in seqs]
        b = runner.open(rows)
        b.close([len(s.token_ids) for s in seqs])
    step()
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    for s in seqs:
        runner.forget(s.seq_id)
    return (time.perf_counter() - t0) / steps * 1e3


def check_served_path(device: str, smoke: bool) -> dict:
    layers, hidden, vocab, n_tokens = (2, 64, 512, 16) if smoke else (4, 512, VOCAB, 48)
    target = llama(layers, hidden, vocab, 1, torch.float32, device)
    draft = blend(target, 1, 2, torch.float32, device)
    tok = tokenizer(vocab)
    shared = prompts(1, 48, vocab, seed=5)[0]
    batch = [shared, shared + prompts(1, 8, vocab, seed=6)[0]] + prompts(4 if smoke else 14, 40, vocab, seed=9)
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, speculation={"num_tokens": 4})
    ref = [run_hf(Engine(ModelRunner(target, tok)), ids, MODES["hf-target"], n_tokens).tokens for ids in batch]
    report = {"batch": len(batch), "modes": {}}
    for mode in ["off", "default"] + (["reduce-overhead"] if device.startswith("cuda") else []):
        log.info("served path: compile=%s", mode)
        runners = [ModelRunner(m, tok, Execution(compile=mode, compile_max_tokens=64)) for m in (target, draft)]
        for r in runners:
            r.on_thread(r.warm)  # on the thread its forwards run on: CUDA graphs are recorded per thread
        engine = Engine(*runners, EngineSettings(policy=DraftPolicy(ahead=True)))
        engine.generate([shared], params)  # its blocks stay as a prefix donor: the second prompt borrows them
        out = engine.generate([list(ids) for ids in batch], params)
        spec = [r.speculation for r in out]
        report["modes"][mode] = {
            "compiled": runners[0].steps is not None,
            "identical": sum(r.token_ids == t for r, t in zip(out, ref)),
            "prefix_hit_tokens": runners[0].cache.prefix_hit_tokens,
            "kv_blocks_held": runners[0].cache.pool.num_blocks - runners[0].cache.pool.free,
            "draft_ahead_hit_rate": sum(s["draft_ahead_hit_rate"] for s in spec) / len(spec),
            "step_ms": {b: step_ms(runners[0], b, 32 if smoke else 512, 3 if smoke else 20) for b in (1, 8)},
        }
    modes = report["modes"].values()
    report["ok"] = all(m["identical"] == len(batch) and m["prefix_hit_tokens"] > 0 for m in modes) and all(
        m["compiled"] for name, m in report["modes"].items() if name != "off")
    return report


# --- 3a. attention paths -------------------------------------------------------------------------

def check_attention(device: str, smoke: bool) -> dict:
    """Each GPU attention path (app/model/ragged.py) in bf16 where the device has it, eager: greedy output of a
    batch of 16 against HF `generate` (bf16: a difference only at a near-tie, as in check_identity), and
    the step's time at batch 1, 8 and 32 over 512 cached positions. varlen (one kernel call per layer
    for the batch) against per_sequence (one SDPA call per sequence per layer) decides auto's choice."""
    dtype = torch.float32 if smoke else dtypes.compute_dtype(device)
    layers, hidden, vocab, n_tokens = (2, 64, 512, 12) if smoke else (8, 1024, VOCAB, 32)
    target = llama(layers, hidden, vocab, 1, dtype, device)
    tok = tokenizer(vocab)
    batch = prompts(4 if smoke else 16, 40, vocab, seed=9)
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    ref = [run_hf(Engine(ModelRunner(target, tok)), ids, MODES["hf-target"], n_tokens).tokens for ids in batch]
    report = {"dtype": str(dtype).removeprefix("torch."), "paths": {}}
    for path in ("per_sequence", "varlen"):
        log.info("attention: %s", path)
        runner = ModelRunner(target, tok, Execution(attention=path))
        out = Engine(runner).generate([list(ids) for ids in batch], params)
        entry = {"identical": 0, "near_ties": 0, "failed": 0}
        for ids, r, want in zip(batch, out, ref):
            if r.token_ids == want:
                entry["identical"] += 1
                continue
            j = next(i for i, (a, b) in enumerate(zip(r.token_ids, want)) if a != b)
            tie = dtype != torch.float32 and near_tie(target, ids + want, len(ids) + j)[0]
            entry["near_ties" if tie else "failed"] += 1
        entry["step_ms"] = {b: round(step_ms(runner, b, 32 if smoke else 512, 3 if smoke else 10), 2)
                            for b in (1, 8, 32)}
        report["paths"][path] = entry
    report["ok"] = not any(p["failed"] for p in report["paths"].values())
    return report


# --- 3b. the production path ---------------------------------------------------------------------

def _saved_and_loaded(device: str, dtype: torch.dtype, shape: tuple[int, int, int]) -> tuple[Engine, float]:
    """A (layers, hidden, vocab) pair saved, then loaded as a replica loads it; and the seconds that took."""
    from app.config import ModelSettings, SpeculationSettings
    from app.engine import EngineConfig

    target = llama(*shape[:2], shape[2], 1, dtype, "cpu")
    draft, tok = blend(target, 1, 2, dtype, "cpu"), tokenizer(shape[2])
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(f"{tmp}/{name}")
            tok.save_pretrained(f"{tmp}/{name}")
        log.info("production path: the pair saved; loading it as a replica does")
        t_load = time.perf_counter()
        settings = ModelSettings(dtype=str(dtype).removeprefix("torch."), device=device, memory_utilization=0.9,
                                 max_model_len=2048, compile="default", compile_max_tokens=64,
                                 max_cache_bytes=None if device.startswith("cuda") else 64 << 20)
        engine = Engine.from_config(EngineConfig(target=f"{tmp}/target", draft=f"{tmp}/draft", target_settings=settings,
                                                 draft_settings=settings,
                                                 speculation=SpeculationSettings(draft_ahead=False)))
    load_s = time.perf_counter() - t_load
    log.info("production path: loaded and warmed in %.1f s", load_s)
    return engine, load_s


def check_production(device: str, smoke: bool) -> dict:
    """The served path as a replica runs it: the pair saved and loaded by `load_pair` (the KV budget
    from the device's real memory, max_model_len enforced), bf16 where the device has it, compiled
    steps, 32 requests at once (half greedy, half sampled and seeded, varied prompt lengths), dynamo
    recompiles an error once warm, and on CUDA torch's sync debug mode counting the host-device
    syncs. Passes when nothing recompiles or fails and a second run gives the same tokens."""
    import warnings

    dtype = torch.float32 if smoke else dtypes.compute_dtype(device)
    layers, hidden, vocab, n_tokens, n_req = (2, 64, 512, 12, 8) if smoke else (8, 2048, VOCAB, 48, 32)
    engine, load_s = _saved_and_loaded(device, dtype, (layers, hidden, vocab))
    g = torch.Generator().manual_seed(11)
    batch = [torch.randint(2, vocab, (int(torch.randint(8, 200, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n_req)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else i,
                             max_tokens=n_tokens, ignore_eos=True, speculation={"num_tokens": 4}) for i in range(n_req)]
    engine.generate([batch[0][:16]], params[0])  # first traffic: lazy set-up off the clock
    dynamo = torch._dynamo.config
    cuda = device.startswith("cuda")
    report = {"dtype": str(dtype).removeprefix("torch."), "requests": n_req,
              "kv_budget_gib": round(engine.target.cache.max_bytes / 2**30, 2),
              "draft_kv_budget_gib": round(engine.draft.cache.max_bytes / 2**30, 2),
              "kv_tokens": engine.target.capacity_tokens(), "compiled": engine.target.steps is not None,
              "draft_compiled": engine.draft.steps is not None, "load_and_warm_s": round(load_s, 1),
              "attention": engine.target.attention}
    before = dynamo.error_on_recompile
    dynamo.error_on_recompile = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            first = engine.generate(batch, params)
            seconds = time.perf_counter() - t0
            log.info("production path: %d requests in %.1f s", n_req, seconds)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        second = engine.generate(batch, params)
    finally:
        dynamo.error_on_recompile = before
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    rounds = sum(r.speculation["rounds"] for r in first)
    emitted = sum(len(r.token_ids) for r in first)
    report.update(rounds=rounds, tokens=emitted, tokens_per_s=round(emitted / seconds, 1),
                  acceptance=round(sum(r.speculation["accepted_tokens"] for r in first)
                                   / max(1, sum(r.speculation["drafted_tokens"] for r in first)), 3),
                  syncs=syncs if cuda else None, syncs_per_round=round(syncs / max(1, rounds), 2) if cuda else None,
                  **rerun_differences(engine.target.model, batch, params, first, second))
    report["ok"] = not report["rerun_failed"] and all(len(r.token_ids) == n_tokens for r in first)
    return report


def rerun_differences(model, prompts: list[list[int]], params: list[SamplingParams], first, second) -> dict:
    """The second run against the first. A greedy request may differ only at a near-tie of the
    dtype (its first difference, as in check_identity): the two runs batch differently (the goodput
    gate's choices for greedy requests follow measured times), and in bf16 a row's rounding depends on
    its batch's shape. A seeded sampled request draws the same numbers in both runs (its K follows its
    own history), but its tokens follow p and q at every position, which that rounding moves: a
    draw near a boundary (u q(x) against p(x), or the inverse CDF) may go the other way, which no
    argmax rule judges. Counted, not failed; in float32 on a CPU the suite asserts every rerun is
    identical, and the sampler's exactness is checked on the device (check_sampling)."""
    out = {"identical_rerun": 0, "rerun_near_ties": [], "rerun_failed": [], "seeded_differing": 0}
    for ids, p, a, b in zip(prompts, params, first, second):
        if a.token_ids == b.token_ids:
            out["identical_rerun"] += 1
        elif p.temperature > 0:
            out["seeded_differing"] += 1
        else:
            j = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            tie, gap = near_tie(model, ids + a.token_ids, len(ids) + j)
            exact = model.dtype == torch.float32
            (out["rerun_near_ties"] if tie and not exact else out["rerun_failed"]).append(
                {"position": j, "top2_gap": round(gap, 4)})
    return out


# --- 4. benchmark ------------------------------------------------------------------------------

def benchmark(device: str, smoke: bool) -> dict:
    dtype = torch.float32 if smoke else dtypes.compute_dtype(device)  # bf16 where the device does it natively
    # ~1.1B parameters: 16 layers of hidden 2048 (MLP 5632), vocabulary 32000; the draft: 2 layers
    layers, hidden, vocab = (2, 128, 1024) if smoke else (16, 2048, VOCAB)
    target = llama(layers, hidden, vocab, 1, dtype, device)
    draft = blend(target, 2 if not smoke else 1, 2, dtype, device)
    params = sum(p.numel() for p in target.parameters())
    steps, context, k = (3, 32, 4) if smoke else (20, 512, 4)
    costs = {}
    for b in (1, 8, 32):
        log.info("benchmark: costs at batch %d", b)
        one, verify = forward_ms(target, context, 1, steps, b), forward_ms(target, context, k + 1, steps, b)
        costs[b] = {"step_ms": one, "verify_ms": verify, "verify_over_step": verify / one}
    c = forward_ms(draft, context, 1, steps) / costs[1]["step_ms"]
    tok = tokenizer(vocab)
    engine = Engine(ModelRunner(target, tok), ModelRunner(draft, tok))
    n_tokens = 16 if smoke else 128
    speed = {}
    for name, mode in [("speculative K=4", MODES["spec-k4"]), ("speculative auto", MODES["spec-auto"]),
                       ("HF generate", MODES["hf-target"]),
                       ("HF assisted K=4", Mode("hf-assisted-k4", assistant=K_MATCHED, hf=True))]:
        log.info("benchmark: %s", name)
        runs = [(run_hf if mode.hf else run_engine)(engine, ids, mode, n_tokens)
                for ids in prompts(2 if smoke else 4, context, vocab, seed=7)]
        speed[name] = sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)
    return {"target_params": params, "dtype": str(dtype).removeprefix("torch."), "k": k, "context": context,
            "costs_by_batch": costs, "c": c, "tokens_per_s": speed, "ok": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.gpu.check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the same code in seconds, e.g. on a CPU")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--only", help="comma-separated steps to run (default all): identity_fp32, identity_bf16, "
                                  "sampling, attention, served_path, production_path, tensor_parallel, benchmark")
    p.add_argument("--isolate", type=float, metavar="SECONDS",
                   help="each step in a process of its own, stopped after SECONDS (specserve/gpu/steps.py)")
    args = p.parse_args(argv)
    # the engine's progress (each compiled bucket, the budget) with seconds since start: a step that
    # runs out of its time says where it was
    logging.basicConfig(format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    for name in ("app", "tools"):
        logging.getLogger(name).setLevel(logging.INFO)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device}
    steps = [("identity_fp32", lambda: check_identity(torch.float32, args.device, args.smoke)),
             ("identity_bf16", lambda: check_identity(torch.bfloat16, args.device, args.smoke)
              if dtypes.native_bf16(args.device) else {"ok": True, "skipped": NO_NATIVE_BF16}),
             ("sampling", lambda: check_sampling(args.device, args.smoke)),
             ("attention", lambda: check_attention(args.device, args.smoke)),
             ("served_path", lambda: check_served_path(args.device, args.smoke)),
             ("production_path", lambda: check_production(args.device, args.smoke)),
             ("tensor_parallel", lambda: check_tensor_parallel(
                 args.device, torch.float32 if args.smoke else dtypes.compute_dtype(args.device), args.smoke)),
             ("benchmark", lambda: benchmark(args.device, args.smoke))]
    if args.only:
        unknown = set(args.only.split(",")) - {name for name, _ in steps}
        if unknown:
            p.error(f"unknown steps: {', '.join(sorted(unknown))}")
        steps = [(name, run) for name, run in steps if name in args.only.split(",")]
    if args.isolate:
        from specserve.gpu.steps import run_isolated

        extra = ["--device", args.device] + (["--smoke"] if args.smoke else [])
        with tempfile.TemporaryDirectory() as tmp:
            report = run_isolated([name for name, _ in steps], args.isolate, extra, args.json, Path(tmp))
        steps = []  # run above
    for name, run in steps:
        t0 = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            report[name] = run()
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "where": traceback.format_exc(limit=-6).splitlines()[-14:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"gpu-check: {name}: {'ok' if report[name]['ok'] else 'FAILED'} "
              f"{json.dumps({k: v for k, v in report[name].items() if k != 'ok'})}", flush=True)
        if args.json:  # after every step: a run stopped midway leaves what it did
            Path(args.json).write_text(json.dumps(report, indent=2))
    failed = [name for name, value in report.items() if isinstance(value, dict) and not value["ok"]]
    print("gpu-check: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
