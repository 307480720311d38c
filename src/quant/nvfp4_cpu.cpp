// CPU NVFP4 quantization and dequantization (semantics §6, "NVFP4"): the scalar rules of include/epmoe/nvfp4.hpp
// applied block by block (16 channels), float32 throughout. The block's maximum is taken on the bit patterns of
// |x| with NaN counted as 0 (the order of |x| for the other floats; CUDA's fmaxf skips NaN the same way).
#include <cstring>

#include "quant/quant.hpp"

namespace epmoe::quant_detail {

namespace {

inline std::uint32_t abs_bits(float v) {
  const std::uint32_t a = float_bits(v) & 0x7fffffffu;
  return a > 0x7f800000u ? 0u : a;
}
inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return bf16_to_float(v); }

template <class In>
void quantize_rows(const Nvfp4Problem& p) {
  const std::int64_t T = p.num_tokens, H = p.hidden, blocks = H / kNvfp4BlockSize, col_tiles = nvfp4_col_tiles(H);
  const float gs = p.global_scale.value;
  auto* scales = static_cast<std::uint8_t*>(p.scales.data);
  const std::int64_t s_stride = p.scales.stride(0);
  // Swizzled: the last row of tiles may hold padding tokens, which are 0.
  if (p.layout == Nvfp4ScaleLayout::swizzled && T % kNvfp4TileRows != 0)
    std::memset(scales + (T / kNvfp4TileRows) * s_stride, 0, static_cast<std::size_t>(col_tiles * kNvfp4TileBytes));
  for (std::int64_t t = 0; t < T; ++t) {
    const In* x = static_cast<const In*>(p.x.data) + t * p.x.stride(0);
    std::uint8_t* q = static_cast<std::uint8_t*>(p.q.data) + t * p.q.stride(0);
    for (std::int64_t j = 0; j < blocks; ++j) {
      const In* xb = x + j * kNvfp4BlockSize;
      std::uint32_t amax = 0;
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        const std::uint32_t b = abs_bits(to_float(xb[i]));
        amax = b > amax ? b : amax;
      }
      const Nvfp4BlockScale s = nvfp4_block_scale(bits_float(amax), gs);
      scales[nvfp4_scale_at(p.layout, t, j, s_stride, col_tiles)] = s.code.bits;
      for (int i = 0; i < kNvfp4BlockSize; i += 2) {
        const std::uint8_t lo = float_to_e2m1(to_float(xb[i]) * s.multiplier);
        const std::uint8_t hi = float_to_e2m1(to_float(xb[i + 1]) * s.multiplier);
        q[j * (kNvfp4BlockSize / 2) + i / 2] = static_cast<std::uint8_t>(lo | (hi << 4));
      }
    }
  }
}

template <class Out>
void dequantize_rows(const TensorView& qv, const TensorView& sv, Nvfp4ScaleLayout layout, float gs,
                     const TensorView& ov) {
  const std::int64_t T = qv.size(0), H = 2 * qv.size(1), blocks = H / kNvfp4BlockSize, col_tiles = nvfp4_col_tiles(H);
  const auto* scales = static_cast<const std::uint8_t*>(sv.data);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::uint8_t* q = static_cast<const std::uint8_t*>(qv.data) + t * qv.stride(0);
    Out* out = static_cast<Out*>(ov.data) + t * H;
    for (std::int64_t j = 0; j < blocks; ++j) {
      const float f = nvfp4_dequant_factor(fp8_e4m3_t{scales[nvfp4_scale_at(layout, t, j, sv.stride(0), col_tiles)]}, gs);
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        const std::uint8_t byte = q[(j * kNvfp4BlockSize + i) / 2];
        const float v = e2m1_to_float(static_cast<std::uint8_t>(i % 2 == 0 ? byte & 0xfu : byte >> 4)) * f;
        if constexpr (sizeof(Out) == 4)
          out[j * kNvfp4BlockSize + i] = v;
        else
          out[j * kNvfp4BlockSize + i] = float_to_bf16(v);
      }
    }
  }
}

}  // namespace

void quantize_nvfp4_cpu(const Nvfp4Problem& p) {
  if (p.x.dtype == DType::bf16)
    quantize_rows<bf16_t>(p);
  else
    quantize_rows<float>(p);
}

void dequantize_nvfp4_cpu(const TensorView& q, const TensorView& scales, Nvfp4ScaleLayout layout, float global_scale,
                          const TensorView& out) {
  if (out.dtype == DType::bf16)
    dequantize_rows<bf16_t>(q, scales, layout, global_scale, out);
  else
    dequantize_rows<float>(q, scales, layout, global_scale, out);
}

}  // namespace epmoe::quant_detail
