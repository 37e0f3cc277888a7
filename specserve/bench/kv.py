"""How attention should read a paged KV cache on this machine: ms per layer for each way of reading it.

    python -m specserve.bench.kv [--sequences 16] [--rows 5] [--keys 300] [--heads 4] [--head-dim 64]
    python -m specserve.bench.kv --model DIR [--compile default|off]    # a model's whole forwards
    python -m specserve.bench.kv --model DIR --compile-layers 6,15      # ... by layers a compiled graph
    python -m specserve.bench.kv --model DIR --linears 1,5,16           # a model's linears alone

A batch of `sequences` sequences with `rows` new query rows each and `keys` to `keys + 7 * sequences`
cached positions, in blocks of app.model.kv.BLOCK_SIZE, read four ways: a view of one run of the
`[heads, slots, dim]` pool (what app/model/ragged.py does where a table is one run), the same pool
gathered per sequence (a table in several runs), a `[blocks, heads, 16, dim]` pool gathered per
sequence, one padded, masked SDPA call over the batch, and the paged CPU kernel (app/model/cpu_attention.py:
one call for the batch, tables in one run or scattered; any row count). fp32 and
bf16.
"""

import argparse
import time

import torch

from app.model import cpu_attention
from app.model.kv import BLOCK_SIZE, SequenceCache


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def layouts(sequences: int, rows: int, keys: int, heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(0)
    lens = [keys + 7 * i + rows for i in range(sequences)]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 8
    blocked = torch.randn(num_blocks, heads, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    flat = blocked.permute(1, 0, 2, 3).reshape(heads, num_blocks * BLOCK_SIZE, head_dim).contiguous()
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // BLOCK_SIZE))))
        first += len(tables[-1])
    shuffled = torch.randperm(num_blocks, generator=gen)  # a fragmented pool: every block somewhere else
    queries = [torch.randn(1, heads, rows, head_dim, generator=gen).to(dtype) for _ in lens]
    masks = [torch.arange(n) <= torch.arange(n - rows, n).unsqueeze(1) for n in lens]
    slots = [torch.cat([shuffled[b] * BLOCK_SIZE + torch.arange(BLOCK_SIZE) for b in t])[:n]
             for t, n in zip(tables, lens)]

    def view():
        for q, t, n, m in zip(queries, tables, lens, masks):
            s = t[0] * BLOCK_SIZE
            sdpa(q, flat[:, s : s + n].unsqueeze(0), flat[:, s : s + n].unsqueeze(0), attn_mask=m)

    def gather_slots():
        for q, idx, m in zip(queries, slots, masks):
            kv = flat.index_select(1, idx).unsqueeze(0)
            sdpa(q, kv, kv, attn_mask=m)

    def gather_blocks():
        for q, t, n, m in zip(queries, tables, lens, masks):
            kv = blocked[shuffled[torch.tensor(t)]].transpose(0, 1).reshape(heads, -1, head_dim)[:, :n].unsqueeze(0)
            sdpa(q, kv, kv, attn_mask=m)

    width = max(lens)
    padded_mask = torch.zeros(sequences, 1, rows, width, dtype=torch.bool)
    for i, (n, m) in enumerate(zip(lens, masks)):
        padded_mask[i, 0, :, :n] = m
    padded_slots = torch.stack([torch.nn.functional.pad(s, (0, width - len(s))) for s in slots])
    batch_q = torch.cat(queries)

    def padded():
        kv = flat[:, padded_slots].transpose(0, 1)
        sdpa(batch_q, kv, kv, attn_mask=padded_mask)

    out = {"view of one run": view, "gathered from [heads, slots, dim]": gather_slots,
           "gathered from [blocks, heads, 16, dim]": gather_blocks, "one padded masked call": padded}
    if cpu_attention.usable(dtype, flat.device):
        # the paged kernel (app/model/cpu_attention.py): every sequence in one call, through its block table
        batch = torch.cat(queries, 2)
        result = torch.zeros(1, batch.shape[2], heads, head_dim)
        for name, order in (("paged kernel, tables in one run", list(range(num_blocks))),
                            ("paged kernel, blocks scattered", shuffled.tolist())):
            spans = cpu_attention.Spans([_Span([order[b] for b in t], n - rows, rows, i * rows)
                                         for i, (t, n) in enumerate(zip(tables, lens))])
            out[name] = lambda spans=spans: spans.attend(batch, flat, flat, result, head_dim ** -0.5)
    return out


class _Span:  # app.model.ragged.Span's fields the kernel reads
    def __init__(self, blocks: list[int], start: int, length: int, offset: int):
        self.entry = SequenceCache([], blocks)
        self.start, self.length, self.offset = start, length, offset


def steps(model_dir: str, compile: str, sequences: int, keys: int, repeats: int,
          dtype: torch.dtype = torch.float32, compile_layers: list[int] | None = None) -> dict:
    """ms per whole ragged forward of a model in `dtype`: `sequences` sequences of `keys`+ cached
    positions each taking 1 row (a decode step) and 5 rows (a K = 4 verify), for each CPU attention path;
    or, given `compile_layers`, on the paged path for each number of layers a compiled graph runs. The
    variants' forwards are interleaved, so the machine's drift falls on all alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.model.runner import Execution, ModelRunner, SeqInput

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if compile_layers:
        variants = {f"{n} layers a graph": Execution(attention="cpu_paged", compile=compile, pack=True, compile_layers=n)
                    for n in compile_layers}
    else:
        paths = ["per_sequence"] + (["cpu_paged"] if cpu_attention.usable(dtype, torch.device("cpu")) else [])
        variants = {path: Execution(attention=path, compile=compile, pack=True) for path in paths}  # as served
    runners, contexts = {}, {}
    for name, execution in variants.items():  # a model each: packing rewrites its linears
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        runners[name] = ModelRunner(model, tokenizer, execution)
        runners[name].warm(lambda message: None)
        gen = torch.Generator().manual_seed(0)
        contexts[name] = [torch.randint(3, runners[name].vocab_size, (keys + 7 * i,), generator=gen).tolist()
                          for i in range(sequences)]
        runners[name].forward([SeqInput(f"s{i}", c, 1) for i, c in enumerate(contexts[name])])
    out = {}
    for rows in (1, 5):
        times = {name: [] for name in runners}
        for _ in range(repeats):
            for name, runner in runners.items():
                for c in contexts[name]:
                    c += [7] * rows
                t0 = time.perf_counter()
                runner.forward([SeqInput(f"s{i}", c, rows) for i, c in enumerate(contexts[name])])
                times[name].append((time.perf_counter() - t0) * 1e3)
        out[f"{rows} row{'s' if rows > 1 else ''} per sequence"] = {
            name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return out


def linears(model_dir: str, rows: list[int], repeats: int) -> dict:
    """ms for one pass over every linear of a float32 model (its head included) at each row count: the
    small-row kernel on its packed weights (app/model/cpu_linear.py) and `F.linear`, called in turn, medians."""
    from transformers import AutoModelForCausalLM

    from app.model import cpu_linear

    if not cpu_linear.kernel_available():
        raise SystemExit("the small-row kernel is not built on this machine (no C++ compiler?)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = {id(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}.values()  # tied head once
    packed = [(m.weight, m.bias, cpu_linear.pack(m.weight)) for m in layers]
    nbytes = sum(w.numel() * w.element_size() for w, _, _ in packed)
    out = {}
    with torch.no_grad():
        for r in rows:
            inputs = {w.shape[1]: torch.randn(r, w.shape[1]) for w, _, _ in packed}

            def kernel():
                for w, b, p in packed:
                    torch.ops.specserve.linear(inputs[w.shape[1]], p, b, w.shape[0])

            def plain():
                for w, b, _ in packed:
                    torch.nn.functional.linear(inputs[w.shape[1]], w, b)
            times = {"kernel": [], "F.linear": []}
            for _ in range(repeats):
                for name, fn in (("kernel", kernel), ("F.linear", plain)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            out[r] = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            out[r]["kernel GB/s"] = nbytes / out[r]["kernel"] / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m specserve.bench.kv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--model", help="a model directory: time its whole forwards (median ms) for each CPU "
                    "attention path instead")
    ap.add_argument("--compile", default="default", help="with --model: off, default (compiled steps)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="with --model: its dtype")
    ap.add_argument("--compile-layers", help="with --model: the paged path's forwards for each of these numbers "
                    "of decoder layers a compiled graph runs (e.g. 6,15), instead of each attention path")
    ap.add_argument("--linears", help="with --model: time its linears alone at these row counts (e.g. 1,5,16), "
                    "the small-row kernel against F.linear, float32")
    args = ap.parse_args()
    if args.model and args.linears:
        results = linears(args.model, [int(r) for r in args.linears.split(",")], min(args.repeats, 15))
        print(f"median ms for every linear of the model once, float32, {torch.get_num_threads()} threads")
        print("| rows | kernel | F.linear | kernel GB/s |\n|---|---|---|---|")
        for r, row in results.items():
            print(f"| {r} | {row['kernel']:.1f} | {row['F.linear']:.1f} | {row['kernel GB/s']:.1f} |")
        return
    if args.model:
        layers = [int(n) for n in args.compile_layers.split(",")] if args.compile_layers else None
        results = steps(args.model, args.compile, args.sequences, args.keys, args.repeats, getattr(torch, args.dtype),
                        layers)
        print(f"median ms per forward, {args.dtype}, {args.sequences} sequences x {args.keys}+ keys, "
              f"compile {args.compile}, {torch.get_num_threads()} threads")
        print("| rows | " + " | ".join(next(iter(results.values()))) + " |\n|---|" + "---|" * len(next(iter(results.values()))))
        for name, row in results.items():
            print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row.values()) + " |")
        return
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in layouts(args.sequences, args.rows, args.keys, args.heads, args.head_dim, dtype).items():
            results.setdefault(name, {})[str(dtype).removeprefix("torch.")] = _time(fn, args.repeats)
    print(f"ms per layer, {args.sequences} sequences x {args.rows} rows x {args.keys}+ keys, "
          f"{args.heads} heads x {args.head_dim}, {torch.get_num_threads()} threads")
    print("| KV read as | float32 | bfloat16 |\n|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['float32']:.2f} | {row.get('bfloat16', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
