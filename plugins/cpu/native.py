"""Int4 steps through flashnext's own C step (decode.c), compiled for this CPU at first use: decode steps and prompt
chunks alike, over the engine's paged KV cache.

The build takes the first C compiler it finds: $CC, then cc / gcc / clang on the PATH, then the one the `ziglang`
wheel ships (a dependency, so a fresh machine has it); the library is kept under the cache folder, keyed by the
source, the compiler and this CPU's features, and rebuilt when any of them changes. Where no compiler works the
CPU backend says why and runs its onnxruntime route instead.
"""

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from flashnext.core import model_cache
from flashnext.core.model import DecoderModel
from flashnext.core.precision import Int4Weight

from .head import Int8Head, head_weight

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-pthread"]
MAX_TOKENS = 128  # tokens a call takes (decode.c's MAX_TOKENS)
REFINE_TOP = 16  # where the head's codes are not exact: each row's largest logits computed again from the float rows
KV_DTYPES = (torch.float16, torch.float32)  # KV caches the step reads (float16: half the memory, as llama.cpp keeps it)
UNBOUNDED_SPIN_US = 1_000_000  # the idle spin asked for as unbounded: longer than any step's gap
BUILD_TIMEOUT_S = 300
_CALLS = threading.Lock()


class BuildError(RuntimeError):
    """No compiler produced the library; the message says what was tried."""


def compilers() -> list[list[str]]:
    """Commands that compile C here, in the order tried."""
    found = []
    if os.environ.get("CC"):
        found.append(os.environ["CC"].split())
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            found.append([path])
    if importlib.util.find_spec("ziglang") is not None:
        found.append([sys.executable, "-m", "ziglang", "cc"])
    return found


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "model name", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def unavailable(model: DecoderModel, kv_dtype: torch.dtype) -> str | None:
    """Why the C step cannot run this model here (None: it can): the model's shapes, or no library builds."""
    reason = unsupported(model, kv_dtype)
    if reason is None:
        try:
            build()
        except BuildError as exc:
            reason = f"the C step did not build ({exc})"
    return reason


def vectorized() -> bool:
    """Whether this CPU's build has a vector path (AVX-512 or AVX2); the plain-C one is for `int4_route = native`
    only: `auto` then prefers the onnxruntime graph, whose kernels have paths for every CPU it ships for."""
    return build().fx_lanes() > 1


@functools.cache
def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled step, from the cache folder or built now (once a process). `extra_flags` follow -march=native
    (tests build the AVX2 and plain-C variants with -mno-avx512f and the like)."""
    source = SOURCE.read_bytes()
    flags = [*FLAGS, *extra_flags]
    errors = []
    for command in compilers():
        key = hashlib.sha256(source + repr(command + flags).encode() + cpu_features().encode()).hexdigest()[:16]
        folder = model_cache.build_folder()
        library = folder / f"decode-{key}.so"
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:
                out = Path(work) / "decode.so"
                try:
                    done = subprocess.run(
                        [*command, *flags, "-o", str(out), str(SOURCE), "-lm"],
                        capture_output=True,
                        text=True,
                        timeout=BUILD_TIMEOUT_S,
                    )
                except (OSError, subprocess.TimeoutExpired) as exc:
                    errors.append(f"{' '.join(command)}: {exc}")
                    continue
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                    errors.append(f"{' '.join(command)}: {last}")
                    continue
                os.replace(out, library)  # whole or not at all: another process may be loading it
        try:
            return _declare(ctypes.CDLL(str(library)))
        except OSError as exc:
            errors.append(f"{library}: {exc}")
    if not errors:
        raise BuildError("no C compiler found (set CC, or pip install ziglang)")
    raise BuildError("; ".join(errors))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.fx_set_threads.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.fx_set_threads.restype = ctypes.c_int
    lib.fx_step.argtypes = [
        ctypes.POINTER(ModelWeights),
        PagedCacheView,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.fx_step.restype = ctypes.c_int
    lib.fx_lanes.restype = ctypes.c_int
    return lib


class Q4Weight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("half", ctypes.c_int64),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("qkv", Q4Weight),
        ("o", Q4Weight),
        ("gate_up", Q4Weight),
        ("down", Q4Weight),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
    ]


class ModelWeights(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layer", ctypes.POINTER(LayerWeights)),
        ("final_norm", ctypes.c_void_p),
        ("head_codes", ctypes.c_void_p),
        ("head_scales", ctypes.c_void_p),
        ("head_half", ctypes.c_int64),
        ("refine_rows", ctypes.c_void_p),
        ("refine_half", ctypes.c_int64),
        ("refine_top", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("positions", ctypes.c_int64),
    ]


class PagedCacheView(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("half", ctypes.c_int64),
        ("slots", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("tables", ctypes.c_void_p),
        ("sequences", ctypes.c_int64),
        ("width", ctypes.c_int64),
    ]


def unsupported(model: DecoderModel, kv_dtype: torch.dtype) -> str | None:
    """Why the C step cannot run this model (None: it can)."""
    cfg = model.config
    if kv_dtype not in KV_DTYPES or model.dtype != torch.float32:
        return f"it reads a float16 / float32 KV cache, float32 activations; this engine has {kv_dtype} / {model.dtype}"
    if cfg.head_dim % 16 or cfg.head_dim > 256:
        return f"head_dim {cfg.head_dim} is not a multiple of 16 up to 256"
    if cfg.hidden_size % 32 or cfg.hidden_size > 32768:
        return f"hidden size {cfg.hidden_size} is not a multiple of 32 up to 32768"
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(w, Int4Weight):
                return "the projections are not int4"
            if w.group_size % 32:
                return f"int4 group size {w.group_size} is not a multiple of 32"
    head = head_weight(model)
    if not isinstance(head, torch.Tensor) or head.dtype not in (torch.float32, torch.float16):
        return f"the LM head is stored as {getattr(head, 'dtype', type(head).__name__)}, not float32 or float16"
    return None


def q4_layout(w: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(codes [n][k/32][16], scales, offsets, half) as decode.c reads them: in each group of 32, byte j holds element
    j (low nibble) and element j + 16 (high). Scales and offsets are float16 where that is exact (GGUF's Q4_0 /
    Q4_1 store them so: a step then reads 0.625 byte a weight), float32 otherwise; groups wider than 32 repeat
    theirs for each 32."""
    n, k = w.shape
    pairs = w.packed.numpy().reshape(n, k // 32, 16)  # byte i: elements 2i (low), 2i + 1 (high) of the group
    values = np.empty((n, k // 32, 32), np.uint8)
    values[..., 0::2], values[..., 1::2] = pairs & 15, pairs >> 4
    codes = values[..., :16] | (values[..., 16:] << 4)
    repeat = w.group_size // 32
    scales, offsets = (t.float().repeat_interleave(repeat, dim=1).numpy() for t in (w.scales, w.offsets))
    half = exact_in_half(scales) and exact_in_half(offsets)
    if half:
        scales, offsets = scales.astype(np.float16), offsets.astype(np.float16)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales), np.ascontiguousarray(offsets), half


def exact_in_half(a: np.ndarray) -> bool:
    return np.array_equal(a.astype(np.float16).astype(np.float32), a)


def halved(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(a as float16, True) where that is exact, else (a, False)."""
    return (a.astype(np.float16), True) if exact_in_half(a) else (a, False)


class TeamSize:
    """How many of its threads the C step runs on: all of them, unless fewer run faster. A busy neighbour that takes
    a core stalls every barrier of a step whose thread shares that core with it (SmolLM2 at 2 threads beside a busy
    loop: 39-50 tok/s, against 64 on one thread and 116 quiet). So a call that takes over SLOW times the usual (a
    running average of this batch size's calls) has the next call try one thread fewer, and with fewer threads than
    all, every PROBE_UP_EVERY-th call tries one more; a tried size is kept where its call took under MARGIN of the
    time it is weighed against (the slow call, or the usual). A quiet machine pays nothing: no call is slow."""

    SLOW = 1.3
    MARGIN = 0.85
    PROBE_UP_EVERY = 64

    def __init__(self, most: int):
        self.most = self.size = most
        self.batch, self.usual, self.calls = None, None, 0
        self.probe = self.against = self.slow = None

    def size_for(self, batch: int) -> int:
        if batch != self.batch:  # another batch size: other step times
            self.batch, self.usual, self.slow, self.calls = batch, None, None, 0
        self.calls += 1
        self.probe = None
        if self.slow is not None and self.size > 1:
            self.probe, self.against = self.size - 1, self.slow
        elif self.size < self.most and self.usual is not None and self.calls % self.PROBE_UP_EVERY == 0:
            self.probe, self.against = self.size + 1, self.usual
        self.slow = None
        return self.probe or self.size

    def took(self, seconds: float) -> None:
        if self.probe is not None:
            if seconds < self.MARGIN * self.against:
                self.size, self.usual = self.probe, seconds
            return
        if self.usual is not None and seconds > self.SLOW * self.usual:
            self.slow = seconds
        self.usual = seconds if self.usual is None else 0.9 * self.usual + 0.1 * seconds


class NativeModel:
    """The model's layers and LM head as decode.c reads them, and steps through it."""

    def __init__(
        self, model: DecoderModel, threads: int, spin_us: int, release: bool, library: ctypes.CDLL | None = None
    ):
        """`release`: no torch step will follow, so each of the model's tensors is let go once its copy here is
        made (the load's peak memory then holds one copy of a layer at a time); `library`: a build of decode.c
        (default: `build()`)."""
        self.lib = library or build()
        self.spin_ns = spin_us * 1000
        self.team = TeamSize(self.lib.fx_set_threads(threads, self.spin_ns))
        cfg = model.config
        if len(model.layers) != cfg.num_layers:  # let go by another route's build
            raise RuntimeError(f"the C step needs the model's {cfg.num_layers} layers; it holds {len(model.layers)}")
        self.vocab = cfg.vocab_size
        self._keep: list = []  # every array the structures point into
        self.head = Int8Head.of(model)
        # The float rows to recompute each row's top logits from where the codes are not the head exactly.
        refine = None if self.head.exact else np.ascontiguousarray(head_weight(model).numpy())
        cos, sin = model.cos_sin.float().chunk(2, dim=-1)
        head_scales, head_half = halved(self.head.scales)
        layers = (LayerWeights * cfg.num_layers)()
        for i, layer in enumerate(model.layers):
            layers[i] = self._layer(layer)
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down):  # read from a converted entry's map: let go
                model_cache.drop_pages(w.packed, w.scales, w.offsets)
            if release:
                model.layers[i] = None
        self._keep.append(layers)
        self.weights = ModelWeights(
            layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            inter=layers[0].down.k,
            vocab=cfg.vocab_size,
            eps=cfg.rms_norm_eps,
            scale=model.scale,
            layer=layers,
            final_norm=self._floats(model.norm),
            head_codes=self._array(self.head.codes),
            head_scales=self._array(head_scales),
            head_half=int(head_half),
            refine_rows=None if refine is None else self._array(refine),
            refine_half=int(refine is not None and refine.dtype == np.float16),
            refine_top=REFINE_TOP,
            cos=self._floats(cos),
            sin=self._floats(sin),
            positions=cos.shape[0],
        )
        model_cache.drop_all_pages()
        if release:
            model.layers = []
            model.lm_head = None if refine is None else model.lm_head
            model.embed = self.head.table

    def _layer(self, layer) -> LayerWeights:
        return LayerWeights(
            *(
                self._q4(w, b)
                for w, b in ((layer.qkv, layer.qkv_bias), (layer.o, None), (layer.gate_up, None), (layer.down, None))
            ),
            *(self._floats(t) for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)),
        )

    def _array(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        self._keep.append(a)
        return a.ctypes.data

    def _floats(self, t: torch.Tensor | None) -> int | None:
        return None if t is None else self._array(t.float().contiguous().numpy())

    def _q4(self, w: Int4Weight, bias: torch.Tensor | None) -> Q4Weight:
        codes, scales, offsets, half = q4_layout(w)
        n, k = w.shape
        return Q4Weight(
            self._array(codes), self._array(scales), self._array(offsets), self._floats(bias), n, k, int(half)
        )

    def step(self, paged: tuple, block_size: int, tables: torch.Tensor, seqs, past, hidden, first_logit: int, logits):
        """One call over len(seqs) tokens: token i at position past[i] of the sequence whose block table is
        tables[seqs[i]] (int32 [sequences, width]), its embedding hidden[i]. `paged` is the engine's (keys, values)
        cache as [layers, slots, kv heads, head dim] float32 or float16, where the call writes every token's keys
        and values; `logits` [len(seqs) - first_logit, vocab] gets the logits of the tokens from first_logit on."""
        k, v = paged
        half = k.dtype == torch.float16
        cache = PagedCacheView(
            k.data_ptr(), v.data_ptr(), half, k.shape[1], block_size, tables.data_ptr(), *tables.shape
        )
        seq = np.asarray(seqs, np.int64)
        at = np.asarray(past, np.int64)
        hidden = hidden.contiguous()
        # Only one-token rows (a sequence each) teach TeamSize: a prompt chunk's calls take longer as its context
        # grows, which is no neighbour's doing.
        decode = len(set(seq.tolist())) == len(seq)
        with _CALLS:  # a library's team and scratch serve one call at a time
            self.lib.fx_set_threads(self.team.size_for(len(seq)) if decode else self.team.size, self.spin_ns)
            start = time.perf_counter()
            status = self.lib.fx_step(
                ctypes.byref(self.weights),
                cache,
                len(seq),
                seq.ctypes.data,
                at.ctypes.data,
                hidden.data_ptr(),
                first_logit,
                logits.data_ptr(),
            )
            if decode:
                self.team.took(time.perf_counter() - start)
        if status:
            raise RuntimeError(f"decode.c refused a step of {len(seq)} tokens at positions {at.min()}..{at.max()}")
