"""Decode-step attention: a split-KV kernel (and its reduce) for batches too small to fill the GPU a sequence a
program, and a kernel for fp8-e5m2 caches that widens keys and values in registers. Both can rotate the new token
and write it to the cache themselves, saving qkv_rope_store's launch."""

import triton
import triton.language as tl

from .attention import (
    _apply_norm_rope,
    _as_dot_operand,
    _attention_tile,
    _cos_sin,
    _head_norm_weight,
    _kv_tile,
    _softmax_start,
    _softmax_step,
    _softmax_update,
    _store_new_kv,
)
from .primitives import _INTERPRETED, _after_producer, _dot
from .quant import _finite_amax, _fp8_scale, _fp8_values


@triton.jit
def _e5m2_pairs_to_fp16(pairs):
    """An fp8-e5m2 tile read as int16 pairs -> its even and odd elements as fp16, exactly: an e5m2 byte is the
    high byte of the fp16 it equals, so each is one byte permute or one and for two pairs a 32-bit register."""
    if _INTERPRETED:
        even = (pairs << 8).to(tl.float16, bitcast=True)
        odd = (pairs & -256).to(tl.float16, bitcast=True)
    else:
        even = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0, 0x2404;", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2
        )
        odd = tl.inline_asm_elementwise(
            "and.b32 $0, $1, 0xFF00FF00;", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2
        )
    return even, odd


@triton.jit
def _decode_e5m2_kernel(
    q_ptr,
    k_cache,
    v_cache,
    k_pairs,
    v_pairs,
    out_ptr,
    tables_ptr,
    qstart_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    rows_per_table,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    out_scale_ptr,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FMAX: tl.constexpr,
    PDL: tl.constexpr,
    SCALE_HEADS: tl.constexpr = 1,
):
    """Decode attention (one query row a sequence; program (sequence, kv head)) over an fp8-e5m2 cache read as
    int16 pairs (k_pairs / v_pairs: the caches viewed so): q.k = q_even.k_even + q_odd.k_odd, and the even and
    odd output columns come from two P.V dots. The tiles then reach the tensor cores as 16-bit operands straight
    from shared memory, where widening the bytes in the operand layout costs Triton byte loads and converts.

    ROPE (a table row a sequence): q_ptr is the merged qkv rows, and the kernel first does what
    _qkv_rope_store_kernel would (q/k norm, rotation, this kv head's new key and value into the cache: a launch
    less a layer); the barrier after it makes those stores visible to the key loop.

    FMAX > 0 (the o projection takes fp8 rows): the output, rounded to the activations' dtype, goes out as
    fp8-e4m3 with a dynamic scale for each head (out_scale_ptr [rows, H]), or with SCALE_HEADS = H / KVH one for
    the program's heads ([rows, KVH]): the quantization pass before that projection would need the whole token's
    row, which spans KVH programs."""
    seq, kvh = tl.program_id(0), tl.program_id(1)
    GROUP: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_M)
    ok = r < GROUP
    head = kvh * GROUP + r
    if ROPE:  # read before the wait: none of it comes from qkv's producer
        qw, qw_swapped = _head_norm_weight(qn_ptr, D, HAS_NORM)
        kw, kw_swapped = _head_norm_weight(kn_ptr, D, HAS_NORM)
        slot = tl.load(slot_ptr + seq)
        cos, sin = _cos_sin(cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * D, D)
    _after_producer(PDL)
    q_first = tl.load(qstart_ptr + seq)
    if tl.load(qstart_ptr + seq + 1) > q_first:
        ctx = tl.load(ctx_ptr + seq)
        j = tl.arange(0, HALF)
        if ROPE:
            row_ptr = q_ptr + q_first * stride_q
            q = _apply_norm_rope(
                row_ptr + head[:, None] * D,
                qw,
                qw_swapped,
                cos,
                sin,
                eps,
                ok[:, None],
                D,
                HAS_NORM,
                q_ptr.dtype.element_ty,
            )
            q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_M, HALF, 2]))
            if slot >= 0:
                _store_new_kv(
                    row_ptr,
                    kw,
                    kw_swapped,
                    cos,
                    sin,
                    eps,
                    slot,
                    kvh,
                    k_cache,
                    v_cache,
                    H,
                    KVH,
                    D,
                    1,
                    HAS_NORM,
                    q_ptr.dtype.element_ty,
                )
            tl.debug_barrier()
        else:
            q_offs = q_first * (H * D) + head[:, None] * D + 2 * j[None, :]
            q_even = tl.load(q_ptr + q_offs, mask=ok[:, None], other=0.0)
            q_odd = tl.load(q_ptr + q_offs + 1, mask=ok[:, None], other=0.0)
        q_even, q_odd = q_even.to(tl.float16), q_odd.to(tl.float16)
        acc_even, m_i, l_i = _softmax_start(BLOCK_M, HALF)
        acc_odd = tl.zeros([BLOCK_M, HALF], tl.float32)
        table = seq // rows_per_table
        for start in range(0, ctx, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < ctx
            block = tl.load(tables_ptr + table * max_blocks + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            offs = ((block * BLOCK_SIZE + n % BLOCK_SIZE) * (KVH * HALF) + kvh * HALF)[:, None] + j[None, :]
            k_even, k_odd = _e5m2_pairs_to_fp16(tl.load(k_pairs + offs, mask=n_ok[:, None], other=0))
            s = _dot(q_odd, tl.trans(k_odd), _dot(q_even, tl.trans(k_even)))
            p, alpha, m_new = _softmax_step(tl.where(n_ok[None, :], s * scale, float("-inf")), m_i)
            v_even, v_odd = _e5m2_pairs_to_fp16(tl.load(v_pairs + offs, mask=n_ok[:, None], other=0))
            p16 = p.to(tl.float16)
            acc_even = _dot(p16, v_even, acc_even * alpha[:, None])
            acc_odd = _dot(p16, v_odd, acc_odd * alpha[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        out_offs = q_first * (H * D) + head[:, None] * D + 2 * j[None, :]
        dtype = q_ptr.dtype.element_ty
        out_even, out_odd = (acc_even * inv[:, None]).to(dtype), (acc_odd * inv[:, None]).to(dtype)
        if FMAX > 0:
            out_even, out_odd = out_even.to(tl.float32), out_odd.to(tl.float32)
            amax = tl.maximum(_finite_amax(out_even, 1), _finite_amax(out_odd, 1))
            if SCALE_HEADS > 1:  # the program's heads share one scale
                o_scale = _fp8_scale(tl.max(tl.where(ok, amax, 0.0), axis=0), FMAX)
                out_even, out_odd = _fp8_values(out_even, o_scale, FMAX), _fp8_values(out_odd, o_scale, FMAX)
                tl.store(out_scale_ptr + q_first * KVH + kvh, o_scale)
            else:
                o_scale = _fp8_scale(amax, FMAX)
                out_even = _fp8_values(out_even, o_scale[:, None], FMAX)
                out_odd = _fp8_values(out_odd, o_scale[:, None], FMAX)
                tl.store(out_scale_ptr + q_first * H + head, o_scale, mask=ok)
        tl.store(out_ptr + out_offs, out_even.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(out_ptr + out_offs + 1, out_odd.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _new_kv_into_tile(
    row_ptr,
    pos,
    slot,
    cos,
    sin,
    lo,
    hi,
    n0,
    k0,
    v0,
    kw,
    kw_swapped,
    eps,
    kvh,
    k_cache,
    v_cache,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    dtype: tl.constexpr,
):
    """A qkv row's new key and value, if its position falls in lo .. hi: into the cache and into the first key
    tile (k0, v0 at positions n0, already read), which are returned."""
    if (pos >= lo) & (pos < hi) & (slot >= 0):
        new_k, new_v = _store_new_kv(
            row_ptr, kw, kw_swapped, cos, sin, eps, slot, kvh, k_cache, v_cache, H, KVH, D, 1, HAS_NORM, dtype
        )
        k0 = tl.where((n0 == pos)[:, None], new_k.to(k0.dtype), k0)
        v0 = tl.where((n0 == pos)[:, None], new_v.to(v0.dtype), v0)
    return k0, v0


@triton.jit
def _new_kvs_into_tile(
    qkv_ptr,
    stride,
    first,
    last,
    pos_ptr,
    slot_ptr,
    pos,
    slot,
    cos_sin_ptr,
    lo,
    hi,
    n0,
    k0,
    v0,
    kw,
    kw_swapped,
    eps,
    kvh,
    k_cache,
    v_cache,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    dtype: tl.constexpr,
):
    """_new_kv_into_tile for the qkv rows first .. last (<= first + NEW_ROWS; pos and slot: theirs, -1 past last).
    Each row is roped as one [1, D] tile, as a decode row's own key is (the same bits, q/k norm included); the
    tile positions they land on then read back what was stored (the barrier makes this program's stores visible
    to all its threads). Without q/k norm the rows are unrolled, masked, so that their loads and stores overlap
    rather than chain row after row; with it a row that puts no key in is skipped instead, as its norm's
    reduction costs more than the overlap gains."""
    if HAS_NORM:
        for j in range(first, last):
            pos_j = tl.load(pos_ptr + j)
            slot_j = tl.load(slot_ptr + j)
            if (slot_j >= 0) & (pos_j >= lo) & (pos_j < hi):
                cos, sin = _cos_sin(cos_sin_ptr + pos_j.to(tl.int64) * D, D)
                _store_new_kv(
                    qkv_ptr + j * stride,
                    kw,
                    kw_swapped,
                    cos,
                    sin,
                    eps,
                    slot_j,
                    kvh,
                    k_cache,
                    v_cache,
                    H,
                    KVH,
                    D,
                    1,
                    HAS_NORM,
                    dtype,
                )
    else:
        for r in tl.static_range(NEW_ROWS):
            j = first + r + tl.zeros([1], tl.int32)  # [1]: the interpreter takes tensor masks only
            pos_j = tl.load(pos_ptr + j, mask=j < last, other=-1)
            slot_j = tl.load(slot_ptr + j, mask=j < last, other=-1)
            cos, sin = _cos_sin(cos_sin_ptr + tl.maximum(pos_j, 0).to(tl.int64) * D, D)
            _store_new_kv(
                qkv_ptr + j * stride,
                kw,
                kw_swapped,
                cos,
                sin,
                eps,
                slot_j,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                1,
                HAS_NORM,
                dtype,
                ok=(slot_j >= 0) & (pos_j >= lo) & (pos_j < hi),
            )
    new = (slot >= 0) & (pos >= lo) & (pos < hi)
    # The slot each tile position's new key went to (positions of one sequence's rows differ), else -1.
    landed = tl.max(tl.where((n0[:, None] == pos[None, :]) & new[None, :], slot[None, :], -1), axis=1)[:, None]
    tl.debug_barrier()
    src = landed * KVH * D + kvh * D + tl.arange(0, D)[None, :]
    k0 = tl.where(landed >= 0, tl.load(k_cache + src, mask=landed >= 0, other=0.0).to(k0.dtype), k0)
    v0 = tl.where(landed >= 0, tl.load(v_cache + src, mask=landed >= 0, other=0.0).to(v0.dtype), v0)
    return k0, v0


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache,
    v_cache,
    part_ptr,
    ml_ptr,
    tables_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    rows_per_table,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode only (one query row each; a block-table row serves rows_per_table consecutive rows): split s of
    SPLITS covers one slice of each row's context. The slices depend on the context length alone, so a row's
    result does not depend on how many other rows the step has.

    A program takes BLOCK_Q consecutive rows of one table row (the rows of a speculative verify step: BLOCK_Q
    = BLOCK_M // group, so that its query tile has decode's shape) and reads each key tile once for all of
    them. Slices start at multiples of BLOCK_N, so every row meets its own tiles as a one-row program would,
    and the tiles outside its slice change nothing (_softmax_update): each row's bits equal a decode row's.

    ROPE: q_ptr is the merged qkv rows, and the kernel does what _qkv_rope_store_kernel would have done first
    (a launch less a layer): q/k norm and rotation, and the new keys and values in its slices into the cache,
    those of the table row's earlier rows included (programs writing one slot write the same bits; NEW_ROWS:
    rows_per_table as a power of two). Its first key tile is read before the wait for the producer of qkv (the
    contexts and tables precede layer 0, the cached keys earlier steps), and the new keys that fall in it are put
    in by hand."""
    tile, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_a_table = tl.cdiv(rows_per_table, BLOCK_Q)
    table_row = tile // tiles_a_table
    group_first = table_row * rows_per_table
    first = group_first + (tile % tiles_a_table) * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, group_first + rows_per_table)  # one past this program's last row
    if BLOCK_Q == 1 or HAS_NORM:  # with q/k norm the verify rows' new keys go a row at a time, skipping dead rows
        _split_program(
            q_ptr,
            k_cache,
            v_cache,
            part_ptr,
            ml_ptr,
            tables_ptr,
            ctx_ptr,
            scale,
            max_blocks,
            stride_q,
            qn_ptr,
            kn_ptr,
            cos_sin_ptr,
            pos_ptr,
            slot_ptr,
            eps,
            table_row,
            group_first,
            first,
            last,
            kvh,
            split,
            H,
            KVH,
            D,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            SPLITS,
            BLOCK_Q,
            NEW_ROWS,
            ROPE,
            HAS_NORM,
            PDL,
            ONE_ROW=BLOCK_Q == 1,
        )
    else:
        # A verify step's rows past its drafts have context 0. When the table row's own token is this program's
        # only live row (a step without drafts), it runs as a decode row (its bits are a decode row's either way),
        # without the verify rows' loads and new-key loop; so does a program with no live row (its rows' keys are
        # the earlier programs' to write). Not with q/k norm, where steps with drafts lose more than those
        # without gain.
        rows = first + tl.arange(0, NEW_ROWS)
        ctx = tl.load(ctx_ptr + rows, mask=rows < last, other=0)
        later_dead = tl.max(tl.where(rows > first, ctx, 0), axis=0) == 0
        first_dead = tl.max(tl.where(rows == first, ctx, 0), axis=0) == 0
        if later_dead & ((first == group_first) | first_dead):
            _split_program(
                q_ptr,
                k_cache,
                v_cache,
                part_ptr,
                ml_ptr,
                tables_ptr,
                ctx_ptr,
                scale,
                max_blocks,
                stride_q,
                qn_ptr,
                kn_ptr,
                cos_sin_ptr,
                pos_ptr,
                slot_ptr,
                eps,
                table_row,
                group_first,
                first,
                last,
                kvh,
                split,
                H,
                KVH,
                D,
                BLOCK_SIZE,
                BLOCK_M,
                BLOCK_N,
                SPLITS,
                BLOCK_Q,
                NEW_ROWS,
                ROPE,
                HAS_NORM,
                PDL,
                ONE_ROW=True,
            )
        else:
            _split_program(
                q_ptr,
                k_cache,
                v_cache,
                part_ptr,
                ml_ptr,
                tables_ptr,
                ctx_ptr,
                scale,
                max_blocks,
                stride_q,
                qn_ptr,
                kn_ptr,
                cos_sin_ptr,
                pos_ptr,
                slot_ptr,
                eps,
                table_row,
                group_first,
                first,
                last,
                kvh,
                split,
                H,
                KVH,
                D,
                BLOCK_SIZE,
                BLOCK_M,
                BLOCK_N,
                SPLITS,
                BLOCK_Q,
                NEW_ROWS,
                ROPE,
                HAS_NORM,
                PDL,
                ONE_ROW=False,
            )


@triton.jit
def _split_program(
    q_ptr,
    k_cache,
    v_cache,
    part_ptr,
    ml_ptr,
    tables_ptr,
    ctx_ptr,
    scale,
    max_blocks,
    stride_q,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    table_row,
    group_first,
    first,
    last,
    kvh,
    split,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NEW_ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    """_decode_split_kernel's work for rows first .. last - 1; ONE_ROW: row `first` alone attends (as decode), the
    others' results are stored empty (no keys: the reduce gives them zeros)."""
    GROUP: tl.constexpr = H // KVH
    r = tl.arange(0, BLOCK_M)
    row = first + r // GROUP
    head = kvh * GROUP + r % GROUP
    ok = (r < BLOCK_Q * GROUP) & (row < last)  # the rows this program stores
    if ONE_ROW and BLOCK_Q > 1:
        ok_q = ok & (r < GROUP)  # the rows that attend
    else:
        ok_q = ok
    ctx = tl.load(ctx_ptr + row, mask=ok_q, other=0)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    row_lo = split * chunk
    row_hi = tl.minimum(ctx, row_lo + chunk)
    live = ok_q & (row_lo < row_hi)
    hi = tl.max(tl.where(live, row_hi, 0), axis=0)
    lo = tl.minimum(tl.min(tl.where(live, row_lo, 1 << 30), axis=0), hi)  # the rows' slices together
    row_lo, row_hi = row_lo[:, None], row_hi[:, None]
    dtype = q_ptr.dtype.element_ty
    if ROPE:
        # Read before the wait, as none of it comes from qkv's producer: the first key tile, the rows' positions
        # (written before layer 0), the norm weights and the positions' cos / sin; a decode row's slot too (verify
        # rows read theirs in the new-key loop below, where each row's position and cos / sin come from cache).
        k0, v0, n0 = _kv_tile(
            k_cache, v_cache, tables_ptr, table_row, kvh, lo, hi, KVH, D, BLOCK_SIZE, BLOCK_N, max_blocks, dtype
        )
        qw, qw_swapped = _head_norm_weight(qn_ptr, D, HAS_NORM)
        kw, kw_swapped = _head_norm_weight(kn_ptr, D, HAS_NORM)
        if ONE_ROW:  # a decode row: its key's position, slot and cos / sin too
            own_pos = tl.load(pos_ptr + first)
            own_slot = tl.load(slot_ptr + first)
            cos, sin = _cos_sin(cos_sin_ptr + own_pos.to(tl.int64) * D, D)
        else:
            pos = tl.load(pos_ptr + row, mask=ok_q, other=0)
            cos, sin = _cos_sin(cos_sin_ptr + pos.to(tl.int64)[:, None] * D, D)
            # The new keys of the table row's rows up to this program's last: only a program whose slices hold
            # one of them puts any in (a step's rows past its drafts have none).
            new_row = group_first + tl.arange(0, NEW_ROWS)
            new_pos = tl.load(pos_ptr + new_row, mask=new_row < last, other=-1)
            new_slot = tl.load(slot_ptr + new_row, mask=new_row < last, other=-1)
            puts_keys = tl.max(((new_slot >= 0) & (new_pos >= lo) & (new_pos < hi)).to(tl.int32), axis=0) > 0
    _after_producer(PDL)
    d = tl.arange(0, D)
    q_pos = ctx - 1
    acc, m_i, l_i = _softmax_start(BLOCK_M, D)
    if ROPE:
        q = _as_dot_operand(
            _apply_norm_rope(
                q_ptr + row[:, None] * stride_q + head[:, None] * D,
                qw,
                qw_swapped,
                cos,
                sin,
                eps,
                ok_q[:, None],
                D,
                HAS_NORM,
                dtype,
            ),
            k_cache,
        )
        k0, v0 = k0.to(q.dtype), v0.to(q.dtype)  # exact: an e5m2 tile read as 16-bit, fp16 for the dots
        if ONE_ROW:
            k0, v0 = _new_kv_into_tile(
                q_ptr + first * stride_q,
                own_pos,
                own_slot,
                cos,
                sin,
                lo,
                hi,
                n0,
                k0,
                v0,
                kw,
                kw_swapped,
                eps,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                HAS_NORM,
                dtype,
            )
        elif puts_keys:  # the new keys of this program's rows and of the earlier ones, all at once
            k0, v0 = _new_kvs_into_tile(
                q_ptr,
                stride_q,
                group_first,
                last,
                pos_ptr,
                slot_ptr,
                new_pos,
                new_slot,
                cos_sin_ptr,
                lo,
                hi,
                n0,
                k0,
                v0,
                kw,
                kw_swapped,
                eps,
                kvh,
                k_cache,
                v_cache,
                H,
                KVH,
                D,
                HAS_NORM,
                NEW_ROWS,
                dtype,
            )
        tl.debug_barrier()  # the new keys past the first tile are in the cache before the loop reads them
        acc, m_i, l_i = _softmax_update(q, k0, v0, n0, row_lo, row_hi, q_pos, scale, acc, m_i, l_i)
        lo += BLOCK_N
    else:
        q = _as_dot_operand(
            tl.load(q_ptr + row[:, None] * stride_q + head[:, None] * D + d[None, :], mask=ok_q[:, None], other=0.0),
            k_cache,
        )
    acc, m_i, l_i = _attention_tile(
        q,
        k_cache,
        v_cache,
        tables_ptr,
        table_row,
        kvh,
        q_pos,
        lo,
        hi,
        row_lo,
        row_hi,
        scale,
        KVH,
        D,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_N,
        max_blocks,
        acc,
        m_i,
        l_i,
    )
    base = (row * H + head) * SPLITS + split
    tl.store(part_ptr + base[:, None] * D + d[None, :], acc, mask=ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=ok)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    _after_producer(PDL)
    row = tl.program_id(0)  # seq * H + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (row * SPLITS + s) * 2)
    l = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1)  # noqa: E741 (the softmax sum, as in the papers)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    acc = tl.sum(tl.load(part_ptr + (row * SPLITS + s)[:, None] * D + d[None, :]) * w[:, None], axis=0)
    total = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, (acc / tl.where(total == 0.0, 1.0, total)).to(out_ptr.dtype.element_ty))
