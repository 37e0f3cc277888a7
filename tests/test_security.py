"""Security and bad input against the live app: API keys, secrets kept out of logs, safe defaults, fuzzing.

One cluster for the module, deployed with SPECSERVE_API_KEY set (in the replicas' environment, as a
Kubernetes secret would be, never in the config). All traffic stays on loopback.
"""

import collections
import json
import secrets
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import running_app, save_tiny_pair

KEY = "sk-test-" + secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {KEY}"}
OK_BODY = {"model": "target", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    with running_app(*pair, env={"SPECSERVE_API_KEY": KEY}, compiled=False) as url:
        yield url


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app, timeout=60) as client:
        yield client


def served() -> int:
    """Propose + verify items answered by the draft and target replicas so far."""
    from ray import serve

    return sum(serve.get_deployment_handle(name, "specserve").stats.remote().result(timeout_s=30)["served"]
               for name in ("DraftServer", "TargetServer"))


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    return err


# -- API keys ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}])
def test_v1_needs_the_key_and_a_refusal_touches_no_model(http, headers):
    before = served()
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", OK_BODY),
                               ("POST", "/v1/chat/completions",
                                {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
        r = http.request(method, path, json=body, headers=headers)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
    assert served() == before


@pytest.mark.slow
def test_the_right_key_is_served_and_health_stays_open(http):
    assert http.get("/health").json() == {"status": "ok"}  # probes carry no key
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    before = served()
    r = http.post("/v1/completions", json=OK_BODY, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert served() > before


@pytest.mark.slow
def test_the_http_benchmark_sends_the_key_and_says_when_one_is_wanted(app, tmp_path, capsys, monkeypatch):
    import argparse

    from specserve.bench import http_sweep, inprocess

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')

    def sweep(*extra: str) -> int:
        parser = inprocess.add_bench_arguments(argparse.ArgumentParser())
        return http_sweep.url_cli(parser.parse_args(["--url", app, "--prompts", str(prompts), "--concurrency", "1",
                                                     "--max-tokens", "4", "--modes", "target", "--no-progress",
                                                     *extra]))

    for name in ("SPECSERVE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert sweep() == 1
    assert "HTTP 401: the server wants an API key (--api-key" in capsys.readouterr().err
    assert sweep("--api-key", KEY) == 0
    assert "target" in capsys.readouterr().out
    monkeypatch.setenv("SPECSERVE_API_KEY", KEY)
    assert sweep() == 0


@pytest.mark.slow
def test_the_key_is_never_logged(http):
    import ray

    http.post("/v1/completions", json=OK_BODY, headers=AUTH)
    http.post("/v1/completions", json={**OK_BODY, "model": KEY}, headers=AUTH)  # even echoed input
    http.get("/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}"})
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    # the replicas' own logs: Serve's per-replica, proxy and controller logs, and every worker's stdout/stderr
    files = [p for p in logs.rglob("*") if p.is_file() and (p.parent.name == "serve" or p.name.startswith("worker-"))]
    leaks = [str(p) for p in files if KEY.encode() in p.read_bytes()]
    print(f"\n[key in logs] scanned {len(files)} log files: {len(leaks)} contain the key")
    assert files and not leaks


def test_remote_code_is_off_and_serve_binds_loopback_by_default():
    from cluster.local import load_config
    from deployments.args import AppConfig

    cfg = AppConfig.model_validate(load_config()["applications"][0]["args"])
    assert not cfg.target.trust_remote_code and not cfg.draft.trust_remote_code
    assert load_config()["http_options"]["host"] == "127.0.0.1"


# -- targeted bad input --------------------------------------------------------------------------
BAD = [  # (what, body or raw bytes, status)
    ("prompt of a wrong type", {"prompt": 123}, 400),
    ("messages of a wrong type", {"messages": "hi"}, 400),
    ("message without a role", {"messages": [{"content": "hi"}]}, 400),
    ("message with an unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("no prompt", {}, 400),
    ("no model", {"model": None, "prompt": "x"}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("empty token list", {"prompt": []}, 400),
    ("token id out of the vocabulary", {"prompt": [1, 10**6]}, 400),
    ("negative token id", {"prompt": [-1]}, 400),
    ("huge prompt", {"prompt": "x" * 100_000}, 400),
    ("prompt + max_tokens over the context", {"prompt": "x" * 400, "max_tokens": 200}, 400),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -5}, 400),
    ("absurd max_tokens", {"prompt": "x", "max_tokens": 10**18}, 400),
    ("float max_tokens", {"prompt": "x", "max_tokens": 2.5}, 400),
    ("n over the cap", {"prompt": "x", "n": 1000}, 400),
    ("temperature out of range", {"prompt": "x", "temperature": 9}, 400),
    ("NaN-like temperature", {"prompt": "x", "temperature": "nan"}, 400),
    ("seed too large", {"prompt": "x", "seed": 2**70}, 400),
    ("speculation K negative", {"prompt": "x", "speculation": {"num_tokens": -1}}, 400),
    ("speculation K too large", {"prompt": "x", "speculation": {"num_tokens": 1000}}, 400),
    ("speculation of a wrong type", {"prompt": "x", "speculation": "fast"}, 400),
    ("five stop strings", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("unknown model", {"model": "gpt-99", "prompt": "x"}, 404),
    ("malformed JSON", b'{"model": "target", "prompt": ', 400),
    ("non-UTF-8 bytes", b'{"model": "target", "prompt": "\xff\xfe"}', 400),
    ("a JSON array", b"[]", 400),
    ("a JSON string", b'"prompt"', 400),
    ("empty body", b"", 400),
    ("oversized body", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413),
]


@pytest.mark.slow
@pytest.mark.parametrize("what, body, status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_openai_error(http, what, body, status):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    if isinstance(body, dict):
        content = json.dumps({"model": "target", **body}).encode()
    else:
        content = body
    r = http.post(path, content=content, headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(r, status)


@pytest.mark.slow
def test_wrong_methods_and_paths_get_openai_errors(http):
    assert_openai_error(http.get("/v1/completions", headers=AUTH), 405)
    assert_openai_error(http.post("/v1/nothing", json={}, headers=AUTH), 404)


# -- fuzzing -------------------------------------------------------------------------------------
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
small_tokens = st.integers(-3, 8) | st.sampled_from([10**4, 10**9, 2**63])
fields = {
    "model": st.sampled_from(["target", "target", "nope", ""]) | json_value,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 120), max_size=8) | json_value,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bogus"]) | json_value,
         "content": st.text(max_size=30) | json_value}), max_size=3) | json_value,
    "max_tokens": small_tokens | json_value,
    "max_completion_tokens": small_tokens,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_value,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "top_k": st.integers(-3, 200),
    "seed": st.integers(-5, 2**64),
    "n": st.integers(-1, 3) | json_value,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | json_value,
    "stream": st.booleans() | json_value,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_value}),
    "logprobs": st.none() | json_value,
    "ignore_eos": st.booleans(),
    "speculation": st.fixed_dictionaries({}, optional={"num_tokens": st.integers(-3, 40) | st.just("auto") | json_value,
                                                      "enabled": st.booleans() | json_value}) | json_value,
}
requests = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps({"model": "target", **d}).encode())
    | json_value.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64))
FUZZ_OUTCOMES = collections.Counter()


@pytest.mark.slow
def test_fuzzed_requests_never_get_5xx_and_errors_keep_openais_shape(http):
    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests)
    def check(request):
        path, content = request
        headers = {**AUTH, "content-type": "application/json"}
        with http.stream("POST", path, content=content, headers=headers) as r:
            raw = r.read()
        FUZZ_OUTCOMES[r.status_code] += 1
        assert r.status_code < 500, raw[:300]
        if r.status_code >= 400:
            assert_openai_error(httpx.Response(r.status_code, content=raw))
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])
        else:
            assert r.json()["choices"]

    check()
    print(f"\n[fuzz] {sum(FUZZ_OUTCOMES.values())} generated requests: "
          + ", ".join(f"{code}: {n}" for code, n in sorted(FUZZ_OUTCOMES.items())))
    assert http.post("/v1/completions", json=OK_BODY, headers=AUTH).status_code == 200  # still serving
