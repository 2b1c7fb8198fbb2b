"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

Built on the `tokenizers` library. Two sources:
- an HF folder (`tokenizer.json` + `tokenizer_config.json`, optionally `chat_template.jinja`,
  `generation_config.json`);
- a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE, `tokenizer.ggml.model == "gpt2"`), rebuilt into a
  `tokenizers.Tokenizer` with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

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
    raise UserError(
        f"{source}: tokenizer.ggml.pre '{pre}' is not supported; supported: {', '.join(supported)}"
    )


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


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
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise UserError(
                f"{self.source}: the model has no chat template; run without --chat or use a model that has one"
            )
        if self._template_cache is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template_cache = env.from_string(self.chat_template)
            except Exception as exc:  # jinja2.TemplateSyntaxError
                raise UserError(f"{self.source}: the chat template does not parse ({exc}); fix or remove it") from None
        try:
            return self._template_cache.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special, **extra
            )
        except Exception as exc:
            raise UserError(f"{self.source}: chat template failed on these messages: {exc}") from None

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise UserError(f"{path}: no tokenizer.json; the folder needs the model's tokenizer.json (fast tokenizer)")
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as exc:
            raise UserError(f"{tj}: not a valid tokenizer.json ({str(exc).splitlines()[0][:200]}); re-download it") from None
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        mcfg = _read_json(path / "config.json")

        def tok_text(value) -> str | None:
            if isinstance(value, dict):
                return value.get("content")
            return value

        def tok_id(value) -> int | None:
            text = tok_text(value)
            return backend.token_to_id(text) if text else None

        bos_token = tok_text(cfg.get("bos_token"))
        eos_token = tok_text(cfg.get("eos_token"))
        bos_id = tok_id(bos_token)
        if bos_id is None and isinstance(mcfg.get("bos_token_id"), int):
            bos_id = mcfg["bos_token_id"]
        eos_ids: list[int] = []
        for src in (gen.get("eos_token_id"), mcfg.get("eos_token_id")):
            if isinstance(src, int):
                src = [src]
            for i in src or []:
                if isinstance(i, int) and i not in eos_ids:
                    eos_ids.append(i)
        eid = tok_id(eos_token)
        if eid is not None and eid not in eos_ids:
            eos_ids.insert(0, eid)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        add_bos = bool(cfg.get("add_bos_token", False))
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
        types_field = fields.get("tokenizer.ggml.token_type")
        token_types = [int(x) for x in types_field.contents()] if types_field is not None else [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise UserError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise UserError(f"{source}: tokenizer.ggml.merges entry {m!r} is not 'a b'; the file is damaged")
            merges.append((a, b))
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False)
        backend = _HFTokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(scalar("tokenizer.ggml.pre"), source)
        if scalar("tokenizer.ggml.pre") in ("qwen2", "deepseek-r1-qwen"):
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
        bos = scalar("tokenizer.ggml.bos_token_id")
        eos = scalar("tokenizer.ggml.eos_token_id")
        eot = scalar("tokenizer.ggml.eot_token_id")
        eos_ids = [int(x) for x in (eos, eot) if x is not None]
        eos_ids = list(dict.fromkeys(eos_ids))

        def text_of(i):
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            add_bos=bool(scalar("tokenizer.ggml.add_bos_token", False)),
            chat_template=scalar("tokenizer.chat_template"),
            source=source,
            special_tokens={
                "bos_token": text_of(bos),
                "eos_token": text_of(eos),
                "unk_token": text_of(scalar("tokenizer.ggml.unknown_token_id")),
                "pad_token": text_of(scalar("tokenizer.ggml.padding_token_id")),
            },
        )


def _string_array(fields, key: str, source: str) -> list[str]:
    f = fields.get(key)
    if f is None:
        raise UserError(f"{source}: GGUF metadata {key} is missing; the file has no usable tokenizer")
    try:
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
    except Exception:
        raise UserError(f"{source}: GGUF metadata {key} is not a string array; the file is damaged") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: invalid JSON ({exc}); fix or re-download the file") from None
    return data if isinstance(data, dict) else {}
