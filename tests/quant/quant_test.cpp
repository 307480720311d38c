// FP8 per-token-group quantization (semantics §6) on CPU tensors: bit-exact against the independent
// reference for several H (partial last group included), round_scale and UE8M0 packing, strided
// outputs, hand-checked scales and bytes, dequantization error bounds, and argument errors.
#include <gtest/gtest.h>

#include <epmoe/quant.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/quant_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

struct Input {
  Tensor x;  // bf16 or fp32 [T, H]
  std::vector<float> vals;  // its values, decoded independently
};

// Values uniform in [-1, 1] times 2^k with k drawn per group, so groups span many magnitudes; some
// exact zeros, and some groups entirely tiny (amax below the 1e-4 floor).
Input random_input(std::mt19937_64& rng, DType dtype, std::int64_t T, std::int64_t H) {
  Input in;
  in.x = Tensor::empty(dtype, {T, H});
  in.vals.resize(static_cast<std::size_t>(T * H));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> k(-14, 14), pct(0, 99);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t g = 0; g < num_scale_groups(H); ++g) {
      const int p = pct(rng);
      const float mag = p < 5 ? 1e-6f : std::ldexp(1.0f, k(rng));
      for (std::int64_t i = g * 128; i < std::min(H, (g + 1) * 128); ++i) {
        float v = pct(rng) < 3 ? 0.0f : u(rng) * mag;
        const std::size_t idx = static_cast<std::size_t>(t * H + i);
        if (dtype == DType::bf16) {
          in.x.ptr<bf16_t>()[idx] = float_to_bf16(v);
          in.vals[idx] = static_cast<float>(test::ref_bf16_decode(in.x.ptr<bf16_t>()[idx].bits));
        } else {
          in.x.ptr<float>()[idx] = v;
          in.vals[idx] = v;
        }
      }
    }
  }
  return in;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Compares q [T, H] and scales with the reference; q may have a row stride, scales any strides (row- or
// column-major: element [t, c] at t * stride(0) + c * stride(1)).
void expect_equal_to_reference(const TensorView& q, const TensorView& scales, const test::RefFp8& ref, bool ue8m0) {
  for (std::int64_t t = 0; t < ref.T; ++t) {
    const auto* qr = static_cast<const std::uint8_t*>(q.data) + t * q.stride(0);
    for (std::int64_t i = 0; i < ref.H; ++i)
      ASSERT_EQ(qr[i], ref.q[static_cast<std::size_t>(t * ref.H + i)]) << "token " << t << " channel " << i;
    if (ue8m0) {
      const auto* w = static_cast<const std::uint32_t*>(scales.data) + t * scales.stride(0);
      for (std::int64_t j = 0; j < ref.W; ++j)
        ASSERT_EQ(w[j * scales.stride(1)], ref.words[static_cast<std::size_t>(t * ref.W + j)]) << "token " << t << " word " << j;
    } else {
      const auto* s = static_cast<const float*>(scales.data) + t * scales.stride(0);
      for (std::int64_t g = 0; g < ref.G; ++g)
        ASSERT_EQ(bits_of(s[g * scales.stride(1)]), bits_of(ref.scales[static_cast<std::size_t>(t * ref.G + g)]))
            << "token " << t << " group " << g << ": " << s[g * scales.stride(1)] << " vs "
            << ref.scales[static_cast<std::size_t>(t * ref.G + g)];
    }
  }
}

struct Mode {
  const char* name;
  Fp8Options options;
};
const Mode kModes[] = {{"plain", {false, false}}, {"round_scale", {true, false}}, {"ue8m0", {true, true}}};

TEST(QuantizeFp8, MatchesReferenceForManyHiddenSizes) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {128, 2048, 2880, 7168, 16, 144}) {
    for (DType dtype : {DType::bf16, DType::fp32}) {
      const std::int64_t T = H >= 2048 ? 6 : 17;
      const Input in = random_input(rng, dtype, T, H);
      for (const Mode& m : kModes) {
        SCOPED_TRACE(std::string(m.name) + " H=" + std::to_string(H) + " " + std::string(dtype_name(dtype)));
        const Fp8Tensor out = quantize_fp8(in.x, m.options);
        ASSERT_EQ(out.data.dtype(), DType::fp8_e4m3);
        ASSERT_EQ(out.data.shape(), (Shape{T, H}));
        if (m.options.use_ue8m0) {
          ASSERT_EQ(out.scales.dtype(), DType::int32);
          ASSERT_EQ(out.scales.shape(), (Shape{T, (num_scale_groups(H) + 3) / 4}));
        } else {
          ASSERT_EQ(out.scales.dtype(), DType::fp32);
          ASSERT_EQ(out.scales.shape(), (Shape{T, (H + 127) / 128}));
        }
        const auto ref = test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0);
        expect_equal_to_reference(out.data, out.scales, ref, m.options.use_ue8m0);
      }
    }
  }
}

TEST(QuantizeFp8, PartialLastGroupOf2880) {
  EXPECT_EQ(num_scale_groups(2880), 23);
  EXPECT_EQ(num_ue8m0_words(2880), 6);
  // Only the last 64 channels are large: the 23rd group's scale sees them, the others do not.
  Tensor x = Tensor::zeros(DType::fp32, {1, 2880});
  for (int i = 0; i < 2816; ++i) x.ptr<float>()[i] = 0.5f;
  for (int i = 2816; i < 2880; ++i) x.ptr<float>()[i] = 896.0f;
  const Fp8Tensor out = quantize_fp8(x);
  for (int g = 0; g < 22; ++g) EXPECT_EQ(out.scales.ptr<float>()[g], 0.5f / 448.0f) << g;
  EXPECT_EQ(out.scales.ptr<float>()[22], 2.0f);
  EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[0].bits, 0x7e);  // 0.5 * (448 / 0.5) = 448
  EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[2879].bits, 0x7e);  // 896 * (448 / 896) = 448
}

TEST(QuantizeFp8, ZeroAndTinyRowsUseTheAmaxFloor) {
  // amax 0 -> a = 1e-4: scale 1e-4 / 448, every code 0 (+0 stays +0).
  Tensor x = Tensor::zeros(DType::bf16, {2, 256});
  for (int i = 0; i < 128; ++i) x.ptr<bf16_t>()[256 + i] = float_to_bf16(1e-5f);  // row 1, group 0: below the floor
  const Fp8Tensor out = quantize_fp8(x);
  EXPECT_EQ(out.scales.ptr<float>()[0], 1e-4f / 448.0f);
  EXPECT_EQ(out.scales.ptr<float>()[1], 1e-4f / 448.0f);
  EXPECT_EQ(out.scales.ptr<float>()[2], 1e-4f / 448.0f);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[i].bits, 0x00);
  // bf16(1e-5) * (448 / 1e-4) = 44.77..: fp8 44 = 1.375 * 2^5, code 0x63.
  const float y = bf16_to_float(float_to_bf16(1e-5f)) * (448.0f / 1e-4f);
  EXPECT_GT(y, 44.0f);
  EXPECT_LT(y, 46.0f);
  EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[256].bits, 0x63);
  // round_scale: 1e-4 / 448 = 2.23e-7 -> 2^-22; UE8M0 byte 127 - 22 = 105 = 0x69, two groups -> 0x6969.
  const Fp8Tensor r = quantize_fp8(x, {true, true});
  EXPECT_EQ(r.scales.shape(), (Shape{2, 1}));
  EXPECT_EQ(static_cast<std::uint32_t>(r.scales.ptr<std::int32_t>()[0]), 0x00006969u);
  EXPECT_EQ(fp8_group_scale(0.0f, true), std::ldexp(1.0f, -22));
}

TEST(QuantizeFp8, Ue8m0PackingByHand) {
  // H = 2880 (23 groups, 6 words). Group g holds 448 * 2^(g - 10) once, so a / 448 = 2^(g - 10)
  // exactly: scale 2^(g - 10), byte 117 + g, and that value quantizes to 448 (0x7e).
  Tensor x = Tensor::zeros(DType::bf16, {1, 2880});
  for (int g = 0; g < 23; ++g) {
    x.ptr<bf16_t>()[g * 128 + 3] = float_to_bf16(std::ldexp(448.0f, g - 10));
    x.ptr<bf16_t>()[g * 128 + 7] = float_to_bf16(-std::ldexp(1.0f, g - 10));  // 1 * 2^(g-10) / 2^(g-10) = 1
  }
  const Fp8Tensor out = quantize_fp8(x, {true, true});
  ASSERT_EQ(out.scales.shape(), (Shape{1, 6}));
  const auto* w = reinterpret_cast<const std::uint32_t*>(out.scales.ptr<std::int32_t>());
  EXPECT_EQ(w[0], 0x78777675u);  // groups 0..3: bytes 117, 118, 119, 120, group 0 lowest
  EXPECT_EQ(w[1], 0x7c7b7a79u);
  EXPECT_EQ(w[4], 0x88878685u);
  EXPECT_EQ(w[5], 0x008b8a89u);  // groups 20..22, the byte past the last group is 0
  for (int g = 0; g < 23; ++g) {
    EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[g * 128 + 3].bits, 0x7e) << g;
    EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[g * 128 + 7].bits, 0xb8) << g;  // -1.0
  }
  // Float scales with round_scale are the same powers of two.
  const Fp8Tensor f = quantize_fp8(x, {true, false});
  for (int g = 0; g < 23; ++g) EXPECT_EQ(f.scales.ptr<float>()[g], std::ldexp(1.0f, g - 10)) << g;
}

TEST(QuantizeFp8, RoundScaleJustAboveAPowerOfTwo) {
  // amax 449: 449 / 448 > 1 -> scale 2, byte 128; 449 / 2 = 224.5 -> fp8 224 (0x76).
  Tensor x = Tensor::zeros(DType::fp32, {1, 16});
  x.ptr<float>()[0] = 449.0f;
  x.ptr<float>()[1] = -3.0f;  // -1.5 -> 0xbc
  const Fp8Tensor out = quantize_fp8(x, {true, true});
  EXPECT_EQ(out.scales.ptr<std::int32_t>()[0], 128);
  EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[0].bits, 0x76);
  EXPECT_EQ(out.data.ptr<fp8_e4m3_t>()[1].bits, 0xbc);
  // Without round_scale: scale 449 / 448, 449 * (448 / 449) rounds to 448.
  const Fp8Tensor p = quantize_fp8(x);
  EXPECT_EQ(p.scales.ptr<float>()[0], 449.0f / 448.0f);
  EXPECT_EQ(p.data.ptr<fp8_e4m3_t>()[0].bits, 0x7e);
}

TEST(QuantizeFp8, IntoStridedRowsOfALargerBuffer) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 5, H = 2880, G = 23, W = 6;
  const Input in = random_input(rng, DType::bf16, T, H);
  // x itself as a view with a row stride too.
  Tensor x_big = Tensor::empty(DType::bf16, {T, H + 32});
  for (std::int64_t t = 0; t < T; ++t)
    std::memcpy(x_big.ptr<bf16_t>() + t * (H + 32), in.x.ptr<bf16_t>() + t * H, static_cast<std::size_t>(H) * 2);
  const TensorView x(x_big.data(), DType::bf16, {T, H}, {H + 32, 1}, Device::cpu());
  for (const Mode& m : kModes) {
    SCOPED_TRACE(m.name);
    const std::int64_t q_stride = H + 48, s_stride = m.options.use_ue8m0 ? W + 3 : G + 5;
    std::vector<std::uint8_t> qbuf(static_cast<std::size_t>(T * q_stride), 0xab);
    std::vector<std::uint32_t> sbuf(static_cast<std::size_t>(T * s_stride), 0xdeadbeefu);
    const TensorView q(qbuf.data(), DType::fp8_e4m3, {T, H}, {q_stride, 1}, Device::cpu());
    const TensorView s(sbuf.data(), m.options.use_ue8m0 ? DType::int32 : DType::fp32, {T, m.options.use_ue8m0 ? W : G},
                       {s_stride, 1}, Device::cpu());
    quantize_fp8_into(x, q, s, m.options);
    const auto ref = test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0);
    expect_equal_to_reference(q, s, ref, m.options.use_ue8m0);
    // The gaps between rows are untouched.
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t i = H; i < q_stride; ++i) ASSERT_EQ(qbuf[static_cast<std::size_t>(t * q_stride + i)], 0xab);
      for (std::int64_t j = m.options.use_ue8m0 ? W : G; j < s_stride; ++j)
        ASSERT_EQ(sbuf[static_cast<std::size_t>(t * s_stride + j)], 0xdeadbeefu);
    }
  }
}

TEST(QuantizeFp8, EmptyBatchAndInputUntouched) {
  const Tensor empty = Tensor::empty(DType::bf16, {0, 256});
  const Fp8Tensor e = quantize_fp8(empty, {true, true});
  EXPECT_EQ(e.data.shape(), (Shape{0, 256}));
  EXPECT_EQ(e.scales.shape(), (Shape{0, 1}));
  EXPECT_EQ(dequantize_fp8(e.data, e.scales).shape(), (Shape{0, 256}));
  std::mt19937_64 rng(test::fresh_seed());
  const Tensor x = test::random_bf16(rng, 3, 384, 5.0f);
  std::vector<std::uint16_t> before(x.ptr<std::int16_t>(), x.ptr<std::int16_t>() + 3 * 384);
  (void)quantize_fp8(x);
  EXPECT_EQ(std::memcmp(before.data(), x.data(), x.nbytes()), 0);
}

// ---------------------------------------------------------------- scale layouts

// Equal sizes and bytes; T = 0 tensors hold no storage, and memcmp must not see their null pointers.
bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

// Column-major scales (DeepGEMM's TMA-aligned layout): strides {1, T rounded up to 4}, the same values as the
// reference (and so as row-major), for T = 0, 1, non-multiples of 4 and H with a partial last group.
TEST(QuantizeFp8, ColumnMajorScalesHoldTheRowMajorValues) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {2048, 2880, 4096, 7168, 144}) {
    for (std::int64_t T : {0, 1, 2, 3, 4, 5, 13}) {
      const Input in = random_input(rng, DType::bf16, T, H);
      for (const Mode& m : kModes) {
        SCOPED_TRACE(std::string(m.name) + " H=" + std::to_string(H) + " T=" + std::to_string(T));
        Fp8Options o = m.options;
        o.scale_layout = ScaleLayout::column_major;
        const Fp8Tensor col = quantize_fp8(in.x, o);
        const Fp8Tensor row = quantize_fp8(in.x, m.options);
        const std::int64_t C = m.options.use_ue8m0 ? (num_scale_groups(H) + 3) / 4 : (H + 127) / 128;
        const std::int64_t pitch = (T + 3) / 4 * 4;  // 16 bytes of 4-byte scales
        ASSERT_EQ(col.scales.shape(), (Shape{T, C}));
        ASSERT_EQ(col.scales.view().strides, (Shape{1, pitch}));
        EXPECT_TRUE(scales_have_layout(col.scales, ScaleLayout::column_major));
        ASSERT_TRUE(same_bytes(col.data, row.data));
        const auto ref = test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0);
        expect_equal_to_reference(col.data, col.scales, ref, m.options.use_ue8m0);
        // Dequantizing reads the layout from the strides: the same bits from either.
        const Tensor dc = dequantize_fp8(col.data, col.scales, DType::fp32);
        const Tensor dr = dequantize_fp8(row.data, row.scales, DType::fp32);
        ASSERT_TRUE(same_bytes(dc, dr));
      }
    }
  }
}

// quantize_fp8_into with caller-provided column-major scales of a wider column stride: the values land at
// [t * 1 + c * stride], the gaps stay untouched.
TEST(QuantizeFp8, IntoColumnMajorScalesOfAWiderColumnStride) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 7, H = 2880, G = 23, W = 6, pitch = 11;
  const Input in = random_input(rng, DType::fp32, T, H);
  for (const Mode& m : kModes) {
    SCOPED_TRACE(m.name);
    const std::int64_t C = m.options.use_ue8m0 ? W : G;
    std::vector<std::uint32_t> sbuf(static_cast<std::size_t>(C * pitch), 0xdeadbeefu);
    const TensorView s(sbuf.data(), m.options.use_ue8m0 ? DType::int32 : DType::fp32, {T, C}, {1, pitch},
                       Device::cpu());
    Fp8Options o = m.options;
    o.scale_layout = ScaleLayout::column_major;
    const Tensor q = Tensor::empty(DType::fp8_e4m3, {T, H});
    quantize_fp8_into(in.x, q, s, o);
    expect_equal_to_reference(q, s, test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0),
                              m.options.use_ue8m0);
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t r = T; r < pitch; ++r) ASSERT_EQ(sbuf[static_cast<std::size_t>(c * pitch + r)], 0xdeadbeefu);
  }
}

TEST(Fp8Scales, LayoutsByHand) {
  EXPECT_EQ(tma_aligned_scale_rows(0), 0);
  EXPECT_EQ(tma_aligned_scale_rows(1), 4);
  EXPECT_EQ(tma_aligned_scale_rows(4), 4);
  EXPECT_EQ(tma_aligned_scale_rows(5), 8);
  EXPECT_STREQ(scale_layout_name(ScaleLayout::row_major), "row_major");
  EXPECT_STREQ(scale_layout_name(ScaleLayout::column_major), "column_major");
  // DeepEP's low-latency scales: [E_local, R*Tmax, C] over a [E_local, C, M] allocation.
  const Tensor b = empty_fp8_scales(DType::int32, {3, 10, 6}, ScaleLayout::column_major);
  EXPECT_EQ(b.shape(), (Shape{3, 10, 6}));
  EXPECT_EQ(b.view().strides, (Shape{72, 1, 12}));
  EXPECT_EQ(empty_fp8_scales(DType::fp32, {5, 2}, ScaleLayout::row_major).view().strides, (Shape{2, 1}));
  float dummy[64] = {};
  const auto view = [&](Shape shape, Shape strides) { return TensorView(dummy, DType::fp32, shape, strides, {}); };
  EXPECT_TRUE(scales_have_layout(view({5, 3}, {3, 1}), ScaleLayout::row_major));
  EXPECT_TRUE(scales_have_layout(view({5, 3}, {7, 1}), ScaleLayout::row_major));
  EXPECT_FALSE(scales_have_layout(view({5, 3}, {3, 1}), ScaleLayout::column_major));
  EXPECT_TRUE(scales_have_layout(view({5, 3}, {1, 8}), ScaleLayout::column_major));
  EXPECT_FALSE(scales_have_layout(view({5, 3}, {1, 4}), ScaleLayout::column_major));  // columns overlap
  EXPECT_FALSE(scales_have_layout(view({5, 3}, {2, 10}), ScaleLayout::row_major));
  EXPECT_FALSE(scales_have_layout(view({5, 3}, {2, 10}), ScaleLayout::column_major));
  EXPECT_TRUE(scales_have_layout(view({1, 3}, {99, 1}), ScaleLayout::column_major));  // one token: both
  EXPECT_TRUE(scales_have_layout(view({5, 1}, {1, 1}), ScaleLayout::row_major));      // one column: both
  EXPECT_TRUE(scales_have_layout(view({0, 3}, {0, 0}), ScaleLayout::row_major));      // empty
  EXPECT_FALSE(scales_have_layout(view({5}, {1}), ScaleLayout::row_major));           // not 2-d
}

// ---------------------------------------------------------------- dequantization

TEST(DequantizeFp8, MatchesReferenceBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 4, H = 2880;
  const Input in = random_input(rng, DType::fp32, T, H);
  for (const Mode& m : kModes) {
    const Fp8Tensor qt = quantize_fp8(in.x, m.options);
    const auto ref = test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0);
    for (DType out_dtype : {DType::fp32, DType::bf16}) {
      SCOPED_TRACE(std::string(m.name) + " -> " + std::string(dtype_name(out_dtype)));
      const Tensor d = dequantize_fp8(qt.data, qt.scales, out_dtype);
      ASSERT_EQ(d.dtype(), out_dtype);
      ASSERT_EQ(d.shape(), (Shape{T, H}));
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t i = 0; i < H; ++i) {
          const std::size_t k = static_cast<std::size_t>(t * H + i);
          // float32 product of the fp8 value and the group's scale, then bf16 if asked.
          const float v = static_cast<float>(test::ref_fp8_decode(ref.q[k]) *
                                             ref.group_scale[static_cast<std::size_t>(t * ref.G + i / 128)]);
          if (out_dtype == DType::fp32)
            ASSERT_EQ(d.ptr<float>()[k], v) << t << "," << i;
          else
            ASSERT_EQ(test::ref_bf16_decode(d.ptr<bf16_t>()[k].bits), test::ref_bf16_round(v)) << t << "," << i;
        }
      }
    }
  }
}

TEST(DequantizeFp8, RoundTripWithinFp8ErrorBound) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {128, 2048, 2880, 7168}) {
    const std::int64_t T = 4;
    const Input in = random_input(rng, DType::bf16, T, H);
    for (const Mode& m : kModes) {
      const Fp8Tensor qt = quantize_fp8(in.x, m.options);
      const Tensor d = dequantize_fp8(qt.data, qt.scales, DType::fp32);
      const auto ref = test::ref_quantize_fp8(in.vals, T, H, m.options.round_scale, m.options.use_ue8m0);
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t i = 0; i < H; ++i) {
          const std::size_t k = static_cast<std::size_t>(t * H + i);
          const double x = in.vals[k], scale = ref.group_scale[static_cast<std::size_t>(t * ref.G + i / 128)];
          // Normal fp8: half an ulp is 2^-4 relative; subnormal step 2^-9: half is 2^-10 * scale.
          const double bound = std::fabs(x) * 0x1p-4 + 0x1p-10 * scale + 1e-30;
          ASSERT_LE(std::fabs(d.ptr<float>()[k] - x), bound * (1 + 1e-6))
              << m.name << " H=" << H << " " << t << "," << i;
        }
      }
    }
  }
}

TEST(DequantizeFp8, HandValuesNanAndStridedInput) {
  // Row 0: float scale 0.5; row 1: UE8M0 is separate below. Codes: 1.0, -448, NaN, smallest subnormal.
  std::vector<std::uint8_t> qbuf = {0x38, 0xfe, 0x7f, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                    0xaa, 0xaa, 0xaa, 0xaa,  // gap between the rows
                                    0x40, 0x00, 0x80, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const TensorView q(qbuf.data(), DType::fp8_e4m3, {2, 16}, {20, 1}, Device::cpu());
  const std::vector<float> scales = {0.5f, 3.0f};
  const TensorView s(const_cast<float*>(scales.data()), DType::fp32, {2, 1});
  const Tensor f = dequantize_fp8(q, s, DType::fp32);
  EXPECT_EQ(f.ptr<float>()[0], 0.5f);
  EXPECT_EQ(f.ptr<float>()[1], -224.0f);
  EXPECT_TRUE(std::isnan(f.ptr<float>()[2]));
  EXPECT_EQ(f.ptr<float>()[3], std::ldexp(0.5f, -9));
  EXPECT_EQ(f.ptr<float>()[16], 6.0f);  // 0x40 = 2.0, times 3
  EXPECT_EQ(f.ptr<float>()[17], 0.0f);
  EXPECT_TRUE(std::signbit(f.ptr<float>()[18]));  // -0
  EXPECT_TRUE(std::isnan(f.ptr<float>()[19]));
  const Tensor b = dequantize_fp8(q, s, DType::bf16);
  EXPECT_EQ(b.ptr<bf16_t>()[0].bits, 0x3f00);  // 0.5
  EXPECT_EQ(b.ptr<bf16_t>()[1].bits, 0xc360);  // -224
  EXPECT_TRUE(std::isnan(bf16_to_float(b.ptr<bf16_t>()[2])));
  EXPECT_EQ(b.ptr<bf16_t>()[18].bits, 0x8000);
  // UE8M0: byte 126 = 0.5 for the only group; byte 255 is NaN.
  const std::vector<std::int32_t> words = {126, 255};
  const TensorView w(const_cast<std::int32_t*>(words.data()), DType::int32, {2, 1});
  const Tensor u = dequantize_fp8(q, w, DType::fp32);
  EXPECT_EQ(u.ptr<float>()[1], -224.0f);
  EXPECT_TRUE(std::isnan(u.ptr<float>()[16]));
}

TEST(DequantizeFp8, Ue8m0AndFloatScalesAgree) {
  std::mt19937_64 rng(test::fresh_seed());
  const Input in = random_input(rng, DType::bf16, 3, 7168);
  const Fp8Tensor a = quantize_fp8(in.x, {true, false}), b = quantize_fp8(in.x, {true, true});
  ASSERT_EQ(std::memcmp(a.data.data(), b.data.data(), a.data.nbytes()), 0);
  const Tensor da = dequantize_fp8(a.data, a.scales), db = dequantize_fp8(b.data, b.scales);
  EXPECT_EQ(std::memcmp(da.data(), db.data(), da.nbytes()), 0);
}

// ---------------------------------------------------------------- helpers

TEST(Fp8Scales, GroupScaleHandValues) {
  EXPECT_EQ(fp8_group_scale(448.0f, false), 1.0f);
  EXPECT_EQ(fp8_group_scale(448.0f, true), 1.0f);
  EXPECT_EQ(fp8_group_scale(449.0f, true), 2.0f);
  EXPECT_EQ(fp8_group_scale(224.0f, true), 0.5f);
  EXPECT_EQ(fp8_group_scale(225.0f, true), 1.0f);
  EXPECT_EQ(fp8_group_scale(3.5f, false), 3.5f / 448.0f);
  EXPECT_EQ(fp8_group_scale(0.0f, false), 1e-4f / 448.0f);
  EXPECT_EQ(fp8_group_scale(5e-5f, false), 1e-4f / 448.0f);
  EXPECT_THROW(fp8_group_scale(-1.0f, false), Error);
  EXPECT_THROW(fp8_group_scale(NAN, true), Error);
}

TEST(Fp8Scales, Ue8m0Bytes) {
  EXPECT_EQ(ue8m0_from_scale(1.0f), 127);
  EXPECT_EQ(ue8m0_from_scale(2.0f), 128);
  EXPECT_EQ(ue8m0_from_scale(0.5f), 126);
  EXPECT_EQ(ue8m0_from_scale(std::ldexp(1.0f, -22)), 105);
  EXPECT_EQ(ue8m0_from_scale(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(ue8m0_from_scale(std::ldexp(1.0f, -126)), 1);
  EXPECT_EQ(ue8m0_from_scale(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(ue8m0_to_scale(127), 1.0f);
  EXPECT_EQ(ue8m0_to_scale(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ue8m0_to_scale(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_scale(255)));
  for (int b = 0; b < 255; ++b) EXPECT_EQ(ue8m0_from_scale(ue8m0_to_scale(static_cast<std::uint8_t>(b))), b);
  for (float bad : {3.0f, 0.0f, -1.0f, INFINITY, NAN, std::ldexp(1.0f, -128), 1.5f}) {
    try {
      ue8m0_from_scale(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'pow2_scale'"), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------- errors

template <class F>
void expect_invalid(F&& f, std::vector<std::string> parts, ErrorCode code = ErrorCode::invalid_argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(QuantErrors, BadInput) {
  const Tensor h100 = Tensor::zeros(DType::bf16, {2, 100});
  expect_invalid([&] { quantize_fp8(h100); }, {"'x'", "multiple of 16", "H = 100"});
  const Tensor h0 = Tensor::zeros(DType::bf16, {2, 0});
  expect_invalid([&] { quantize_fp8(h0); }, {"'x'", "multiple of 16"});
  const Tensor i32 = Tensor::zeros(DType::int32, {2, 128});
  expect_invalid([&] { quantize_fp8(i32); }, {"'x'", "bfloat16 or float32", "int32[2, 128]"});
  const Tensor fp8 = Tensor::zeros(DType::fp8_e4m3, {2, 128});
  expect_invalid([&] { quantize_fp8(fp8); }, {"'x'", "float8_e4m3fn[2, 128]"});
  const Tensor one_d = Tensor::zeros(DType::bf16, {128});
  expect_invalid([&] { quantize_fp8(one_d); }, {"'x'", "2-d"});
  expect_invalid([&] { quantize_fp8(TensorView()); }, {"'x'", "None"});
  const Tensor ok = Tensor::zeros(DType::bf16, {2, 128});
  expect_invalid([&] { quantize_fp8(ok, {false, true}); }, {"'options.use_ue8m0'", "round_scale = true"});
  const Tensor big = Tensor::zeros(DType::bf16, {4, 256});
  const TensorView col_strided(big.data(), DType::bf16, {2, 128}, {256, 2}, Device::cpu());
  expect_invalid([&] { quantize_fp8(col_strided); }, {"'x'", "unit stride in dimension 1"});
  const TensorView overlapping(big.data(), DType::bf16, {2, 128}, {64, 1}, Device::cpu());
  expect_invalid([&] { quantize_fp8(overlapping); }, {"'x'", "row stride >= 128"});
  Fp8Options col_no_round;
  col_no_round.use_ue8m0 = true;
  col_no_round.scale_layout = ScaleLayout::column_major;
  expect_invalid([&] { quantize_fp8(ok, col_no_round); }, {"'options.use_ue8m0'", "round_scale = true"});
  Fp8Options bad_layout;
  bad_layout.scale_layout = static_cast<ScaleLayout>(7);
  expect_invalid([&] { quantize_fp8(ok, bad_layout); }, {"'options.scale_layout'", "row_major or column_major", "7"});
}

TEST(QuantErrors, BadOutputs) {
  const Tensor x = Tensor::zeros(DType::bf16, {3, 2880});
  const Tensor q = Tensor::zeros(DType::fp8_e4m3, {3, 2880});
  const Tensor s = Tensor::zeros(DType::fp32, {3, 23});
  const Tensor w = Tensor::zeros(DType::int32, {3, 6});
  EXPECT_NO_THROW(quantize_fp8_into(x, q, s));
  EXPECT_NO_THROW(quantize_fp8_into(x, q, w, {true, true}));
  const Tensor q_i8 = Tensor::zeros(DType::int8, {3, 2880});
  expect_invalid([&] { quantize_fp8_into(x, q_i8, s); }, {"'q'", "float8_e4m3fn[3, 2880]", "int8[3, 2880]"});
  const Tensor q_short = Tensor::zeros(DType::fp8_e4m3, {2, 2880});
  expect_invalid([&] { quantize_fp8_into(x, q_short, s); }, {"'q'", "float8_e4m3fn[2, 2880]"});
  const Tensor s22 = Tensor::zeros(DType::fp32, {3, 22});
  expect_invalid([&] { quantize_fp8_into(x, q, s22); }, {"'scales'", "float32[3, 23]", "float32[3, 22]"});
  expect_invalid([&] { quantize_fp8_into(x, q, s, {true, true}); }, {"'scales'", "int32[3, 6]", "float32[3, 23]"});
  expect_invalid([&] { quantize_fp8_into(x, q, w, {true, false}); }, {"'scales'", "float32[3, 23]", "int32[3, 6]"});
  const TensorView q_overlap(q.data(), DType::fp8_e4m3, {3, 2880}, {1000, 1}, Device::cpu());
  expect_invalid([&] { quantize_fp8_into(x, q_overlap, s); }, {"'q'", "row stride >= 2880"});
  // The scales' strides must be the layout options.scale_layout names.
  Fp8Options col;
  col.scale_layout = ScaleLayout::column_major;
  expect_invalid([&] { quantize_fp8_into(x, q, s, col); },
                 {"'scales'", "column-major scales (unit stride in dimension 0, a column stride >= 3)", "[23, 1]"});
  const Tensor s_col = empty_fp8_scales(DType::fp32, {3, 23}, ScaleLayout::column_major);
  EXPECT_NO_THROW(quantize_fp8_into(x, q, s_col, col));
  expect_invalid([&] { quantize_fp8_into(x, q, s_col); },
                 {"'scales'", "row-major scales (unit stride in dimension 1, a row stride >= 23)", "[1, 4]"});
}

TEST(QuantErrors, BadDequantizeArguments) {
  const Tensor q = Tensor::zeros(DType::fp8_e4m3, {2, 256});
  const Tensor s = Tensor::zeros(DType::fp32, {2, 2});
  EXPECT_NO_THROW(dequantize_fp8(q, s));
  const Tensor q_bf16 = Tensor::zeros(DType::bf16, {2, 256});
  expect_invalid([&] { dequantize_fp8(q_bf16, s); }, {"'q'", "float8_e4m3fn", "bfloat16[2, 256]"});
  const Tensor s3 = Tensor::zeros(DType::fp32, {2, 3});
  expect_invalid([&] { dequantize_fp8(q, s3); }, {"'scales'", "float32[2, 2]", "float32[2, 3]"});
  const Tensor s_bf16 = Tensor::zeros(DType::bf16, {2, 2});
  expect_invalid([&] { dequantize_fp8(q, s_bf16); }, {"'scales'", "int32[2, 1]", "bfloat16[2, 2]"});
  expect_invalid([&] { dequantize_fp8(q, s, DType::int32); }, {"'out_dtype'", "bfloat16 or float32", "int32"});
  // Scales in neither layout: strided in both dimensions.
  float sbuf[16] = {};
  const TensorView s_neither(sbuf, DType::fp32, {2, 2}, {4, 2}, Device::cpu());
  expect_invalid([&] { dequantize_fp8(q, s_neither); }, {"'scales'", "row-major", "or column-major", "[4, 2]"});
  const TensorView s_col(sbuf, DType::fp32, {2, 2}, {1, 2}, Device::cpu());
  EXPECT_NO_THROW(dequantize_fp8(q, s_col));
}

#if !defined(EPMOE_HAVE_CUDA)
// CPU-only builds: tensors on a GPU are a clear error (CUDA builds quantize them on the GPU).
TEST(QuantErrors, CudaTensorsInACpuOnlyBuildAreUnsupported) {
  std::uint16_t dummy[128] = {};
  const TensorView on_gpu(dummy, DType::bf16, {1, 128}, {128, 1}, Device::cuda(0));
  expect_invalid([&] { quantize_fp8(on_gpu); }, {"'x'", "cuda:0", "built without CUDA"}, ErrorCode::unsupported);
  const Tensor q = Tensor::zeros(DType::fp8_e4m3, {1, 128});
  const Tensor s = Tensor::zeros(DType::fp32, {1, 1});
  expect_invalid([&] { quantize_fp8_into(on_gpu, q, s); }, {"'q'", "cuda:0"});  // devices must match
  const TensorView q_gpu(dummy, DType::fp8_e4m3, {1, 128}, {128, 1}, Device::cuda(0));
  expect_invalid([&] { dequantize_fp8(q_gpu, s); }, {"'scales'", "cuda:0"});
}
#endif

}  // namespace
}  // namespace epmoe
