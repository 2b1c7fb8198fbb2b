import atexit
import os
import shutil
import tempfile

import pytest
import torch

from fixtures import write_tiny_hf_model

# The rknpu backend defaults to rknn-toolkit2's simulator where a toolkit venv exists (.venv-rknn); tests that want
# it point FLASHNEXT_RKNN_TOOLKIT_PYTHON at a stand-in, the rest run onnxruntime wherever they run.
os.environ["FLASHNEXT_RKNN_TOOLKIT_PYTHON"] = ""
# Converted GGUFs go to a cache of the run's own (child processes inherit it): every run writes fresh fixture files,
# whose entries would pile up in the user's cache.
os.environ["FLASHNEXT_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashnext-test-cache-")
atexit.register(shutil.rmtree, os.environ["FLASHNEXT_CACHE_DIR"], True)


def pytest_configure(config):
    # Under `pytest -n N` each worker takes its share of the cores: more OpenMP threads than cores makes every op
    # wait on descheduled threads at its barrier (measured: 3x slower suites on 2 cores).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint folder, written once per session."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_random():
    """Random bf16 weights of a tiny Qwen3 shape, built the way `flashnext bench --shape` builds real shapes."""
    import torch

    from flashnext.core.cli_bench import SHAPES, random_model
    from flashnext.core.config import ModelConfig

    SHAPES["tiny-test"] = ModelConfig(
        architecture="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qk_norm=True,
    )
    try:
        return random_model("tiny-test", torch.device("cpu"))
    finally:
        del SHAPES["tiny-test"]


@pytest.fixture(scope="session")
def rknpu_export(tiny_llama, tmp_path_factory):
    """The tiny Llama exported for rk3588 (int4, batch 4, chunk 16, context 128), checked; (folder, manifest)."""
    from flashnext.core.loader import load_model
    from flashnext.plugins.rknpu.export import export
    from rknpu_fakes import CHUNK, CONTEXT

    out = tmp_path_factory.mktemp("rknpu-tiny")
    return out, export(load_model(str(tiny_llama)), out, chunk=CHUNK, context=CONTEXT)
