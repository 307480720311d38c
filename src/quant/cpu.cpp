// CPU fp8 per-token-group quantization and dequantization (semantics §6).
//
// One pass per group: the absolute maximum is taken on the bit patterns (for non-NaN floats the
// order of |x| is the order of its bits, and integer max vectorises without -ffast-math; NaNs are
// skipped as CUDA's fmaxf does), then every value is scaled and converted with the branch-free
// converter. No allocation per row.

// The subnormal branch of the fp8 converter adds a constant in float; with GCC's default
// -ftrapping-math that add may not be executed speculatively, which keeps the conversion loop from
// vectorising. epmoe never reads floating-point exception flags, so allow it for this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "core/check.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "quant/fp8_cpu.hpp"
#include "quant/quant.hpp"

namespace epmoe::quant_detail {

namespace {

// |x| bits of a float as a signed int (SSE2 compares signed only), or 0 for NaN so a NaN never
// becomes the maximum.
inline std::int32_t abs_bits(float v) {
  const std::int32_t a = static_cast<std::int32_t>(float_bits(v) & 0x7fffffffu);
  return a > 0x7f800000 ? 0 : a;
}
inline std::int32_t abs_bits(bf16_t v) {
  const std::int32_t a = static_cast<std::int32_t>(v.bits & 0x7fffu) << 16;
  return a > 0x7f800000 ? 0 : a;
}
inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return bf16_to_float(v); }

template <class In>
[[gnu::always_inline]] inline void quantize_rows(const QuantizeProblem& p) {
  const std::int64_t H = p.hidden, G = num_scale_groups(H);
  const bool ue8m0 = p.options.use_ue8m0, round_scale = p.options.round_scale;
  const std::int64_t x_stride = p.x.stride(0), q_stride = p.q.stride(0);
  // Row- or column-major scales alike: element [t, c] at t * s_token + c * s_col.
  const std::int64_t s_token = p.scales.stride(0), s_col = p.scales.stride(1);
  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    const In* x = static_cast<const In*>(p.x.data) + t * x_stride;
    std::uint8_t* q = static_cast<std::uint8_t*>(p.q.data) + t * q_stride;
    float* scale_row = ue8m0 ? nullptr : static_cast<float*>(p.scales.data) + t * s_token;
    std::int32_t* word_row = ue8m0 ? static_cast<std::int32_t*>(p.scales.data) + t * s_token : nullptr;
    std::uint32_t word = 0;
    for (std::int64_t g = 0; g < G; ++g) {
      const std::int64_t begin = g * kFp8GroupSize, len = std::min<std::int64_t>(kFp8GroupSize, H - begin);
      const In* xg = x + begin;
      std::uint8_t* qg = q + begin;
      std::int32_t amax_bits = 0;
      for (std::int64_t i = 0; i < len; ++i) {
        const std::int32_t b = abs_bits(xg[i]);
        amax_bits = b > amax_bits ? b : amax_bits;
      }
      const GroupScale s = group_scale(bits_float(static_cast<std::uint32_t>(amax_bits)), round_scale);
      const float inv = s.inv;
      for (std::int64_t i = 0; i < len; ++i) qg[i] = fp8_e4m3_from_float_vec(to_float(xg[i]) * inv);
      if (!ue8m0) {
        scale_row[g * s_col] = s.scale;
      } else {
        const std::uint32_t byte = static_cast<std::uint32_t>(std::clamp(s.exponent + 127, 0, 255));
        word |= byte << (8 * (g % 4));
        if (g % 4 == 3 || g == G - 1) {
          word_row[(g / 4) * s_col] = static_cast<std::int32_t>(word);
          word = 0;
        }
      }
    }
  }
}

// x86-64: an AVX2 clone of the row loops, picked at load time when the CPU has AVX2 (twice the
// lanes of the SSE2 baseline); both clones compute the same bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define EPMOE_QUANT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EPMOE_QUANT_CLONES
#endif

EPMOE_QUANT_CLONES void quantize_rows_bf16(const QuantizeProblem& p) { quantize_rows<bf16_t>(p); }
EPMOE_QUANT_CLONES void quantize_rows_f32(const QuantizeProblem& p) { quantize_rows<float>(p); }

// fp8 code -> float, for all 256 codes.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c)
      t[static_cast<std::size_t>(c)] = fp8_e4m3_to_float(fp8_e4m3_t{static_cast<std::uint8_t>(c)});
    return t;
  }();
  return table;
}

// float_to_bf16 without its early return, so the store loop vectorises; same bits for every input.
inline std::uint16_t bf16_bits(float v) {
  const std::uint32_t u = float_bits(v);
  const auto a = static_cast<std::int32_t>(u & 0x7fffffffu);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>(a > 0x7f800000 ? quiet_nan : rounded);
}

template <class Out>
inline void store(Out* out, std::int64_t i, float v) {
  if constexpr (std::is_same_v<Out, float>)
    out[i] = v;
  else
    out[i].bits = bf16_bits(v);
}

template <class Out>
[[gnu::always_inline]] inline void dequantize_rows(const TensorView& qv, const TensorView& sv, const TensorView& ov) {
  const std::int64_t T = qv.size(0), H = qv.size(1), G = num_scale_groups(H);
  const bool ue8m0 = sv.dtype == DType::int32;
  const std::int64_t s_token = sv.stride(0), s_col = sv.stride(1);  // row- or column-major
  const auto& table = fp8_table();
  for (std::int64_t t = 0; t < T; ++t) {
    const std::uint8_t* q = static_cast<const std::uint8_t*>(qv.data) + t * qv.stride(0);
    Out* out = static_cast<Out*>(ov.data) + t * H;
    for (std::int64_t g = 0; g < G; ++g) {
      float scale;
      if (ue8m0) {
        const auto word =
            static_cast<std::uint32_t>(static_cast<const std::int32_t*>(sv.data)[t * s_token + (g / 4) * s_col]);
        scale = ue8m0_to_scale(static_cast<std::uint8_t>(word >> (8 * (g % 4))));
      } else {
        scale = static_cast<const float*>(sv.data)[t * s_token + g * s_col];
      }
      const std::int64_t begin = g * kFp8GroupSize, end = std::min<std::int64_t>(begin + kFp8GroupSize, H);
      for (std::int64_t i = begin; i < end; ++i) store(out, i, table[q[i]] * scale);
    }
  }
}

EPMOE_QUANT_CLONES void dequantize_rows_bf16(const TensorView& q, const TensorView& s, const TensorView& o) {
  dequantize_rows<bf16_t>(q, s, o);
}
EPMOE_QUANT_CLONES void dequantize_rows_f32(const TensorView& q, const TensorView& s, const TensorView& o) {
  dequantize_rows<float>(q, s, o);
}

}  // namespace

void quantize_fp8_cpu(const QuantizeProblem& p) {
  if (p.x.dtype == DType::bf16)
    quantize_rows_bf16(p);
  else
    quantize_rows_f32(p);
}

void dequantize_fp8_cpu(const TensorView& q, const TensorView& scales, const TensorView& out) {
  if (out.dtype == DType::bf16)
    dequantize_rows_bf16(q, scales, out);
  else
    dequantize_rows_f32(q, scales, out);
}

}  // namespace epmoe::quant_detail
