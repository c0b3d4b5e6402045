/* Paged decode attention on the CPU, float32.
 *
 * One query token per sequence attends over its context, whose K/V live in fixed-size blocks named by
 * the sequence's block table. K and V are read once, straight from their blocks: the pure-torch path
 * first gathers every block into a padded copy, which costs about three times the memory traffic of
 * this loop on a 2-core machine. Scores are computed in a first pass, then max-subtracted softmax, then
 * the weighted sum of V: the same order of operations as a two-pass SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* q: [B, H, D]; kc, vc: [num_blocks * bs, Hkv, D]; tables: [B, max_blocks]; ctx_lens: [B];
 * out: [B, H, D]. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *tables,
                     const int64_t *ctx_lens, float *out, int64_t B, int64_t H, int64_t Hkv,
                     int64_t D, int64_t bs, int64_t max_blocks, float scale, int num_threads) {
    const int64_t G = H / Hkv;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < B; ++b) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
    float *scratch = (float *)malloc(sizeof(float) * G * max_ctx);
    if (scratch == NULL) failed = 1;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        if (scratch == NULL) continue;
        const int64_t ctx = ctx_lens[b];
        const int64_t *table = tables + b * max_blocks;
        for (int64_t kh = 0; kh < Hkv; ++kh) {
            for (int64_t g = 0; g < G; ++g) {
                const float *qv = q + (b * H + kh * G + g) * D;
                float *s = scratch + g * ctx;
                float mx = -INFINITY;
                for (int64_t t = 0; t < ctx; ++t) {
                    const float *kv = kc + ((table[t / bs] * bs + t % bs) * Hkv + kh) * D;
                    float acc = 0.f;
                    for (int64_t d = 0; d < D; ++d) acc += qv[d] * kv[d];
                    s[t] = acc * scale;
                    mx = s[t] > mx ? s[t] : mx;
                }
                float sum = 0.f;
                for (int64_t t = 0; t < ctx; ++t) {
                    s[t] = expf(s[t] - mx);
                    sum += s[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
            }
            float *o = out + (b * H + kh * G) * D;
            memset(o, 0, sizeof(float) * G * D);
            for (int64_t t = 0; t < ctx; ++t) {
                const float *vv = vc + ((table[t / bs] * bs + t % bs) * Hkv + kh) * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float p = scratch[g * ctx + t];
                    float *og = o + g * D;
                    for (int64_t d = 0; d < D; ++d) og[d] += p * vv[d];
                }
            }
        }
    }
    free(scratch);
    }
    return failed ? -1 : 0;
}
