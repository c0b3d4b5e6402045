/* Paged decode attention on the CPU, float32.
 *
 * One query token per sequence attends over its context, whose K/V live in fixed-size blocks named by
 * the sequence's block table. K and V are read once, straight from their blocks: the pure-torch path
 * first gathers every block into a padded copy, about three times the memory traffic of this loop.
 * Per sequence: pass 1 streams each position's K row (all KV heads, contiguous) and scores every query
 * head; then a max-subtracted softmax per head; pass 2 streams each V row and accumulates. Walking
 * positions in the outer loop reads every block front to back once, which measured 25% faster on a
 * cold cache than a loop per KV head (strided reads of a quarter of each row). Sequences are split
 * over the OpenMP threads.
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
    const int64_t G = H / Hkv, row = Hkv * D;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < B; ++b) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *s = (float *)malloc(sizeof(float) * H * max_ctx);
        if (s == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (s == NULL) continue;
            const int64_t ctx = ctx_lens[b];
            const int64_t *table = tables + b * max_blocks;
            const float *qb = q + b * H * D;
            for (int64_t t = 0; t < ctx; ++t) {
                const float *kt = kc + (table[t / bs] * bs + t % bs) * row;
                for (int64_t h = 0; h < H; ++h) {
                    const float *kv = kt + (h / G) * D, *qv = qb + h * D;
                    float acc = 0.f;
                    for (int64_t d = 0; d < D; ++d) acc += qv[d] * kv[d];
                    s[h * max_ctx + t] = acc * scale;
                }
            }
            for (int64_t h = 0; h < H; ++h) {
                float *sh = s + h * max_ctx, mx = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < ctx; ++t) mx = sh[t] > mx ? sh[t] : mx;
                for (int64_t t = 0; t < ctx; ++t) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < ctx; ++t) sh[t] *= inv;
            }
            float *ob = out + b * H * D;
            memset(ob, 0, sizeof(float) * H * D);
            for (int64_t t = 0; t < ctx; ++t) {
                const float *vt = vc + (table[t / bs] * bs + t % bs) * row;
                for (int64_t h = 0; h < H; ++h) {
                    const float p = s[h * max_ctx + t], *vv = vt + (h / G) * D;
                    float *oh = ob + h * D;
                    for (int64_t d = 0; d < D; ++d) oh[d] += p * vv[d];
                }
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
