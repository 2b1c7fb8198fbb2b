"""Int4 decode steps through onnxruntime: the whole layer stack as one graph that computes from the 4-bit codes.

Every projection is a `MatMulNBits` over the Int4Weight's own codes and scales (activations float32, or rounded to
int8 in blocks as llama.cpp's Q4 x Q8 dot does: ACCURACY_LEVEL); the rest of a layer (RMSNorm, rope, attention over
the paged KV cache, SiLU, residuals) is in the same graph, so a decode step is one session call instead of hundreds
of torch ops. The cache is read in place (bound by pointer); the step's new keys and values come back as outputs
that the runner writes into the cache after the call. Prefill and the LM head stay on the torch path.

An Int4Weight value is q * scale + offset (q = 0..15); MatMulNBits computes (q - zero_point) * scale with integer
zero points. Symmetric weights (offset = -8 * scale) are exactly zero point 8. Otherwise the codes run with zero
point 0 and the offsets are added as a dense product of each group's column sum: sum_g offset_g * sum(x_g).
"""

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from flashnext.core.kernels import AttentionMetadata
from flashnext.core.model import DecoderModel
from flashnext.core.precision import Int4Weight

# MatMulNBits accuracy levels: 4 rounds activations to int8 in blocks of the group size (integer dot products, the
# fast kernels); 1 keeps them float32 (the weights widened block by block: the reference's numbers).
ACCURACY_LEVEL = {"int8": 4, "fp32": 1}
BLOCK_SIZES = (16, 32, 64, 128, 256)  # group sizes MatMulNBits takes
MS_DOMAIN = "com.microsoft"


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
    return None


@dataclass
class DecodeOutputs:
    hidden: torch.Tensor  # [B, hidden] after the final norm
    keys: torch.Tensor  # [B, layers, kv_heads, head_dim]: the step's new keys, not yet in the cache
    values: torch.Tensor


class OrtDecoder:
    """One onnxruntime session running a decode step of every layer; the KV cache is [layers * blocks, ...]."""

    def __init__(
        self, model: DecoderModel, num_blocks: int, threads: int, activations: str = "fp32", spinning: bool = False
    ):
        import onnxruntime as ort

        self.model, self.num_blocks = model, num_blocks
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = False  # a step's activations are small; an arena only keeps freed weights copies
        # Serialized at once, so the proto's copy of the weights is gone before onnxruntime makes its own.
        graph = GraphBuilder(model, num_blocks, ACCURACY_LEVEL[activations]).build().SerializeToString()
        self.session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()

    def step(self, hidden, positions, meta: AttentionMetadata, k_cache, v_cache) -> DecodeOutputs:
        """One decode step of B sequences (one token each) whose embeddings are `hidden` [B, hidden]."""
        cfg = self.model.config
        rows = hidden.shape[0]
        block_size = k_cache.shape[1]
        width = -(-meta.max_context_len // block_size)
        blocks = meta.block_tables[:, :width].clamp_min(0).long()
        past = meta.context_lens.long() - 1
        span = torch.arange(width * block_size + 1)
        valid = ((span < past[:, None]) | (span == width * block_size)).contiguous()
        out = DecodeOutputs(
            torch.empty(rows, cfg.hidden_size),
            torch.empty(rows, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
            torch.empty(rows, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
        )
        inputs = {
            "hidden": hidden.contiguous(),
            "positions": positions.long().reshape(rows, 1).contiguous(),
            "blocks": blocks.contiguous(),
            "valid": valid[:, None, None, :],  # scores [B, KV, group, span]
            "valid_rows": valid[:, :, None, None],  # values [B, span, KV, D]: the same bytes
            "k_cache": k_cache,
            "v_cache": v_cache,
        }
        b = self.binding
        for name, t in inputs.items():
            b.bind_input(name, "cpu", 0, _NP[t.dtype], tuple(t.shape), t.data_ptr())
        for name, t in (("out", out.hidden), ("k_new", out.keys), ("v_new", out.values)):
            b.bind_output(name, "cpu", 0, np.float32, tuple(t.shape), t.data_ptr())
        self.session.run_with_iobinding(b)
        return out


_NP = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}


class GraphBuilder:
    """Writes the decode graph node by node (onnx.helper), weights as initializers."""

    def __init__(self, model: DecoderModel, num_blocks: int, accuracy_level: int):
        self.model, self.cfg, self.num_blocks = model, model.config, num_blocks
        self.accuracy_level = accuracy_level
        self.nodes, self.inits, self._n = [], [], 0

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
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
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

    def linear(self, x: str, w: Int4Weight, bias: torch.Tensor | None = None) -> str:
        n, k = w.shape
        g = w.group_size
        codes = self.const(w.packed.reshape(n, k // g, g // 2).numpy(), "codes")
        scales = self.const(w.scales.float().reshape(-1).numpy(), "scales")
        symmetric = bool(torch.equal(w.offsets.float(), -8.0 * w.scales.float()))
        inputs = [x, codes, scales]
        if not symmetric:  # zero point 0: the codes' own value; the offsets follow as a dense term
            inputs.append(self.const(np.zeros((n, -(-(k // g) // 2)), dtype=np.uint8), "zero"))
        attrs = dict(K=k, N=n, bits=4, block_size=g, accuracy_level=self.accuracy_level)
        y = self.one("MatMulNBits", inputs, domain=MS_DOMAIN, **attrs)
        if not symmetric:  # [B, K] @ [K, groups] of ones: each group's column sum
            sums = self.one("MatMul", [x, self.group_ones(k, g)])
            y = self.one("Add", [y, self.one("MatMul", [sums, self.const(w.offsets.float().T.numpy(), "offsets")])])
        if bias is not None:
            y = self.one("Add", [y, self.const(bias.float().numpy(), "bias")])
        return y

    def group_ones(self, k: int, g: int) -> str:
        if (k, g) not in self._group_ones:
            ones = np.kron(np.eye(k // g, dtype=np.float32), np.ones((g, 1), dtype=np.float32))
            self._group_ones[(k, g)] = self.const(ones, "group_ones")
        return self._group_ones[(k, g)]

    def attention(self, q: str, key: str, value: str, layer: int) -> str:
        """q [B, H, D] over the cached context (masked by `valid`) and the step's own key / value [B, 1, KV, D]."""
        cfg = self.cfg
        kv, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        q = self.one("Mul", [self.one("Reshape", [q, self.ints(0, kv, group, d)]), self.scale])
        blocks = self.one("Add", ["blocks", self.const(np.array(layer * self.num_blocks, dtype=np.int64))])
        context = []
        for cache, new in (("k_cache", key), ("v_cache", value)):
            past = self.one("Reshape", [self.one("Gather", [cache, blocks]), self.ints(0, -1, kv, d)])
            context.append(self.one("Concat", [past, new], axis=1))  # [B, P + 1, KV, D]
        # Slots past a sequence's end hold whatever the memory held: a NaN there would survive a zero weight.
        context[1] = self.one("Where", ["valid_rows", context[1], self.zero])
        scores = self.one("MatMul", [q, self.one("Transpose", [context[0]], perm=[0, 2, 3, 1])])
        probs = self.one("Softmax", [self.one("Where", ["valid", scores, self.neg_inf])], axis=-1)
        out = self.one("MatMul", [probs, self.one("Transpose", [context[1]], perm=[0, 2, 1, 3])])
        return self.one("Reshape", [out, self.ints(0, cfg.num_heads * d)])

    def layer(self, i: int, residual: str, hidden: str | None) -> tuple[str, str]:
        cfg, w = self.cfg, self.model.layers[i]
        d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if hidden is None:
            x = self.rmsnorm(residual, w.input_norm)
        else:
            x, residual = self.add_rmsnorm(hidden, residual, w.input_norm)
        qkv = self.linear(x, w.qkv, w.qkv_bias)
        if cfg.qk_norm:
            qkv = self.one("Reshape", [qkv, self.ints(0, heads + 2 * kv, d)])
            q, key, value = self.op("Split", [qkv, self.ints(heads, kv, kv)], outputs=3, axis=1)
            q, key = self.rmsnorm(q, w.q_norm), self.rmsnorm(key, w.k_norm)
            qk = self.one("Concat", [q, key], axis=1)
        else:
            qk, value = self.op("Split", [qkv, self.ints((heads + kv) * d, kv * d)], outputs=2, axis=-1)
        qk = self.one("Reshape", [qk, self.ints(0, 1, (heads + kv) * d)])
        qk = self.one("RotaryEmbedding", [qk, "positions", self.cos, self.sin], domain=MS_DOMAIN, num_heads=heads + kv)
        qk = self.one("Reshape", [qk, self.ints(0, heads + kv, d)])
        q, key = self.op("Split", [qk, self.ints(heads, kv)], outputs=2, axis=1)
        key = self.one("Reshape", [key, self.ints(0, 1, kv, d)])
        value = self.one("Reshape", [value, self.ints(0, 1, kv, d)])
        self.new_keys.append(key)
        self.new_values.append(value)
        attn = self.linear(self.attention(q, key, value, i), w.o)
        x, residual = self.add_rmsnorm(attn, residual, w.post_norm)
        gate, up = self.op("Split", [self.linear(x, w.gate_up)], outputs=2, axis=-1, num_outputs=2)
        act = self.one("Mul", [self.one("Mul", [gate, self.one("Sigmoid", [gate])]), up])
        return residual, self.linear(act, w.down)

    def build(self):
        cfg = self.cfg
        self.new_keys, self.new_values, self._group_ones = [], [], {}
        cos, sin = self.model.cos_sin.float().chunk(2, dim=-1)
        self.cos, self.sin = self.const(cos.contiguous().numpy(), "cos"), self.const(sin.contiguous().numpy(), "sin")
        self.scale = self.const(np.array(cfg.head_dim**-0.5, dtype=np.float32), "scale")
        self.neg_inf = self.const(np.array(-np.inf, dtype=np.float32), "neg_inf")
        self.zero = self.const(np.array(0.0, dtype=np.float32), "zero")
        residual, hidden = "hidden", None
        for i in range(cfg.num_layers):
            residual, hidden = self.layer(i, residual, hidden)
        out, _ = self.add_rmsnorm(hidden, residual, self.model.norm)
        self.nodes.append(helper.make_node("Identity", [out], ["out"]))
        self.nodes.append(helper.make_node("Concat", self.new_keys, ["k_new"], axis=1))
        self.nodes.append(helper.make_node("Concat", self.new_values, ["v_new"], axis=1))
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        kv, d = cfg.num_kv_heads, cfg.head_dim
        cache = ["cache_blocks", "block_size", kv, d]
        inputs = [
            helper.make_tensor_value_info("hidden", f32, ["batch", cfg.hidden_size]),
            helper.make_tensor_value_info("positions", i64, ["batch", 1]),
            helper.make_tensor_value_info("blocks", i64, ["batch", "width"]),
            helper.make_tensor_value_info("valid", TensorProto.BOOL, ["batch", 1, 1, "span"]),
            helper.make_tensor_value_info("valid_rows", TensorProto.BOOL, ["batch", "span", 1, 1]),
            helper.make_tensor_value_info("k_cache", f32, cache),
            helper.make_tensor_value_info("v_cache", f32, cache),
        ]
        outputs = [
            helper.make_tensor_value_info("out", f32, ["batch", cfg.hidden_size]),
            helper.make_tensor_value_info("k_new", f32, ["batch", cfg.num_layers, kv, d]),
            helper.make_tensor_value_info("v_new", f32, ["batch", cfg.num_layers, kv, d]),
        ]
        graph = helper.make_graph(self.nodes, "flashnext_decode", inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=9)
