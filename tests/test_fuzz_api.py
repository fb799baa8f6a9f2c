"""No 5xx from any input: `ragkv bench fuzz`'s property-based requests (schemathesis over the server's own
OpenAPI document, serve/openapi.py) against a real `ragkv serve` on 127.0.0.1, bounded here to a few hundred
requests with a fixed seed; `ragkv bench fuzz --examples N` runs more."""

import httpx
import pytest

from ragkv.bench.fuzz import ROUTES, FuzzConfig, fuzz
from ragkv.bench.serve import ServerProcess
from tiny import default_model_available

pytest.importorskip("schemathesis")
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=180,
                       cache_dir=tmp_path_factory.mktemp("fuzz"),
                       extra=("--timeout", "120", "--no-startup-profile", "--max-batch", "4")) as s:
        yield s


def test_the_openapi_document_describes_every_request_body(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    for path, method in ROUTES:
        ref = doc["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]


def test_no_generated_request_gets_a_5xx(server):
    result = fuzz(server.url, FuzzConfig(examples=35), say=lambda msg: None)
    assert not result["failures"], result["failures"][:5]
    statuses = result["statuses"]
    assert result["requests"] >= len(ROUTES) * 35 * 0.8 and any(s < 300 for s in statuses), statuses
    assert any(400 <= s < 500 for s in statuses)  # invalid bodies were generated and refused
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # still serving


def test_what_the_long_fuzz_found_is_a_400(server):
    """`ragkv bench fuzz --examples 1700` (10,200 requests) found one 500 (7 times): a prompt list whose second
    prompt is a control character the tokenizer drops ("\\x13": no tokens) reached the engine with an empty query."""
    for prompt in (["\x13", "\x87"], ["\x87", "\x13"], "\x13"):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] in ("prompt", "prompt[0]", "prompt[1]") and "no tokens" in err["message"], err
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "\x87", "max_tokens": 1},
                    timeout=60)
    assert ok.status_code == 200, ok.text  # a control character the tokenizer keeps is a prompt
