/* flashnext's CPU decode step: every layer and the LM head over one-token rows (one a sequence) in one call.

   Built at first use for the machine it runs on (-march=native) by plugins/cpu/native.py. The projections compute
   from the Int4Weight's 4-bit codes with float32 activations: a row's dot is sum_g scale_g (q_g . x_g) + offset_g
   sum(x_g), the codes widened to float32 in registers, so a step streams 0.5 byte a weight plus the scale and
   offset (float16 where they are exact, as GGUF's Q4_0 / Q4_1 store them). The LM head is an 8-bit table (blocks
   of 32 codes with zero point 128, a scale each: float16 where exact, as GGUF's Q8_0 stores it), computed in
   float32 too; fx_head runs it alone for rows whose layers ran elsewhere (prompt chunks). Attention reads the
   onnxruntime graph's row cache ([layers][rows][kv heads][capacity][head dim], float32), where it also writes the
   step's keys and values.

   One team of threads runs a call: the caller and workers that spin briefly between calls, then sleep. Every thread
   keeps its own copy of each row's residual stream and norms it itself, so a layer has five barriers: after the
   qkv, attention, o, gate/up and down stages, whose rows (or attention's position chunks) threads claim as they
   come free. How many threads a call uses is the caller's choice (native.py's TeamSize). */

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
#define MAX_TOKENS 64
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
} model_weights;

typedef struct {
    float *k, *v; /* [layers][rows][kv heads][capacity][head dim] */
    int64_t rows, capacity;
} row_cache;

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
    while (team.started < threads - 1) {
        if (pthread_create(&team.workers[team.started], NULL, worker_main, (void *)(intptr_t)(team.started + 1)))
            break;
        pthread_detach(team.workers[team.started]);
        team.started++;
    }
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

/* y[t][r] = w[r] . x[t] (+ bias) for rows r in [start, end), tokens t < tokens (x rows k apart, y rows ystride). */
static void q4_rows(const q4_weight *w, int64_t start, int64_t end, int tokens, const float *x, float *y,
                    int64_t ystride) {
    int64_t groups = w->k / 32, r = start;
    float d[4][1024], m[4][1024]; /* a row's scales and offsets as float32 (k <= 32768) */
    if (tokens == 1) { /* four rows at a time share each load of x; sum_g d_g (q_g . x_g) + m_g sum(x_g) */
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
    for (; r < end; r++) { /* one row at a time, each group's values dotted with every token */
        vf acc[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) acc[t] = vzero();
        row_scales(w, r, d[0], m[0]);
        const uint8_t *c = w->codes + r * groups * 16;
        for (int64_t g = 0; g < groups; g++) {
            vf v[PER_GROUP];
            q4_values(c + g * 16, d[0][g], m[0][g], v);
            for (int t = 0; t < tokens; t++)
                for (int j = 0; j < PER_GROUP; j++) acc[t] = vfma(v[j], vload(x + t * w->k + g * 32 + j * LANES), acc[t]);
        }
        for (int t = 0; t < tokens; t++) y[t * ystride + r] = vsum(acc[t]) + (w->bias ? w->bias[r] : 0.0f);
    }
}

/* The head's scales of rows [row, row + n) as float32. */
static void head_scales(const model_weights *mw, int64_t row, int64_t n, float *out) {
    int64_t blocks = mw->hidden / 32;
    if (mw->head_half) halves_to_floats((const uint16_t *)mw->head_scales + row * blocks, out, n * blocks);
    else memcpy(out, (const float *)mw->head_scales + row * blocks, n * blocks * sizeof(float));
}

/* The LM head's rows [start, end) for every token: logits[t][r]. */
static void head_rows(const model_weights *mw, int64_t start, int64_t end, int tokens, const float *x, float *logits) {
    int64_t blocks = mw->hidden / 32, h = mw->hidden;
    int64_t r = start;
    float sc[4 * 1024];
    if (tokens == 1) { /* sum_b s_b (c_b . x_b) - 128 s_b sum(x_b) */
        float sums[1024];
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
    for (; r < end; r++) {
        vf acc[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) acc[t] = vzero();
        head_scales(mw, r, 1, sc);
        for (int64_t b = 0; b < blocks; b++) {
            vf v[PER_GROUP];
            q8_values(mw->head_codes + (r * blocks + b) * 32, sc[b], v);
            for (int t = 0; t < tokens; t++)
                for (int j = 0; j < PER_GROUP; j++) acc[t] = vfma(v[j], vload(x + t * h + b * 32 + j * LANES), acc[t]);
        }
        for (int t = 0; t < tokens; t++) logits[t * mw->vocab + r] = vsum(acc[t]);
    }
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
    row_cache cache;
    int tokens;
    const int64_t *row, *past;
    const float *hidden;
    float *logits;
    /* shared stage outputs */
    float *qkv, *o, *act, *down, *final;
    float *partial; /* [chunks of every token][heads][head_dim + 2]: a chunk's attention output, max and sum */
    int64_t first_chunk[MAX_TOKENS + 1]; /* token t's attention chunks are first_chunk[t] .. first_chunk[t + 1] - 1 */
    /* per thread */
    float *local; /* [threads][local_floats] */
    int64_t local_floats;
} call_state;

typedef struct {
    float *residual, *normed, *q, *knew, *vnew, *attn, *scores;
} thread_buffers;

static thread_buffers buffers_of(call_state *s, int thread) {
    const model_weights *mw = s->mw;
    int64_t t = s->tokens, h = mw->hidden, qs = mw->heads * mw->head_dim, kvs = mw->kv_heads * mw->head_dim;
    int64_t widest = mw->inter > h ? mw->inter : h;
    float *p = s->local + thread * s->local_floats;
    thread_buffers b;
    b.residual = p; p += t * h;
    b.normed = p; p += t * widest;
    b.q = p; p += t * qs;
    b.knew = p; p += t * kvs;
    b.vnew = p; p += t * kvs;
    b.attn = p; p += t * qs;
    b.scores = p;
    return b;
}

static int64_t local_floats(const model_weights *mw, int tokens, int64_t capacity) {
    int64_t h = mw->hidden, qs = mw->heads * mw->head_dim, kvs = mw->kv_heads * mw->head_dim;
    int64_t widest = mw->inter > h ? mw->inter : h;
    int64_t per_group = mw->heads / mw->kv_heads;
    return tokens * (h + widest + 2 * qs + 2 * kvs) + per_group * (capacity + 1) + 64;
}

/* One token's attention over positions [start, end) of its context (the last one, `past`, is the new key and value
   in thread-local buffers), every head: out, max and sum of exponentials per head into `part`. */
static void attend_chunk(call_state *s, int layer, int t, int64_t start, int64_t end, thread_buffers *b, float *part) {
    const model_weights *mw = s->mw;
    int64_t d = mw->head_dim, kv = mw->kv_heads, per_group = mw->heads / kv, past = s->past[t];
    int64_t stride = s->cache.capacity * d;
    int64_t base = ((layer * s->cache.rows + s->row[t]) * kv) * stride;
    for (int64_t g = 0; g < kv; g++) {
        const float *keys = s->cache.k + base + g * stride, *values = s->cache.v + base + g * stride;
        const float *knew = b->knew + t * kv * d + g * d, *vnew = b->vnew + t * kv * d + g * d;
        int64_t n = end - start;
        for (int64_t i = 0; i < per_group; i++) {
            int64_t h = g * per_group + i;
            float *out = part + h * (d + 2);
            if (n <= 0) {
                memset(out, 0, d * sizeof(float));
                out[d] = -INFINITY;
                out[d + 1] = 0.0f;
                continue;
            }
            const float *q = b->q + t * mw->heads * d + h * d;
            float *sc = b->scores;
            float top = -INFINITY;
            for (int64_t p = start; p < end; p++) {
                const float *key = p == past ? knew : keys + p * d;
                float v = dot(q, key, d) * mw->scale;
                sc[p - start] = v;
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
            for (int64_t q = start; q < end; q++) {
                const float *value = q == past ? vnew : values + q * d;
                vf e = vset(sc[q - start]);
                for (int64_t j = 0; j < d / LANES; j++) acc[j] = vfma(e, vload(value + j * LANES), acc[j]);
            }
            for (int64_t j = 0; j < d / LANES; j++) vstore(out + j * LANES, acc[j]);
            out[d] = top;
            out[d + 1] = total;
        }
    }
}

static void decode_job(int thread, void *arg) {
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
        for (int t = 0; t < tokens; t++) { /* this thread's copy of the step's queries and new keys / values */
            const float *row = s->qkv + t * qkv_n;
            memcpy(b.q + t * qs, row, qs * sizeof(float));
            memcpy(b.knew + t * kvs, row + qs, kvs * sizeof(float));
            memcpy(b.vnew + t * kvs, row + qs + kvs, kvs * sizeof(float));
            const float *cos = mw->cos + s->past[t] * (d / 2), *sin = mw->sin + s->past[t] * (d / 2);
            for (int64_t i = 0; i < heads; i++) {
                float *q = b.q + t * qs + i * d;
                if (w->q_norm) rmsnorm(q, w->q_norm, d, mw->eps, q);
                rope(q, cos, sin, d);
            }
            for (int64_t i = 0; i < kv; i++) {
                float *k = b.knew + t * kvs + i * d;
                if (w->k_norm) rmsnorm(k, w->k_norm, d, mw->eps, k);
                rope(k, cos, sin, d);
            }
        }
        int64_t chunk, all = s->first_chunk[tokens];
        while ((chunk = atomic_fetch_add(&team.next, 1)) < all) { /* one chunk a claim: they are few */
            int t = 0;
            while (s->first_chunk[t + 1] <= chunk) t++;
            start = (chunk - s->first_chunk[t]) * POSITIONS_CHUNK;
            end = start + POSITIONS_CHUNK < s->past[t] + 1 ? start + POSITIONS_CHUNK : s->past[t] + 1;
            attend_chunk(s, (int)l, t, start, end, &b, s->partial + chunk * heads * (d + 2));
        }
        barrier();
        for (int t = 0; t < tokens; t++) { /* every thread merges the chunks into its own copy */
            for (int64_t i = 0; i < heads; i++) {
                float top = -INFINITY, total = 0.0f;
                for (int64_t c = s->first_chunk[t]; c < s->first_chunk[t + 1]; c++) {
                    const float *part = s->partial + c * heads * (d + 2) + i * (d + 2);
                    if (part[d] > top) top = part[d];
                }
                float *out = b.attn + t * qs + i * d;
                memset(out, 0, d * sizeof(float));
                for (int64_t c = s->first_chunk[t]; c < s->first_chunk[t + 1]; c++) {
                    const float *part = s->partial + c * heads * (d + 2) + i * (d + 2);
                    if (part[d + 1] == 0.0f) continue;
                    float f = expf(part[d] - top);
                    total += f * part[d + 1];
                    for (int64_t j = 0; j < d; j++) out[j] += f * part[j];
                }
                for (int64_t j = 0; j < d; j++) out[j] /= total;
            }
        }
        if (thread == 0) { /* the step's keys and values into the row cache (no one reads them there this call) */
            int64_t stride = s->cache.capacity * d;
            for (int t = 0; t < tokens; t++) {
                int64_t base = ((l * s->cache.rows + s->row[t]) * kv) * stride + s->past[t] * d;
                for (int64_t i = 0; i < kv; i++) {
                    memcpy(s->cache.k + base + i * stride, b.knew + t * kvs + i * d, d * sizeof(float));
                    memcpy(s->cache.v + base + i * stride, b.vnew + t * kvs + i * d, d * sizeof(float));
                }
            }
        }
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
    for (int t = 0; t < tokens; t++) rmsnorm(b.residual + t * h, mw->final_norm, h, mw->eps, b.normed + t * h);
    if (thread == 0) memcpy(s->final, b.normed, tokens * h * sizeof(float));
    while (claim(mw->vocab, HEAD_CHUNK, &start, &end)) head_rows(mw, start, end, tokens, b.normed, s->logits);
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

/* Logits [tokens][vocab] of one decode step: token t is at position past[t] of the sequence in cache row row[t],
   its embedding hidden[t]. Returns 0, or -1 where scratch memory could not be had or the shapes are out of range. */
int fx_decode(const model_weights *mw, row_cache cache, int tokens, const int64_t *row, const int64_t *past,
              const float *hidden, float *logits) {
    if (tokens < 1 || tokens > MAX_TOKENS || mw->head_dim > 256 || mw->head_dim % LANES || mw->hidden % 32 ||
        mw->hidden > 32768)
        return -1;
    call_state s = {.mw = mw, .cache = cache, .tokens = tokens, .row = row, .past = past, .hidden = hidden,
                    .logits = logits};
    int64_t h = mw->hidden, qs = mw->heads * mw->head_dim, kvs = mw->kv_heads * mw->head_dim;
    int64_t qkv_n = qs + 2 * kvs;
    for (int t = 0; t < tokens; t++) {
        if (past[t] < 0 || past[t] >= cache.capacity || row[t] < 0 || row[t] >= cache.rows) return -1;
        s.first_chunk[t + 1] = s.first_chunk[t] + past[t] / POSITIONS_CHUNK + 1; /* past + 1 positions */
    }
    int64_t partial = s.first_chunk[tokens] * mw->heads * (mw->head_dim + 2);
    int64_t shared = tokens * (qkv_n + h + mw->inter + h + h) + partial;
    float *p = grown(&scratch.shared, &scratch.shared_floats, shared);
    s.local_floats = local_floats(mw, tokens, cache.capacity);
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
    run_team(decode_job, &s);
    if (mw->refine_rows) refine(mw, tokens, s.final, logits);
    return 0;
}

typedef struct {
    const model_weights *mw;
    int tokens;
    const float *x;
    float *logits;
} head_state;

static void head_job(int thread, void *arg) {
    (void)thread;
    head_state *s = arg;
    int64_t start, end;
    while (claim(s->mw->vocab, HEAD_CHUNK, &start, &end)) head_rows(s->mw, start, end, s->tokens, s->x, s->logits);
    barrier();
}

/* Logits [tokens][vocab] of final (normed) hidden states x [tokens][hidden]: the head of prompt chunks, whose
   layers run elsewhere. */
int fx_head(const model_weights *mw, int tokens, const float *x, float *logits) {
    if (tokens < 1 || tokens > MAX_TOKENS || mw->hidden % 32 || mw->hidden > 32768) return -1;
    head_state s = {.mw = mw, .tokens = tokens, .x = x, .logits = logits};
    run_team(head_job, &s);
    if (mw->refine_rows) refine(mw, tokens, x, logits);
    return 0;
}

/* Floats a vector holds in this build: 16 (AVX-512), 8 (AVX2) or 1 (plain C). */
int fx_lanes(void) { return LANES; }
