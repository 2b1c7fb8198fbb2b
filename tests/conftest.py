import os

import pytest
import torch

from fixtures import write_tiny_hf_model


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
