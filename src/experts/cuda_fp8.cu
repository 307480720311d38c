// Elementwise kernels of the fp8 block-scaled CUDA experts (see cuda_fp8.hpp): semantics §6 quantization
// of the input rows and of the activation output, and the scale/row reordering cuBLASLt's block-scaled GEMMs
// need. Quantization works one warp per (row, group of 128 channels): each lane holds 4 consecutive channels,
// the group's absolute maximum is a warp reduction, and the arithmetic is semantics §6's float32 rule
// (a = max(amax, 1e-4); q = fp8(x * (448 / a)); scale = a / 448), the one quant.hpp implements.
#include "experts/cuda_fp8.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/cuda_check.hpp"
#include "experts/activation.cuh"

namespace epmoe::experts_cuda_fp8 {

namespace {

using experts_cuda::act_value;

constexpr int kGroup = 128;
constexpr int kWarpsPerBlock = 8;

struct Place {
  bool live;
  std::int64_t r0, n;  // first row and row count of the segment holding the row
};

// The segment of GEMM row o. `check_count`: batched rows past their slab's count are not live.
__device__ __forceinline__ Place locate(const Segments& s, std::int64_t o, bool check_count) {
  if (s.seg != nullptr) {
    if (o >= s.seg[s.e_local]) return {false, 0, 0};
    int lo = 0, hi = s.e_local - 1;  // the last e with seg[e] <= o (its segment is non-empty)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s.seg[mid] <= o) lo = mid;
      else hi = mid - 1;
    }
    return {true, s.seg[lo], s.seg[lo + 1] - s.seg[lo]};
  }
  const std::int64_t e = o / s.slab, t = o - e * s.slab;
  bool live = true;
  if (check_count) {
    std::int64_t c = s.counts != nullptr ? static_cast<std::int64_t>(s.counts[e]) : s.valid;
    c = c < 0 ? 0 : (c > s.valid ? s.valid : c);
    live = t < c;
  }
  return {live, e * s.slab, s.slab};
}

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ std::uint32_t fp8x4(const float* v, float inv) {
  std::uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t b = __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3);
    w |= (b & 0xffu) << (8 * i);
  }
  return w;
}

// Quantizes the 4 values of each lane of one group; lanes past the row's end hold `valid` = false. Returns
// the group's scale (every lane) and writes the lane's 4 codes to *q when valid.
__device__ __forceinline__ float quantize_group(const float* v, bool valid, std::uint32_t* q) {
  float amax = 0.0f;
  if (valid)
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = warp_amax(amax);
  const float a = amax > 1e-4f ? amax : 1e-4f;
  const float inv = 448.0f / a;
  if (valid) *q = fp8x4(v, inv);
  return a / 448.0f;
}

__device__ __forceinline__ void store_scale(float* scales, bool transposed, std::int64_t groups, std::int64_t g,
                                            std::int64_t o, const Place& p, float scale) {
  if (transposed) scales[p.r0 * groups + g * p.n + (o - p.r0)] = scale;
  else scales[o * groups + g] = scale;
}

template <bool kFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    quantize_rows_kernel(const void* __restrict__ x, std::int64_t rows, std::int64_t h, std::int64_t groups,
                         const float* __restrict__ weights, std::int64_t weight_stride, std::int64_t in_slab,
                         std::int64_t out_slab, std::uint8_t* __restrict__ q, float* __restrict__ scales,
                         bool transposed, Segments seg) {
  const std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows * groups) return;
  const std::int64_t r = w / groups, g = w - r * groups;
  const std::int64_t o = (r / in_slab) * out_slab + r % in_slab;
  const Place p = transposed ? locate(seg, o, true) : Place{seg.counts == nullptr || locate(seg, o, true).live, 0, 0};
  if (!p.live) return;  // uniform over the warp
  const std::int64_t c = g * kGroup + lane * 4;
  const bool valid = c < h;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (valid) {
    if constexpr (kFp32) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(x) + r * h + c));
      v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
    } else {
      const uint2 b = __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(x) + r * h + c));
      v[0] = __uint_as_float(b.x << 16);
      v[1] = __uint_as_float(b.x & 0xffff0000u);
      v[2] = __uint_as_float(b.y << 16);
      v[3] = __uint_as_float(b.y & 0xffff0000u);
    }
    if (weights != nullptr) {
      const float wt = weights[r * weight_stride];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __fmul_rn(v[i], wt);
    }
  }
  std::uint32_t codes = 0;
  const float scale = quantize_group(v, valid, &codes);
  if (valid) *reinterpret_cast<std::uint32_t*>(q + o * h + c) = codes;
  if (lane == 0) store_scale(scales, transposed, groups, g, o, p, scale);
}

__global__ void transpose_scales_kernel(const float* __restrict__ src, std::int64_t rows_total, std::int64_t groups,
                                        Segments seg, float* __restrict__ dst) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows_total * groups) return;
  const std::int64_t o = i / groups, g = i - o * groups;
  const Place p = locate(seg, o, false);
  if (!p.live) return;
  float v;
  if (seg.seg != nullptr) {
    v = src[o * groups + g];
  } else {
    const std::int64_t e = o / seg.slab, t = o - e * seg.slab;
    v = t < seg.valid ? src[(e * seg.valid + t) * groups + g] : 0.0f;
  }
  dst[p.r0 * groups + g * p.n + (o - p.r0)] = v;
}

template <Activation A>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    activation_quant_kernel(const float* __restrict__ gin, std::int64_t rows_total, std::int64_t n,
                            std::int64_t groups, Segments seg, std::uint8_t* __restrict__ a, std::int64_t a_stride,
                            float* __restrict__ scales) {
  constexpr bool kGated = A == Activation::silu || A == Activation::gelu || A == Activation::swigluoai;
  const std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows_total * groups) return;
  const std::int64_t o = w / groups, g = w - o * groups;
  const Place p = locate(seg, o, true);
  if (!p.live) return;
  const std::int64_t c = g * kGroup + lane * 4;
  const bool valid = c < n;
  const float* row = gin + o * (kGated ? 2 * n : n);
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (valid) {
    float gate[4], up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (A == Activation::swigluoai) {
      const float4 f0 = __ldg(reinterpret_cast<const float4*>(row + 2 * c));
      const float4 f1 = __ldg(reinterpret_cast<const float4*>(row + 2 * c + 4));
      gate[0] = f0.x; up[0] = f0.y; gate[1] = f0.z; up[1] = f0.w;
      gate[2] = f1.x; up[2] = f1.y; gate[3] = f1.z; up[3] = f1.w;
    } else {
      const float4 f = __ldg(reinterpret_cast<const float4*>(row + c));
      gate[0] = f.x; gate[1] = f.y; gate[2] = f.z; gate[3] = f.w;
      if constexpr (kGated) {
        const float4 u = __ldg(reinterpret_cast<const float4*>(row + n + c));
        up[0] = u.x; up[1] = u.y; up[2] = u.z; up[3] = u.w;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = act_value<A>(gate[i], up[i]);
  }
  std::uint32_t codes = 0;
  const float scale = quantize_group(v, valid, &codes);
  if (valid) *reinterpret_cast<std::uint32_t*>(a + o * a_stride + c) = codes;
  if (lane == 0) store_scale(scales, true, groups, g, o, p, scale);
}

__global__ void pad_weight_scales_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t kb,
                                         std::int64_t kb4, float* __restrict__ dst) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * kb4) return;
  const std::int64_t r = i / kb4, j = i - r * kb4;
  dst[i] = j < kb ? src[r * kb + j] : 0.0f;
}

__global__ void copy_slab_rows_kernel(const uint4* __restrict__ src, std::int64_t src_slab, uint4* __restrict__ dst,
                                      std::int64_t dst_slab, std::int64_t rows, std::int64_t vecs,
                                      const std::int32_t* __restrict__ counts) {
  const std::int64_t e = blockIdx.x / rows, t = blockIdx.x - e * rows;
  if (counts != nullptr) {
    std::int64_t c = counts[e];
    c = c < 0 ? 0 : (c > rows ? rows : c);
    if (t >= c) return;
  }
  const uint4* s = src + (e * src_slab + t) * vecs;
  uint4* d = dst + (e * dst_slab + t) * vecs;
  for (std::int64_t v = threadIdx.x; v < vecs; v += blockDim.x) d[v] = __ldg(s + v);
}

unsigned blocks_for(std::int64_t items, std::int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

}  // namespace

void quantize_rows(const void* x, bool x_fp32, std::int64_t rows, std::int64_t h, const float* weights,
                   std::int64_t weight_stride, std::int64_t in_slab, std::int64_t out_slab, std::uint8_t* q,
                   float* scales, bool transposed, const Segments& seg, cudaStream_t stream) {
  if (rows == 0) return;
  const std::int64_t groups = (h + kGroup - 1) / kGroup;
  const unsigned grid = blocks_for(rows * groups, kWarpsPerBlock);
  if (x_fp32)
    quantize_rows_kernel<true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        x, rows, h, groups, weights, weight_stride, in_slab, out_slab, q, scales, transposed, seg);
  else
    quantize_rows_kernel<false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        x, rows, h, groups, weights, weight_stride, in_slab, out_slab, q, scales, transposed, seg);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void transpose_scales(const float* src, std::int64_t rows_total, std::int64_t groups, const Segments& seg, float* dst,
                      cudaStream_t stream) {
  if (rows_total * groups == 0) return;
  transpose_scales_kernel<<<blocks_for(rows_total * groups, 256), 256, 0, stream>>>(src, rows_total, groups, seg, dst);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void activation_quant(Activation act, const float* g, std::int64_t rows_total, std::int64_t n, const Segments& seg,
                      std::uint8_t* a, std::int64_t a_stride, float* scales, cudaStream_t stream) {
  if (rows_total == 0) return;
  const std::int64_t groups = (n + kGroup - 1) / kGroup;
  const unsigned grid = blocks_for(rows_total * groups, kWarpsPerBlock);
  constexpr unsigned kThreads = kWarpsPerBlock * 32;
#define EPMOE_FP8_ACT_CASE(A)                                                                                       \
  case A:                                                                                                           \
    activation_quant_kernel<A><<<grid, kThreads, 0, stream>>>(g, rows_total, n, groups, seg, a, a_stride, scales); \
    break;
  switch (act) {
    EPMOE_FP8_ACT_CASE(Activation::silu)
    EPMOE_FP8_ACT_CASE(Activation::gelu)
    EPMOE_FP8_ACT_CASE(Activation::swigluoai)
    EPMOE_FP8_ACT_CASE(Activation::silu_no_mul)
    EPMOE_FP8_ACT_CASE(Activation::gelu_no_mul)
    EPMOE_FP8_ACT_CASE(Activation::relu2_no_mul)
  }
#undef EPMOE_FP8_ACT_CASE
  EPMOE_CUDA_CHECK_LAUNCH();
}

void pad_weight_scales(const float* src, std::int64_t rows, std::int64_t kb, std::int64_t kb4, float* dst,
                       cudaStream_t stream) {
  if (rows * kb4 == 0) return;
  pad_weight_scales_kernel<<<blocks_for(rows * kb4, 256), 256, 0, stream>>>(src, rows, kb, kb4, dst);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void copy_slab_rows(const void* src, std::int64_t src_slab, void* dst, std::int64_t dst_slab, int e_local,
                    std::int64_t rows, std::int64_t row_bytes, const std::int32_t* counts, cudaStream_t stream) {
  if (e_local == 0 || rows == 0) return;
  copy_slab_rows_kernel<<<static_cast<unsigned>(e_local * rows), 128, 0, stream>>>(
      static_cast<const uint4*>(src), src_slab, static_cast<uint4*>(dst), dst_slab, rows, row_bytes / 16, counts);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::experts_cuda_fp8
