// The engine's CPU kernels: its linears (int4/int8 weights, bf16 on AMX, bf16 and fp32 on any CPU) and, in
// cpu_kernels_layer.h, the per-layer ops for bf16 and fp32 (RMSNorm with the residual add before it, rope + KV
// write + attention, SiLU-and-multiply, and the whole decoder stack in one call). Built and loaded by
// cpu_kernels.py; the why is there. Plain C on raw pointers: no torch headers, so it compiles in a few seconds.
//
// Every row (and in attention every query token and head) is computed on its own, in a fixed
// order: its bits don't depend on the batch around it, on how many tokens its forward feeds
// (a verify's k+1 or a decode's 1), or on the other rows' lengths. Greedy speculative output
// equals plain output through these kernels by construction.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Which vector code this build runs (cpu_kernels.py builds it for the CPU, or capped: PIPELINE_KERNELS).
// cpu_kernels.py builds with -ffp-contract=off: a multiply and an add are never fused behind the source's
// back, so every path (AVX-512, AVX2, portable) rounds each operation the same way and gives the same bits.
// Where a fused multiply-add is wanted, the source says fmaf, and every path computes that alike too.
#if defined(__AVX512F__)
#define KERNEL_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL_ISA "avx2"
#else
#define KERNEL_ISA "portable"
#endif
#define AI inline __attribute__((always_inline))

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

#define NORM_LANES 16  // RMSNorm's sum of squares: one chain per lane (cpu_kernels_layer.h)
#define QB 16  // query tokens per attention work item
#define KB 16  // keys per block of the score loop (one vector lane each)
#define SR 4  // query rows whose scores are summed side by side (s0..s3 in rope_attend)
#define SUM_LANES 16  // chains of a softmax row's sum (rope_attend)
#define DV 16  // elements of a row's weighted sum held in registers at a time

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

#if defined(__AVX512F__)
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
#elif defined(__AVX2__) && defined(__FMA__)
// q_tile in AVX2 + FMA: each half of a block (8 outputs) runs the whole reduction on its own, so a row's four
// chains fit in registers. The same operations per lane in the same order as the portable tile: the same bits.
static inline __attribute__((always_inline)) void q_tile_avx2(const int bits, const int R, const uint8_t *wb,
                                                              const float *sb, const float *x, int64_t K,
                                                              int64_t G, float out[QM][QN]) {
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int h = 0; h < 2; h++) {
        __m256 tot[QM], acc[QM][4];
        for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < K / G; g++) {
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
                __m256 w[4];
                _mm_prefetch((const char *)(wb + k * bits / 8 * QN + Q_PREFETCH), _MM_HINT_T0);
                if (bits == 4) {  // u - 8 for each nibble: exact, as the AVX-512 table and the portable code give
                    __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wb + k / 2 * QN + h * 8)));
                    __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wb + k / 2 * QN + QN + h * 8)));
                    const __m256i lo = _mm256_set1_epi32(15);
                    w[0] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d0, lo)), eight);
                    w[1] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4)), eight);
                    w[2] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d1, lo)), eight);
                    w[3] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4)), eight);
                } else {
                    for (int c = 0; c < 4; c++)
                        w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                            _mm_loadl_epi64((const __m128i *)(wb + (k + c) * QN + h * 8))));
                }
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < 4; c++)
                        acc[r][c] = _mm256_fmadd_ps(w[c], _mm256_set1_ps(x[r * K + k + c]), acc[r][c]);
            }
            const __m256 s = _mm256_loadu_ps(sb + g * QN + h * 8);
            for (int r = 0; r < R; r++)
                tot[r] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                                       _mm256_add_ps(acc[r][2], acc[r][3])), s, tot[r]);
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + h * 8, tot[r]);
    }
}
#define q_tile q_tile_avx2
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

// ---- dense linears (bf16 or fp32 weights) on any CPU -----------------------------------------------------
//
// y[m, n] = sum over k of w[n, k] * x[m, k], with x and w both bf16 or both fp32, in fp32: one accumulator per
// output, k in order from 0, each step a multiply rounded to fp32 and then an add rounded to fp32. IEEE-754
// defines both, so every CPU computes them alike; a fused multiply-add would not be (a CPU without FMA computes
// one in software, slowly). Nothing in the order depends on M, on the rows beside a row, on the thread count or
// on the code path: the AVX-512, AVX2 and portable tiles give every output the same bits (tests build all three
// and compare). Why not oneDNN or MKL: they change their kernel, and with it the order, by the row count, so a
// row's logits moved between a decode (1 row) and a verify (k+1) on CPUs without AMX (issue 27).
//
// Layouts (cpu_kernels.dense_blocks), N padded with zero weights to whole blocks of QN outputs:
//   bf16: uint32 [N/QN, Kp/2, QN], Kp = K rounded up to even: lane j of pair p holds w[n, 2p] in its low half and
//         w[n, 2p+1] in its high one (n = block*QN + j): AMX's B-tile layout, so one layout serves both kernels.
//         A bf16's fp32 value is its bits shifted up 16, so the low one is v << 16 and the high one
//         v & 0xFFFF0000, one op each. A padded input is x = 0 times w = 0.
//   fp32: float [N/QN, K, QN]
// A tile is R rows (up to DM) by NB blocks, its accumulators in registers; every output's chain is its own, so
// which tile shape covers an output never changes its bits.
// A tile prefetches its weights D_PREFETCH bytes ahead: at 3 or more rows the sums take long enough that the
// hardware prefetcher falls behind and the loads stop overlapping them. On a 2-core EPYC, SmolLM2's gate_up at
// 4 rows went from 1.4x the cost of 1 row to 1.0x, and a k=4 verify step from 10.0 to 8.1 ms (4096 beat
// 1024, 2048, 8192 and 16384 there).
#define DNB_MAX 8
#ifndef D_PREFETCH
#define D_PREFETCH 4096
#endif

#if defined(__AVX512F__)
// 32 registers: up to 8 rows a tile, so a k=4 verify's 5 rows pass over the weights once, not as 4 + 1.
#define DM 8
#define DNB1 8
#define DNB2 8
#define DNB3 4
#define DNB4 4
#define DNB5 4
#define DNB6 4
#define DNB7 2
#define DNB8 2
static AI void d_tile_bf16(const int R, const int NB, const uint32_t *w, int64_t bstride, const float *x, int64_t Kp,
                           float out[DM][DNB_MAX][QN]) {
    __m512 acc[DM][DNB_MAX];
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < Kp / 2; p++) {
        for (int b = 0; b < NB; b++) {
            _mm_prefetch((const char *)(w + b * bstride + p * QN) + D_PREFETCH, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void *)(w + b * bstride + p * QN));
            const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            for (int r = 0; r < R; r++) {
                acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(w0, _mm512_set1_ps(x[r * Kp + 2 * p])));
                acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(w1, _mm512_set1_ps(x[r * Kp + 2 * p + 1])));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[r][b], acc[r][b]);
}

static AI void d_tile_f32(const int R, const int NB, const float *w, int64_t bstride, const float *x, int64_t K,
                          float out[DM][DNB_MAX][QN]) {
    __m512 acc[DM][DNB_MAX];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++)
        for (int b = 0; b < NB; b++) {
            _mm_prefetch((const char *)(w + b * bstride + k * QN) + D_PREFETCH, _MM_HINT_T0);
            const __m512 wv = _mm512_loadu_ps(w + b * bstride + k * QN);
            for (int r = 0; r < R; r++)
                acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(wv, _mm512_set1_ps(x[r * K + k])));
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[r][b], acc[r][b]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// Two 8-lane halves per block of QN outputs; 16 registers, so fewer blocks a tile.
#define DM 4
#define DNB1 4
#define DNB2 2
#define DNB3 2
#define DNB4 1
static AI void d_tile_bf16(const int R, const int NB, const uint32_t *w, int64_t bstride, const float *x, int64_t Kp,
                           float out[DM][DNB_MAX][QN]) {
    __m256 acc[DM][DNB_MAX][2];
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < Kp / 2; p++) {
        for (int b = 0; b < NB; b++) {
            _mm_prefetch((const char *)(w + b * bstride + p * QN) + D_PREFETCH, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * bstride + p * QN + h * 8));
                const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
                for (int r = 0; r < R; r++) {
                    acc[r][b][h] = _mm256_add_ps(acc[r][b][h], _mm256_mul_ps(w0, _mm256_set1_ps(x[r * Kp + 2 * p])));
                    acc[r][b][h] = _mm256_add_ps(acc[r][b][h], _mm256_mul_ps(w1, _mm256_set1_ps(x[r * Kp + 2 * p + 1])));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[r][b] + h * 8, acc[r][b][h]);
}

static AI void d_tile_f32(const int R, const int NB, const float *w, int64_t bstride, const float *x, int64_t K,
                          float out[DM][DNB_MAX][QN]) {
    __m256 acc[DM][DNB_MAX][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++)
        for (int b = 0; b < NB; b++) {
            _mm_prefetch((const char *)(w + b * bstride + k * QN) + D_PREFETCH, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                const __m256 wv = _mm256_loadu_ps(w + b * bstride + k * QN + h * 8);
                for (int r = 0; r < R; r++)
                    acc[r][b][h] = _mm256_add_ps(acc[r][b][h], _mm256_mul_ps(wv, _mm256_set1_ps(x[r * K + k])));
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[r][b] + h * 8, acc[r][b][h]);
}
#else
// Plain C: the compiler vectorizes the lanes where it can (SSE2, NEON). The same operations per output.
#define DM 4
#define DNB1 2
#define DNB2 2
#define DNB3 1
#define DNB4 1
static AI void d_tile_bf16(const int R, const int NB, const uint32_t *w, int64_t bstride, const float *x, int64_t Kp,
                           float out[DM][DNB_MAX][QN]) {
    float acc[DM][DNB_MAX][QN] = {{{0}}};
    for (int64_t p = 0; p < Kp / 2; p++)
        for (int b = 0; b < NB; b++) {
            float w0[QN], w1[QN];
            for (int j = 0; j < QN; j++) {
                const uint32_t v = w[b * bstride + p * QN + j], lo = v << 16, hi = v & 0xFFFF0000u;
                memcpy(&w0[j], &lo, sizeof(float));
                memcpy(&w1[j], &hi, sizeof(float));
            }
            for (int r = 0; r < R; r++) {
                const float x0 = x[r * Kp + 2 * p], x1 = x[r * Kp + 2 * p + 1];
                for (int j = 0; j < QN; j++) acc[r][b][j] = acc[r][b][j] + w0[j] * x0;
                for (int j = 0; j < QN; j++) acc[r][b][j] = acc[r][b][j] + w1[j] * x1;
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) memcpy(out[r][b], acc[r][b], sizeof(float) * QN);
}

static AI void d_tile_f32(const int R, const int NB, const float *w, int64_t bstride, const float *x, int64_t K,
                          float out[DM][DNB_MAX][QN]) {
    float acc[DM][DNB_MAX][QN] = {{{0}}};
    for (int64_t k = 0; k < K; k++)
        for (int b = 0; b < NB; b++)
            for (int r = 0; r < R; r++) {
                const float xk = x[r * K + k], *wk = w + b * bstride + k * QN;
                for (int j = 0; j < QN; j++) acc[r][b][j] = acc[r][b][j] + wk[j] * xk;
            }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) memcpy(out[r][b], acc[r][b], sizeof(float) * QN);
}
#endif

// One tile of R rows by NB blocks, from one specialized copy per shape (constants keep the accumulators in
// registers): NB is the path's widest for R rows (DNB<R>) or 1, for what is left of a thread's blocks.
static void d_tile_any(int f32, int R, int NB, const void *w, int64_t bstride, const float *x, int64_t Kp,
                       float out[DM][DNB_MAX][QN]) {
#define D_CASE(RR, NN)                                                                      \
    if (R == RR && NB == NN) {                                                              \
        if (f32)                                                                            \
            d_tile_f32(RR, NN, (const float *)w, bstride, x, Kp, out);                      \
        else                                                                                \
            d_tile_bf16(RR, NN, (const uint32_t *)w, bstride, x, Kp, out);                  \
        return;                                                                             \
    }
    D_CASE(1, DNB1) D_CASE(2, DNB2) D_CASE(3, DNB3) D_CASE(4, DNB4)
#if DNB1 != 1
    D_CASE(1, 1)
#endif
#if DNB2 != 1
    D_CASE(2, 1)
#endif
#if DNB3 != 1
    D_CASE(3, 1)
#endif
#if DNB4 != 1
    D_CASE(4, 1)
#endif
#if DM == 8
    D_CASE(5, DNB5) D_CASE(6, DNB6) D_CASE(7, DNB7) D_CASE(8, DNB8)
    D_CASE(5, 1) D_CASE(6, 1) D_CASE(7, 1) D_CASE(8, 1)
#endif
#undef D_CASE
}

#if DM == 8
static const int d_nb[DM + 1] = {0, DNB1, DNB2, DNB3, DNB4, DNB5, DNB6, DNB7, DNB8};
#else
static const int d_nb[DM + 1] = {0, DNB1, DNB2, DNB3, DNB4};
#endif

// x: [M, K] and w (see above) both bf16 (f32 = 0) or both fp32; y: [M, N], bf16 (rounded once) or fp32. A
// thread takes a contiguous range of blocks, in panels of DNB_MAX blocks (their weights stay in L2 while every
// group of DM rows passes over them). Returns 0, or -1 for shapes it can't take.
int dense_linear(const void *x, int f32, int64_t M, int64_t K, const void *w, int64_t N, void *y, int y_f32,
                 int threads) {
    if (M < 0 || K <= 0 || N <= 0) return -1;
    const int64_t Kp = f32 ? K : (K + 1) / 2 * 2, blocks = (N + QN - 1) / QN;
    const int64_t bstride = f32 ? K * QN : Kp / 2 * QN;  // per block, in elements of w's type
    float *xf = malloc(sizeof(float) * (M * Kp > 0 ? M * Kp : 1));
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++)
            xf[m * Kp + k] = f32 ? ((const float *)x)[m * K + k] : bf2f(((const bf16 *)x)[m * K + k]);
        for (int64_t k = K; k < Kp; k++) xf[m * Kp + k] = 0.0f;
    }
    const size_t wsize = f32 ? sizeof(float) : sizeof(uint32_t);
    int nt = M * N * K >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
        float out[DM][DNB_MAX][QN];
        for (int64_t panel = b0; panel < b1; panel += DNB_MAX) {
            const int64_t pend = b1 - panel < DNB_MAX ? b1 : panel + DNB_MAX;
            for (int64_t m0 = 0; m0 < M; m0 += DM) {
                const int R = M - m0 < DM ? (int)(M - m0) : DM;
                for (int64_t b = panel; b < pend;) {
                    const int NB = pend - b >= d_nb[R] ? d_nb[R] : 1;
                    d_tile_any(f32, R, NB, (const char *)w + b * bstride * wsize, bstride, xf + m0 * Kp, Kp, out);
                    for (int i = 0; i < NB; i++, b++) {
                        const int64_t lanes = N - b * QN < QN ? N - b * QN : QN;
                        for (int r = 0; r < R; r++) {
                            const int64_t at = (m0 + r) * N + b * QN;
                            if (y_f32)
                                memcpy((float *)y + at, out[r][i], sizeof(float) * lanes);
                            else
                                for (int64_t j = 0; j < lanes; j++) ((bf16 *)y)[at + j] = f2bf(out[r][i][j]);
                        }
                    }
                }
            }
        }
    }
    free(xf);
    return 0;
}

const char *kernel_isa(void) { return KERNEL_ISA; }

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

// ---- the per-layer ops, for bf16 and for fp32 storage ---------------------------------------------------

// a projection's kind (cpu_kernels.STACK_KINDS); STACK_MOE: a layer's experts (moe in cpu_kernels_layer.h)
enum { STACK_DENSE = 2, STACK_INT4 = 4, STACK_AMX = 16, STACK_MOE = 32 };
enum { HEAD_NORM_TWICE = 1, HEAD_NORMED_RESIDUAL = 2 };  // head_layer's flags (eagle3.HEAD_FLAGS)
// a MoE description's entries (moe in cpu_kernels_layer.h; moe.SparseMoE.c_plan writes them)
enum { MOE_E, MOE_TOP_K, MOE_NORM, MOE_INTER, MOE_ROUTER, MOE_EXPERTS = MOE_ROUTER + 4 };
// L_Q_NORM, L_K_NORM: per-head q and k norm weights (Qwen3, Gemma 3), 0 for none; L_ATTN_OUT_NORM, L_MLP_OUT_NORM:
// the norms of attention's and the MLP's outputs (Gemma's sandwich), 0 for none; L_WINDOW: the layer's sliding window
// (0 for none), whose rope is the stack's local tables
enum { L_IN_NORM, L_POST_NORM, L_QKV, L_O = L_QKV + 4, L_GU = L_O + 4, L_DOWN = L_GU + 4, L_Q_NORM = L_DOWN + 4, L_K_NORM,
       L_ATTN_OUT_NORM, L_MLP_OUT_NORM, L_WINDOW, LAYER_ENTRIES };
// layers' flags (model.STACK_FLAGS): every norm weight is fp32 (Gemma's 1 + w); the MLP is GeGLU, not SwiGLU
enum { STACK_NORM_F32 = 1, STACK_GELU = 2 };

#define ELT bf16
#define FN(name) name##_bf16
#define LD(v) bf2f(v)
#define ST(f) f2bf(f)
#define RND(f) round_bf(f)
#define IS_F32 0
#include "cpu_kernels_layer.h"
#undef ELT
#undef FN
#undef LD
#undef ST
#undef RND
#undef IS_F32

#define ELT float
#define FN(name) name##_f32
#define LD(v) (v)
#define ST(f) (f)
#define RND(f) (f)
#define IS_F32 1
#include "cpu_kernels_layer.h"
