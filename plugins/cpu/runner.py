"""The CPU runner: prefill through the model's torch forward, int4 decode steps through one onnxruntime graph."""

import time

import torch

from flashnext.core.engine.runner import ModelRunner, RunnerSetup, StepInputs
from flashnext.core.errors import UserError
from flashnext.core.model import DecoderModel

from . import ort_decode


class CpuRunner(ModelRunner):
    """ModelRunner with the KV cache of all layers in one tensor (so the decode graph reads it by one pointer and
    one index_copy_ stores a step's keys), and decode steps through `OrtDecoder` where the model allows it."""

    int4_decode = "auto"  # the profile's choices; set on the subclass CpuBackend.runner_class returns
    batch_invariant = False
    spinning = False  # the graph's thread pool sleeps between ops (a spinning one loses more on a shared machine)

    def __init__(self, model: DecoderModel, setup: RunnerSetup):
        model.kernels.batch_invariant = self.batch_invariant  # before any step: every row's arithmetic is fixed
        super().__init__(model, setup)
        cfg = model.config
        shape = (cfg.num_layers * setup.num_blocks, setup.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.empty(shape, dtype=setup.kv_dtype)
        self.v_cache = torch.empty(shape, dtype=setup.kv_dtype)
        n = setup.num_blocks
        self.kv_caches = [
            (self.k_cache[i * n : (i + 1) * n], self.v_cache[i * n : (i + 1) * n]) for i in range(cfg.num_layers)
        ]
        self.route, self.route_reason = decode_route(self.int4_decode, model, setup.kv_dtype)
        self.decoder: ort_decode.OrtDecoder | None = None

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.route == "torch" or not inputs.is_decode or bool((inputs.meta.slot_mapping < 0).any()):
            return super().forward(inputs)
        if self.decoder is None:
            start = time.perf_counter()
            activations = "int8" if self.route == "onnxruntime-int8" else "fp32"
            self.decoder = ort_decode.OrtDecoder(
                self.model, self.setup.num_blocks, torch.get_num_threads(), activations, self.spinning
            )
            self.warm_up_s += time.perf_counter() - start
        model = self.model
        hidden = model.kernels.embedding(inputs.input_ids, model.embed)
        out = self.decoder.step(hidden, inputs.positions, inputs.meta, self.k_cache, self.v_cache)
        # Slot s of layer l is row l * blocks * block_size + s of the flattened cache.
        layer_rows = torch.arange(model.config.num_layers) * (self.setup.num_blocks * self.block_size)
        rows = (inputs.meta.slot_mapping[:, None] + layer_rows).flatten()
        for cache, new in ((self.k_cache, out.keys), (self.v_cache, out.values)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, rows, new.flatten(0, 1))
        return out.hidden


def decode_route(choice: str, model: DecoderModel, kv_dtype: torch.dtype) -> tuple[str, str]:
    """(route, why): an onnxruntime route where the graph can run this model's decode steps and the choice allows
    it; `auto` is `onnxruntime` (float32 activations)."""
    if choice == "torch":
        return "torch", "int4_decode = torch (profile / FLASHNEXT_INT4_DECODE)"
    reason = ort_decode.unsupported(model, kv_dtype)
    if getattr(model, "parallel", None) is not None:  # the graph holds whole layers: no all-reduce between ranks
        reason = "tensor-parallel ranks hold shards of each layer"
    if getattr(model.kernels, "batch_invariant", False):  # onnxruntime's GEMMs block by the number of rows
        reason = "batch_invariant asks for fixed per-row arithmetic"
    if reason is None:
        route = "onnxruntime" if choice == "auto" else choice
        acts = "int8" if route == "onnxruntime-int8" else "float32"
        return route, f"int4 decode steps through one onnxruntime MatMulNBits graph, {acts} activations"
    if choice != "auto":
        raise UserError(f"int4_decode = {choice} cannot run this model: {reason}; set int4_decode to auto or torch")
    return "torch", f"decode through torch: {reason}"
