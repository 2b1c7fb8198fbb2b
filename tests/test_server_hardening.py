"""`flashnext serve` under hostile or unlucky input: no request can stop the server or freeze its event loop.

A step that raises fails only its request; numeric fields are bounded at the door; bodies are size-limited, parsed
and tokenized off the event loop; malformed bodies get 400 error objects, never plain-text 500s; an empty API key
is refused at start; /metrics shows running and waiting requests.
"""

import contextlib
import json
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

from fixtures import write_tiny_hf_model
from flashnext.core import server as server_module
from flashnext.core.async_engine import AsyncEngine
from flashnext.core.cli import app as cli_app
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM
from flashnext.core.metrics import ServerMetrics
from test_server import _wait, assert_error, metric, running

POISON = 97  # a prompt starting with this id makes the patched runner raise, as a bad embedding lookup would


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    return LLM(str(model), backend="cpu", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_max_gib=0.02)


@pytest.fixture(scope="module")
def client(llm):
    with running(llm) as c:
        yield c


def _all_free(client) -> bool:
    h = client.get("/health").json()
    return (
        h["requests"] == {"running": 0, "waiting": 0} and h["kv_cache"]["blocks_free"] == h["kv_cache"]["blocks_total"]
    )


# -- 1. a step that raises fails its request, not the server ------------------------------------------------------
def test_step_exception_fails_only_its_request(client, llm, monkeypatch):
    step = llm.engine.runner.step

    failed_batches = []

    def poisoned_step(inputs):
        if any(item.seq.prompt_ids[0] == POISON for item in inputs.batch):
            failed_batches.append(len(inputs.batch))
            raise IndexError("index out of range in self")
        return step(inputs)

    monkeypatch.setattr(llm.engine.runner, "step", poisoned_step)
    steady = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    errors_before = metric(client, "flashnext_requests_total", status="error")
    with client.stream("POST", "/v1/completions", json={**steady, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(lines)  # the steady request is running: the poisoned one joins its batch
        failed = client.post("/v1/completions", json={"prompt": [POISON, 1, 2], "max_tokens": 4})
        rest = [first, *lines]
    assert max(failed_batches) > 1  # the poisoned request failed a batch it shared, which was then rerun
    error = assert_error(failed, 500, code="engine_error")
    assert error["type"] == "server_error" and "IndexError" in error["message"]
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    concurrent_text = "".join(c["choices"][0]["text"] for c in chunks)
    later = client.post("/v1/completions", json=steady)  # the same request alone, after the failure
    assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 200
    assert later.json()["choices"][0]["text"] == concurrent_text  # the retried batch computed the same tokens
    assert client.get("/health").json()["status"] == "ok"
    assert metric(client, "flashnext_requests_total", status="error") == errors_before + 1
    _wait(lambda: _all_free(client), "blocks freed after the failed request", timeout=5)


def test_engine_step_isolates_the_failing_request(tmp_path):
    """The engine itself: a batch of three with one poisoned request finishes that one with "error" and its blocks
    freed; the other two get the tokens they would have got without it. Without isolate_failures it raises."""
    llm = LLM(str(write_tiny_hf_model(tmp_path)), backend="cpu", kv_cache_max_gib=0.01)
    engine, step = llm.engine, llm.engine.runner.step
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    solo = [s.output_ids for s in engine.generate([[3, 4, 5], [6, 7]], params)]
    engine.runner.step = lambda inputs: (
        (_ for _ in ()).throw(IndexError("bad id"))
        if any(i.seq.prompt_ids[0] == POISON for i in inputs.batch)
        else step(inputs)
    )
    seqs = [engine.add_request(p, params) for p in ([3, 4, 5], [POISON, 1], [6, 7])]
    outputs = engine.step(isolate_failures=True)
    assert [(o.seq is seqs[1], o.finished, o.error) for o in outputs if o.error] == [(True, True, "IndexError: bad id")]
    assert seqs[1].finish_reason == "error" and not seqs[1].block_table
    while engine.has_work():
        engine.step(isolate_failures=True)
    assert [seqs[0].output_ids, seqs[2].output_ids] == solo
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.add_request([POISON, 2], params)
    with pytest.raises(IndexError):
        engine.step()


def test_streamed_request_failure_is_an_error_event(client, llm, monkeypatch):
    step = llm.engine.runner.step
    monkeypatch.setattr(
        llm.engine.runner,
        "step",
        lambda inputs: (
            (_ for _ in ()).throw(OverflowError("too big"))
            if inputs.batch[0].seq.prompt_ids[0] == POISON
            else step(inputs)
        ),
    )
    r = client.post("/v1/completions", json={"prompt": [POISON, 3], "max_tokens": 4, "stream": True})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[-1]["error"]["type"] == "server_error" and "OverflowError" in events[-1]["error"]["message"]
    assert r.text.endswith("data: [DONE]\n\n")
    assert client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}).status_code == 200


def test_failure_outside_any_request_fails_the_running_ones_and_serving_goes_on(client, llm, monkeypatch):
    def broken_step(isolate_failures=False):
        raise RuntimeError("scheduler boom")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500, code="engine_error"
    )
    assert "scheduler boom" in error["message"]
    monkeypatch.undo()
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    _wait(lambda: _all_free(client), "blocks freed", timeout=5)


def test_warm_up_failure_marks_the_server_failed(llm, monkeypatch):
    def broken_step(isolate_failures=False):
        raise RuntimeError("no device")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    engine = AsyncEngine(llm, ServerMetrics(llm.engine), max_queue=1)
    engine.start()
    engine.thread.join(10)
    assert not engine.thread.is_alive() and engine.status == "error"
    for seq in list(llm.engine.scheduler.waiting):  # the warm-up request the broken step never ran
        llm.engine.abort(seq)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "top_k": 2**63}, "top_k"),
        ({"prompt": "hi", "top_k": 10**30, "temperature": 0}, "top_k"),
        ({"prompt": "hi", "top_k": 321}, "top_k"),  # the vocabulary has 320 tokens
        ({"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1025}, "max_tokens"),  # the context holds 1024
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
        ({"prompt": "hi", "stop": "x" * 1001}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [320]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"prompt": [1, 2**70]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "hi", "logprobs": 5}, "logprobs"),
        ({"prompt": "hi", "top_logprobs": 5}, "top_logprobs"),
    ],
)
def test_numeric_fields_are_bounded_at_the_door(client, body, param):
    error = assert_error(
        client.post("/v1/completions", json=body), 400, param, "unsupported_parameter" if "logprobs" in param else None
    )
    assert len(error["message"]) < 400


def test_chat_bounds_and_edge_values_that_are_allowed(client):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(
        client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 2**64}), 400, "max_completion_tokens"
    )
    assert_error(client.post("/v1/chat/completions", json={**chat, "top_k": 2**63}), 400, "top_k")
    ok = client.post(
        "/v1/completions",
        json={"prompt": "hi", "top_k": 320, "seed": 2**63 - 1, "max_tokens": 2, "temperature": 2.0, "stop": ["a"] * 16},
    )
    assert ok.status_code == 200, ok.text


# -- 4. a large request does not freeze the server -----------------------------------------------------------------
def test_oversized_body_is_413(llm):
    with running(llm, max_body_mib=0.01) as c:  # 10,485 bytes
        big = {"prompt": "word " * 3000}
        assert_error(c.post("/v1/completions", json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            for _ in range(30):
                yield b" " * 1000

        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_health_stays_responsive_while_a_large_prompt_is_tokenized(client, llm, monkeypatch):
    encode = llm.tokenizer.encode
    started = threading.Event()

    def slow_encode(text, *args, **kwargs):  # a tokenizer busy for 2 s, as with a prompt of megabytes
        started.set()
        deadline = time.perf_counter() + 2.0
        while time.perf_counter() < deadline:
            encode(text[:2000], *args, **kwargs)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", slow_encode)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            r=client.post("/v1/completions", json={"prompt": "long " * 20000, "max_tokens": 1})
        )
    )
    worker.start()
    assert started.wait(10)
    latencies = []
    while worker.is_alive() and len(latencies) < 50:
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join(30)
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    assert_error(result["r"], 400, "prompt", "context_length_exceeded")


def test_a_stalled_body_times_out_with_408(llm, monkeypatch):
    monkeypatch.setattr(server_module, "BODY_READ_TIMEOUT_S", 0.5)
    with running(llm) as c:
        port = int(str(c.base_url).rsplit(":", 1)[1].strip("/"))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            reply = b""
            while chunk := s.recv(65536):  # the server closes the connection after its answer
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408")
        assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


# -- 5. an empty API key fails closed ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, args", [({"FLASHNEXT_API_KEY": ""}, []), ({"FLASHNEXT_API_KEY": "  "}, []), ({}, ["--api-key", ""])]
)
def test_empty_api_key_refuses_to_start(env, args, tmp_path):
    result = CliRunner().invoke(cli_app, ["serve", "--model", str(tmp_path / "never-loaded"), *args], env=env)
    assert result.exit_code == 2
    assert "API_KEY is empty" in result.output and len(result.output.strip().splitlines()) == 1


# -- 9. malformed bodies are 400 error objects; bearer is case-insensitive; gauges ----------------------------------
def test_deeply_nested_body_is_400(client):
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = assert_error(client.post("/v1/completions", content=body), 400)
    assert "nested too deeply" in error["message"]
    shallow = b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}"  # parses, then is not a prompt
    assert_error(client.post("/v1/completions", content=shallow), 400, "prompt")


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": "abc \\ud800 def"}', "prompt"),
        (b'{"prompt": "ok", "stop": ["\\udfff"]}', "stop.0"),
        (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
    ],
)
def test_lone_surrogate_is_400(client, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert "surrogate" in assert_error(client.post(path, content=body), 400, param)["message"]


def test_other_malformed_bodies_are_400(client):
    assert_error(client.post("/v1/completions", content=b'{"prompt": "\xed\xa0\x80"}'), 400)  # not UTF-8
    assert_error(client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}'), 400)
    assert_error(client.post("/v1/completions", content=b'{"prompt": "hi", "top_p": Infinity}'), 400)
    # A paired surrogate escape is an ordinary character.
    ok = client.post("/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}')
    assert ok.status_code == 200, ok.text


def test_unexpected_exception_is_a_500_error_object(client, monkeypatch):
    monkeypatch.setattr(server_module.Server, "model_card", lambda self: 1 / 0)
    error = assert_error(client.get("/v1/models"), 500, code="internal_error")
    assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]


def test_bearer_scheme_is_case_insensitive(llm):
    with running(llm, api_key="s3cret") as c:
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("bearer nope", "Basic s3cret", "s3cret", "bearer", "Bearer s3cret2"):
            assert_error(c.get("/v1/models", headers={"Authorization": header}), 401, code="invalid_api_key")


def test_metrics_has_running_and_waiting_gauges(client):
    text = client.get("/metrics").text
    assert "# TYPE flashnext_requests_running gauge" in text and "# TYPE flashnext_requests_waiting gauge" in text
    assert metric(client, "flashnext_requests_running") == 0
    long = {"prompt": [9, 9, 9], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as streams:
        readers = []
        for _ in range(6):  # 4 running slots: 2 wait
            r = streams.enter_context(client.stream("POST", "/v1/completions", json=long))
            readers.append(r.iter_lines())
        next(readers[0])
        _wait(
            lambda: (
                metric(client, "flashnext_requests_running") == 4 and metric(client, "flashnext_requests_waiting") == 2
            ),
            "4 running and 2 waiting",
            timeout=10,
        )
    _wait(lambda: _all_free(client), "blocks freed", timeout=10)
    assert metric(client, "flashnext_requests_running") == 0 and metric(client, "flashnext_requests_waiting") == 0
