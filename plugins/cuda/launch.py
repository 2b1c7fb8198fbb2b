"""Where each call goes and with what tiles: the routing thresholds and launch tables of the CUDA kernels.

A launch table is a tuple of (bounds, config) rows: the first row whose bounds all hold for a call's shape gives the
call's config (LaunchTable). The sweeps that chose the rows are listed in docs/architecture.md (the CUDA plugin).
"""

from flashnext.core.precision import Int4Weight

from .primitives import _pow2

# Rows up to this many go through the fused norm-GEMV (one weight read per program, rows unrolled): small decode
# batches. Beyond them a tiled GEMM (the skinny GEMM, or cuBLAS) is faster.
GEMV_MAX_ROWS = 4
# Input sizes whose whole row fits one program's registers beside other rows of x (the GEMV keeps all of x and
# its W tile live).
GEMV_MAX_K = 4096
# Longer rows still take the GEMV, up to LONG_GEMV_MAX_K: int4 ones in two pieces, a row a program (gemv_config,
# gemv_k_pieces, gemv_row_block); 16-bit and fp8 ones for calls of up to CudaKernels.long_gemv_rows rows
# (LONG_GEMV_MAX_ROWS; 0 in graphs whose verify rows must take their decode row's route, where the skinny GEMM reads
# the weight once for all of them). One such row gains from the GEMV, two lose.
LONG_GEMV_MAX_K, LONG_GEMV_MAX_ROWS = 16384, 1
# Weights of at least this many elements (the layers of 1.7B and larger models) run the GEMV a row a program, and
# only for calls of up to CudaKernels.large_gemv_rows rows (LARGE_GEMV_MAX_ROWS outside row-invariant graphs): more
# rows read the weight once in the skinny GEMM (int4 ones meeting Int8Rows: meets_int8_rows).
LARGE_WEIGHT, LARGE_GEMV_MAX_ROWS = 1 << 23, 1
# Wider 16-bit outputs (a vocabulary projection) stay on cuBLAS, which streams them at full bandwidth already;
# quantized ones only our kernels read.
GEMV_MAX_N = 32768
# Keys a split-KV decode program reads per tile.
SPLIT_BLOCK_N = 32
# A greedy step's argmax: up to this many programs a row, each over at least ARGMAX_MIN_CHUNK logits.
ARGMAX_CHUNKS, ARGMAX_MIN_CHUNK = 128, 1024
# fp8 weights at batches up to this many rows (decode) use the skinny Triton GEMM; larger ones torch._scaled_mm.
SKINNY_MAX_ROWS = 64
# Int4 batches up to this many rows run in the skinny GEMM, widening their nibbles (int4_skinny_config) or meeting
# Int8Rows (meets_int8_rows); larger batches dequantize in a pass first, which is then faster.
INT4_SKINNY_MAX_ROWS = 32
# Large int4 weights (LARGE_WEIGHT) of at least INT4_WIDE_MIN_N outputs at INT4_WIDE_ROWS rows are widened as the
# skinny GEMM's first operand instead (_wide_int4, int4_wide_config), but the widest (gate/up, outputs >= 4 x K) up
# to INT4_SKINNY_MAX_ROWS rows, where Int8Rows stay ahead. Fewer outputs make too few programs of 64 weight rows.
INT4_WIDE_ROWS, INT4_WIDE_MIN_N = (17, 64), 2560
# Up to this many rows the wide route's GEMM starts when its producer has finished, not under programmatic dependent
# launch: only this route gains from that, and only up to here.
INT4_WIDE_SERIAL_ROWS = 32
# Decode steps of more rows than this over an fp8-e5m2 cache hand the fp8 o projection its input quantized by the
# attention kernel, a scale per token and kv group (heads_per_scale), no pass between. At fewer rows the attention
# is one wave of programs, and the GEMM started beside it by programmatic dependent launch slows the pair.
HEAD_SCALES_ABOVE_ROWS = 32
# A GEMV hands its output to the int4 GEMV after it as a PackedX (see PACKED_BLOCK) only for rows of at least this
# many columns: each consumer program's rounding grows with its row, the producer's epilogue does not.
PACKED_X_MIN_K = 4096
# Weight kinds the GEMV / skinny GEMM read: 16-bit dense, fp8 with one scale per output row, Int4Weight.
DENSE, FP8, INT4 = 0, 1, 2

INF = 1 << 62  # an open upper bound in the tables


class LaunchTable:
    """(bounds, config) rows over the shape fields named at the start; called with those fields' values it returns
    the config of the first row whose bounds all hold. A (lo, hi) bound is a closed range, any other bound a value
    the field must equal; a row bounds only the fields it names, and the last row none. Answers are kept: an eager
    step looks a config up for every projection, and a kept answer costs about what a branch does."""

    def __init__(self, fields: str, *rows: tuple[dict, tuple]):
        self.fields, self.rows = fields.split(), rows
        self._answers: dict[tuple, tuple] = {}

    def __call__(self, *values) -> tuple:
        config = self._answers.get(values)
        if config is None:
            shape = dict(zip(self.fields, values))
            config = next(c for bounds, c in self.rows if all(_holds(b, shape[f]) for f, b in bounds.items()))
            self._answers[values] = config
        return config


def _holds(bound, value) -> bool:
    return bound[0] <= value <= bound[1] if isinstance(bound, tuple) else value == bound


# The skinny GEMM for 16-bit (elem_bytes 2) and fp8 (1) weights -> (BLOCK_N, BLOCK_K, pipeline stages, K slices).
# vocab: more outputs than GEMV_MAX_N; k_align: the largest power of two dividing K. Long rows at small batches
# stream in four K slices; above 16 rows (programs of 64 rows of x: skinny_block_m) a K step spans 256 bytes of a
# weight row where N >= 4,096 and 512 elsewhere, and the widest projections take 64 weight rows a program.
SKINNY_TILES = LaunchTable(
    "vocab n k k_align rows elem_bytes",
    ({"vocab": True, "elem_bytes": 1, "rows": (0, 32)}, (64, 256, 3, 1)),
    ({"vocab": True}, (64, 128, 3, 1)),
    ({"k": (3072, INF), "rows": (0, 16), "k_align": (1024, INF)}, (32, 256, 3, 4)),
    ({"k": (3072, INF), "rows": (0, 16), "k_align": (512, INF), "elem_bytes": 2}, (32, 128, 3, 4)),
    ({"rows": (17, INF), "n": (6144, INF), "elem_bytes": 1}, (64, 256, 4, 1)),
    ({"rows": (17, INF), "n": (6144, INF)}, (64, 128, 4, 1)),
    ({"rows": (17, INF), "n": (4096, INF), "elem_bytes": 1}, (32, 256, 4, 1)),
    ({"rows": (17, INF), "n": (4096, INF)}, (32, 128, 4, 1)),
    ({"rows": (17, INF), "elem_bytes": 1}, (16, 512, 4, 1)),
    ({"rows": (17, INF)}, (16, 256, 4, 1)),
    ({"n": (4096, INF)}, (32, 128, 4, 1)),
    ({}, (16, 256, 4, 1)),
)
# Int4 weights widened in the skinny GEMM's K loop -> (BLOCK_N, largest BLOCK_K, stages, K slices): 32 weight rows a
# program up to 16 rows of x, 16 above; rows of 1,536+ columns (o and down, whose few outputs make few programs) 16
# weight rows and K in two slices, four above 16 rows where K >= 2,048.
INT4_SKINNY_TILES = LaunchTable(
    "k rows",
    ({"k": (2048, INF), "rows": (17, INF)}, (16, 256, 3, 4)),
    ({"k": (1536, INF)}, (16, 256, 3, 2)),
    ({"rows": (0, 16)}, (32, 256, 3, 1)),
    ({}, (16, 256, 3, 1)),
)
# Large int4 weights widened as the dot's first operand (W_AS_A) -> the same; n_per_k: outputs over columns. 64
# weight rows a program (one wgmma tile), K in two slices; the widest (gate/up, n_per_k >= 4) 128 columns and two
# stages, qkv-like ones of 6,144+ outputs one slice above 32 rows.
INT4_WIDE_TILES = LaunchTable(
    "n n_per_k rows",
    ({"n_per_k": (4, INF)}, (64, 128, 2, 2)),
    ({"n_per_k": (0, 1)}, (64, 256, 3, 2)),
    ({"rows": (33, INF), "n": (6144, INF)}, (64, 256, 3, 1)),
    ({}, (64, 256, 3, 2)),
)
# Int4 weights meeting Int8Rows -> the same. 17-32 rows: 64 weight rows, three stages, K in two slices. Up to 16
# rows, 32 weight rows a program: rows at least as long as the outputs are many (o, down) 512 columns a step where
# 1,024 divide K, K in two slices where it is twice the outputs; the widest (gate/up) 128 columns, one slice, 64
# weight rows and three stages from K = 4,096; the rest (qkv) 256 columns in two slices.
INT4_INT8_TILES = LaunchTable(
    "n_per_k k k_align rows",
    ({"rows": (17, INF)}, (64, 256, 3, 2)),
    ({"n_per_k": (0, 0.5), "k_align": (1024, INF)}, (32, 512, 3, 2)),
    ({"n_per_k": (0, 0.5)}, (32, 256, 3, 2)),
    ({"n_per_k": (0, 1), "k_align": (1024, INF)}, (32, 512, 3, 1)),
    ({"n_per_k": (0, 1)}, (32, 256, 3, 1)),
    ({"n_per_k": (4, INF), "k": (4096, INF)}, (64, 128, 3, 1)),
    ({"n_per_k": (4, INF)}, (32, 128, 4, 1)),
    ({}, (32, 256, 3, 2)),
)
# The paged attention kernel -> (keys a tile, warps, pipeline stages): decode steps (one query row a sequence) up to
# head_dim 128 take two warps, four stages over an fp8-e5m2 cache.
PAGED_TILES = LaunchTable(
    "dim e5m2 decode",
    ({"decode": True, "dim": (0, 128), "e5m2": True}, (64, 2, 4)),
    ({"decode": True, "dim": (0, 128)}, (64, 2, 3)),
    ({"dim": (0, 128)}, (64, 4, 3)),
    ({}, (32, 4, 3)),
)
# _decode_e5m2_kernel -> the same: 128 keys up to head_dim 128, a tile of the same bytes past it.
E5M2_DECODE_TILES = LaunchTable(
    "dim",
    ({"dim": (0, 128)}, (128, 4, 2)),
    ({}, (64, 4, 2)),
)
# The register GEMV -> (rows of W a program, warps). long: rows past GEMV_MAX_K, which spill four rows' registers.
# Small 16-bit weights run faster with eight rows (small fp8 ones do not); int4 rows cost few instructions (int8
# dots), so their programs take 16. A function of the weight alone, so decode and verify rows of a layer round alike.
GEMV_TILES = LaunchTable(
    "kind long small",
    ({"kind": (DENSE, FP8), "long": True}, (2, 4)),
    ({"kind": INT4, "small": True}, (16, 4)),
    ({"kind": INT4, "long": True}, (16, 4)),
    ({"kind": INT4}, (16, 8)),
    ({"kind": DENSE, "small": True}, (8, 4)),
    ({}, (4, 4)),
)


def skinny_config(n: int, k: int, rows: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """SKINNY_TILES' row for an [n, k] weight of elem_bytes bytes an element at rows rows, its K step halved until
    it divides k."""
    block_n, block_k, stages, split_k = SKINNY_TILES(n > GEMV_MAX_N, n, k, k & -k, rows, elem_bytes)
    return block_n, _k_step(block_k, k, 0), stages, split_k


def int4_skinny_config(k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """INT4_SKINNY_TILES' row; None where no K step of whole groups divides k."""
    return _whole_groups(INT4_SKINNY_TILES(k, rows), k, group)


def int4_wide_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """INT4_WIDE_TILES' row for an [n, k] weight (_wide_int4 says which take it); None where no K step of whole
    groups divides k."""
    return _whole_groups(INT4_WIDE_TILES(n, n / k, rows), k, group)


def int4_int8_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int]:
    """INT4_INT8_TILES' row for an [n, k] weight meeting Int8Rows (meets_int8_rows); a group divides k."""
    block_n, block_k, stages, split_k = INT4_INT8_TILES(n / k, k, k & -k, rows)
    return block_n, _k_step(block_k, k, group), stages, split_k


def _whole_groups(config, k: int, group: int):
    """config with its K step fitted to k in whole groups (_k_step); None where no such step divides k."""
    block_n, block_k, stages, split_k = config
    block_k = _k_step(block_k, k, group)
    if k % block_k or block_k % group:
        return None
    return block_n, block_k, stages, split_k


def _k_step(block_k: int, k: int, floor: int) -> int:
    """block_k halved until it divides k, but not below floor."""
    while k % block_k and block_k > floor:
        block_k //= 2
    return block_k


def paged_config(dim: int, e5m2: bool, decode: bool) -> tuple[int, int, int]:
    """PAGED_TILES' row."""
    return PAGED_TILES(dim, e5m2, decode)


def e5m2_decode_config(dim: int) -> tuple[int, int, int]:
    """E5M2_DECODE_TILES' row."""
    return E5M2_DECODE_TILES(dim)


def gemv_config(n_out: int, k: int, kind: int = DENSE) -> tuple[int, int]:
    """GEMV_TILES' row for an [n_out, k] weight of this kind."""
    return GEMV_TILES(kind, k > GEMV_MAX_K, is_small_weight(n_out, k))


def skinny_block_m(rows: int, kind: int) -> int:
    """Rows of x a skinny GEMM program takes: 64, the wgmma's tile, for 17-64 rows of 16-bit or fp8 weights (with
    SKINNY_TILES' >16-row steps); else the rows' next power of two, 16 at least (the mma's). Int4 tiles, widened in
    registers, keep the latter."""
    if 16 < rows <= 64 and kind != INT4:
        return 64
    return max(16, _pow2(rows))


def silu_fp8_group(n: int) -> int:
    """Columns a scale covers in silu_and_mul_fp8's grouped rows of n columns: one program's block."""
    return min(1024, _pow2(n))


def heads_per_scale(group: int) -> int:
    """Heads of a kv group that share one fp8 scale in the o projection's input: the whole group where it is a
    power of two (the skinny GEMM's groups are), else one. Fewer, wider groups are fewer partial products to
    scale."""
    return group if _pow2(group) == group else 1


def gemv_k_pieces(n_out: int, k: int, group: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_KB): a GEMV row as a power-of-two piece plus a second one for the rest, so that a 576-wide
    row takes 512 + 64 columns' registers rather than 1,024 (BLOCK_KB 0: one piece); group > 1 means int4 rows,
    whose pieces hold whole groups. Two pieces for small weights, rows past GEMV_MAX_K, every int4 row that is not
    a power of two (the dots, not the bytes, bound them) and 16-bit or fp8 rows one piece would pad by more than a
    quarter."""
    first = 1 << (k.bit_length() - 1)
    rest = _pow2(k - first) if first < k else 0
    if rest == 0 or rest % group:
        return _pow2(k), 0
    wasteful = group > 1 or 4 * k < 3 * _pow2(k)
    if not is_small_weight(n_out, k) and k <= GEMV_MAX_K and not wasteful:
        return _pow2(k), 0
    return first, rest


def meets_int8_rows(w: Int4Weight) -> bool:
    """Large int4 weights whose groups are a power of two of at least 64 columns meet Int8Rows of their group in
    the skinny GEMM (each half of a group fills an int8 mma step of 32), which streams them faster than widening
    their nibbles to bf16. Others are widened (GGUF's 32-column blocks; smaller weights, which ran slower with
    Int8Rows)."""
    g = w.group_size
    return g >= 64 and g & (g - 1) == 0 and is_large_weight(*w.shape)


def is_small_weight(n_out: int, k: int) -> bool:
    """Under 2^21 elements (4 MiB in 16 bits): the layers of SmolLM2-135M are, those of Qwen3-0.6B are not."""
    return n_out * k < 1 << 21


def is_large_weight(n_out: int, k: int) -> bool:
    """At least LARGE_WEIGHT elements: the layers of 1.7B and larger models."""
    return n_out * k >= LARGE_WEIGHT


def gemv_row_block(rows: int, n_out: int, k: int) -> int:
    """Rows of x one GEMV program applies its W tile to, unrolled: more rows share a tile, fewer when the row is
    long (registers). A small weight gives each row programs of its own: L2 serves the re-reads and the rows run
    in parallel (larger weights are faster shared). Rows past GEMV_MAX_K fill the registers alone, and large
    weights run faster a row a program too (LARGE_WEIGHT)."""
    if is_small_weight(n_out, k) or k > GEMV_MAX_K or is_large_weight(n_out, k):
        return 1
    return max(1, min(rows, 8 if k <= 2048 else 4))


def argmax_chunks(n: int) -> int:
    """argmax_keys' chunks a row of n logits: a power of 2, at most ARGMAX_CHUNKS."""
    return max(1, min(ARGMAX_CHUNKS, _pow2(n // ARGMAX_MIN_CHUNK + 1) // 2))
