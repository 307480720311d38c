// FP8 per-token-group quantization (semantics §6).
//
// Format (as DeepEP and vLLM): one float32 scale per group of 128 consecutive hidden channels of a
// token; the last group may be shorter (H = 2880: 22 groups of 128 and one of 64).
//   a = max(amax(group), 1e-4);  q = fp8_e4m3(x * (448 / a));  scale = a / 448
// round_scale: scale = 2^ceil(log2(a / 448)), q = fp8_e4m3(x / scale).
// UE8M0 (needs round_scale): the scale's exponent byte log2(scale) + 127, four groups per int32,
// group 4i in the lowest byte, bytes past the last group 0.
// Scale layouts (ScaleLayout): row-major [T, C], or DeepGEMM's column-major ("MN-major") TMA-aligned layout, where
// the token dimension has unit stride and each column is padded to a multiple of 4 elements (16 bytes).
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

namespace epmoe {

inline constexpr int kFp8GroupSize = 128;

/// Number of scale groups of a row of `hidden` channels: ceil(hidden / group_size).
constexpr std::int64_t num_scale_groups(std::int64_t hidden, int group_size = kFp8GroupSize) {
  return (hidden + group_size - 1) / group_size;
}
/// Number of int32 words holding UE8M0 scales of a row: ceil(groups / 4).
constexpr std::int64_t num_ue8m0_words(std::int64_t hidden, int group_size = kFp8GroupSize) {
  return (num_scale_groups(hidden, group_size) + 3) / 4;
}

/// How a scale tensor [T, C] (C = G float32 groups or ceil(G/4) UE8M0 words) lies in memory; the values are the same
/// either way (semantics §6).
enum class ScaleLayout : std::uint8_t {
  /// A token's C scales adjacent: strides {row stride >= C, 1} ({C, 1} when epmoe allocates).
  row_major,
  /// The token dimension has unit stride: strides {1, column stride >= T}. epmoe allocates the column stride
  /// tma_aligned_scale_rows(T), the layout DeepGEMM's get_mn_major_tma_aligned_tensor and
  /// get_mn_major_tma_aligned_packed_ue8m0_tensor return (deepseek-ai/DeepGEMM, csrc/jit_kernels/impls/smxx_layout.hpp)
  /// and its fp8 GEMMs read through TMA.
  column_major,
};

/// "row_major" or "column_major".
const char* scale_layout_name(ScaleLayout layout);

/// DeepGEMM's get_tma_aligned_size(rows, 4) (csrc/utils/math.hpp): `rows` rounded up to a multiple of 16 bytes of
/// 4-byte elements, i.e. of 4. The column stride of column-major scales.
constexpr std::int64_t tma_aligned_scale_rows(std::int64_t rows) { return (rows + 3) / 4 * 4; }

struct Fp8Options {
  bool round_scale = false;  ///< scales rounded up to powers of two
  bool use_ue8m0 = false;    ///< pack scale exponents four to an int32 (requires round_scale)
  ScaleLayout scale_layout = ScaleLayout::row_major;  ///< the scales' layout (the values do not depend on it)
};

struct Fp8Tensor {
  Tensor data;    ///< float8_e4m3fn [T, H]
  /// float32 [T, ceil(H/128)], or int32 [T, ceil(ceil(H/128)/4)] with use_ue8m0; strides {C, 1} (row_major) or
  /// {1, tma_aligned_scale_rows(T)} (column_major; the padding rows of each column are not written).
  Tensor scales;
};

/// Quantizes x (bfloat16 or float32 [T, H], H % 16 == 0, unit stride in dimension 1) per token group of 128 channels,
/// scales in options.scale_layout. Errors (invalid_argument naming the argument): x not 2-d bfloat16/float32,
/// H % 16 != 0, use_ue8m0 without round_scale.
Fp8Tensor quantize_fp8(const TensorView& x, const Fp8Options& options = {});

/// As quantize_fp8, into caller-provided q [T, H] fp8 (unit stride in dimension 1, any row stride >= H, so rows can
/// live inside a larger buffer) and scales of the shape above in options.scale_layout (row_major: any row stride
/// >= C; column_major: unit stride in dimension 0, any column stride >= T). Errors: as quantize_fp8, and outputs of
/// another dtype, shape, device or layout (naming 'q' or 'scales').
void quantize_fp8_into(const TensorView& x, const TensorView& q, const TensorView& scales, const Fp8Options& options = {});

/// Dequantizes q [T, H] with float32 [T, G] or UE8M0 int32 [T, ceil(G/4)] scales into `out_dtype`
/// (bfloat16 or float32). The scales' format is read from their dtype, their layout (row- or column-major, as
/// scales_have_layout accepts) from their strides.
Tensor dequantize_fp8(const TensorView& q, const TensorView& scales, DType out_dtype = DType::bf16);

/// Whether the 2-d scales [rows, cols] lie as `layout` says: row_major, unit stride in dimension 1 and a row stride
/// >= cols; column_major, unit stride in dimension 0 and a column stride >= rows. A stride of a dimension of size
/// <= 1 is not looked at (a single token's scales are both); an empty tensor has every layout.
bool scales_have_layout(const TensorView& scales, ScaleLayout layout);

/// Uninitialised scales of `shape` ([rows, cols] or [batch, rows, cols]) in `layout`: row_major contiguous;
/// column_major with strides {1, R} or {cols * R, 1, R}, R = tma_aligned_scale_rows(rows) (DeepGEMM's batched
/// layout; DeepEP's low-latency scales). The padding rows are not initialised. dtype float32 or int32.
/// Errors: invalid_argument naming 'dtype' or 'shape'; as Tensor::empty.
Tensor empty_fp8_scales(DType dtype, Shape shape, ScaleLayout layout, Device device = {});

/// One group's scale as semantics §6 computes it from the group's absolute maximum.
float fp8_group_scale(float amax, bool round_scale);
/// UE8M0 byte of a power-of-two scale, and back.
std::uint8_t ue8m0_from_scale(float pow2_scale);
float ue8m0_to_scale(std::uint8_t byte);

/// The same on an explicit stream (stream.hpp): on CUDA, asynchronous on `stream`, bit-identical to the CPU.
inline Fp8Tensor quantize_fp8(const TensorView& x, const Fp8Options& options, Stream stream) {
  StreamGuard guard(stream);
  return quantize_fp8(x, options);
}
inline void quantize_fp8_into(const TensorView& x, const TensorView& q, const TensorView& scales,
                              const Fp8Options& options, Stream stream) {
  StreamGuard guard(stream);
  quantize_fp8_into(x, q, scales, options);
}
inline Tensor dequantize_fp8(const TensorView& q, const TensorView& scales, DType out_dtype, Stream stream) {
  StreamGuard guard(stream);
  return dequantize_fp8(q, scales, out_dtype);
}

}  // namespace epmoe
