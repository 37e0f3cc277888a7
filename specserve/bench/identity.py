"""Greedy identity through a server: speculative output against the same server's plain output.

    python -m specserve.bench.identity [--url http://127.0.0.1:8000] [--max-tokens 64] [--k 4]

Code prompts one at a time and four at a time, and a chat answer, each sent greedy with the server's
speculation (`--k`: a fixed K; default its own choice) and with `{"speculation": {"enabled": false}}`.
Prints a line per prompt (identical or where it parts, times, the round's figures) and ends with
`IDENTICAL n/m`; exits 1 where any differs. Exactness in bfloat16 is batch invariance (docs/architecture.md).
"""

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef moving_average(x, w):",
           "class Stack:\n    def __init__(self):", "# Merge two sorted lists\ndef merge(a, b):",
           "def is_prime(n: int) -> bool:", "def parse_csv_line(line):", "SELECT name, COUNT(*) FROM orders",
           "function debounce(fn, ms) {"]
CHAT = "Explain what a Python generator is, briefly."


def http_post(url: str):
    """A `post(path, body) -> dict` over HTTP to the server at `url`."""
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as response:
            return json.load(response)
    return post


def parts_at(a: str, b: str) -> int | None:
    """The first character where two texts differ, None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(post, model: str, max_tokens: int, k: int | None, concurrency: int = 4, say=print) -> tuple[int, int]:
    """(identical, compared): every prompt plain then speculative one at a time, the speculative ones again
    `concurrency` at a time, and the chat answer both ways."""
    speculative = {"num_tokens": k} if k else {}

    def complete(prompt: str, spec: dict) -> tuple[str, float, dict | None]:
        started = time.perf_counter()
        out = post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                       "speculation": spec})
        return out["choices"][0]["text"], time.perf_counter() - started, out.get("speculation")

    same = total = 0
    plain = {}
    for prompt in PROMPTS:
        plain[prompt], t_off, _ = complete(prompt, {"enabled": False})
        text, t_spec, figures = complete(prompt, speculative)
        at = parts_at(plain[prompt], text)
        same, total = same + (at is None), total + 1
        rounds = figures and {key: figures.get(key) for key in ("rounds", "drafted_tokens", "accepted_tokens")}
        say(f"alone  {prompt[:32]!r:36} {'identical' if at is None else f'parts at {at}'}  "
            f"off {t_off:.1f} s, speculative {t_spec:.1f} s, {rounds}")
    with ThreadPoolExecutor(concurrency) as pool:
        together = list(pool.map(lambda p: complete(p, speculative)[0], PROMPTS))
    for prompt, text in zip(PROMPTS, together):
        at = parts_at(plain[prompt], text)
        same, total = same + (at is None), total + 1
        say(f"x{concurrency}     {prompt[:32]!r:36} {'identical' if at is None else f'parts at {at}'}")
    answers = [post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": CHAT}],
                                             "max_tokens": max_tokens, "temperature": 0, "speculation": spec}
                    )["choices"][0]["message"]["content"] for spec in ({"enabled": False}, speculative)]
    at = parts_at(*answers)
    same, total = same + (at is None), total + 1
    say(f"chat   {CHAT[:32]!r:36} {'identical' if at is None else f'parts at {at}'}")
    return same, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=None, help="a fixed K (default: the server's own choice)")
    args = parser.parse_args(argv)
    with urllib.request.urlopen(args.url + "/v1/models", timeout=60) as response:
        model = json.load(response)["data"][0]["id"]
    same, total = compare(http_post(args.url), model, args.max_tokens, args.k)
    print(f"IDENTICAL {same}/{total}")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
