"""Malformed model files for the readers: a seeded generator and a runner that classifies each outcome.

`base_gguf` / `base_hf` write a tiny valid model (tests/fixtures.py); `gguf_cases` / `hf_cases` yield named mutations
of it (bit flips, truncation, metadata of the wrong type, huge counts, tensor offsets, NaN/inf, deep nesting, shapes
the kernels cannot run). `run_case` loads one in-process under a memory cap and a per-case timer and says what came
of it: "refused" (a one-line UserError), "ok" (it loaded and generated), or a failure (any other exception, a hang,
memory past the cap, or a multi-line message). `python tests/fuzz_models.py [cases] [seed]` prints the counts.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import write_tiny_gguf, write_tiny_hf_model  # noqa: E402

CASE_SECONDS = 20  # a case past this is a hang
MEMORY_HEADROOM = 2 << 30  # address space a case may add to what the process already maps


# ---------------------------------------------------------------------------------------------------------------
# GGUF: the file as data (metadata with value types, tensors with raw bytes), so a mutation can change any field


@dataclass
class Tensor:
    name: str
    dims: list[int]  # ne0 first, as the file stores them
    ttype: int
    data: bytes
    offset: int | None = None  # None: laid out in order


@dataclass
class Gguf:
    kv: list[tuple[str, int, object]]  # key, value type, value (an array is (item type, list))
    tensors: list[Tensor]
    version: int = 3

    def get(self, key: str):
        return next(v for k, _, v in self.kv if k == key)

    def set(self, key: str, vtype: int, value) -> None:
        self.kv = [(k, vtype, value) if k == key else (k, t, v) for k, t, v in self.kv]
        if key not in [k for k, _, _ in self.kv]:
            self.kv.append((key, vtype, value))

    def drop(self, key: str) -> None:
        self.kv = [e for e in self.kv if e[0] != key]


_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, U32, I32, F32, BOOL, U64 = 8, 9, 4, 5, 6, 7, 10


def _pack_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        raw = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_pack_value(item, x) for x in items)
    return struct.pack("<" + _FMT[vtype], value)


def read_gguf(path: Path) -> Gguf:
    import gguf

    reader = gguf.GGUFReader(str(path))
    kv = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = int(f.types[0])
        if vtype == ARRAY:
            item = int(f.types[-1])
            items = [bytes(f.parts[i]) for i in f.data] if item == STRING else f.contents()
            kv.append((name, vtype, (item, items)))
        else:
            kv.append((name, vtype, bytes(f.parts[-1]) if vtype == STRING else f.contents()))
    tensors = [Tensor(t.name, [int(x) for x in t.shape], int(t.tensor_type), t.data.tobytes()) for t in reader.tensors]
    return Gguf(kv, tensors)


def gguf_bytes(g: Gguf, align: int = 32) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", g.version, len(g.tensors), len(g.kv))]
    for key, vtype, value in g.kv:
        out += [_pack_value(STRING, key), struct.pack("<I", vtype), _pack_value(vtype, value)]
    offset, blobs = 0, []
    for t in g.tensors:
        at = offset if t.offset is None else t.offset
        out += [
            _pack_value(STRING, t.name),
            struct.pack("<I", len(t.dims)),
            struct.pack(f"<{len(t.dims)}Q", *t.dims),
            struct.pack("<IQ", t.ttype, at % 2**64),
        ]
        blobs.append(t.data + b"\0" * (-len(t.data) % align))
        offset += len(blobs[-1])
    head = b"".join(out)
    return head + b"\0" * (-len(head) % align) + b"".join(blobs)


def base_gguf(folder: Path, arch: str = "llama") -> Path:
    path, _ = write_tiny_gguf(folder / f"base-{arch}.gguf", arch=arch, qtype="Q8_0")
    return path


def _write(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


COUNT_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "context_length",
    "attention.key_length",
    "vocab_size",
)
FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
BAD_COUNTS = [
    (STRING, "twelve"),
    (F32, float("nan")),
    (ARRAY, (U32, [1, 2, 3])),
    (I32, -1),
    (U64, 2**63),
    (U32, 0),
    (BOOL, True),
    (ARRAY, (STRING, [b"a"])),
]
BAD_FLOATS = [(F32, float("nan")), (F32, float("inf")), (F32, -1.0), (F32, 0.0), (STRING, "big")]
TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def _setter(key: str, vtype: int, value) -> Callable[[Gguf], None]:
    """A variant's edit: metadata `key` set to `value` of GGUF type `vtype`."""
    return lambda g: g.set(key, vtype, value)


def gguf_structured(base: Gguf, arch: str) -> Iterator[tuple[str, Gguf]]:
    """Every field-level fault the readers must name: one mutated copy each."""
    import copy

    def variant(fn: Callable[[Gguf], None]) -> Gguf:
        g = copy.deepcopy(base)
        fn(g)
        return g

    for key in COUNT_KEYS:
        for vtype, value in BAD_COUNTS:
            yield (
                f"{key}={vtype}:{str(value)[:12]}",
                variant(_setter(f"{arch}.{key}", vtype, value)),
            )
    for key in FLOAT_KEYS:
        for vtype, value in BAD_FLOATS:
            yield (
                f"{key}={value}",
                variant(_setter(f"{arch}.{key}", vtype, value)),
            )
    for key in TOKEN_ID_KEYS:
        for vtype, value in [(U32, 10**6), (STRING, "1"), (I32, -5), (F32, 1.5)]:
            yield f"{key}={value}", variant(_setter(key, vtype, value))
    blocks = base.get(f"{arch}.block_count")
    yield "block_count one short", variant(lambda g: g.set(f"{arch}.block_count", U32, blocks - 1))
    yield "block_count one more", variant(lambda g: g.set(f"{arch}.block_count", U32, blocks + 1))
    yield "kv heads not dividing", variant(lambda g: g.set(f"{arch}.attention.head_count_kv", U32, 3))
    yield (
        "rope scaling linear factor 0",
        variant(
            lambda g: (
                g.set(f"{arch}.rope.scaling.type", STRING, "linear"),
                g.set(f"{arch}.rope.scaling.factor", F32, 0.0),
            )
        ),
    )
    yield "architecture array", variant(lambda g: g.set("general.architecture", ARRAY, (STRING, [b"llama"])))
    yield "architecture unknown", variant(lambda g: g.set("general.architecture", STRING, "mamba"))
    yield "architecture not utf-8", variant(lambda g: g.set("general.architecture", STRING, b"\xff\xfe"))
    yield "no tokenizer model", variant(lambda g: g.drop("tokenizer.ggml.model"))
    yield "tokenizer pre number", variant(lambda g: g.set("tokenizer.ggml.pre", U32, 7))
    yield (
        "token types strings",
        variant(
            lambda g: g.set(
                "tokenizer.ggml.token_type", ARRAY, (STRING, [b"x"] * len(g.get("tokenizer.ggml.tokens")[1]))
            )
        ),
    )
    yield "token types short", variant(lambda g: g.set("tokenizer.ggml.token_type", ARRAY, (I32, [1])))
    yield (
        "merges of unknown tokens",
        variant(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [b"\xe2\x98\x83 zz"]))),
    )
    yield (
        "merge whose result is no token",
        variant(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [_orphan_merge(g)]))),
    )
    yield "merge without a space", variant(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [b"ab"])))
    yield "tokens not an array", variant(lambda g: g.set("tokenizer.ggml.tokens", U32, 5))
    yield "chat template a number", variant(lambda g: g.set("tokenizer.chat_template", U32, 5))
    yield "alignment 3", variant(lambda g: g.set("general.alignment", U32, 3))
    yield "alignment as string", variant(lambda g: g.set("general.alignment", STRING, "32"))
    yield "version 7", variant(lambda g: setattr(g, "version", 7))
    if arch == "qwen3":
        yield (
            "qwen3 without q/k norms",
            variant(
                lambda g: setattr(
                    g,
                    "tensors",
                    [t for t in g.tensors if not t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))],
                )
            ),
        )
    for fault, offset in [("wrap", 2**64 - 64), ("misaligned", 1), ("past end", 1 << 40)]:
        yield f"tensor offset {fault}", variant(lambda g, offset=offset: setattr(g.tensors[1], "offset", offset))
    yield "tensor type 99", variant(lambda g: setattr(g.tensors[0], "ttype", 99))
    yield "tensor 0 dims", variant(lambda g: setattr(g.tensors[0], "dims", []))
    yield "tensor 5 dims", variant(lambda g: setattr(g.tensors[0], "dims", g.tensors[0].dims + [1, 1, 1]))
    yield "tensor dim 0", variant(lambda g: setattr(g.tensors[0], "dims", [0] + g.tensors[0].dims[1:]))
    yield "tensor shape swapped", variant(lambda g: setattr(g.tensors[0], "dims", g.tensors[0].dims[::-1]))
    yield "tensor dropped", variant(lambda g: g.tensors.pop(3))
    yield "norm weight as int32", variant(lambda g: _retype_norm(g, 26))


def _orphan_merge(g: Gguf) -> bytes:
    """Two single-character tokens whose join is not a token: the BPE builder panics on such a merge."""
    tokens = {t.decode() for t in g.get("tokenizer.ggml.tokens")[1]}
    singles = sorted(t for t in tokens if len(t) == 1)
    return next(f"{a} {b}".encode() for a in singles for b in singles if a + b not in tokens)


def _retype_norm(g: Gguf, ttype: int) -> None:
    t = next(t for t in g.tensors if t.name == "output_norm.weight")
    t.ttype = ttype  # I32: same size as F32, so the file stays consistent


def _huge_array(base: bytes) -> bytes:
    """The 94-byte file: one metadata array whose declared length (2^62) runs past the end."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _pack_value(STRING, b"general.x") + struct.pack("<IIQ", 9, 0, 2**62)
    return head + b"\0" * (94 - len(head))


def gguf_cases(folder: Path, rng: random.Random, n_random: int, arch: str = "llama") -> Iterator[tuple[str, Path]]:
    path = base_gguf(folder, arch)
    raw = path.read_bytes()
    base = read_gguf(path)
    header_end = len(gguf_bytes(Gguf(base.kv, []))) + 64 * len(base.tensors)
    yield "valid", path
    for i, (name, g) in enumerate(gguf_structured(base, arch)):
        yield f"gguf {name}", _write(folder, f"s{i}.gguf", gguf_bytes(g))
    yield "gguf 94-byte huge array", _write(folder, "huge.gguf", _huge_array(raw))
    yield "gguf text file", _write(folder, "text.gguf", b"this is a plain text file\n")
    yield "gguf empty", _write(folder, "empty.gguf", b"")
    for i in range(n_random):
        data = bytearray(raw)
        kind = rng.choice(["flip", "flip", "truncate", "bytes", "count"])
        if kind == "flip":  # mostly in the header, where a flip changes a length, a type or an offset
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(header_end if rng.random() < 0.8 else len(data))
                data[at] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind == "bytes":
            at = rng.randrange(header_end)
            data[at : at + 8] = rng.choice([b"\xff" * 8, b"\0" * 8, struct.pack("<Q", 2**62), rng.randbytes(8)])
        else:  # a u64 length somewhere in the header set huge
            at = rng.randrange(8, header_end - 8)
            data[at : at + 8] = struct.pack("<Q", rng.choice([2**62, 2**64 - 1, 2**40, 2**31]))
        yield f"gguf random {kind} #{i}", _write(folder, f"r{i}.gguf", bytes(data))


# ---------------------------------------------------------------------------------------------------------------
# HF folders: config.json, safetensors, tokenizer files


CONFIG_FAULTS: list[tuple[str, object]] = [
    ("hidden_size", "64"),
    ("hidden_size", [64]),
    ("hidden_size", {"a": 1}),
    ("hidden_size", 64.5),
    ("num_attention_heads", None),
    ("num_attention_heads", 0),
    ("num_attention_heads", True),
    ("num_key_value_heads", 3),
    ("head_dim", 15),
    ("num_hidden_layers", 1),
    ("num_hidden_layers", 3),
    ("vocab_size", 10),
    ("vocab_size", -1),
    ("rope_theta", float("inf")),
    ("rope_theta", float("nan")),
    ("rope_theta", "x"),
    ("rms_norm_eps", float("nan")),
    ("max_position_embeddings", 10**12),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}),
    ("rope_scaling", {"rope_type": "linear", "factor": -2}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4}),
    ("rope_scaling", "linear"),
    ("rope_scaling", {"type": ["x"]}),
    ("architectures", "LlamaForCausalLM"),
    ("architectures", [["LlamaForCausalLM"]]),
    ("architectures", {"a": 1}),
    ("architectures", 5),
    ("eos_token_id", "2"),
    ("eos_token_id", [[2]]),
    ("bos_token_id", 10**6),
    ("bos_token_id", "0"),
    ("tie_word_embeddings", "maybe"),
    ("hidden_act", ["silu"]),
    ("quantization_config", "fp8"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [float("inf"), 1]}),
    ("use_sliding_window", True),
    ("sliding_window", "x"),
    ("num_nextn_predict_layers", -1),
]


def base_hf(folder: Path, arch: str = "llama") -> Path:
    return write_tiny_hf_model(folder / f"base-{arch}", arch=arch)


def _copy(base: Path, folder: Path, name: str) -> Path:
    out = folder / name
    shutil.copytree(base, out)
    return out


def _safetensors_with(out: Path, edit: Callable[[dict, bytearray], None]) -> None:
    raw = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = bytearray(raw[8 + n :])
    edit(header, data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(data))


def _set_dtype(name: str, dtype: str):
    def edit(header: dict, data: bytearray) -> None:
        header[name]["dtype"] = dtype

    return edit


def _drop_qk_norms(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    w = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in w.items() if "_norm" not in k or "self_attn" not in k}, str(out / "model.safetensors"))


def hf_cases(folder: Path, rng: random.Random, n_random: int, arch: str = "llama") -> Iterator[tuple[str, Path]]:
    base = base_hf(folder, arch)
    config = json.loads((base / "config.json").read_text())
    yield "hf valid", base
    for i, (field, value) in enumerate(CONFIG_FAULTS):
        out = _copy(base, folder, f"c{i}")
        (out / "config.json").write_text(json.dumps(config | {field: value}))
        yield f"config {field}={str(value)[:20]}", out
    files: list[tuple[str, Callable[[Path], None]]] = [
        ("config deep nesting", lambda o: (o / "config.json").write_text("[" * 100000 + "]" * 100000)),
        (
            "config field nested deep",
            lambda o: (o / "config.json").write_text(
                json.dumps(config)[:-1] + ', "rope_scaling": ' + "[" * 5000 + "]" * 5000 + "}"
            ),
        ),
        ("config not an object", lambda o: (o / "config.json").write_text("[1, 2]")),
        ("config not utf-8", lambda o: (o / "config.json").write_bytes(b'{"a": "\xff"}')),
        ("chat_template.jinja not utf-8", lambda o: _jinja_only(o, b"{{ '\xff\xfe' }}")),
        ("tokenizer_config chat_template a number", lambda o: _tok_config(o, chat_template=5)),
        ("tokenizer_config chat_template list of junk", lambda o: _tok_config(o, chat_template=[{"name": [1]}])),
        ("tokenizer_config bos a list", lambda o: _tok_config(o, bos_token=["<|endoftext|>"])),
        (
            "tokenizer_config deep",
            lambda o: (o / "tokenizer_config.json").write_text('{"a":' * 5000 + "1" + "}" * 5000),
        ),
        ("generation_config eos a float", lambda o: (o / "generation_config.json").write_text('{"eos_token_id": 2.5}')),
        ("tokenizer.json truncated", lambda o: _truncate(o / "tokenizer.json", 0.5)),
        ("tokenizer.json merge result missing", _drop_merged_token),
        ("tokenizer bigger than vocab", lambda o: _edit_config(o, vocab_size=100)),
        ("safetensors int32 weight", lambda o: _safetensors_with(o, _set_dtype("model.norm.weight", "I32"))),
        ("safetensors norm read as bool bytes", lambda o: _safetensors_with(o, _set_dtype_bool("model.norm.weight"))),
        ("safetensors offsets past end", lambda o: _safetensors_with(o, _offsets("model.norm.weight", 10**9))),
        ("safetensors header truncated", lambda o: _truncate(o / "model.safetensors", 0.001)),
        ("safetensors huge header length", lambda o: _poke(o / "model.safetensors", 0, struct.pack("<Q", 2**62))),
        ("shard path escapes", lambda o: _index(o, "../../etc/passwd")),
        ("shard name a list", lambda o: _index(o, ["x"])),
    ]
    if arch == "qwen3":
        files.append(("qwen3 without q/k norms", _drop_qk_norms))
    for i, (name, edit) in enumerate(files):
        out = _copy(base, folder, f"f{i}")
        edit(out)
        yield name, out
    for i in range(n_random):
        out = _copy(base, folder, f"r{i}")
        target = out / rng.choice(["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
        data = bytearray(target.read_bytes())
        # safetensors: the header, where a flip changes meaning rather than a weight; JSON files: anywhere
        limit = min(len(data), 4096) if target.suffix == ".safetensors" else len(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(limit)
            data[at] ^= 1 << rng.randrange(8)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        target.write_bytes(bytes(data))
        yield f"hf random {target.name} #{i}", out


def _drop_merged_token(out: Path) -> None:
    data = json.loads((out / "tokenizer.json").read_text())
    first = data["model"]["merges"][0]
    a, b = first.split(" ") if isinstance(first, str) else first
    del data["model"]["vocab"][a + b]
    (out / "tokenizer.json").write_text(json.dumps(data))


def _edit_config(out: Path, **changes) -> None:
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | changes))


def _tok_config(out: Path, **changes) -> None:
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg | changes))


def _jinja_only(out: Path, template: bytes) -> None:
    _tok_config(out, chat_template=None)
    (out / "chat_template.jinja").write_bytes(template)


def _truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: max(1, int(len(data) * fraction))])


def _poke(path: Path, at: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    path.write_bytes(bytes(data))


def _offsets(name: str, end: int):
    def edit(header: dict, data: bytearray) -> None:
        header[name]["data_offsets"] = [0, end]

    return edit


def _set_dtype_bool(name: str):
    def edit(header: dict, data: bytearray) -> None:
        start, end = header[name]["data_offsets"]
        header[name]["dtype"] = "BOOL"
        header[name]["shape"] = [end - start]

    return edit


def _index(out: Path, shard) -> None:
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))


# ---------------------------------------------------------------------------------------------------------------
# running a case


class CaseTimeout(BaseException):
    """Not an Exception, so no reader's own `except Exception` can turn a hang into an ordinary refusal."""


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def run_case(path: Path, generate: Callable | None = None, seconds: int = CASE_SECONDS) -> tuple[str, str]:
    """("refused", the message), ("ok", "") or (a failure, what happened): the load (and the generation, given
    one) runs under an address-space cap and a timer."""
    from flashnext.core.errors import UserError
    from flashnext.core.loader import load_model

    def on_alarm(signum, frame):
        raise CaseTimeout()

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + MEMORY_HEADROOM, hard))
    try:
        model = load_model(str(path))
        if generate is not None:
            generate(model)
        return "ok", ""
    except UserError as exc:
        one_line = str(exc) and "\n" not in str(exc)
        return ("refused" if one_line else "multi-line error"), str(exc)[:300]
    except CaseTimeout:
        return "hang", f"no answer in {seconds} s"
    except MemoryError:
        return "memory past the cap", ""
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a Rust panic in a library is a BaseException
        return "internal error", f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def generate_two_tokens(model) -> None:
    """A correct run: the CPU engine takes the model and decodes (with a prompt of rare characters)."""
    from flashnext.core.engine.sequence import SamplingParams
    from flashnext.core.llm import LLM

    llm = LLM(model=model, backend="cpu", max_model_len=64, max_num_seqs=1)
    llm.generate(["hi ☃ 𝔘 \x00 ÿ"], SamplingParams(max_tokens=2, temperature=0.0))
    if model.tokenizer.chat_template:
        llm.encode("hi", chat=True)


# Mutations that leave a model the readers may run: a fallback (key_length 0 means "hidden / heads"), a value
# pydantic reads as the number it spells, or a field the loader does not need; random damage may land anywhere.
MAY_RUN = {
    "valid",
    "hf valid",
    "gguf attention.key_length=4:0",
    "config hidden_size=64",
    "config architectures=LlamaForCausalLM",
    "config bos_token_id=0",
    "config use_sliding_window=True",
    "config sliding_window=x",
    "tokenizer_config chat_template list of junk",
    "tokenizer_config bos a list",
    "generation_config eos a float",
}


def must_refuse(name: str) -> bool:
    return name not in MAY_RUN and " random " not in name


def campaign(folder: Path, seed: int, n_random: int, log: Callable[[str], None] | None = None) -> dict:
    """Every case once; returns counts and the failures by case name."""
    os.environ["FLASHNEXT_CACHE_DIR"] = "off"
    rng = random.Random(seed)
    counts = {"cases": 0, "refused": 0, "ok": 0}
    failures = {}
    for arch in ("llama", "qwen3"):
        for maker in (gguf_cases, hf_cases):
            (folder / arch / maker.__name__).mkdir(parents=True, exist_ok=True)
            for name, path in maker(folder / arch / maker.__name__, rng, n_random, arch):
                outcome, detail = run_case(path, generate_two_tokens)
                counts["cases"] += 1
                if outcome == "ok" and must_refuse(name):
                    outcome, detail = "accepted a damaged file", "it loaded and ran"
                if outcome in counts:
                    counts[outcome] += 1
                else:
                    failures[f"{arch} {name}"] = f"{outcome}: {detail}"
                if log is not None:
                    log(f"{arch} {name}: {outcome} {detail}")
    return counts | {"failures": failures}


if __name__ == "__main__":
    import tempfile

    n, seed = int(sys.argv[1]) if len(sys.argv) > 1 else 40, int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with tempfile.TemporaryDirectory() as tmp:
        result = campaign(Path(tmp), seed, n, log=print if os.environ.get("FUZZ_VERBOSE") else None)
    print(json.dumps(result, indent=1))
