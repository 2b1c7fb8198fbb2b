"""Which slice of every weight a tensor-parallel rank holds (docs/parallel.md).

q/k/v and gate/up are split by output rows (column-parallel), o and down by input columns (row-parallel: their
partial products are summed by one all-reduce each), the embedding table and the LM head by vocabulary rows. KV
heads are split like the query heads, or, where a model has fewer KV heads than ranks, each rank keeps the one KV
head its query heads read. Norms stay whole. Loaders read only their rank's slices (safetensors slices, GGUF
tensors sliced from the memory map); `shard_loaded` cuts a model already in memory the same way.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import UserError
from .precision import Int4Weight, Weight

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ROWS_BY_HEAD = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_ROWS_BY_KV_HEAD = (
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def size_fits(config: ModelConfig, size: int) -> bool:
    heads, kv, ffn = config.num_heads, config.num_kv_heads, config.intermediate_size
    return heads % size == 0 and (kv % size == 0 or size % kv == 0) and ffn % size == 0


def fitting_sizes(config: ModelConfig) -> list[int]:
    return [n for n in range(1, min(config.num_heads, 256) + 1) if size_fits(config, n)]


def check_size(config: ModelConfig, size: int, source: str) -> None:
    """Refuse a tensor-parallel size the model's heads or MLP do not split into evenly, before any weight is read."""
    if size == 1 or size_fits(config, size):
        return
    counts = (
        f"{config.num_heads} attention heads, {config.num_kv_heads} KV heads, {config.intermediate_size} MLP columns"
    )
    sizes = ", ".join(map(str, fitting_sizes(config)))
    raise UserError(
        f"{source}: --tensor-parallel {size} does not split the model ({counts}) evenly; "
        f"sizes that work for it: {sizes}"
    )


@dataclass(frozen=True)
class Shard:
    """A rank of a tensor-parallel group, as a loader is told it: the plan follows from the model's config."""

    rank: int
    size: int

    def plan(self, config: ModelConfig, source: str) -> ShardPlan:
        check_size(config, self.size, source)
        return ShardPlan(config, self.rank, self.size)


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    rank: int
    size: int

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_kv_heads
        return self.rank * self.kv_heads if kv >= self.size else self.rank // (self.size // kv)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """Rows [start, stop) of the embedding and head: ceil(vocab / size) a rank, the last one shorter."""
        vocab = self.config.vocab_size
        rows = -(-vocab // self.size)
        start = min(vocab, self.rank * rows)
        return start, min(vocab, start + rows)

    def local_config(self) -> ModelConfig:
        """The config one rank's DecoderModel runs: its heads and MLP columns, the whole vocabulary and hidden
        size (the embedding's rows are a slice, handled by the TensorParallel ops). MTP modules are not loaded."""
        return self.config.model_copy(
            update={
                "num_heads": self.heads,
                "num_kv_heads": self.kv_heads,
                "intermediate_size": self.config.intermediate_size // self.size,
                "num_mtp_modules": 0,
            }
        )

    def keeps(self, name: str) -> bool:
        """MTP modules' layers (past num_layers) are left unread: speculative MTP does not run tensor-parallel."""
        m = _LAYER.match(name)
        return m is None or int(m.group(1)) < self.config.num_layers

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of the tensor `name` (canonical HF names), None: all of it."""
        hd, ffn = self.config.head_dim, self.config.intermediate_size // self.size
        if name in _VOCAB:
            return (0, *self.vocab_range)
        m = _LAYER.match(name)
        part = m.group(2) if m else ""
        q_rows = (self.rank * self.heads * hd, (self.rank + 1) * self.heads * hd)
        if part in _ROWS_BY_HEAD:
            return (0, *q_rows)
        if part in _ROWS_BY_KV_HEAD:
            return (0, self.first_kv_head * hd, (self.first_kv_head + self.kv_heads) * hd)
        if part == "self_attn.o_proj.weight":
            return (1, *q_rows)
        if part in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return (0, self.rank * ffn, (self.rank + 1) * ffn)
        if part == "mlp.down_proj.weight":
            return (1, self.rank * ffn, (self.rank + 1) * ffn)
        return None

    def expected_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        cut = self.slice_of(name)
        if cut is None:
            return shape
        dim, start, stop = cut
        return tuple(stop - start if d == dim else n for d, n in enumerate(shape))


def slice_weight(w: Weight, dim: int, start: int, stop: int, name: str) -> Weight:
    """A copy of rows (dim 0) or columns (dim 1) [start, stop) of a weight in any stored form. Columns of a
    quantized weight must fall on its group (or block) boundaries."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, stop - start).contiguous().clone()
    if isinstance(w, Int4Weight):
        if dim == 0:
            return Int4Weight(*(t[start:stop].clone() for t in (w.packed, w.scales, w.offsets)), w.group_size)
        g = _whole_groups(name, start, stop, w.group_size)
        packed = w.packed[:, start // 2 : stop // 2].clone()
        return Int4Weight(packed, w.scales[:, g].clone(), w.offsets[:, g].clone(), w.group_size)
    data = w.data.view(torch.uint8).narrow(dim, start, stop - start).clone().view(w.data.dtype)
    if w.block is not None:  # the blocks' scales: whole blocks only
        block = w.block[dim]
        if start % block or (stop % block and stop != w.shape[dim]):
            _whole_groups(name, start, stop, block)
        scale = w.scale.narrow(dim, start // block, -(-stop // block) - start // block).clone()
    elif dim == 0 and w.scale.shape[0] > 1:
        scale = w.scale[start:stop].clone()
    else:
        scale = w.scale.clone()
    return dataclasses.replace(w, data=data, scale=scale)


def _whole_groups(name: str, start: int, stop: int, group: int) -> slice:
    if start % group or stop % group:
        raise UserError(
            f"{name}: its columns {start}..{stop} of this rank do not fall on the quantization groups of "
            f"{group}; pick a tensor-parallel size that splits the layer into whole groups"
        )
    return slice(start // group, stop // group)


def shard_loaded(loaded, plan: ShardPlan):
    """A LoadedModel's shard for one rank, cut from the weights in memory (random benchmark weights, models a
    caller built): the slices are copies, so the whole model can be dropped afterwards."""
    weights = {}
    for name, w in loaded.weights.items():
        if not plan.keeps(name):
            continue
        cut = plan.slice_of(name)
        weights[name] = w if cut is None else slice_weight(w, *cut, name)
    return dataclasses.replace(loaded, config=plan.local_config(), weights=weights)


def check_shard(config: ModelConfig, plan: ShardPlan, weights: dict[str, Weight], source: str) -> None:
    """Every weight a rank needs, in its shard's shape (the whole model's shapes were checked against the
    config when the checkpoint's header was read)."""
    from .loaded_model import expected_shapes

    for name, shape in expected_shapes(config).items():
        w = weights.get(name)
        want = plan.expected_shape(name, shape)
        if w is None:
            raise UserError(
                f"{source}: weight {name} is missing; the checkpoint is incomplete or not this architecture"
            )
        if tuple(int(x) for x in w.shape) != want:
            raise UserError(
                f"{source}: weight {name} has shape {list(w.shape)} on rank {plan.rank}, expected {list(want)}; "
                "the config and weights do not match"
            )
