"""The API fuzzed from its own /openapi.json with schemathesis, against the live server on a tiny model: bodies that
fit the schema (positive) and bodies that break it (negative), for every route. Pass: no 5xx, every 4xx carries
OpenAI's error shape, every JSON answer matches its schema, and /health is fine afterwards. Bounded: a fixed
number of examples per route and mode, no example database, a small cache so that no answer is long."""


import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvbook.runtime.engine import Engine
from kvbook.serving.server import BackgroundServer
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from .conftest import small_config
from .test_server import KEY_ENV, MODEL

EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 40}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import os
    old = {name: os.environ.get(name) for name in ("XDG_CACHE_HOME", KEY_ENV)}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    os.environ.pop(KEY_ENV, None)
    # 64 positions: an accepted request generates a few dozen tokens at most
    config = small_config(vocab=151936, max_cache_len=64).replace(inference={"output_len": 4})
    try:
        with BackgroundServer(Engine(config, progress=False)) as running:
            yield running
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def served_model_often(case_and_coin):
    """Most generated bodies name some other model (a 404); half of them are given the served model's name, so
    that the fuzzer reaches the checks behind it."""
    case, coin = case_and_coin
    if coin and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def test_fuzz_the_schema_against_the_live_server(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /api/v1/chat/completions", "GET /health", "GET /metrics"}
    statuses: dict[int, int] = {}
    session = requests.Session()
    for operation in operations:
        for mode, examples in EXAMPLES.items():
            if mode is GenerationMode.NEGATIVE and not len(operation.body):
                continue  # nothing to break in a GET without parameters
            strategy = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans()).map(served_model_often)

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def check(case):
                response = case.call(base_url=server.url, session=session, timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code < 500, f"{case.body!r} -> {response.text}"
                if response.status_code >= 400:
                    body = response.json()
                    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, (case.body, response.text)
                    assert body["error"]["message"] and body["error"]["type"]
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                         response_schema_conformance])

            check()
    health = requests.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["running"] == health["waiting"] == 0
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both sides of the schema were reached


@pytest.mark.parametrize("temperature, top_p", [(1e-40, 1.0), (5e-324, 1.0), (0.7, 1e-300), (1e-30, 1e-300)])
def test_sampling_options_at_the_edges_of_float32_answer_greedy(server, temperature, top_p):
    """Found by the fuzzer: a temperature that divides the logits to inf or NaN in float32, or a top_p that rounds
    to 0 there, made torch.multinomial fail (a 500). Their limit is greedy decoding."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    url = server.api_base + "/v1/chat/completions"
    greedy = requests.post(url, json={**body, "temperature": 0}, timeout=60).json()
    edge = requests.post(url, json={**body, "temperature": temperature, "top_p": top_p, "seed": 1}, timeout=60)
    assert edge.status_code == 200, edge.text
    assert edge.json()["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
