"""Engine-level helpers: a tiny random model built in memory, a float32 reference backend, prompt logits, greedy runs.

The tiny model needs no files and no tokenizer training, so a third-party backend's author can run the suite
anywhere flashnext is installed.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from flashnext.core.backend import Backend, Probe
from flashnext.core.config import ModelConfig
from flashnext.core.engine.engine import LLMEngine
from flashnext.core.engine.runner import StepInput
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.loader import LoadedModel
from flashnext.core.precision import PRECISIONS
from flashnext.core.tokenizer import Tokenizer

TINY_VOCAB = 384


def tiny_config() -> ModelConfig:
    # K of every projection is a multiple of 128 so int4's default group size applies; GQA 4:2 like real models.
    return ModelConfig(
        architecture="llama",
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def tiny_model(seed: int = 0) -> LoadedModel:
    """Random weights scaled so logits spread widely: greedy choices have margins far above rounding noise."""
    cfg = tiny_config()
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g) * std

    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    w = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, h, std=1.0),
        "model.norm.weight": 1 + rnd(h, std=0.1),
        "lm_head.weight": rnd(cfg.vocab_size, h, std=0.4),
    }
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(h, std=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
            p + "self_attn.q_proj.weight": rnd(q, h, std=0.1),
            p + "self_attn.k_proj.weight": rnd(kv, h, std=0.1),
            p + "self_attn.v_proj.weight": rnd(kv, h, std=0.1),
            p + "self_attn.o_proj.weight": rnd(h, q, std=0.1),
            p + "mlp.gate_proj.weight": rnd(i, h, std=0.1),
            p + "mlp.up_proj.weight": rnd(i, h, std=0.1),
            p + "mlp.down_proj.weight": rnd(h, i, std=0.1),
        }
    vocab = {f"t{n}": n for n in range(cfg.vocab_size)}
    tok = Tokenizer(
        HFTokenizer(models.WordLevel(vocab, unk_token="t0")),
        bos_token_id=None,
        eos_token_ids=[],
        add_bos=False,
        chat_template=None,
        source="conformance tiny model",
    )
    return LoadedModel(cfg, w, tok, "conformance tiny model", "tiny")


def tiny_prompts(n: int, seed: int, lengths=(5, 23, 40, 9, 33, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY_VOCAB, (lengths[k % len(lengths)],), generator=g).tolist() for k in range(n)]


class ReferenceBackend(Backend):
    """The core reference kernels in float32 on the CPU: what engine-level cases compare a backend with."""

    name = "reference"
    precisions = tuple(PRECISIONS)
    features = {"chunked_prefill": True, "prefix_caching": True}

    def probe(self) -> Probe:
        return Probe(True, 0.0, "core reference kernels")

    def activation_dtype(self, precision) -> torch.dtype:
        return torch.float32

    def free_memory_bytes(self) -> int:
        return 1 << 30


def make_engine(backend: Backend, loaded: LoadedModel, precision: str, **overrides) -> LLMEngine:
    """The profile this device runs (profile_under_test) with a small KV cache, and `overrides` applied (validated
    by Profile)."""
    base = profile_under_test(backend)
    settings = {"kv_cache_max_gib": 0.02, "max_model_len": 256, "max_num_batched_tokens": 512} | overrides
    return LLMEngine(backend, loaded, precision, base.overridden(**settings))


def profile_under_test(backend: Backend):
    """The backend's default profile with this environment's FLASHNEXT_<FIELD> settings, as `flashnext run` and
    `serve` would run it: the suite checks the configuration a deployment uses (e.g. FLASHNEXT_INT4_ROUTE)."""
    from flashnext.core.llm import resolve_profile

    return resolve_profile(backend, None, {})


def plain_profile() -> dict:
    """Overrides that turn off every optional path, for the unoptimized side of a comparison."""
    return {"chunked_prefill": False, "cuda_graphs": False, "spec": "none"}


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position in one step (the engine must not chunk: use plain_profile())."""
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    batch = engine.scheduler.schedule()
    try:
        if len(batch) != 1 or batch[0].num_tokens != len(prompt):
            raise AssertionError(f"expected the whole {len(prompt)}-token prompt in one step, got {batch}")
        logits = engine.runner.step(StepInput([ScheduledSeq(seq, len(prompt), len(prompt))])).logits
        return logits.float().cpu()
    finally:
        engine.abort(seq)


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return seqs


def outputs(seqs: list[Sequence]) -> list[list[int]]:
    return [s.output_ids for s in seqs]


def mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, str]:
    """Tokens that differ between two runs, and where the first difference is."""
    count, first = 0, ""
    for i, (x, y) in enumerate(zip(a, b)):
        diff = [j for j in range(max(len(x), len(y))) if j >= len(x) or j >= len(y) or x[j] != y[j]]
        count += len(diff)
        if diff and not first:
            j = diff[0]
            first = f"request {i} differs from token {j}: {x[j : j + 4]} vs {y[j : j + 4]}"
    return count, first


class LogitTape:
    """The logits behind every token the engine samples, per request and output step, recorded around its runner:
    what invariants compare, so rounding (logits a little apart) and faults (far apart, or a token that is not the
    argmax of its own logits) are told apart at the precision the backend runs."""

    def __init__(self, engine: LLMEngine):
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        step = engine.runner.step

        def recording(inputs):
            result = step(inputs)
            self._keep(inputs.batch, result.logits)
            return result

        engine.runner.step = recording

    def _keep(self, batch: list[ScheduledSeq], logits) -> None:
        if not isinstance(logits, torch.Tensor) or logits.shape[0] != sum(item.num_logits for item in batch):
            return  # a runner that replays look-ahead tokens: nothing to record
        rows, r = logits.float().cpu(), 0
        for item in batch:
            seq = item.seq
            first = seq.num_computed + item.num_tokens - item.num_logits + 1 - seq.num_prompt  # output step predicted
            for k in range(item.num_logits):
                if first + k >= 0:  # the latest wins: a later step re-predicts what a rejected draft conditioned
                    self.rows[seq.request_id, first + k] = rows[r + k]
            r += item.num_logits

    def get(self, seq: Sequence, step: int) -> torch.Tensor | None:
        return self.rows.get((seq.request_id, step))


class Divergence(NamedTuple):
    worst: float  # largest logits NMSE between the runs before their tokens part
    fault: str | None
    where: str
    request: int | None = None  # where the comparison failed, for op-level blame
    step: int | None = None


def divergence(
    fast: LogitTape,
    fast_seqs: list[Sequence],
    plain: LogitTape,
    plain_seqs: list[Sequence],
    limit: float,
    greedy: bool = True,
) -> Divergence:
    """(largest logits NMSE between the runs before their tokens part, a fault or None, where[, the request and
    step that failed]). Each request is compared step by step until its tokens differ; a difference is a fault
    when both runs' logits are finite and close but the token still changed: identical logits, or (greedy) a top-2
    margin wider than twice the largest logit difference, which rounding cannot bridge. Beyond the first
    difference the prefixes differ: not compared."""
    worst, where = 0.0, ""
    for i, (a, b) in enumerate(zip(fast_seqs, plain_seqs)):
        for j, (ta, tb) in enumerate(zip(a.output_ids, b.output_ids)):
            la, lb = fast.get(a, j), plain.get(b, j)
            for run, logits in (("", la), ("plain ", lb)):
                if logits is not None and not bool(torch.isfinite(logits).all()):
                    return Divergence(
                        math.nan,
                        (
                            f"the {run}run's logits hold NaN/Inf at request {i} step {j}: the backend emits "
                            "non-finite logits"
                        ),
                        "",
                        i,
                        j,
                    )
            if la is not None and lb is not None:
                err = float(((la.double() - lb.double()) ** 2).sum() / (lb.double() ** 2).sum().clamp_min(1e-300))
                if err > worst:
                    worst, where = err, f"largest at request {i} step {j}"
                if err > limit:
                    return Divergence(
                        err,
                        None,
                        f"the logits first leave the plain run's beyond the bound at request {i} step {j}",
                        i,
                        j,
                    )
            if ta == tb:
                continue
            if la is None or lb is None:
                return Divergence(
                    worst,
                    f"request {i} step {j}: token {ta} vs {tb}, and no logits were recorded to tell a "
                    "near tie from a fault",
                    where,
                    i,
                    j,
                )
            diff = float((la - lb).abs().max())
            top2 = lb.topk(2).values
            margin = float(top2[0] - top2[1])
            if diff == 0 or (greedy and margin > 2 * diff):
                return Divergence(
                    worst,
                    (
                        f"request {i} step {j}: token {ta} vs {tb} although the logits differ by at most "
                        f"{diff:.3g} and the plain run's top-2 margin is {margin:.3g}: the token is not the one "
                        "its logits pick"
                    ),
                    where,
                    i,
                    j,
                )
            break  # a near tie that rounding decided: later steps follow different prefixes
    return Divergence(worst, None, where)


KERNEL_OPS = ("embedding", "rmsnorm", "add_rmsnorm", "rope", "store_kv", "attention", "linear", "silu_and_mul")


class KernelTape:
    """Kernels that record every op call of a model in order, with copies of its inputs (caches included), so
    the calls can be replayed on another backend's kernels one at a time."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, []

    def __getattr__(self, name):
        fn = getattr(self.kernels, name)
        if name not in KERNEL_OPS:
            return fn

        def call(*args):
            self.calls.append((name, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return fn(*args)

        return call


# Names of the outputs of ops that return several tensors; and of a layer's projections in call order.
_OUTPUTS = {"add_rmsnorm": ("normed", "residual"), "rope": ("q", "k")}
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class OpTape:
    """Every kernel output of a run, row by row, known by the token it belongs to (request, position) and by the
    op call that made it ("layer 0 linear (qkv)"): two runs that must agree are compared op by op to find the first
    that parts them. It follows the runner's batches and wraps the model's kernels, so it sees a runner that calls
    them in Python every step; replayed graphs and a backend's own forward pass leave it empty."""

    def __init__(self, engine: LLMEngine):
        self.rows: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.order: list[str] = []  # op calls in the order a step makes them
        self.ops: dict[str, str] = {}  # op call -> the kernel op it called
        model = engine.model
        if not hasattr(model, "layers") or not hasattr(model, "kernels"):
            return
        self.dtype = model.dtype
        self._tokens: list[tuple[str, int]] = []
        self._calls, self._linears, self._num_layers = 0, 0, len(model.layers)
        kernels = getattr(model.kernels, "recorded", model.kernels)  # an earlier tape's kernels are replaced
        tape, step = self, engine.runner.step

        class Recording:
            recorded = kernels

            def __getattr__(self, name):
                fn = getattr(kernels, name)
                if name not in KERNEL_OPS or name == "store_kv":
                    return fn

                def call(*args):
                    out = fn(*args)
                    tape._record(name, out)
                    return out

                return call

        def following(inputs):
            self._tokens = [
                (item.seq.request_id, item.seq.num_computed + k)
                for item in inputs.batch
                for k in range(item.num_tokens)
            ]
            self._calls = self._linears = 0
            return step(inputs)

        model.kernels = Recording()
        engine.runner.step = following

    def _label(self, op: str) -> str:
        layer = self._linears // len(_PROJECTIONS)
        if layer >= self._num_layers:
            return "lm head linear" if op == "linear" else f"final {op}"
        if op == "linear":
            return f"layer {layer} linear ({_PROJECTIONS[self._linears % len(_PROJECTIONS)]})"
        return f"layer {layer} {op}"

    def _record(self, op: str, out) -> None:
        label = self._label(op)
        self._linears += op == "linear"
        outputs = out if isinstance(out, tuple) else (out,)
        for name, tensor in zip(_OUTPUTS.get(op, ("",)), outputs):
            call = f"{self._calls:03d} {label}" + (f" ({name})" if name else "")
            self._calls += 1
            if not isinstance(tensor, torch.Tensor) or tensor.shape[0] != len(self._tokens):
                continue  # rows that are not one a token (the LM head's)
            if call not in self.ops:
                self.order.append(call)
                self.ops[call] = op
            flat = tensor.detach().flatten(1).double().cpu()
            for token, row in zip(self._tokens, flat):
                self.rows.setdefault(token, {})[call] = row  # the latest wins, as in LogitTape


def first_op_divergence(
    a: OpTape, seq_a: Sequence, b: OpTape, seq_b: Sequence, step: int, bound: Callable[[str], float]
) -> str:
    """Where two runs of one request first part, op by op, over the tokens both computed that lead to output `step`
    (its prompt and the outputs before it, equal in both): the first op call whose outputs differ beyond
    bound(op), as "first divergence at layer L op X, normalized error E"."""
    upto = seq_a.num_prompt + step
    tokens = [
        (pos, a.rows[seq_a.request_id, pos], b.rows[seq_b.request_id, pos])
        for pos in range(upto)
        if (seq_a.request_id, pos) in a.rows and (seq_b.request_id, pos) in b.rows
    ]
    if not tokens or not a.order:
        return "the runs' ops could not be compared (the runner does not call the model's kernels step by step)"
    largest = (0.0, "")
    for call in a.order:
        pairs = [(ra[call], rb[call]) for _, ra, rb in tokens if call in ra and call in rb]
        if not pairs:
            continue
        x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        finite = torch.isfinite(x) & torch.isfinite(y)
        if bool((torch.isfinite(x) != torch.isfinite(y)).any()):
            err = math.inf
        else:
            err = float(((x - y)[finite] ** 2).sum() / (y[finite] ** 2).sum().clamp_min(1e-300))
        name, op = call.split(" ", 1)[1], a.ops[call]
        if err > bound(op):
            return (
                f"first divergence at {name}, normalized error {err:.3g} (its op bound {bound(op):g}) over the "
                f"{len(pairs)} tokens both runs computed before that step"
            )
        largest = max(largest, (err, name))
    return (
        f"every op call agrees between the runs within its op bound (largest: {largest[1]}, normalized error "
        f"{largest[0]:.3g}): they part after the ops, where the runner computes the logits or samples"
    )
