"""Bad input at scale: schemathesis generates request bodies from the OpenAPI schema the server
publishes, valid ones and ones that break it, and sends them to a live app. Every answer must be a
success or an error in OpenAI's body with a 4xx status: never a 5xx, never another shape.

`make fuzz` runs 1000 cases per endpoint and mode; the suite runs FUZZ_CASES (default 60).
"""

import collections
import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("FUZZ_CASES", "60"))
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    # a small max_tokens cap keeps a thousand valid generations short
    with running_app(*pair, args={"limits": {"max_tokens_cap": 8}}, compiled=False) as url:
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
