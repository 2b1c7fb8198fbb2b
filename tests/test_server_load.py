"""Load: the real `flashnext serve` (a subprocess on a loopback port) driven by the official `openai` client.

300 requests at concurrency 32: completions and chat, streamed and not, prompts of 2 to ~270 tokens; every 10th
client hangs up mid-stream, from a request the server needs thousands of steps to finish (one client process
parses every stream, so on a loaded machine it reads a stream seconds after the server wrote it: a hang-up from a
short request could come after its end and count as "length"). Each other request must return the text (and
finish reason) of a solo greedy run of its prompt, run one at a time after the burst (and equal to
`LLM.generate`); at the end every KV block is free and
/metrics counts exactly what was sent. Long prompts arriving together exercise chunked prefill, repeated ones the
prefix cache.
"""

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures import write_tiny_hf_model
from flashnext.core.engine.sequence import SamplingParams
from flashnext.core.llm import LLM

pytestmark = pytest.mark.slow

API_KEY = f"load-test-{secrets.token_hex(8)}"  # also tells this test's server from another on a reused port
NUM_REQUESTS, CONCURRENCY, HANGUP_EVERY = 300, 32, 10
CONTEXT, HANGUP_MAX_TOKENS = 4096, 4000
STARTUP_S = 600  # importing torch, loading and warming up on a machine other jobs keep busy
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "to",
    "be",
    "or",
    "not",
    "that",
    "is",
    "question",
    "hello",
    "world",
    "again",
]
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i * i // 2)) for i in range(16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("load")
    model = write_tiny_hf_model(folder / "tiny", max_position_embeddings=CONTEXT)
    for attempt in range(3):  # a port found free can be taken by another process before the server binds it
        log_path = folder / f"server-{attempt}.log"
        base, proc, log = _start(model, log_path)
        try:
            if _wait_until_serving(base, proc, log_path):
                yield base, model
                return
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    pytest.fail(f"the server never bound a port in 3 attempts: {log_path.read_text()[-2000:]}")


def _start(model, log_path):
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        "from flashnext.core.cli import main; main()",
        "serve",
        "--model",
        str(model),
        "--backend",
        "cpu",
        "--port",
        str(port),
        "--max-num-seqs",
        str(CONCURRENCY),
        "--log-level",
        "warning",
    ]
    log = open(log_path, "w")  # noqa: SIM115 (open for the server's whole life)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FLASHNEXT_API_KEY": API_KEY})
    return f"http://127.0.0.1:{port}", proc, log


def _wait_until_serving(base: str, proc, log_path) -> bool:
    """True once this test's server answers; False when it exited because its port was taken."""
    deadline = time.monotonic() + STARTUP_S
    while not _ours_and_healthy(base):
        if proc.poll() is not None:
            text = log_path.read_text()
            assert "address already in use" in text.lower(), text
            return False
        assert time.monotonic() < deadline, f"the server did not become healthy in {STARTUP_S} s"
        time.sleep(0.2)
    return True


def _ours_and_healthy(base: str) -> bool:
    """Healthy, and asking for this test's own key: another server that took the port answers otherwise."""
    try:
        if httpx.get(f"{base}/health").json()["status"] != "ok":
            return False
        theirs = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer not-the-key"})
        ours = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        return theirs.status_code == 401 and ours.status_code == 200
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _job(i: int) -> dict:
    """Request i: which prompt, endpoint, streaming, and whether its client hangs up."""
    hangup = i % HANGUP_EVERY == HANGUP_EVERY - 1
    return {
        "prompt": (i * 7) % len(PROMPTS) if not hangup else i % 3,
        "chat": i % 2 == 0,
        "hangup": hangup,
        "stream": hangup or i % 3 != 0,
    }


def _max_tokens(prompt_index: int) -> int:
    return 8 + (prompt_index * 5) % 25


async def _run(client: openai.AsyncOpenAI, model: str, job: dict) -> tuple[str, str | None]:
    """(text, finish reason) of one request; a hang-up returns ("", None) after two chunks."""
    prompt = PROMPTS[job["prompt"]]
    args = {"model": model, "temperature": 0, "stream": job["stream"]}
    if job["hangup"]:  # long enough that it is still running when its client leaves
        args.update(max_tokens=HANGUP_MAX_TOKENS, extra_body={"ignore_eos": True})
    else:
        args.update(max_tokens=_max_tokens(job["prompt"]))
    if job["chat"]:
        result = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **args)
    else:
        result = await client.completions.create(prompt=prompt, **args)
    if not job["stream"]:
        choice = result.choices[0]
        return (choice.message.content if job["chat"] else choice.text), choice.finish_reason
    pieces, reason, seen = [], None, 0
    async for chunk in result:
        seen += 1
        if job["hangup"] and seen == 2:
            await result.close()
            return "", None
        if chunk.choices:
            choice = chunk.choices[0]
            pieces.append((choice.delta.content or "") if job["chat"] else choice.text)
            reason = choice.finish_reason or reason
    return "".join(pieces), reason


def _metrics(base: str) -> dict[tuple, float]:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_load_openai_client(server):
    server, model_path = server
    model = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def limited(job):
            async with gate:
                return await _run(client, model, job)

        jobs = [_job(i) for i in range(NUM_REQUESTS)]
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(job) for job in jobs))
        elapsed = time.perf_counter() - start
        # Solo references afterwards, one request at a time: the burst above met a cold prefix cache, these hit it.
        solo = {}
        for p in range(len(PROMPTS)):
            for chat in (False, True):
                solo[p, chat] = await _run(client, model, {"prompt": p, "chat": chat, "hangup": False, "stream": False})
        await client.close()
        return solo, jobs, results, elapsed

    solo, jobs, results, elapsed = asyncio.run(main())
    print(f"\n{NUM_REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f} s")
    mismatches = [
        (job, got, solo[job["prompt"], job["chat"]])
        for job, got in zip(jobs, results)
        if not job["hangup"] and got != solo[job["prompt"], job["chat"]]
    ]
    assert not mismatches, mismatches[:3]
    assert {reason for _, reason in solo.values()} <= {"stop", "length"}
    # The server's solo runs are the Python API's: same text (streamed detokenization included), same reason. With
    # the server's thread count: the automatic choice follows the machine's load, and another reduction order may
    # settle a near tie the other way.
    threads = httpx.get(f"{server}/health").json()["threads"]
    llm = LLM(str(model_path), backend="cpu", threads=threads)
    for (p, chat), reference in solo.items():
        done = llm.generate([PROMPTS[p]], SamplingParams(max_tokens=_max_tokens(p)), chat=chat)[0]
        assert (done.text, done.finish_reason) == reference, (p, chat)

    deadline = time.monotonic() + 60  # hang-ups are freed by the engine's next step, however late it runs
    while True:
        health = httpx.get(f"{server}/health").json()
        kv, running = health["kv_cache"], health["requests"]
        if running == {"running": 0, "waiting": 0} and kv["blocks_free"] == kv["blocks_total"]:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.1)

    hangups = sum(job["hangup"] for job in jobs)
    completed = len(solo) + NUM_REQUESTS - hangups
    metrics = _metrics(server)
    counts = {labels[0][1]: value for (name, labels), value in metrics.items() if name == "flashnext_requests_total"}
    assert counts.get("abort") == hangups
    assert counts.get("stop", 0) + counts.get("length", 0) == completed
    assert set(counts) <= {"abort", "stop", "length"}
    assert metrics["flashnext_time_to_first_token_seconds_count", ()] == completed + hangups
    assert metrics["flashnext_prefix_cache_hits_total", ()] > 0
    assert metrics["flashnext_chunked_prefill_chunks_total", ()] > 0  # long prompts met a full step budget
    assert metrics["flashnext_kv_cache_usage_ratio", ()] == 0.0
