// FP8 per-token-group quantization and dequantization on CUDA (semantics §6); the CPU twin is quant/cpu.cpp
// and every step below mirrors its float32 arithmetic, so the two agree bit for bit.
//
// Quantize: 8 lanes per group of 128 channels, 16 channels per lane (two 16-byte loads for bf16, four
// for float32; one 16-byte fp8 store). A warp covers the four groups that share one UE8M0 word of one
// row, so the word is assembled with three shuffles and written once (optionally four such words per
// warp, all loads first). The group's absolute maximum (NaN skipped, as on the CPU) is reduced with three
// xor-shuffles; scale and inverse are computed as quant.hpp's group_scale does.
// Dequantize: one thread per 16 values.
#include <epmoe/quant.hpp>

#include <string>

#include "core/cuda_util.hpp"
#include "quant/quant.hpp"

namespace epmoe::quant_detail {

namespace {

constexpr int kQuantWarps = 8;  // warps per block
constexpr int kChannelsPerLane = 16;
constexpr int kLanesPerGroup = kFp8GroupSize / kChannelsPerLane;  // 8

// One task = the four groups of one row that share a UE8M0 word, 8 lanes per group, 16 channels per
// lane. A warp takes kTasks consecutive tasks and issues all their loads before using any (64 or 128
// bytes in flight per thread for bf16 or float32 with kTasks = 4).
//
// The group maximum is fmaxf over |x| (fmaxf ignores a NaN operand; for the other values the float
// order of |x| is the order of its bits), which equals the CPU's integer max of |x| bit patterns with
// NaN counted as 0. probe = fma(x, 0, probe) turns NaN iff some x is an inf or a NaN: only then can
// x * inv be NaN, and only then is the NaN fix-up of the conversion needed.
template <class In, bool kHardware, int kTasks>
__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_kernel(const char* __restrict__ x, std::int64_t x_stride_bytes, std::uint8_t* __restrict__ q,
                    std::int64_t q_stride, void* __restrict__ scales, std::int64_t s_stride, std::int64_t s_col,
                    std::int64_t num_tasks,
                    int H, int G, int words_per_row, bool round_scale, bool ue8m0) {
  constexpr int kVecs = sizeof(In) == 2 ? 2 : 4;  // 16-byte loads per lane per task
  const int lane = threadIdx.x & 31;
  const std::int64_t first = (static_cast<std::int64_t>(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5)) * kTasks;
  if (first >= num_tasks) return;  // whole warps only
  // (row, word) of the first task; the next tasks step through the words of the rows.
  const std::int64_t t0 = first / words_per_row;
  const int word0 = static_cast<int>(first - t0 * words_per_row);

  uint4 raw[kTasks][kVecs];
  {
    std::int64_t t = t0;
    int word = word0;
#pragma unroll
    for (int i = 0; i < kTasks; ++i) {
      const int g = word * 4 + (lane >> 3);
      const int c = g * kLanesPerGroup + (lane & 7);  // 16-channel chunk of the row
      if (first + i < num_tasks && g < G && c * kChannelsPerLane < H) {
        const uint4* src = reinterpret_cast<const uint4*>(x + t * x_stride_bytes) + kVecs * c;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) raw[i][j] = __ldg(src + j);
      }
      if (++word == words_per_row) {
        word = 0;
        ++t;
      }
    }
  }

  std::int64_t t = t0;
  int word = word0;
#pragma unroll
  for (int i = 0; i < kTasks; ++i) {
    if (first + i >= num_tasks) break;  // uniform over the warp
    const int g = word * 4 + (lane >> 3);
    const int c = g * kLanesPerGroup + (lane & 7);
    const bool active = g < G && c * kChannelsPerLane < H;

    static_assert(kChannelsPerLane == 16, "quantize_lane16 takes 16 channels per lane");
    float v[kChannelsPerLane];
    if (active) unpack16<static_cast<int>(sizeof(In))>(raw[i], v);
    uint4 out;
    const DeviceGroupScale s = quantize_lane16<kHardware>(v, active, round_scale, &out);
    if (active) *reinterpret_cast<uint4*>(q + t * q_stride + static_cast<std::int64_t>(c) * kChannelsPerLane) = out;
    if (!ue8m0) {
      if ((lane & 7) == 0 && g < G) static_cast<float*>(scales)[t * s_stride + g * s_col] = s.scale;
    } else {
      const std::int32_t packed = ue8m0_word(s.exponent, g < G);  // bytes past the last group are 0
      if (lane == 0) static_cast<std::int32_t*>(scales)[t * s_stride + word * s_col] = packed;
    }
    if (++word == words_per_row) {
      word = 0;
      ++t;
    }
  }
}

// x86's float multiply, NaNs included (the CPU twin's arithmetic): a NaN operand comes back quieted
// (the first one if both are), and an invalid product (0 * inf) is the x86 default NaN 0xffc00000.
// CUDA would return its canonical NaN 0x7fffffff in all three cases.
__device__ __forceinline__ float mul_like_host(float a, float b) {
  if (a != a) return __uint_as_float(__float_as_uint(a) | 0x00400000u);
  if (b != b) return __uint_as_float(__float_as_uint(b) | 0x00400000u);
  const float r = __fmul_rn(a, b);
  return r != r ? __uint_as_float(0xffc00000u) : r;
}

__device__ __forceinline__ float ue8m0_scale(std::uint32_t byte) {
  if (byte == 0xffu) return __uint_as_float(0x7fc00000u);  // NaN, as ue8m0_to_scale's nanf("")
  if (byte == 0u) return __uint_as_float(0x00400000u);     // 2^-127
  return __uint_as_float(byte << 23);
}

/// Group g's scale of the token whose scales start at element `s_row` (columns s_col apart: row- or column-major).
__device__ __forceinline__ float group_scale_at(const void* __restrict__ scales, std::int64_t s_row,
                                                std::int64_t s_col, bool ue8m0, int g) {
  if (!ue8m0) return static_cast<const float*>(scales)[s_row + g * s_col];
  const auto word = static_cast<std::uint32_t>(static_cast<const std::int32_t*>(scales)[s_row + (g / 4) * s_col]);
  return ue8m0_scale((word >> (8 * (g % 4))) & 0xffu);
}

/// Row t's 16-channel chunk c (H % 16 == 0, 16-byte aligned rows); its scales start at element s_row.
template <class Out>
__device__ __forceinline__ void dequantize_chunk(const std::uint8_t* __restrict__ q, std::int64_t q_stride,
                                                 const void* __restrict__ scales, std::int64_t s_row,
                                                 std::int64_t s_col, bool ue8m0, Out* __restrict__ out,
                                                 std::int64_t t, int c, int H) {
  const float scale = group_scale_at(scales, s_row, s_col, ue8m0, c / kLanesPerGroup);
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(q + t * q_stride) + c);
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  float f[kChannelsPerLane];
#pragma unroll
  for (int j = 0; j < kChannelsPerLane; ++j) {
    const auto code = static_cast<std::uint8_t>(w[j / 4] >> (8 * (j % 4)));
    f[j] = mul_like_host(fp8_e4m3_to_float(fp8_e4m3_t{code}), scale);
  }
  Out* o = out + t * H + static_cast<std::int64_t>(c) * kChannelsPerLane;
  if constexpr (sizeof(Out) == 4) {
    uint4* dst = reinterpret_cast<uint4*>(o);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      dst[j] = make_uint4(__float_as_uint(f[4 * j]), __float_as_uint(f[4 * j + 1]), __float_as_uint(f[4 * j + 2]),
                          __float_as_uint(f[4 * j + 3]));
  } else {
    std::uint32_t packed[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      packed[j] = static_cast<std::uint32_t>(float_to_bf16(f[2 * j]).bits) |
                  (static_cast<std::uint32_t>(float_to_bf16(f[2 * j + 1]).bits) << 16);
    uint4* dst = reinterpret_cast<uint4*>(o);
    dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
}

template <class Out>
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ q, std::int64_t q_stride,
                                  const void* __restrict__ scales, std::int64_t s_stride, std::int64_t s_col,
                                  bool ue8m0, Out* __restrict__ out, std::int64_t T, int H) {
  const int chunks = H / kChannelsPerLane;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * chunks) return;
  const std::int64_t t = i / chunks;
  dequantize_chunk(q, q_stride, scales, t * s_stride, s_col, ue8m0, out, t, static_cast<int>(i - t * chunks), H);
}

/// Element strides of slab scales [E, rows, C]: row-major {rows * C, C, 1}, or column-major {C * R', 1, R'}.
struct SlabScaleStrides {
  std::int64_t slab, row, col;
};

/// Slabs [E, rows, H]: slab e's first min(masked_m[e], rows) rows only (blockIdx.x = e; blocks of a slab stride
/// over its rows), so the work follows the tokens received, not the slabs' capacity.
template <class Out>
__global__ void dequantize_masked_kernel(const std::uint8_t* __restrict__ q, const void* __restrict__ scales,
                                         SlabScaleStrides ss, bool ue8m0, Out* __restrict__ out,
                                         const std::int32_t* __restrict__ masked_m, std::int64_t rows, int H) {
  const int e = blockIdx.x, chunks = H / kChannelsPerLane;
  const std::int64_t n = masked_m[e] < 0 ? 0 : (masked_m[e] > rows ? rows : masked_m[e]);
  for (std::int64_t r = blockIdx.y; r < n; r += gridDim.y)
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      dequantize_chunk(q, H, scales, e * ss.slab + r * ss.row, ss.col, ue8m0, out,
                       static_cast<std::int64_t>(e) * rows + r, c, H);
}

// Any H and any row stride (dequantize accepts H not a multiple of 16): one thread per value.
template <class Out>
__global__ void dequantize_scalar_kernel(const std::uint8_t* __restrict__ q, std::int64_t q_stride,
                                         const void* __restrict__ scales, std::int64_t s_stride, std::int64_t s_col,
                                         bool ue8m0, Out* __restrict__ out, std::int64_t T, int H) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * H) return;
  const std::int64_t t = i / H;
  const int h = static_cast<int>(i - t * H);
  const float scale = group_scale_at(scales, t * s_stride, s_col, ue8m0, h / kFp8GroupSize);
  const float f = mul_like_host(fp8_e4m3_to_float(fp8_e4m3_t{q[t * q_stride + h]}), scale);
  if constexpr (sizeof(Out) == 4)
    out[i] = f;
  else
    out[i] = float_to_bf16(f);
}

void require_vector_rows(const TensorView& t, const char* name) {
  const auto elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  if (!cuda_util::aligned16(t.data) || (t.size(0) > 1 && (t.stride(0) * elem) % 16 != 0))
    throw_invalid_argument(name, "16-byte-aligned rows on CUDA (data pointer and row stride in bytes multiples of 16)",
                           describe(t) + " with row stride " + std::to_string(t.stride(0)));
}

}  // namespace

void quantize_fp8_cuda(const QuantizeProblem& p, Stream stream, bool hardware_convert, int tasks_per_warp) {
  if (p.num_tokens == 0) return;
  require_vector_rows(p.x, "x");
  require_vector_rows(p.q, "q");
  cuda_util::DeviceGuard guard(p.x.device);
  const int H = static_cast<int>(p.hidden);
  const int G = static_cast<int>(num_scale_groups(p.hidden));
  const int words_per_row = (G + 3) / 4;
  const std::int64_t tasks = p.num_tokens * words_per_row;
  const auto elem = static_cast<std::int64_t>(dtype_size(p.x.dtype));
  const cudaStream_t s = cuda_util::to_cuda(stream);
  // One scale word per warp by default: on an H200 at T=4096, H=7168 it moved 76% of the copy rate
  // against 73% with four words per warp (loads of four words in flight); at T=128, 5.1 us against 6.0.
  const bool many = tasks_per_warp == 4;
  auto launch = [&](auto kernel, int words_per_warp) {
    const auto blocks = static_cast<unsigned>(cuda_util::ceil_div(tasks, std::int64_t{kQuantWarps} * words_per_warp));
    kernel<<<blocks, kQuantWarps * 32, 0, s>>>(
        static_cast<const char*>(p.x.data), p.x.stride(0) * elem, static_cast<std::uint8_t*>(p.q.data), p.q.stride(0),
        p.scales.data, p.scales.stride(0), p.scales.stride(1), tasks, H, G, words_per_row, p.options.round_scale,
        p.options.use_ue8m0);
  };
  const bool bf16 = p.x.dtype == DType::bf16;
  if (hardware_convert) {
    if (bf16)
      many ? launch(quantize_kernel<bf16_t, true, 4>, 4) : launch(quantize_kernel<bf16_t, true, 1>, 1);
    else
      many ? launch(quantize_kernel<float, true, 4>, 4) : launch(quantize_kernel<float, true, 1>, 1);
  } else {
    if (bf16)
      many ? launch(quantize_kernel<bf16_t, false, 4>, 4) : launch(quantize_kernel<bf16_t, false, 1>, 1);
    else
      many ? launch(quantize_kernel<float, false, 4>, 4) : launch(quantize_kernel<float, false, 1>, 1);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_fp8_masked_cuda(const TensorView& q, const TensorView& scales, const TensorView& out,
                                const std::int32_t* masked_m, Stream stream) {
  const std::int64_t E = q.size(0), rows = q.size(1);
  const int H = static_cast<int>(q.size(2));
  if (E == 0 || rows == 0) return;
  const bool vector_rows =
      H % kChannelsPerLane == 0 && cuda_util::aligned16(q.data) && q.is_contiguous() && out.is_contiguous();
  if (!vector_rows) {  // every row of every slab (rows past a count are never read)
    for (std::int64_t e = 0; e < E; ++e) dequantize_fp8_cuda(q.row(e), scales.row(e), out.row(e), stream);
    return;
  }
  cuda_util::DeviceGuard guard(q.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const bool ue8m0 = scales.dtype == DType::int32;
  const SlabScaleStrides ss{scales.stride(0), scales.stride(1), scales.stride(2)};  // row- or column-major slabs
  const dim3 grid(static_cast<unsigned>(E), static_cast<unsigned>(rows < 8 ? rows : 8));
  if (out.dtype == DType::bf16)
    dequantize_masked_kernel<bf16_t><<<grid, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), scales.data, ss,
                                                          ue8m0, static_cast<bf16_t*>(out.data), masked_m, rows, H);
  else
    dequantize_masked_kernel<float><<<grid, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), scales.data, ss,
                                                         ue8m0, static_cast<float*>(out.data), masked_m, rows, H);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_fp8_cuda(const TensorView& q, const TensorView& scales, const TensorView& out, Stream stream) {
  const std::int64_t T = q.size(0);
  if (T == 0) return;
  cuda_util::DeviceGuard guard(q.device);
  const int H = static_cast<int>(q.size(1));
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const bool ue8m0 = scales.dtype == DType::int32;
  const bool vector_rows =
      H % kChannelsPerLane == 0 && cuda_util::aligned16(q.data) && (T <= 1 || q.stride(0) % 16 == 0);
  if (!vector_rows) {
    const auto blocks = static_cast<unsigned>(cuda_util::ceil_div(T * H, 256));
    if (out.dtype == DType::bf16)
      dequantize_scalar_kernel<bf16_t><<<blocks, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), q.stride(0),
                                                              scales.data, scales.stride(0), scales.stride(1),
                                                              ue8m0, static_cast<bf16_t*>(out.data), T, H);
    else
      dequantize_scalar_kernel<float><<<blocks, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), q.stride(0),
                                                             scales.data, scales.stride(0), scales.stride(1),
                                                             ue8m0, static_cast<float*>(out.data), T, H);
    EPMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const std::int64_t threads = T * (H / kChannelsPerLane);
  const auto blocks = static_cast<unsigned>(cuda_util::ceil_div(threads, 256));
  if (out.dtype == DType::bf16)
    dequantize_kernel<bf16_t><<<blocks, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), q.stride(0), scales.data,
                                                     scales.stride(0), scales.stride(1), ue8m0,
                                                     static_cast<bf16_t*>(out.data), T, H);
  else
    dequantize_kernel<float><<<blocks, 256, 0, s>>>(static_cast<const std::uint8_t*>(q.data), q.stride(0), scales.data,
                                                    scales.stride(0), scales.stride(1), ue8m0,
                                                    static_cast<float*>(out.data), T, H);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::quant_detail
