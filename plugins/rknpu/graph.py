"""The decoder as one static-shape torch module, written for ONNX export and an NPU that runs 16-bit floats.

Shapes are fixed at export: `batch` sequences of `tokens` new tokens each, attending over a `context`-long KV
cache given as inputs plus the step's own keys. The graph returns the step's new keys and values; the runner
writes them into its cache. The embedding lookup stays on the host (one row a token, a gather the NPU does
poorly); rope arrives as cos / sin inputs; the mask is additive.

Inputs:  embeds [B, T, H] · cos, sin [B, 1, T, D/2] · mask [B, 1, T, C + T] · past_k_i, past_v_i [B, KV, C, D]
Outputs: logits [B, T, V] · new_k_i, new_v_i [B, KV, T, D]
"""

from dataclasses import dataclass

import torch
from torch import nn

from flashnext.core.config import ModelConfig
from flashnext.core.model import DecoderModel
from flashnext.core.precision import Weight

# Added to masked scores: far below any real score, yet finite in fp16 so a fully masked (padding) row stays a
# uniform softmax rather than NaN.
MASK_VALUE = -1.0e4
# RMSNorm squares activations pre-scaled by this: each (x*s)^2 stays inside fp16 while |x| < 64 * sqrt(65504)
# (about 16k), and (x*s) / rms(x*s) == x / rms(x).
NORM_PRESCALE = 1.0 / 64.0


@dataclass(frozen=True)
class GraphShape:
    batch: int
    tokens: int
    context: int

    @property
    def name(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"


def dense(w: Weight) -> torch.Tensor:
    """A projection as float32 values: an Int4Weight gives exactly its int4 grid (q * scale + offset)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)


def input_names(num_layers: int) -> list[str]:
    return ["embeds", "cos", "sin", "mask"] + [f"past_{kv}_{i}" for i in range(num_layers) for kv in "kv"]


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"new_{kv}_{i}" for i in range(num_layers) for kv in "kv"]


class RmsNorm(nn.Module):
    """Mul / ReduceMean / Add / Sqrt / Div only: no Pow, no fp32-only ops, all on the NPU."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
        self.eps = eps * NORM_PRESCALE * NORM_PRESCALE

    def forward(self, x):
        x = x * NORM_PRESCALE
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class Linear(nn.Module):
    """x @ W^T with W stored transposed ([K, N]): a plain MatMul in the graph, no transpose to fold."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_t = nn.Parameter(weight.float().t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(), requires_grad=False)

    def forward(self, x):
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer):
        super().__init__()
        self.cfg = cfg
        self.input_norm = RmsNorm(layer.input_norm, cfg.rms_norm_eps)
        self.qkv = Linear(dense(layer.qkv), layer.qkv_bias)
        self.q_norm = RmsNorm(layer.q_norm, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RmsNorm(layer.k_norm, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o = Linear(dense(layer.o))
        self.post_norm = RmsNorm(layer.post_norm, cfg.rms_norm_eps)
        self.gate_up = Linear(dense(layer.gate_up))
        self.down = Linear(dense(layer.down))

    def forward(self, x, cos, sin, mask, past_k, past_v, b: int, t: int):
        cfg = self.cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv(self.input_norm(x))
        q, k, v = qkv[..., : h * d], qkv[..., h * d : (h + kv) * d], qkv[..., (h + kv) * d :]
        q = q.reshape(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        k = k.reshape(b, t, kv, d).transpose(1, 2)
        v = v.reshape(b, t, kv, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys = torch.cat([past_k, k], dim=2)  # [B, KV, C + T, D]
        values = torch.cat([past_v, v], dim=2)
        group = h // kv
        # Grouped heads as rows: [B, KV, G * T, D] against [B, KV, C + T, D], 4-D throughout.
        qg = q.reshape(b, kv, group * t, d)
        scores = torch.matmul(qg, keys.transpose(2, 3)) * d**-0.5 + torch.cat([mask] * group, dim=2)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, KV, G * T, D]
        out = out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        x = x + self.o(out)
        gate_up = self.gate_up(self.post_norm(x))
        half = gate_up.shape[-1] // 2
        x = x + self.down(nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:])
        return x, k, v


def rotate(x, cos, sin):
    """Neox-style rope, as the core's kernels: first half with second half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class StaticDecoder(nn.Module):
    """Built from the core's DecoderModel (its weights in the export precision, projections as exact grids).
    `shape` is set before each export: sizes come from it as plain ints, so the graph holds no Shape ops."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.shape: GraphShape | None = None
        cfg = model.config
        self.num_layers = cfg.num_layers
        self.layers = nn.ModuleList(Layer(cfg, layer) for layer in model.layers)
        self.norm = RmsNorm(model.norm, cfg.rms_norm_eps)
        self.head = Linear(dense(model.lm_head))

    def forward(self, embeds, cos, sin, mask, *past):
        x, new = embeds, []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, past[2 * i], past[2 * i + 1], self.shape.batch, self.shape.tokens)
            new += [k, v]
        return (self.head(self.norm(x)), *new)


def example_inputs(cfg: ModelConfig, shape: GraphShape) -> tuple[torch.Tensor, ...]:
    b, t, c = shape.batch, shape.tokens, shape.context
    half = cfg.head_dim // 2
    past = torch.zeros(b, cfg.num_kv_heads, c, cfg.head_dim)
    return (
        torch.zeros(b, t, cfg.hidden_size),
        torch.ones(b, 1, t, half),
        torch.zeros(b, 1, t, half),
        torch.zeros(b, 1, t, c + t),
        *([past] * (2 * cfg.num_layers)),
    )
