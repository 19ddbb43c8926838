// A linear layer's product for a few rows on a CPU, y = x W^T + b: the matrix-vector products of a decode
// step at small batch, built with the paged kernel by services/engine/executor/kernels/cpu_kernels.py.
// Four weight rows at a time, each read once from memory against every input row (the rows stay in L1),
// the next four asked for ahead, fp32 accumulation. On one thread, torch's GEMM and oneDNN read a weight
// that lives in L3 at 11-14 GB/s here, this loop at 35-40 (the tiny model's 29 products of one token:
// 1.1-1.5 ms against 0.40-0.45); from memory 6-9 GB/s against 14-15.
// A weight of at least kChunkBytes * 2 is split over torch's intra-op threads; a smaller one runs on the
// calling thread (a parallel region costs more than the product of a small matrix). Two threads, one row,
// h1024's 56 layer weights from memory: 12-16 ms a pass (24-31 GB/s) against 25-26 on one thread, oneDNN's
// packed weights 17-22 ms.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

namespace {

constexpr int64_t kChunkBytes = 1 << 20;  // the least weight a thread is given

// out[j] = sum_i w_j[i] * x[i] for the four rows w_0..w_3 of W (stride ldw).
template <typename T>
inline void dot4(const T* w, int64_t ldw, const T* x, int64_t k, float* out) {
  const T* w0 = w;
  const T* w1 = w + ldw;
  const T* w2 = w + 2 * ldw;
  const T* w3 = w + 3 * ldw;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < k; ++i) {
    const float xi = static_cast<float>(x[i]);
    s0 += static_cast<float>(w0[i]) * xi;
    s1 += static_cast<float>(w1[i]) * xi;
    s2 += static_cast<float>(w2[i]) * xi;
    s3 += static_cast<float>(w3[i]) * xi;
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <typename T>
inline float dot1(const T* w, const T* x, int64_t k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += static_cast<float>(w[i]) * static_cast<float>(x[i]);
  return s;
}

// Asks for the next block of four weight rows [p, end) to be brought into cache while this one is read: a
// block of a model's small matrices is one or a few 4 KB pages, at whose ends the hardware's prefetch
// stops (the tiny model's 28 layer products, weights out of cache: 8.9 -> 14-15 GB/s; two blocks ahead
// or into L2/L3 only were no better).
inline void prefetch_block(const char* p, const char* end, int64_t bytes) {
  for (int64_t i = 0; i < bytes && p + i < end; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// Output columns [begin, end) of y (m, n) for x (m, k), w (n, k), bias (n,) or nullptr.
template <typename T>
void columns(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t n, int64_t k, int64_t begin,
             int64_t end) {
  float acc[4];
  const int64_t block_bytes = 4 * k * static_cast<int64_t>(sizeof(T));
  const char* w_end = reinterpret_cast<const char*>(w + end * k);
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) {
    const T* wo = w + o * k;
    prefetch_block(reinterpret_cast<const char*>(wo + 4 * k), w_end, block_bytes);
    for (int64_t r = 0; r < m; ++r) {
      dot4(wo, k, x + r * k, k, acc);
      for (int j = 0; j < 4; ++j) {
        const float b = bias ? static_cast<float>(bias[o + j]) : 0.f;
        y[r * n + o + j] = static_cast<T>(acc[j] + b);
      }
    }
  }
  for (; o < end; ++o)
    for (int64_t r = 0; r < m; ++r) {
      const float b = bias ? static_cast<float>(bias[o]) : 0.f;
      y[r * n + o] = static_cast<T>(dot1(w + o * k, x + r * k, k) + b);
    }
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& w, const T* bias, torch::Tensor& y) {  // x contiguous
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
  // whole blocks of four rows per thread, at least kChunkBytes of weight each
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (4 * row_bytes));
  const int64_t blocks = (n + 3) / 4;
  at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
    columns<T>(xp, wp, bias, yp, m, n, k, 4 * b, std::min(n, 4 * e));
  });
}

}  // namespace

// x (m, k) and w (n, k, contiguous): float32 or bfloat16, one dtype; bias (n,) of that dtype or None.
// Returns y (m, n) = x w^T + bias in that dtype (fp32 accumulation).
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (m, k) and w (n, k)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w: one dtype");
  TORCH_CHECK(w.is_contiguous(), "w: contiguous");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == w.size(0) && b.scalar_type() == w.scalar_type(), "bias: (n,) in w's dtype");
  }
  auto xc = x.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(xc, w, b.defined() ? b.data_ptr<float>() : nullptr, y); break;
    case at::kBFloat16:
      run<c10::BFloat16>(xc, w, b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, y);
      break;
    default: TORCH_CHECK(false, "linear_rows: float32 or bfloat16, got ", x.scalar_type());
  }
  return y;
}
