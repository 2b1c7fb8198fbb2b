"""CUDA runner: the fused forward against the reference forward (CPU, Triton interpreter), look-ahead bounds, and on
a GPU the graph decode path with and without look-ahead."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

import flashnext.plugins.cuda.launch as launch_module  # noqa: E402
from flashnext.core.cli_bench import random_model  # noqa: E402
from flashnext.core.engine.runner import ModelRunner, RunnerSetup  # noqa: E402
from flashnext.core.engine.scheduler import ScheduledSeq  # noqa: E402
from flashnext.core.engine.sequence import SamplingParams, Sequence  # noqa: E402
from flashnext.core.kernels import ReferenceKernels  # noqa: E402
from flashnext.core.model import DecoderModel  # noqa: E402
from flashnext.core.precision import PRECISIONS  # noqa: E402
from flashnext.core.profile import Profile  # noqa: E402
from flashnext.plugins.cuda.kernels import CudaKernels  # noqa: E402
from flashnext.plugins.cuda.runner import CudaGraphRunner, graph_buckets  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _two_steps(loaded, kernels, runner_class, precision="fp32"):
    """A prefill of two prompts (one 20 tokens, one 7), then one decode step; the logits of both steps."""
    model = DecoderModel(loaded.config, loaded.weights, kernels, PRECISIONS[precision], DEV, torch.float32)
    runner = runner_class(model, RunnerSetup(16, 4, torch.float32))
    batch = []
    for i, prompt in enumerate((list(range(5, 25)), list(range(30, 37)))):
        seq = Sequence(prompt, SamplingParams())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        batch.append(ScheduledSeq(seq, len(prompt), 1))
    prefill, _ = runner.run(batch)
    for item in batch:
        item.seq.num_computed = len(item.seq)
        item.seq.token_ids.append(3)
    decode, _ = runner.run([ScheduledSeq(item.seq, 1, 1) for item in batch])
    return prefill, decode


def test_fused_forward_matches_reference_forward(tiny_random):
    ours = _two_steps(tiny_random, CudaKernels(), CudaGraphRunner.for_profile(Profile(name="basic")))
    ref = _two_steps(tiny_random, ReferenceKernels(), ModelRunner)
    for a, b in zip(ours, ref):
        assert float((a - b).pow(2).sum() / b.pow(2).sum()) < 1e-5  # fp32; GPU dots round through tf32


def test_int4_decode_hands_x_packed_from_gemv_to_gemv(tiny_random, monkeypatch):
    """An int4 decode step's GEMVs hand x on packed (o -> gate/up, gate/up -> down, down -> the next layer's qkv):
    its logits within the int8 rounding of the step with packed_x off, and the prefill (no GEMVs) unchanged."""
    packs = []
    gemv = CudaKernels.gemv

    def spy(self, x, w, *args, pack=None, **kwargs):
        packs.append(pack is not None)
        return gemv(self, x, w, *args, pack=pack, **kwargs)

    monkeypatch.setattr(CudaKernels, "gemv", spy)
    monkeypatch.setattr(launch_module, "PACKED_X_MIN_K", 0)  # at this model's rows of 64 and 96 columns
    runner_class = CudaGraphRunner.for_profile(Profile(name="basic"))
    packed = _two_steps(tiny_random, CudaKernels(), runner_class, "int4")
    assert sum(packs) == 3 * tiny_random.config.num_layers - 1
    unpacked_kernels = CudaKernels()
    unpacked_kernels.packed_x = False
    unpacked = _two_steps(tiny_random, unpacked_kernels, runner_class, "int4")
    assert torch.equal(packed[0], unpacked[0])
    assert 0 < float((packed[1] - unpacked[1]).pow(2).sum() / unpacked[1].pow(2).sum()) < 1e-3


def test_lookahead_stays_inside_owned_slots_and_max_tokens(tiny_random):
    model = DecoderModel(
        tiny_random.config, tiny_random.weights, CudaKernels(), PRECISIONS["fp32"], torch.device("cpu"), torch.float32
    )
    runner = CudaGraphRunner.for_profile(Profile(name="basic"))(model, RunnerSetup(8, 4, torch.float32))
    a = Sequence(list(range(6)), SamplingParams(max_tokens=50))
    a.block_table, a.num_computed = [0, 1], 6  # 8 slots owned, position 6 next: room for 2
    b = Sequence(list(range(3)), SamplingParams(max_tokens=4))
    b.token_ids += [1, 2, 3]  # 3 of 4 tokens produced: 1 more wanted
    b.block_table, b.num_computed = [2, 3], 5
    assert runner._chunk_steps([ScheduledSeq(a, 1, 1)]) == 2
    assert runner._chunk_steps([ScheduledSeq(a, 1, 1), ScheduledSeq(b, 1, 1)]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_lookahead_gives_the_step_by_step_tokens():
    from flashnext.core.llm import LLM

    loaded = random_model("smollm2-135m", torch.device("cuda"))
    prompts = torch.randint(0, 49152, (3, 30), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = {}
    for steps in (1, 16):
        llm = LLM(model=loaded, backend="cuda", precision="bf16", profile="full", max_model_len=128, max_num_seqs=4)
        llm.engine.runner.max_decode_steps = steps
        for temperature in (0.0, 0.9):
            params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
            outputs[steps, temperature] = [s.output_ids for s in llm.engine.generate(prompts, params)]
        runner = llm.engine.runner
        assert runner.graph_replays > 0 and runner.graph_memory_bytes > 0  # captures reserve their pool
        assert runner.warm_up_s > 0  # the captures' time, which `flashnext run` keeps out of decode speed
    assert outputs[1, 0.0] == outputs[16, 0.0]
    assert outputs[1, 0.9] == outputs[16, 0.9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_after_a_full_chunk_writes_inside_the_token_buffer():
    """A capture's warm-up runs the decode body once, which writes its tokens at row step_index of out_tokens;
    after a full chunk that row is one past the buffer, so a new bucket's capture wrote past it."""
    from flashnext.core.llm import LLM

    llm = LLM(
        model=random_model("smollm2-135m", torch.device("cuda")),
        backend="cuda",
        precision="int4",
        profile="full",
        max_model_len=128,
        max_num_seqs=4,
    )
    runner = llm.engine.runner
    runner.step_index.fill_(runner.max_decode_steps)  # as a chunk of max_decode_steps steps leaves it
    batch = []
    for j in range(2):
        seq = Sequence(list(range(10 + j, 30 + j)), SamplingParams(max_tokens=8, ignore_eos=True))
        seq.token_ids.append(1)
        seq.num_computed, seq.block_table = 20, [4 * j + b for b in range(4)]
        batch.append(ScheduledSeq(seq, 1, 1))
    runner._ensure_graphs(batch, 2, True)
    assert int(runner.step_index) == 1  # the warm-up's one step wrote row 0


@pytest.mark.parametrize("precision", ["fp8-e4m3", "int4"])
def test_greedy_decode_body_folds_the_argmax_into_the_fp8_head(tiny_random, monkeypatch, precision):
    """The decode body (a graph's, run eagerly) of an fp8 or int4 model with an fp8 head at a bucket past the
    GEMV's rows: its argmax rides in the head's GEMM and the tokens are those of logits + an argmax pass, step after
    step; the keys buffer is all zeros between steps, as the next step needs it."""
    model = DecoderModel(
        tiny_random.config,
        tiny_random.weights,
        CudaKernels(),
        PRECISIONS[precision],
        DEV,
        torch.bfloat16,
        quantized_head=True,
    )
    assert type(model.lm_head).__name__ == "Fp8Weight"
    profile = Profile(name="full", cuda_graphs=True, graph_batch_sizes=[8], max_num_seqs=8)
    runner = CudaGraphRunner.for_profile(profile)(model, RunnerSetup(64, 4, torch.bfloat16))
    batch = []
    for i in range(6):
        seq = Sequence(list(range(5 + i, 20 + 2 * i)), SamplingParams())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        batch.append(ScheduledSeq(seq, len(seq), 1))
    runner.run(batch)
    for item in batch:
        item.seq.num_computed = len(item.seq)
        item.seq.token_ids.append(3)
    decode = [ScheduledSeq(item.seq, 1, 1) for item in batch]

    def three_steps():
        runner._fill_inputs(decode, 8)
        runner.step_index.zero_()
        for _ in range(3):
            runner._decode_body(8, greedy=True)
            assert not runner.greedy_keys.any()
        return runner.out_tokens[:3, :6].clone()

    fused = three_steps()
    monkeypatch.setattr(
        CudaKernels,
        "greedy_keys",
        lambda self, x, residual, norm_w, eps, w, keys: self.argmax_keys(
            self.norm_linear(x, residual, norm_w, eps, w)[0], out=keys
        ),
    )
    assert torch.equal(fused, three_steps())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="an fp8 checkpoint on CUDA needs a GPU")
@pytest.mark.parametrize("scales", ["row", "block"])
def test_an_fp8_checkpoint_runs_in_fp8_where_the_gpu_has_fp8_tensor_cores(tmp_path, scales):
    """Loaded with its scales, run with no precision asked: fp8-e4m3 on cc 8.9+ (block scales rounded to a scale a
    row), bf16 values below; its logits near the checkpoint's exact values run in fp32 on the CPU."""
    from fixtures import write_tiny_fp8_hf_model
    from flashnext.core.llm import LLM
    from flashnext.core.loader import load_model
    from numerics import engine_logits

    write_tiny_fp8_hf_model(tmp_path, arch="qwen3", scales=scales)
    loaded = load_model(str(tmp_path))
    gpu = LLM(loaded, backend="cuda", max_model_len=128, max_num_seqs=2)
    assert gpu.engine.precision.name == ("fp8-e4m3" if torch.cuda.get_device_capability() >= (8, 9) else "bf16")
    exact = LLM(loaded, backend="cpu", precision="fp32", max_model_len=128, max_num_seqs=2)
    ids = list(range(5, 45))
    ours, ref = engine_logits(gpu, ids).float().cpu(), engine_logits(exact, ids)
    assert 0 < float((ours - ref).pow(2).sum() / ref.pow(2).sum()) < 3e-2


def test_graph_buckets_reach_max_num_seqs():
    """A listed size past max_num_seqs stands for max_num_seqs, so every batch up to it replays a graph; sizes a
    profile lists below it are kept, and a profile listing none past it runs larger batches eagerly as it asked."""
    assert graph_buckets([1, 2, 4, 8, 16, 32, 64, 128], 48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_buckets([1, 2, 4, 8, 16, 32, 64], 64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets([8, 1, 4], 3) == [1, 3]
    assert graph_buckets([1, 2, 4], 64) == [1, 2, 4]
