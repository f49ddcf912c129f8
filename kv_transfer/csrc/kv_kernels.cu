// Tandem KV-transfer kernels: gather/scatter of paged-cache blocks through a contiguous staging
// buffer, NHD <-> HND layout conversion, and FP8 (e4m3) packing with a per-run scale.
//
// Built by kv_transfer/build.py with nvcc into libtandem_kv.so and called through ctypes with
// raw device pointers; kv_transfer/kernels.py holds the torch reference of each kernel and
// checks `tandem_kv_abi()` before calling anything (a stale library is never called).
//
// Cache:   [NB, L, 2, BS, H, D]  (each block one contiguous run of block_bytes)
// Staging: [n, L, 2, BS, H, D]   (the n selected blocks, back to back)
//
// Every kernel is memory-bound; the rules that make them run near the copy rate (H200: ~4.1 TB/s
// of read + write): 16-byte loads and stores, several loads in flight per thread before the
// first store, and enough CTAs to fill every SM even for 16 blocks.
//
// FP8 rounding, identical in kernels.py's reference (bit-exact test):
//   scale = amax / 448        (fp32, IEEE division, correctly rounded; 1 for an all-zero run)
//   inv   = 1 / scale         (fp32, IEEE division, once per run)
//   q     = e4m3_rne_satfinite(x * inv)      x * inv: one fp32 multiply, no contraction
//   x'    = dtype_rn(float(q) * scale)
// torch's `t / 448.0` on CUDA multiplies by a rounded reciprocal of the scalar (one bit off the
// quotient): the reference divides by a tensor instead, and this file must not be built with
// --use_fast_math (build.py does not).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define TANDEM_KV_ABI 2  // kernels.py refuses a library with another value

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;           // 16-byte loads in flight per thread
constexpr int64_t kMinChunk = 4096;  // bytes of one block a CTA copies, at least / at most
constexpr int64_t kMaxChunk = 64 * 1024;
constexpr int kWarpVecs = 12;         // 16-byte vectors a lane keeps in registers (fp8 warp variant)

int num_sms() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 108;
  }
  return sms;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

// ---- gather / scatter ------------------------------------------------------------------------
// A flat grid of (selected block, chunk) pairs: chunk_bytes is picked by the host so that even
// 16 blocks make ~8 CTAs per SM (one 64 KiB chunk per CTA gave 16 SmolLM2 blocks only 90 CTAs).

template <bool kVec>
__global__ void copy_blocks_kernel(uint8_t* __restrict__ cache, uint8_t* __restrict__ staging,
                                   const int64_t* __restrict__ block_ids, int64_t num_blocks,
                                   int64_t block_bytes, int64_t chunk_bytes,
                                   int64_t chunks_per_block, bool to_staging) {
  const int64_t sel = blockIdx.x / chunks_per_block;
  const int64_t chunk = blockIdx.x % chunks_per_block;
  const int64_t block = block_ids[sel];
  if (block < 0 || block >= num_blocks) return;  // ids are bounds-checked on the host too
  const int64_t begin = chunk * chunk_bytes;
  const int64_t end = min(begin + chunk_bytes, block_bytes);
  uint8_t* c = cache + block * block_bytes + begin;
  uint8_t* s = staging + sel * block_bytes + begin;
  const uint8_t* src = to_staging ? c : s;
  uint8_t* dst = to_staging ? s : c;
  if (kVec) {  // block_bytes and both bases are 16-byte aligned (checked by the host)
    const int4* src4 = reinterpret_cast<const int4*>(src);
    int4* dst4 = reinterpret_cast<int4*>(dst);
    const int64_t n = (end - begin) / 16;
    for (int64_t i = threadIdx.x; i < n; i += (int64_t)blockDim.x * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t j = i + (int64_t)k * blockDim.x;
        if (j < n) v[k] = src4[j];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t j = i + (int64_t)k * blockDim.x;
        if (j < n) dst4[j] = v[k];
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < end - begin; i += blockDim.x) dst[i] = src[i];
  }
}

int copy_blocks(void* cache, void* staging, const int64_t* block_ids, int64_t num_sel,
                int64_t num_blocks, int64_t block_bytes, int64_t chunk_bytes, void* stream,
                bool to_staging) {
  if (num_sel <= 0) return 0;
  if (block_bytes <= 0) return -1;
  if (chunk_bytes <= 0) {  // auto: ~8 CTAs per SM over the whole copy, 4..64 KiB each
    const int64_t target = 8 * (int64_t)num_sms();
    chunk_bytes = (block_bytes * num_sel + target - 1) / target;
    chunk_bytes = min(max(chunk_bytes, kMinChunk), kMaxChunk);
  }
  chunk_bytes = (chunk_bytes + 15) / 16 * 16;
  const int64_t chunks_per_block = (block_bytes + chunk_bytes - 1) / chunk_bytes;
  const int64_t grid = chunks_per_block * num_sel;
  if (grid > 0x7fffffffLL) return -1;
  const bool vec = block_bytes % 16 == 0 && aligned16(cache) && aligned16(staging);
  cudaStream_t s = (cudaStream_t)stream;
  if (vec) {
    copy_blocks_kernel<true><<<(unsigned)grid, kThreads, 0, s>>>(
        (uint8_t*)cache, (uint8_t*)staging, block_ids, num_blocks, block_bytes, chunk_bytes,
        chunks_per_block, to_staging);
  } else {
    copy_blocks_kernel<false><<<(unsigned)grid, kThreads, 0, s>>>(
        (uint8_t*)cache, (uint8_t*)staging, block_ids, num_blocks, block_bytes, chunk_bytes,
        chunks_per_block, to_staging);
  }
  return (int)cudaGetLastError();
}

// ---- NHD <-> HND -----------------------------------------------------------------------------
// [runs, T, H, D] <-> [runs, H, T, D] moves whole rows of D elements: a permutation of rows.
// Threads walk the source in order (coalesced 16-byte loads); each row lands as one contiguous
// D-element write (128 bytes or more for D >= 64 in 16-bit types), so no shared-memory tile is
// needed. Idx is 32-bit where the element count allows (cheaper index arithmetic).

template <typename W, typename Idx>
__global__ void transpose_rows_kernel(const W* __restrict__ src, W* __restrict__ dst, Idx total,
                                      Idx words_per_row, Idx tokens, Idx heads, bool nhd_to_hnd) {
  const Idx stride = (Idx)gridDim.x * blockDim.x;
  for (Idx g = (Idx)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride * kUnroll) {
    W v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const Idx j = g + (Idx)k * stride;
      if (j < total) v[k] = src[j];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const Idx j = g + (Idx)k * stride;
      if (j >= total) continue;
      const Idx w = j % words_per_row;
      const Idx row = j / words_per_row;
      Idx out_row;
      if (nhd_to_hnd) {  // source rows [run, t, h] -> [run, h, t]
        const Idx h = row % heads, rest = row / heads;
        const Idx t = rest % tokens, run = rest / tokens;
        out_row = (run * heads + h) * tokens + t;
      } else {  // source rows [run, h, t] -> [run, t, h]
        const Idx t = row % tokens, rest = row / tokens;
        const Idx h = rest % heads, run = rest / heads;
        out_row = (run * tokens + t) * heads + h;
      }
      dst[out_row * words_per_row + w] = v[k];
    }
  }
}

template <typename W>
int launch_transpose(const void* src, void* dst, int64_t rows, int64_t words_per_row,
                     int64_t tokens, int64_t heads, bool nhd_to_hnd, cudaStream_t s) {
  const int64_t total = rows * words_per_row;
  const int64_t want = (total + (int64_t)kThreads * kUnroll - 1) / ((int64_t)kThreads * kUnroll);
  const int grid = (int)min(max(want, (int64_t)1), (int64_t)num_sms() * 16);
  if (total < 0x7fffffffLL) {
    transpose_rows_kernel<W, uint32_t><<<grid, kThreads, 0, s>>>(
        (const W*)src, (W*)dst, (uint32_t)total, (uint32_t)words_per_row, (uint32_t)tokens,
        (uint32_t)heads, nhd_to_hnd);
  } else {
    transpose_rows_kernel<W, uint64_t><<<grid, kThreads, 0, s>>>(
        (const W*)src, (W*)dst, (uint64_t)total, (uint64_t)words_per_row, (uint64_t)tokens,
        (uint64_t)heads, nhd_to_hnd);
  }
  return (int)cudaGetLastError();
}

// ---- FP8 -------------------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ uint8_t e4m3(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float fp8_scale(float amax) {
  return amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;  // IEEE division, as the reference
}

// 16 bytes of T: VEC elements.
template <typename T>
struct Vec {
  static constexpr int kElems = 16 / sizeof(T);
  __device__ __forceinline__ static float amax(const int4& v) {
    const T* e = reinterpret_cast<const T*>(&v);
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kElems; ++i) m = fmaxf(m, fabsf(to_float(e[i])));
    return m;
  }
  // Quantizes one vector into kElems bytes at out (aligned to kElems bytes).
  __device__ __forceinline__ static void pack(const int4& v, float inv, uint8_t* out) {
    const T* e = reinterpret_cast<const T*>(&v);
    uint8_t b[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) b[i] = e4m3(__fmul_rn(to_float(e[i]), inv));
    if (kElems == 8) {
      *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(b);
    } else {  // float: 4 elements
      *reinterpret_cast<uint32_t*>(out) = *reinterpret_cast<const uint32_t*>(b);
    }
  }
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The largest of every thread's `v` in the CTA (blockDim.x <= 1024), in every thread: each
// warp's maximum, then the first warp's over those.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max_of[32];
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) warp_max_of[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float m = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max_of[threadIdx.x] : 0.f;
    m = warp_max(m);
    if (threadIdx.x == 0) warp_max_of[0] = m;
  }
  __syncthreads();
  return warp_max_of[0];
}

// One CTA per run: up to R vectors per thread stay in registers between the amax and the
// quantization (longer runs re-read the rest, from L2).
template <typename T, int R>
__global__ void fp8_pack_cta_kernel(const T* __restrict__ src, uint8_t* __restrict__ q,
                                    float* __restrict__ scales, int64_t run_elems) {
  using V = Vec<T>;
  const int64_t run = blockIdx.x;
  const int64_t nvec = run_elems / V::kElems;
  const int4* s = reinterpret_cast<const int4*>(src + run * run_elems);
  uint8_t* out = q + run * run_elems;
  int4 regs[R];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
    if (i < nvec) { regs[k] = s[i]; amax = fmaxf(amax, V::amax(regs[k])); }
  }
  for (int64_t i = threadIdx.x + (int64_t)R * blockDim.x; i < nvec; i += blockDim.x)
    amax = fmaxf(amax, V::amax(s[i]));
  const float scale = fp8_scale(block_max(amax));
  const float inv = __frcp_rn(scale);
  if (threadIdx.x == 0) scales[run] = scale;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
    if (i < nvec) V::pack(regs[k], inv, out + i * V::kElems);
  }
  for (int64_t i = threadIdx.x + (int64_t)R * blockDim.x; i < nvec; i += blockDim.x)
    V::pack(s[i], inv, out + i * V::kElems);
}

// One warp per run (short runs, e.g. SmolLM2's 3,072 elements): no __syncthreads, 8 runs per
// CTA, many CTAs resident per SM.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads, 2) fp8_pack_warp_kernel(const T* __restrict__ src, uint8_t* __restrict__ q,
                                     float* __restrict__ scales, int64_t num_runs, int64_t run_elems) {
  using V = Vec<T>;
  const int64_t run = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (run >= num_runs) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const int64_t nvec = run_elems / V::kElems;
  const int4* s = reinterpret_cast<const int4*>(src + run * run_elems);
  uint8_t* out = q + run * run_elems;
  int4 regs[R];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < nvec) { regs[k] = s[i]; amax = fmaxf(amax, V::amax(regs[k])); }
  }
  for (int64_t i = lane + 32 * R; i < nvec; i += 32) amax = fmaxf(amax, V::amax(s[i]));
  const float scale = fp8_scale(warp_max(amax));
  const float inv = __frcp_rn(scale);
  if (lane == 0) scales[run] = scale;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < nvec) V::pack(regs[k], inv, out + i * V::kElems);
  }
  for (int64_t i = lane + 32 * R; i < nvec; i += 32) V::pack(s[i], inv, out + i * V::kElems);
}

// Any size or alignment: one CTA per run, scalar loads.
template <typename T>
__global__ void fp8_pack_scalar_kernel(const T* src, uint8_t* q, float* scales, int64_t run_elems) {
  const int64_t run = blockIdx.x;
  const T* s = src + run * run_elems;
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x) amax = fmaxf(amax, fabsf(to_float(s[i])));
  const float scale = fp8_scale(block_max(amax));
  const float inv = __frcp_rn(scale);
  if (threadIdx.x == 0) scales[run] = scale;
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x)
    q[run * run_elems + i] = e4m3(__fmul_rn(to_float(s[i]), inv));
}

// variant: 0 auto, 1 CTA per run, 2 warp per run, 3 scalar.
template <typename T>
int launch_fp8_pack(const void* src, void* q, float* scales, int64_t num_runs, int64_t run_elems,
                    int variant, cudaStream_t s) {
  constexpr int kElems = Vec<T>::kElems;
  const bool vec = (run_elems * (int64_t)sizeof(T)) % 16 == 0 && aligned16(src) &&
                   (reinterpret_cast<uintptr_t>(q) % kElems) == 0 && run_elems % kElems == 0;
  const int64_t nvec = run_elems / kElems;
  if (!vec) variant = 3;
  if (variant == 0) variant = nvec <= 32 * kWarpVecs ? 2 : 1;
  if (variant == 2) {
    const int64_t runs_per_cta = kThreads / 32;
    const int64_t grid = (num_runs + runs_per_cta - 1) / runs_per_cta;
    fp8_pack_warp_kernel<T, kWarpVecs><<<(unsigned)grid, kThreads, 0, s>>>(
        (const T*)src, (uint8_t*)q, scales, num_runs, run_elems);
  } else if (variant == 1) {
    // Threads: enough for 4 vectors each, 64..1024.
    int64_t threads = (nvec + 3) / 4;
    threads = min(max((threads + 31) / 32 * 32, (int64_t)64), (int64_t)1024);
    fp8_pack_cta_kernel<T, 4><<<(unsigned)num_runs, (unsigned)threads, 0, s>>>(
        (const T*)src, (uint8_t*)q, scales, run_elems);
  } else {
    fp8_pack_scalar_kernel<T><<<(unsigned)num_runs, kThreads, 0, s>>>(
        (const T*)src, (uint8_t*)q, scales, run_elems);
  }
  return (int)cudaGetLastError();
}

// Flat over groups of 8 elements (8 fp8 bytes in, 8 T out); run_elems % 8 == 0.
template <typename T, typename Idx>
__global__ void fp8_unpack_vec_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                      T* __restrict__ dst, Idx num_groups, Idx groups_per_run) {
  const Idx stride = (Idx)gridDim.x * blockDim.x;
  for (Idx g = (Idx)blockIdx.x * blockDim.x + threadIdx.x; g < num_groups; g += stride) {
    const float scale = scales[g / groups_per_run];
    const uint2 raw = reinterpret_cast<const uint2*>(q)[g];
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
    T out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      __nv_fp8_e4m3 v;
      v.__x = b[i];
      out[i] = from_float<T>(__fmul_rn(static_cast<float>(v), scale));
    }
    if (sizeof(T) == 2) {
      reinterpret_cast<int4*>(dst)[g] = *reinterpret_cast<const int4*>(out);
    } else {
      reinterpret_cast<int4*>(dst)[2 * g] = reinterpret_cast<const int4*>(out)[0];
      reinterpret_cast<int4*>(dst)[2 * g + 1] = reinterpret_cast<const int4*>(out)[1];
    }
  }
}

template <typename T>
__global__ void fp8_unpack_scalar_kernel(const uint8_t* q, const float* scales, T* dst, int64_t run_elems) {
  const int64_t run = blockIdx.x;
  const float scale = scales[run];
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x) {
    __nv_fp8_e4m3 v;
    v.__x = q[run * run_elems + i];
    dst[run * run_elems + i] = from_float<T>(__fmul_rn(static_cast<float>(v), scale));
  }
}

template <typename T>
int launch_fp8_unpack(const void* q, const float* scales, void* dst, int64_t num_runs,
                      int64_t run_elems, cudaStream_t s) {
  const bool vec = run_elems % 8 == 0 && (reinterpret_cast<uintptr_t>(q) % 8) == 0 && aligned16(dst);
  if (!vec) {
    fp8_unpack_scalar_kernel<T><<<(unsigned)num_runs, kThreads, 0, s>>>(
        (const uint8_t*)q, scales, (T*)dst, run_elems);
    return (int)cudaGetLastError();
  }
  const int64_t groups = num_runs * run_elems / 8;
  const int64_t want = (groups + kThreads - 1) / kThreads;
  const int grid = (int)min(max(want, (int64_t)1), (int64_t)num_sms() * 16);
  if (groups < 0x7fffffffLL) {
    fp8_unpack_vec_kernel<T, uint32_t><<<grid, kThreads, 0, s>>>(
        (const uint8_t*)q, scales, (T*)dst, (uint32_t)groups, (uint32_t)(run_elems / 8));
  } else {
    fp8_unpack_vec_kernel<T, uint64_t><<<grid, kThreads, 0, s>>>(
        (const uint8_t*)q, scales, (T*)dst, (uint64_t)groups, (uint64_t)(run_elems / 8));
  }
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// dtype codes shared with kernels.py: 0 float32, 1 float16, 2 bfloat16.

int tandem_kv_abi() { return TANDEM_KV_ABI; }

// chunk_bytes: bytes of a block one CTA copies; 0 picks it (see copy_blocks).
int tandem_gather_blocks(void* cache, void* staging, const int64_t* block_ids, int64_t num_sel,
                         int64_t num_blocks, int64_t block_bytes, int64_t chunk_bytes, void* stream) {
  return copy_blocks(cache, staging, block_ids, num_sel, num_blocks, block_bytes, chunk_bytes,
                     stream, true);
}

int tandem_scatter_blocks(void* cache, void* staging, const int64_t* block_ids, int64_t num_sel,
                          int64_t num_blocks, int64_t block_bytes, int64_t chunk_bytes, void* stream) {
  return copy_blocks(cache, staging, block_ids, num_sel, num_blocks, block_bytes, chunk_bytes,
                     stream, false);
}

int tandem_transpose(const void* src, void* dst, int64_t num_runs, int64_t tokens, int64_t heads,
                     int64_t head_dim, int64_t elem_bytes, int nhd_to_hnd, void* stream) {
  if (num_runs == 0 || tokens == 0 || heads == 0 || head_dim == 0) return 0;
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return -1;
  cudaStream_t s = (cudaStream_t)stream;
  const int64_t rows = num_runs * tokens * heads;
  const int64_t row_bytes = head_dim * elem_bytes;
  const bool rev = nhd_to_hnd != 0;
  if (row_bytes % 16 == 0 && aligned16(src) && aligned16(dst))
    return launch_transpose<int4>(src, dst, rows, row_bytes / 16, tokens, heads, rev, s);
  if (row_bytes % 8 == 0 && (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 8 == 0)
    return launch_transpose<uint2>(src, dst, rows, row_bytes / 8, tokens, heads, rev, s);
  if (elem_bytes == 4) return launch_transpose<uint32_t>(src, dst, rows, head_dim, tokens, heads, rev, s);
  if (elem_bytes == 2) return launch_transpose<uint16_t>(src, dst, rows, head_dim, tokens, heads, rev, s);
  return launch_transpose<uint8_t>(src, dst, rows, head_dim, tokens, heads, rev, s);
}

int tandem_fp8_pack(const void* src, void* q, float* scales, int64_t num_runs, int64_t run_elems,
                    int dtype, int variant, void* stream) {
  if (num_runs == 0 || run_elems == 0) return 0;
  if (variant < 0 || variant > 3) return -1;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return launch_fp8_pack<float>(src, q, scales, num_runs, run_elems, variant, s);
    case 1: return launch_fp8_pack<__half>(src, q, scales, num_runs, run_elems, variant, s);
    case 2: return launch_fp8_pack<__nv_bfloat16>(src, q, scales, num_runs, run_elems, variant, s);
    default: return -1;
  }
}

int tandem_fp8_unpack(const void* q, const float* scales, void* dst, int64_t num_runs,
                      int64_t run_elems, int dtype, void* stream) {
  if (num_runs == 0 || run_elems == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return launch_fp8_unpack<float>(q, scales, dst, num_runs, run_elems, s);
    case 1: return launch_fp8_unpack<__half>(q, scales, dst, num_runs, run_elems, s);
    case 2: return launch_fp8_unpack<__nv_bfloat16>(q, scales, dst, num_runs, run_elems, s);
    default: return -1;
  }
}

}  // extern "C"
