// Attention for a few queries per row over a cache of grouped key/value heads, on CPU: the verify forwards' shape.
//
// out[b, h, l] = softmax(scale * q[b, h, l] . k[b, h / G, s] + mask[b, 0, l, s]) over s, times v[b, h / G, s]
//
// A verify step asks for 1-6 queries per row against hundreds of cached keys; torch's CPU flash kernel is built for
// blocks of queries and reads the cache slowly in that case (8 rows x 300 keys: ~0.3-0.7 ms a layer in fp32, and a
// slow path for one bf16 query: 2.4 ms). Here the G query heads sharing a key/value head and the L queries of a row
// are one block of G * L query rows that reads each key and value once, in order: scores as a small GEMM (blocks of 8
// keys transposed in registers, up to BLOCK_ROWS query rows a pass, fp32 sums; the last S % 8 keys one dot product
// each), the mask added, a softmax per query row, then the values weighted. Keys a mask sets to the dtype's minimum
// (a tree's other branches, holes, padding) get exactly zero weight, as in SDPA. Sums are fp32 in a fixed order, so
// results differ from SDPA's by float rounding only. fp32 or bf16 inputs (bf16 widened to fp32 in registers, the
// output rounded back); the key and value heads may be views with any strides but a contiguous last dimension (a
// cache with room to grow); AVX2 + FMA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// e^x for x <= 0 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp), exactly 0 below -87
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)), zero_below);
}

constexpr int MAX_DIM = 256;   // head dimension at most
constexpr int BLOCK_ROWS = 6;  // query rows per pass over a block of keys (2 x 6 accumulators + 3 ymm of 16)
constexpr int64_t PARALLEL_WORK = 1 << 21;  // multiply-adds a thread's chunk of heads holds at least

// 8 x 8 floats transposed in registers: r[i][j] becomes r[j][i]
__attribute__((target("avx2,fma"))) inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// scores[r0 + i, s0 .. s0 + 8] for ROWS query rows (q [R, D]) against a transposed block of 8 keys (kt [D, 8]):
// the even and odd coordinates summed apart (two chains a row hide the FMA latency), then added
template <int ROWS>
__attribute__((target("avx2,fma"))) inline void block_scores(const float* q, const float* kt, float* scores,
                                                             int64_t r0, int64_t s0, int64_t S, int64_t D) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m256 even = _mm256_load_ps(kt + d * 8), odd = _mm256_load_ps(kt + (d + 1) * 8);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const float* qi = q + (r0 + i) * D + d;
      acc[i][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(qi), even, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(qi + 1), odd, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) _mm256_storeu_ps(scores + (r0 + i) * S + s0, _mm256_add_ps(acc[i][0], acc[i][1]));
}

// one row's softmax in place (n scores, fp32): max, e^(x - max), normalized
__attribute__((target("avx2,fma"))) void softmax_row(float* x, int64_t n) {
  float top = -INFINITY;
  for (int64_t s = 0; s < n; ++s) top = std::max(top, x[s]);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 vsum = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + s), vtop));
    _mm256_storeu_ps(x + s, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; s < n; ++s) {
    const float d = x[s] - top;
    x[s] = d > -87.0f ? std::exp(d) : 0.0f;
    sum += x[s];
  }
  const float inv = 1.0f / sum;
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

// one (row, key/value head): Q [R, D] fp32 (pre-scaled, R = G * L, row r = g * L + l), keys / values [S, D] at
// stride kv_stride, mask [L, S] at stride mask_stride (or null) -> out rows [R, D] fp32
template <typename T>
__attribute__((target("avx2,fma"))) void attend(const float* q, const T* k, const T* v, int64_t kv_stride,
                                                const float* mask, int64_t mask_stride, float* scores, float* out,
                                                int64_t R, int64_t L, int64_t S, int64_t D) {
  alignas(32) float kt[MAX_DIM * 8];  // a block of 8 keys, transposed: kt[d * 8 + i] = key i's coordinate d
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {  // whole blocks of 8 keys: a small GEMM of the query rows by the block
    for (int64_t c = 0; c < D; c += 8) {
      __m256 rows[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) rows[i] = load8(k + (s + i) * kv_stride + c);
      transpose8(rows);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_store_ps(kt + (c + j) * 8, rows[j]);
    }
    for (int64_t r0 = 0; r0 < R; r0 += BLOCK_ROWS) {
      switch (std::min<int64_t>(BLOCK_ROWS, R - r0)) {
        case 6: block_scores<6>(q, kt, scores, r0, s, S, D); break;
        case 5: block_scores<5>(q, kt, scores, r0, s, S, D); break;
        case 4: block_scores<4>(q, kt, scores, r0, s, S, D); break;
        case 3: block_scores<3>(q, kt, scores, r0, s, S, D); break;
        case 2: block_scores<2>(q, kt, scores, r0, s, S, D); break;
        default: block_scores<1>(q, kt, scores, r0, s, S, D); break;
      }
    }
  }
  for (; s < S; ++s) {  // the last keys, one dot product each
    const T* ks = k + s * kv_stride;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qr), load8(ks));
      __m256 a1 = _mm256_setzero_ps();
      int64_t d = 8;
      for (; d + 16 <= D; d += 16) {
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(ks + d), a1);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d + 8), load8(ks + d + 8), a0);
      }
      if (d < D) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(ks + d), a1);
      scores[r * S + s] = hsum(_mm256_add_ps(a0, a1));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * S;
    if (mask != nullptr) {
      const float* m = mask + (r % L) * mask_stride;
      for (int64_t s = 0; s < S; ++s) row[s] += m[s];
    }
    softmax_row(row, S);
  }
  for (int64_t i = 0; i < R * D; ++i) out[i] = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const T* vs = v + s * kv_stride;
    for (int64_t r = 0; r < R; ++r) {
      const float p = scores[r * S + s];
      if (p == 0.0f) continue;
      const __m256 pb = _mm256_set1_ps(p);
      float* o = out + r * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pb, load8(vs + d), _mm256_loadu_ps(o + d)));
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
         double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), Hk = k.size(1), S = k.size(2);
  const int64_t G = H / Hk, R = G * L;
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // key/value heads shared by torch's threads in chunks of at least PARALLEL_WORK multiply-adds (a parallel region
  // costs 15-50 us: one row's few queries run on the calling thread); each head's sums stay one thread's
  const int64_t grain = std::max<int64_t>(1, PARALLEL_WORK / std::max<int64_t>(1, 2 * R * S * D));
  at::parallel_for(0, B * Hk, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(R * D), scores(R * S);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hk, h = bh % Hk;
      const float* qrows = qp + (b * H + h * G) * L * D;  // G heads x L queries, contiguous
      for (int64_t i = 0; i < R * D; ++i) qs[i] = static_cast<float>(qrows[i] * scale);
      const float* m = mp == nullptr ? nullptr : mp + (mask.size(0) == 1 ? 0 : b * mask.stride(0));
      attend<T>(qs.data(), kp + b * k.stride(0) + h * k.stride(1), vp + b * v.stride(0) + h * v.stride(1),
                k.stride(2), m, mask.defined() ? mask.stride(2) : 0, scores.data(), op + (b * H + h * G) * L * D, R, L,
                S, D);
    }
  });
}

}  // namespace

// q [B, H, L, D], k / v [B, Hk, S, D] (H a multiple of Hk; last dimension contiguous; k and v with equal strides),
// mask: additive [B or 1, 1, L, S] or undefined -> [B, H, L, D] in q's dtype
torch::Tensor small_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                              double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "small_attention: 4-D q, k, v");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "small_attention: k and v of one layout");
  TORCH_CHECK(k.stride(3) == 1 && k.scalar_type() == v.scalar_type() && q.scalar_type() == k.scalar_type(),
              "small_attention: contiguous head dimension, one dtype");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0, "small_attention: shapes");
  TORCH_CHECK(q.size(3) % 8 == 0 && q.size(3) >= 8 && q.size(3) <= MAX_DIM,
              "small_attention: head dimension a multiple of 8, at most 256");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "small_attention: fp32 or bf16");
  const auto qf = q.to(at::kFloat).contiguous();
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->to(at::kFloat);
    TORCH_CHECK(m.dim() == 4 && m.size(1) == 1 && m.size(2) == q.size(2) && m.size(3) == k.size(2) &&
                    (m.size(0) == 1 || m.size(0) == q.size(0)),
                "small_attention: mask [B, 1, L, S]");
    if (m.stride(3) != 1) m = m.contiguous();
  }
  auto out = torch::empty(q.sizes(), q.options().dtype(at::kFloat));
  if (k.scalar_type() == at::kFloat) {
    run<float>(qf, k, v, m, scale, out);
  } else {
    run<at::BFloat16>(qf, k, v, m, scale, out);
  }
  return out.to(q.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_attention", &small_attention, "softmax(q k^T * scale + mask) v for a few queries over grouped heads");
}
