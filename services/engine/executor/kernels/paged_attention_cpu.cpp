// Paged decode attention on a CPU: each decode row's K/V read in place from the pool through its block
// table (no gather), built by services/engine/executor/kernels/cpu_kernels.py. Per row: every query head's
// scores over the row's context (the window's last keys), soft-capped, a softmax whose denominator holds
// exp(sink) when there are sinks, times V; fp32 accumulation; a row of length 0 gives zeros. The
// rows are spread over torch's intra-op threads (at::parallel_for), one row at a time: by KV head when
// query heads share one (GQA; their accumulators kept in registers), else by slot (every KV head of a
// slot read once, contiguously).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// D > 0: the head size known at compile time (fully unrolled loops); D == 0: `d` at run time.
template <typename KT, int D>
inline float dot(const float* q, const KT* k, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename KT, int D>
inline void axpy(float* acc, float p, const KT* v, int64_t d) {
  const int64_t n = D > 0 ? D : d;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// Asks for the `bytes` from `p` on to be brought into cache. The loops below ask for the vector kAhead
// slots ahead of the one they read: a row's blocks lie anywhere in the pool, so the hardware's own
// prefetch stops at each block's end (kAhead = 16 measured 1.2-2x faster than none, fp32 and bf16
// pools, head sizes 64 and 128, 64 rows of 128-400 tokens; 8 and 32 were slower or no better).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}
constexpr int64_t kAhead = 16;

struct Args {
  const float* q;  // (rows, H, D)
  const int32_t* tables;  // (rows, max_blocks)
  const int32_t* lens;  // (rows,)
  const float* sinks;  // (H,) or nullptr
  float* out;  // (rows, H, D)
  int64_t rows, h, hkv, d, max_blocks, block_size, window;
  float scale, softcap;
};

// Softmax over one head's scores in place, with exp(sink) in the denominator when there is a sink.
inline void softmax(float* s, int64_t n, const float* sink, float softcap) {
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] * inv);
  }
  float mx = sink ? *sink : -std::numeric_limits<float>::max();
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = sink ? std::exp(*sink - mx) : 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// Row r's visible keys (the last `window` of its context, or all of it): their element offsets in the
// pool (slot * stride) into `offs`, grown as needed; returns how many.
inline int64_t row_slots(const Args& a, int64_t r, int64_t stride, std::vector<int64_t>& offs) {
  const int64_t len = a.lens[r];
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = std::max<int64_t>(0, len - start);
  const int32_t* table = a.tables + r * a.max_blocks;
  offs.resize(std::max<size_t>(offs.size(), static_cast<size_t>(n)));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    offs[t] = (static_cast<int64_t>(table[pos / a.block_size]) * a.block_size + pos % a.block_size) * stride;
  }
  return n;
}

// Every KV head of a slot in one pass over the row's slots: for one query head per KV head (no grouping).
template <typename KT, int D>
void decode_by_slot(const Args& a, const KT* kp, const KT* vp) {
  const int64_t g = a.h / a.hkv, d = a.d, h = a.h;
  const int64_t stride = a.hkv * d;  // one slot: every KV head's vector
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    std::vector<int64_t> offs;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = row_slots(a, r, stride, offs);
      const float* q = a.q + r * h * d;
      float* o = a.out + r * h * d;
      s.resize(std::max<size_t>(s.size(), static_cast<size_t>(h * n)));
      for (int64_t t = 0; t < n; ++t) {
        const KT* k = kp + offs[t];
        if (t + kAhead < n) prefetch(kp + offs[t + kAhead], stride * sizeof(KT));
        for (int64_t i = 0; i < h; ++i) s[i * n + t] = dot<KT, D>(q + i * d, k + (i / g) * d, d) * a.scale;
      }
      for (int64_t i = 0; i < h; ++i) softmax(s.data() + i * n, n, a.sinks ? a.sinks + i : nullptr, a.softcap);
      std::fill(o, o + h * d, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const KT* v = vp + offs[t];
        if (t + kAhead < n) prefetch(vp + offs[t + kAhead], stride * sizeof(KT));
        for (int64_t i = 0; i < h; ++i) axpy<KT, D>(o + i * d, s[i * n + t], v + (i / g) * d, d);
      }
    }
  });
}

// One KV head at a time over the row's slots, its G query heads together: G and D known at compile
// time, so the G accumulators of the values stay in registers across the keys (1.3-1.8x faster than by
// slot for G = 2 and 4; with one query head per KV head the extra passes over the slots cost more).
template <typename KT, int G, int D>
void decode_by_head(const Args& a, const KT* kp, const KT* vp) {
  const int64_t g = G, d = D, h = a.h, hkv = a.hkv;
  const int64_t stride = hkv * d;  // one slot: every KV head's vector
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    std::vector<int64_t> offs;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = row_slots(a, r, stride, offs);
      const float* q = a.q + r * h * d;
      float* o = a.out + r * h * d;
      s.resize(std::max<size_t>(s.size(), static_cast<size_t>(h * n)));
      for (int64_t kh = 0; kh < hkv; ++kh) {
        const float* qh = q + kh * g * d;
        float* sh = s.data() + kh * g * n;
        for (int64_t t = 0; t < n; ++t) {
          const KT* k = kp + offs[t] + kh * d;
          if (t + kAhead < n) prefetch(kp + offs[t + kAhead] + kh * d, d * sizeof(KT));
          for (int64_t j = 0; j < g; ++j) sh[j * n + t] = dot<KT, D>(qh + j * d, k, d) * a.scale;
        }
      }
      for (int64_t i = 0; i < h; ++i) softmax(s.data() + i * n, n, a.sinks ? a.sinks + i : nullptr, a.softcap);
      for (int64_t kh = 0; kh < hkv; ++kh) {
        float acc[G * D];
        float* oh = o + kh * g * d;
        float* ac = acc;
        std::fill(ac, ac + g * d, 0.f);
        const float* ph = s.data() + kh * g * n;
        for (int64_t t = 0; t < n; ++t) {
          const KT* v = vp + offs[t] + kh * d;
          if (t + kAhead < n) prefetch(vp + offs[t + kAhead] + kh * d, d * sizeof(KT));
          for (int64_t j = 0; j < g; ++j) axpy<KT, D>(ac + j * d, ph[j * n + t], v, d);
        }
        std::copy(ac, ac + g * d, oh);
      }
    }
  });
}

template <typename KT, int D>
void dispatch_g(const Args& a, const KT* k, const KT* v) {
  switch (a.h / a.hkv) {
    case 2: decode_by_head<KT, 2, D>(a, k, v); break;
    case 4: decode_by_head<KT, 4, D>(a, k, v); break;
    case 8: decode_by_head<KT, 8, D>(a, k, v); break;
    default: decode_by_slot<KT, D>(a, k, v);
  }
}

template <typename KT>
void dispatch_d(const Args& a, const void* kp, const void* vp) {
  const KT* k = static_cast<const KT*>(kp);
  const KT* v = static_cast<const KT*>(vp);
  switch (a.d) {
    case 64: dispatch_g<KT, 64>(a, k, v); break;
    case 128: dispatch_g<KT, 128>(a, k, v); break;
    default: decode_by_slot<KT, 0>(a, k, v);
  }
}

}  // namespace

// q (rows, H, D) float32; pools (slots, Hkv, D) float32 / bfloat16 / float16 / float8 e4m3; tables
// (rows, max_blocks) and lens (rows,) int32; sinks (H,) or None. Returns (rows, H, D) float32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale, int64_t window,
                           double softcap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: (rows, H, D) float32");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == v_pool.scalar_type(),
              "K and V pools: contiguous, one dtype");
  TORCH_CHECK(k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0 && k_pool.size(2) == q.size(2),
              "head layout: H a multiple of Hkv, one head size");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt, "tables, lens: int32");
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table and length per row");
  auto t = tables.contiguous();
  auto n = lens.contiguous();
  auto out = torch::empty_like(q);
  torch::Tensor sk;
  Args a{q.data_ptr<float>(), t.data_ptr<int32_t>(), n.data_ptr<int32_t>(), nullptr, out.data_ptr<float>(),
         q.size(0), q.size(1), k_pool.size(1), q.size(2), t.size(1), block_size, window,
         static_cast<float>(scale), static_cast<float>(softcap)};
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == q.size(1), "one sink per query head");
    sk = sinks->to(at::kFloat).contiguous();
    a.sinks = sk.data_ptr<float>();
  }
  const void* kp = k_pool.data_ptr();
  const void* vp = v_pool.data_ptr();
  switch (k_pool.scalar_type()) {
    case at::kFloat: dispatch_d<float>(a, kp, vp); break;
    case at::kBFloat16: dispatch_d<c10::BFloat16>(a, kp, vp); break;
    case at::kHalf: dispatch_d<c10::Half>(a, kp, vp); break;
    case at::kFloat8_e4m3fn: dispatch_d<c10::Float8_e4m3fn>(a, kp, vp); break;
    default: TORCH_CHECK(false, "unsupported pool dtype ", k_pool.scalar_type());
  }
  return out;
}

// linear_rows_cpu.cpp, built into the same module
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

// The threads one at::parallel_for region of this module runs on: torch's intra-op threads when the module
// was built with OpenMP (cpu_kernels.CFLAGS), 1 when the region silently ran on the calling thread alone.
int64_t parallel_threads() {
  std::vector<char> seen(static_cast<size_t>(at::get_num_threads()), 0);
  at::parallel_for(0, 1 << 16, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("linear_rows", &linear_rows);
  m.def("parallel_threads", &parallel_threads);
}
