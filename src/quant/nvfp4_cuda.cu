// NVFP4 quantization and dequantization on CUDA (semantics §6, "NVFP4"); the CPU twin is quant/nvfp4_cpu.cpp. Both
// apply include/epmoe/nvfp4.hpp's scalar rules (nvfp4_block_scale, float_to_e2m1, nvfp4_dequant_factor, whose device
// branches use the IEEE intrinsics), so they agree bit for bit; the block maximum is fmaxf over |x| (NaN skipped),
// the CPU's integer maximum of |x| bits with NaN counted as 0.
//
// A thread per block of 16 channels: quantize loads the block (two 16-byte loads of bf16, four of float32), stores
// its 8 code bytes and its scale byte; with the swizzled layout the padding tokens of the last row of tiles get a
// scale of 0. Dequantize reads 8 code bytes and a scale, stores 16 values.
#include <epmoe/nvfp4.hpp>

#include <string>

#include "core/cuda_util.hpp"
#include "quant/quant.hpp"

namespace epmoe::quant_detail {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_global_scale(float value, const float* device) {
  return device != nullptr ? __ldg(device) : value;
}

template <int kInBytes>
__global__ void __launch_bounds__(kThreads)
    nvfp4_quantize_kernel(const char* __restrict__ x, std::int64_t x_stride_bytes, std::uint8_t* __restrict__ q,
                          std::int64_t q_stride, bool q_vector, std::uint8_t* __restrict__ scales,
                          std::int64_t s_stride, Nvfp4ScaleLayout layout, std::int64_t T, std::int64_t rows,
                          int blocks, float gs_value, const float* gs_device) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * blocks) return;
  const std::int64_t t = i / blocks;
  const int j = static_cast<int>(i - t * blocks);
  const std::int64_t col_tiles = (blocks + kNvfp4TileCols - 1) / kNvfp4TileCols;
  std::uint8_t* scale = scales + nvfp4_scale_at(layout, t, j, s_stride, col_tiles);
  if (t >= T) {  // a padding token of the swizzled layout
    *scale = 0;
    return;
  }
  constexpr int kVecs = kInBytes == 2 ? 2 : 4;
  uint4 raw[kVecs];
  const uint4* src = reinterpret_cast<const uint4*>(x + t * x_stride_bytes) + static_cast<std::int64_t>(j) * kVecs;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) raw[v] = __ldg(src + v);
  float v[kNvfp4BlockSize];
  unpack16<kInBytes>(raw, v);
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kNvfp4BlockSize; ++e) amax = fmaxf(amax, fabsf(v[e]));
  const Nvfp4BlockScale s = nvfp4_block_scale(amax, load_global_scale(gs_value, gs_device));
  *scale = s.code.bits;
  std::uint32_t words[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < kNvfp4BlockSize; ++e)
    words[e / 8] |= static_cast<std::uint32_t>(float_to_e2m1(__fmul_rn(v[e], s.multiplier))) << (4 * (e % 8));
  std::uint8_t* dst = q + t * q_stride + static_cast<std::int64_t>(j) * (kNvfp4BlockSize / 2);
  if (q_vector) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
#pragma unroll
    for (int b = 0; b < 8; ++b) dst[b] = static_cast<std::uint8_t>(words[b / 4] >> (8 * (b % 4)));
  }
}

// Block j of row t: 8 code bytes and its scale -> 16 values at `out` (16-byte aligned).
template <class Out>
__device__ __forceinline__ void dequantize_block(const std::uint8_t* __restrict__ q, std::uint8_t scale, float gs,
                                                 Out* __restrict__ out) {
  const float f = nvfp4_dequant_factor(fp8_e4m3_t{scale}, gs);
  float v[kNvfp4BlockSize];
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const std::uint8_t byte = q[b];
    v[2 * b] = __fmul_rn(e2m1_to_float(static_cast<std::uint8_t>(byte & 0xfu)), f);
    v[2 * b + 1] = __fmul_rn(e2m1_to_float(static_cast<std::uint8_t>(byte >> 4)), f);
  }
  uint4* dst = reinterpret_cast<uint4*>(out);
  if constexpr (sizeof(Out) == 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      dst[k] = make_uint4(__float_as_uint(v[4 * k]), __float_as_uint(v[4 * k + 1]), __float_as_uint(v[4 * k + 2]),
                          __float_as_uint(v[4 * k + 3]));
  } else {
    std::uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      w[k] = static_cast<std::uint32_t>(float_to_bf16(v[2 * k]).bits) |
             (static_cast<std::uint32_t>(float_to_bf16(v[2 * k + 1]).bits) << 16);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

template <class Out>
__global__ void __launch_bounds__(kThreads)
    nvfp4_dequantize_kernel(const std::uint8_t* __restrict__ q, std::int64_t q_stride,
                            const std::uint8_t* __restrict__ scales, std::int64_t s_stride, Nvfp4ScaleLayout layout,
                            Out* __restrict__ out, std::int64_t T, int blocks, float gs_value,
                            const float* gs_device) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * blocks) return;
  const std::int64_t t = i / blocks;
  const int j = static_cast<int>(i - t * blocks);
  const std::int64_t col_tiles = (blocks + kNvfp4TileCols - 1) / kNvfp4TileCols;
  dequantize_block(q + t * q_stride + static_cast<std::int64_t>(j) * (kNvfp4BlockSize / 2),
                   scales[nvfp4_scale_at(layout, t, j, s_stride, col_tiles)], load_global_scale(gs_value, gs_device),
                   out + (t * blocks + j) * kNvfp4BlockSize);
}

/// Slabs [E, rows, H / 2] with swizzled scales per slab: blockIdx.x = slab e, the blocks of a slab stride over its
/// first min(masked_m[e], rows) rows' 16-channel blocks.
template <class Out>
__global__ void __launch_bounds__(kThreads)
    nvfp4_dequantize_masked_kernel(const std::uint8_t* __restrict__ q, const std::uint8_t* __restrict__ scales,
                                   Out* __restrict__ out, const std::int32_t* __restrict__ masked_m,
                                   std::int64_t rows, int blocks, float gs_value, const float* gs_device) {
  const int e = blockIdx.x;
  const std::int64_t n = masked_m[e] < 0 ? 0 : (masked_m[e] > rows ? rows : masked_m[e]);
  const std::int64_t col_tiles = (blocks + kNvfp4TileCols - 1) / kNvfp4TileCols;
  const std::int64_t slab_scale_bytes = nvfp4_row_tiles(rows) * col_tiles * kNvfp4TileBytes;
  const float gs = load_global_scale(gs_value, gs_device);
  const std::int64_t row_bytes = static_cast<std::int64_t>(blocks) * (kNvfp4BlockSize / 2);
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < n * blocks;
       i += static_cast<std::int64_t>(gridDim.y) * blockDim.x) {
    const std::int64_t t = i / blocks;
    const int j = static_cast<int>(i - t * blocks);
    const std::int64_t row = e * rows + t;
    dequantize_block(q + row * row_bytes + static_cast<std::int64_t>(j) * (kNvfp4BlockSize / 2),
                     scales[e * slab_scale_bytes + nvfp4_scale_at(Nvfp4ScaleLayout::swizzled, t, j,
                                                                  col_tiles * kNvfp4TileBytes, col_tiles)],
                     gs, out + (row * blocks + j) * kNvfp4BlockSize);
  }
}

unsigned grid_for(std::int64_t threads) {
  return static_cast<unsigned>(cuda_util::ceil_div(threads < 1 ? 1 : threads, kThreads));
}

}  // namespace

void quantize_nvfp4_cuda(const Nvfp4Problem& p, Stream stream) {
  const std::int64_t T = p.num_tokens, H = p.hidden;
  const std::int64_t rows = p.layout == Nvfp4ScaleLayout::linear ? T : nvfp4_row_tiles(T) * kNvfp4TileRows;
  if (rows == 0) return;
  const auto elem = static_cast<std::int64_t>(dtype_size(p.x.dtype));
  if (!cuda_util::aligned16(p.x.data) || (T > 1 && (p.x.stride(0) * elem) % 16 != 0))
    throw_invalid_argument("x", "16-byte-aligned rows on CUDA (data pointer and row stride in bytes multiples of 16)",
                           describe(p.x) + " with row stride " + std::to_string(p.x.stride(0)));
  cuda_util::DeviceGuard guard(p.x.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const int blocks = static_cast<int>(H / kNvfp4BlockSize);
  const bool q_vector = reinterpret_cast<std::uintptr_t>(p.q.data) % 8 == 0 && (T <= 1 || p.q.stride(0) % 8 == 0);
  auto launch = [&](auto kernel) {
    kernel<<<grid_for(rows * blocks), kThreads, 0, s>>>(
        static_cast<const char*>(p.x.data), p.x.stride(0) * elem, static_cast<std::uint8_t*>(p.q.data),
        p.q.stride(0), q_vector, static_cast<std::uint8_t*>(p.scales.data), p.scales.stride(0), p.layout, T, rows,
        blocks, p.global_scale.value, p.global_scale.device);
  };
  if (p.x.dtype == DType::bf16)
    launch(nvfp4_quantize_kernel<2>);
  else
    launch(nvfp4_quantize_kernel<4>);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_nvfp4_cuda(const TensorView& q, const TensorView& scales, Nvfp4ScaleLayout layout,
                           const GlobalScale& gs, const TensorView& out, Stream stream) {
  const std::int64_t T = q.size(0);
  if (T == 0) return;
  cuda_util::DeviceGuard guard(q.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const int blocks = static_cast<int>(2 * q.size(1) / kNvfp4BlockSize);
  const auto* qp = static_cast<const std::uint8_t*>(q.data);
  const auto* sp = static_cast<const std::uint8_t*>(scales.data);
  if (out.dtype == DType::bf16)
    nvfp4_dequantize_kernel<bf16_t><<<grid_for(T * blocks), kThreads, 0, s>>>(
        qp, q.stride(0), sp, scales.stride(0), layout, static_cast<bf16_t*>(out.data), T, blocks, gs.value, gs.device);
  else
    nvfp4_dequantize_kernel<float><<<grid_for(T * blocks), kThreads, 0, s>>>(
        qp, q.stride(0), sp, scales.stride(0), layout, static_cast<float*>(out.data), T, blocks, gs.value, gs.device);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_nvfp4_masked_cuda(const TensorView& q, const TensorView& scales, const GlobalScale& gs,
                                  const TensorView& out, const std::int32_t* masked_m, Stream stream) {
  const std::int64_t E = q.size(0), rows = q.size(1);
  if (E == 0 || rows == 0) return;
  cuda_util::DeviceGuard guard(q.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const int blocks = static_cast<int>(2 * q.size(2) / kNvfp4BlockSize);
  const dim3 grid(static_cast<unsigned>(E), static_cast<unsigned>(rows < 8 ? rows : 8));
  const auto* qp = static_cast<const std::uint8_t*>(q.data);
  const auto* sp = static_cast<const std::uint8_t*>(scales.data);
  if (out.dtype == DType::bf16)
    nvfp4_dequantize_masked_kernel<bf16_t><<<grid, kThreads, 0, s>>>(qp, sp, static_cast<bf16_t*>(out.data), masked_m,
                                                                    rows, blocks, gs.value, gs.device);
  else
    nvfp4_dequantize_masked_kernel<float><<<grid, kThreads, 0, s>>>(qp, sp, static_cast<float*>(out.data), masked_m,
                                                                   rows, blocks, gs.value, gs.device);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::quant_detail
