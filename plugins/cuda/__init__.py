"""The CUDA backend for discrete NVIDIA GPUs."""

import torch

from flashnext.core.backend import API_VERSION, FP8_KV, WIDE_KV, Backend, Capabilities, Probe
from flashnext.core.errors import UserError
from flashnext.core.hookspecs import hookimpl
from flashnext.core.precision import Fp8Weight
from flashnext.core.profile import Profile

FP8_CAPABILITY = (8, 9)  # Ada and Hopper on: FP8 tensor cores, which torch._scaled_mm needs


def cuda_probe() -> Probe:
    if torch.version.hip is not None:
        return Probe(False, 0.0, f"this torch is a ROCm build (HIP {torch.version.hip}); the rocm backend serves it")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none"
        return Probe(False, 0.0, f"torch sees no CUDA device (torch {torch.__version__}, CUDA build: {built})")
    props = torch.cuda.get_device_properties(0)
    if props.is_integrated:
        return Probe(False, 0.0, f"{props.name} is an integrated GPU (Jetson-class); the jetson backend serves it")
    capability = (props.major, props.minor)
    facts = {
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_total_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "fp8": capability >= FP8_CAPABILITY,
        "device_count": torch.cuda.device_count(),
    }
    return Probe(True, 100.0, f"{props.name} (compute capability {props.major}.{props.minor})", facts)


class CudaBackend(Backend):
    name = "cuda"
    precisions = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4")
    default_precision = "bf16"
    api_version = API_VERSION
    capabilities = Capabilities(
        cuda_graphs=True,  # decode steps replay captured graphs, several per host round trip (runner.py)
        chunked_prefill=True,
        prefix_caching=True,
        # verify steps chained on the device in row-invariant graphs (runner.py), MTP's module too (mtp_graphs.py)
        drafters=("ngram", "mtp"),
        kv_dtypes=FP8_KV + WIDE_KV,  # e5m2 (read as fp8, widened to fp16 for the dots) or e4m3, inside attention
        extra={
            "triton_kernels": True,  # CudaKernels (kernels.py); unit-tested against the reference kernels
            # fp8-e4m3 weights, per-channel scales: 16-bit activations in the small-batch GEMV, per-token fp8
            # activations (written by the rmsnorm / SiLU before the projection) in the decode-batch Triton GEMM
            # and in torch._scaled_mm for prefill-sized batches. The LM head too, if the profile asks.
            "fp8_weights": True,
            "int4_weights": True,  # Triton GEMV up to 4 rows; a Triton dequant pass + the skinny GEMM / cuBLAS above
        },
    )

    def probe(self) -> Probe:
        return cuda_probe()

    def profiles(self) -> dict[str, Profile]:
        # A large token budget: on a slow host each eager prefill step costs tens of milliseconds of Python.
        # Speculation up to 4 sequences: decode graphs that small use the row-invariant GEMV (the same numbers in
        # a verify step), which stays faster than cuBLAS there.
        full = Profile(
            name="full",
            cuda_graphs=True,
            chunked_prefill=True,
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
            spec_max_batch=4,
            # MTP drafts through an fp8 copy of a 16-bit LM head: cheaper draft steps for slightly fewer accepted
            # drafts, a net gain at every K (docs/benchmarks.md); where the GPU has no fp8, the head itself.
            spec_draft_head="fp8",
        )
        return {"full": full, "basic": full.basic()}

    def device(self) -> torch.device:
        return torch.device("cuda")

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device())

    def kernels(self, precision):
        from .kernels import CudaKernels

        return CudaKernels()

    def quantized_head(self, precision) -> bool:
        # An fp8 head reads half the bytes of the largest matrix, for the memory of a second copy (the 16-bit
        # embedding table stays for the lookup) and fp8-rounded logits (docs/architecture.md). Int4 weights'
        # head is fp8 too (Precision.head), which past the GEMV's rows needs fp8 tensor cores.
        if precision.name == "int4":
            return torch.cuda.is_available() and _capability()[:2] >= FP8_CAPABILITY
        return precision.name == "fp8-e4m3"

    def runner_class(self, profile: Profile):
        from .runner import CudaGraphRunner

        return CudaGraphRunner.for_profile(profile)

    def preferred_precision(self, weights: dict) -> str:
        """An fp8 checkpoint's precision where the GPU has FP8 tensor cores: its own bytes at half bf16's memory
        (block scales are rounded to a scale a row, Precision.quantize); bf16 elsewhere and for other weights."""
        stored_fp8 = any(isinstance(w, Fp8Weight) and w.fmt == "fp8-e4m3" for w in weights.values())
        return "fp8-e4m3" if stored_fp8 and _capability()[:2] >= FP8_CAPABILITY else self.default_precision

    def check_request(self, precision: str, profile: Profile):
        chosen = super().check_request(precision, profile)
        if precision == "fp8-e4m3":
            major, minor, name = _capability()
            if (major, minor) < FP8_CAPABILITY:
                raise UserError(
                    f"fp8-e4m3 needs FP8 tensor cores (compute capability 8.9 or 9.x); {name} is"
                    f" {major}.{minor}: use --precision bf16 or int4"
                )
        return chosen

    def free_memory_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        # Blocks torch's caching allocator holds but no tensor uses are free to us, not to the driver.
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    def peak_memory_bytes(self, run) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    def reset_memory_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device())

    def memory_peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _capability() -> tuple[int, int, str]:
    props = torch.cuda.get_device_properties(0)
    return props.major, props.minor, props.name


@hookimpl
def register_backends(register):
    register(CudaBackend())
