// Fused bf16 kernels for the CPU forward's small ops: RMSNorm (with the residual add before it),
// rope + KV-cache write + attention, and SiLU-and-multiply. Built and loaded by cpu_kernels.py;
// the why is there. Plain C on raw pointers: no torch headers, so it compiles in about a second.
//
// Every row (and in attention every query token and head) is computed on its own, in a fixed
// order: its bits don't depend on the batch around it, on how many tokens its forward feeds
// (a verify's k+1 or a decode's 1), or on the other rows' lengths. Greedy speculative output
// equals plain output through these kernels by construction.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

// Bits move through memcpy, not a union: the vectorizer gives up on loops with union accesses.
static inline float bf2f(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even, NaN to the canonical NaN: c10::BFloat16's rounding, so an elementwise
// result here has the same bits as torch's bf16 op that rounds once.
static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? 0x7FC0 : (bf16)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

// Parallel only past this many element-operations: a parallel region costs a few microseconds,
// more than a decode step's norm or SiLU takes on one core.
#define PAR_WORK 65536

#define QB 16  // query tokens per attention work item
#define KB 16  // keys per block of the score loop (one vector lane each)

// exp as 2^n * e^r with |r| <= ln2/2 and Cephes' expf polynomial (relative error about 2e-7), for x
// clamped to [-87, 88]. Written out so the compiler vectorizes it: libm's expf stays scalar without
// -ffast-math, and a prefill's softmax and SiLU call it millions of times.
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), the rounding transformers' LlamaRMSNorm does in bf16.
// With delta: sum = bf16(x + delta) first (the residual add), written to `sum`, and normalised.
static void norm_row(const bf16 *x, const bf16 *delta, const bf16 *w, float eps, int64_t dim,
                     bf16 *sum, bf16 *out, float *tmp) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) {
        float v = bf2f(x[i]);
        if (delta) v = round_bf(v + bf2f(delta[i]));
        tmp[i] = v;
        ss += v * v;
    }
    float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        if (delta) sum[i] = f2bf(tmp[i]);
        out[i] = f2bf(bf2f(w[i]) * round_bf(tmp[i] * rstd));
    }
}

void rms_norm_bf16(const bf16 *x, const bf16 *delta, const bf16 *w, float eps, int64_t rows, int64_t dim,
                   bf16 *sum, bf16 *out, int threads) {
    int nt = rows * dim >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *tmp = malloc(sizeof(float) * dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            norm_row(x + r * dim, delta ? delta + r * dim : NULL, w, eps, dim, sum ? sum + r * dim : NULL,
                     out + r * dim, tmp);
        free(tmp);
    }
}

// Split into loops through an fp32 buffer: written as one loop, gcc 12 vectorized none of it.
static void silu_row(const bf16 *g, const bf16 *u, int64_t n, bf16 *o, float *tmp) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = bf2f(g[i]);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = 1.0f + exp_poly(-tmp[i]);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = f2bf(round_bf(bf2f(g[i]) / tmp[i]) * bf2f(u[i]));
}

// gate_up: [rows, 2*inter] (gate then up, as the fused projection lays them out) -> out [rows, inter]:
// bf16(bf16(silu(gate)) * up), as F.silu(gate) * up rounds in bf16.
void silu_mul_bf16(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out, int threads) {
    int nt = rows * inter >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *tmp = malloc(sizeof(float) * inter);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter, out + r * inter, tmp);
        free(tmp);
    }
}

// Rotate-half rope on one head, with the rounding of apply_rope in bf16: bf16(bf16(x*cos) +
// bf16(roll(x, D/2)*sin)), where sin's first half carries rotate_half's sign.
static inline void rope_head(const bf16 *x, const bf16 *cos, const bf16 *sin, int64_t D, float *out) {
    int64_t h = D / 2;
#pragma omp simd
    for (int64_t d = 0; d < h; d++)
        out[d] = round_bf(round_bf(bf2f(x[d]) * bf2f(cos[d])) + round_bf(bf2f(x[d + h]) * bf2f(sin[d])));
#pragma omp simd
    for (int64_t d = h; d < D; d++)
        out[d] = round_bf(round_bf(bf2f(x[d]) * bf2f(cos[d])) + round_bf(bf2f(x[d - h]) * bf2f(sin[d])));
}

// qkv: [B, T, H + 2*KV, D], the fused projection's output. cos/sin: [B, T, D]. cache_k/cache_v: one
// layer's [S, KV, P, D]. write_pos: [B, T] cache position of each token, P - 1 (the trash row) for pads.
// out: [B, T, H, D].
//
// First every token's rotated K and its V go to the cache; then query (b, t) attends keys
// 0..write_pos[b, t] of its slot, which is causal order within the forward too. A pad's output is
// zeros (nothing reads it). Scores and softmax in fp32; the weighted sum in fp32, rounded once.
// Returns 0, or -1 (writing nothing) when a slot or position lies outside the cache: torch's indexing
// would raise there, and a write past the cache would corrupt memory silently.
int rope_attend_bf16(const bf16 *qkv, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                     const bf16 *cos, const bf16 *sin, bf16 *cache_k, bf16 *cache_v, int64_t S, int64_t P,
                     const int64_t *slots, const int64_t *write_pos, float scale, int threads, bf16 *out) {
    const int64_t W = H + 2 * KV, G = H / KV, trash = P - 1;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < 0 || slots[b] >= S) return -1;
    for (int64_t i = 0; i < B * T; i++)
        if (write_pos[i] < 0 || write_pos[i] >= P) return -1;
    float krot[D];
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const bf16 *row = qkv + (b * T + t) * W * D;
            const bf16 *c = cos + (b * T + t) * D, *s = sin + (b * T + t) * D;
            int64_t wp = write_pos[b * T + t];
            for (int64_t j = 0; j < KV; j++) {
                int64_t at = ((slots[b] * KV + j) * P + wp) * D;
                rope_head(row + (H + j) * D, c, s, D, krot);
                for (int64_t d = 0; d < D; d++) cache_k[at + d] = f2bf(krot[d]);
                memcpy(cache_v + at, row + (H + KV + j) * D, sizeof(bf16) * D);
            }
        }
    }
    int64_t max_keys = 0, work = 0;
    for (int64_t i = 0; i < B * T; i++) {
        int64_t n = write_pos[i] == trash ? 0 : write_pos[i] + 1;
        if (n > max_keys) max_keys = n;
        work += n;
    }
    // Work items: (row, KV head, block of QB query tokens), so a prefill converts each key and value
    // to fp32 once per block of queries rather than once per query.
    const int64_t nqb = (T + QB - 1) / QB, stride = (max_keys + KB - 1) / KB * KB;
    int nt = work * H * D >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *q = malloc(sizeof(float) * QB * G * D);  // the block's rotated queries
        float *acc = malloc(sizeof(float) * QB * G * D);
        float *kt = malloc(sizeof(float) * D * KB);  // a block of keys in fp32, transposed
        float *vf = malloc(sizeof(float) * D);
        float *p = malloc(sizeof(float) * QB * G * (stride ? stride : 1));  // scores, then probabilities
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * KV * nqb; item++) {
            int64_t b = item / (KV * nqb), j = item / nqb % KV, t0 = item % nqb * QB;
            int64_t nq = T - t0 < QB ? T - t0 : QB, n[QB], nmax = 0;
            for (int64_t tq = 0; tq < nq; tq++) {
                int64_t bt = b * T + t0 + tq, wp = write_pos[bt];
                n[tq] = wp == trash ? 0 : wp + 1;
                if (n[tq] > nmax) nmax = n[tq];
                for (int64_t g = 0; g < G && n[tq]; g++)
                    rope_head(qkv + (bt * W + j * G + g) * D, cos + bt * D, sin + bt * D, D, q + (tq * G + g) * D);
            }
            const bf16 *keys = cache_k + (slots[b] * KV + j) * P * D;
            const bf16 *vals = cache_v + (slots[b] * KV + j) * P * D;
            // Scores: KB keys at a time, one lane per key, summed over d in order. A score's bits depend
            // only on its query, its key and the key's lane (k mod KB): never on the batch or the block.
            for (int64_t k0 = 0; k0 < nmax; k0 += KB) {
                int64_t kn = nmax - k0 < KB ? nmax - k0 : KB;
                for (int64_t kk = 0; kk < KB; kk++)
                    for (int64_t d = 0; d < D; d++) kt[d * KB + kk] = kk < kn ? bf2f(keys[(k0 + kk) * D + d]) : 0.0f;
                for (int64_t tq = 0; tq < nq; tq++) {
                    if (k0 >= n[tq]) continue;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = q + (tq * G + g) * D;
                        float s[KB] = {0};
                        for (int64_t d = 0; d < D; d++) {
                            const float qd = qg[d], *restrict kd = kt + d * KB;
#pragma omp simd
                            for (int64_t kk = 0; kk < KB; kk++) s[kk] += qd * kd[kk];
                        }
                        float *pg = p + (tq * G + g) * stride + k0;
                        for (int64_t kk = 0; kk < KB; kk++) pg[kk] = s[kk] * scale;
                    }
                }
            }
            for (int64_t tq = 0; tq < nq; tq++) {
                for (int64_t g = 0; g < G && n[tq]; g++) {
                    float *pg = p + (tq * G + g) * stride, m = -INFINITY, total = 0.0f;
                    for (int64_t k = 0; k < n[tq]; k++) m = pg[k] > m ? pg[k] : m;
#pragma omp simd
                    for (int64_t k = 0; k < n[tq]; k++) pg[k] = exp_poly(pg[k] - m);
                    for (int64_t k = 0; k < n[tq]; k++) total += pg[k];  // in order: the same sum every time
                    float inv = 1.0f / total;
#pragma omp simd
                    for (int64_t k = 0; k < n[tq]; k++) pg[k] *= inv;
                }
            }
            for (int64_t x = 0; x < nq * G * D; x++) acc[x] = 0.0f;
            for (int64_t k = 0; k < nmax; k++) {
                for (int64_t d = 0; d < D; d++) vf[d] = bf2f(vals[k * D + d]);
                for (int64_t tq = 0; tq < nq; tq++) {
                    if (k >= n[tq]) continue;
                    for (int64_t g = 0; g < G; g++) {
                        float pk = p[(tq * G + g) * stride + k], *ag = acc + (tq * G + g) * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) ag[d] += pk * vf[d];
                    }
                }
            }
            for (int64_t tq = 0; tq < nq; tq++) {
                bf16 *o = out + ((b * T + t0 + tq) * H + j * G) * D;
                for (int64_t x = 0; x < G * D; x++) o[x] = n[tq] ? f2bf(acc[tq * G * D + x]) : 0;
            }
        }
        free(q);
        free(acc);
        free(kt);
        free(vf);
        free(p);
    }
    return 0;
}

// ---- weight-quantized linears ----------------------------------------------------------------------
//
// y[m, n] = sum over groups g of scale[n, g] * sum over k in g of q[n, k] * x[m, k], for int4 (a checkpoint's
// AWQ weights) and int8 (the engine's lm_head) weights, accumulated in fp32.
//
// The weights are held in blocks of QN output features, so one vector lane computes one output, and
// a block is decoded once for up to QM rows: a verify's k+1 rows then cost about what a decode's one
// row does, where torch's int4 kernel costs about 2x at 4 rows and 9x at 16. Layouts (quant.py packs
// them at load):
//   int4: uint8 [N/QN, K/2, QN], byte j of pair p = (q[n, 2p] + 8) | (q[n, 2p+1] + 8) << 4, n = block*QN + j
//   int8: int8  [N/QN, K, QN]
//   scale: fp32 [N/QN, K/G, QN]
// Every product and sum is an fmaf or an add, in the same order for every row whatever the rows beside
// it, each rounded once: a row's bits don't depend on the batch, nor on which of the variants for 1-4
// rows runs it, nor on whether the AVX-512 or the portable code does (tests compare the two).
#define QN 16
#define QM 4

// One row's QN outputs from fp32 sums to y at `at`: fp32 as they are, or bf16 rounded once.
static inline void store_outputs(void *y, int y_f32, int64_t at, const float *v) {
    if (y_f32)
        memcpy((float *)y + at, v, sizeof(float) * QN);
    else
        for (int j = 0; j < QN; j++) ((bf16 *)y)[at + j] = f2bf(v[j]);
}
#ifndef Q_PREFETCH
#define Q_PREFETCH 2048
#endif

// Four accumulator chains per row (k mod 4), summed as (c0 + c1) + (c2 + c3) at the end of a group: one
// chain per row would stall on the FMA's latency at a decode's single row.
static inline __attribute__((always_inline)) void q_tile(const int bits, const int R, const uint8_t *wb,
                                                         const float *sb, const float *x, int64_t K, int64_t G,
                                                         float out[QM][QN]) {
    float tot[QM][QN] = {{0}};
    for (int64_t g = 0; g < K / G; g++) {
        float acc[QM][4][QN] = {{{0}}};
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
            float w0[QN], w1[QN];
            for (int j = 0; j < QN; j++) {
                if (bits == 4) {
                    w0[j] = (float)(wb[k / 2 * QN + j] & 15) - 8.0f;
                    w1[j] = (float)(wb[k / 2 * QN + j] >> 4) - 8.0f;
                } else {
                    w0[j] = (float)((const int8_t *)wb)[k * QN + j];
                    w1[j] = (float)((const int8_t *)wb)[(k + 1) * QN + j];
                }
            }
            const int c = (k - g * G) % 4;
            for (int r = 0; r < R; r++)
                for (int j = 0; j < QN; j++) {
                    acc[r][c][j] = fmaf(w0[j], x[r * K + k], acc[r][c][j]);
                    acc[r][c + 1][j] = fmaf(w1[j], x[r * K + k + 1], acc[r][c + 1][j]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < QN; j++)
                tot[r][j] = fmaf((acc[r][0][j] + acc[r][1][j]) + (acc[r][2][j] + acc[r][3][j]), sb[g * QN + j], tot[r][j]);
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < QN; j++) out[r][j] = tot[r][j];
}

#ifdef __AVX512F__
#include <immintrin.h>
// q_tile in AVX-512 intrinsics: gcc spills the portable version's arrays to the stack and runs it ~7x
// slower than torch's int4 kernel. The same operations per lane in the same order: the same bits.
static inline __attribute__((always_inline)) void q_tile_avx512(const int bits, const int R, const uint8_t *wb,
                                                                const float *sb, const float *x, int64_t K,
                                                                int64_t G, float out[QM][QN]) {
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 tot[QM], acc[QM][4];
    for (int r = 0; r < R; r++) tot[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / G; g++) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
            __m512 w[4];
            _mm_prefetch((const char *)(wb + k * bits / 8 * QN + Q_PREFETCH), _MM_HINT_T0);
            if (bits == 4) {  // vpermps reads the low 4 bits of each index: u - 8 for the low nibble
                __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wb + k / 2 * QN)));
                __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wb + k / 2 * QN + QN)));
                w[0] = _mm512_permutexvar_ps(d0, lut);
                w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut);
                w[2] = _mm512_permutexvar_ps(d1, lut);
                w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut);
            } else {
                for (int c = 0; c < 4; c++)
                    w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + (k + c) * QN))));
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(w[c], _mm512_set1_ps(x[r * K + k + c]), acc[r][c]);
        }
        const __m512 s = _mm512_loadu_ps(sb + g * QN);
        for (int r = 0; r < R; r++)
            tot[r] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])),
                                     s, tot[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], tot[r]);
}
#define q_tile q_tile_avx512
#endif

static void q_tile_any(int bits, int64_t R, const uint8_t *wb, const float *sb, const float *x, int64_t K,
                       int64_t G, float out[QM][QN]) {
    // One specialized copy per (bits, rows), so each keeps its accumulators in registers.
#define Q_CASE(B, RR) \
    if (bits == B && R == RR) return q_tile(B, RR, wb, sb, x, K, G, out);
    Q_CASE(4, 1) Q_CASE(4, 2) Q_CASE(4, 3) Q_CASE(4, 4)
    Q_CASE(8, 1) Q_CASE(8, 2) Q_CASE(8, 3) Q_CASE(8, 4)
#undef Q_CASE
}

// x: [M, K], bf16 (x_f32 = 0) or fp32, times pre_scale [K] (AWQ's pre_quant_scale; NULL for none) in fp32.
// y: [M, N], bf16 (rounded once) or fp32. Returns 0, or -1 for shapes the layout can't hold.
int quant_linear(const void *x, int x_f32, int64_t M, int64_t K, const float *pre_scale, const uint8_t *w,
                 int bits, const float *scale, int64_t G, int64_t N, void *y, int y_f32, int threads) {
    if ((bits != 4 && bits != 8) || G <= 0 || G % 4 || K % G || N % QN || M < 0) return -1;
    float *xf = malloc(sizeof(float) * (M * K > 0 ? M * K : 1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            float v = x_f32 ? ((const float *)x)[m * K + k] : bf2f(((const bf16 *)x)[m * K + k]);
            xf[m * K + k] = pre_scale ? v * pre_scale[k] : v;
        }
    const int64_t blocks = N / QN, block_bytes = K * QN * bits / 8;
    int nt = M * N * K >= PAR_WORK ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        float out[QM][QN];
        for (int64_t m0 = 0; m0 < M; m0 += QM) {
            int64_t R = M - m0 < QM ? M - m0 : QM;
            q_tile_any(bits, R, w + nb * block_bytes, scale + nb * (K / G) * QN, xf + m0 * K, K, G, out);
            for (int64_t r = 0; r < R; r++) store_outputs(y, y_f32, (m0 + r) * N + nb * QN, out[r]);
        }
    }
    free(xf);
    return 0;
}

// ---- bf16 linears on AMX ----------------------------------------------------------------------------
//
// y = x @ w.T for bf16 x and w with fp32 accumulation, on weights held as bf16 [N/QN, K/2, QN, 2]: pair p of
// lane j is (w[n, 2p], w[n, 2p+1]), n = block*QN + j: the layout of AMX's B tile, so 16 pairs of a block are
// one contiguous 1 KB tile. Each row is computed on its own by the tile unit (up to 16 rows per op), so a
// row's bits don't depend on the rows beside it (tests check 1 row against 37).
//
// Why not oneDNN, which also runs AMX: its call costs 10-30 us from Python, and the engine split its calls
// into 4-32 rows to keep a row's bits batch-independent. This streams SmolLM2's layers at 21-24 GB/s for
// 1-16 rows (oneDNN 15-18) and keeps up at 64 (2 threads, weights past the L3).
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
// AMX: one tile op multiplies up to 16 rows by 32 inputs of a block of 16 outputs, about as fast at 1 row as at
// 16, so the weights stream at the memory's pace for a decode and a prefill alike. Tiles: 0-3 accumulate four
// blocks of outputs, 4 holds x, 5 one block of weights (16 pairs x 16 lanes, 1 KB, contiguous in the layout).
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // fp32 [rows, 16]
    cfg.rows[4] = rows, cfg.colsb[4] = 64;                              // bf16 [rows, 32]
    cfg.rows[5] = 16, cfg.colsb[5] = 64;                                // bf16 pairs [16, 16, 2]
    _tile_loadconfig(&cfg);
}

int amx_usable(void) {
    static int state = -1;  // the kernel must ask Linux for the tile state once per process
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

int bf16_linear(const bf16 *x, int64_t M, int64_t K, const bf16 *w, int64_t N, void *y, int y_f32,
                    int threads) {
    if (!amx_usable() || K % 32 || N % QN || M < 0) return -1;
    const int64_t blocks = N / QN;
    int nt = M * N * K >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float out[4][16][QN];
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < blocks; cb += 4) {
            const int64_t nbn = blocks - cb < 4 ? blocks - cb : 4;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? M - m0 : 16;
                if (rows != configured) amx_configure(configured = rows);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t k0 = 0; k0 < K; k0 += 32) {
                    _tile_loadd(4, x + m0 * K + k0, K * 2);
                    const bf16 *wk = w + (cb * (K / 2) + k0 / 2) * QN * 2;
                    _tile_loadd(5, wk, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nbn > 1) { _tile_loadd(5, wk + K * QN, 64); _tile_dpbf16ps(1, 4, 5); }
                    if (nbn > 2) { _tile_loadd(5, wk + 2 * K * QN, 64); _tile_dpbf16ps(2, 4, 5); }
                    if (nbn > 3) { _tile_loadd(5, wk + 3 * K * QN, 64); _tile_dpbf16ps(3, 4, 5); }
                }
                _tile_stored(0, out[0], 64);
                _tile_stored(1, out[1], 64);
                _tile_stored(2, out[2], 64);
                _tile_stored(3, out[3], 64);
                for (int64_t i = 0; i < nbn; i++)
                    for (int r = 0; r < rows; r++) store_outputs(y, y_f32, (m0 + r) * N + (cb + i) * QN, out[i][r]);
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}
#else
int amx_usable(void) { return 0; }
int bf16_linear(const bf16 *x, int64_t M, int64_t K, const bf16 *w, int64_t N, void *y, int y_f32, int threads) {
    return -1;
}
#endif

// ---- a whole decoder stack in one call ----------------------------------------------------------------
//
// The layer loop of a bf16 model whose projections all run here (int4 on quant_linear, bf16 on AMX), without
// biases: the same kernels, in the same order and with the same roundings, as the modules call one by one
// (model.py's DecoderLayer with the fused residual adds), so the bits are the same. It saves the Python
// between them: ~10 calls, their module hops and tensor allocations per layer, which took 8 of a SmolLM2
// INT4 decode step's 18 ms.
//
// x [rows, hidden]: the first layer's input; on return, the residual after the last layer's attention.
// delta: on return, the last layer's MLP output (the caller adds it). table: per layer, the two norms'
// weights, then per projection (qkv, o, gate_up, down) its kind (4: int4, 16: bf16) and the addresses of
// its weights, scales and pre_quant_scale (0 for none). Returns 0; -1 when a slot or position lies outside
// the cache (nothing is written then); -2 when a projection's kernel refuses its shape (the plan checks
// them, so a bug).
enum { L_IN_NORM, L_POST_NORM, L_QKV, L_O = L_QKV + 4, L_GU = L_O + 4, L_DOWN = L_GU + 4, LAYER_ENTRIES = L_DOWN + 4 };

static int stack_linear(const bf16 *x, int64_t rows, int64_t K, const int64_t *lin, int64_t G, int64_t N, bf16 *y,
                        int threads) {
    const void *w = (const void *)(intptr_t)lin[1];
    int rc = lin[0] == 16 ? bf16_linear(x, rows, K, w, N, y, 0, threads)
                          : quant_linear(x, 0, rows, K, (const float *)(intptr_t)lin[3], w, (int)lin[0],
                                         (const float *)(intptr_t)lin[2], G, N, y, 0, threads);
    return rc ? -2 : 0;
}

int layers_bf16(bf16 *x, bf16 *delta, int64_t B, int64_t T, int64_t layers, int64_t hidden, int64_t H, int64_t KV,
                int64_t D, int64_t inter, int64_t G, const int64_t *table, float eps, const bf16 *cos,
                const bf16 *sin, bf16 *cache_k, bf16 *cache_v, int64_t S, int64_t P, const int64_t *slots,
                const int64_t *write_pos, float scale, int threads) {
    const int64_t rows = B * T, nqkv = (H + 2 * KV) * D, layer_cache = S * KV * P * D;
    bf16 *normed = malloc(sizeof(bf16) * rows * hidden), *qkv = malloc(sizeof(bf16) * rows * nqkv);
    bf16 *attn = malloc(sizeof(bf16) * rows * H * D), *o = malloc(sizeof(bf16) * rows * hidden);
    bf16 *gate_up = malloc(sizeof(bf16) * rows * 2 * inter), *act = malloc(sizeof(bf16) * rows * inter);
    int rc = 0;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *t = table + l * LAYER_ENTRIES;
        // The residual add runs in place: norm_row reads a row whole before it writes the sum.
        rms_norm_bf16(x, l ? delta : NULL, (const bf16 *)(intptr_t)t[L_IN_NORM], eps, rows, hidden, l ? x : NULL,
                      normed, threads);
        if ((rc = stack_linear(normed, rows, hidden, t + L_QKV, G, nqkv, qkv, threads))) break;
        if (rope_attend_bf16(qkv, B, T, H, KV, D, cos, sin, cache_k + l * layer_cache, cache_v + l * layer_cache,
                             S, P, slots, write_pos, scale, threads, attn)) {
            rc = -1;
            break;
        }
        if ((rc = stack_linear(attn, rows, H * D, t + L_O, G, hidden, o, threads))) break;
        rms_norm_bf16(x, o, (const bf16 *)(intptr_t)t[L_POST_NORM], eps, rows, hidden, x, normed, threads);
        if ((rc = stack_linear(normed, rows, hidden, t + L_GU, G, 2 * inter, gate_up, threads))) break;
        silu_mul_bf16(gate_up, rows, inter, act, threads);
        if ((rc = stack_linear(act, rows, inter, t + L_DOWN, G, hidden, delta, threads))) break;
    }
    free(normed);
    free(qkv);
    free(attn);
    free(o);
    free(gate_up);
    free(act);
    return rc;
}
