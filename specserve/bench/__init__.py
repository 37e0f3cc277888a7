"""The benchmarks: `specserve bench` in process (inprocess.py, its modes in runs.py) and over HTTP
(http_sweep.py), the figures both report (figures.py), and the focused ones run as modules:
`python -m specserve.bench.kv` (attention, linears and steps), `.tp` (tensor parallelism),
`.prefill` (chunked prefill beside decoding streams), `.constraint` (speculation under a grammar)."""
