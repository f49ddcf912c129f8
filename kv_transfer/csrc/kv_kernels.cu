// Tandem KV-transfer kernels: gather/scatter of paged-cache blocks through a contiguous staging
// buffer, NHD <-> HND layout conversion, and FP8 (e4m3) packing with a per-run scale.
//
// Built by kv_transfer/build.py with nvcc into libtandem_kv.so and called through ctypes with
// raw device pointers; kv_transfer/kernels.py holds the torch reference of each kernel.
//
// Cache:   [NB, L, 2, BS, H, D]  (each block one contiguous run of block_bytes)
// Staging: [n, L, 2, BS, H, D]   (the n selected blocks, back to back)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

// Copy selected blocks between the cache and a staging buffer. The grid is (chunks, n): each
// CUDA block copies one 64 KiB slice of one cache block, in 16-byte words when aligned.
constexpr int64_t kChunk = 64 * 1024;

__global__ void copy_blocks_kernel(uint8_t* cache, uint8_t* staging, const int64_t* block_ids,
                                   int64_t num_blocks, int64_t block_bytes, bool to_staging) {
  const int64_t sel = blockIdx.y;
  const int64_t block = block_ids[sel];
  if (block < 0 || block >= num_blocks) return;  // ids are bounds-checked on the host too
  const int64_t begin = blockIdx.x * kChunk;
  const int64_t end = min(begin + kChunk, block_bytes);
  uint8_t* c = cache + block * block_bytes;
  uint8_t* s = staging + sel * block_bytes;
  uint8_t* src = to_staging ? c : s;
  uint8_t* dst = to_staging ? s : c;
  if ((block_bytes % 16) == 0 && (reinterpret_cast<uintptr_t>(src) % 16) == 0 &&
      (reinterpret_cast<uintptr_t>(dst) % 16) == 0) {
    const int4* src4 = reinterpret_cast<const int4*>(src + begin);
    int4* dst4 = reinterpret_cast<int4*>(dst + begin);
    for (int64_t i = threadIdx.x; i < (end - begin) / 16; i += blockDim.x) dst4[i] = src4[i];
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
  }
}

// [runs, T, H, D] <-> [runs, H, T, D], elements of `elem` bytes (2 or 4).
template <typename W>
__global__ void transpose_kernel(const W* src, W* dst, int64_t tokens, int64_t heads,
                                 int64_t head_dim, bool nhd_to_hnd) {
  const int64_t run = blockIdx.x;
  const int64_t per_run = tokens * heads * head_dim;
  const W* s = src + run * per_run;
  W* d = dst + run * per_run;
  for (int64_t i = threadIdx.x; i < per_run; i += blockDim.x) {
    const int64_t dd = i % head_dim;
    const int64_t rest = i / head_dim;
    if (nhd_to_hnd) {  // i indexes the source [T, H, D]
      const int64_t h = rest % heads, t = rest / heads;
      d[(h * tokens + t) * head_dim + dd] = s[i];
    } else {  // i indexes the source [H, T, D]
      const int64_t t = rest % tokens, h = rest / tokens;
      d[(t * heads + h) * head_dim + dd] = s[i];
    }
  }
}

template <typename T> __device__ float to_float(T x);
template <> __device__ float to_float<float>(float x) { return x; }
template <> __device__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ T from_float(float x);
template <> __device__ float from_float<float>(float x) { return x; }
template <> __device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One CUDA block per run: amax reduction, scale = amax / 448 (1 when the run is all zeros),
// q = e4m3(x / scale) with round-to-nearest-even and saturation.
template <typename T>
__global__ void fp8_pack_kernel(const T* src, uint8_t* q, float* scales, int64_t run_elems) {
  __shared__ float partial[256];
  const int64_t run = blockIdx.x;
  const T* s = src + run * run_elems;
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x) amax = fmaxf(amax, fabsf(to_float(s[i])));
  partial[threadIdx.x] = amax;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  const float scale = partial[0] > 0.f ? partial[0] / 448.f : 1.f;
  if (threadIdx.x == 0) scales[run] = scale;
  uint8_t* out = q + run * run_elems;
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x) {
    __nv_fp8_e4m3 v(to_float(s[i]) / scale);
    out[i] = *reinterpret_cast<uint8_t*>(&v);
  }
}

template <typename T>
__global__ void fp8_unpack_kernel(const uint8_t* q, const float* scales, T* dst, int64_t run_elems) {
  const int64_t run = blockIdx.x;
  const float scale = scales[run];
  for (int64_t i = threadIdx.x; i < run_elems; i += blockDim.x) {
    __nv_fp8_e4m3 v;
    *reinterpret_cast<uint8_t*>(&v) = q[run * run_elems + i];
    dst[run * run_elems + i] = from_float<T>(static_cast<float>(v) * scale);
  }
}

constexpr int kThreads = 256;

}  // namespace

extern "C" {

// dtype codes shared with kernels.py: 0 float32, 1 float16, 2 bfloat16.

int tandem_gather_blocks(void* cache, void* staging, const int64_t* block_ids, int64_t num_sel,
                         int64_t num_blocks, int64_t block_bytes, void* stream) {
  if (num_sel == 0) return 0;
  dim3 grid((block_bytes + kChunk - 1) / kChunk, num_sel);
  copy_blocks_kernel<<<grid, kThreads, 0, (cudaStream_t)stream>>>(
      (uint8_t*)cache, (uint8_t*)staging, block_ids, num_blocks, block_bytes, true);
  return (int)cudaGetLastError();
}

int tandem_scatter_blocks(void* cache, void* staging, const int64_t* block_ids, int64_t num_sel,
                          int64_t num_blocks, int64_t block_bytes, void* stream) {
  if (num_sel == 0) return 0;
  dim3 grid((block_bytes + kChunk - 1) / kChunk, num_sel);
  copy_blocks_kernel<<<grid, kThreads, 0, (cudaStream_t)stream>>>(
      (uint8_t*)cache, (uint8_t*)staging, block_ids, num_blocks, block_bytes, false);
  return (int)cudaGetLastError();
}

int tandem_transpose(const void* src, void* dst, int64_t num_runs, int64_t tokens, int64_t heads,
                     int64_t head_dim, int64_t elem_bytes, int nhd_to_hnd, void* stream) {
  if (num_runs == 0) return 0;
  if (elem_bytes == 4) {
    transpose_kernel<uint32_t><<<num_runs, kThreads, 0, (cudaStream_t)stream>>>(
        (const uint32_t*)src, (uint32_t*)dst, tokens, heads, head_dim, nhd_to_hnd != 0);
  } else if (elem_bytes == 2) {
    transpose_kernel<uint16_t><<<num_runs, kThreads, 0, (cudaStream_t)stream>>>(
        (const uint16_t*)src, (uint16_t*)dst, tokens, heads, head_dim, nhd_to_hnd != 0);
  } else {
    return -1;
  }
  return (int)cudaGetLastError();
}

int tandem_fp8_pack(const void* src, void* q, float* scales, int64_t num_runs, int64_t run_elems,
                    int dtype, void* stream) {
  if (num_runs == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: fp8_pack_kernel<float><<<num_runs, kThreads, 0, s>>>((const float*)src, (uint8_t*)q, scales, run_elems); break;
    case 1: fp8_pack_kernel<__half><<<num_runs, kThreads, 0, s>>>((const __half*)src, (uint8_t*)q, scales, run_elems); break;
    case 2: fp8_pack_kernel<__nv_bfloat16><<<num_runs, kThreads, 0, s>>>((const __nv_bfloat16*)src, (uint8_t*)q, scales, run_elems); break;
    default: return -1;
  }
  return (int)cudaGetLastError();
}

int tandem_fp8_unpack(const void* q, const float* scales, void* dst, int64_t num_runs,
                      int64_t run_elems, int dtype, void* stream) {
  if (num_runs == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: fp8_unpack_kernel<float><<<num_runs, kThreads, 0, s>>>((const uint8_t*)q, scales, (float*)dst, run_elems); break;
    case 1: fp8_unpack_kernel<__half><<<num_runs, kThreads, 0, s>>>((const uint8_t*)q, scales, (__half*)dst, run_elems); break;
    case 2: fp8_unpack_kernel<__nv_bfloat16><<<num_runs, kThreads, 0, s>>>((const uint8_t*)q, scales, (__nv_bfloat16*)dst, run_elems); break;
    default: return -1;
  }
  return (int)cudaGetLastError();
}

}  // extern "C"
