/* Probe: is ggml's Q4_1 x Q8_1 dot product on AVX2 the limit of batched decode on this CPU?
 *
 * ggml (llama.cpp in llama-cpp-python 0.3.36) multiplies a Q4_1 matrix by a batch of activation
 * columns by calling ggml_vec_dot_q4_1_q8_1 once per (weight row, column): on x86 it has no
 * multi-column Q4_1 kernel (no llamafile sgemm case, no repacked layout), so 8 columns cost 8 dot
 * products. This probe times, on one 1536 x 576 Q4_1 matrix (SmolLM2-135M's FFN up/gate shape)
 * and 8 Q8_1 columns of random data:
 *   lib_1col  the library's exported ggml_vec_dot_q4_1_q8_1, one column (a decode step of 1);
 *   lib_8col  the same for 8 columns, as ggml calls it for a step of 8;
 *   copy_8col a verbatim copy of that AVX2 kernel compiled here (to show the compile flags alone
 *             change nothing: build it with -march=native too);
 *   multi_8col a kernel that unpacks each weight block once for 8 columns and keeps 8 independent
 *             accumulators, doing for every (row, column) exactly the library's arithmetic in the
 *             library's order, so each result is bit-identical (checked).
 * Prints ns per (row, column) pair and the speedups.
 *
 * Build and run (from the repository root; LIB is llama-cpp-python's lib folder):
 *   LIB=$(python -c "import llama_cpp,os;print(os.path.dirname(llama_cpp.__file__)+'/lib')")
 *   gcc -O3 -mavx -mavx2 -mfma -mf16c -mbmi2 bench/q4_1_kernel_probe.c -o /tmp/q41probe \
 *       -L$LIB -lggml-cpu -lggml-base -Wl,-rpath,$LIB && /tmp/q41probe
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef uint16_t ggml_half;
typedef struct { ggml_half d; ggml_half m; uint8_t qs[16]; } block_q4_1;
typedef struct { ggml_half d; ggml_half s; int8_t qs[32]; } block_q8_1;

void ggml_vec_dot_q4_1_q8_1(int n, float *s, size_t bs, const void *vx, size_t bx, const void *vy,
                            size_t by, int nrc);
void ggml_cpu_init(void);

#define K 576
#define NB (K / 32)
#define ROWS 1536
#define COLS 8

static inline float h2f(ggml_half h) { return _cvtsh_ss(h); }

/* The library's AVX2 helpers (ggml-cpu/arch/x86/quants.c, the __AVX2__ branch), verbatim. */
#define MM256_SET_M128I(a, b) _mm256_insertf128_si256(_mm256_castsi128_si256(b), (a), 1)
static inline __m256i bytes_from_nibbles_32(const uint8_t *rsi) {
    const __m128i tmp = _mm_loadu_si128((const __m128i *)rsi);
    const __m256i bytes = MM256_SET_M128I(_mm_srli_epi16(tmp, 4), tmp);
    const __m256i lowMask = _mm256_set1_epi8(0xF);
    return _mm256_and_si256(lowMask, bytes);
}
static inline __m256 sum_i16_pairs_float(const __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i summed_pairs = _mm256_madd_epi16(ones, x);
    return _mm256_cvtepi32_ps(summed_pairs);
}
static inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
    const __m256i dot = _mm256_maddubs_epi16(ax, sy);
    return sum_i16_pairs_float(dot);
}
static inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

/* A verbatim copy of the library's AVX2 ggml_vec_dot_q4_1_q8_1 body. */
static void copy_dot(int n, float *s, const block_q4_1 *x, const block_q8_1 *y) {
    const int nb = n / 32;
    __m256 acc = _mm256_setzero_ps();
    float summs = 0;
    for (int ib = 0; ib < nb; ++ib) {
        const float d0 = h2f(x[ib].d);
        const float d1 = h2f(y[ib].d);
        summs += h2f(x[ib].m) * h2f(y[ib].s);
        const __m256 d0v = _mm256_set1_ps(d0);
        const __m256 d1v = _mm256_set1_ps(d1);
        const __m256 d0d1 = _mm256_mul_ps(d0v, d1v);
        const __m256i qx = bytes_from_nibbles_32(x[ib].qs);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[ib].qs);
        const __m256 xy = mul_sum_us8_pairs_float(qx, qy);
        acc = _mm256_fmadd_ps(d0d1, xy, acc);
    }
    *s = hsum_float_8(acc) + summs;
}

/* One weight row against 8 columns: each block unpacked once; 8 independent accumulator chains.
 * Per (row, column) the operations and their order are the library's. */
static void multi_dot8(int n, float *s, const block_q4_1 *x, const block_q8_1 *const *y) {
    const int nb = n / 32;
    __m256 acc[COLS];
    float summs[COLS];
    for (int c = 0; c < COLS; ++c) { acc[c] = _mm256_setzero_ps(); summs[c] = 0; }
    for (int ib = 0; ib < nb; ++ib) {
        const float d0 = h2f(x[ib].d);
        const float m0 = h2f(x[ib].m);
        const __m256 d0v = _mm256_set1_ps(d0);
        const __m256i qx = bytes_from_nibbles_32(x[ib].qs);
        for (int c = 0; c < COLS; ++c) {
            const block_q8_1 *yb = &y[c][ib];
            summs[c] += m0 * h2f(yb->s);
            const __m256 d0d1 = _mm256_mul_ps(d0v, _mm256_set1_ps(h2f(yb->d)));
            const __m256i qy = _mm256_loadu_si256((const __m256i *)yb->qs);
            acc[c] = _mm256_fmadd_ps(d0d1, mul_sum_us8_pairs_float(qx, qy), acc[c]);
        }
    }
    for (int c = 0; c < COLS; ++c) s[c] = hsum_float_8(acc[c]) + summs[c];
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static ggml_half f2h(float f) { return _cvtss_sh(f, 0); }

int main(void) {
    ggml_cpu_init();
    srand(1);
    block_q4_1 *w = aligned_alloc(64, sizeof(block_q4_1) * ROWS * NB);
    block_q8_1 *a = aligned_alloc(64, sizeof(block_q8_1) * COLS * NB);
    for (int i = 0; i < ROWS * NB; ++i) {
        w[i].d = f2h(0.001f + (rand() % 1000) * 1e-5f);
        w[i].m = f2h(-0.05f + (rand() % 1000) * 1e-4f);
        for (int j = 0; j < 16; ++j) w[i].qs[j] = rand() & 0xFF;
    }
    for (int i = 0; i < COLS * NB; ++i) {
        float d = 0.01f + (rand() % 1000) * 1e-4f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) { a[i].qs[j] = (int8_t)(rand() % 255 - 127); sum += a[i].qs[j]; }
        a[i].d = f2h(d);
        a[i].s = f2h(d * sum);
    }
    const block_q8_1 *cols[COLS];
    for (int c = 0; c < COLS; ++c) cols[c] = a + c * NB;
    static float r_lib[ROWS][COLS], r_copy[ROWS][COLS], r_multi[ROWS][COLS];
    const int reps = 300;
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int t = 0; t < 5; ++t) {
        double t0 = now();
        for (int k = 0; k < reps; ++k)
            for (int r = 0; r < ROWS; ++r)
                ggml_vec_dot_q4_1_q8_1(K, &r_lib[r][0], 0, w + r * NB, 0, cols[0], 0, 1);
        double t1 = now();
        for (int k = 0; k < reps; ++k)
            for (int r = 0; r < ROWS; ++r)  /* ggml's order: a block of rows per column */
                for (int c = 0; c < COLS; ++c)
                    ggml_vec_dot_q4_1_q8_1(K, &r_lib[r][c], 0, w + r * NB, 0, cols[c], 0, 1);
        double t2 = now();
        for (int k = 0; k < reps; ++k)
            for (int r = 0; r < ROWS; ++r)
                for (int c = 0; c < COLS; ++c) copy_dot(K, &r_copy[r][c], w + r * NB, cols[c]);
        double t3 = now();
        for (int k = 0; k < reps; ++k)
            for (int r = 0; r < ROWS; ++r) multi_dot8(K, r_multi[r], w + r * NB, cols);
        double t4 = now();
        double d[4] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3};
        for (int i = 0; i < 4; ++i) if (d[i] < best[i]) best[i] = d[i];
    }
    int same_copy = memcmp(r_lib, r_copy, sizeof r_lib) == 0;
    int same_multi = memcmp(r_lib, r_multi, sizeof r_lib) == 0;
    double pairs1 = (double)reps * ROWS, pairs8 = pairs1 * COLS;
    double ns1 = best[0] / pairs1 * 1e9, ns8 = best[1] / pairs8 * 1e9;
    double nsc = best[2] / pairs8 * 1e9, nsm = best[3] / pairs8 * 1e9;
    printf("{\"k\": %d, \"rows\": %d, \"ns_per_pair\": {\"lib_1col\": %.1f, \"lib_8col\": %.1f, "
           "\"copy_8col\": %.1f, \"multi_8col\": %.1f}, \"gmac_s\": {\"lib_1col\": %.2f, "
           "\"lib_8col\": %.2f, \"multi_8col\": %.2f}, \"step8_over_step1\": {\"lib\": %.2f, "
           "\"multi\": %.2f}, \"bit_identical\": {\"copy\": %s, \"multi\": %s}}\n",
           K, ROWS, ns1, ns8, nsc, nsm, K / ns1, K / ns8, K / nsm, 8 * ns8 / ns1, 8 * nsm / ns1,
           same_copy ? "true" : "false", same_multi ? "true" : "false");
    return 0;
}
