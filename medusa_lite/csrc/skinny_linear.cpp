// A skinny fp32 GEMM for verify forwards on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = a few tree tokens.
//
// A GEMM of a few rows is bound by reading the weights, not by arithmetic; MKL's kernels for M >= 2 are not
// (two rows cost ~1.7x one row on AVX2 kernels). Here the weights are read once per call whatever M is: they are
// packed once into tiles of TILE_ROWS output rows interleaved in 8-float blocks ([N/4][K/8][4][8], zero rows pad
// N), so each tile is one sequential stream, and the x rows (a few KB, in L1) are applied to each tile CHUNK rows
// at a time. AVX2 + FMA, compiled for that target alone (the rest of the file is plain C++). Sums run in a different
// order than MKL's: results differ from F.linear by float rounding only. bf16 weights are packed as bf16 (half the
// bytes to stream) and widened to fp32 in registers; the input is widened once, sums are fp32, the output is
// rounded to the input's dtype, as oneDNN's bf16 GEMM does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int TILE_ROWS = 4;  // output rows per packed tile (4 accumulators per x row)
constexpr int CHUNK = 3;      // x rows per pass over a tile (12 accumulators + 4 weight registers: the 16 ymm)

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 weights from a packed tile as fp32: fp32 as they are, bf16 widened (a bf16 is the top half of an fp32)
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// rows [0, ROWS) of x times one packed tile (TILE_ROWS output rows starting at n0), into y
template <int ROWS, typename W>
__attribute__((target("avx2,fma"))) void tile(const float* x, const W* tile_w, const float* bias, float* y,
                                             int64_t K, int64_t N, int64_t n0) {
  __m256 acc[TILE_ROWS][ROWS];
#pragma GCC unroll 8
  for (int b = 0; b < TILE_ROWS; ++b)
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) acc[b][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[TILE_ROWS];
#pragma GCC unroll 8
    for (int b = 0; b < TILE_ROWS; ++b) w[b] = load8(tile_w + k * TILE_ROWS + 8 * b);
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int b = 0; b < TILE_ROWS; ++b) acc[b][m] = _mm256_fmadd_ps(w[b], xv, acc[b][m]);
    }
  }
  for (int b = 0; b < TILE_ROWS && n0 + b < N; ++b)
    for (int m = 0; m < ROWS; ++m) y[m * N + n0 + b] = hsum(acc[b][m]) + (bias ? bias[n0 + b] : 0.0f);
}

// y [M, N] fp32 = x [M, K] fp32 times every packed tile
template <typename W>
void gemm(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N, int64_t tiles) {
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* tile_w = wp + t * TILE_ROWS * K;
      for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        const int64_t rows = std::min<int64_t>(CHUNK, M - m0);
        if (rows == 3) tile<3>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
        else if (rows == 2) tile<2>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
        else tile<1>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
      }
    }
  });
}

}  // namespace

// weight [N, K] fp32 or bf16 -> packed tiles [ceil(N/4), K/8, 4, 8] of its dtype (K a multiple of 8)
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
              (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16),
              "pack_weight: a 2-D fp32 or bf16 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 8 == 0, "pack_weight: in_features must be a multiple of 8, got ", K);
  const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
  auto padded = torch::zeros({tiles * TILE_ROWS, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({tiles, TILE_ROWS, K / 8, 8}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] (fp32, or bf16 with bf16 weights), packed from pack_weight, N output features, optional bias [N]
// -> y [M, N] of x's dtype
torch::Tensor skinny_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() && x_in.scalar_type() == packed.scalar_type(),
              "skinny_linear: a 2-D CPU input of the packed weight's dtype");
  const auto x = x_in.to(torch::kFloat).contiguous();  // bf16: widened once (a few KB)
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 8 == K && tiles * TILE_ROWS >= N && packed.is_contiguous(),
              "skinny_linear: packed weight does not match the input");
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->to(torch::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "skinny_linear: bias of N values");
  }
  auto y = torch::empty({M, N}, x.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (packed.scalar_type() == torch::kBFloat16)
    gemm(x.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, K, N, tiles);
  else
    gemm(x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, tiles);
  return y.to(x_in.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack an fp32 or bf16 [N, K] weight into 4-row tiles");
  m.def("skinny_linear", &skinny_linear, "x [M, K] @ W^T from packed tiles (+ bias)");
}
