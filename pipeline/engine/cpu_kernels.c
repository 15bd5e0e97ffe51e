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

static inline float bf2f(bf16 h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

// Round to nearest even, NaN to the canonical NaN: c10::BFloat16's rounding, so an elementwise
// result here has the same bits as torch's bf16 op that rounds once.
static inline bf16 f2bf(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if (f != f) return 0x7FC0;
    return (bf16)((v.u + (((v.u >> 16) & 1) + 0x7FFF)) >> 16);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

// Parallel only past this many element-operations: a parallel region costs a few microseconds,
// more than a decode step's norm or SiLU takes on one core.
#define PAR_WORK 65536

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

// gate_up: [rows, 2*inter] (gate then up, as the fused projection lays them out) -> out [rows, inter]:
// bf16(bf16(silu(gate)) * up), as F.silu(gate) * up rounds in bf16.
void silu_mul_bf16(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out, int threads) {
    int nt = rows * inter >= PAR_WORK ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = gate_up + r * 2 * inter, *u = g + inter;
        bf16 *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float x = bf2f(g[i]);
            o[i] = f2bf(round_bf(x / (1.0f + expf(-x))) * bf2f(u[i]));
        }
    }
}

// Rotate-half rope on one head, with the rounding of apply_rope in bf16: bf16(bf16(x*cos) +
// bf16(roll(x, D/2)*sin)), where sin's first half carries rotate_half's sign.
static inline void rope_head(const bf16 *x, const bf16 *cos, const bf16 *sin, int64_t D, float *out) {
    int64_t h = D / 2;
    for (int64_t d = 0; d < D; d++) {
        float r = bf2f(x[d < h ? d + h : d - h]);
        out[d] = round_bf(round_bf(bf2f(x[d]) * bf2f(cos[d])) + round_bf(r * bf2f(sin[d])));
    }
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
    int nt = work * H * D >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *q = malloc(sizeof(float) * (G * D + G * D + G * (max_keys + 1)));
        float *acc = q + G * D, *p = acc + G * D;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * T * KV; item++) {
            int64_t bt = item / KV, j = item % KV, b = bt / T;
            int64_t wp = write_pos[bt];
            bf16 *o = out + (bt * H + j * G) * D;
            if (wp == trash) {
                memset(o, 0, sizeof(bf16) * G * D);
                continue;
            }
            int64_t n = wp + 1;
            const bf16 *row = qkv + bt * W * D;
            for (int64_t g = 0; g < G; g++) rope_head(row + (j * G + g) * D, cos + bt * D, sin + bt * D, D, q + g * D);
            const bf16 *keys = cache_k + (slots[b] * KV + j) * P * D;
            const bf16 *vals = cache_v + (slots[b] * KV + j) * P * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float *pg = p + g * n, m = -INFINITY;
                for (int64_t k = 0; k < n; k++) {
                    const bf16 *kk = keys + k * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * bf2f(kk[d]);
                    pg[k] = dot * scale;
                    if (pg[k] > m) m = pg[k];
                }
                float total = 0.0f;
                for (int64_t k = 0; k < n; k++) {
                    pg[k] = expf(pg[k] - m);
                    total += pg[k];
                }
                float inv = 1.0f / total;
                for (int64_t k = 0; k < n; k++) pg[k] *= inv;
            }
            for (int64_t x = 0; x < G * D; x++) acc[x] = 0.0f;
            for (int64_t k = 0; k < n; k++) {
                const bf16 *vk = vals + k * D;
                for (int64_t g = 0; g < G; g++) {
                    float pk = p[g * n + k];
                    float *ag = acc + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] += pk * bf2f(vk[d]);
                }
            }
            for (int64_t x = 0; x < G * D; x++) o[x] = f2bf(acc[x]);
        }
        free(q);
    }
    return 0;
}
