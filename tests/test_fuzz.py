"""Bad input at scale: schemathesis generates request bodies from the OpenAPI schema the server
publishes, valid ones and ones that break it, and sends them to a live app. Every answer must be a
success or an error in OpenAI's body with a 4xx status: never a 5xx, never another shape. The app
serves an operator's chat template (one that reads a request's template variable), so the fuzzed
template controls reach a template, and loads its pair from object storage; the template controls
and the object-storage loading themselves are tested here too.

`make fuzz` runs 1000 cases per endpoint and mode; the suite runs FUZZ_CASES (default 60).
"""

import collections
import importlib.metadata
import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from serving import S3Server, running_app, save_tiny_pair

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("FUZZ_CASES", "60"))
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]
ERROR_KEYS = {"message", "type", "param", "code"}
# the operator's template (args.chat_template): it reads a variable requests may pass
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% if brief is defined and brief %} (briefly){% endif %} {% endif %}")


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def app(tmp_path_factory, s3):
    """The app, its pair served from object storage (an S3-compatible server on loopback) through a
    node cache: the builder and two ingress replicas read the target's config and tokenizer, the
    model replicas the whole of their own model."""
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    sources = s3.upload(target, "pair/target"), s3.upload(draft, "pair/draft")
    s3.expected = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"])
    s3.start_recording()
    env = {**s3.env, "SPECSERVE_MODEL_CACHE": str(tmp_path_factory.mktemp("model-cache"))}
    # a small max_tokens cap keeps a thousand valid generations short
    with running_app(*sources, args={"limits": {"max_tokens_cap": 8}, "chat_template": TEMPLATE}, env=env,
                     deployments={"Ingress": {"num_replicas": 2}}, compiled=False) as url:
        yield url


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
@pytest.mark.parametrize("path, method", OPERATIONS, ids=[p for p, _ in OPERATIONS])
def test_generated_bodies_get_a_success_or_an_openai_error(app, path, method, mode):
    schema = schemathesis.openapi.from_url(f"{app}/openapi.json")
    operation = schema[path][method]
    statuses, bad, reasons = collections.Counter(), [], collections.Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def send(case):
        response = case.call(base_url=app, timeout=120)
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            bad.append((response.status_code, case.body, response.text[:300]))
        elif response.status_code >= 400:
            try:
                error = response.json()["error"]
                assert set(error) == ERROR_KEYS and isinstance(error["message"], str)
                reasons[error["param"]] += 1
            except (ValueError, KeyError, TypeError, AssertionError):
                bad.append((response.status_code, case.body, response.text[:300]))
        elif not answered(response):
            bad.append((response.status_code, case.body, response.text[:300]))

    send()
    print(f"\n[fuzz] {path} {mode.value}: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}, "
          f"400s by param {dict(reasons.most_common(8))}")
    assert sum(statuses.values()) >= min(CASES, 20)
    assert not bad, bad[:5]


def answered(response) -> bool:
    """A 200: a completion body, or a stream of events ending with [DONE] whose every event is a chunk or
    an error in OpenAI's body."""
    kind = response.headers.get("content-type") or ""
    if not (kind[0] if isinstance(kind, list) else kind).startswith("text/event-stream"):
        return "choices" in response.json()
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            return set(event["error"]) == ERROR_KEYS
        if "choices" not in event:
            return False
    return True


def test_template_controls_through_http(app):
    """The operator's template serves; a request's chat_template_kwargs reach it, continue_final_message
    continues the assistant's text (the same tokens as completing the rendered prompt), and a request's
    own template is refused where the operator does not trust them."""
    chat = {"model": "target", "messages": [{"role": "user", "content": "hi"}]}
    brief = httpx.post(f"{app}/tokenize", json={**chat, "chat_template_kwargs": {"brief": True}}, timeout=60).json()
    plain = httpx.post(f"{app}/tokenize", json=chat, timeout=60).json()
    text = httpx.post(f"{app}/detokenize", json={"tokens": brief["tokens"]}, timeout=60).json()["prompt"]
    assert text.endswith("assistant: (briefly) ")
    assert brief["count"] > plain["count"]
    assert brief["max_model_len"] == plain["max_model_len"]
    prefill = {"model": "target", "add_generation_prompt": False, "continue_final_message": True,
               "messages": [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return"}]}
    ids = httpx.post(f"{app}/tokenize", json=prefill, timeout=60).json()["tokens"]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    continued = httpx.post(f"{app}/v1/chat/completions", json={**prefill, **greedy}, timeout=120).json()
    completed = httpx.post(f"{app}/v1/completions", json={"model": "target", "prompt": ids, **greedy}, timeout=120).json()
    assert continued["choices"][0]["message"]["content"] == completed["choices"][0]["text"]
    assert continued["usage"]["prompt_tokens"] == len(ids)
    refused = httpx.post(f"{app}/v1/chat/completions", json={**chat, "chat_template": "{{ messages }}"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    refused = httpx.post(f"{app}/tokenize", json={**chat, "chat_template": "{{ messages }}"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_models_and_version_say_what_clients_budget_with(app):
    (model,) = httpx.get(f"{app}/v1/models", timeout=60).json()["data"]
    assert model["id"] == "target" and model["owned_by"] == "specserve"
    assert model["max_model_len"] == httpx.post(f"{app}/tokenize", json={"prompt": "x"}, timeout=60).json()["max_model_len"]
    assert isinstance(model["created"], int) and model["created"] > 1_700_000_000
    assert httpx.get(f"{app}/version", timeout=60).json() == {"version": importlib.metadata.version("specserve")}


def test_models_from_object_storage_are_fetched_once_per_node(app, s3):
    """Builder, two ingress replicas, the target and the draft replica all resolved their s3:// models on
    this one node: every object was fetched exactly once, and the app answers from them."""
    r = httpx.post(f"{app}/v1/completions", json={"model": "target", "prompt": "def f", "max_tokens": 4,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    fetched = collections.Counter(s3.gets())
    assert sorted(fetched) == [k.removeprefix(f"{s3.bucket}/") for k in s3.expected]
    assert set(fetched.values()) == {1}, fetched
