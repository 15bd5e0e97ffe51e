// The per-layer ops of the CPU forward, on one storage type ELT: included by cpu_kernels.c twice, for bf16
// (FN(name) = name_bf16, LD/ST convert, RND rounds to bf16 as torch's bf16 ops do) and for fp32 (FN(name) =
// name_f32, LD/ST/RND the identity). The math is the same; the bf16 copy rounds where a bf16 model's torch ops
// round, so its results match theirs; the fp32 copy rounds only where fp32 arithmetic does.
//
// Every row (and in attention every query token and head) is computed on its own, in a fixed order: its bits
// don't depend on the batch around it, on how many tokens its forward feeds (a verify's k+1 or a decode's 1),
// or on the other rows' lengths.

// out = w * RND(x * rsqrt(mean(x^2) + eps)), the rounding transformers' LlamaRMSNorm does in bf16; with an fp32
// weight (w32: Gemma's 1 + w), out = w * (x * rsqrt(...)) in fp32, rounded once, as Gemma3RMSNorm does.
// With delta: sum = RND(x + delta) first (the residual add), written to `sum`, and normalised. out may be x.
//
// The sum of squares runs in NORM_LANES fixed chains (element i in chain i mod NORM_LANES), then the chains in
// order: a vectorized reduction (omp simd reduction) sums in whatever order the compiler picks for this loop on
// this ISA, and gcc picked another for the with-delta and the without-delta copies of it, so a row's norm
// moved between the fused residual add and a separate one (EAGLE-3's captured layers take the latter).
static void FN(norm_row)(const ELT *x, const ELT *delta, const void *wv, int w32, float eps, int64_t dim,
                         ELT *sum, ELT *out, float *tmp) {
    for (int64_t i = 0; i < dim; i++) tmp[i] = delta ? RND(LD(x[i]) + LD(delta[i])) : LD(x[i]);
    float lanes[NORM_LANES] = {0}, ss = 0.0f;
    int64_t i = 0;
    for (; i + NORM_LANES <= dim; i += NORM_LANES)
        for (int j = 0; j < NORM_LANES; j++) lanes[j] += tmp[i + j] * tmp[i + j];
    for (int j = 0; i < dim; i++, j++) lanes[j] += tmp[i] * tmp[i];
    for (int j = 0; j < NORM_LANES; j++) ss += lanes[j];
    float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
    if (delta)
        for (int64_t i = 0; i < dim; i++) sum[i] = ST(tmp[i]);
    if (w32) {
        const float *w = wv;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) out[i] = ST(w[i] * (tmp[i] * rstd));
    } else {
        const ELT *w = wv;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) out[i] = ST(LD(w[i]) * RND(tmp[i] * rstd));
    }
}

static void FN(norm_rows)(const ELT *x, const ELT *delta, const void *w, int w32, float eps, int64_t rows,
                          int64_t dim, ELT *sum, ELT *out, int threads) {
    int nt = rows * dim >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *tmp = malloc(sizeof(float) * dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            FN(norm_row)(x + r * dim, delta ? delta + r * dim : NULL, w, w32, eps, dim, sum ? sum + r * dim : NULL,
                         out + r * dim, tmp);
        free(tmp);
    }
}

void FN(rms_norm)(const ELT *x, const ELT *delta, const ELT *w, float eps, int64_t rows, int64_t dim, ELT *sum,
                  ELT *out, int threads) {
    FN(norm_rows)(x, delta, w, 0, eps, rows, dim, sum, out, threads);
}

// RMSNorm with an fp32 weight (Gemma's 1 + w) on rows of ELT.
void FN(rms_norm_w32)(const ELT *x, const ELT *delta, const float *w, float eps, int64_t rows, int64_t dim, ELT *sum,
                      ELT *out, int threads) {
    FN(norm_rows)(x, delta, w, 1, eps, rows, dim, sum, out, threads);
}

// Split into loops through an fp32 buffer: written as one loop, gcc 12 vectorized none of it.
static void FN(silu_row)(const ELT *g, const ELT *u, int64_t n, ELT *o, float *tmp) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = LD(g[i]);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = 1.0f + exp_poly(-tmp[i]);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = ST(RND(LD(g[i]) / tmp[i]) * LD(u[i]));
}

// gate_up: [rows, 2*inter] (gate then up, as the fused projection lays them out) -> out [rows, inter], each row by
// `row` (silu_row, gelu_row) on the threads, with an fp32 scratch row each.
static void FN(glu_mul)(const ELT *gate_up, int64_t rows, int64_t inter, ELT *out, int threads,
                        void (*row)(const ELT *, const ELT *, int64_t, ELT *, float *)) {
    int nt = rows * inter >= PAR_WORK ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *tmp = malloc(sizeof(float) * inter);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter, out + r * inter, tmp);
        free(tmp);
    }
}

// RND(RND(silu(gate)) * up), as F.silu(gate) * up rounds in bf16.
void FN(silu_mul)(const ELT *gate_up, int64_t rows, int64_t inter, ELT *out, int threads) {
    FN(glu_mul)(gate_up, rows, inter, out, threads, FN(silu_row));
}

// GeGLU: gelu(gate) * up with gelu's tanh approximation (torch's gelu(approximate="tanh"), Gemma's
// gelu_pytorch_tanh), 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + e^(-2y)), the
// same function, on exp_poly: RND(RND(gelu(gate)) * up), as torch rounds the two ops in bf16.
static void FN(gelu_row)(const ELT *g, const ELT *u, int64_t n, ELT *o, float *tmp) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float x = LD(g[i]);
        tmp[i] = 1.0f + exp_poly(-1.5957691216057308f * (x + 0.044715f * x * x * x));
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = ST(RND(LD(g[i]) / tmp[i]) * LD(u[i]));
}

void FN(gelu_mul)(const ELT *gate_up, int64_t rows, int64_t inter, ELT *out, int threads) {
    FN(glu_mul)(gate_up, rows, inter, out, threads, FN(gelu_row));
}

// Rotate-half rope on one head, with the rounding of apply_rope in bf16: RND(RND(x*cos) +
// RND(roll(x, D/2)*sin)), where sin's first half carries rotate_half's sign.
static inline void FN(rope_head)(const ELT *x, const ELT *cos, const ELT *sin, int64_t D, float *out) {
    int64_t h = D / 2;
#pragma omp simd
    for (int64_t d = 0; d < h; d++)
        out[d] = RND(RND(LD(x[d]) * LD(cos[d])) + RND(LD(x[d + h]) * LD(sin[d])));
#pragma omp simd
    for (int64_t d = h; d < D; d++)
        out[d] = RND(RND(LD(x[d]) * LD(cos[d])) + RND(LD(x[d - h]) * LD(sin[d])));
}

// qkv: [B, T, H + 2*KV, D], the fused projection's output. cos/sin: [B, T, D]. cache_k/cache_v: one
// layer's block pool [NB, KV, BS, D]. table: [B, MB], each row's blocks in order: position p of row b lives at
// offset p % BS of block table[b, p / BS]. write_pos: [B, T] position of each token, -1 for pads.
// out: [B, T, H, D].
//
// First every token's rotated K and its V go to the cache; then query (b, t) attends positions
// 0..write_pos[b, t] of its row, which is causal order within the forward too. A pad writes nothing and its
// output is zeros (nothing reads it). Scores and softmax in fp32; the weighted sum in fp32, rounded once.
// Where a key lives changes no arithmetic: the bits are those of a contiguous cache.
// Returns 0, or -1 (writing nothing) when a position or a block lies outside the table or the pool: torch's
// indexing would raise there, and a write past the cache would corrupt memory silently.
#define KV_AT(b, pos) (((table[(b) * MB + (pos) / BS] * KV + j) * BS + (pos) % BS) * D)
int FN(rope_attend)(const ELT *qkv, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const ELT *cos,
                    const ELT *sin, ELT *cache_k, ELT *cache_v, int64_t NB, int64_t BS, const int64_t *table,
                    int64_t MB, const int64_t *write_pos, float scale, int64_t window, int threads, ELT *out) {
    const int64_t W = H + 2 * KV, G = H / KV;
    for (int64_t b = 0; b < B; b++) {
        int64_t last = -1;
        for (int64_t t = 0; t < T; t++) {
            int64_t wp = write_pos[b * T + t];
            if (wp < -1 || wp / BS >= MB) return -1;
            if (wp > last) last = wp;
        }
        for (int64_t k = 0; k <= last / BS && last >= 0; k++)  // every block the row reads or writes
            if (table[b * MB + k] < 0 || table[b * MB + k] >= NB) return -1;
    }
    float krot[D];
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const ELT *row = qkv + (b * T + t) * W * D;
            const ELT *c = cos + (b * T + t) * D, *s = sin + (b * T + t) * D;
            int64_t wp = write_pos[b * T + t];
            if (wp < 0) continue;
            for (int64_t j = 0; j < KV; j++) {
                int64_t at = KV_AT(b, wp);
                FN(rope_head)(row + (H + j) * D, c, s, D, krot);
                for (int64_t d = 0; d < D; d++) cache_k[at + d] = ST(krot[d]);
                memcpy(cache_v + at, row + (H + KV + j) * D, sizeof(ELT) * D);
            }
        }
    }
    int64_t max_keys = 0, work = 0;
    for (int64_t i = 0; i < B * T; i++) {
        int64_t n = write_pos[i] + 1;  // 0 for a pad
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
        float *vt = malloc(sizeof(float) * KB * D);  // a block of values in fp32
        float *p = malloc(sizeof(float) * QB * G * (stride ? stride : 1));  // scores, then probabilities
        int64_t *live = malloc(sizeof(int64_t) * QB * G);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * KV * nqb; item++) {
            int64_t b = item / (KV * nqb), j = item / nqb % KV, t0 = item % nqb * QB;
            int64_t nq = T - t0 < QB ? T - t0 : QB, n[QB], nmax = 0;
            for (int64_t tq = 0; tq < nq; tq++) {
                int64_t bt = b * T + t0 + tq;
                n[tq] = write_pos[bt] + 1;
                if (n[tq] > nmax) nmax = n[tq];
                for (int64_t g = 0; g < G && n[tq]; g++)
                    FN(rope_head)(qkv + (bt * W + j * G + g) * D, cos + bt * D, sin + bt * D, D, q + (tq * G + g) * D);
            }
            // The (query, head) rows of this item: (tq, g) as tq * G + g, the ones that attend to anything.
            int64_t nl = 0;
            for (int64_t tq = 0; tq < nq; tq++)
                for (int64_t g = 0; g < G && n[tq]; g++) live[nl++] = tq * G + g;
            // Scores: KB keys at a time, one lane per key, summed over d in order. A score's bits depend
            // only on its query, its key and the key's lane (k mod KB): never on the batch or the block.
            // SR rows at a time, their sums side by side in registers: one row's chain of D dependent adds left
            // the core waiting on their latency (a k=4 verify's five queries cost 3x a decode's one).
            for (int64_t k0 = 0; k0 < nmax; k0 += KB) {
                int64_t kn = nmax - k0 < KB ? nmax - k0 : KB;
                for (int64_t kk = 0; kk < KB; kk++) {
                    const ELT *key = kk < kn ? cache_k + KV_AT(b, k0 + kk) : NULL;
                    for (int64_t d = 0; d < D; d++) kt[d * KB + kk] = key ? LD(key[d]) : 0.0f;
                }
                for (int64_t x0 = 0; x0 < nl; x0 += SR) {
                    const float *qr[SR];
                    int64_t rn = 0;
                    for (int64_t r = 0; r < SR; r++) {  // rows past this block's keys (or past nl) ride along
                        int64_t x = x0 + r < nl ? x0 + r : nl - 1;
                        qr[r] = q + live[x] * D;
                        if (x0 + r < nl && k0 < n[live[x] / G]) rn = r + 1;
                    }
                    if (!rn) continue;
                    float s0[KB] = {0}, s1[KB] = {0}, s2[KB] = {0}, s3[KB] = {0};
                    for (int64_t d = 0; d < D; d++) {
                        const float *restrict kd = kt + d * KB;
                        const float a0 = qr[0][d], a1 = qr[1][d], a2 = qr[2][d], a3 = qr[3][d];
#pragma omp simd
                        for (int64_t kk = 0; kk < KB; kk++) {
                            s0[kk] += a0 * kd[kk];
                            s1[kk] += a1 * kd[kk];
                            s2[kk] += a2 * kd[kk];
                            s3[kk] += a3 * kd[kk];
                        }
                    }
                    const float *sr[SR] = {s0, s1, s2, s3};
                    for (int64_t r = 0; r < rn; r++) {
                        if (k0 >= n[live[x0 + r] / G]) continue;
                        float *pg = p + live[x0 + r] * stride + k0;
                        for (int64_t kk = 0; kk < KB; kk++) pg[kk] = sr[r][kk] * scale;
                    }
                }
            }
            for (int64_t x = 0; x < nl; x++) {
                // A sliding window (window > 0) drops the keys before a token's last `window`: their
                // probabilities are exact zeros, which the weighted sum below adds as nothing.
                int64_t len = n[live[x] / G], lo = window > 0 && len > window ? len - window : 0;
                float *pg = p + live[x] * stride, m = -INFINITY, total = 0.0f;
                for (int64_t k = 0; k < lo; k++) pg[k] = 0.0f;
                pg += lo;
                len -= lo;
#pragma omp simd reduction(max : m)
                for (int64_t k = 0; k < len; k++) m = pg[k] > m ? pg[k] : m;  // a max: the same in any order
#pragma omp simd
                for (int64_t k = 0; k < len; k++) pg[k] = exp_poly(pg[k] - m);
                // Summed in SUM_LANES fixed chains (key k in chain k mod SUM_LANES), then the chains in order: the
                // same sum for a row every time and on every ISA, without waiting on one chain's latency per key.
                float lanes[SUM_LANES] = {0};
                int64_t k = 0;
                for (; k + SUM_LANES <= len; k += SUM_LANES)
                    for (int c = 0; c < SUM_LANES; c++) lanes[c] += pg[k + c];
                for (int c = 0; k < len; k++, c++) lanes[c] += pg[k];
                for (int c = 0; c < SUM_LANES; c++) total += lanes[c];
                float inv = 1.0f / total;
#pragma omp simd
                for (int64_t k = 0; k < len; k++) pg[k] *= inv;
            }
            // The weighted sum: per row and element, p[k] * v[k] added in key order from 0, as one key at a time
            // would; KB values at a time in fp32, each row's sums held in registers DV elements at a time.
            for (int64_t x = 0; x < nq * G * D; x++) acc[x] = 0.0f;
            for (int64_t k0 = 0; k0 < nmax; k0 += KB) {
                int64_t kn = nmax - k0 < KB ? nmax - k0 : KB;
                for (int64_t kk = 0; kk < kn; kk++) {
                    const ELT *val = cache_v + KV_AT(b, k0 + kk);
                    for (int64_t d = 0; d < D; d++) vt[kk * D + d] = LD(val[d]);
                }
                for (int64_t x = 0; x < nl; x++) {
                    int64_t len = n[live[x] / G] - k0, kend = len < kn ? len : kn;
                    const float *pp = p + live[x] * stride + k0;
                    float *ag = acc + live[x] * D;
                    int64_t d0 = 0;
                    for (; d0 + DV <= D; d0 += DV) {
                        float a[DV];
                        for (int64_t i = 0; i < DV; i++) a[i] = ag[d0 + i];
                        for (int64_t kk = 0; kk < kend; kk++) {
                            const float pk = pp[kk], *restrict v = vt + kk * D + d0;
#pragma omp simd
                            for (int64_t i = 0; i < DV; i++) a[i] += pk * v[i];
                        }
                        for (int64_t i = 0; i < DV; i++) ag[d0 + i] = a[i];
                    }
                    for (int64_t kk = 0; kk < kend && d0 < D; kk++)  // a head size not a multiple of DV: the rest
                        for (int64_t d = d0; d < D; d++) ag[d] += pp[kk] * vt[kk * D + d];
                }
            }
            for (int64_t tq = 0; tq < nq; tq++) {
                ELT *o = out + ((b * T + t0 + tq) * H + j * G) * D;
                for (int64_t x = 0; x < G * D; x++) o[x] = n[tq] ? ST(acc[tq * G * D + x]) : 0;
            }
        }
        free(q);
        free(acc);
        free(kt);
        free(vt);
        free(p);
        free(live);
    }
    return 0;
}
#undef KV_AT

// ---- a whole decoder stack in one call ----------------------------------------------------------------
//
// The layer loop of a model whose projections all run here (int4 on quant_linear, bf16 on AMX or on
// dense_linear, fp32 on dense_linear), without biases: the same kernels, in the same order and with the same roundings, as the
// modules call one by one (model.py's DecoderLayer with the fused residual adds), so the bits are the same. It
// saves the Python between them: ~10 calls, their module hops and tensor allocations per layer, which took 8
// of a SmolLM2 INT4 decode step's 18 ms.
//
// x [rows, hidden]: the first layer's input; on return, the residual after the last layer's attention.
// delta: on return, the last layer's MLP output (the caller adds it). table: per layer, the two norms'
// weights, then per projection (qkv, o, gate_up, down) its kind (STACK_*) and the addresses of its weights,
// scales and pre_quant_scale (0 for none), then the per-head q and k norms' weights (0 for none); a layer with
// experts has STACK_MOE and its MoE description (moe above) in place of gate_up's kind and weights. Returns 0; -1
// when a position or block lies outside the table or the pool (nothing is written then); -2 when a projection's
// kernel refuses its shape (the plan checks them, so a bug).

static int FN(stack_linear)(const ELT *x, int64_t rows, int64_t K, const int64_t *lin, int64_t G, int64_t N,
                            ELT *y, int threads) {
    const void *w = (const void *)(intptr_t)lin[1];
    int rc = lin[0] == STACK_AMX     ? (IS_F32 ? -1 : bf16_linear((const bf16 *)x, rows, K, w, N, y, 0, threads))
             : lin[0] == STACK_DENSE ? dense_linear(x, IS_F32, rows, K, w, N, y, IS_F32, threads)
                                     : quant_linear(x, IS_F32, rows, K, (const float *)(intptr_t)lin[3], w,
                                                    (int)lin[0], (const float *)(intptr_t)lin[2], G, N, y, IS_F32,
                                                    threads);
    return rc ? -2 : 0;
}

// ---- a mixture-of-experts MLP in one call ----------------------------------------------------------------------
//
// moe.SparseMoE's forward on these kernels: the router's logits (a projection, ELT out), each row's softmax in fp32
// (exp_poly, summed in SUM_LANES fixed chains), its top_k experts (ties go to the lower index), their probabilities
// renormalized over the top_k where norm_topk_prob (summed in rank order), each rounded to ELT as transformers casts
// them; then expert by expert in index order, the rows that picked it through its gate_up, silu_mul and down, each
// output times its weight (rounded) added to its row (rounded): a row's sum runs in expert order, as transformers'
// index_add_ adds. A row's routing and sum read that row alone and each projection's bits are a row's own whatever
// rows ride along, so a row's output depends on nothing else in the step.
//
// x, out: [rows, hidden]. desc (moe.SparseMoE.c_plan): E, top_k, norm_topk_prob, the experts' intermediate size,
// the router's 4 entries (kind, weights, scales, pre_quant_scale), then per expert its gate_up's 4 and its down's 4.
// Returns 0, or -2 when a projection's kernel refuses its shape (a plan bug).
static void FN(route_row)(const ELT *logits, int64_t E, int64_t K, int norm, float *p, int64_t *pick, float *w) {
    float m = -INFINITY, lanes[SUM_LANES] = {0}, total = 0.0f;
    for (int64_t e = 0; e < E; e++) m = LD(logits[e]) > m ? LD(logits[e]) : m;
    for (int64_t e = 0; e < E; e++) p[e] = exp_poly(LD(logits[e]) - m);
    int64_t e = 0;
    for (; e + SUM_LANES <= E; e += SUM_LANES)
        for (int c = 0; c < SUM_LANES; c++) lanes[c] += p[e + c];
    for (int c = 0; e < E; e++, c++) lanes[c] += p[e];
    for (int c = 0; c < SUM_LANES; c++) total += lanes[c];
    for (int64_t e = 0; e < E; e++) p[e] = p[e] / total;
    float kept = 0.0f;
    for (int64_t s = 0; s < K; s++) {  // the largest not yet taken; a taken one is marked -1 (probabilities are >= 0)
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        for (int64_t e = 0; best < 0 && e < E; e++)  // a row of NaN logits: its lowest untaken experts (and NaN out)
            if (p[e] != -1.0f) best = e;
        pick[s] = best;
        w[s] = p[best];
        kept += p[best];
        p[best] = -1.0f;
    }
    for (int64_t s = 0; s < K; s++) w[s] = RND(norm ? w[s] / kept : w[s]);
}

int FN(moe)(const ELT *x, int64_t rows, int64_t hidden, const int64_t *desc, int64_t G, ELT *out, int threads) {
    const int64_t E = desc[MOE_E], K = desc[MOE_TOP_K], inter = desc[MOE_INTER], n = rows * K > 0 ? rows * K : 1;
    ELT *logits = malloc(sizeof(ELT) * (rows > 0 ? rows : 1) * E);
    int64_t *pick = malloc(sizeof(int64_t) * n), *member = malloc(sizeof(int64_t) * n);
    int64_t *start = calloc(E + 1, sizeof(int64_t)), *active = malloc(sizeof(int64_t) * E);
    float *w = malloc(sizeof(float) * n), *mw = malloc(sizeof(float) * n), *p = malloc(sizeof(float) * E);
    // Each expert's rows side by side: xs (their inputs), gu, act and y, at the expert's start.
    ELT *xs = malloc(sizeof(ELT) * n * hidden), *gu = malloc(sizeof(ELT) * n * 2 * inter);
    ELT *act = malloc(sizeof(ELT) * n * inter), *y = malloc(sizeof(ELT) * n * hidden);
    int rc = FN(stack_linear)(x, rows, hidden, desc + MOE_ROUTER, G, E, logits, threads);
    if (!rc) {
        for (int64_t r = 0; r < rows; r++)
            FN(route_row)(logits + r * E, E, K, (int)desc[MOE_NORM], p, pick + r * K, w + r * K);
        for (int64_t i = 0; i < rows * K; i++) start[pick[i] + 1]++;
        int64_t na = 0;
        for (int64_t e = 0; e < E; e++) {
            if (start[e + 1]) active[na++] = e;
            start[e + 1] += start[e];
        }
        for (int64_t e = 0, at = 0; e < E; e++)  // an expert's rows in row order
            for (int64_t i = 0; i < rows * K; i++)
                if (pick[i] == e) {
                    member[at] = i / K;
                    mw[at] = w[i];
                    memcpy(xs + at++ * hidden, x + i / K * hidden, sizeof(ELT) * hidden);
                }
        // Experts side by side, each on one thread, when there are enough of them for the threads: a decode step's
        // few experts otherwise paid a fork and a join per projection. Either way each projection's bits are a row's
        // own, so how the work is split changes nothing.
        const int outer = threads > 1 && na >= threads, inner = outer ? 1 : threads;
        int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(outer ? threads : 1) reduction(| : failed)
        for (int64_t a = 0; a < na; a++) {
            const int64_t e = active[a], s0 = start[e], m = start[e + 1] - s0;
            const int64_t *ex = desc + MOE_EXPERTS + 8 * e;
            failed |= FN(stack_linear)(xs + s0 * hidden, m, hidden, ex, G, 2 * inter, gu + s0 * 2 * inter, inner) != 0;
            FN(silu_mul)(gu + s0 * 2 * inter, m, inter, act + s0 * inter, inner);
            failed |= FN(stack_linear)(act + s0 * inter, m, inter, ex + 4, G, hidden, y + s0 * hidden, inner) != 0;
        }
        rc = failed ? -2 : 0;
        // Each output times its weight, added to its row expert by expert in index order (transformers' order).
        for (int64_t i = 0; i < rows * hidden; i++) out[i] = ST(0.0f);
        for (int64_t i = 0; i < rows * K && !rc; i++) {
            ELT *o = out + member[i] * hidden;
            const ELT *yi = y + i * hidden;
            for (int64_t h = 0; h < hidden; h++) o[h] = ST(LD(o[h]) + RND(LD(yi[h]) * mw[i]));
        }
    }
    free(logits);
    free(pick);
    free(member);
    free(start);
    free(active);
    free(w);
    free(mw);
    free(p);
    free(xs);
    free(gu);
    free(act);
    free(y);
    return rc;
}

int FN(layers)(ELT *x, ELT *delta, int64_t B, int64_t T, int64_t layers, int64_t hidden, int64_t H, int64_t KV,
               int64_t D, int64_t inter, int64_t G, const int64_t *table, float eps, const ELT *cos, const ELT *sin,
               ELT *cache_k, ELT *cache_v, int64_t NB, int64_t BS, const int64_t *block_table, int64_t MB,
               const int64_t *write_pos, float scale, int threads, int64_t flags, const ELT *cos_local,
               const ELT *sin_local) {
    const int64_t rows = B * T, nqkv = (H + 2 * KV) * D, layer_cache = NB * KV * BS * D;
    const int w32 = (flags & STACK_NORM_F32) != 0;
    ELT *normed = malloc(sizeof(ELT) * rows * hidden), *qkv = malloc(sizeof(ELT) * rows * nqkv);
    ELT *attn = malloc(sizeof(ELT) * rows * H * D), *o = malloc(sizeof(ELT) * rows * hidden);
    ELT *gate_up = malloc(sizeof(ELT) * rows * 2 * inter), *act = malloc(sizeof(ELT) * rows * inter);
    int rc = 0;
#define NORM(w) (const void *)(intptr_t)(w), w32, eps
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *t = table + l * LAYER_ENTRIES;
        // The residual add runs in place: norm_row reads a row whole before it writes the sum.
        FN(norm_rows)(x, l ? delta : NULL, NORM(t[L_IN_NORM]), rows, hidden, l ? x : NULL, normed, threads);
        if ((rc = FN(stack_linear)(normed, rows, hidden, t + L_QKV, G, nqkv, qkv, threads))) break;
        if (t[L_Q_NORM])  // each head of q and of k through its own RMSNorm, in place, before rope (model.py's order)
            for (int64_t r = 0; r < rows; r++) {
                FN(norm_rows)(qkv + r * nqkv, NULL, NORM(t[L_Q_NORM]), H, D, NULL, qkv + r * nqkv, threads);
                FN(norm_rows)(qkv + r * nqkv + H * D, NULL, NORM(t[L_K_NORM]), KV, D, NULL, qkv + r * nqkv + H * D,
                              threads);
            }
        const int local = t[L_WINDOW] > 0 && cos_local;  // a sliding-window layer: its own rope (Gemma 3)
        if (FN(rope_attend)(qkv, B, T, H, KV, D, local ? cos_local : cos, local ? sin_local : sin,
                            cache_k + l * layer_cache, cache_v + l * layer_cache, NB, BS, block_table, MB, write_pos,
                            scale, t[L_WINDOW], threads, attn)) {
            rc = -1;
            break;
        }
        if ((rc = FN(stack_linear)(attn, rows, H * D, t + L_O, G, hidden, o, threads))) break;
        if (t[L_ATTN_OUT_NORM]) FN(norm_rows)(o, NULL, NORM(t[L_ATTN_OUT_NORM]), rows, hidden, NULL, o, threads);
        FN(norm_rows)(x, o, NORM(t[L_POST_NORM]), rows, hidden, x, normed, threads);
        if (t[L_GU] == STACK_MOE) {  // experts: L_GU's second entry is the layer's MoE description
            if ((rc = FN(moe)(normed, rows, hidden, (const int64_t *)(intptr_t)t[L_GU + 1], G, delta, threads))) break;
        } else {
            if ((rc = FN(stack_linear)(normed, rows, hidden, t + L_GU, G, 2 * inter, gate_up, threads))) break;
            if (flags & STACK_GELU)
                FN(gelu_mul)(gate_up, rows, inter, act, threads);
            else
                FN(silu_mul)(gate_up, rows, inter, act, threads);
            if ((rc = FN(stack_linear)(act, rows, inter, t + L_DOWN, G, hidden, delta, threads))) break;
        }
        if (t[L_MLP_OUT_NORM]) FN(norm_rows)(delta, NULL, NORM(t[L_MLP_OUT_NORM]), rows, hidden, NULL, delta, threads);
    }
#undef NORM
    free(normed);
    free(qkv);
    free(attn);
    free(o);
    free(gate_up);
    free(act);
    return rc;
}

// ---- an EAGLE-3 head's decoder layer in one call --------------------------------------------------------------
//
// eagle3.Eagle3Head.forward up to its gather, with the kernels its modules call, in their order and with their
// roundings, so the bits are the modules'. The head's q/k/v read two normed inputs side by side, [input_layernorm(
// emb); hidden_norm(state)], and its residual is the state (HEAD_NORMED_RESIDUAL: the normed state, speculators'
// norm_before_residual); under HEAD_NORM_TWICE (ModelOpt's layout) the state goes through input_layernorm before
// hidden_norm. A drafted token ran ~12 module calls and their allocations, 0.3-0.4 ms of a 0.7 ms head step on a
// 2-core Xeon, against 0.25 ms of kernel time.
//
// emb, state: [rows, dim]. row: the layer's entries in the stack's table layout (L_IN_NORM holds input_layernorm);
// hidden_norm: the second input's norm. out: [rows, dim], the layer's output before the head's final norm.
// flags: HEAD_* (cpu_kernels.c). Returns as layers does.

int FN(head_layer)(const ELT *emb, const ELT *state, ELT *out, int64_t B, int64_t T, int64_t dim, int64_t H,
                   int64_t KV, int64_t D, int64_t inter, int64_t G, const int64_t *row, const ELT *hidden_norm,
                   int64_t flags, float eps, const ELT *cos, const ELT *sin, ELT *cache_k, ELT *cache_v, int64_t NB,
                   int64_t BS, const int64_t *block_table, int64_t MB, const int64_t *write_pos, float scale,
                   int threads) {
    const int64_t rows = B * T, nqkv = (H + 2 * KV) * D;
    const ELT *in_norm = (const ELT *)(intptr_t)row[L_IN_NORM];
    ELT *e = malloc(sizeof(ELT) * rows * dim), *h = malloc(sizeof(ELT) * rows * dim);
    ELT *x2 = malloc(sizeof(ELT) * rows * 2 * dim), *qkv = malloc(sizeof(ELT) * rows * nqkv);
    ELT *attn = malloc(sizeof(ELT) * rows * H * D), *o = malloc(sizeof(ELT) * rows * dim);
    ELT *sum = malloc(sizeof(ELT) * rows * dim), *normed = malloc(sizeof(ELT) * rows * dim);
    ELT *gate_up = malloc(sizeof(ELT) * rows * 2 * inter), *act = malloc(sizeof(ELT) * rows * inter);
    ELT *delta = malloc(sizeof(ELT) * rows * dim);
    int rc = 0;
    FN(rms_norm)(emb, NULL, in_norm, eps, rows, dim, NULL, e, threads);
    if (flags & HEAD_NORM_TWICE) {
        FN(rms_norm)(state, NULL, in_norm, eps, rows, dim, NULL, o, threads);  // o: scratch until the attention
        FN(rms_norm)(o, NULL, hidden_norm, eps, rows, dim, NULL, h, threads);
    } else {
        FN(rms_norm)(state, NULL, hidden_norm, eps, rows, dim, NULL, h, threads);
    }
    for (int64_t r = 0; r < rows; r++) {
        memcpy(x2 + r * 2 * dim, e + r * dim, sizeof(ELT) * dim);
        memcpy(x2 + r * 2 * dim + dim, h + r * dim, sizeof(ELT) * dim);
    }
    if ((rc = FN(stack_linear)(x2, rows, 2 * dim, row + L_QKV, G, nqkv, qkv, threads))) goto done;
    if (FN(rope_attend)(qkv, B, T, H, KV, D, cos, sin, cache_k, cache_v, NB, BS, block_table, MB, write_pos, scale,
                        0, threads, attn)) {
        rc = -1;
        goto done;
    }
    if ((rc = FN(stack_linear)(attn, rows, H * D, row + L_O, G, dim, o, threads))) goto done;
    // sum = residual + attention (one rounding, as torch's add), normed = post_attention_layernorm(sum).
    FN(rms_norm)(flags & HEAD_NORMED_RESIDUAL ? h : state, o, (const ELT *)(intptr_t)row[L_POST_NORM], eps, rows, dim,
                 sum, normed, threads);
    if ((rc = FN(stack_linear)(normed, rows, dim, row + L_GU, G, 2 * inter, gate_up, threads))) goto done;
    FN(silu_mul)(gate_up, rows, inter, act, threads);
    if ((rc = FN(stack_linear)(act, rows, inter, row + L_DOWN, G, dim, delta, threads))) goto done;
    for (int64_t i = 0; i < rows * dim; i++) out[i] = ST(LD(sum[i]) + LD(delta[i]));
done:
    free(e);
    free(h);
    free(x2);
    free(qkv);
    free(attn);
    free(o);
    free(sum);
    free(normed);
    free(gate_up);
    free(act);
    free(delta);
    return rc;
}
