"""The CUDA backend for discrete NVIDIA GPUs."""

import torch

from flashnext.core.backend import Backend, Probe
from flashnext.core.hookspecs import hookimpl
from flashnext.core.profile import Profile

FP8_CAPABILITIES = ((8, 9), (9, 0))


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
        "fp8": capability >= (8, 9),
        "device_count": torch.cuda.device_count(),
    }
    return Probe(True, 100.0, f"{props.name} (compute capability {props.major}.{props.minor})", facts)


class CudaBackend(Backend):
    name = "cuda"
    precisions = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int4")
    default_precision = "bf16"
    features = {
        "cuda_graphs": False,
        "chunked_prefill": True,
        "prefix_caching": True,
        "spec_decode": False,
        "fp8_kv_cache": True,
    }

    def probe(self) -> Probe:
        return cuda_probe()

    def profiles(self) -> dict[str, Profile]:
        full = Profile(name="full", chunked_prefill=True, max_num_seqs=128, max_num_batched_tokens=2048)
        return {"full": full, "basic": full.basic()}

    def device(self) -> torch.device:
        return torch.device("cuda")

    def free_memory_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        return free


@hookimpl
def register_backends(register):
    register(CudaBackend())
