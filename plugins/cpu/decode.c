/* flashnext's CPU int4 step: every layer and the LM head over a call's tokens (decode rows, one a sequence, or a
   prompt chunk's tokens in order) in one call.

   Built at first use for the machine it runs on (-march=native) by plugins/cpu/native.py. The projections compute
   from the Int4Weight's 4-bit codes with float32 activations: for one token a row's dot is sum_g scale_g (q_g . x_g)
   + offset_g sum(x_g), the codes widened to float32 in registers, so a step streams 0.5 byte a weight plus the scale
   and offset (float16 where they are exact, as GGUF's Q4_0 / Q4_1 store them); for several tokens a tile of rows is
   widened to float32 values once and dotted with every token from registers. The LM head is an 8-bit table (blocks
   of 32 codes with zero point 128, a scale each: float16 where exact, as GGUF's Q8_0 stores it), computed in float32
   too, for the tokens whose logits are wanted. Attention reads the engine's paged KV cache ([layers][slots][kv
   heads][head dim], float16 or float32) through each sequence's block table; a call writes its tokens' keys and
   values there first, so a prompt chunk's later tokens see its earlier ones.

   One team of threads runs a call: the caller and workers that spin briefly between calls, then sleep. Every thread
   keeps its own copy of each token's residual stream and norms it itself, so a layer has six barriers: after the
   qkv stage, the cache writes, attention, o, gate/up and down, whose rows (or attention's position chunks) threads
   claim as they come free. How many threads a call uses is the caller's choice (native.py's TeamSize). */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define MAX_THREADS 64
#define MAX_TOKENS 128
#define ROWS_CHUNK 64 /* the fewest projection rows a claim takes (a multiple of 4) */
#define HEAD_CHUNK 256 /* the fewest LM head rows a claim takes */
#define POSITIONS_CHUNK 64 /* context positions a chunk of attention holds */

/* ---- vectors: 16 lanes (AVX-512), 8 (AVX2), or 1 (plain C) ----
   Each build says how to widen a group's codes to floats (q4_codes, q8_codes), how to convert float16 and, for
   the vector builds, the pieces of e^x; the dot products, the values and e^x itself are written once below. */

#if defined(__AVX512F__) && defined(__F16C__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for whole n in the normal range. */
static inline vf vpow2(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* A 4-bit group's 32 codes as floats: bytes c[j] hold element j (low nibble) and element j + 16 (high). The nibbles
   index a table of 0..15 (vpermps reads an index's low 4 bits, so the low nibble needs no mask). */
static inline void q4_codes(const uint8_t *c, vf *q) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    q[0] = _mm512_permutexvar_ps(b, iota);
    q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), iota);
}
/* 32 8-bit codes as floats, as stored (zero point not taken off). */
static inline void q8_codes(const uint8_t *c, vf *q) {
    for (int i = 0; i < 2; i++)
        q[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * i))));
}
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}
static inline vf vload_half(const uint16_t *h) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)); }
static inline void vstore_half(uint16_t *h, vf a) {
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline void q4_codes(const uint8_t *c, vf *q) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)c);
    __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    __m256i low = _mm256_set1_epi32(15);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}
static inline void q8_codes(const uint8_t *c, vf *q) {
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * i))));
}
static inline float half_to_float(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}
static inline vf vload_half(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }
static inline void vstore_half(uint16_t *h, vf a) {
    _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
#define LANES 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vset(float a) { return a; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf a) { *p = a; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return a; }
static inline void q4_codes(const uint8_t *c, vf *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (float)(c[j] & 15);
        q[j + 16] = (float)(c[j] >> 4);
    }
}
static inline void q8_codes(const uint8_t *c, vf *q) {
    for (int j = 0; j < 32; j++) q[j] = (float)c[j];
}
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    union { uint32_t u; float f; } out;
    if (exp == 31) out.u = sign | 0x7f800000u | (man << 13);
    else if (exp) out.u = sign | ((exp + 112) << 23) | (man << 13);
    else { out.f = (float)man * (1.0f / 16777216.0f); out.u |= sign; }
    return out.f;
}
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) f[i] = half_to_float(h[i]);
}
/* float32 -> float16 bits, rounded to nearest even (as F16C's conversion). */
static inline uint16_t float_to_half(float f) {
    union { float f; uint32_t u; } in = {f};
    uint32_t sign = (in.u >> 16) & 0x8000u, bits = in.u & 0x7fffffffu;
    if (bits >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (bits > 0x7f800000u ? 0x200u : 0)); /* inf, NaN */
    if (bits >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past the largest half: inf */
    if (bits < 0x38800000u) { /* a subnormal half (or 0): the value in units of 2^-24, rounded */
        union { uint32_t u; float f; } magic = {0x3f000000u}; /* 0.5: adding it puts 2^-24 in the last mantissa bit */
        in.u = bits;
        in.f += magic.f;
        return (uint16_t)(sign | (in.u - magic.u));
    }
    uint32_t odd = (bits >> 13) & 1u;
    bits += 0xc8000fffu + odd; /* rebias the exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (bits >> 13));
}
static inline vf vload_half(const uint16_t *h) { return half_to_float(*h); }
static inline void vstore_half(uint16_t *h, vf a) { *h = float_to_half(a); }
static inline vf vexp(vf x) { return x < -87.0f ? 0.0f : expf(x); }
#endif

#define PER_GROUP (32 / LANES) /* vectors a group of 32 values fills */

#if LANES > 1
/* e^x for x <= 0 (softmax after its maximum is taken off); below -87 it is 0. */
static inline vf vexp(vf x) {
    x = vmax(x, vset(-87.0f));
    vf n = vround(vmul(x, vset(1.44269504f)));
    vf r = vfma(n, vset(-0.693145751953125f), x);
    r = vfma(n, vset(-1.428606765330187e-06f), r);
    vf p = vset(1.0f / 5040);
    p = vfma(p, r, vset(1.0f / 720));
    p = vfma(p, r, vset(1.0f / 120));
    p = vfma(p, r, vset(1.0f / 24));
    p = vfma(p, r, vset(1.0f / 6));
    p = vfma(p, r, vset(0.5f));
    p = vfma(p, r, vset(1.0f));
    p = vfma(p, r, vset(1.0f));
    return vmul(p, vpow2(n));
}
#endif

/* sum_j q_j x_j over a group of 32 floats (PER_GROUP vectors), lane-wise. */
static inline vf group_dot(const vf *q, const vf *x) {
#if PER_GROUP > 4 /* plain C: two chains, so a group's 32 multiply-adds do not wait on each other one by one */
    vf even = vmul(q[0], x[0]), odd = vmul(q[1], x[1]);
    for (int j = 2; j < PER_GROUP; j += 2) {
        even = vfma(q[j], x[j], even);
        odd = vfma(q[j + 1], x[j + 1], odd);
    }
    return vadd(even, odd);
#else
    vf t = vmul(q[0], x[0]);
    for (int j = 1; j < PER_GROUP; j++) t = vfma(q[j], x[j], t);
    return t;
#endif
}
static inline vf q4_dot(const uint8_t *c, const vf *x) {
    vf q[PER_GROUP];
    q4_codes(c, q);
    return group_dot(q, x);
}
static inline vf q8_dot(const uint8_t *c, const vf *x) {
    vf q[PER_GROUP];
    q8_codes(c, q);
    return group_dot(q, x);
}
/* A 4-bit group's 32 values q * d + m. */
static inline void q4_values(const uint8_t *c, float d, float m, vf *w) {
    q4_codes(c, w);
    for (int j = 0; j < PER_GROUP; j++) w[j] = vfma(w[j], vset(d), vset(m));
}
/* 32 8-bit codes (zero point 128) times their scale. */
static inline void q8_values(const uint8_t *c, float s, vf *w) {
    q8_codes(c, w);
    for (int j = 0; j < PER_GROUP; j++) w[j] = vfma(w[j], vset(s), vset(-128.0f * s));
}

/* ---- what Python hands over (plugins/cpu/native.py mirrors these with ctypes) ---- */

typedef struct {
    const uint8_t *codes; /* [n][k / 32][16] */
    const void *scales, *offsets; /* [n][k / 32]: float16 bits where half, else float32 */
    const float *bias; /* [n] or NULL */
    int64_t n, k, half;
} q4_weight;

typedef struct {
    q4_weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* the per-head norms NULL unless the model has them */
} layer_weights;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float eps, scale;
    const layer_weights *layer;
    const float *final_norm;
    const uint8_t *head_codes; /* [vocab][hidden / 32][32], zero point 128 */
    const void *head_scales; /* [vocab][hidden / 32]: float16 bits where head_half, else float32 */
    int64_t head_half;
    const void *refine_rows; /* [vocab][hidden] float32 or float16 rows, or NULL where the codes are the head */
    int64_t refine_half, refine_top;
    const float *cos, *sin; /* [positions][head_dim / 2] */
    int64_t positions;
} model_weights;

typedef struct {
    void *k, *v; /* [layers][slots][kv heads][head dim]: the engine's paged cache, float32 or (half) float16 */
    int64_t half;
    int64_t slots, block_size; /* a layer's slots; positions a block holds */
    const int32_t *tables; /* [sequences][width]: the block of each block_size positions of a sequence */
    int64_t sequences, width;
} paged_cache;

/* ---- the team ---- */

static struct {
    int size; /* threads a call uses, the caller included */
    int started; /* workers running */
    int created_at; /* the generation when the last worker was made: it waits for the next one */
    int64_t spin_ns; /* how long an idle worker spins for the next call before it sleeps */
    pthread_t workers[MAX_THREADS];
    atomic_int generation; /* bumped to hand the team a call */
    atomic_int arrived, passed; /* the barrier */
    atomic_llong next; /* the next chunk of the stage in progress */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    void (*job)(int thread, void *arg);
    void *arg;
} team = {.size = 1, .spin_ns = 50000, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* All `team.size` threads meet here. Spinning, then yielding the core: a busy neighbour gets it back. */
static void barrier(void) {
    int passed = atomic_load(&team.passed);
    if (atomic_fetch_add(&team.arrived, 1) == team.size - 1) {
        atomic_store(&team.arrived, 0);
        atomic_store(&team.next, 0); /* the next stage's chunks, before anyone can claim one */
        atomic_fetch_add(&team.passed, 1);
        return;
    }
    for (int i = 0; atomic_load(&team.passed) == passed; i++) {
        if (i < 20000) relax();
        else sched_yield();
    }
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    int seen = team.created_at;
    for (;;) {
        int64_t until = now_ns() + team.spin_ns;
        for (int i = 0; atomic_load(&team.generation) == seen; i++) {
            if ((i & 63) == 0 && now_ns() > until) {
                pthread_mutex_lock(&team.lock);
                while (atomic_load(&team.generation) == seen) pthread_cond_wait(&team.wake, &team.lock);
                pthread_mutex_unlock(&team.lock);
                break;
            }
            relax();
        }
        seen = atomic_load(&team.generation);
        if (index < team.size) team.job(index, team.arg);
    }
    return NULL;
}

/* Threads for later calls (the caller is one of them); returns the team's size. */
int fx_set_threads(int threads, int64_t spin_ns) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    team.created_at = atomic_load(&team.generation);
    pthread_attr_t attr; /* a stage keeps ~120 KiB of buffers on the stack: near musl's default 128 KiB */
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8 << 20);
    while (team.started < threads - 1) {
        if (pthread_create(&team.workers[team.started], &attr, worker_main, (void *)(intptr_t)(team.started + 1)))
            break;
        pthread_detach(team.workers[team.started]);
        team.started++;
    }
    pthread_attr_destroy(&attr);
    team.size = team.started + 1 < threads ? team.started + 1 : threads;
    team.spin_ns = spin_ns;
    return team.size;
}

static void run_team(void (*job)(int, void *), void *arg) {
    team.job = job;
    team.arg = arg;
    atomic_store(&team.next, 0);
    pthread_mutex_lock(&team.lock);
    atomic_fetch_add(&team.generation, 1);
    pthread_cond_broadcast(&team.wake);
    pthread_mutex_unlock(&team.lock);
    job(0, arg); /* ends in a barrier: every worker is done when this returns */
}

/* The next unclaimed part [start, end) of a stage's [0, n) (0 when none is left), guided: a claim takes 1 / (2 x
   threads) of what is left, down to `least` (a multiple of 4). Threads take parts as they come free, so a thread
   that lost its core to another process holds the others back by the part it is in, not by a fixed share of the
   stage, while the first claims stay long runs of rows (the memory streams as with a fixed split). Every stage
   ends in a barrier, which resets the count. */
static inline int claim(int64_t n, int64_t least, int64_t *start, int64_t *end) {
    long long at = atomic_load(&team.next);
    for (;;) {
        if (at >= n) return 0;
        int64_t part = (n - at) / (2 * team.size);
        part = part < least ? least : (part + 3) / 4 * 4;
        int64_t until = at + part < n ? at + part : n;
        if (atomic_compare_exchange_weak(&team.next, &at, until)) {
            *start = at;
            *end = until;
            return 1;
        }
    }
}

/* ---- kernels ---- */

static float dot(const float *a, const float *b, int64_t n) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float group_sum(const float *x) {
    vf acc = vzero();
    for (int j = 0; j < PER_GROUP; j++) acc = vadd(acc, vload(x + j * LANES));
    return vsum(acc);
}

static void row_scales(const q4_weight *w, int64_t row, float *d, float *m) {
    int64_t groups = w->k / 32;
    if (w->half) {
        halves_to_floats((const uint16_t *)w->scales + row * groups, d, groups);
        halves_to_floats((const uint16_t *)w->offsets + row * groups, m, groups);
    } else {
        memcpy(d, (const float *)w->scales + row * groups, groups * sizeof(float));
        memcpy(m, (const float *)w->offsets + row * groups, groups * sizeof(float));
    }
}

/* ---- several tokens: weights widened a tile at a time, then dotted with every token from registers ----
   A tile is ROW_TILE rows by up to PANEL columns of float32 values (L1-resident); TOKEN_TILE tokens at a time are
   dotted with all of its rows, each of the ROW_TILE x TOKEN_TILE sums in its own register. */

#define ROW_TILE 4
#define PANEL 256 /* columns a tile holds (a multiple of 32) */
#if LANES == 16
#define TOKEN_TILE 6 /* 24 sums + 4 rows + 1 token: 29 of 32 registers */
#elif LANES == 8
#define TOKEN_TILE 2 /* 8 + 4 + 1 of 16 */
#else
#define TOKEN_TILE 4
#endif

/* Rows [r, r + nr) of a weight, columns [c, c + n), as float32 values into `tile` (rows PANEL apart). */
typedef void (*widen_fn)(const void *weight, int64_t r, int nr, int64_t c, int64_t n, float *tile);

static inline float scale_at(const void *p, int64_t half, int64_t i) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void q4_widen(const void *weight, int64_t r, int nr, int64_t c, int64_t n, float *tile) {
    const q4_weight *w = weight;
    int64_t groups = w->k / 32;
    for (int i = 0; i < nr; i++) {
        int64_t row = (r + i) * groups;
        for (int64_t g = c / 32; g < (c + n) / 32; g++) {
            vf v[PER_GROUP];
            q4_values(w->codes + (row + g) * 16, scale_at(w->scales, w->half, row + g),
                      scale_at(w->offsets, w->half, row + g), v);
            for (int j = 0; j < PER_GROUP; j++) vstore(tile + i * PANEL + g * 32 - c + j * LANES, v[j]);
        }
    }
}

static void head_widen(const void *weights, int64_t r, int nr, int64_t c, int64_t n, float *tile) {
    const model_weights *mw = weights;
    int64_t blocks = mw->hidden / 32;
    for (int i = 0; i < nr; i++) {
        int64_t row = (r + i) * blocks;
        for (int64_t b = c / 32; b < (c + n) / 32; b++) {
            vf v[PER_GROUP];
            q8_values(mw->head_codes + (row + b) * 32, scale_at(mw->head_scales, mw->head_half, row + b), v);
            for (int j = 0; j < PER_GROUP; j++) vstore(tile + i * PANEL + b * 32 - c + j * LANES, v[j]);
        }
    }
}

/* y[t][i] (+)= tile[i] . x[t] over n columns for ROW_TILE rows (nr of them stored) and NT tokens. Inlined with a
   constant NT, every sum stays in a register. */
static inline __attribute__((always_inline)) void tile_dot(const float *tile, const float *x, int64_t xstride,
                                                           int64_t n, float *y, int64_t ystride, int nr, int first,
                                                           const float *bias, const int NT) {
    vf acc[ROW_TILE][TOKEN_TILE];
#pragma GCC unroll 8
    for (int i = 0; i < ROW_TILE; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[i][t] = vzero();
    for (int64_t j = 0; j < n; j += LANES) {
        vf w[ROW_TILE];
#pragma GCC unroll 8
        for (int i = 0; i < ROW_TILE; i++) w[i] = vload(tile + i * PANEL + j);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            vf xt = vload(x + t * xstride + j);
#pragma GCC unroll 8
            for (int i = 0; i < ROW_TILE; i++) acc[i][t] = vfma(w[i], xt, acc[i][t]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < nr; i++) {
            float *out = y + t * ystride + i;
            *out = (first ? (bias ? bias[i] : 0.0f) : *out) + vsum(acc[i][t]);
        }
}

/* y[t][r] = w[r] . x[t] (+ bias) for rows [start, end) and every token (x rows k apart, y rows ystride apart). */
static void tiled_rows(widen_fn widen, const void *weight, int64_t k, int64_t start, int64_t end, int tokens,
                       const float *x, float *y, int64_t ystride, const float *bias) {
    float tile[ROW_TILE * PANEL] __attribute__((aligned(64)));
    memset(tile, 0, sizeof tile); /* rows past nr stay 0 */
    for (int64_t r = start; r < end; r += ROW_TILE) {
        int nr = end - r < ROW_TILE ? (int)(end - r) : ROW_TILE;
        const float *b = bias ? bias + r : NULL;
        for (int64_t c = 0; c < k; c += PANEL) {
            int64_t n = k - c < PANEL ? k - c : PANEL;
            widen(weight, r, nr, c, n, tile);
            int t = 0;
            for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)
                tile_dot(tile, x + t * k + c, k, n, y + t * ystride + r, ystride, nr, c == 0, b, TOKEN_TILE);
            for (; t < tokens; t++) tile_dot(tile, x + t * k + c, k, n, y + t * ystride + r, ystride, nr, c == 0, b, 1);
        }
    }
}

/* y[t][r] = w[r] . x[t] (+ bias) for rows r in [start, end), tokens t < tokens (x rows k apart, y rows ystride). */
static void q4_rows(const q4_weight *w, int64_t start, int64_t end, int tokens, const float *x, float *y,
                    int64_t ystride) {
    int64_t groups = w->k / 32, r = start;
    if (tokens == 1) { /* four rows at a time share each load of x; sum_g d_g (q_g . x_g) + m_g sum(x_g) */
        float d[4][1024], m[4][1024]; /* a row's scales and offsets as float32 (k <= 32768) */
        float sums[1024];
        for (int64_t g = 0; g < groups; g++) sums[g] = group_sum(x + g * 32);
        for (; r + 4 <= end; r += 4) {
            vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
            const uint8_t *c[4];
            for (int i = 0; i < 4; i++) {
                row_scales(w, r + i, d[i], m[i]);
                c[i] = w->codes + (r + i) * groups * 16;
            }
            for (int64_t g = 0; g < groups; g++) {
                vf xg[PER_GROUP];
                for (int j = 0; j < PER_GROUP; j++) xg[j] = vload(x + g * 32 + j * LANES);
                for (int i = 0; i < 4; i++) acc[i] = vfma(q4_dot(c[i] + g * 16, xg), vset(d[i][g]), acc[i]);
            }
            for (int i = 0; i < 4; i++)
                y[r + i] = vsum(acc[i]) + dot(m[i], sums, groups) + (w->bias ? w->bias[r + i] : 0.0f);
        }
    }
    if (r < end) tiled_rows(q4_widen, w, w->k, r, end, tokens, x, y, ystride, w->bias);
}

/* The head's scales of rows [row, row + n) as float32. */
static void head_scales(const model_weights *mw, int64_t row, int64_t n, float *out) {
    int64_t blocks = mw->hidden / 32;
    if (mw->head_half) halves_to_floats((const uint16_t *)mw->head_scales + row * blocks, out, n * blocks);
    else memcpy(out, (const float *)mw->head_scales + row * blocks, n * blocks * sizeof(float));
}

/* The LM head's rows [start, end) for every token: logits[t][r]. */
static void head_rows(const model_weights *mw, int64_t start, int64_t end, int tokens, const float *x, float *logits) {
    int64_t blocks = mw->hidden / 32;
    int64_t r = start;
    if (tokens == 1) { /* sum_b s_b (c_b . x_b) - 128 s_b sum(x_b) */
        float sc[4 * 1024], sums[1024];
        for (int64_t b = 0; b < blocks; b++) sums[b] = -128.0f * group_sum(x + b * 32);
        for (; r + 4 <= end; r += 4) {
            vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
            head_scales(mw, r, 4, sc);
            for (int64_t b = 0; b < blocks; b++) {
                vf xg[PER_GROUP];
                for (int j = 0; j < PER_GROUP; j++) xg[j] = vload(x + b * 32 + j * LANES);
                for (int i = 0; i < 4; i++)
                    acc[i] = vfma(q8_dot(mw->head_codes + ((r + i) * blocks + b) * 32, xg), vset(sc[i * blocks + b]), acc[i]);
            }
            for (int i = 0; i < 4; i++) logits[r + i] = vsum(acc[i]) + dot(sc + i * blocks, sums, blocks);
        }
    }
    if (r < end) tiled_rows(head_widen, mw, mw->hidden, r, end, tokens, x, logits, mw->vocab, NULL);
}

static void rmsnorm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float ss = dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* Neox rope (the halves of a head rotated against each other) at one position. */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/* ---- one call ---- */

typedef struct {
    const model_weights *mw;
    paged_cache cache;
    int tokens, first_logit;
    const int64_t *seq, *past;
    const float *hidden;
    float *logits;
    int64_t capacity; /* the longest context of the call's tokens */
    int64_t chunk; /* context positions an attention chunk holds */
    /* shared stage outputs */
    float *qkv, *o, *act, *down, *final;
    float *partial; /* [chunks of every token][heads][head_dim + 2]: a chunk's attention output, max and sum */
    int64_t first_chunk[MAX_TOKENS + 1]; /* token t's attention chunks are first_chunk[t] .. first_chunk[t + 1] - 1 */
    /* per thread */
    float *local; /* [threads][local_floats] */
    int64_t local_floats;
} call_state;

typedef struct {
    float *residual, *normed, *q, *attn, *scores;
    int64_t *slots;
} thread_buffers;

static thread_buffers buffers_of(call_state *s, int thread) {
    const model_weights *mw = s->mw;
    int64_t t = s->tokens, h = mw->hidden, qs = mw->heads * mw->head_dim;
    int64_t widest = mw->inter > h ? mw->inter : h;
    float *p = s->local + thread * s->local_floats;
    thread_buffers b;
    b.residual = p; p += t * h;
    b.normed = p; p += t * widest;
    b.q = p; p += t * qs;
    b.attn = p; p += t * qs;
    b.slots = (int64_t *)p; p += 2 * s->capacity;
    b.scores = p;
    return b;
}

static int64_t local_floats(const model_weights *mw, int tokens, int64_t capacity) {
    int64_t h = mw->hidden, qs = mw->heads * mw->head_dim;
    int64_t widest = mw->inter > h ? mw->inter : h;
    int64_t per_group = mw->heads / mw->kv_heads;
    return tokens * (h + widest + 2 * qs) + 2 * capacity + per_group * capacity + 64;
}

/* The cache slot of token t's sequence's position p. */
static inline int64_t slot_of(const call_state *s, int t, int64_t p) {
    const paged_cache *c = &s->cache;
    return (int64_t)c->tables[s->seq[t] * c->width + p / c->block_size] * c->block_size + p % c->block_size;
}

/* q . key of the key at element `at` of the cache. */
static inline float key_dot(const paged_cache *c, int64_t at, const float *q, int64_t d) {
    if (!c->half) return dot(q, (const float *)c->k + at, d);
    const uint16_t *k = (const uint16_t *)c->k + at;
    vf acc = vzero();
    for (int64_t j = 0; j < d; j += LANES) acc = vfma(vload(q + j), vload_half(k + j), acc);
    return vsum(acc);
}

/* acc += e * the value at element `at` of the cache. */
static inline void value_add(const paged_cache *c, int64_t at, float e, int64_t d, vf *acc) {
    vf ev = vset(e);
    if (c->half) {
        const uint16_t *v = (const uint16_t *)c->v + at;
        for (int64_t j = 0; j < d / LANES; j++) acc[j] = vfma(ev, vload_half(v + j * LANES), acc[j]);
    } else {
        const float *v = (const float *)c->v + at;
        for (int64_t j = 0; j < d / LANES; j++) acc[j] = vfma(ev, vload(v + j * LANES), acc[j]);
    }
}

/* n floats into the cache at element `at`, as its type. */
static void cache_store(void *cache, int half, int64_t at, const float *x, int64_t n) {
    if (!half) {
        memcpy((float *)cache + at, x, n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)cache + at;
    for (int64_t j = 0; j < n; j += LANES) vstore_half(h + j, vload(x + j));
}

/* One token's attention over positions [start, end) of its context, every head: out, max and sum of exponentials
   per head into `part`. Every position's key and value is in the cache (the call wrote its own there first). */
static void attend_chunk(call_state *s, int layer, int t, int64_t start, int64_t end, thread_buffers *b, float *part) {
    const model_weights *mw = s->mw;
    int64_t d = mw->head_dim, kv = mw->kv_heads, per_group = mw->heads / kv, n = end - start;
    for (int64_t p = start; p < end; p++) b->slots[p - start] = ((layer * s->cache.slots) + slot_of(s, t, p)) * kv * d;
    for (int64_t g = 0; g < kv; g++) {
        int64_t head = g * d; /* this group's keys and values in a slot */
        for (int64_t i = 0; i < per_group; i++) {
            int64_t h = g * per_group + i;
            float *out = part + h * (d + 2);
            const float *q = b->q + t * mw->heads * d + h * d;
            float *sc = b->scores;
            float top = -INFINITY;
            for (int64_t p = 0; p < n; p++) {
                float v = key_dot(&s->cache, b->slots[p] + head, q, d) * mw->scale;
                sc[p] = v;
                if (v > top) top = v;
            }
            int64_t p = 0;
            vf sum = vzero(), vtop = vset(top);
            for (; p + LANES <= n; p += LANES) {
                vf e = vexp(vload(sc + p) - vtop);
                vstore(sc + p, e);
                sum = sum + e;
            }
            float total = vsum(sum);
            for (; p < n; p++) {
                sc[p] = expf(sc[p] - top);
                total += sc[p];
            }
            vf acc[256 / LANES]; /* head_dim <= 256 */
            for (int64_t j = 0; j < d / LANES; j++) acc[j] = vzero();
            for (int64_t p = 0; p < n; p++) value_add(&s->cache, b->slots[p] + head, sc[p], d, acc);
            for (int64_t j = 0; j < d / LANES; j++) vstore(out + j * LANES, acc[j]);
            out[d] = top;
            out[d + 1] = total;
        }
    }
}

/* The call's new keys (normed, roped) and values of one layer into their cache slots. */
static void write_kv(call_state *s, int64_t layer, const layer_weights *w) {
    const model_weights *mw = s->mw;
    int64_t d = mw->head_dim, kv = mw->kv_heads, qs = mw->heads * d, kvs = kv * d, qkv_n = qs + 2 * kvs;
    for (int t = 0; t < s->tokens; t++) {
        const float *row = s->qkv + t * qkv_n;
        int64_t at = (layer * s->cache.slots + slot_of(s, t, s->past[t])) * kvs;
        const float *cos = mw->cos + s->past[t] * (d / 2), *sin = mw->sin + s->past[t] * (d / 2);
        for (int64_t i = 0; i < kv; i++) {
            float k[256];
            memcpy(k, row + qs + i * d, d * sizeof(float));
            if (w->k_norm) rmsnorm(k, w->k_norm, d, mw->eps, k);
            rope(k, cos, sin, d);
            cache_store(s->cache.k, (int)s->cache.half, at + i * d, k, d);
        }
        cache_store(s->cache.v, (int)s->cache.half, at, row + qs + kvs, kvs);
    }
}

/* Every thread merges token t's attention chunks into its own copy of the output. */
static void merge_chunks(call_state *s, int t, float *attn) {
    int64_t d = s->mw->head_dim, heads = s->mw->heads;
    for (int64_t i = 0; i < heads; i++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = s->first_chunk[t]; c < s->first_chunk[t + 1]; c++) {
            const float *part = s->partial + c * heads * (d + 2) + i * (d + 2);
            if (part[d] > top) top = part[d];
        }
        float *out = attn + t * heads * d + i * d;
        memset(out, 0, d * sizeof(float));
        for (int64_t c = s->first_chunk[t]; c < s->first_chunk[t + 1]; c++) {
            const float *part = s->partial + c * heads * (d + 2) + i * (d + 2);
            float f = expf(part[d] - top);
            total += f * part[d + 1];
            for (int64_t j = 0; j < d; j++) out[j] += f * part[j];
        }
        for (int64_t j = 0; j < d; j++) out[j] /= total;
    }
}

static void step_job(int thread, void *arg) {
    call_state *s = arg;
    const model_weights *mw = s->mw;
    thread_buffers b = buffers_of(s, thread);
    int tokens = s->tokens;
    int64_t h = mw->hidden, d = mw->head_dim, heads = mw->heads, kv = mw->kv_heads;
    int64_t qs = heads * d, kvs = kv * d, qkv_n = qs + 2 * kvs, inter = mw->inter;
    int64_t start, end;
    memcpy(b.residual, s->hidden, tokens * h * sizeof(float));
    for (int64_t l = 0; l < mw->layers; l++) {
        const layer_weights *w = mw->layer + l;
        for (int t = 0; t < tokens; t++) rmsnorm(b.residual + t * h, w->input_norm, h, mw->eps, b.normed + t * h);
        while (claim(qkv_n, ROWS_CHUNK, &start, &end)) q4_rows(&w->qkv, start, end, tokens, b.normed, s->qkv, qkv_n);
        barrier();
        if (thread == 0) write_kv(s, l, w); /* a later token of a sequence reads an earlier one's */
        for (int t = 0; t < tokens; t++) { /* this thread's copy of the step's queries */
            const float *cos = mw->cos + s->past[t] * (d / 2), *sin = mw->sin + s->past[t] * (d / 2);
            memcpy(b.q + t * qs, s->qkv + t * qkv_n, qs * sizeof(float));
            for (int64_t i = 0; i < heads; i++) {
                float *q = b.q + t * qs + i * d;
                if (w->q_norm) rmsnorm(q, w->q_norm, d, mw->eps, q);
                rope(q, cos, sin, d);
            }
        }
        barrier();
        int64_t chunk, all = s->first_chunk[tokens];
        while ((chunk = atomic_fetch_add(&team.next, 1)) < all) { /* one chunk a claim: they are few */
            int t = 0;
            while (s->first_chunk[t + 1] <= chunk) t++;
            start = (chunk - s->first_chunk[t]) * s->chunk;
            end = start + s->chunk < s->past[t] + 1 ? start + s->chunk : s->past[t] + 1;
            attend_chunk(s, (int)l, t, start, end, &b, s->partial + chunk * heads * (d + 2));
        }
        barrier();
        for (int t = 0; t < tokens; t++) merge_chunks(s, t, b.attn);
        while (claim(h, ROWS_CHUNK, &start, &end)) q4_rows(&w->o, start, end, tokens, b.attn, s->o, h);
        barrier();
        for (int t = 0; t < tokens; t++) {
            float *res = b.residual + t * h;
            for (int64_t i = 0; i < h; i++) res[i] += s->o[t * h + i];
            rmsnorm(res, w->post_norm, h, mw->eps, b.normed + t * h);
        }
        /* gate rows [start, end) and the same up rows: SiLU(gate) * up of those rows */
        q4_weight gate = w->gate_up, up = w->gate_up;
        int64_t groups = w->gate_up.k / 32, sz = w->gate_up.half ? 2 : 4;
        up.codes += inter * groups * 16;
        up.scales = (const char *)up.scales + inter * groups * sz;
        up.offsets = (const char *)up.offsets + inter * groups * sz;
        if (up.bias) up.bias += inter;
        while (claim(inter, ROWS_CHUNK, &start, &end)) {
            for (int64_t r0 = start; r0 < end; r0 += ROWS_CHUNK) { /* gate's rows, then up's, while x is in cache */
                int64_t r1 = r0 + ROWS_CHUNK < end ? r0 + ROWS_CHUNK : end;
                float g[MAX_TOKENS * ROWS_CHUNK], u[MAX_TOKENS * ROWS_CHUNK];
                q4_rows(&gate, r0, r1, tokens, b.normed, g - r0, ROWS_CHUNK);
                q4_rows(&up, r0, r1, tokens, b.normed, u - r0, ROWS_CHUNK);
                for (int t = 0; t < tokens; t++)
                    for (int64_t r = r0; r < r1; r++) {
                        float gv = g[t * ROWS_CHUNK + r - r0];
                        s->act[t * inter + r] = gv / (1.0f + expf(-gv)) * u[t * ROWS_CHUNK + r - r0];
                    }
            }
        }
        barrier();
        while (claim(h, ROWS_CHUNK, &start, &end)) q4_rows(&w->down, start, end, tokens, s->act, s->down, h);
        barrier();
        for (int t = 0; t < tokens; t++)
            for (int64_t i = 0; i < h; i++) b.residual[t * h + i] += s->down[t * h + i];
    }
    int first = s->first_logit, wanted = tokens - first;
    if (wanted <= 0) { /* no head: the call ends when every thread is done with its buffers */
        barrier();
        return;
    }
    for (int t = first; t < tokens; t++)
        rmsnorm(b.residual + t * h, mw->final_norm, h, mw->eps, b.normed + (t - first) * h);
    if (thread == 0) memcpy(s->final, b.normed, wanted * h * sizeof(float));
    while (claim(mw->vocab, HEAD_CHUNK, &start, &end)) head_rows(mw, start, end, wanted, b.normed, s->logits);
    barrier();
}

/* Where the head's codes are not its exact values: each token's refine_top largest logits computed again from the
   float rows (the argmax then exact unless that many lie within the codes' rounding of the top). */
static void refine(const model_weights *mw, int tokens, const float *x, float *logits) {
    int64_t top_n = mw->refine_top, h = mw->hidden;
    int64_t best[256];
    float best_v[256];
    if (top_n > 256) top_n = 256;
    for (int t = 0; t < tokens; t++) {
        float *row = logits + t * mw->vocab;
        int64_t have = 0;
        for (int64_t i = 0; i < mw->vocab; i++) { /* insertion into a short sorted list */
            float v = row[i];
            if (have == top_n && v <= best_v[have - 1]) continue;
            int64_t j = have < top_n ? have++ : have - 1;
            while (j > 0 && best_v[j - 1] < v) {
                best_v[j] = best_v[j - 1];
                best[j] = best[j - 1];
                j--;
            }
            best_v[j] = v;
            best[j] = i;
        }
        for (int64_t j = 0; j < have; j++) {
            float acc = 0.0f;
            if (mw->refine_half) {
                const uint16_t *w = (const uint16_t *)mw->refine_rows + best[j] * h;
                for (int64_t i = 0; i < h; i++) acc += half_to_float(w[i]) * x[t * h + i];
            } else {
                acc = dot((const float *)mw->refine_rows + best[j] * h, x + t * h, h);
            }
            row[best[j]] = acc;
        }
    }
}

static struct {
    float *shared, *local;
    int64_t shared_floats, local_floats;
} scratch;

static float *grown(float **buffer, int64_t *have, int64_t want) {
    if (want > *have) {
        free(*buffer);
        *buffer = aligned_alloc(64, ((want * sizeof(float) + 63) / 64) * 64);
        *have = *buffer ? want : 0;
    }
    return *buffer;
}

/* Whether token t's sequence has a block for each of positions 0 .. past[t] and the cache and rope tables hold them. */
static int in_range(const model_weights *mw, const paged_cache *c, int64_t seq, int64_t past) {
    if (seq < 0 || seq >= c->sequences || past < 0 || past >= mw->positions || past / c->block_size >= c->width)
        return 0;
    for (int64_t i = 0; i <= past / c->block_size; i++) {
        int32_t block = c->tables[seq * c->width + i];
        if (block < 0 || (int64_t)(block + 1) * c->block_size > c->slots) return 0;
    }
    return 1;
}

/* One step over `tokens` tokens: token t at position past[t] of sequence seq[t] (its row of the cache's block
   tables), its embedding hidden[t]. Tokens of one sequence may follow each other (a prompt chunk: positions in
   order). Writes every token's keys and values into the cache and the logits [tokens - first_logit][vocab] of the
   tokens from first_logit on (none where first_logit >= tokens). Returns 0, or -1 where scratch memory could not be
   had or the shapes or positions are out of range. */
int fx_step(const model_weights *mw, paged_cache cache, int tokens, const int64_t *seq, const int64_t *past,
            const float *hidden, int first_logit, float *logits) {
    if (tokens < 1 || tokens > MAX_TOKENS || first_logit < 0 || mw->head_dim > 256 || mw->head_dim % LANES ||
        mw->hidden % 32 || mw->hidden > 32768 || cache.block_size < 1)
        return -1;
    call_state s = {.mw = mw, .cache = cache, .tokens = tokens, .first_logit = first_logit, .seq = seq,
                    .past = past, .hidden = hidden, .logits = logits};
    int64_t h = mw->hidden, qs = mw->heads * mw->head_dim, kvs = mw->kv_heads * mw->head_dim;
    int64_t qkv_n = qs + 2 * kvs;
    for (int t = 0; t < tokens; t++) {
        if (!in_range(mw, &cache, seq[t], past[t])) return -1;
        if (past[t] + 1 > s.capacity) s.capacity = past[t] + 1;
    }
    /* Few tokens: their contexts in chunks, so every thread has some; many: one chunk a token, nothing to merge. */
    s.chunk = tokens >= 4 * team.size ? s.capacity : POSITIONS_CHUNK;
    for (int t = 0; t < tokens; t++) s.first_chunk[t + 1] = s.first_chunk[t] + past[t] / s.chunk + 1;
    int64_t partial = s.first_chunk[tokens] * mw->heads * (mw->head_dim + 2);
    int64_t shared = tokens * (qkv_n + h + mw->inter + h + h) + partial;
    float *p = grown(&scratch.shared, &scratch.shared_floats, shared);
    s.local_floats = local_floats(mw, tokens, s.capacity);
    s.local_floats = (s.local_floats + 15) / 16 * 16; /* each thread's buffers on their own cache lines */
    float *local = grown(&scratch.local, &scratch.local_floats, s.local_floats * team.size);
    if (!p || !local) return -1;
    s.qkv = p; p += tokens * qkv_n;
    s.o = p; p += tokens * h;
    s.act = p; p += tokens * mw->inter;
    s.down = p; p += tokens * h;
    s.final = p; p += tokens * h;
    s.partial = p;
    s.local = local;
    run_team(step_job, &s);
    if (mw->refine_rows && first_logit < tokens) refine(mw, tokens - first_logit, s.final, logits);
    return 0;
}

/* Floats a vector holds in this build: 16 (AVX-512), 8 (AVX2) or 1 (plain C). */
int fx_lanes(void) { return LANES; }
