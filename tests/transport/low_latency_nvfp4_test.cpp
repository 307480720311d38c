// NVFP4 low-latency dispatch (semantics §5, §6) on thread ranks: the layout, counts, src_info and layout_range as the
// independent reference; every received row's packed codes equal quantize_nvfp4 of the source row and the float64
// model (support/nvfp4_reference), its block scales sit at their swizzled places in the expert's scale matrix; the
// combine after it is unchanged. Errors before any communication, each naming its argument, the buffer usable after.
#include <gtest/gtest.h>

#include <epmoe/nvfp4.hpp>

#include <limits>

#include "support/nvfp4_reference.hpp"
#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

Tensor scalar(float v) {
  Tensor t = Tensor::empty(DType::fp32, Shape{});
  *t.ptr<float>() = v;
  return t;
}

float amax_of(const Tensor& x) {
  float a = 0.0f;
  for (std::int64_t i = 0; i < x.numel(); ++i) a = std::max(a, std::fabs(bf16_to_float(x.ptr<bf16_t>()[i])));
  return a;
}

// One rank's received rows against quantize_nvfp4 of their source rows (linear scales) and the float64 model.
void expect_nvfp4_rows(const Case& c, int d, const DispatchCopy& got, const std::vector<LowLatencyRankInput>& in,
                       const std::vector<LowLatencyReferenceRank>& ref, const std::vector<float>& gs) {
  SCOPED_TRACE(describe_case(c) + " nvfp4, receiving rank " + std::to_string(d));
  const int El = c.E / c.R;
  const std::int64_t rows = static_cast<std::int64_t>(c.R) * c.tmax, H = c.H, B = H / 16;
  ASSERT_EQ(got.packed_x.dtype(), DType::uint8);
  ASSERT_EQ(got.packed_x.shape(), (Shape{El, rows, H / 2}));
  ASSERT_EQ(got.scales.dtype(), DType::fp8_e4m3);
  ASSERT_EQ(got.scales.shape(), (Shape{El, nvfp4_row_tiles(rows), (H / 64) * 512}));
  std::vector<Nvfp4Tensor> q;
  std::vector<RefNvfp4> model;
  for (int s = 0; s < c.R; ++s) {
    const Tensor& x = in[static_cast<std::size_t>(s)].x;
    q.push_back(quantize_nvfp4(x, scalar(gs[static_cast<std::size_t>(s)]), Nvfp4ScaleLayout::linear));
    std::vector<float> v(static_cast<std::size_t>(x.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_float(x.ptr<bf16_t>()[i]);
    model.push_back(ref_quantize_nvfp4(v, x.size(0), H, gs[static_cast<std::size_t>(s)]));
  }
  const std::int64_t slab = nvfp4_row_tiles(rows) * (H / 64) * 512;
  const auto* scales = static_cast<const std::uint8_t*>(got.scales.data());
  std::int64_t bad = 0;
  const auto& rr = ref[static_cast<std::size_t>(d)];
  for (int e = 0; e < El; ++e) {
    const auto& er = rr.rows[static_cast<std::size_t>(e)];
    ASSERT_EQ(got.count.ptr<std::int32_t>()[e], static_cast<std::int32_t>(er.size())) << "expert " << e;
    for (int s = 0; s < c.R; ++s)
      EXPECT_EQ(got.layout_range.ptr<std::int64_t>()[e * c.R + s], rr.layout_range[static_cast<std::size_t>(e * c.R + s)]);
    for (std::size_t j = 0; j < er.size(); ++j) {
      const auto& src = er[j];
      EXPECT_EQ(got.src_info.ptr<std::int32_t>()[e * rows + static_cast<std::int64_t>(j)], src.token);
      const auto* row = got.packed_x.ptr<std::uint8_t>() + (e * rows + static_cast<std::int64_t>(j)) * (H / 2);
      const auto& m = model[static_cast<std::size_t>(src.rank)];
      const auto* want = q[static_cast<std::size_t>(src.rank)].data.ptr<std::uint8_t>() + src.token * (H / 2);
      bad += std::memcmp(row, want, static_cast<std::size_t>(H / 2)) != 0;
      bad += std::memcmp(row, m.q.data() + src.token * (H / 2), static_cast<std::size_t>(H / 2)) != 0;
      const auto* want_sc = static_cast<const std::uint8_t*>(q[static_cast<std::size_t>(src.rank)].scales.data());
      for (std::int64_t b = 0; b < B; ++b) {
        const std::uint8_t g = scales[e * slab + ref_swizzled_offset(static_cast<std::int64_t>(j), b, H / 64)];
        bad += g != want_sc[src.token * B + b];
        bad += g != m.scales[static_cast<std::size_t>(src.token * B + b)];
      }
    }
  }
  EXPECT_EQ(bad, 0) << "rows or scales differing from the quantizer / the float64 model";
}

void run_nvfp4_case(const Case& c, bool hooks, bool fixed_scale) {
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::vector<float> gs;
  for (const auto& i : in) gs.push_back(fixed_scale || i.x.numel() == 0 ? 0.75f : 448.0f * 6.0f / amax_of(i.x));
  std::vector<DispatchCopy> got(static_cast<std::size_t>(c.R));
  std::vector<Tensor> combined(static_cast<std::size_t>(c.R));
  run_buffers(c.R, [&](Buffer& buffer, Group& g) {
    const int r = g.rank();
    LowLatencyDispatchArgs a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
    a.use_fp8 = false;
    a.use_nvfp4 = true;
    const Tensor scale = scalar(gs[static_cast<std::size_t>(r)]);
    a.x_global_scale = scale;
    a.return_recv_hook = hooks;
    const LowLatencyDispatchResult d = buffer.low_latency_dispatch(a);
    if (hooks) d.hook();
    got[static_cast<std::size_t>(r)] = copy_dispatch(d);
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = in[static_cast<std::size_t>(r)].topk_idx;
    ca.topk_weights = in[static_cast<std::size_t>(r)].topk_weights;
    ca.handle = &d.handle;
    combined[static_cast<std::size_t>(r)] = clone(buffer.low_latency_combine(ca).combined_x);
  });
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want = reference_low_latency_combine(in, ref, y, c.E);
  for (int d = 0; d < c.R; ++d) {
    expect_nvfp4_rows(c, d, got[static_cast<std::size_t>(d)], in, ref, gs);
    expect_bf16_equal(combined[static_cast<std::size_t>(d)], want[static_cast<std::size_t>(d)], "combine");
  }
}

TEST(LowLatencyNvfp4, DispatchMatchesQuantizerAndModel) {
  struct S {
    int R, E, K;
    std::int64_t H;
    int tmax;
  };
  // R * Tmax past 128 rows (two tiles of the swizzled matrix) in the 8-rank case.
  for (const S s : {S{1, 4, 2, 128, 8}, S{2, 8, 1, 2048, 8}, S{2, 16, 8, 2880, 16}, S{4, 16, 2, 7168, 4},
                    S{4, 8, 8, 256, 40}, S{8, 16, 9, 192, 20}}) {
    Case c;
    c.R = s.R;
    c.E = s.E;
    c.K = s.K;
    c.H = s.H;
    c.tmax = s.tmax;
    c.routing.p_minus_one = 0.1;
    for (int r = 0; r < c.R; ++r) c.T.push_back(std::max(1, c.tmax - r % 3));
    run_nvfp4_case(c, false, false);
    run_nvfp4_case(c, true, true);
  }
}

TEST(LowLatencyNvfp4, ZeroTokenRankAndFullBatch) {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 4;
  c.H = 512;
  c.tmax = 12;
  c.T = {0, 12};
  run_nvfp4_case(c, false, true);
}

TEST(LowLatencyNvfp4, BadArgumentsAreRefusedBeforeSendingAndTheBufferStaysUsable) {
  Case c;
  c.R = 2;
  c.E = 4;
  c.K = 2;
  c.H = 128;
  c.tmax = 4;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto in96 = [&] {
    Case c96 = c;
    c96.H = 96;  // a multiple of 16, not of 64
    return make_inputs(rng, c96);
  }();
  run_buffers(c.R, [&](Buffer& buffer, Group& g) {
    const int r = g.rank();
    const Tensor good = scalar(2.0f);
    auto base = [&] {
      LowLatencyDispatchArgs a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
      a.use_fp8 = false;
      a.use_nvfp4 = true;
      a.x_global_scale = good;
      return a;
    };
    const Tensor half = Tensor::zeros(DType::fp16, Shape{}), pair = Tensor::zeros(DType::fp32, {2});
    const Tensor nan = scalar(std::numeric_limits<float>::quiet_NaN()), inf = scalar(INFINITY), zero = scalar(0.0f),
                 neg = scalar(-1.0f);
    const std::pair<std::string, std::function<void(LowLatencyDispatchArgs&)>> cases[] = {
        {"use_nvfp4", [](LowLatencyDispatchArgs& a) { a.use_fp8 = true; }},
        {"x_global_scale", [](LowLatencyDispatchArgs& a) { a.x_global_scale = {}; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = half; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = pair; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = nan; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = inf; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = zero; }},
        {"x_global_scale", [&](LowLatencyDispatchArgs& a) { a.x_global_scale = neg; }},
        {"x", [&](LowLatencyDispatchArgs& a) { a.x = in96[static_cast<std::size_t>(r)].x; }},
    };
    for (const auto& [name, edit] : cases) {
      LowLatencyDispatchArgs a = base();
      edit(a);
      const Caught e = catch_error([&] { buffer.low_latency_dispatch(a); });
      EXPECT_TRUE(e.thrown) << name;
      EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
      EXPECT_NE(e.what.find("'" + name + "'"), std::string::npos) << e.what;
    }
    const LowLatencyDispatchResult d = buffer.low_latency_dispatch(base());  // still usable
    EXPECT_EQ(d.packed_recv_x.dtype, DType::uint8);
  });
}

TEST(LowLatencyNvfp4, FormatMustAgreeAcrossRanks) {
  Case c;
  c.R = 2;
  c.E = 4;
  c.H = 128;
  c.tmax = 4;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto errors = run_buffers_collect(c.R, [&](Buffer& buffer, Group& g) {
    LowLatencyDispatchArgs a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
    a.use_fp8 = false;
    const Tensor gs = scalar(1.0f);
    if (g.rank() == 0) {
      a.use_nvfp4 = true;
      a.x_global_scale = gs;
    }
    buffer.low_latency_dispatch(a);
  });
  for (const auto& e : errors) {
    const Caught got = caught(e);
    EXPECT_TRUE(got.thrown);
    EXPECT_EQ(got.code, ErrorCode::rank_mismatch) << got.what;
    EXPECT_NE(got.what.find("use_nvfp4"), std::string::npos) << got.what;
  }
}

}  // namespace
}  // namespace epmoe::test::ll
