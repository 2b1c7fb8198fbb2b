"""Shared by the numerics tests: per-position and teacher-forced decode logits through the engine, error and
perplexity measures, prompts."""

import torch

from flashnext.core.engine.runner import StepInput
from flashnext.core.engine.scheduler import ScheduledSeq
from flashnext.core.engine.sequence import SamplingParams, Sequence
from flashnext.core.llm import LLM

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press adapted from winemaking. Before his workshop in Mainz, books in "
    "Europe were copied by hand, a slow and costly process that kept them in the hands of monasteries, universities "
    "and wealthy patrons. Within fifty years of the first printed Bible, presses were running in more than two "
    "hundred cities, and millions of volumes had been produced. Prices fell, literacy spread, and ideas travelled "
    "faster than ever before: scientists could compare observations, reformers could reach a wide audience, and "
    "scholars could rely on identical copies of the same text. Historians still debate how much of the scientific "
    "revolution and the Reformation we owe to this single invention, but few doubt that it changed how knowledge "
    "was stored, shared and questioned. Newspapers, pamphlets and cheap almanacs soon followed, carrying news and "
    "opinion to readers who had never owned a book. In the centuries that followed, steam power, rotary presses and"
)

# The default model's test prompts: (text, chat-templated?); the last is ~200 tokens.
SMOLLM_PROMPTS = [
    ("The capital of France is", False),
    ("What is the tallest mountain in the world?", True),
    ("def fibonacci(n):\n    ", False),
    (LONG_TEXT, False),
]


def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every prompt position, computed by the engine's own step path
    (scheduler → runner.prepare → runner.forward → compute_logits), prefill chunks included."""
    return engine_outputs(llm, ids)[1]


def engine_outputs(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states, logits) of every prompt position as engine_logits computes them."""
    states, chunks = [], []

    def forward(batch) -> list[int]:
        inputs = llm.engine.runner.prepare(batch)
        states.append(llm.engine.runner.forward(inputs))
        chunks.append(llm.engine.model.compute_logits(states[-1]))
        return chunks[-1][inputs.logit_rows].argmax(-1).tolist()

    _each_prompt_chunk(llm, ids, forward)
    return torch.cat(states), torch.cat(chunks)


def served_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every prompt position through `runner.step`, the path a served request's
    steps take (for the CPU's int4 default, the onnxruntime graph rather than the torch forward), prefill chunks
    included."""
    chunks = []

    def step(batch) -> list[int]:
        every_row = [ScheduledSeq(item.seq, item.num_tokens, item.num_tokens) for item in batch]
        chunks.append(llm.engine.runner.step(StepInput(every_row, False)).logits.float())
        return [int(chunks[-1][-1].argmax())] if batch[-1].num_logits else []

    _each_prompt_chunk(llm, ids, step)
    return torch.cat(chunks)


def _each_prompt_chunk(llm: LLM, ids: list[int], run_chunk) -> None:
    """A one-token request's prompt, scheduled chunk by chunk: `run_chunk(batch)` computes a chunk and returns the
    tokens it samples, which the engine records as its own steps would."""
    engine = llm.engine
    seq = engine.add_request(ids, SamplingParams(max_tokens=1))
    with torch.inference_mode():
        while seq.finish_reason is None:
            batch = engine.scheduler.schedule()
            engine._postprocess(batch, run_chunk(batch))


def step_logits(engine, prompts: list[list[int]], steps: int, forced=None) -> list[torch.Tensor]:
    """Logits [B, vocab] of each prompt's last position, then of `steps` decode steps of the whole batch. The token
    fed back after step i is forced[i][b] where given (so two routes see the same inputs), else the greedy one."""
    seqs = [Sequence(list(p), SamplingParams()) for p in prompts]
    last = []
    for seq in seqs:
        engine.blocks.grow(seq, len(seq.token_ids) + steps)
        last.append(engine.runner.run([ScheduledSeq(seq, len(seq.token_ids), 1)])[0][-1])
        seq.num_computed = len(seq.token_ids)
    out = [torch.stack(last)]
    for step in range(steps):
        for i, seq in enumerate(seqs):
            seq.token_ids.append(forced[step][i] if forced else int(out[-1][i].argmax()))
            seq.num_computed = len(seq.token_ids) - 1
        out.append(engine.runner.run([ScheduledSeq(seq, 1, 1) for seq in seqs])[0])
    for seq in seqs:
        engine.blocks.free_sequence(seq)
    return out


def relative_errors(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """‖ours − ref‖ / ‖ref‖ for each position's logit vector."""
    return (ours.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """Teacher-forced perplexity: position t predicts token t + 1."""
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets)
    return float(nll.exp())
