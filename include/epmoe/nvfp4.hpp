// NVFP4 quantization (semantics §6, "NVFP4"): e2m1 values, two per byte, one fp8 e4m3 scale per 16 consecutive
// channels of a token, and one float32 global scale per tensor.
//
// Format (NVIDIA's NVFP4, as vLLM's scaled_fp4_quant and FlashInfer's fp4_quantize produce it and the block-scaled
// fp4 GEMMs read it):
//   - e2m1: 4 bits, sign | 2 exponent bits (bias 1) | 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
//     Byte i of a row holds channel 2i in its low nibble and channel 2i + 1 in its high nibble (PTX's
//     cvt.rn.satfinite.e2m1x2.f32 puts its second operand in the low nibble; every consumer unpacks it so).
//   - global scale gs (the producers' convention: gs = 448 * 6 / amax(tensor), so the largest block scale is 448):
//     a float32 > 0, finite, given by the caller (a calibrated input scale: ModelOpt's 1 / input_scale).
//   - per block of 16 channels, in float32 with IEEE operations:
//       amax = max |x| (NaN skipped);  sf = e4m3((amax / 6) * gs);  m = gs / float(sf), or 0 when sf is 0
//       (capped at the largest float, so a zero stays zero);  q = e2m1(x * m)
//     e4m3 rounds to nearest even and saturates at 448 (dtype.hpp); e2m1 rounds to nearest even, saturates at
//     +-6, keeps the sign of a zero and maps NaN to +6 (code 0x7): the rule of CUDA's __nv_cvt_float_to_fp4(v,
//     __NV_E2M1, cudaRoundNearest) and of the cvt instruction.
//   - dequantization: x' = e2m1_value(q) * (float(sf) / gs) in float32.
//   vLLM's and FlashInfer's kernels compute the same steps with approximate reciprocals (of 6, of gs and of the
//   scale), so their codes can differ from these by one step where a value sits on a rounding boundary.
//
// Scale layouts (Nvfp4ScaleLayout):
//   - linear: fp8_e4m3 [T, H / 16], row-major (block j of token t at [t, j]).
//   - swizzled: the 128x4 tiles the block-scaled GEMMs read (CUTLASS's / cuBLAS's scale-factor layout for
//     16-element blocks, FlashInfer's SWIZZLE_32_4_4, DeepEP's nvfp4 low-latency dispatch): tokens padded to a
//     multiple of 128 and scale columns to a multiple of 4 (H % 64 == 0 here, so no column is padding); tile
//     (t / 128, j / 4) holds 512 bytes, tiles row-major, and inside a tile scale (t, j) sits at byte
//     (t % 32) * 16 + ((t % 128) / 32) * 4 + j % 4. Stored as fp8_e4m3 [ceil(T / 128), (H / 64) * 512]: one
//     matrix row per 128 tokens. Bytes of padding tokens are 0.
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cfloat>
#include <cstdint>

namespace epmoe {

inline constexpr int kNvfp4BlockSize = 16;   ///< channels per e4m3 scale
inline constexpr float kE2m1Max = 6.0f;      ///< largest e2m1 magnitude
inline constexpr int kNvfp4TileRows = 128;   ///< swizzled layout: tokens per tile
inline constexpr int kNvfp4TileCols = 4;     ///< swizzled layout: scales (of 16 channels) per tile row
inline constexpr int kNvfp4TileBytes = 512;  ///< swizzled layout: bytes per 128 x 4 tile

enum class Nvfp4ScaleLayout : std::uint8_t {
  linear,    ///< fp8_e4m3 [T, H / 16]
  swizzled,  ///< fp8_e4m3 [ceil(T / 128), (H / 64) * 512], the 128x4 tiles (needs H % 64 == 0)
};
/// "linear" or "swizzled".
constexpr const char* nvfp4_scale_layout_name(Nvfp4ScaleLayout l) {
  return l == Nvfp4ScaleLayout::linear ? "linear" : "swizzled";
}

/// Swizzled layout: tiles of 128 rows (ceil(rows / 128)) and of 4 scale columns (H / 64) of a matrix.
constexpr std::int64_t nvfp4_row_tiles(std::int64_t rows) { return (rows + kNvfp4TileRows - 1) / kNvfp4TileRows; }
constexpr std::int64_t nvfp4_col_tiles(std::int64_t hidden) {
  return (hidden / kNvfp4BlockSize + kNvfp4TileCols - 1) / kNvfp4TileCols;
}
/// Byte offset of scale (row, col) in a swizzled matrix whose rows of tiles hold `col_tiles` tiles.
EPMOE_HD std::int64_t nvfp4_swizzled_offset(std::int64_t row, std::int64_t col, std::int64_t col_tiles) {
  return ((row / kNvfp4TileRows) * col_tiles + col / kNvfp4TileCols) * kNvfp4TileBytes + (row % 32) * 16 +
         ((row % kNvfp4TileRows) / 32) * 4 + col % kNvfp4TileCols;
}

/// float -> e2m1 code (0..15): nearest value, ties to the even code, +-6 for larger magnitudes and infinities,
/// the sign kept for zeros and underflows, NaN -> 0x7 (+6). Bit-exact with __nv_cvt_float_to_fp4(v, __NV_E2M1,
/// cudaRoundNearest) (tested over a dense sweep in CUDA builds). Branch-free (vectorises).
EPMOE_HD std::uint8_t float_to_e2m1(float v) {
  const std::uint32_t u = float_bits(v);
  const float a = bits_float(u & 0x7fffffffu);
  // Each comparison passes one midpoint between neighbouring magnitudes; '>' at a midpoint whose lower neighbour
  // has the even code (ties go down), '>=' where the upper one has it (ties go up).
  const std::uint32_t code = static_cast<std::uint32_t>(a > 0.25f) + static_cast<std::uint32_t>(a >= 0.75f) +
                             static_cast<std::uint32_t>(a > 1.25f) + static_cast<std::uint32_t>(a >= 1.75f) +
                             static_cast<std::uint32_t>(a > 2.5f) + static_cast<std::uint32_t>(a >= 3.5f) +
                             static_cast<std::uint32_t>(a > 5.0f);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint8_t>(nan ? 0x7u : (((u >> 28) & 0x8u) | code));
}

/// e2m1 code (low 4 bits of `code`) -> float (exact).
EPMOE_HD float e2m1_to_float(std::uint8_t code) {
  const std::uint32_t m = code & 0x7u;
  // Magnitudes 0, 0.5, 1, 1.5 (m / 2), then 2, 3, 4, 6.
  const float mag = m < 4u ? static_cast<float>(m) * 0.5f : (m == 4u ? 2.0f : (m == 5u ? 3.0f : (m == 6u ? 4.0f : 6.0f)));
  return (code & 0x8u) ? -mag : mag;
}

/// One block's scale as the format defines it: sf = e4m3((amax / 6) * gs) and the factor m the values are
/// multiplied by before rounding to e2m1 (gs / float(sf) capped at the largest float, 0 when sf is 0).
struct Nvfp4BlockScale {
  fp8_e4m3_t code;
  float multiplier;
};
EPMOE_HD Nvfp4BlockScale nvfp4_block_scale(float amax, float global_scale) {
#if defined(__CUDA_ARCH__)
  const float s = __fmul_rn(__fdiv_rn(amax, kE2m1Max), global_scale);
#else
  const float s = (amax / kE2m1Max) * global_scale;
#endif
  const fp8_e4m3_t code = float_to_fp8_e4m3(s);
  const float value = fp8_e4m3_to_float(code);
#if defined(__CUDA_ARCH__)
  const float m = value > 0.0f ? fminf(__fdiv_rn(global_scale, value), FLT_MAX) : 0.0f;
#else
  const float q = global_scale / value;
  const float m = value > 0.0f ? (q < FLT_MAX ? q : FLT_MAX) : 0.0f;
#endif
  return {code, m};
}

/// The dequantization factor of a block: float(sf) / gs.
EPMOE_HD float nvfp4_dequant_factor(fp8_e4m3_t scale, float global_scale) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(fp8_e4m3_to_float(scale), global_scale);
#else
  return fp8_e4m3_to_float(scale) / global_scale;
#endif
}

/// Packed values and block scales of a quantized tensor.
struct Nvfp4Tensor {
  Tensor data;    ///< uint8 [T, H / 2], channel 2i in the low nibble of byte i
  Tensor scales;  ///< fp8_e4m3: linear [T, H / 16] or swizzled [ceil(T / 128), (H / 64) * 512]
};

/// Quantizes x (bfloat16 or float32 [T, H], unit inner stride, any row stride) to NVFP4 with the global scale
/// `global_scale` (float32 with one element, shape [] or [1], on the CPU or on x's device; a CPU value must be
/// finite and > 0; a device value is read by the kernel, unchecked). CPU or CUDA (asynchronous on the current
/// stream, the CPU's bits). Errors (invalid_argument naming the argument): x not 2-d bfloat16/float32, H not a
/// positive multiple of 16 (of 64 for the swizzled layout), a bad global_scale.
Nvfp4Tensor quantize_nvfp4(const TensorView& x, const TensorView& global_scale,
                           Nvfp4ScaleLayout layout = Nvfp4ScaleLayout::swizzled);

/// As quantize_nvfp4, into caller-provided q uint8 [T, H / 2] and scales (shape of the layout; rows may be spaced
/// by any stride >= their width; the swizzled matrix's padding tokens are written as 0). Same errors, plus q or
/// scales of the wrong dtype, shape or device.
void quantize_nvfp4_into(const TensorView& x, const TensorView& global_scale, const TensorView& q,
                         const TensorView& scales, Nvfp4ScaleLayout layout = Nvfp4ScaleLayout::swizzled);

/// Dequantizes q uint8 [T, H / 2] with its scales (layout as given) and global scale into `out_dtype` (bfloat16,
/// rounded once, or float32): x' = e2m1_value * (float(sf) / gs). Errors as above, out_dtype not bf16/fp32.
Tensor dequantize_nvfp4(const TensorView& q, const TensorView& scales, const TensorView& global_scale,
                        Nvfp4ScaleLayout layout = Nvfp4ScaleLayout::swizzled, DType out_dtype = DType::bf16);

/// The same on an explicit stream (stream.hpp).
inline Nvfp4Tensor quantize_nvfp4(const TensorView& x, const TensorView& global_scale, Nvfp4ScaleLayout layout,
                                  Stream stream) {
  StreamGuard guard(stream);
  return quantize_nvfp4(x, global_scale, layout);
}
inline Tensor dequantize_nvfp4(const TensorView& q, const TensorView& scales, const TensorView& global_scale,
                               Nvfp4ScaleLayout layout, DType out_dtype, Stream stream) {
  StreamGuard guard(stream);
  return dequantize_nvfp4(q, scales, global_scale, layout, out_dtype);
}

}  // namespace epmoe
