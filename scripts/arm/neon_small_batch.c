// nsd's small-batch kernels mapped to ARM NEON with the dot-product extension (FEAT_DotProd:
// Apple M1 and later, AWS Graviton 2 and later, Ampere Altra), as a standalone file with its
// own correctness test. It is NOT wired into ggml: no ARM build of nsd uses it yet, and no
// ARM speed has been measured. What it shows, compiled for aarch64 and run under QEMU
// (scripts/arm/check_neon.sh), is that the design of scripts/patches/ggml-avx2-small-batch.patch
// carries over: each weight block is read once for up to 16 activation rows, and every row is
// computed by the same instructions in the same order whatever the number of rows beside it,
// so a row of a batch is bitwise the one-row result.
//
// Layouts (ggml's, re-stated so the test can build them from plain blocks):
//   block_q8_0    : fp16 scale d, 32 int8 q; value = d * q. Activations, one row at a time.
//   block_q4_0    : fp16 scale d, 16 bytes; byte j holds element j (low nibble) and element
//                   j + 16 (high nibble); value = d * (nibble - 8).
//   block_q4_0x4  : 4 weight rows' blocks, ggml's 4x8 repacked layout (the one ggml picks on
//                   NEON with dotprod): the 4 scales, then 8 chunks of 8 bytes, chunk i being
//                   bytes (i / 4) * 8 .. + 7 of row i % 4, each byte XOR 0x88 so that a nibble
//                   read as signed 4-bit is (nibble - 8).
//
// Q4_0 kernel, per 4 weight rows and block: the 4 weight vectors are unpacked once into 8
// signed-byte vectors (low nibbles by a left shift of 4, high nibbles by a mask: both 16x the
// value, undone by the fixed-point conversion), then each activation row takes 8 SDOT into two
// accumulators, one pairwise add, one conversion and one fused multiply-add into its own
// float32x4. Read against ggml's one-row NEON kernel for this layout (ggml_gemv_q4_0_4x8_q8_0
// in llama-cpp-python 0.3.36's vendored source), this per-row sequence is the same one, so with
// activations quantized row by row (quantize_row_q8_0, as the one-row step does) a batch row
// should be bitwise ggml's one-token result too; that was read, not run (ggml is not built
// for ARM here).
//
// Q8_0 kernel, per 4 weight rows and block: two SDOT per row pair of 32-byte blocks, exact
// integer sums combined by pairwise adds, then one fused multiply-add per row and block.
//
// Build and run: aarch64-linux-gnu-gcc -O2 -march=armv8.2-a+dotprod -static ... ; qemu-aarch64.

#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_ROWS 16

typedef struct { __fp16 d; int8_t qs[QK]; } block_q8_0;
typedef struct { __fp16 d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { __fp16 d[4]; uint8_t qs[QK * 2]; } block_q4_0x4;

// ---------------------------------------------------------------------------- kernels

// out[m * nc + c] = row m of x (n_rows rows of nb blocks) . weight column c, for all nc
// columns (nc a multiple of 4); w holds nc / 4 groups of nb block_q4_0x4.
static void q4_0x4_small_batch(int nb, int nc, const block_q4_0x4 *w, const block_q8_0 *x,
                               int n_rows, float *out) {
    const uint8x16_t high = vdupq_n_u8(0xF0);
    for (int c = 0; c < nc; c += 4) {
        const block_q4_0x4 *wb = w + (size_t)(c / 4) * nb;
        float32x4_t acc[MAX_ROWS];
        for (int m = 0; m < n_rows; m++) acc[m] = vdupq_n_f32(0.0f);
        for (int b = 0; b < nb; b++) {
            // the weight block, read and unpacked once for every row
            const int8x16_t b0 = vld1q_s8((const int8_t *)wb[b].qs);
            const int8x16_t b1 = vld1q_s8((const int8_t *)wb[b].qs + 16);
            const int8x16_t b2 = vld1q_s8((const int8_t *)wb[b].qs + 32);
            const int8x16_t b3 = vld1q_s8((const int8_t *)wb[b].qs + 48);
            const int8x16_t l0 = vshlq_n_s8(b0, 4), l1 = vshlq_n_s8(b1, 4);
            const int8x16_t l2 = vshlq_n_s8(b2, 4), l3 = vshlq_n_s8(b3, 4);
            const int8x16_t h0 = vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(b0), high));
            const int8x16_t h1 = vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(b1), high));
            const int8x16_t h2 = vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(b2), high));
            const int8x16_t h3 = vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(b3), high));
            const float32x4_t wd = vcvt_f32_f16(vld1_f16(wb[b].d));
            for (int m = 0; m < n_rows; m++) {
                const block_q8_0 *a = x + (size_t)m * nb + b;
                // elements 0-7, 8-15, 16-23, 24-31 of the row, each in both halves
                const int8x16_t a0 = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t *)a->qs));
                const int8x16_t a1 = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t *)a->qs + 1));
                const int8x16_t a2 = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t *)a->qs + 2));
                const int8x16_t a3 = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t *)a->qs + 3));
                int32x4_t r0 = vdupq_n_s32(0), r1 = vdupq_n_s32(0);
                r0 = vdotq_s32(r0, l0, a0);  // rows 0, 1 of the group: elements 0-7
                r1 = vdotq_s32(r1, l1, a0);  // rows 2, 3
                r0 = vdotq_s32(r0, l2, a1);  // elements 8-15
                r1 = vdotq_s32(r1, l3, a1);
                r0 = vdotq_s32(r0, h0, a2);  // elements 16-23
                r1 = vdotq_s32(r1, h1, a2);
                r0 = vdotq_s32(r0, h2, a3);  // elements 24-31
                r1 = vdotq_s32(r1, h3, a3);
                const int32x4_t r = vpaddq_s32(r0, r1);  // one exact sum per weight row
                const float32x4_t d = vmulq_f32(vdupq_n_f32((float)a->d), wd);
                acc[m] = vfmaq_f32(acc[m], vcvtq_n_f32_s32(r, 4), d);  // /16: the nibbles' shift
            }
        }
        for (int m = 0; m < n_rows; m++) vst1q_f32(out + (size_t)m * nc + c, acc[m]);
    }
}

// The same for Q8_0 weights: w holds nc rows of nb block_q8_0.
static void q8_0_small_batch(int nb, int nc, const block_q8_0 *w, const block_q8_0 *x,
                             int n_rows, float *out) {
    for (int c = 0; c < nc; c += 4) {
        float32x4_t acc[MAX_ROWS];
        for (int m = 0; m < n_rows; m++) acc[m] = vdupq_n_f32(0.0f);
        for (int b = 0; b < nb; b++) {
            int8x16_t wl[4], wh[4];
            float wd[4];
            for (int j = 0; j < 4; j++) {  // 4 weight rows' blocks, read once for every row
                const block_q8_0 *wj = w + (size_t)(c + j) * nb + b;
                wl[j] = vld1q_s8(wj->qs);
                wh[j] = vld1q_s8(wj->qs + 16);
                wd[j] = (float)wj->d;
            }
            const float32x4_t wdv = vld1q_f32(wd);
            for (int m = 0; m < n_rows; m++) {
                const block_q8_0 *a = x + (size_t)m * nb + b;
                const int8x16_t al = vld1q_s8(a->qs), ah = vld1q_s8(a->qs + 16);
                int32x4_t s[4];
                for (int j = 0; j < 4; j++) s[j] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), wl[j], al), wh[j], ah);
                const int32x4_t r = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]));
                acc[m] = vfmaq_f32(acc[m], vcvtq_f32_s32(r), vmulq_f32(vdupq_n_f32((float)a->d), wdv));
            }
        }
        for (int m = 0; m < n_rows; m++) vst1q_f32(out + (size_t)m * nc + c, acc[m]);
    }
}

// ---------------------------------------------------------------------------- test harness

static uint64_t rng = 0x9E3779B97F4A7C15ULL;  // fixed seed: the test is deterministic
static float uniform(void) {  // xorshift64*, in [-1, 1)
    rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
    return (float)((rng * 2685821657736338717ULL) >> 40) / (float)(1 << 23) - 1.0f;
}

static void quantize_q8_0(const float *v, block_q8_0 *y, int nb) {  // row by row, as ggml does
    for (int b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[b * QK + i]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = (__fp16)d;
        for (int i = 0; i < QK; i++) y[b].qs[i] = (int8_t)lrintf(v[b * QK + i] * id);
    }
}

static void random_q4_0(block_q4_0 *w, int n) {
    for (int i = 0; i < n; i++) {
        w[i].d = (__fp16)(0.01f + 0.02f * fabsf(uniform()));
        for (int j = 0; j < QK / 2; j++) {
            uniform();
            w[i].qs[j] = (uint8_t)(rng >> 17);
        }
    }
}

// ggml's 4x8 repacking of 4 rows' blocks (see the layout notes at the top)
static block_q4_0x4 repack_4x8(const block_q4_0 *in[4]) {
    block_q4_0x4 out;
    for (int r = 0; r < 4; r++) out.d[r] = in[r]->d;
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 8; k++) out.qs[i * 8 + k] = in[i % 4]->qs[(i / 4) * 8 + k] ^ 0x88;
    return out;
}

static int q4_element(const block_q4_0 *b, int i) {
    return (i < 16 ? b->qs[i] & 0x0F : b->qs[i - 16] >> 4) - 8;
}

// One output in plain C, in the kernels' order: per block an exact integer sum, then one
// fused multiply-add by the product of the two scales. halves = 1 sums the first and the
// second half of the blocks apart and adds them at the end: the same terms in another order.
static float scalar_dot(int kind, const block_q4_0 *w4, const block_q8_0 *w8, const block_q8_0 *a,
                        int nb, int halves) {
    float acc[2] = {0.0f, 0.0f};
    for (int b = 0; b < nb; b++) {
        int isum = 0;
        for (int i = 0; i < QK; i++)
            isum += (kind ? w8[b].qs[i] : q4_element(&w4[b], i)) * a[b].qs[i];
        const float d = (float)a[b].d * (float)(kind ? w8[b].d : w4[b].d);
        float *into = &acc[halves && b >= nb / 2];
        *into = fmaf((float)isum, d, *into);
    }
    return halves ? acc[0] + acc[1] : acc[0];
}

int main(void) {
    enum { NB = 8, NC = 24, K = NB * QK };
    static block_q4_0 w4[NC * NB];
    static block_q4_0x4 w4x4[NC / 4 * NB];
    static block_q8_0 w8[NC * NB], x[MAX_ROWS * NB];
    static float xf[MAX_ROWS * K], out[MAX_ROWS * NC], one[NC];
    int failures = 0, reordered_differ = 0;

    random_q4_0(w4, NC * NB);
    for (int g = 0; g < NC / 4; g++)
        for (int b = 0; b < NB; b++) {
            const block_q4_0 *rows[4] = {&w4[(g * 4 + 0) * NB + b], &w4[(g * 4 + 1) * NB + b],
                                         &w4[(g * 4 + 2) * NB + b], &w4[(g * 4 + 3) * NB + b]};
            w4x4[g * NB + b] = repack_4x8(rows);
        }
    for (int c = 0; c < NC; c++) {
        float row[K];
        for (int i = 0; i < K; i++) row[i] = uniform();
        quantize_q8_0(row, &w8[c * NB], NB);
    }
    for (int i = 0; i < MAX_ROWS * K; i++) xf[i] = uniform();
    for (int m = 0; m < MAX_ROWS; m++) quantize_q8_0(&xf[m * K], &x[m * NB], NB);

    for (int kind = 0; kind < 2; kind++) {
        const char *name = kind ? "q8_0" : "q4_0x4";
        double worst = 0.0;
        const int failures_before = failures;
        for (int n = 1; n <= MAX_ROWS; n++) {
            if (kind) q8_0_small_batch(NB, NC, w8, x, n, out);
            else q4_0x4_small_batch(NB, NC, w4x4, x, n, out);
            for (int m = 0; m < n; m++) {
                // the row alone (a one-row call on its own activations)
                if (kind) q8_0_small_batch(NB, NC, w8, &x[m * NB], 1, one);
                else q4_0x4_small_batch(NB, NC, w4x4, &x[m * NB], 1, one);
                if (memcmp(one, &out[m * NC], sizeof one) != 0) {
                    printf("FAIL %s: row %d of a batch of %d differs from the row alone\n", name, m, n);
                    failures++;
                }
                // the kernels' order in plain C: bitwise the same (this checks the layout,
                // the nibble signs and the scales, built here from the plain blocks); and the
                // exact product of the dequantized values, in double, within rounding
                for (int c = 0; c < NC; c++) {
                    const float want = scalar_dot(kind, &w4[c * NB], &w8[c * NB], &x[m * NB], NB, 0);
                    if (memcmp(&want, &out[m * NC + c], sizeof want) != 0) {
                        printf("FAIL %s: row %d column %d of a batch of %d: %.9g, plain C %.9g\n",
                               name, m, c, n, out[m * NC + c], want);
                        failures++;
                    }
                    reordered_differ += n == MAX_ROWS &&
                        scalar_dot(kind, &w4[c * NB], &w8[c * NB], &x[m * NB], NB, 1) != want;
                    double s = 0.0, mag = 0.0;
                    for (int b = 0; b < NB; b++) {
                        const block_q8_0 *a = &x[m * NB + b];
                        for (int i = 0; i < QK; i++) {
                            const double wv = kind ? (double)w8[c * NB + b].d * w8[c * NB + b].qs[i]
                                                   : (double)w4[c * NB + b].d * q4_element(&w4[c * NB + b], i);
                            const double term = wv * (double)a->d * a->qs[i];
                            s += term;
                            mag += fabs(term);
                        }
                    }
                    const double err = fabs((double)out[m * NC + c] - s) / (mag > 0 ? mag : 1.0);
                    if (err > worst) worst = err;
                }
            }
        }
        // float32 accumulation over NB blocks: a few ulps of the sum of magnitudes at most
        if (worst > 1e-6) {
            printf("FAIL %s: relative error %.3g against the exact product\n", name, worst);
            failures++;
        }
        if (failures == failures_before)
            printf("%s: rows of batches of 1..%d bitwise equal to the row alone and to plain C; "
                   "error %.2g of |terms|\n", name, MAX_ROWS, worst);
    }
    // The bitwise checks have teeth: the same terms summed in another order (two halves of
    // the blocks) change some outputs in their last bits.
    if (reordered_differ == 0) {
        printf("FAIL: summing in another order changed no output: the bitwise checks see nothing\n");
        failures++;
    }
    printf("another order of the same sums changes %d of %d outputs\n", reordered_differ, 2 * NC * MAX_ROWS);
    if (failures) return 1;
    printf("ok\n");
    return 0;
}
