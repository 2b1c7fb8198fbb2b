import pytest

from fixtures import write_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint folder, written once per session."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")
