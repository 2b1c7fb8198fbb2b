"""Int4 steps through onnxruntime: the whole layer stack and the LM head as one graph that computes from the 4-bit
codes, for decode steps and prompt chunks alike.

Every projection is a `MatMulNBits` over the Int4Weight's own codes and scales (activations float32, or rounded to
int8 in blocks as llama.cpp's Q4 x Q8 dot does, for the projections ROUNDED names); attention is
`GroupQueryAttention` (rope, causal masking, the call's keys written into the cache in place, grouped heads) over
each sequence's own contiguous KV row (`RowCache`); the LM head is an 8-bit `MatMulNBits` (blocks of 32, as GGUF's
Q8_0 stores it) over the rows whose logits are wanted. A step is one session call for all its one-token rows, plus
one per longer piece (a prompt chunk, a verify step): GroupQueryAttention takes several tokens a row only for one
row at a time.

An Int4Weight value is q * scale + offset (q = 0..15); MatMulNBits computes (q - zero_point) * scale with integer
zero points. The codes run with zero point 8, exactly symmetric weights (offset = -8 * scale); what an offset adds
beyond that is a dense product of each group's column sum: sum_g (offset_g + 8 * scale_g) * sum(x_g).
"""

import contextlib
import math
import mmap
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from flashnext.core import model_cache
from flashnext.core.kernels import AttentionMetadata
from flashnext.core.model import DecoderModel
from flashnext.core.precision import Int4Weight

from .head import HEAD_BLOCK, Int8Head, head_weight

if TYPE_CHECKING:
    from .runner import Piece

# MatMulNBits accuracy levels: 4 rounds activations to int8 in blocks of the group size (integer dot products, the
# fast kernels); 1 keeps them float32 (the weights widened block by block: the reference's numbers).
INT8_ACTIVATIONS, FP32_ACTIVATIONS = 4, 1
# The projections each `activations` choice runs on int8 activations. The MLP's two hold three quarters of a layer's
# weights; the attention projections' inputs carry the outlier channels whose blocks int8 rounds coarsely (on
# SmolLM2 they add more logits error than the MLP's, docs/benchmarks.md).
ROUNDED = {"fp32": (), "mlp-int8": ("gate_up", "down"), "int8": ("qkv", "o", "gate_up", "down")}
BLOCK_SIZES = (16, 32, 64, 128, 256)  # group sizes MatMulNBits takes
# The LM head as 8-bit codes (head.py; GGUF's Q8_0: a checkpoint that stores its head so is run on exactly its
# values). 8-bit codes have a fast kernel only with int8 activations, and rounding the head's input so moves logits
# by up to ~0.1: enough to swap two near-tied tokens. So each row's REFINE_TOP largest logits (picked in the graph)
# are computed again from the head's own weights in float32, which keeps the argmax exact unless that many tokens
# lie within twice the rounding of the top. Where the codes give the head back exactly, those rows are read from the
# codes, and so are the embedding's rows of a tied table.
HEAD_ACCURACY, REFINE_TOP = 4, 16
MS_DOMAIN = "com.microsoft"
# Constants this large reach onnxruntime as arrays it reads in place (the Int4Weights' own codes and scales, no copy
# in the graph's bytes or the session), not serialized into the graph.
EXTERNAL_BYTES = 1 << 16


def unsupported(model: DecoderModel, kv_dtype: torch.dtype) -> str | None:
    """Why the graph cannot run this model's decode steps (None: it can)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed"
    if kv_dtype != torch.float32 or model.dtype != torch.float32:
        return f"the graph reads a float32 KV cache and activations; this engine has {kv_dtype} / {model.dtype}"
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(w, Int4Weight):
                return "the projections are not int4"
            if w.group_size not in BLOCK_SIZES:
                return f"int4 group size {w.group_size} is not one MatMulNBits takes ({BLOCK_SIZES})"
    head = head_weight(model)
    if not isinstance(head, torch.Tensor) or head.dtype not in (torch.float32, torch.float16):
        return f"the LM head is stored as {getattr(head, 'dtype', type(head).__name__)}, not float32 or float16"
    if model.config.hidden_size % HEAD_BLOCK:
        return f"the hidden size {model.config.hidden_size} is not a multiple of the LM head's block {HEAD_BLOCK}"
    return None


class RowCache:
    """Each sequence's keys and values as one contiguous [kv heads, capacity, head dim] row a layer: the layout
    GroupQueryAttention reads and extends in place. It mirrors the engine's paged cache, which stays the one the
    torch path, the prefix cache and preemption use: before a call a row copies in the positions it lacks (all of
    them when it held another sequence), after it the call's new keys and values go out to their paged slots."""

    FIRST_CAPACITY = 256  # positions; doubled as sequences grow (a copy each time, so few)

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.k = self.v = torch.empty(layers, 0, kv_heads, 0, head_dim)
        self.owner: list[int | None] = []  # the sequence each row holds
        self.length: list[int] = []  # positions of it the row holds
        self.version = 0  # bumped when the buffers move (bindings to them are stale)

    def reserve(self, rows: int, positions: int) -> None:
        """Room for `rows` rows of `positions` positions."""
        layers, have_rows, kv, capacity, d = self.k.shape
        if rows <= have_rows and positions <= capacity:
            return
        capacity = max(capacity, self.FIRST_CAPACITY)
        while capacity < positions:
            capacity *= 2
        shape = (layers, max(rows, have_rows), kv, capacity, d)
        for name in ("k", "v"):
            old, new = getattr(self, name), torch.empty(shape)
            new[:, :have_rows, :, : old.shape[3]] = old
            setattr(self, name, new)
        self.owner += [None] * (shape[1] - have_rows)
        self.length += [0] * (shape[1] - have_rows)
        self.version += 1

    def place_group(self, owners: list[int]) -> list[int]:
        """Rows 0 .. len(owners) - 1 for these sequences (GroupQueryAttention reads a batch as consecutive rows): each
        keeps its row where it already holds one of them, so a batch that loses or gains a sequence moves few."""
        n = len(owners)
        self.reserve(n, 1)
        kept = {o: self.owner.index(o) for o in owners if o in self.owner[:n]}
        free = iter(r for r in range(n) if r not in kept.values())
        return [kept[o] if o in kept else self._claim(next(free), o) for o in owners]

    def place_one(self, owner: int, busy: int) -> int:
        """A row for one sequence outside rows 0 .. busy - 1: the one it holds, else one no sequence holds (one more
        if none is free)."""
        if owner in self.owner[busy:]:
            return self.owner.index(owner, busy)
        free = [r for r in range(busy, len(self.owner)) if self.owner[r] is None]
        row = free[0] if free else max(busy, len(self.owner))
        self.reserve(row + 1, 1)
        return self._claim(row, owner)

    def release(self, live: set[int]) -> None:
        """Rows of sequences no longer among `live` are free again."""
        for r, owner in enumerate(self.owner):
            if owner is not None and owner not in live:
                self.owner[r], self.length[r] = None, 0

    def _claim(self, row: int, owner: int) -> int:
        if owner in self.owner:  # it moves: its old row is free
            old = self.owner.index(owner)
            self.owner[old], self.length[old] = None, 0
        self.owner[row], self.length[row] = owner, 0
        return row

    def sync(self, row: int, past: int, table: torch.Tensor, paged_k, paged_v, block_size: int) -> None:
        """The row gets its sequence's first `past` positions from the paged cache ([layers, slots, kv, d]), copying
        only those it lacks. Positions it holds past `past` are a rejected draft's: dropped."""
        start = min(self.length[row], past)
        if start < past:
            positions = torch.arange(start, past)
            slots = table[positions // block_size].long() * block_size + positions % block_size
            for rows, paged in ((self.k, paged_k), (self.v, paged_v)):
                rows[:, row, :, start:past] = paged[:, slots].transpose(1, 2)
        self.length[row] = past

    def write_back(self, row: int, past: int, slots: list[int], paged_k, paged_v) -> None:
        """The call's keys and values (the row's positions past .. past + len(slots) - 1) into their paged slots."""
        n = len(slots)
        if n == 1:
            paged_k[:, slots[0]] = self.k[:, row, :, past]
            paged_v[:, slots[0]] = self.v[:, row, :, past]
        else:
            index = torch.tensor(slots)
            paged_k[:, index] = self.k[:, row, :, past : past + n].transpose(1, 2)
            paged_v[:, index] = self.v[:, row, :, past : past + n].transpose(1, 2)
        self.length[row] = past + n


class OrtModel:
    """One onnxruntime session running every layer and the LM head over a step's tokens."""

    def __init__(
        self,
        model: DecoderModel,
        threads: int,
        activations: str,
        spin_us: int | None,
        release_model: bool = False,
        constants_folder: Path | None = None,
    ):
        """`spin_us`: how long the pool's idle threads spin for the next op before they sleep (0: they sleep at
        once; None: onnxruntime's own, unbounded spinning). `release_model`: no torch step will follow, so the
        model's own copies of what the graph holds are let go before the session is built (its projections where
        the graph's constants live in a file, its float head where the graph has exact codes). `constants_folder`:
        where that file goes (None: the constants stay in memory)."""
        import onnxruntime as ort

        cfg = model.config
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0" if spin_us == 0 else "1")
        if spin_us is not None:
            options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
        options.log_severity_level = 3
        # The arena reuses a prompt chunk's activation buffers; without it glibc keeps what they freed resident.
        options.enable_cpu_mem_arena = True
        builder = GraphBuilder(model, ROUNDED[activations])
        graph = builder.build().SerializeToString()
        # onnxruntime reads these by address and must have them for the session's life (it builds its own packed
        # copies from them): in a file, they take no memory once the session is built.
        self.constants = Constants(builder.external, constants_folder)
        model_cache.drop_all_pages()  # what the graph's build read of the converted model's file
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.constants.arrays.values()]
        options.add_external_initializers(list(self.constants.arrays), self._values)
        # The head as the graph reads it: its own codes where they are exact, else the float rows, bound by address.
        self.head = builder.int8_head  # where the embedding's rows come from (`embed`)
        self.own_head = self.head.exact
        # The file's copies where the codes went there (a small head's are serialized into the graph).
        self.head.codes = self.constants.arrays.get(builder.head_names[0], self.head.codes)
        self.head.scales = self.constants.arrays.get(builder.head_names[1], self.head.scales)
        self.head_rows = None if self.own_head else np.ascontiguousarray(head_weight(model).numpy())
        del builder
        if release_model:
            self._release(model)
        self.session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        self.constants.drop_resident()
        self.layers, self.vocab, self.hidden_size = cfg.num_layers, cfg.vocab_size, cfg.hidden_size
        self.rows = RowCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.rope_outside = cfg.qk_norm  # the graph's own rope op then takes the positions
        # One binding for the step's one-token rows, one for a longer piece: each binds the cache rows again only
        # when its rows or the buffers changed, and its inputs and output only when their shapes did.
        self.bindings = {kind: Bound(self.session.io_binding()) for kind in ("group", "one")}
        head = self.head_rows
        for bound in self.bindings.values():  # the head's rows stay where they are: bound once
            if head is not None:
                bound.binding.bind_input("head_rows", "cpu", 0, head.dtype, head.shape, head.ctypes.data)

    def _release(self, model: DecoderModel) -> None:
        """Lets go of the model's tensors the graph does not read: 108 MiB of float head on SmolLM2 (a GiB on a
        128k-vocabulary 2048-wide model), and its projections (79 MiB) once the graph's copies are in a file."""
        if self.own_head:
            model.lm_head = None
        if self.head.table is None:
            model.embed = None
        if self.constants.apart_from_model:
            model.layers = []

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` [tokens, hidden size] (`Int8Head.embed`)."""
        return self.head.embed(ids)

    def step(self, pieces: "list[Piece]", hidden, meta: AttentionMetadata, paged: tuple, block_size: int):
        """Logits [rows wanted, vocab] of one step over `hidden` [tokens, hidden size] (the step's embeddings).
        `paged` is the engine's (keys, values) cache as [layers, slots, kv, d]."""
        logits = torch.empty(sum(p.logits for p in pieces), self.vocab)
        self.rows.release({p.owner for p in pieces})
        group = [p for p in pieces if p.tokens == 1]
        if group:
            rows = self.rows.place_group([p.owner for p in group])
            order = sorted(range(len(group)), key=rows.__getitem__)  # batch row i is cache row i
            group = [group[i] for i in order]
            self._call(group, 0, "group", hidden, meta, paged, block_size, logits)
        for piece in pieces:
            if piece.tokens > 1:
                row = self.rows.place_one(piece.owner, len(group))
                self._call([piece], row, "one", hidden, meta, paged, block_size, logits)
        return logits

    def _call(self, pieces, first_row, kind, hidden, meta, paged, block_size, logits) -> None:
        """One session call: `pieces` in cache rows first_row, first_row + 1, ... (one piece if it has several
        tokens)."""
        n, tokens = len(pieces), pieces[0].tokens
        self.rows.reserve(first_row + n, max(p.past + p.tokens for p in pieces))
        # Each piece's last `logits` rows (at least one, so no call asks for none; the extra row is dropped).
        wanted = [r for i, p in enumerate(pieces) for r in range((i + 1) * tokens - max(p.logits, 1), (i + 1) * tokens)]
        for i, p in enumerate(pieces):
            self.rows.sync(first_row + i, p.past, meta.block_tables[p.index], *paged, block_size)
        bound = self._bound(kind, first_row, n, tokens, len(wanted))
        token_rows = torch.cat([torch.arange(p.first, p.first + p.tokens) for p in pieces])
        torch.index_select(hidden, 0, token_rows, out=torch.from_numpy(bound.inputs["hidden"]))
        bound.inputs["batch_shape"][:] = (n, tokens, -1)
        bound.inputs["seqlens"][:] = [p.past + tokens - 1 for p in pieces]
        bound.inputs["total"][...] = max(p.past for p in pieces) + tokens
        bound.inputs["logit_rows"][:] = wanted
        if self.rope_outside:
            bound.inputs["positions"][:, 0] = [q for p in pieces for q in range(p.past, p.past + tokens)]
        self.session.run_with_iobinding(bound.binding)
        start = 0
        for i, p in enumerate(pieces):
            slots = meta.slot_mapping[p.first : p.first + p.tokens].tolist()
            self.rows.write_back(first_row + i, p.past, slots, *paged)
            if p.logits:
                logits[p.logits_first : p.logits_first + p.logits] = bound.out[start : start + p.logits]
            start += max(p.logits, 1)

    def _bound(self, kind: str, first_row: int, n: int, tokens: int, wanted: int) -> "Bound":
        """The binding of `kind` with each layer's past and present keys / values on the same cache rows (the call
        writes its keys and values there in place), and with input and output buffers of this call's shapes, which
        a call fills in place."""
        bound = self.bindings[kind]
        binding = bound.binding
        if bound.rows_key != (first_row, n, self.rows.version):
            for i in range(self.layers):
                for name, cache in (("k", self.rows.k), ("v", self.rows.v)):
                    run = cache[i, first_row : first_row + n]
                    args = ("cpu", 0, np.float32, tuple(run.shape), run.data_ptr())
                    binding.bind_input(f"past_{name}_{i}", *args)
                    binding.bind_output(f"present_{name}_{i}", *args)
            bound.rows_key = (first_row, n, self.rows.version)
        if bound.shape_key != (n, tokens, wanted):
            bound.inputs = {
                "hidden": np.empty((n * tokens, self.hidden_size), np.float32),
                "batch_shape": np.empty(3, np.int64),  # (B, S, -1)
                "seqlens": np.empty(n, np.int32),
                "total": np.empty((), np.int32),
                "logit_rows": np.empty(wanted, np.int64),
            }
            if self.rope_outside:
                bound.inputs["positions"] = np.empty((n * tokens, 1), np.int64)
            for name, a in bound.inputs.items():
                binding.bind_input(name, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
            bound.out = torch.empty(wanted, self.vocab)
            binding.bind_output("logits", "cpu", 0, np.float32, tuple(bound.out.shape), bound.out.data_ptr())
            bound.shape_key = (n, tokens, wanted)
        return bound


class Constants:
    """The graph's large constants by name, in one unlinked file mapped read-only where a folder is given and takes
    one (else the arrays themselves). Once the session has built its own copies, the map's pages are let go: the
    file keeps their bytes, and a later read pages them back in."""

    def __init__(self, arrays: dict[str, np.ndarray], folder: Path | None):
        self.arrays, self._map = arrays, None
        if folder is not None and arrays:
            with contextlib.suppress(OSError):  # no room or no write access there: they stay in memory
                self._map, self.arrays = _file_backed(arrays, folder)

    @property
    def apart_from_model(self) -> bool:
        """None of the arrays is (a view of) the model's own memory: they are copies in the file, or none."""
        return self._map is not None or not self.arrays

    def drop_resident(self) -> None:
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)


def _file_backed(arrays: dict[str, np.ndarray], folder: Path) -> tuple[mmap.mmap, dict[str, np.ndarray]]:
    """The arrays written to an unlinked file in `folder` (each at a page boundary) and mapped back read-only."""
    folder.mkdir(parents=True, exist_ok=True)
    places = {}
    with tempfile.TemporaryFile(dir=folder) as f:
        for name, a in arrays.items():
            start = -(-f.tell() // mmap.PAGESIZE) * mmap.PAGESIZE
            f.seek(start)
            f.write(np.ascontiguousarray(a).data.cast("B"))
            places[name] = (start, a.dtype, a.shape)
        f.flush()
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    views = {
        n: np.frombuffer(mapped, dt, math.prod(shape), start).reshape(shape) for n, (start, dt, shape) in places.items()
    }
    return mapped, views


@dataclass
class Bound:
    """An io binding and what it is bound to: the cache rows (first row, rows, buffer version), and the shapes
    (rows, tokens a row, logits rows) of the input and output buffers it reads and writes by address."""

    binding: object
    rows_key: tuple | None = None
    shape_key: tuple | None = None
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    out: torch.Tensor | None = None


class GraphBuilder:
    """Writes the graph node by node (onnx.helper), weights as initializers. Activations are [tokens, width]
    ([B, S, width] around GroupQueryAttention), as Gemm wants them for the offset terms."""

    def __init__(self, model: DecoderModel, rounded: tuple[str, ...] = ()):
        self.model, self.cfg = model, model.config
        self.rounded = rounded
        self.head_names: tuple = (None, None)  # the head's codes and scales as graph constants, where it has them
        self.nodes, self.inits, self._n, self._group_ones = [], [], 0, {}
        self.external: dict[str, np.ndarray] = {}

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        names = [self.name(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name("n"), domain=domain, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    def const(self, array: np.ndarray, stem: str = "c") -> str:
        name, array = self.name(stem), np.ascontiguousarray(array)
        if array.nbytes < EXTERNAL_BYTES:
            self.inits.append(numpy_helper.from_array(array, name))
            return name
        self.external[name] = array  # the graph names it; onnxruntime is handed the array itself
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=name)
        self.inits.append(tensor)
        return name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), "shape")

    def rmsnorm(self, x: str, weight: torch.Tensor) -> str:
        w = self.const(weight.float().numpy(), "norm")
        return self.one("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=self.cfg.rms_norm_eps)

    def add_rmsnorm(self, x: str, residual: str, weight: torch.Tensor) -> tuple[str, str]:
        """(rmsnorm(x + residual), x + residual)."""
        w = self.const(weight.float().numpy(), "norm")
        normed, _, _, total = self.op(
            "SkipSimplifiedLayerNormalization",
            [x, residual, w],
            outputs=4,
            domain=MS_DOMAIN,
            epsilon=self.cfg.rms_norm_eps,
        )
        return normed, total

    def linear(self, x: str, w: Int4Weight, kind: str, bias: torch.Tensor | None = None) -> str:
        n, k = w.shape
        g = w.group_size
        codes = self.const(w.packed.reshape(n, k // g, g // 2).numpy(), "codes")
        scales = self.const(w.scales.float().reshape(-1).numpy(), "scales")
        level = INT8_ACTIVATIONS if kind in self.rounded else FP32_ACTIVATIONS
        attrs = dict(K=k, N=n, bits=4, block_size=g, accuracy_level=level)
        y = self.one("MatMulNBits", [x, codes, scales], domain=MS_DOMAIN, **attrs)  # zero point 8: (q - 8) * scale
        # What the group's offset adds beyond -8 * scale (nothing for symmetric weights), as a dense term over each
        # group's column sum. Centred codes matter with int8 activations: their rounding errors then cancel within
        # a group instead of adding up along the codes' mean.
        residual = w.offsets.float() + 8.0 * w.scales.float()
        if bool(residual.any()):
            sums = self.one("MatMul", [x, self.group_ones(k, g)])  # [B, K] @ [K, groups] of ones
            y = self.one("Gemm", [sums, self.const(residual.T.numpy(), "offsets"), y])  # y + sums @ offsets
        if bias is not None:
            y = self.one("Add", [y, self.const(bias.float().numpy(), "bias")])
        return y

    def group_ones(self, k: int, g: int) -> str:
        if (k, g) not in self._group_ones:
            ones = np.kron(np.eye(k // g, dtype=np.float32), np.ones((g, 1), dtype=np.float32))
            self._group_ones[(k, g)] = self.const(ones, "group_ones")
        return self._group_ones[(k, g)]

    def head(self, x: str) -> str:
        """The LM head over x as 8-bit codes (head.py's `Int8Head`, kept as `int8_head`)."""
        self.int8_head = Int8Head.of(self.model)
        arrays = (self.int8_head.codes, self.int8_head.scales)
        self.head_names = tuple(self.const(a, stem) for a, stem in zip(arrays, ("head_codes", "head_scales")))
        n, k = head_weight(self.model).shape
        attrs = dict(K=k, N=n, bits=8, block_size=HEAD_BLOCK, accuracy_level=HEAD_ACCURACY)
        return self.one("MatMulNBits", [x, *self.head_names], domain=MS_DOMAIN, **attrs)

    def refine(self, logits: str, x: str) -> str:
        """logits with each row's REFINE_TOP largest computed again from x and the head's own weights in float32:
        from the head's codes where they are exact (`head` tells), else from the float rows, an input bound to the
        model's tensor (as an initializer onnxruntime would copy them)."""
        top_k = min(REFINE_TOP, self.cfg.vocab_size)
        top = self.op("TopK", [logits, self.ints(top_k)], outputs=2, axis=-1)[1]  # [rows, top_k]
        if self.int8_head.exact:  # head_values in graph ops: (codes - 128) * scale, block by block
            codes, scales = (self.one("Gather", [name, top], axis=0) for name in self.head_names)
            codes = self.one("Sub", [self.one("Cast", [codes], to=TensorProto.FLOAT), self.const(np.float32(128))])
            rows = self.one("Mul", [codes, self.one("Unsqueeze", [scales, self.ints(-1)])])
            rows = self.one("Reshape", [rows, self.ints(0, top_k, self.cfg.hidden_size)])
        else:
            rows = self.one("Gather", ["head_rows", top], axis=0)  # the graph input `build` declares
            if head_weight(self.model).dtype != torch.float32:
                rows = self.one("Cast", [rows], to=TensorProto.FLOAT)
        exact = self.one("MatMul", [rows, self.one("Unsqueeze", [x, self.ints(-1)])])  # [rows, top_k, 1]
        exact = self.one("Reshape", [exact, self.ints(0, top_k)])
        return self.one("ScatterElements", [logits, top, exact], axis=1)

    def layer(self, i: int, residual: str, hidden: str | None) -> tuple[str, str]:
        cfg, w = self.cfg, self.model.layers[i]
        d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if hidden is None:
            x = self.rmsnorm(residual, w.input_norm)
        else:
            x, residual = self.add_rmsnorm(hidden, residual, w.input_norm)
        qkv = self.linear(x, w.qkv, "qkv", w.qkv_bias)
        if cfg.qk_norm:  # per-head norms before the rope, which then runs here too
            qkv = self.one("Reshape", [qkv, self.ints(0, heads + 2 * kv, d)])
            q, key, value = self.op("Split", [qkv, self.ints(heads, kv, kv)], outputs=3, axis=1)
            q, key = self.rmsnorm(q, w.q_norm), self.rmsnorm(key, w.k_norm)
            # Each token as a sequence of one at its own position ([T, 1, width], positions [T, 1]).
            qk = self.one("Reshape", [self.one("Concat", [q, key], axis=1), self.ints(0, 1, (heads + kv) * d)])
            rope = [qk, "positions", self.cos, self.sin]
            qk = self.one("RotaryEmbedding", rope, domain=MS_DOMAIN, num_heads=heads + kv)
            qkv = self.one("Concat", [qk, self.one("Reshape", [value, self.ints(0, 1, kv * d)])], axis=-1)
        qkv = self.one("Reshape", [qkv, "batch_shape"])  # [B, S, width]: a call's rows are B pieces of S tokens
        attn, _, _ = self.op(
            "GroupQueryAttention",
            [qkv, "", "", f"past_k_{i}", f"past_v_{i}", "seqlens", "total", self.cos, self.sin],
            outputs=3,
            domain=MS_DOMAIN,
            num_heads=heads,
            kv_num_heads=kv,
            do_rotary=int(not cfg.qk_norm),
            scale=d**-0.5,
        )
        self.nodes[-1].output[1:] = [f"present_k_{i}", f"present_v_{i}"]
        attn = self.linear(self.one("Reshape", [attn, self.ints(-1, heads * d)]), w.o, "o")
        x, residual = self.add_rmsnorm(attn, residual, w.post_norm)
        gate, up = self.op("Split", [self.linear(x, w.gate_up, "gate_up")], outputs=2, axis=-1, num_outputs=2)
        act = self.one("Mul", [self.one("Mul", [gate, self.one("Sigmoid", [gate])]), up])
        return residual, self.linear(act, w.down, "down")

    def build(self):
        cfg = self.cfg
        cos, sin = self.model.cos_sin.float().chunk(2, dim=-1)
        self.cos, self.sin = self.const(cos.contiguous().numpy(), "cos"), self.const(sin.contiguous().numpy(), "sin")
        residual, hidden = "hidden", None
        for i in range(cfg.num_layers):
            residual, hidden = self.layer(i, residual, hidden)
        out, _ = self.add_rmsnorm(hidden, residual, self.model.norm)
        wanted = self.one("Gather", [out, "logit_rows"], axis=0)
        self.nodes.append(helper.make_node("Identity", [self.refine(self.head(wanted), wanted)], ["logits"]))
        f32, i32 = TensorProto.FLOAT, TensorProto.INT32
        kv, d = cfg.num_kv_heads, cfg.head_dim
        run = ["batch", kv, "capacity", d]
        i64 = TensorProto.INT64
        inputs = [
            helper.make_tensor_value_info("hidden", f32, ["tokens", cfg.hidden_size]),
            helper.make_tensor_value_info("batch_shape", i64, [3]),  # (B, S, -1): B pieces of S tokens
            helper.make_tensor_value_info("seqlens", i32, ["batch"]),  # positions a piece will have, minus one
            helper.make_tensor_value_info("total", i32, []),
            helper.make_tensor_value_info("logit_rows", i64, ["wanted"]),
        ]
        if cfg.qk_norm:
            inputs.append(helper.make_tensor_value_info("positions", i64, ["tokens", 1]))
        if not self.int8_head.exact:
            head = head_weight(self.model)
            head_type = helper.np_dtype_to_tensor_dtype(head.numpy().dtype)
            inputs.append(helper.make_tensor_value_info("head_rows", head_type, list(head.shape)))
        outputs = [helper.make_tensor_value_info("logits", f32, ["wanted", cfg.vocab_size])]
        for i in range(cfg.num_layers):
            for kind in ("k", "v"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", f32, run))
                outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", f32, run))
        graph = helper.make_graph(self.nodes, "flashnext_int4", inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=9)
