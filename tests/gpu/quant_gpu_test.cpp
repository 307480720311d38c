// CUDA fp8 per-token-group quantization / dequantization against the CPU implementation on the same
// inputs, bit for bit: T in {0, 1, 7, 128, 4096}, H in {2048, 2880, 7168} (and 16, 144: one partial
// group), bfloat16 and float32 input, plain / round_scale / UE8M0 scales, rows with zeros, infinities,
// NaNs, subnormals and huge values, strided rows; outputs poisoned first. The hardware e4m3 conversion
// and the software one agree with the CPU over a dense sweep of float inputs.
#include <gtest/gtest.h>

#include <epmoe/quant.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gpu/gpu_util.hpp"
#include "quant/quant.hpp"
#include "support/quant_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::same_bits;
using gputest::to_device;
using gputest::to_host;

// Random rows with a per-row magnitude between 1e-6 and 1e6, and a few special rows.
Tensor make_input(std::mt19937_64& rng, std::int64_t T, std::int64_t H, DType dtype) {
  Tensor f = Tensor::empty(DType::fp32, {T, H});
  gputest::fill_random(rng(), f);
  std::uniform_real_distribution<float> exponent(-6.0f, 6.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    float* row = f.ptr<float>() + t * H;
    const float scale = std::pow(10.0f, exponent(rng));
    for (std::int64_t h = 0; h < H; ++h) row[h] *= scale;
    switch (t % 16) {
      case 3:
        for (std::int64_t h = 0; h < H; ++h) row[h] = 0.0f;
        break;  // amax floor
      case 5:
        row[H / 2] = std::numeric_limits<float>::infinity();
        break;  // inf amax
      case 6:
        row[1] = std::numeric_limits<float>::quiet_NaN();
        row[H - 1] = -row[1];
        break;  // NaN skipped
      case 9:
        for (std::int64_t h = 0; h < H; h += 3) row[h] = 1e-40f;
        break;  // subnormals
      case 11:
        row[0] = 3e38f;
        row[H - 1] = -3e38f;
        break;  // huge
      default:
        break;
    }
  }
  if (dtype == DType::fp32) return f;
  Tensor b = Tensor::empty(DType::bf16, {T, H});
  for (std::int64_t i = 0; i < T * H; ++i) b.ptr<bf16_t>()[i] = float_to_bf16(f.ptr<float>()[i]);
  return b;
}

struct Mode {
  bool round_scale, ue8m0;
};
constexpr Mode kModes[] = {{false, false}, {true, false}, {true, true}};

void compare_quantize(const Tensor& x, const Fp8Options& o, const std::string& what, bool strided) {
  const std::int64_t T = x.size(0), H = x.size(1);
  const Fp8Tensor want = quantize_fp8(x, o);
  const Tensor x_dev = to_device(x);
  const std::int64_t S = want.scales.size(1);
  // Caller buffers, poisoned; strided rows when asked (q rows 16 bytes apart more, scales one more word).
  const std::int64_t q_stride = strided ? H + 16 : H, s_stride = strided ? S + 1 : S;
  Tensor q_store = Tensor::empty(DType::fp8_e4m3, {T, q_stride}, gputest::gpu());
  Tensor s_store = Tensor::empty(want.scales.dtype(), {T, s_stride}, gputest::gpu());
  const TensorView q(q_store.data(), DType::fp8_e4m3, {T, H}, {q_stride, 1}, gputest::gpu());
  const TensorView s(s_store.data(), want.scales.dtype(), {T, S}, {s_stride, 1}, gputest::gpu());
  // The public call (hardware conversion, kernel shape chosen by size), the software conversion, and
  // both kernel shapes (1 or 4 scale words per warp) forced.
  for (int variant = 0; variant < 4; ++variant) {
    gputest::poison(q_store);
    gputest::poison(s_store);
    if (variant == 0)
      quantize_fp8_into(x_dev, q, s, o);
    else if (variant == 1)
      quant_detail::quantize_fp8_cuda({x_dev, q, s, T, H, o}, Stream{}, false);
    else
      quant_detail::quantize_fp8_cuda({x_dev, q, s, T, H, o}, Stream{}, true, variant == 2 ? 1 : 4);
    const char* names[] = {" public", " software conversion", " 1 word/warp", " 4 words/warp"};
    EXPECT_TRUE(same_bits(want.data, to_host(q))) << what << names[variant] << " q";
    EXPECT_TRUE(same_bits(want.scales, to_host(s))) << what << names[variant] << " scales";
  }
  // The allocating variant, then the dequantization of its result, both ways.
  const Fp8Tensor got = quantize_fp8(x_dev, o);
  EXPECT_TRUE(same_bits(want.data, to_host(got.data))) << what << " quantize_fp8";
  for (DType out : {DType::bf16, DType::fp32}) {
    const Tensor dq_want = dequantize_fp8(want.data, want.scales, out);
    const Tensor dq_got = dequantize_fp8(got.data, got.scales, out);
    EXPECT_TRUE(same_bits(dq_want, to_host(dq_got))) << what << " dequantize to " << dtype_name(out);
  }
}

TEST(GpuQuant, QuantizeAndDequantizeMatchCpuBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  std::vector<std::int64_t> hs = gputest::hidden_sizes();
  hs.push_back(16);
  hs.push_back(144);
  for (std::int64_t T : gputest::token_counts())
    for (std::int64_t H : hs)
      for (DType dtype : {DType::bf16, DType::fp32}) {
        if (T >= 4096 && dtype == DType::fp32 && H != 2880) continue;
        const Tensor x = make_input(rng, T, H, dtype);
        for (const Mode& m : kModes) {
          Fp8Options o;
          o.round_scale = m.round_scale;
          o.use_ue8m0 = m.ue8m0;
          const std::string what = "T=" + std::to_string(T) + " H=" + std::to_string(H) + " " +
                                   std::string(dtype_name(dtype)) + " round_scale=" + std::to_string(m.round_scale) +
                                   " ue8m0=" + std::to_string(m.ue8m0);
          compare_quantize(x, o, what, T == 7 || (T == 128 && H == 2880));
          if (HasFailure()) return;
        }
      }
}

// Column-major scales (DeepGEMM's TMA-aligned layout: strides {1, T rounded up to 4}) from the CUDA quantizer hold
// the CPU row-major path's values bit for bit, from every kernel shape; the codes are unchanged; dequantizing from
// them gives the CPU's bits. T = 0, 1 and non-multiples of 4; H = 2048, 2880 (a partial group), 4096, 7168.
TEST(GpuQuant, ColumnMajorScalesMatchCpuRowMajorBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{4096}, std::int64_t{7168}})
    for (std::int64_t T : {std::int64_t{0}, std::int64_t{1}, std::int64_t{3}, std::int64_t{5}, std::int64_t{130},
                           std::int64_t{1027}})
      for (DType dtype : {DType::bf16, DType::fp32}) {
        if (dtype == DType::fp32 && H != 2880) continue;
        const Tensor x = make_input(rng, T, H, dtype);
        const Tensor x_dev = to_device(x);
        for (const Mode& m : kModes) {
          const std::string what = "T=" + std::to_string(T) + " H=" + std::to_string(H) + " " +
                                   std::string(dtype_name(dtype)) + " round_scale=" + std::to_string(m.round_scale) +
                                   " ue8m0=" + std::to_string(m.ue8m0);
          Fp8Options row{m.round_scale, m.ue8m0};
          Fp8Options col = row;
          col.scale_layout = ScaleLayout::column_major;
          const Fp8Tensor want = quantize_fp8(x, row);  // CPU, row-major
          const std::int64_t S = want.scales.size(1), pitch = (T + 3) / 4 * 4;
          const Fp8Tensor got = quantize_fp8(x_dev, col);
          ASSERT_EQ(got.scales.view().strides, (Shape{1, pitch})) << what;
          EXPECT_TRUE(same_bits(want.data, to_host(got.data))) << what << " q";
          EXPECT_TRUE(same_bits(want.scales, gputest::to_cpu(got.scales))) << what << " scales";
          for (DType out : {DType::bf16, DType::fp32})
            EXPECT_TRUE(same_bits(dequantize_fp8(want.data, want.scales, out),
                                  to_host(dequantize_fp8(got.data, got.scales, out))))
                << what << " dequantize to " << dtype_name(out);
          // Both kernel shapes and the software conversion, into poisoned column-major scales.
          Tensor q = Tensor::empty(DType::fp8_e4m3, {T, H}, gputest::gpu());
          const Tensor s = empty_fp8_scales(want.scales.dtype(), {T, S}, ScaleLayout::column_major, gputest::gpu());
          for (int variant = 0; variant < 3; ++variant) {
            gputest::poison(s);
            quant_detail::quantize_fp8_cuda({x_dev, q, s, T, H, col}, Stream{}, variant != 0, variant == 2 ? 4 : 1);
            EXPECT_TRUE(same_bits(want.scales, gputest::to_cpu(s))) << what << " variant " << variant;
          }
          if (HasFailure()) return;
        }
      }
}

// Every float of the sweep (|x| <= 448 or NaN) in groups whose maximum is exactly 448: scale 1, so
// q = e4m3(x) directly. CPU, the hardware conversion and the software one must agree everywhere.
TEST(GpuQuant, E4m3ConversionSweepHardwareSoftwareAndCpuAgree) {
  std::vector<std::uint32_t> bits;
  for (std::uint32_t b : test::fp8_sweep_bits()) {
    const std::uint32_t a = b & 0x7fffffffu;
    if (a <= 0x43e00000u || a > 0x7f800000u) bits.push_back(b);
  }
  const std::int64_t per_row = 127;  // + one 448 per row
  const std::int64_t T = static_cast<std::int64_t>((bits.size() + per_row - 1) / per_row);
  Tensor x = Tensor::empty(DType::fp32, {T, 128});
  for (std::int64_t t = 0; t < T; ++t) {
    float* row = x.ptr<float>() + t * 128;
    row[0] = 448.0f;
    for (std::int64_t i = 0; i < per_row; ++i) {
      const std::size_t j = static_cast<std::size_t>(t * per_row + i);
      row[i + 1] = j < bits.size() ? bits_float(bits[j]) : 1.0f;
    }
  }
  compare_quantize(x, {}, "sweep of " + std::to_string(bits.size()) + " floats", false);
}

TEST(GpuQuant, DequantizeArbitraryCodesAndScales) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {std::int64_t{2880}, std::int64_t{7168}, std::int64_t{100}})
    for (bool ue8m0 : {false, true}) {
      const std::int64_t T = 67, G = num_scale_groups(H);
      Tensor q = Tensor::empty(DType::fp8_e4m3, {T, H});
      gputest::fill_random(rng(), q);  // all 256 codes, NaN codes included
      Tensor s = Tensor::empty(ue8m0 ? DType::int32 : DType::fp32, {T, ue8m0 ? num_ue8m0_words(H) : G});
      gputest::fill_random(rng(), s);  // every UE8M0 byte, including 0 and 255
      if (!ue8m0) {
        float* p = s.ptr<float>();
        std::uniform_real_distribution<float> u(1e-6f, 1e3f);
        for (std::int64_t i = 0; i < s.numel(); ++i) p[i] = u(rng);
        p[0] = 0.0f;
        p[1] = std::numeric_limits<float>::infinity();
        p[2] = std::numeric_limits<float>::quiet_NaN();
        p[3] = 1e-42f;
      }
      // A NaN code times a NaN scale: x86 returns one of the two NaNs depending on the operand order the
      // compiler chose (the CPU's vectorised loops differ between bf16 and float32 outputs), so that
      // case has no single CPU answer; give NaN scales only non-NaN codes. NaN codes with other scales
      // and NaN scales with other codes are still covered.
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t g = h / 128;
          const bool nan_scale =
              ue8m0 ? ((static_cast<std::uint32_t>(s.ptr<std::int32_t>()[t * s.size(1) + g / 4]) >> (8 * (g % 4))) &
                       0xffu) == 0xffu
                    : std::isnan(s.ptr<float>()[t * G + g]);
          auto& code = static_cast<std::uint8_t*>(q.data())[t * H + h];
          if (nan_scale && (code & 0x7fu) == 0x7fu) code = 0x38;  // 1.0
        }
      for (DType out : {DType::bf16, DType::fp32}) {
        const Tensor want = dequantize_fp8(q, s, out);
        const Tensor q_dev = to_device(q), s_dev = to_device(s);
        const Tensor got = dequantize_fp8(q_dev, s_dev, out);
        EXPECT_TRUE(same_bits(want, to_host(got))) << "H=" << H << " ue8m0=" << ue8m0 << " " << dtype_name(out);
      }
    }
}

// The low-latency slabs: only each slab's first masked_m[e] rows are dequantized (the CPU's bits); the other rows
// keep the poison they were given. Counts of 0, of every row, past the rows (clamped) and negative (none); scales
// row-major and column-major per slab (the low-latency dispatch's layout).
TEST(GpuQuant, MaskedSlabDequantizeWritesTheCountedRowsOnly) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{7168}})
    for (bool ue8m0 : {false, true})
      for (ScaleLayout layout : {ScaleLayout::row_major, ScaleLayout::column_major}) {
        const std::int64_t E = 6, rows = 13, G = num_scale_groups(H);
        const Tensor x = make_input(rng, E * rows, H, DType::bf16);
        const Fp8Tensor q = quantize_fp8(x, {ue8m0, ue8m0});
        const Tensor want = dequantize_fp8(q.data, q.scales, DType::bf16);  // [E * rows, H]
        const std::int32_t counts[E] = {0, 1, 7, 13, 40, -3};
        Tensor m = Tensor::empty(DType::int32, {E});
        for (std::int64_t e = 0; e < E; ++e) m.ptr<std::int32_t>()[e] = counts[e];
        const Tensor q_dev = to_device(TensorView(q.data.data(), q.data.dtype(), {E, rows, H}, Device::cpu()));
        // The slabs' scales as the low-latency dispatch returns them (column-major: {C * 16, 1, 16}) or row-major.
        const std::int64_t C = ue8m0 ? num_ue8m0_words(H) : G;
        const Tensor s_host = empty_fp8_scales(q.scales.dtype(), {E, rows, C}, layout);
        const TensorView& sv = s_host.view();
        for (std::int64_t e = 0; e < E; ++e)
          for (std::int64_t r = 0; r < rows; ++r)
            for (std::int64_t c = 0; c < C; ++c)
              static_cast<std::uint32_t*>(s_host.data())[e * sv.stride(0) + r * sv.stride(1) + c * sv.stride(2)] =
                  static_cast<const std::uint32_t*>(q.scales.data())[(e * rows + r) * C + c];
        const Tensor s_dev = empty_fp8_scales(q.scales.dtype(), {E, rows, C}, layout, gputest::gpu());
        const std::size_t span = static_cast<std::size_t>(E * sv.stride(0)) * 4;
        GPU_CHECK(cudaMemcpy(s_dev.data(), s_host.data(), span, cudaMemcpyHostToDevice));
        const Tensor m_dev = to_device(m);
        Tensor out = to_device(Tensor::empty(DType::bf16, {E, rows, H}));
        gputest::poison(out);
        quant_detail::dequantize_fp8_masked_cuda(q_dev, s_dev, out, m_dev.ptr<std::int32_t>(), Stream{});
        gputest::sync_ok();
        const Tensor got = to_host(out);
        for (std::int64_t e = 0; e < E; ++e) {
          const std::int64_t n = std::max<std::int64_t>(0, std::min<std::int64_t>(counts[e], rows));
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::size_t bytes = static_cast<std::size_t>(H) * 2;
            const auto* g = static_cast<const char*>(got.data()) + ((e * rows + r) * H) * 2;
            const auto* w = static_cast<const char*>(want.data()) + ((e * rows + r) * H) * 2;
            if (r < n)
              EXPECT_EQ(std::memcmp(g, w, bytes), 0) << "H=" << H << " ue8m0=" << ue8m0 << " "
                                                     << scale_layout_name(layout) << " slab " << e << " row " << r;
            else
              EXPECT_NE(std::memcmp(g, w, bytes), 0)
                  << "H=" << H << " ue8m0=" << ue8m0 << " slab " << e << " row " << r << " past the count was written";
          }
        }
      }
}

TEST(GpuQuant, MisalignedRowsAreRejectedOnCuda) {
  std::mt19937_64 rng(test::fresh_seed());
  const Tensor x = to_device(make_input(rng, 4, 2048, DType::bf16));
  Tensor q_store = Tensor::empty(DType::fp8_e4m3, {4, 2048 + 8}, gputest::gpu());
  const TensorView q(q_store.data(), DType::fp8_e4m3, {4, 2048}, {2048 + 8, 1}, gputest::gpu());
  Tensor s = Tensor::empty(DType::fp32, {4, 16}, gputest::gpu());
  try {
    quantize_fp8_into(x, q, s);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'q'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epmoe
