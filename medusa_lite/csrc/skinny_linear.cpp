// A skinny GEMM for verify forwards on CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = a few tree tokens.
//
// A GEMM of a few rows is bound by reading the weights, not by arithmetic, and MKL's kernels for few rows are not
// (its one-row GEMV streams them at half the memory's speed, two rows cost ~1.7x one row on AVX2 kernels). Here
// the weights are read once per call whatever M is: packed once into panels of PANEL output features, k-major
// ([ceil(N/16)][K][16], zero features pad N), each panel one sequential stream that is prefetched ahead of the
// arithmetic, so that reading the next weights overlaps the FMAs on the current ones. Each panel is applied to up
// to MAX_ROWS x rows at a time (a broadcast of x[m, k] times the panel's 16 weights of row k, into 2 x MAX_ROWS
// accumulators): up to 6 tree tokens cost about what one does. Every output is one fp32 sum over k in order,
// whatever M (not MKL's order): results differ from F.linear by float rounding only. AVX2 + FMA, compiled for that
// target alone (the rest of the file is plain C++). bf16 weights are packed as bf16 (half the bytes to stream) and
// widened to fp32 in registers; the input is widened once, sums are fp32, the output is rounded to the input's
// dtype, as oneDNN's bf16 GEMM does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int PANEL = 16;     // output features per packed panel (two 8-float registers)
constexpr int MAX_ROWS = 6;   // x rows per pass over a panel (12 accumulators + 2 weights + 1 broadcast: 15 of 16 ymm)
constexpr int AHEAD = 64;     // k rows of the panel stream prefetched ahead of the arithmetic (4 KB of fp32)
constexpr int64_t PARALLEL_ROWS = 8;          // rows from which the panels are shared by torch's threads ...
constexpr int64_t PARALLEL_WORK = 1 << 22;    // ... in a GEMM of at least this many multiply-adds

// 8 weights of a packed panel as fp32: fp32 as they are, bf16 widened (a bf16 is the top half of an fp32)
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// ACC[m][0..1] += x[m, K_] times row K_ of the panel (16 weights), the stream prefetched AHEAD rows on (a macro:
// accumulators reached through a reference, or indexed by anything not constant, are kept in memory, a store
// each per k; a local array indexed by unrolled loops stays in registers)
#define SKINNY_STEP(ACC, K_)                                                                   \
  do {                                                                                         \
    const W* wk = panel + (K_) * PANEL;                                                        \
    _mm_prefetch(reinterpret_cast<const char*>(wk + AHEAD * PANEL), _MM_HINT_T0);              \
    const __m256 w0 = load8(wk), w1 = load8(wk + 8);                                           \
    _Pragma("GCC unroll 8") for (int m = 0; m < ROWS; ++m) {                                   \
      const __m256 xb = _mm256_broadcast_ss(x + m * K + (K_));                                 \
      ACC[m][0] = _mm256_fmadd_ps(xb, w0, ACC[m][0]);                                          \
      ACC[m][1] = _mm256_fmadd_ps(xb, w1, ACC[m][1]);                                          \
    }                                                                                          \
  } while (0)

// rows [0, ROWS) of x times one panel (output features n0 .. n0 + 16, those below N) into y, plus bias
template <int ROWS, typename W>
__attribute__((target("avx2,fma"))) void panel_rows(const float* x, const W* panel, const float* bias, float* y,
                                                    int64_t K, int64_t N, int64_t n0) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) SKINNY_STEP(acc, k);
  const int64_t width = std::min<int64_t>(PANEL, N - n0);
  alignas(32) float sums[ROWS][PANEL];  // (every index constant: the accumulators stay in registers)
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) {
    _mm256_store_ps(sums[m], acc[m][0]);
    _mm256_store_ps(sums[m] + 8, acc[m][1]);
  }
  for (int m = 0; m < ROWS; ++m) {
    float* out = y + m * N + n0;
    for (int64_t j = 0; j < width; ++j) out[j] = sums[m][j] + (bias ? bias[n0 + j] : 0.0f);
  }
}
#undef SKINNY_STEP

template <typename W>
void rows_pass(int64_t rows, const float* x, const W* panel, const float* bias, float* y, int64_t K, int64_t N,
               int64_t n0) {
  switch (rows) {
    case 6: return panel_rows<6>(x, panel, bias, y, K, N, n0);
    case 5: return panel_rows<5>(x, panel, bias, y, K, N, n0);
    case 4: return panel_rows<4>(x, panel, bias, y, K, N, n0);
    case 3: return panel_rows<3>(x, panel, bias, y, K, N, n0);
    case 2: return panel_rows<2>(x, panel, bias, y, K, N, n0);
    default: return panel_rows<1>(x, panel, bias, y, K, N, n0);
  }
}

// y [M, N] fp32 = x [M, K] fp32 times every packed panel; M split into equal passes of at most MAX_ROWS rows
// (over panels, on torch's intra-op threads, only where the arithmetic bounds it: PARALLEL_ROWS rows or more and
// PARALLEL_WORK multiply-adds; fewer rows are bound by reading the weights, which a second core does not speed up,
// and a parallel region costs 15-50 us. Each output is still one thread's sum over k in order: the same bits
// whatever the thread count.)
template <typename W>
void gemm(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N, int64_t panels) {
  const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
  const bool parallel = M >= PARALLEL_ROWS && M * K * panels * PANEL >= PARALLEL_WORK;
  at::parallel_for(0, panels, parallel ? 16 : panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = wp + p * K * PANEL;
      for (int64_t i = 0, m0 = 0; i < passes; ++i) {
        const int64_t rows = (M - m0) / (passes - i);  // the rows left, shared equally by the passes left
        rows_pass(rows, xp + m0 * K, panel, bp, yp + m0 * N, K, N, p * PANEL);
        m0 += rows;
      }
    }
  });
}

}  // namespace

// weight [N, K] fp32 or bf16 -> packed panels [ceil(N/16), K, 16] of its dtype
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
              (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16),
              "pack_weight: a 2-D fp32 or bf16 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  auto padded = torch::zeros({panels * PANEL, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, PANEL, K}).permute({0, 2, 1}).contiguous();
}

// x [M, K] (fp32, or bf16 with bf16 weights), packed from pack_weight, N output features, optional bias [N]
// -> y [M, N] of x's dtype
torch::Tensor skinny_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() && x_in.scalar_type() == packed.scalar_type(),
              "skinny_linear: a 2-D CPU input of the packed weight's dtype");
  const auto x = x_in.to(torch::kFloat).contiguous();  // bf16: widened once (a few KB)
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == PANEL && panels * PANEL >= N &&
              packed.is_contiguous(), "skinny_linear: packed weight does not match the input");
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->to(torch::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "skinny_linear: bias of N values");
  }
  auto y = torch::empty({M, N}, x.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (packed.scalar_type() == torch::kBFloat16)
    gemm(x.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, K, N, panels);
  else
    gemm(x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, panels);
  return y.to(x_in.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack an fp32 or bf16 [N, K] weight into 16-feature panels");
  m.def("skinny_linear", &skinny_linear, "x [M, K] @ W^T from packed panels (+ bias)");
}
