"""The RK3588 NPU backend: runs decoder graphs exported ahead of time (`flashnext export --target rk3588`), on the
NPU through rknn-toolkit-lite2 or, where there is none, in rknn-toolkit2's simulator (where its venv is found) or
through onnxruntime on the CPU."""

import importlib.util
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from flashnext.core.backend import API_VERSION, Backend, Capabilities, Probe, StoredWeight
from flashnext.core.errors import UserError
from flashnext.core.hookspecs import hookimpl
from flashnext.core.loader import LoadedModel
from flashnext.core.precision import int4_group_size
from flashnext.core.profile import Profile
from flashnext.core.tokenizer import Tokenizer

from . import probe as board
from .runtime import CORE_MASKS, MANIFEST, StaticModel, StaticRunner, read_manifest
from .simulator import find_toolkit_python

MAX_SEQS = 4  # the graphs' batch: more concurrent requests queue
MAX_TOKENS = 64  # a request's answer on the board
FP8_REFUSAL = (
    "backend 'rknpu' does not run {precision}: RK3588's NPU has no FP8 type and FP8 work falls back to "
    "the CPU at ~17x the latency; use --precision int4 (default) or fp16"
)


class NpuProfile(Profile):
    """The core's knobs plus where the graphs run: `runtime` rknnlite (the NPU, cores `npu_cores`), simulator
    (rknn-toolkit2's, fp16, in the venv of `rknn_toolkit_python`) or onnxruntime (the CPU, fp32)."""

    runtime: Literal["rknnlite", "simulator", "onnxruntime"] = "onnxruntime"
    npu_cores: Literal["auto", "0", "1", "2", "0_1", "0_1_2"] = "0_1_2"
    rknn_toolkit_python: str | None = None

    def executed_on(self) -> str:
        return {
            "rknnlite": f"RK3588 NPU (rknn-toolkit-lite2, cores {self.npu_cores})",
            "simulator": f"rknn-toolkit2 simulator (fp16, rk3588; {self.rknn_toolkit_python})",
            "onnxruntime": "onnxruntime on the CPU (fp32)",
        }[self.runtime]


@dataclass
class ExportedModel(LoadedModel):
    folder: Path = Path()
    manifest: dict = field(default_factory=dict)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class RknpuBackend(Backend):
    name = "rknpu"
    precisions = ("int4", "fp16")
    default_precision = "int4"
    api_version = API_VERSION
    # Prompts run in the prefill graph's chunk; no prefix caching: the cache is a slot a sequence, not shared blocks.
    capabilities = Capabilities(chunked_prefill=True, max_concurrency=MAX_SEQS)

    export_targets = ("rk3588",)

    def __init__(self, root: Path = Path("/"), rknnlite=None):
        self.root, self.rknnlite = root, rknnlite  # rknnlite: the module, where tests hand in a stand-in

    def export(self, target: str, loaded, out: Path, **options) -> dict:
        from .export import export

        return export(loaded, out, target=target, **options)

    def runtime(self, facts: dict) -> str | None:
        """Where the graphs run by default: the NPU, else rknn-toolkit2's simulator where its python is found, else
        onnxruntime."""
        if facts["soc"] and facts["librknnrt"] and (self.rknnlite is not None or _has("rknnlite")):
            return "rknnlite"
        if find_toolkit_python():
            return "simulator"
        return "onnxruntime" if _has("onnxruntime") else None

    def probe(self) -> Probe:
        facts = board.board_facts(self.root)
        facts["runtime"] = runtime = self.runtime(facts)
        facts["rknn_toolkit_python"] = find_toolkit_python()
        facts["default_profile"] = self.default_profile
        chip = facts["soc"]
        if runtime == "rknnlite":
            return Probe(
                True,
                3.0,
                f"{chip.upper()} NPU through rknn-toolkit-lite2 and {facts['librknnrt']}: "
                "runs folders made by `flashnext export --target rk3588`",
                facts,
            )
        if runtime in ("simulator", "onnxruntime"):
            why = (
                f"{chip.upper()} found but no NPU runtime (librknnrt.so in /usr/lib and rknn-toolkit-lite2)"
                if chip
                else "no RK3588 here"
            )
            return Probe(
                True,
                0.5,
                f"{why}: exported graphs run "
                + ("in rknn-toolkit2's simulator" if runtime == "simulator" else "through onnxruntime on the CPU")
                + " (for checks, not speed; below cpu for auto)",
                facts,
            )
        return Probe(False, 0.0, "no RK3588 NPU runtime and no onnxruntime: pip install 'flashnext[rknpu]'", facts)

    def profiles(self) -> dict[str, Profile]:
        base = dict(
            chunked_prefill=True,
            prefix_caching=False,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=32,
            max_tokens_cap=MAX_TOKENS,
        )
        npu = NpuProfile(name="npu", runtime="rknnlite", **base)
        simulator = NpuProfile(name="simulator", runtime="simulator", rknn_toolkit_python=find_toolkit_python(), **base)
        onnx = NpuProfile(name="onnxruntime", runtime="onnxruntime", **base)
        default = {"rknnlite": npu, "simulator": simulator}.get(self.runtime(board.board_facts(self.root)), onnx)
        return {default.name: default, **{p.name: p for p in (npu, simulator, onnx)}, "basic": default.basic()}

    def check_request(self, precision, profile):
        if isinstance(precision, str) and precision.startswith("fp8"):
            raise UserError(FP8_REFUSAL.format(precision=precision))
        if profile.max_num_seqs > MAX_SEQS:
            raise UserError(
                f"max_num_seqs {profile.max_num_seqs}: the RK3588 graphs run at most {MAX_SEQS} "
                f"sequences (more requests queue); set FLASHNEXT_MAX_NUM_SEQS={MAX_SEQS} or less"
            )
        return super().check_request(precision, profile)

    def preferred_precision(self, weights: dict) -> str:
        return getattr(self, "_folder_precision", None) or self.default_precision

    def runner_class(self, profile):
        return StaticRunner

    def load_model(self, spec):
        folder = Path(spec) if spec else None
        if folder is None or not (folder / MANIFEST).is_file():
            self._folder_precision = None
            return super().load_model(spec)  # exported on the fly by build_model (onnxruntime only)
        manifest = read_manifest(folder)
        from flashnext.core.config import ModelConfig

        config = ModelConfig(**json.loads((folder / "config.json").read_text()))
        self._folder_precision = manifest["precision"]
        return ExportedModel(
            config=config,
            weights={},
            tokenizer=Tokenizer.from_hf_folder(folder),
            source=str(folder),
            name=manifest.get("model") or folder.name,
            folder=folder,
            manifest=manifest,
        )

    def build_model(self, loaded, precision, profile, quantized_head):
        runtime = getattr(profile, "runtime", "onnxruntime")
        toolkit = getattr(profile, "rknn_toolkit_python", None)
        mask = CORE_MASKS[getattr(profile, "npu_cores", "auto")]
        if isinstance(loaded, ExportedModel):
            if precision.name != loaded.manifest["precision"]:
                raise UserError(
                    f"{loaded.folder}: exported as {loaded.manifest['precision']}, not {precision.name};"
                    f" export again with --precision {precision.name} or leave --precision out"
                )
            if loaded.manifest["batch"] < profile.max_num_seqs:
                raise UserError(
                    f"{loaded.folder}: its graphs take {loaded.manifest['batch']} sequences; set "
                    f"FLASHNEXT_MAX_NUM_SEQS={loaded.manifest['batch']} or export with --batch "
                    f"{profile.max_num_seqs}"
                )
            return StaticModel.open(loaded.folder, runtime, mask, self.rknnlite, toolkit)
        if runtime == "rknnlite":
            raise UserError(
                f"{loaded.source}: the NPU runs folders exported ahead of time: `flashnext export "
                f"--target rk3588 --model {loaded.source} --out DIR` on a PC, then --model DIR"
            )
        return self._export_and_open(loaded, precision.name, runtime, toolkit, profile)

    def _export_and_open(self, loaded, precision: str, runtime: str, toolkit: str | None, profile) -> StaticModel:
        """A checkpoint given directly: exported into a temporary folder and opened with the profile's runtime
        (simulator or onnxruntime). The folder lives as long as the model: stored_weights reads the graphs' weights
        back from it."""
        from .export import export

        limit = loaded.config.max_position_embeddings
        context = min(profile.max_model_len or limit, limit)
        folder = tempfile.TemporaryDirectory(prefix="flashnext-rknpu-")
        export(
            loaded,
            Path(folder.name),
            precision=precision,
            batch=profile.max_num_seqs,
            chunk=min(32, context),
            context=context,
            check=False,
        )
        model = StaticModel.open(Path(folder.name), runtime, toolkit_python=toolkit)
        model.temporary_folder = folder
        return model

    def stored_weights(self, model: StaticModel) -> dict[str, StoredWeight]:
        """The projections as the graphs hold them: float32 initializers whose values are exactly the int4 grid
        (q * scale + offset in the core's Int4Weight groups) or fp16-rounded values; not packed int4. The RKNN
        converter stores both as fp16 on the NPU (docs/backends.md: which path gives which numerics)."""
        int4 = model.manifest["precision"] == "int4"
        return {
            name: StoredWeight(torch.from_numpy(w.copy()), "grid", int4_group_size(w.shape[1]) if int4 else None)
            for name, w in model.projections().items()
        }


@hookimpl
def register_backends(register):
    register(RknpuBackend())
