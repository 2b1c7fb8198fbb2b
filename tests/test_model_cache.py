"""The converted-GGUF cache returns exactly what parsing returns, and notices a changed file."""

import os

import pytest
import torch

from fixtures import write_tiny_gguf
from flashnext.core import model_cache
from flashnext.core.loader import load_model
from flashnext.core.model import tensors_of
from flashnext.core.precision import Int4Weight


def same_weights(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for name, w in a.items():
        v = b[name]
        if isinstance(w, Int4Weight):
            if not (
                isinstance(v, Int4Weight)
                and w.group_size == v.group_size
                and torch.equal(w.packed, v.packed)
                and torch.equal(w.scales, v.scales)
                and torch.equal(w.offsets, v.offsets)
            ):
                return False
        elif not torch.equal(w, v):
            return False
    return True


def test_second_load_comes_from_cache_and_matches(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama", qtype="Q4_1")
    first = load_model(str(path))
    entry = model_cache.entry_for(path)
    assert (entry / "weights.safetensors").is_file()
    second = load_model(str(path))
    assert second.config == first.config
    assert same_weights(first.weights, second.weights)
    text = "hello world <|im_start|> 123"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template


def mapped_rss_kib(path: str) -> int:
    """Resident KiB of this process's maps of `path`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_a_cached_load_maps_the_entry_and_what_it_read_can_leave_memory(tmp_path, monkeypatch):
    """The entry's tensors are views of one map of its file: nothing is read before it is used, and pages dropped
    leave memory and come back from the file, the same values."""
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama", qtype="Q4_1")
    load_model(str(path))
    cached = load_model(str(path))
    stored = str(model_cache.entry_for(path) / "weights.safetensors")
    tensors = [t for w in cached.weights.values() for t in tensors_of(w)]
    values = [t.clone() for t in tensors]  # every page read
    biggest = max(tensors, key=lambda t: t.numel() * t.element_size())
    assert mapped_rss_kib(stored) > 0
    before = mapped_rss_kib(stored)
    model_cache.drop_pages(biggest)
    assert mapped_rss_kib(stored) < before  # its whole pages, not the others'
    model_cache.drop_all_pages()
    assert mapped_rss_kib(stored) == 0
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))  # read again from the file
    elsewhere = torch.ones(1 << 16)
    model_cache.drop_pages(elsewhere)  # not the map's: left alone
    assert elsewhere.sum() == elsewhere.numel()


def test_a_replaced_file_leaves_one_entry_and_other_files_keep_theirs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path / "cache"))
    path, other = tmp_path / "tiny.gguf", tmp_path / "other.gguf"
    write_tiny_gguf(other, arch="llama", qtype="Q4_0")
    load_model(str(other))
    for version in range(3):  # re-downloaded twice: a new size / mtime each time
        write_tiny_gguf(path, arch="llama", qtype="Q4_1", seed=version)
        os.utime(path, ns=(version * 10**9, version * 10**9))
        load_model(str(path))
    entries = sorted((tmp_path / "cache" / "gguf").iterdir())
    assert sorted([model_cache.entry_for(path), model_cache.entry_for(other)]) == entries
    assert (model_cache.entry_for(path) / "source").read_text() == str(path.resolve())


def test_changed_file_gets_a_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama", qtype="Q4_0")
    before = model_cache.entry_for(path)
    load_model(str(path))
    write_tiny_gguf(path, arch="llama", qtype="Q4_0", seed=1)
    os.utime(path, ns=(1, 1))
    assert model_cache.entry_for(path) != before


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", "off")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="qwen3", qtype="Q8_0")
    assert model_cache.entry_for(path) is None
    assert load_model(str(path)).config.architecture == "qwen3"


def _damage_weights(entry):
    data = bytearray((entry / "weights.safetensors").read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    (entry / "weights.safetensors").write_bytes(bytes(data))


def _damage_config_vocab(entry):
    import json

    cfg = json.loads((entry / "config.json").read_text())
    (entry / "config.json").write_text(json.dumps(cfg | {"vocab_size": 5}))


@pytest.mark.parametrize(
    "damage",
    [
        _damage_weights,
        lambda e: (e / "tokenizer_meta.json").write_text("{not json"),
        lambda e: (e / "tokenizer_meta.json").write_text('{"bos_token_id": "x"}'),
        lambda e: (e / "tokenizer.json").write_bytes(b"\xff\xfe"),
        lambda e: (e / "config.json").unlink(),
        _damage_config_vocab,
    ],
    ids=["weights header", "meta json", "meta fields", "tokenizer bytes", "config gone", "config vocab"],
)
def test_damaged_cache_entry_is_rebuilt_with_one_warning(tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("FLASHNEXT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama", qtype="Q4_1")
    first = load_model(str(path))
    entry = model_cache.entry_for(path)
    damage(entry)
    capsys.readouterr()
    again = load_model(str(path))
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("warning: ") and "rebuilding" in warning and "\n" not in warning
    assert again.config == first.config and same_weights(first.weights, again.weights)
    assert (entry / "tokenizer_meta.json").is_file()  # rebuilt, so the third load is quiet and cached
    load_model(str(path))
    assert capsys.readouterr().err == ""
