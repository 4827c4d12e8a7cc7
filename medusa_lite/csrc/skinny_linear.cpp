// A skinny fp32 GEMM for verify forwards on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = a few tree tokens.
//
// A GEMM of a few rows is bound by reading the weights, not by arithmetic; MKL's kernels for M >= 2 are not
// (two rows cost ~1.7x one row on AVX2 kernels). Here the weights are read once per call whatever M is: they are
// packed once into tiles of TILE_ROWS output rows interleaved in 8-float blocks ([N/4][K/8][4][8], zero rows pad
// N), so each tile is one sequential stream, and the x rows (a few KB, in L1) are applied to each tile CHUNK rows
// at a time. AVX2 + FMA, compiled for that target alone (the rest of the file is plain C++). Sums run in a different
// order than MKL's: results differ from F.linear by float rounding only.
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

// rows [0, ROWS) of x times one packed tile (TILE_ROWS output rows starting at n0), into y
template <int ROWS>
__attribute__((target("avx2,fma"))) void tile(const float* x, const float* tile_w, const float* bias, float* y,
                                             int64_t K, int64_t N, int64_t n0) {
  __m256 acc[TILE_ROWS][ROWS];
#pragma GCC unroll 8
  for (int b = 0; b < TILE_ROWS; ++b)
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) acc[b][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[TILE_ROWS];
#pragma GCC unroll 8
    for (int b = 0; b < TILE_ROWS; ++b) w[b] = _mm256_loadu_ps(tile_w + k * TILE_ROWS + 8 * b);
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

}  // namespace

// weight [N, K] fp32 -> packed tiles [ceil(N/4), K/8, 4, 8] (K a multiple of 8)
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "pack_weight: a 2-D fp32 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 8 == 0, "pack_weight: in_features must be a multiple of 8, got ", K);
  const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
  auto padded = torch::zeros({tiles * TILE_ROWS, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({tiles, TILE_ROWS, K / 8, 8}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] fp32, packed from pack_weight, N output features, optional bias [N] -> y [M, N]
torch::Tensor skinny_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(),
              "skinny_linear: a 2-D fp32 CPU input");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 8 == K && tiles * TILE_ROWS >= N && packed.is_contiguous(),
              "skinny_linear: packed weight does not match the input");
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == N, "skinny_linear: bias of N fp32 values");
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* tile_w = wp + t * TILE_ROWS * K;
      for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        const int64_t rows = std::min<int64_t>(CHUNK, M - m0);
        if (rows == 3) tile<3>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
        else if (rows == 2) tile<2>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
        else tile<1>(xp + m0 * K, tile_w, bp, yp + m0 * N, K, N, t * TILE_ROWS);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack an fp32 [N, K] weight into 4-row tiles");
  m.def("skinny_linear", &skinny_linear, "x [M, K] @ W^T from packed tiles (+ bias)");
}
