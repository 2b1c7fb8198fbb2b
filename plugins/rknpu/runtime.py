"""Running exported graphs: a session per graph (rknn-toolkit-lite2 on the board; rknn-toolkit2's simulator or
onnxruntime elsewhere), the model that steps them over a slot-per-sequence KV cache, and the engine's runner on top."""

import json
from pathlib import Path

import numpy as np
import torch

from flashnext.core.config import ModelConfig
from flashnext.core.engine.runner import ModelRunner, RunnerSetup, StepInput, StepResult, noise_seed
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import Status
from flashnext.core.errors import FlashnextError, UserError
from flashnext.core.kernels import ReferenceKernels, SamplingTensors
from flashnext.core.model import rope_cache

from .graph import MASK_VALUE

MANIFEST = "manifest.json"
# RKNNLite.NPU_CORE_* values: which of the three NPU cores a context runs on.
CORE_MASKS = {"auto": 0, "0": 1, "1": 2, "2": 4, "0_1": 3, "0_1_2": 7}


class NpuRuntimeError(FlashnextError):
    """The NPU runtime refused a call (it reports by return code, never by exception)."""


class OnnxSession:
    """One exported graph under onnxruntime on the CPU: the NPU's stand-in for checks, CI and machines without it."""

    def __init__(self, path: Path, threads: int = 0):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, dict(zip(self.names, inputs)))

    def release(self) -> None:
        self.session = None


class RknnLiteSession:
    """One converted graph (.rknn) on the NPU through rknn-toolkit-lite2. Its calls return 0 / -1 or None on error
    and never raise: each is checked here and turned into one error that names the file and the call."""

    def __init__(self, path: Path, core_mask: int = 0, rknnlite=None):
        if rknnlite is None:
            from rknnlite import api as rknnlite
        self.path = path
        self.rknn = rknnlite.RKNNLite(verbose=False)
        if self.rknn.load_rknn(str(path)) != 0:
            raise NpuRuntimeError(
                f"{path}: load_rknn failed; convert the graph again for rk3588 with "
                "benchmarks/rknn_simulate.sh or rknn-toolkit2 of the board's runtime version"
            )
        if self.rknn.init_runtime(core_mask=core_mask) != 0:
            self.rknn.release()
            raise NpuRuntimeError(
                f"{path}: init_runtime(core_mask={core_mask}) failed; check that librknnrt.so "
                "and the rknpu driver are installed and that the cores exist (RK3588: 0, 1, 2)"
            )

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        # As the arrays are: a 4-D input would otherwise be taken for an NHWC image and transposed.
        outputs = self.rknn.inference(inputs=inputs, data_format=["nchw"] * len(inputs))
        if outputs is None:
            raise NpuRuntimeError(
                f"{self.path}: inference returned no outputs (the NPU runtime logged why); "
                "check the input shapes against manifest.json"
            )
        return outputs

    def release(self) -> None:
        self.rknn.release()


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{folder}: no {MANIFEST}; backend 'rknpu' runs folders written by "
            f"`flashnext export --target rk3588 --out DIR`"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); export the folder again") from None


class StaticModel:
    """An exported decoder: host-side embedding and rope tables, one session per graph, and the KV cache as one
    slot of `batch` per running sequence ([batch, kv_heads, context, head_dim] a layer for keys and values)."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, config: ModelConfig, embed: np.ndarray, sessions: dict, manifest: dict, folder: Path):
        self.config, self.embed, self.sessions, self.manifest = config, embed, sessions, manifest
        self.folder = folder
        self.temporary_folder = None  # an on-the-fly export's TemporaryDirectory: removed with the model
        self.batch, self.chunk, self.context = manifest["batch"], manifest["chunk"], manifest["context"]
        self.cos_sin = rope_cache(config, "cpu").numpy()  # [context, D]: cos half, sin half
        shape = (self.batch, config.num_kv_heads, self.context, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.num_layers)]

    @classmethod
    def open(
        cls, folder: Path, runtime: str, core_mask: int = 0, rknnlite=None, toolkit_python: str | None = None
    ) -> "StaticModel":
        """runtime: rknnlite (the .rknn files on the NPU), simulator (the .onnx files built and run by rknn-toolkit2
        in the venv of `toolkit_python`) or onnxruntime."""
        manifest = read_manifest(folder)
        config = ModelConfig(**json.loads((folder / "config.json").read_text()))
        embed = np.load(folder / manifest["embedding"])
        sessions = {}
        for name, graph in manifest["graphs"].items():
            if runtime == "rknnlite":
                if "rknn" not in graph:
                    raise UserError(
                        f"{folder}: graph '{name}' has no .rknn file; convert it for rk3588 "
                        "(benchmarks/rknn_simulate.sh) or run with --profile onnxruntime"
                    )
                sessions[name] = RknnLiteSession(folder / graph["rknn"], core_mask, rknnlite)
            elif runtime == "simulator":
                from .simulator import SimulatorSession

                if toolkit_python is None:
                    raise UserError(
                        "runtime simulator needs rknn-toolkit2's python: set FLASHNEXT_RKNN_TOOLKIT_PYTHON "
                        "(benchmarks/rknn_simulate.sh makes .venv-rknn) or run with --profile onnxruntime"
                    )
                sessions[name] = SimulatorSession(folder / graph["onnx"], toolkit_python, manifest["target"])
            else:
                sessions[name] = OnnxSession(folder / graph["onnx"])
        return cls(config, embed, sessions, manifest, folder)

    def projections(self) -> dict[str, np.ndarray]:
        """The decoder's projection weights as the exported graphs hold them, [N, K] float32 by "layer I NAME",
        read back from the folder's ONNX graph and its weights file."""
        import onnx
        from onnx import numpy_helper

        graph = self.folder / self.manifest["graphs"]["prefill"]["onnx"]
        tensors = {t.name: t for t in onnx.load(str(graph), load_external_data=True).graph.initializer}
        return {
            f"layer {i} {name}": numpy_helper.to_array(tensors[f"layers.{i}.{name}.weight_t"]).T
            for i in range(self.config.num_layers)
            for name in ("qkv", "o", "gate_up", "down")
        }

    def step(self, kind: str, first_slot: int, tokens: list[list[int] | None], starts: list[int]) -> np.ndarray:
        """One call of graph `kind`: its row i takes tokens[i] at positions starts[i].., reading and then extending
        cache slot first_slot + i; a None row is idle (it attends to itself and writes nothing). Returns logits
        [batch, tokens, vocab]."""
        graph = self.manifest["graphs"][kind]
        b, t, c = graph["batch"], graph["tokens"], self.context
        cfg, half = self.config, self.config.head_dim // 2
        ids = np.zeros((b, t), np.int64)
        positions = np.zeros((b, t), np.int64)
        mask = np.full((b, 1, t, c + t), MASK_VALUE, np.float32)
        mask[:, 0, :, c:] = np.triu(np.full((t, t), MASK_VALUE, np.float32), k=1)
        for row, (toks, start) in enumerate(zip(tokens, starts)):
            if toks is None:
                mask[row, 0, :, c:] = np.where(np.eye(t, dtype=bool), 0.0, MASK_VALUE)
                continue
            if len(toks) > t or start + len(toks) > c:
                raise UserError(
                    f"{len(toks)} tokens at position {start} do not fit graph '{kind}' "
                    f"({t} tokens, context {c}); lower --max-model-len to {c}"
                )
            ids[row, : len(toks)] = toks
            positions[row] = np.minimum(np.arange(start, start + t), c - 1)
            mask[row, 0, :, :start] = 0.0
        table = self.cos_sin[positions]  # [B, T, D]
        cos = np.ascontiguousarray(table[..., :half][:, None])
        sin = np.ascontiguousarray(table[..., half:][:, None])
        rows = slice(first_slot, first_slot + b)  # a view: the decode graph reads the whole cache without a copy
        past = [cache[layer][rows] for layer in range(cfg.num_layers) for cache in (self.k, self.v)]
        outputs = self.sessions[kind].run([self.embed[ids], cos, sin, mask, *past])
        for row, (toks, start) in enumerate(zip(tokens, starts)):
            if toks is None:
                continue
            end, slot = start + len(toks), first_slot + row
            for layer in range(cfg.num_layers):
                self.k[layer][slot, :, start:end] = outputs[1 + 2 * layer][row, :, : len(toks)]
                self.v[layer][slot, :, start:end] = outputs[2 + 2 * layer][row, :, : len(toks)]
        return outputs[0]

    def decode(self, slot_tokens: dict[int, tuple[int, int]]) -> dict[int, np.ndarray]:
        """One token for each busy slot ({slot: (token, position)}) in one decode-graph call; {slot: logits}."""
        tokens = [[slot_tokens[s][0]] if s in slot_tokens else None for s in range(self.batch)]
        starts = [slot_tokens[s][1] if s in slot_tokens else 0 for s in range(self.batch)]
        logits = self.step("decode", 0, tokens, starts)
        return {s: logits[s, 0] for s in slot_tokens}

    def prefill(self, slot: int, tokens: list[int], start: int) -> np.ndarray:
        """tokens at positions start.. for one slot, a chunk a graph call; returns logits [len(tokens), vocab]."""
        out = []
        for i in range(0, len(tokens), self.chunk):
            part = tokens[i : i + self.chunk]
            out.append(self.step("prefill", slot, [part], [start + i])[0, : len(part)])
        return np.concatenate(out)

    def release(self) -> None:
        for session in self.sessions.values():
            session.release()


class StaticRunner(ModelRunner):
    """The engine's runner over a StaticModel: decodes of up to `batch` sequences share one decode-graph call,
    each prompt runs through the prefill graph a chunk at a time. The paged block tables the scheduler keeps are
    only its accounting here: every running sequence owns one cache slot."""

    def __init__(self, model: StaticModel, setup: RunnerSetup):
        self.model, self.setup, self.block_size, self.device = model, setup, setup.block_size, torch.device("cpu")
        self.warm_up_s = 0.0
        self.kernels = ReferenceKernels()
        self.slots: dict[int, object] = {}  # slot -> sequence

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4

    def _slot(self, seq) -> int:
        for slot, owner in list(self.slots.items()):
            if owner.status is not Status.RUNNING:  # finished or preempted: its cache rows are free again
                del self.slots[slot]
        for slot, owner in self.slots.items():
            if owner is seq:
                return slot
        free = next(s for s in range(self.model.batch) if s not in self.slots)
        self.slots[free] = seq
        return free

    def step(self, inputs: StepInput) -> StepResult:
        batch = inputs.batch
        logits_of: dict[int, np.ndarray] = {}
        decodes = {}
        for i, item in enumerate(batch):
            seq, start = item.seq, item.seq.num_computed
            slot = self._slot(seq)
            tokens = seq.query_tokens(start, item.num_tokens)
            if item.num_tokens == 1:
                decodes[slot] = (tokens[0], start, i)
            else:
                logits = self.model.prefill(slot, tokens, start)
                logits_of[i] = logits[len(logits) - item.num_logits :]
        if decodes:
            out = self.model.decode({s: (tok, pos) for s, (tok, pos, _) in decodes.items()})
            for slot, (_, _, i) in decodes.items():
                logits_of[i] = out[slot][None]
        rows = [
            torch.from_numpy(np.ascontiguousarray(logits_of[i], np.float32))
            for i, item in enumerate(batch)
            if item.num_logits
        ]
        logits = torch.cat(rows) if rows else torch.empty(0, self.model.config.vocab_size)
        return StepResult(self.kernels.sample(logits, self._sampling(batch)), logits)

    def _sampling(self, batch: list[ScheduledSeq]) -> SamplingTensors:
        temps, top_ks, top_ps, seeds = [], [], [], []
        for item in batch:
            seq, end = item.seq, item.seq.num_computed + item.num_tokens
            for r in range(item.num_logits):
                temps.append(seq.params.temperature)
                top_ks.append(seq.params.top_k)
                top_ps.append(seq.params.top_p)
                seeds.append(noise_seed(seq.seed, end - item.num_logits + r + 1))
        return SamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.int64),
            top_p=torch.tensor(top_ps, dtype=torch.float32),
            noise_seed=torch.tensor(seeds, dtype=torch.int64),
            all_greedy=all(t == 0 for t in temps),
        )
