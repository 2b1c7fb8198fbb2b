"""The LM head as 8-bit codes, as the onnxruntime graph and the C step read it, and embedding rows from it.

Blocks of HEAD_BLOCK inputs with a scale each: scale = largest |w| / 127, codes round(w / scale) + 128 (zero point
128), GGUF's Q8_0. A Q8_0 table (its largest code 127 a block) comes back exactly; its rows are then the tied
embedding's too, and the float32 table is not needed at all (on SmolLM2 it is 108 MiB beside 30 MiB of codes).
"""

from dataclasses import dataclass

import numpy as np
import torch

from flashnext.core import model_cache
from flashnext.core.model import DecoderModel

HEAD_BLOCK = 32
HEAD_ROWS_AT_ONCE = 4096  # a whole table's float temporaries would be 3x its size


def head_weight(model: DecoderModel) -> torch.Tensor:
    """The LM head's weights as the model keeps them (the tied embedding keeps a GGUF's values in fp32)."""
    tied = model.config.tie_word_embeddings and model.lm_head.shape == model.embed.shape
    return model.embed if tied else model.lm_head


def block_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of [rows, blocks, HEAD_BLOCK] float weights."""
    scales = blocks.abs().amax(-1) / 127
    codes = torch.where(scales[..., None] > 0, blocks / scales.clamp_min(1e-30)[..., None], 0).round() + 128
    return codes.to(torch.uint8), scales


def head_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights [..., blocks, HEAD_BLOCK] that codes and scales stand for. A Q8_0 block's scale times its
    largest code, 127, is exact in float32, so its values come back."""
    return (codes.float() - 128) * scales[..., None]


@dataclass
class Int8Head:
    codes: np.ndarray  # uint8 [vocab, hidden / HEAD_BLOCK, HEAD_BLOCK]
    scales: np.ndarray  # float32 [vocab, hidden / HEAD_BLOCK]
    exact: bool  # the codes give the model's head back exactly
    table: torch.Tensor | None  # the embedding table, where the codes are not it (tied and exact: None)

    @classmethod
    def of(cls, model: DecoderModel) -> "Int8Head":
        w = head_weight(model)
        n, k = w.shape
        codes = torch.empty(n, k // HEAD_BLOCK, HEAD_BLOCK, dtype=torch.uint8)
        scales = torch.empty(n, k // HEAD_BLOCK)
        exact = True
        for rows in range(0, n, HEAD_ROWS_AT_ONCE):
            part = slice(rows, rows + HEAD_ROWS_AT_ONCE)
            blocks = w[part].float().reshape(-1, k // HEAD_BLOCK, HEAD_BLOCK)
            codes[part], scales[part] = block_codes(blocks)
            exact = exact and torch.equal(head_values(codes[part], scales[part]), blocks)
            model_cache.drop_pages(w[part])  # a table read from a converted entry's map: its pages leave memory
        return cls(codes.numpy(), scales.numpy(), exact, None if exact and w is model.embed else model.embed)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` [tokens, hidden size] float32: from the codes where they are the tied table
        exactly, else from the table. The codes in numpy: after a step's stream of weights the host runs cache-cold,
        and numpy's few calls cost half of torch's (SmolLM2 decode: 47 vs 81 us a step)."""
        if self.table is not None:
            return torch.nn.functional.embedding(ids, self.table).float()
        rows = ids.numpy()
        values = (self.codes[rows].astype(np.float32) - 128) * self.scales[rows][..., None]
        return torch.from_numpy(values.reshape(len(rows), -1))
