"""`flashnext serve` unit tests: a real uvicorn server on a loopback port in a thread, over a tiny random model."""

import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fixtures import write_tiny_hf_model
from flashnext.core.async_engine import NotReady
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.server import create_app

LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}  # runs for seconds: time to hang up mid-way


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096))


@pytest.fixture(scope="module")
def llm(tiny):
    # A 16-token step budget makes a 60-token prompt prefill in chunks; a long context allows long generations.
    return LLM(tiny, backend="cpu", max_num_seqs=2, max_num_batched_tokens=16, kv_cache_max_gib=0.05)


@contextlib.contextmanager
def running(llm, **options):
    """Serve `create_app(llm, **options)` on an ephemeral loopback port; yields an httpx client once healthy."""
    server = uvicorn.Server(uvicorn.Config(create_app(llm, **options), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, "uvicorn start")
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _wait(lambda: client.get("/health").json()["status"] == "ok", "warm-up")
            yield client
    finally:
        server.should_exit = True
        thread.join(30)


def _wait(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def client(llm):
    with running(llm) as c:
        yield c


def metric(client, name: str, **labels) -> float:
    """A sample's value from /metrics (0 when absent)."""
    headers = {"Authorization": client.headers.get("Authorization", "")}
    for family in text_string_to_metric_families(client.get("/metrics", headers=headers).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sse_events(response) -> list:
    """Parse an SSE body: every event must be one `data: ...` line followed by a blank line."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


def assert_error(response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    assert error["code"] == code
    return error


def test_completion_json_sse_and_token_ids_agree(client, llm):
    prompt = "The quick brown fox jumps over"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == llm.info.model
    choice = body["choices"][0]
    ids = llm.tokenizer.encode(prompt)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    assert choice["finish_reason"] == "length"
    stream = client.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert stream.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(stream)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    # Token ids as the prompt give the same answer.
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == choice["text"]


def test_chat_stream_and_not_agree(client, llm):
    req = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    whole = client.post("/v1/chat/completions", json=req).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and whole["usage"]["completion_tokens"] == 10
    chunks = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == message["content"]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_stop_strings_cut_the_text(client):
    base = {"prompt": "Hello world! hello there", "max_tokens": 24, "temperature": 0}
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[6:9]
    want = text[: text.find(stop)]
    before = metric(client, "flashnext_requests_total", status="stop")
    for stream in (False, True):
        r = client.post("/v1/completions", json={**base, "stop": [stop, "\x00never"], "stream": stream})
        if stream:
            chunks = sse_events(r)
            got = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            got, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (got, reason) == (want, "stop")
    assert metric(client, "flashnext_requests_total", status="stop") == before + 2


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature", None),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature", None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", None),
        ("/v1/completions", {"prompt": "   "}, "prompt", None),
        ("/v1/completions", {"prompt": []}, "prompt", None),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", None),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", None),
        ("/v1/completions", {"prompt": [5] * 5000}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n", None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop", None),
        ("/v1/completions", {"max_tokens": 3}, "prompt", None),
        ("/v1/chat/completions", {"messages": []}, "messages", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "messages", None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", None),
    ],
)
def test_validation_errors_are_400(client, path, body, param, code):
    assert_error(client.post(path, json=body), 400, param, code)


def test_bad_json_unknown_model_and_route(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    assert "not valid JSON" in assert_error(r, 400)["message"]
    assert_error(client.post("/v1/completions", content=b"[1]"), 400)
    error = assert_error(
        client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model", "model_not_found"
    )
    assert "gpt-9" in error["message"]
    assert_error(client.get("/v1/models/gpt-9"), 404, "model", "model_not_found")
    assert_error(client.get("/v1/nothing"), 404)


def test_models_and_health_shape(client, llm):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [llm.info.model]
    assert client.get(f"/v1/models/{llm.info.model}").json()["id"] == llm.info.model
    health = client.get("/health").json()
    assert set(health) >= {"status", "backend", "model", "precision", "optimizations", "kv_cache", "requests"}
    assert health["status"] == "ok" and health["backend"] == "cpu" and health["precision"] == "fp32"
    assert set(health["optimizations"]) == {"cuda_graphs", "chunked_prefill", "spec_decode", "prefix_caching"}
    assert health["optimizations"]["chunked_prefill"] is True and health["optimizations"]["cuda_graphs"] is False
    assert health["kv_cache"]["blocks_total"] == llm.engine.blocks.num_blocks
    assert health["kv_cache"]["blocks_free"] == health["kv_cache"]["blocks_total"]
    assert health["requests"] == {"running": 0, "waiting": 0}


def test_health_says_starting_before_warm_up(llm):
    server = create_app(llm).state.server
    r = server.health()
    assert r.status_code == 503 and json.loads(r.body)["status"] == "starting"
    with pytest.raises(NotReady, match="starting"):
        server.async_engine.submit([1, 2], SamplingParams(), "r1")


DESIGN_METRICS = [
    "flashnext_cuda_graph_captures_total",
    "flashnext_cuda_graph_replays_total",
    "flashnext_chunked_prefill_chunks_total",
    "flashnext_spec_decode_drafts_total",
    "flashnext_spec_decode_draft_tokens_total",
    "flashnext_spec_decode_accepted_tokens_total",
    "flashnext_spec_decode_accepted_tokens_per_pos_total",
    "flashnext_time_to_first_token_seconds",
    "flashnext_inter_token_latency_seconds",
    "flashnext_kv_cache_usage_ratio",
    "flashnext_preemptions_total",
    "flashnext_requests_total",
    "flashnext_prefix_cache_hits_total",
    "flashnext_cuda_graph_memory_bytes",
]


def test_metrics_names_and_counts(client, llm):
    names = [
        "flashnext_requests_total",
        "flashnext_time_to_first_token_seconds_count",
        "flashnext_inter_token_latency_seconds_count",
        "flashnext_prefix_cache_hits_total",
    ]
    before = [metric(client, n, **({"status": "length"} if n.endswith("requests_total") else {})) for n in names]
    prompt = "0123456789" * 8
    full_blocks = len(llm.tokenizer.encode(prompt)) // llm.engine.blocks.block_size
    for _ in range(3):  # the same prompt three times: the last two reuse its full blocks
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    text = client.get("/metrics").text
    for name in DESIGN_METRICS:
        assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, name
    after = [metric(client, n, **({"status": "length"} if n.endswith("requests_total") else {})) for n in names]
    requests, ttft, itl, hits = (a - b for a, b in zip(after, before))
    assert (requests, ttft, itl) == (3, 3, 9)
    assert hits == 2 * full_blocks and full_blocks >= 2
    assert metric(client, "flashnext_kv_cache_usage_ratio") == 0.0


def test_profile_header_turns_chunking_off_per_request(client):
    prompt = "To be, or not to be, that is the question. " * 6  # ~60 tokens over a 16-token step budget
    chunks = lambda: metric(client, "flashnext_chunked_prefill_chunks_total")  # noqa: E731
    texts = {}
    for profile in ("basic", "full"):
        before = chunks()
        r = client.post(
            "/v1/completions",
            headers={"X-Flashnext-Profile": profile},
            json={"prompt": f"{profile}: {prompt}", "max_tokens": 6, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        texts[profile] = chunks() - before
    assert texts == {"basic": 0, "full": texts["full"]} and texts["full"] >= 3
    assert_error(
        client.post("/v1/completions", headers={"X-Flashnext-Profile": "turbo"}, json={"prompt": "hi"}),
        400,
        "X-Flashnext-Profile",
    )


def test_profile_header_turns_spec_decoding_off_per_request(tiny):
    with running(LLM(tiny, backend="cpu", spec="ngram", kv_cache_max_gib=0.05)) as c:
        assert c.get("/health").json()["optimizations"]["spec_decode"] is True
        req = {"prompt": "hello world, hello there, " * 8, "max_tokens": 24, "temperature": 0}
        runs = {}
        for profile in ("basic", "full"):
            before = metric(c, "flashnext_spec_decode_drafts_total")
            r = c.post("/v1/completions", headers={"X-Flashnext-Profile": profile}, json=req)
            runs[profile] = r.json()["choices"][0]["text"], metric(c, "flashnext_spec_decode_drafts_total") - before
        assert runs["basic"][1] == 0 and runs["full"][1] > 0
        assert runs["basic"][0] == runs["full"][0]  # speculative decoding is exact
        text = c.get("/metrics").text
        assert 'flashnext_spec_decode_accepted_tokens_per_pos_total{position="0"}' in text
        drafted = metric(c, "flashnext_spec_decode_draft_tokens_total")
        assert drafted >= metric(c, "flashnext_spec_decode_accepted_tokens_total") and drafted > 0
        assert 'flashnext_spec_decode_path_info{method="ngram",path="engine"} 1.0' in text
        spec = c.get("/health").json()["spec"]  # the engine drafts between steps on the CPU
        assert spec["method"] == "ngram" and spec["path"] == "engine" and spec["drafted"] == drafted
        assert spec["acceptance_rate"] == round(spec["accepted"] / drafted, 4)


def test_engine_failure_is_an_error_not_a_hang(tiny):
    llm = LLM(tiny, backend="cpu", kv_cache_max_gib=0.05)
    with running(llm) as c:

        def broken_step(isolate_failures=False):
            raise RuntimeError("boom")

        llm.engine.step = broken_step
        error = assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 500, code="engine_error")
        assert "boom" in error["message"]
        assert metric(c, "flashnext_requests_total", status="error") == 1
        health = c.get("/health")  # the loop survives: a later request is served once steps work again
        assert health.status_code == 200 and health.json()["requests"] == {"running": 0, "waiting": 0}
        del llm.engine.step
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(llm):
    with running(llm, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert_error(c.get(path), 401, code="invalid_api_key")
            assert_error(c.get(path, headers={"Authorization": "Bearer nope"}), 401, code="invalid_api_key")
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 401, code="invalid_api_key")
        ok = c.post(
            "/v1/completions", headers={"Authorization": "Bearer s3cret"}, json={"prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200


def _all_free(client) -> bool:
    h = client.get("/health").json()
    kv = h["kv_cache"]
    return h["requests"] == {"running": 0, "waiting": 0} and kv["blocks_free"] == kv["blocks_total"]


def test_queue_full_is_429_and_hangups_free_blocks(llm):
    """Two running slots and no queue: a third request is refused; closing the streams frees every block."""
    with running(llm, max_queue=0) as c:
        with contextlib.ExitStack() as streams:
            readers = []  # dropping a line iterator would close its connection
            for i in range(2):
                r = streams.enter_context(
                    c.stream("POST", "/v1/completions", json={"prompt": f"{i} hi", **LONG, "stream": True})
                )
                readers.append(r.iter_lines())
                next(readers[-1])  # the first token came: the request is running
            error = assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 429, code="queue_full")
            assert "capacity" in error["message"]
            assert c.get("/health").json()["kv_cache"]["blocks_free"] < llm.engine.blocks.num_blocks
        _wait(lambda: _all_free(c), "blocks freed after hang-up", timeout=5)
        assert metric(c, "flashnext_requests_total", status="abort") == 2
        assert metric(c, "flashnext_requests_total", status="rejected") == 1
        # A non-streamed request whose client gives up is cancelled too.
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "wait", **LONG}, timeout=1.0)
        _wait(lambda: _all_free(c), "blocks freed after a timed-out client", timeout=5)
        assert metric(c, "flashnext_requests_total", status="abort") == 3


def test_metrics_count_prompt_and_generation_tokens(client):
    names = ("flashnext_prompt_tokens_total", "flashnext_generation_tokens_total")
    before = [metric(client, n) for n in names]
    r = client.post(
        "/v1/completions", json={"prompt": "count these tokens", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = [metric(client, n) for n in names]
    assert (
        [a - b for a, b in zip(after, before)]
        == [usage["prompt_tokens"], usage["completion_tokens"]]
        == [usage["prompt_tokens"], 5]
    )


def test_health_reports_the_thread_count(client, llm):
    import torch

    threads = client.get("/health").json()["threads"]
    assert threads == llm.threads.threads == torch.get_num_threads()


def test_a_max_tokens_lowered_to_the_backends_cap_says_so(tiny):
    """A profile's max_tokens_cap (the RK3588's 64) lowers a larger max_tokens: finish_reason "length", and the
    reason reaches the client in a header and a top-level "warning" field, which the openai client keeps."""
    import openai

    capped = LLM(tiny, backend="cpu", max_num_seqs=2, kv_cache_max_gib=0.02, max_tokens_cap=6)
    with running(capped) as http:
        body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        want = "max_tokens 20 lowered to 6: a request of backend 'cpu' (profile 'full', max_tokens_cap)"
        assert data["warning"].startswith(want) and reply.headers["x-flashnext-warning"] == data["warning"]
        assert data["usage"]["completion_tokens"] == 6 and data["choices"][0]["finish_reason"] == "length"

        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=chat) as streamed:  # no max_tokens: the context's rest
            assert "lowered to 6" in streamed.headers["x-flashnext-warning"]
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert "lowered to 6" in events[0]["warning"] and all("warning" not in e for e in events[1:])
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        within = http.post("/v1/completions", json=body | {"max_tokens": 6})
        assert "warning" not in within.json() and "x-flashnext-warning" not in within.headers

        client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(
            model=capped.info.model, prompt="hello", max_tokens=20, extra_body={"ignore_eos": True}
        )
        assert done.choices[0].finish_reason == "length" and "lowered to 6" in done.model_extra["warning"]
