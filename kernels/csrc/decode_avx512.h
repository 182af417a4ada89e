// The paged decode kernel's AVX-512 path: an unquantized float32 or bfloat16 cache, head_dim 64 or 128, and a
// GQA group of 1-8 query heads per KV head (what Llama-family models use).
//
// Why its own path: the portable loops spend most of their time outside the arithmetic. Each q.k score
// ends in a horizontal sum of one vector, and each V row is re-widened and its accumulators reloaded once per
// query head of the group. Here scores are computed 16 keys at a time and folded into one vector of 16 sums
// with four rounds of lane permutes (about a fifth of the shuffles); the V pass keeps the whole group's
// accumulators in registers and widens each cached row once. bf16 q.k products use AVX512-BF16's dot-product
// instruction where the CPU has it (a product of two bf16 values is exact in float; sums are in float).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "convert.h"

#define KVMESH_DECODE_AVX512 1

namespace kvmesh::avx512 {

// How many keys ahead the K and V passes prefetch (their blocks are scattered: the hardware prefetcher cannot
// guess the next one).
constexpr int AHEAD_K = 32, AHEAD_V = 16;

// a's and b's lanes picked by ia and by ib, added: one round of folding 16 vectors into their lane sums.
inline __m512 fold(__m512 a, __m512 b, __m512i ia, __m512i ib) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, ia, b), _mm512_permutex2var_ps(a, ib, b));
}

// Lane j of the result is the sum of v[j]'s 16 lanes. Each round halves the vectors and the lanes each
// key keeps: 16 keys x 16 partial sums, then 8 x (2 keys x 8), 4 x (4 x 4), 2 x (8 x 2), 1 x (16 x 1).
inline __m512 sum16(__m512 (&v)[16]) {
  const __m512i a1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i b1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i a2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i b2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i a3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i b3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i a4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i b4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) x[i] = fold(v[2 * i], v[2 * i + 1], a1, b1);
  for (int i = 0; i < 4; ++i) y[i] = fold(x[2 * i], x[2 * i + 1], a2, b2);
  for (int i = 0; i < 2; ++i) z[i] = fold(y[2 * i], y[2 * i + 1], a3, b3);
  return fold(z[0], z[1], a4, b4);
}

// 16 elements of a cached row, widened to float.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// One query head, kept in registers in the form its dot products take: float lanes, or (AVX512-BF16)
// the bf16 pairs the dot-product instruction multiplies.
template <int D, typename C>
struct Query {
  __m512 f[D / 16];
  explicit Query(const C* q) {
    for (int c = 0; c < D / 16; ++c) f[c] = load16(q + 16 * c);
  }
  inline __m512 dot(const C* k) const {
    __m512 acc = _mm512_mul_ps(f[0], load16(k));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(f[c], load16(k + 16 * c), acc);
    return acc;
  }
};

#if defined(__AVX512BF16__)
template <int D>
struct Query<D, c10::BFloat16> {
  __m512bh pairs[D / 32];
  explicit Query(const c10::BFloat16* q) {
    for (int c = 0; c < D / 32; ++c) pairs[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  }
  inline __m512 dot(const c10::BFloat16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, pairs[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return acc;
  }
};
#endif

// Column chunks of 16 the V pass accumulates at once: as many as keep G x chunks accumulators within 24
// registers, dividing D / 16.
constexpr int chunks_per_pass(int D, int G) {
  int n = D / 16;
  while (n > 1 && G * n > 24) n /= 2;
  return n;
}

// The weighted sum of V rows: out[g] = sum over t of p[g][t] * V[t], the probabilities p in scores[g * len + t],
// V row t at v + rows[t]. Every row is widened once for the whole group, whose accumulators stay in registers.
template <int D, int G, typename C>
void weighted_sum(const C* v, const int64_t* rows, int64_t len, const float* scores, float* out) {
  constexpr int N = chunks_per_pass(D, G), LINES = std::max(1, N * 16 * static_cast<int>(sizeof(C)) / 64);
  for (int c0 = 0; c0 < D / 16; c0 += N) {
    __m512 acc[G][N];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < N; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (t + AHEAD_V < len)
        for (int l = 0; l < LINES; ++l) __builtin_prefetch(v + rows[t + AHEAD_V] + 16 * c0 + l * 64 / sizeof(C));
      __m512 x[N];
      for (int c = 0; c < N; ++c) x[c] = load16(v + rows[t] + 16 * (c0 + c));
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * len + t]);
        for (int c = 0; c < N; ++c) acc[g][c] = _mm512_fmadd_ps(p, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < N; ++c) _mm512_storeu_ps(out + g * D + 16 * (c0 + c), acc[g][c]);
  }
}

// Attention of the G query heads q[G][D] (contiguous) over the keys of one KV head whose K rows start at
// k + rows[t] and V rows at v + rows[t], t in [0, len); rows holds a multiple of 16 entries, the ones past len
// any valid row (read, then ignored). scores: scratch of G * len floats. out: G * D floats.
template <int D, int G, typename C>
void attend(const C* q, const int64_t* rows, const C* k, const C* v, int64_t len, float scale, float* scores,
            float* out) {
  constexpr int LINES = D * static_cast<int>(sizeof(C)) / 64;
  for (int g = 0; g < G; ++g) {
    const Query<D, C> qg(q + g * D);
    float* s = scores + g * len;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
      if (g == 0)
        for (int64_t t = t0 + AHEAD_K; t < std::min(len, t0 + AHEAD_K + 16); ++t)
          for (int l = 0; l < LINES; ++l) __builtin_prefetch(k + rows[t] + l * 64 / sizeof(C));
      __m512 part[16];
      for (int j = 0; j < 16; ++j) part[j] = qg.dot(k + rows[t0 + j]);
      const __m512 sums = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << n) - 1), sums);
    }
    float m = s[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  weighted_sum<D, G, C>(v, rows, len, scores, out);
}

}  // namespace kvmesh::avx512
#endif
