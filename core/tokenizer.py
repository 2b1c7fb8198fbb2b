"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

Built on the `tokenizers` library. Two sources:
- an HF folder (`tokenizer.json` + `tokenizer_config.json`, optionally `chat_template.jinja`,
  `generation_config.json`);
- a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE, `tokenizer.ggml.model == "gpt2"`), rebuilt into a
  `tokenizers.Tokenizer` with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from flashnext.core import chat_template
from flashnext.core.errors import UserError

# Pre-tokenizer split regexes, as llama.cpp (llama-vocab.cpp) and transformers' GGUF converter define them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4"], _GPT4O_SPLIT),
}
# Pre types whose merges were learned with GPT-2's own regex (ByteLevel's built-in one).
_GPT2_REGEX_PRES = {"default", "gpt-2", "gpt2", "starcoder", "refact", "smollm", "olmo", "jais", "exaone"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _byte_level_pre_tokenizer(pre: str | None, source: str) -> pre_tokenizers.PreTokenizer:
    pre = pre or "default"
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_REGEX_PRES:
        steps: list[pre_tokenizers.PreTokenizer] = []
        if pre in ("smollm", "starcoder", "refact"):
            # llama.cpp: "\p{N}" first (each digit alone), then GPT-2's regex -- HF's Digits(individual_digits).
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        return pre_tokenizers.Sequence(steps)
    supported = sorted(set(_SPLITS) | _GPT2_REGEX_PRES)
    raise UserError(f"{source}: tokenizer.ggml.pre '{pre}' is not supported; supported: {', '.join(supported)}")


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 and pending merges.

    The usual two-offset scheme: decode a short window ending at the newest token, and emit only the part past
    what the window's prefix already produced, once it no longer ends in a replacement character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens up to here have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a trailing incomplete byte sequence), then reset."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class Tokenizer:
    """Encode/decode, chat templates and streaming for one model."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
        source: str,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self._tk = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special = special_tokens or {}
        self._template_cache = None
        if bos_token_id is not None and backend.id_to_token(bos_token_id) is None:
            raise UserError(
                f"{source}: bos_token_id {bos_token_id} is not a token of the tokenizer (0 to "
                f"{self.vocab_size - 1}); fix the model's config"
            )
        if add_bos and bos_token_id is not None and not self._post_processor_adds_bos():
            bos = backend.id_to_token(bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)]
            )

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self._tk.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    # -- basic ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    def largest_id(self) -> int:
        return max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1)

    def stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    @property
    def backend(self) -> _HFTokenizer:
        return self._tk

    # -- chat ----------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        if not self.chat_template:
            raise UserError(
                f"{self.source}: the model has no chat template; run without --chat or use a model that has one"
            )
        if self._template_cache is None:
            self._template_cache = chat_template.compile_template(self.chat_template, self.source)
        return chat_template.render(
            self._template_cache,
            self.source,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self._special,
            **extra,
        )

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise UserError(f"{path}: no tokenizer.json; the folder needs the model's tokenizer.json (fast tokenizer)")
        _check_bpe_file(tj)
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as exc:
            raise UserError(
                f"{tj}: not a valid tokenizer.json ({str(exc).splitlines()[0][:200]}); re-download it"
            ) from None
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        mcfg = _read_json(path / "config.json")

        def tok_text(value) -> str | None:
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else None

        def tok_id(value) -> int | None:
            text = tok_text(value)
            return backend.token_to_id(text) if text else None

        bos_token = tok_text(cfg.get("bos_token"))
        eos_token = tok_text(cfg.get("eos_token"))
        bos_id = tok_id(bos_token)
        if bos_id is None and type(mcfg.get("bos_token_id")) is int:
            bos_id = mcfg["bos_token_id"]
        eos_ids: list[int] = []
        for src in (gen.get("eos_token_id"), mcfg.get("eos_token_id")):
            if isinstance(src, int):
                src = [src]
            for i in src if isinstance(src, list) else []:
                if type(i) is int and i not in eos_ids:
                    eos_ids.append(i)
        eid = tok_id(eos_token)
        if eid is not None and eid not in eos_ids:
            eos_ids.insert(0, eid)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str):
            raise UserError(f"{path / 'tokenizer_config.json'}: field 'chat_template' is not text; fix or remove it")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = _read_text(jinja_file)
        add_bos = cfg.get("add_bos_token", False) is True
        tok = cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=add_bos,
            chat_template=template,
            source=str(path),
            special_tokens={"bos_token": bos_token or "", "eos_token": eos_token or ""}
            | {k: tok_text(cfg.get(k)) or "" for k in ("pad_token", "unk_token")},
        )
        tok.add_bos = tok._post_processor_adds_bos()
        return tok

    @classmethod
    def from_gguf(cls, reader, source: str = "model.gguf") -> Tokenizer:
        """Build from a `gguf.GGUFReader`'s `tokenizer.ggml.*` metadata."""
        fields = reader.fields

        def scalar(key, default=None):
            f = fields.get(key)
            if f is None or not f.types:
                return default
            try:
                return f.contents()
            except Exception:
                return default

        model = scalar("tokenizer.ggml.model")
        if model is None:
            raise UserError(f"{source}: the GGUF has no tokenizer (tokenizer.ggml.model missing); use a GGUF with one")
        if model != "gpt2":
            raise UserError(
                f"{source}: tokenizer.ggml.model '{model}' is not supported (only byte-level BPE 'gpt2'); "
                "use the model's HF folder instead"
            )
        tokens = _string_array(fields, "tokenizer.ggml.tokens", source)
        merges_raw = _string_array(fields, "tokenizer.ggml.merges", source)
        token_types = scalar("tokenizer.ggml.token_type", [1] * len(tokens))
        if not isinstance(token_types, list) or not all(type(x) is int for x in token_types):
            raise UserError(
                f"{source}: GGUF metadata tokenizer.ggml.token_type is not a list of whole numbers; the "
                "file is damaged, re-download it"
            )
        if len(token_types) != len(tokens):
            raise UserError(
                f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise UserError(f"{source}: tokenizer.ggml.merges entry {m!r} is not 'a b'; the file is damaged")
            merges.append((a, b))
        _check_merges(vocab, merges, f"{source}: GGUF tokenizer.ggml.merges")
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False)
        except Exception as exc:  # the BPE builder rejects merges of tokens the vocabulary lacks
            raise UserError(
                f"{source}: GGUF tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({exc}); the file "
                "is damaged, re-download it"
            ) from None
        backend = _HFTokenizer(bpe)
        pre = scalar("tokenizer.ggml.pre")
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre if isinstance(pre, str) else repr(pre), source)
        if pre in ("qwen2", "deepseek-r1-qwen"):
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, token_types)
            if ty == _TOKEN_TYPE_CONTROL
        ]
        users = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, token_types)
            if ty == _TOKEN_TYPE_USER_DEFINED
        ]
        if specials:
            backend.add_special_tokens(specials)
        if users:
            backend.add_tokens(users)

        def token_id(key: str) -> int | None:
            value = scalar(key)
            if value is None:
                return None
            if type(value) is not int or not 0 <= value < len(tokens):
                raise UserError(
                    f"{source}: GGUF metadata {key} = {str(value)[:40]!r} is not a token id (0 to "
                    f"{len(tokens) - 1}); the file is damaged, re-download it"
                )
            return value

        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        eot = token_id("tokenizer.ggml.eot_token_id")
        eos_ids = list(dict.fromkeys(x for x in (eos, eot) if x is not None))
        template = scalar("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{source}: GGUF metadata tokenizer.chat_template is not text; the file is damaged")

        def text_of(key):
            i = scalar(key)
            return tokens[i] if type(i) is int and 0 <= i < len(tokens) else ""

        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=scalar("tokenizer.ggml.add_bos_token", False) is True,
            chat_template=template,
            source=source,
            special_tokens={
                "bos_token": text_of("tokenizer.ggml.bos_token_id"),
                "eos_token": text_of("tokenizer.ggml.eos_token_id"),
                "unk_token": text_of("tokenizer.ggml.unknown_token_id"),
                "pad_token": text_of("tokenizer.ggml.padding_token_id"),
            },
        )


def _check_merges(vocab: dict, merges: list, where: str, prefix: str = "") -> None:
    """Every merge joins two tokens of the vocabulary into a third: the BPE builder panics (a Rust panic, not an
    error) on a merge whose result is missing. `prefix`: the model's continuing-subword prefix, dropped from b."""
    for pair in merges:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise UserError(f"{where}: entry {str(pair)[:60]!r} is not a pair of tokens; the file is damaged")
        a, b = pair
        joined = a + (b[len(prefix) :] if prefix and b.startswith(prefix) else b)
        for token in (a, b, joined):
            if token not in vocab:
                raise UserError(
                    f"{where}: merge {a + ' ' + b!r} needs token {token!r}, which the vocabulary lacks; "
                    "the file is damaged, re-download it"
                )


def _check_bpe_file(path: Path) -> None:
    """A tokenizer.json with a BPE model: its merges checked before the tokenizers library builds it."""
    try:
        data = json.loads(_read_text(path))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{path}: not a valid tokenizer.json ({str(exc)[:120]}); re-download it") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise UserError(f"{path}: model.vocab or model.merges is malformed; re-download the tokenizer.json")
    pairs = [m.split(" ", 1) if isinstance(m, str) and " " in m else m for m in merges]
    prefix = model.get("continuing_subword_prefix")
    _check_merges(vocab, pairs, f"{path}: model.merges", prefix if isinstance(prefix, str) else "")


def _string_array(fields, key: str, source: str) -> list[str]:
    f = fields.get(key)
    if f is None:
        raise UserError(f"{source}: GGUF metadata {key} is missing; the file has no usable tokenizer")
    if [t.name for t in f.types] != ["ARRAY", "STRING"]:
        raise UserError(f"{source}: GGUF metadata {key} is not an array of strings; the file is damaged")
    try:
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
    except Exception:
        raise UserError(f"{source}: GGUF metadata {key} is not a string array; the file is damaged") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); fix or re-download it") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); check the path and permissions") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON ({exc}); fix or re-download the file") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to be a model file; fix or re-download it") from None
    return data if isinstance(data, dict) else {}
