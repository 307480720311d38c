// Elementwise kernels of the CUDA experts (see cuda.hpp): id mapping, input preparation, the
// fused activation after gemm1, and the final row copies. The GEMMs are cuBLAS calls on the host side.
//
// Every kernel moves rows in 16-byte vectors (8 bf16), one block per row: rows here are long (H or N in
// the thousands) and row-major, so a block's loads are contiguous and fully coalesced.
#include "experts/cuda.hpp"

#include <cuda_bf16.h>

#include "core/bf16_device.cuh"
#include "core/cuda_check.hpp"
#include "experts/activation.cuh"

namespace epmoe::experts_cuda {

namespace {

constexpr int kRowThreads = 128;

__device__ __forceinline__ std::uint32_t bf16_bits(float f) {
  return static_cast<std::uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f)));
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  std::uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = bf16_bits(f[2 * i]) | (bf16_bits(f[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Rows of slab e past its count are skipped; a count outside [0, max_tokens] is clamped.
__device__ __forceinline__ bool row_active(const std::int32_t* counts, std::int64_t max_tokens, std::int64_t row) {
  if (counts == nullptr) return true;
  const std::int64_t e = row / max_tokens, t = row - e * max_tokens;
  const std::int64_t c = counts[e];
  return t < (c < 0 ? 0 : c);
}

// ---- ids ----------------------------------------------------------------------------------------

template <class Id>
__global__ void map_ids_kernel(const Id* __restrict__ idx, std::int64_t n, const std::int32_t* __restrict__ map,
                               std::int64_t map_size, std::int64_t limit, int e_local, std::int32_t* __restrict__ local,
                               IdFlags* __restrict__ flags) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (map != nullptr)
    for (std::int64_t g = first; g < map_size; g += stride) {
      const std::int32_t v = map[g];
      if (v < -1 || v >= e_local) atomicMin(&flags->bad_map, static_cast<unsigned long long>(g));
    }
  for (std::int64_t i = first; i < n; i += stride) {
    const std::int64_t id = static_cast<std::int64_t>(idx[i]);
    std::int32_t out = -1;
    if (id < -1 || id >= limit) {
      atomicMin(&flags->bad_id, static_cast<unsigned long long>(i));
    } else if (id >= 0) {
      const std::int64_t l = map != nullptr ? static_cast<std::int64_t>(map[id]) : id;
      out = (l >= 0 && l < e_local) ? static_cast<std::int32_t>(l) : -1;  // a bad map entry is flagged above
    }
    local[i] = out;
  }
}

// ---- hidden -------------------------------------------------------------------------------------

template <bool kFp32>
__global__ void __launch_bounds__(kRowThreads)
    prepare_hidden_kernel(const void* __restrict__ hidden, std::int64_t vecs, const float* __restrict__ weights,
                          std::int64_t weight_stride, uint4* __restrict__ out) {
  const std::int64_t r = blockIdx.x;
  const float w = weights != nullptr ? weights[r * weight_stride] : 1.0f;
  for (std::int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    float f[8];
    if constexpr (kFp32) {
      const float4* src = static_cast<const float4*>(hidden) + (r * vecs + v) * 2;
      const float4 a = __ldg(src), b = __ldg(src + 1);
      f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
      f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
      unpack_bf16x8(__ldg(static_cast<const uint4*>(hidden) + r * vecs + v), f);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(f[i], w);
    out[r * vecs + v] = pack8(f);
  }
}

// ---- activation ---------------------------------------------------------------------------------

// One block per row; each thread makes 8 consecutive outputs from 16-byte loads: gate and up halves of
// the row (silu, gelu), 16 interleaved values (swigluoai), or 8 values (non-gated).
template <Activation A>
__global__ void __launch_bounds__(kRowThreads)
    activation_kernel(const uint4* __restrict__ g, std::int64_t n, uint4* __restrict__ a,
                      const std::int32_t* __restrict__ counts, std::int64_t max_tokens) {
  const std::int64_t row = blockIdx.x;
  if (!row_active(counts, max_tokens, row)) return;
  constexpr bool kGated = A == Activation::silu || A == Activation::gelu || A == Activation::swigluoai;
  const std::int64_t nv = n / 8;                      // output vectors per row
  const std::int64_t in_vecs = kGated ? 2 * nv : nv;  // input vectors per row
  const uint4* gr = g + row * in_vecs;
  uint4* ar = a + row * nv;
  for (std::int64_t v = threadIdx.x; v < nv; v += kRowThreads) {
    float gate[8], up[8], out[8];
    if constexpr (A == Activation::swigluoai) {
      float f[16];
      unpack_bf16x8(__ldg(gr + 2 * v), f);
      unpack_bf16x8(__ldg(gr + 2 * v + 1), f + 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        gate[i] = f[2 * i];
        up[i] = f[2 * i + 1];
      }
    } else if constexpr (kGated) {
      unpack_bf16x8(__ldg(gr + v), gate);
      unpack_bf16x8(__ldg(gr + nv + v), up);
    } else {
      unpack_bf16x8(__ldg(gr + v), gate);
#pragma unroll
      for (int i = 0; i < 8; ++i) up[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = act_value<A>(gate[i], up[i]);
    ar[v] = pack8(out);
  }
}

// ---- output copies ------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const uint4* __restrict__ y, const std::int32_t* __restrict__ src2dst, std::int64_t vecs,
                       uint4* __restrict__ out) {
  const std::int64_t o = blockIdx.x;
  const std::int32_t d = src2dst[o];
  uint4* dst = out + o * vecs;
  if (d < 0) {
    for (std::int64_t v = threadIdx.x; v < vecs; v += kRowThreads) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* src = y + static_cast<std::int64_t>(d) * vecs;
  for (std::int64_t v = threadIdx.x; v < vecs; v += kRowThreads) dst[v] = __ldg(src + v);
}

__global__ void __launch_bounds__(kRowThreads)
    masked_copy_kernel(const uint4* __restrict__ y, const std::int32_t* __restrict__ counts, std::int64_t max_tokens,
                       std::int64_t vecs, uint4* __restrict__ out) {
  const std::int64_t row = blockIdx.x;
  if (!row_active(counts, max_tokens, row)) return;
  for (std::int64_t v = threadIdx.x; v < vecs; v += kRowThreads) out[row * vecs + v] = __ldg(y + row * vecs + v);
}

// Release order: the rows were stored by earlier kernels of this stream (complete, device-visible); the fence
// orders this thread's view before its add, which the combine reads with an acquire load.
__global__ void write_combine_signal_kernel(void* signal, bool per_expert, const std::int32_t* __restrict__ count_e,
                                            int e, std::int64_t max_tokens, std::int64_t block_m,
                                            std::int64_t blocks_per_expert, int adds) {
  __threadfence();
  if (per_expert) {
    if (threadIdx.x == 0) atomicAdd(static_cast<unsigned*>(signal) + e, 1u);
    return;
  }
  std::int64_t n = *count_e;
  n = n < 0 ? 0 : (n > max_tokens ? max_tokens : n);
  for (std::int64_t b = threadIdx.x; b * block_m < n; b += blockDim.x)
    atomicAdd(static_cast<int*>(signal) + e * blocks_per_expert + b, adds);
}

unsigned grid_rows(std::int64_t rows) { return static_cast<unsigned>(rows); }

}  // namespace

void map_ids(const void* idx, bool idx64, std::int64_t n, const std::int32_t* map, std::int64_t map_size,
             std::int64_t limit, int e_local, std::int32_t* local, IdFlags* flags, cudaStream_t stream) {
  const std::int64_t work = n > map_size ? n : map_size;
  if (work == 0) return;
  constexpr int kThreads = 256;
  std::int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > 4096) blocks = 4096;
  if (idx64)
    map_ids_kernel<std::int64_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const std::int64_t*>(idx), n, map, map_size, limit, e_local, local, flags);
  else
    map_ids_kernel<std::int32_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const std::int32_t*>(idx), n, map, map_size, limit, e_local, local, flags);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void prepare_hidden(const void* hidden, bool hidden_fp32, std::int64_t rows, std::int64_t h, const float* weights,
                    std::int64_t weight_stride, void* out, cudaStream_t stream) {
  if (rows == 0) return;
  const std::int64_t vecs = h / 8;
  if (hidden_fp32)
    prepare_hidden_kernel<true><<<grid_rows(rows), kRowThreads, 0, stream>>>(hidden, vecs, weights, weight_stride,
                                                                            static_cast<uint4*>(out));
  else
    prepare_hidden_kernel<false><<<grid_rows(rows), kRowThreads, 0, stream>>>(hidden, vecs, weights, weight_stride,
                                                                             static_cast<uint4*>(out));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void activation(Activation act, const void* g, std::int64_t rows, std::int64_t n, void* a, const std::int32_t* counts,
                std::int64_t max_tokens, cudaStream_t stream) {
  if (rows == 0) return;
  const auto* gv = static_cast<const uint4*>(g);
  auto* av = static_cast<uint4*>(a);
  const unsigned grid = grid_rows(rows);
  switch (act) {
    case Activation::silu:
      activation_kernel<Activation::silu><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
    case Activation::gelu:
      activation_kernel<Activation::gelu><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
    case Activation::swigluoai:
      activation_kernel<Activation::swigluoai><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
    case Activation::silu_no_mul:
      activation_kernel<Activation::silu_no_mul><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
    case Activation::gelu_no_mul:
      activation_kernel<Activation::gelu_no_mul><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
    case Activation::relu2_no_mul:
      activation_kernel<Activation::relu2_no_mul><<<grid, kRowThreads, 0, stream>>>(gv, n, av, counts, max_tokens);
      break;
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void gather_rows(const void* y, const std::int32_t* src2dst, std::int64_t rows, std::int64_t h, void* out,
                 cudaStream_t stream) {
  if (rows == 0) return;
  gather_rows_kernel<<<grid_rows(rows), kRowThreads, 0, stream>>>(static_cast<const uint4*>(y), src2dst, h / 8,
                                                                   static_cast<uint4*>(out));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void masked_copy(const void* y, const std::int32_t* counts, int e_local, std::int64_t max_tokens, std::int64_t h,
                 void* out, cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(e_local) * max_tokens;
  if (rows == 0) return;
  masked_copy_kernel<<<grid_rows(rows), kRowThreads, 0, stream>>>(static_cast<const uint4*>(y), counts, max_tokens,
                                                                   h / 8, static_cast<uint4*>(out));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void write_combine_signal(void* signal, bool per_expert, const std::int32_t* count_e, int e, std::int64_t max_tokens,
                          std::int64_t block_m, std::int64_t blocks_per_expert, int adds, cudaStream_t stream) {
  write_combine_signal_kernel<<<1, 128, 0, stream>>>(signal, per_expert, count_e, e, max_tokens, block_m,
                                                     blocks_per_expert, adds);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::experts_cuda
