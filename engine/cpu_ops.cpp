// The CPU path's fused layer ops (float32), loaded by engine/cpu_ops.py: the same three ops as the
// GPU path's Triton kernels (engine/fused_ops.py), each one call where torch runs two to seven
// small kernels. A SmolLM2 decode step is ~900 such kernels; after each matmul has streamed its
// weights through the caches every one of them starts cold, so the count is what costs.
//
// Rounding follows the torch code they replace (engine/model.py, engine/rope.py) where it can:
// the products and sums round one at a time (built with -ffp-contract=off), so RoPE gives the
// same bits and SiLU-and-multiply runs torch's own kernels; RMSNorm's sum of squares runs in
// another order, so it agrees to float32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;  // rows a thread takes: a decode batch runs inline

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, " must be a CPU float32 [rows, n] tensor with contiguous rows");
}

// residual = x + residual (x alone when residual is None); returns (weight * RMSNorm(residual),
// residual), as engine/fused_ops.py's add_rms_norm.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden &&
                  weight.scalar_type() == at::kFloat,
              "weight must be float32 [", hidden, "]");
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
  }
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor summed = at::empty({rows, hidden}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = has_residual ? residual->data_ptr<float>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = has_residual ? residual->stride(0) : 0;
  const float* w = weight.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * x_stride;
      float* s = sp + t * hidden;
      float squares = 0.f;
      if (rp != nullptr) {
        const float* rr = rp + t * r_stride;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = xr[i] + rr[i];
          s[i] = v;
          squares += v * v;
        }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
          s[i] = xr[i];
          squares += xr[i] * xr[i];
        }
      }
      // torch: x * rsqrt(mean(x^2) + eps), then weight * that
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf);
      float* o = op + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (s[i] * inv);
    }
  });
  return {out, summed};
}

// RoPE of the q and k heads in place in the fused qkv matmul's output, and each token's rotated
// k and its v written to its cache slot, as engine/fused_ops.py's rope_store.
void rope_store(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                int64_t num_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous tables of one shape");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.dim() == 5 &&
                  kv_cache.size(1) == 2 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4),
              "kv_cache must be one layer's float32 [num_blocks, 2, block_size, kvh, d] with "
              "contiguous heads");
  const int64_t tokens = qkv.size(0), num_kv_heads = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t half = d / 2, rotated_heads = num_heads + num_kv_heads;
  TORCH_CHECK(d % 2 == 0 && cos.size(1) == d && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "qkv must be [T, (heads + 2 * kv_heads) * head_dim] for the cache's head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == tokens && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "positions and slot_mapping must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_positions = cos.size(0), num_blocks = kv_cache.size(0);
  const int64_t block_size = kv_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < num_positions, "position ", pos[t], " out of the table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_blocks * block_size, "slot ", slots[t],
                " out of the cache");
  }
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* cache = kv_cache.data_ptr<float>();
  const int64_t x_stride = qkv.stride(0);
  const int64_t block_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
  const int64_t slot_stride = kv_cache.stride(2);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> head(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + pos[t] * d;
      const float* st = s + pos[t] * d;
      float* row = x + t * x_stride;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* xh = row + h * d;
        std::copy(xh, xh + d, head.begin());
        const float* in = head.data();
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): the same products and sum
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) xh[i] = in[i] * ct[i] - in[i + half] * st[i];
#pragma omp simd
        for (int64_t i = half; i < d; ++i) xh[i] = in[i] * ct[i] + in[i - half] * st[i];
      }
      float* dst = cache + (slots[t] / block_size) * block_stride + (slots[t] % block_size) *
                                                                      slot_stride;
      const float* k = row + num_heads * d;
      const float* v = row + rotated_heads * d;
      std::copy(k, k + num_kv_heads * d, dst);
      std::copy(v, v + num_kv_heads * d, dst + kv_stride);
    }
  });
}

// SiLU(gate) * up over the fused gate_up matmul's output [T, 2 * I] -> [T, I]: torch's own
// vectorized SiLU kernel (a plain loop's exp does not vectorize without -ffast-math), then the
// multiply in place, the same values as F.silu(gate) * up; one call from Python instead of three.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, n)).mul_(gate_up.narrow(1, n, n));
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("rope_store(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) kv_cache, Tensor slot_mapping, int num_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
}
