// FP8 per-token-group quantization (semantics §6).
//
// Format (as DeepEP and vLLM): one float32 scale per group of 128 consecutive hidden channels of a
// token; the last group may be shorter (H = 2880: 22 groups of 128 and one of 64).
//   a = max(amax(group), 1e-4);  q = fp8_e4m3(x * (448 / a));  scale = a / 448
// round_scale: scale = 2^ceil(log2(a / 448)), q = fp8_e4m3(x / scale).
// UE8M0 (needs round_scale): the scale's exponent byte log2(scale) + 127, four groups per int32,
// group 4i in the lowest byte, bytes past the last group 0.
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

struct Fp8Options {
  bool round_scale = false;  ///< scales rounded up to powers of two
  bool use_ue8m0 = false;    ///< pack scale exponents four to an int32 (requires round_scale)
};

struct Fp8Tensor {
  Tensor data;    ///< float8_e4m3fn [T, H]
  Tensor scales;  ///< float32 [T, ceil(H/128)], or int32 [T, ceil(ceil(H/128)/4)] with use_ue8m0
};

/// Quantizes x (bfloat16 or float32 [T, H], H % 16 == 0) per token group of 128 channels.
/// Errors: x not 2-d bfloat16/float32, H % 16 != 0, use_ue8m0 without round_scale.
Fp8Tensor quantize_fp8(const TensorView& x, const Fp8Options& options = {});

/// As quantize_fp8, into caller-provided q [T, H] fp8 and scales (shape as above; strides honoured
/// on dimension 0 so rows can live inside a larger buffer).
void quantize_fp8_into(const TensorView& x, const TensorView& q, const TensorView& scales, const Fp8Options& options = {});

/// Dequantizes q [T, H] with float32 [T, G] or UE8M0 int32 [T, ceil(G/4)] scales into `out_dtype`
/// (bfloat16 or float32). The scales' format is read from their dtype.
Tensor dequantize_fp8(const TensorView& q, const TensorView& scales, DType out_dtype = DType::bf16);

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
