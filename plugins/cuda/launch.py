"""Where each call goes and with what tiles: the routing thresholds and launch configurations of the CUDA kernels.
The measurements behind the choices are in docs/benchmarks.md."""

from flashnext.core.precision import Int4Weight

from .primitives import _pow2

# Rows up to this many go through the fused norm-GEMV (one weight read per program, rows unrolled): small decode
# batches. Beyond ~4 rows a tiled GEMM (the skinny GEMM below, or cuBLAS) is faster on a Qwen3-0.6B shape
# (docs/benchmarks.md).
GEMV_MAX_ROWS = 4


# Input sizes whose whole row fits one program's registers beside other rows of x (the GEMV keeps all of x and
# its W tile live).
GEMV_MAX_K = 4096


# Longer int4 rows (the down projections of 1.7B-8B models) still take the GEMV, up to this long: in two pieces, a
# row per program (gemv_config, gemv_k_pieces, gemv_row_block). H200, us a call against the skinny GEMM at 1 / 2 / 4
# rows: Qwen3-8B's 4,096 x 12,288 13.5 / 23.8 / 44.1 vs 51.9 / 44.8 / 44.8; 4B's 2,560 x 9,728 6.6 / 12.5 / 19.9 vs
# 27.5 / 35.7 / 35.8; 1.7B's 2,048 x 6,144 3.8 / 5.7 / 9.8 vs 13.8 / 14.7 / 14.7; Llama-3-8B's 4,096 x 14,336 18.5 /
# 35.0 / 66.7 vs 59.3 / 51.3 / 51.3. 16-bit and fp8 rows that long take it for calls of up to
# CudaKernels.long_gemv_rows rows (LONG_GEMV_MAX_ROWS; 0 in graphs whose verify rows must take their decode row's
# route, where the skinny GEMM reads the weight once for all of them): two rows through the GEMV lose to the skinny
# GEMM, one row gains (gemv_config; captured batch-1 steps, H200: Qwen3-4B bf16 3,740 -> 2,721 us, fp8 2,493 ->
# 1,963; 8B bf16 4,160 -> 4,099, fp8 3,009 -> 2,638; 1.7B bf16 1,381 -> 1,204, fp8 1,089 -> 936).
LONG_GEMV_MAX_K, LONG_GEMV_MAX_ROWS = 16384, 1


# Weights of at least this many elements (the layers of 1.7B and larger models; Qwen3-0.6B's are under 6.3M) run
# the GEMV a row a program, and only for calls of up to CudaKernels.large_gemv_rows rows (LARGE_GEMV_MAX_ROWS
# outside row-invariant graphs); more rows go to the skinny GEMM (int4 ones meeting Int8Rows: _meets_int8_rows).
# Captured decode steps on an H200 at 1 / 2 / 4 rows, rows sharing the GEMV's programs before: Qwen3-4B bf16
# 3,739 / 6,849 / 9,167 us, through the skinny GEMM above one row 3,734 / 3,086 / 3,149; fp8 2,504 / 4,410 /
# 6,949 -> 2,498 / 2,794 / 2,873; 8B bf16 4,165 / 8,582 / 11,486 -> 4,161 / 5,440 / 5,564; 1.7B bf16 1,388 /
# 1,785 / 2,425 -> 1,391 / 1,446 / 1,546. Int4, the GEMV a row a program (the skinny GEMM widening its nibbles was
# slower) against the skinny GEMM with Int8Rows: 4B 3,469 / 4,951 -> 2,799 / 2,885, 8B 4,360 / 6,207 -> 3,838 /
# 4,046, 1.7B 1,561 / 1,999 -> 1,401 / 1,510.
LARGE_WEIGHT, LARGE_GEMV_MAX_ROWS = 1 << 23, 1


# Wider 16-bit outputs (a vocabulary projection) stay on cuBLAS, which streams them at full bandwidth already;
# quantized ones only our kernels read.
GEMV_MAX_N = 32768


# Keys a split-KV decode program reads per tile.
SPLIT_BLOCK_N = 32


# A greedy step's argmax: up to this many programs a row, each over at least ARGMAX_MIN_CHUNK logits (Qwen3's
# 151,936: 128 x 1,187).
ARGMAX_CHUNKS, ARGMAX_MIN_CHUNK = 128, 1024


# fp8 weights at batches up to this many rows (decode) use the skinny Triton GEMM; larger ones torch._scaled_mm.
SKINNY_MAX_ROWS = 64


# Int4 batches up to this many rows widen their nibbles inside the skinny GEMM (int4_skinny_config); larger ones
# dequantize in a pass first (H200, Qwen3 shape, captured int4 decode steps against the pass: 5 rows 17% shorter,
# 8: 14%, 16: 16%, 32: 5%; at 64 rows the seven fused configurations tried were 4-15% longer). So do large int4
# weights meeting Int8Rows (_meets_int8_rows; Qwen3-8B, captured steps against widening: 32 rows 16,264 -> 6,799
# us; at 64 rows against the pass 11,239 -> 11,361, so the pass stays).
INT4_SKINNY_MAX_ROWS = 32


# Large int4 weights (LARGE_WEIGHT) of at least INT4_WIDE_MIN_N outputs at 17-64 rows are widened as the skinny
# GEMM's first operand instead (_wide_int4, int4_wide_config), but for the widest (gate/up, outputs >= 4 x K) up to
# 32 rows, where Int8Rows stay ahead on 4B. One call on an H200 against the route before (Int8Rows up to 32 rows,
# the pass above), us: 8B down 53.6 -> 36.3 at 32 rows, 76.2 -> 43.0 at 64; 4B gate/up 72.5 -> 44.4 at 64. Fewer
# outputs make too few programs of 64 weight rows: with 1.7B's down projection (2,048) wide, its int4 engine
# decoded 5-7% slower at 24 and 32 rows (docs/benchmarks.md).
INT4_WIDE_ROWS, INT4_WIDE_MIN_N = (17, 64), 2560


# Up to this many rows the wide route's GEMM starts when its producer has finished, not under programmatic dependent
# launch: engine int4 decode at 24 and 32 rows 12-13% faster on Qwen3-4B and 8B, 2-3% on 1.7B; at 64 rows PDL stays
# (4B 3% slower without). Only this route gains: every skinny GEMM so launched made bf16 and fp8 decode 2-12% slower
# (H200, docs/benchmarks.md).
INT4_WIDE_SERIAL_ROWS = 32


# Decode steps of more rows than this over an fp8-e5m2 cache hand the fp8 o projection its input quantized by the
# attention kernel, a scale per token and kv group (heads_per_scale), no pass between (H200, Qwen3 shape, captured
# fp8 + e5m2 steps with a scale a head: 64 rows 1,276.9 -> 1,253.8 us; 16 rows unchanged; 32 rows 1,225.8 ->
# 1,285.5, where the attention is one wave of programs and the GEMM, started beside it by programmatic dependent
# launch, slows the pair by about 12 us a layer).
HEAD_SCALES_ABOVE_ROWS = 32


# A GEMV hands its output to the int4 GEMV after it as a PackedX (see PACKED_BLOCK) only for rows of at least this
# many columns: each consumer program's rounding grows with its row, the producer's epilogue does not. H200,
# captured int4 batch-1 steps, every hand-over against none: Qwen3-0.6B 526 -> 532 us, 1.7B 807 -> 827, 4B 1,393 ->
# 1,412, 8B 2,128 -> 2,056; only to the down projections (rows of 6,144-12,288): 1.7B 806, 4B 1,383, 8B 2,085.
PACKED_X_MIN_K = 4096


# Weight kinds the GEMV / skinny GEMM read: 16-bit dense, fp8 with one scale per output row, Int4Weight.
DENSE, FP8, INT4 = 0, 1, 2


def skinny_config(n: int, k: int, rows: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, pipeline stages, K slices) for weights of elem_bytes bytes an element: the fastest of
    sweeps on an H200 at 1, 8 and 64 rows (docs/benchmarks.md). Long rows at small batches (Qwen3's down
    projection, K = 3,072, up to 16 rows) stream in four K slices: 7.0 -> 5.8 us a call in bf16 at 8 rows, 5.8 ->
    5.2 in fp8 (measured at 8 rows); elsewhere, 64 rows included, slices were no faster. Above 16 rows (programs
    of 64 rows of x: skinny_block_m) a K step spans 256 bytes of a weight row where N >= 4,096 and 512 elsewhere,
    fp8 and bf16 alike, and the widest projection (gate/up, N >= 6,144) takes 64 rows a program (H200, Qwen3 at 64
    rows, us a call, fp8 with its activations already fp8: qkv 3.78 -> 3.34, gate_up 4.61 -> 4.33, down 4.85 ->
    4.72; bf16 gate_up 6.16 -> 5.78).

    Vocabulary projections (N > GEMV_MAX_N): 64 rows a program, 256 bytes of a row a step (fp8 past 32 rows: 128),
    three stages. H200, Qwen3's head with its norm: fp8 writing logits within 1% of the fastest of 18 configs at
    each of 8, 16, 32 and 64 rows (47.6, 48.2, 50.8, 54.9 us; torch._scaled_mm 66.1, 66.0, 64.1, 60.2), and at 64
    rows writing greedy_keys' keys 62.9 -> 55.5 us for the shorter step (logits 54.6 -> 54.4; 8-16 rows 1-5 us
    slower with it); bf16 keys the fastest of 9 configs at 8, 16 and 32 rows and 1.4% off it at 64."""
    stages = 4
    if n > GEMV_MAX_N:
        block_n, block_k, stages = 64, (128 if elem_bytes == 1 and rows > 32 else 256) // elem_bytes, 3
    elif k >= 3072 and rows <= 16 and k % 1024 == 0:
        return 32, 256, 3, 4
    elif k >= 3072 and rows <= 16 and k % 512 == 0 and elem_bytes == 2:
        return 32, 128, 3, 4  # Qwen3-4B's down projection, K = 9,728: 20.3 vs 24.9 us at 8 rows, 20.9 vs 24.6 at 16
    elif rows > 16:
        block_k = (256 if n >= 4096 else 512) // elem_bytes
        block_n = 64 if n >= 6144 else 32 if n >= 4096 else 16
    else:
        block_k = 128 if n >= 4096 else 256
        block_n = 32 if n >= 4096 else 16
    while k % block_k:
        block_k //= 2
    return block_n, block_k, stages, 1


def int4_skinny_config(k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """skinny_config for int4 weights widened in the K loop: 256 columns a step (halved until they divide K), 32
    weight rows a program up to 16 rows of x, 16 above, three stages (the fastest by sum over Qwen3's four
    projections in a sweep of 10 configs at 5, 8, 16 and 32 rows on an H200). Rows of 1,536+ columns (the o and down
    projections, whose 576-1,024 outputs make few programs) take 16 weight rows a program and K in two slices, four
    above 16 rows where K >= 2,048 (H200, captured int4 steps: Qwen3 8 rows 1,269.9 -> 1,158.0 us, 16: 1,370.2 ->
    1,204.9, 32: 1,854.9 -> 1,766.5; SmolLM2 8: 818.5 -> 796.3, 16: 868.3 -> 842.4, 32: 967.9 -> 957.0). None where
    no step of whole groups divides K."""
    block_k = 256
    while k % block_k and block_k > group:
        block_k //= 2
    if k % block_k or block_k % group:
        return None
    if k >= 1536:
        return 16, block_k, 3, 4 if rows > 16 and k >= 2048 else 2
    return (32 if rows <= 16 else 16), block_k, 3, 1


def int4_wide_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int] | None:
    """skinny_config for large int4 weights widened as the dot's first operand (W_AS_A; _wide_int4 says where):
    64 weight rows a program (one wgmma tile), 256 columns a step and K in two slices; the widest weights (gate/up,
    outputs >= 4 x K) 128 columns and two stages, qkv-like ones of 6,144+ outputs (96+ programs) one slice above
    32 rows. The fastest of 31 configs, or within 2% of it, on Qwen3 1.7B / 4B / 8B's weights at 32, 48 and 64 rows
    but 1.7B's gate/up (8%: three stages there; H200). Steps are halved until they
    divide K; None where no step of whole groups does."""
    block_k = 128 if n >= 4 * k else 256
    while k % block_k and block_k > group:
        block_k //= 2
    if k % block_k or block_k % group:
        return None
    if n >= 4 * k:
        return 64, block_k, 2, 2
    return 64, block_k, 3, 1 if rows > 32 and k < n and n >= 6144 else 2


def int4_int8_config(n: int, k: int, rows: int, group: int) -> tuple[int, int, int, int]:
    """skinny_config for int4 weights meeting Int8Rows (large ones: _meets_int8_rows). Up to 16 rows, 32 weight
    rows a program: rows at least as long as the outputs are many (o, down) 512 columns a step where 1,024 divide
    K (else 256), K in two slices where it is twice the outputs; the widest (gate/up, outputs >= 4 x K) 128
    columns, one slice, 64 weight rows and three stages from K = 4,096; the rest (qkv) 256 columns in two
    slices. The fastest of 54 configs at 2 / 4 / 8 / 16 rows on Qwen3 1.7B / 4B / 8B's large weights, or within 7%
    of it, but 1.7B's qkv (12-18%: one rule for qkv; H200). 17-32 rows (programs
    of 32 rows of x; the weights the wide route leaves them: gate/up, and 1.7B's down with its 2,048 outputs): 64
    weight rows, 256 columns and three stages, K in two slices (the fastest of 11 configs at 24 and 32 rows for
    1.7B's gate/up and down, 17-19% and 8% ahead of 128 columns in four stages; within 2% of the fastest for 4B's
    and 8B's gate/up). Steps are halved until they divide K (a group divides it)."""
    if rows > 16:
        block_n, block_k, stages, split_k = 64, 256, 3, 2
    elif k >= n:
        block_n, block_k, stages, split_k = 32, (512 if k % 1024 == 0 else 256), 3, (2 if k >= 2 * n else 1)
    elif n >= 4 * k:
        block_n, block_k, stages, split_k = (64, 128, 3, 1) if k >= 4096 else (32, 128, 4, 1)
    else:
        block_n, block_k, stages, split_k = 32, 256, 3, 2
    while k % block_k and block_k > group:
        block_k //= 2
    return block_n, block_k, stages, split_k


def paged_config(dim: int, e5m2: bool, decode: bool) -> tuple[int, int, int]:
    """(keys a tile, warps, pipeline stages) of the paged attention kernel. Decode steps (one query row a
    sequence) with head_dim 128: 64 keys, two warps (the fastest of a sweep on an H200 at batch 64, context 320:
    bf16 cache 24.9 us a layer vs 25.7 for four warps; fp8-e5m2 21.1, four stages, vs 28.9 for four warps)."""
    if decode and dim <= 128:
        return 64, 2, 4 if e5m2 else 3
    return (64 if dim <= 128 else 32), 4, 3


def skinny_block_m(rows: int, kind: int) -> int:
    """Rows of x a skinny GEMM program takes: 64, the wgmma's tile, for 17-64 rows of 16-bit or fp8 weights (with
    skinny_config's >16-row steps; H200, Qwen3 captured steps against tiles of 32 rows and the <=16-row steps:
    bf16 batch 24 1,375.9 -> 1,305.1 us, 32 1,569.0 -> 1,449.3; fp8 + e5m2 24 1,316.7 -> 1,226.4, 32 1,219.7 ->
    1,149.4); else the rows' next power of two, 16 at least (the mma's). Int4 tiles, widened in registers, keep
    the latter (64 rows: batch 24 1,579.4 -> 1,826.9 us)."""
    if 16 < rows <= 64 and kind != INT4:
        return 64
    return max(16, _pow2(rows))


def silu_fp8_group(n: int) -> int:
    """Columns a scale covers in silu_and_mul_fp8's grouped rows of n columns: one program's block."""
    return min(1024, _pow2(n))


def heads_per_scale(group: int) -> int:
    """Heads of a kv group that share one fp8 scale in the o projection's input: the whole group where it is a
    power of two (the skinny GEMM's groups are), else one. Fewer, wider groups are fewer partial products to scale
    (H200, Qwen3's pairs of heads against a scale a head, captured fp8 + e5m2 steps: 64 rows 1,252.3 -> 1,241.4 us,
    48 rows 1,200.0 -> 1,191.4)."""
    return group if _pow2(group) == group else 1


def e5m2_decode_config(dim: int) -> tuple[int, int, int]:
    """(keys a tile, warps, pipeline stages) of _decode_e5m2_kernel: 128 keys, four warps, two stages up to
    head_dim 128 (the fastest of 24 configs on an H200 at batch 64, contexts 256-382: Qwen3 16.0 us a layer, 64
    keys 19.6-20.5, two warps 17.3-17.7, 256 keys 22.7-32.5; SmolLM2 8.5 vs 10.9-11.6 for 64 keys); a tile of the
    same bytes past it."""
    return (128 if dim <= 128 else 64), 4, 2


def gemv_config(n_out: int, k: int, kind: int = DENSE) -> tuple[int, int]:
    """(rows of W per program, warps). Four rows and four warps gave the fastest batch-1 decode step on an H200 for
    the Qwen3-0.6B shape (programmatic dependent launch on; the sweep in docs/benchmarks.md). Small 16-bit weights
    (the SmolLM2-135M layers) run faster with eight rows, in decode and verify steps alike (SmolLM2 shape, batch-1
    decode step: bf16 358 vs 386 us; K = 4 verify 693 vs 726); small fp8 ones do not (364 vs 340). Int4 rows cost
    few instructions (dp4a), so their programs take 16 (captured steps: Qwen3 batch 1 with eight warps 571 us vs
    602 for four rows and four warps; SmolLM2 decode 344 vs 365, verify 572 vs 614, four warps). A function of the
    weight alone, so that decode and verify rows of one layer round alike."""
    if kind != INT4 and k > GEMV_MAX_K:  # LONG_GEMV_MAX_K's 16-bit and fp8 rows: 4 x 4 spilled at 8B's 12,288
        return 2, 4  # bf16 (7,048 vs 4,099 us a step); 2 x 4 was within 4% of the fastest of six elsewhere
    small = _small_weight(n_out, k)
    if kind == INT4:  # rows past GEMV_MAX_K, 6,144 / 9,728 / 12,288 columns: 3.9 / 6.8 / 13.2 us vs 3.9 / 8.7 / 14.5
        return (16, 4) if small or k > GEMV_MAX_K else (16, 8)  # in 16 x 8 (both in two pieces)
    return (8, 4) if small and kind != FP8 else (4, 4)


def gemv_k_pieces(n_out: int, k: int, group: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_KB): a GEMV row as a power-of-two piece plus a second one for the rest, so that a 576-wide
    row takes 512 + 64 columns' registers rather than 1,024 (BLOCK_KB 0: one piece); group > 1 means int4 rows,
    whose pieces hold whole groups. Two pieces for small weights (SmolLM2 shape, H200, captured steps: bf16 decode
    345 vs 357 us, int4 396 vs 420), rows past GEMV_MAX_K (int4 at one row, 16 rows and four warps a program:
    9,728 = 8,192 + 2,048 columns 6.8 vs 17.8 us in one piece of 16,384; 12,288 13.2 vs 25.6), every int4 row
    that is not a power of two (the dots, not the bytes, bound them: Qwen3-4B's 2,560 = 2,048 + 512 columns, int4
    step 1,701 -> 1,561 us; 0.6B's 3,072 = 2,048 + 1,024, 569 -> 560) and 16-bit or fp8 rows one piece would pad by
    more than a quarter (4B bf16 2,724 -> 2,582 us; 0.6B's 3,072 pads by a quarter and ran 0.7% slower in two, fp8
    1.6%)."""
    first = 1 << (k.bit_length() - 1)
    rest = _pow2(k - first) if first < k else 0
    if rest == 0 or rest % group:
        return _pow2(k), 0
    wasteful = group > 1 or 4 * k < 3 * _pow2(k)
    if not _small_weight(n_out, k) and k <= GEMV_MAX_K and not wasteful:
        return _pow2(k), 0
    return first, rest


def _meets_int8_rows(w: Int4Weight) -> bool:
    """Large int4 weights (the layers of 1.7B and larger models) whose groups are a power of two of at least 64
    columns meet Int8Rows of their group in the skinny GEMM (each half of a group fills an int8 mma step of
    32), which streams them 1.7-2.6x faster at 4 rows than widening their nibbles to bf16 there. Others are
    widened (GGUF's 32-column blocks; the smaller weights of Qwen3-0.6B, whose captured steps of 8-32 rows ran
    5-8% slower with Int8Rows: H200)."""
    g = w.group_size
    return g >= 64 and g & (g - 1) == 0 and _large_weight(*w.shape)


def _small_weight(n_out: int, k: int) -> bool:
    """Under 2^21 elements (4 MiB in 16 bits): the layers of SmolLM2-135M are, those of Qwen3-0.6B are not."""
    return n_out * k < 1 << 21


def _large_weight(n_out: int, k: int) -> bool:
    """At least LARGE_WEIGHT elements: the layers of 1.7B and larger models."""
    return n_out * k >= LARGE_WEIGHT


def gemv_row_block(rows: int, n_out: int, k: int) -> int:
    """Rows of x one GEMV program applies its W tile to, unrolled: more rows share a tile, fewer when the row is
    long (registers). A small weight gives each row programs of its own: L2 serves the re-reads and the rows run
    in parallel (a SmolLM2 K = 4 verify step: 726 vs 837 us; Qwen3's larger layers are faster shared: 1,693 vs
    1,769). Rows past GEMV_MAX_K fill the registers alone (H200, Qwen3-8B's int4 down projection: 4 rows sharing a
    program 149.9 us, one row 13.2), and large weights run faster a row a program too (LARGE_WEIGHT)."""
    if _small_weight(n_out, k) or k > GEMV_MAX_K or _large_weight(n_out, k):
        return 1
    return max(1, min(rows, 8 if k <= 2048 else 4))


def argmax_chunks(n: int) -> int:
    """argmax_keys' chunks a row of n logits: a power of 2, at most ARGMAX_CHUNKS."""
    return max(1, min(ARGMAX_CHUNKS, _pow2(n // ARGMAX_MIN_CHUNK + 1) // 2))
