// Module interface of the quantization stage (the one header of src/quant/ that other folders include):
// quant.cpp validates the arguments of the public functions and dispatches on device to cpu.cpp or cuda.cu
// (CUDA builds only: EPMOE_HAVE_CUDA), which agree bit for bit. The group-scale rule lives here once, for the
// host; its device twin and the other device-side fp8 helpers follow for CUDA sources (nvcc), shared with the
// kernels that quantize rows themselves (the cuda_ipc low-latency dispatch).
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#include "quant/nvfp4.hpp"

namespace epmoe::quant_detail {

/// Argument check of a [rows, cols] matrix of `dtype` whose rows may be spaced by any stride >= cols (unit
/// inner stride, non-null data unless empty). invalid_argument naming `name`.
void check_matrix(const TensorView& t, std::string_view name, DType dtype, std::int64_t rows, std::int64_t cols);
/// In a CPU-only build, a tensor `name` not on the CPU is unsupported.
void require_cpu(const TensorView& t, std::string_view name);

/// Lower clamp of a group's absolute maximum (semantics §6), so an all-zero group gets a finite scale.
inline constexpr float kAmaxFloor = 1e-4f;

/// A group's scale as semantics §6 defines it, with the factor the values are multiplied by.
struct GroupScale {
  float scale;  ///< a / 448, or 2^exponent with round_scale
  float inv;  ///< 448 / a, or 2^-exponent (x * inv equals x / scale exactly for a power of two)
  int exponent;  ///< ceil(log2(a / 448)) with round_scale, else 0
};

/// a = max(amax, 1e-4) in float32; scale = a / 448, or 2^ceil(log2(a / 448)) with round_scale.
inline GroupScale group_scale(float amax, bool round_scale) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  if (!round_scale) return {a / kFp8E4m3Max, kFp8E4m3Max / a, 0};
  // ceil(log2(c)) of a normal float c: its unbiased exponent, plus one unless c is a power of two.
  // c >= 1e-4 / 448 is always normal; c = inf gives 128 (scale inf, UE8M0 byte 255 = NaN).
  const std::uint32_t c = float_bits(a / kFp8E4m3Max);
  const int e = static_cast<int>((c >> 23) & 0xffu) - 127 + ((c & 0x7fffffu) != 0u ? 1 : 0);
  const float scale = std::ldexp(1.0f, e);
  return {scale, 1.0f / scale, e};
}

/// Validated quantization problem: x [T, H] bf16/fp32 and q [T, H] fp8 with unit stride in dimension 1 and any
/// row stride >= H; scales float32 [T, G] or int32 [T, W] (UE8M0), row- or column-major (scales_have_layout): the
/// kernels address element [t, c] as t * stride(0) + c * stride(1).
struct QuantizeProblem {
  TensorView x, q, scales;
  std::int64_t num_tokens = 0, hidden = 0;
  Fp8Options options;
};

/// Scales [rows, cols] of `dtype` in `layout` (scales_have_layout), or in either layout when `layout` is empty, with
/// data. The one rule and message for every argument holding scales (the quantizer's, normal dispatch's x_scales).
/// Errors: invalid_argument naming `name`, the expected shape or layout and the actual one.
void check_scales(const TensorView& t, std::string_view name, DType dtype, std::int64_t rows, std::int64_t cols,
                  std::optional<ScaleLayout> layout);

void quantize_fp8_cpu(const QuantizeProblem& p);

/// q [T, H] fp8, scales float32 [T, G] or int32 [T, W] (row- or column-major); out [T, H] bf16/fp32, contiguous.
void dequantize_fp8_cpu(const TensorView& q, const TensorView& scales, const TensorView& out);

// ---- CUDA (asynchronous on `stream`; bit-identical to the CPU) ------------------------------------------

/// Per-token-group fp8 quantization of a validated problem. On CUDA the rows of x and q must be
/// 16-byte aligned (pointer and row stride in bytes); invalid_argument otherwise.
/// `hardware_convert` selects the cvt.rn.satfinite.e4m3x2 instruction (default) or the software
/// conversion of dtype.hpp; both give the same bits (tests/gpu checks it). `tasks_per_warp` 1 or 4
/// forces that many rows' scale words per warp (0: chosen by size; the benchmark compares them).
void quantize_fp8_cuda(const QuantizeProblem& p, Stream stream, bool hardware_convert = true, int tasks_per_warp = 0);

/// q [T, H] fp8, scales float32 [T, G] or int32 [T, W] (row- or column-major); out [T, H] bf16/fp32, contiguous.
void dequantize_fp8_cuda(const TensorView& q, const TensorView& scales, const TensorView& out, Stream stream);

/// Slabs (the low-latency layout): q [E, rows, H] fp8 and out [E, rows, H] contiguous, scales [E, rows, G or W]
/// row-major or column-major per slab (the low-latency dispatch's, DeepEP's layout: strides {C * R', 1, R'});
/// only slab e's first masked_m[e] rows (device int32 [E], clamped to [0, rows]) are written: the others are
/// never read by a masked (batched) consumer. Rows that are not 16-byte vectors fall back to every row.
void dequantize_fp8_masked_cuda(const TensorView& q, const TensorView& scales, const TensorView& out,
                                const std::int32_t* masked_m, Stream stream);

}  // namespace epmoe::quant_detail

#if defined(__CUDACC__)

// ---- device side (CUDA sources only) --------------------------------------------------------------------
// Every GPU path computes a group's scale and codes with the same operations as group_scale and quant/cpu.cpp.

namespace epmoe::quant_detail {

struct DeviceGroupScale {
  float scale, inv;
  int exponent;
};

// group_scale on the device: same operations, same order.
__device__ __forceinline__ DeviceGroupScale device_group_scale(float amax, bool round_scale) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  if (!round_scale) return {a / kFp8E4m3Max, kFp8E4m3Max / a, 0};
  const std::uint32_t c = float_bits(a / kFp8E4m3Max);
  const int e = static_cast<int>((c >> 23) & 0xffu) - 127 + ((c & 0x7fffffu) != 0u ? 1 : 0);
  // 2^e for -22 <= e <= 128 (e = 128 gives +inf, as ldexp does); a >= 1e-4 keeps e well above -126.
  const float scale = bits_float(static_cast<std::uint32_t>(e + 127) << 23);
  return {scale, 1.0f / scale, e};
}

// Two floats to two e4m3 codes, lo in the low byte. With kFixNaN, NaN -> 0x7f whatever its sign, as
// the CPU does (only needed when the inputs hold an inf or a NaN: otherwise x * inv is never NaN).
template <bool kHardware, bool kFixNaN>
__device__ __forceinline__ std::uint32_t fp8x2(float lo, float hi) {
  std::uint32_t code;
  if constexpr (kHardware) {
    std::uint16_t packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    code = packed;
    if constexpr (kFixNaN) {
      if (lo != lo) code = (code & 0xff00u) | 0x7fu;
      if (hi != hi) code = (code & 0x00ffu) | 0x7f00u;
    }
  } else {
    code = static_cast<std::uint32_t>(float_to_fp8_e4m3(lo).bits) |
           (static_cast<std::uint32_t>(float_to_fp8_e4m3(hi).bits) << 8);
  }
  return code;
}

template <bool kHardware, bool kFixNaN>
__device__ __forceinline__ uint4 convert16(const float* v, float inv) {
  std::uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t lo = fp8x2<kHardware, kFixNaN>(v[4 * i] * inv, v[4 * i + 1] * inv);
    const std::uint32_t hi = fp8x2<kHardware, kFixNaN>(v[4 * i + 2] * inv, v[4 * i + 3] * inv);
    out[i] = lo | (hi << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// A lane's 16 channels from its 16-byte loads `raw`: two of bf16 (kInBytes = 2) or four of float32 (kInBytes = 4).
template <int kInBytes>
__device__ __forceinline__ void unpack16(const uint4* raw, float* v) {
#pragma unroll
  for (int j = 0; j < (kInBytes == 2 ? 2 : 4); ++j) {
    const std::uint32_t w[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (kInBytes == 2) {
        v[8 * j + 2 * e] = __uint_as_float(w[e] << 16);
        v[8 * j + 2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
      } else {
        v[4 * j + e] = __uint_as_float(w[e]);
      }
    }
  }
}

// One lane's share of a group of 128 channels held by 8 consecutive lanes (16 channels `v` each): the group's
// scale (every lane of the group gets it) and, where `active` (the lane holds channels of the row), its 16 codes in
// *codes. Every lane of the warp calls it (shuffles). The maximum is fmaxf over |x| (NaN skipped, as the CPU's
// integer max of |x| bits with NaN counted as 0); probe = fma(x, 0, probe) turns NaN iff some x is an inf or a NaN,
// only then is the conversion's NaN fix-up needed.
template <bool kHardware>
__device__ __forceinline__ DeviceGroupScale quantize_lane16(const float* v, bool active, bool round_scale,
                                                            uint4* codes) {
  float amax = 0.0f, probe = 0.0f;
  if (active) {
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      amax = fmaxf(amax, fabsf(v[e]));
      probe = __fmaf_rn(v[e], 0.0f, probe);
    }
  }
  // The 8 lanes of a group hold the same maximum after these.
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  const DeviceGroupScale s = device_group_scale(amax, round_scale);
  if (active) *codes = probe != probe ? convert16<kHardware, true>(v, s.inv) : convert16<kHardware, false>(v, s.inv);
  return s;
}

// The UE8M0 word of the four groups held by lanes 0-7, 8-15, 16-23 and 24-31 (group i in byte i): each group's
// `exponent` + 127 clamped to a byte, 0 for a group past the row's last (`valid` false). Every lane calls it
// (shuffles); lane 0's result is the word.
__device__ __forceinline__ std::int32_t ue8m0_word(int exponent, bool valid) {
  int e = exponent + 127;
  e = e < 0 ? 0 : (e > 255 ? 255 : e);
  const std::uint32_t byte = valid ? static_cast<std::uint32_t>(e) : 0u;
  const std::uint32_t b1 = __shfl_sync(0xffffffffu, byte, 8);
  const std::uint32_t b2 = __shfl_sync(0xffffffffu, byte, 16);
  const std::uint32_t b3 = __shfl_sync(0xffffffffu, byte, 24);
  return static_cast<std::int32_t>(byte | (b1 << 8) | (b2 << 16) | (b3 << 24));
}

}  // namespace epmoe::quant_detail

#endif  // __CUDACC__
