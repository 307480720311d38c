// Permute / unpermute on CPU tensors (include/epmoe/permute.hpp) against the independent reference
// (tests/support/permute_reference) and hand-made cases: layouts with -1 ids, padding, one expert
// taking every row, int32 and strided ids, no tokens; fp8 rows with scales; the weighted unpermute
// against float64; argument errors.
#include <gtest/gtest.h>

#include <epmoe/error.hpp>
#include <epmoe/permute.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/permute_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

std::vector<std::int64_t> ids_of(const TensorView& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t m = 0; m < t.size(0); ++m)
    for (std::int64_t k = 0; k < t.size(1); ++k) {
      const std::int64_t i = m * t.stride(0) + k * t.stride(1);
      v.push_back(t.dtype == DType::int64 ? static_cast<const std::int64_t*>(t.data)[i]
                                          : static_cast<const std::int32_t*>(t.data)[i]);
    }
  return v;
}

template <class T>
std::vector<T> vec(const Tensor& t) {
  return {t.ptr<T>(), t.ptr<T>() + t.numel()};
}

void expect_layout(const PermuteLayout& got, const test::RefPermuteLayout& want, const std::string& what) {
  ASSERT_EQ(got.capacity, want.capacity) << what;
  EXPECT_EQ(vec<std::int64_t>(got.seg_indptr), want.seg_indptr) << what;
  EXPECT_EQ(vec<std::int32_t>(got.num_tokens_per_expert), want.counts) << what;
  EXPECT_EQ(vec<std::int32_t>(got.src2dst), want.src2dst) << what;
  EXPECT_EQ(vec<std::int32_t>(got.dst2src), want.dst2src) << what;
  EXPECT_EQ(vec<std::int32_t>(got.reorder_topk_ids), want.reorder_topk_ids) << what;
}

Tensor random_bf16_rows(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols) {
  return test::random_bf16(rng, rows, cols, 4.0f);
}

TEST(Permute, HandMadeLayoutPermuteAndUnpermute) {
  // M = 3 tokens, K = 2, E_local = 3, alignment 2.
  // token 0 -> experts 2, 0; token 1 -> -1, 2; token 2 -> 0, -1.
  std::vector<std::int64_t> ids = {2, 0, -1, 2, 0, -1};
  Tensor t = Tensor::empty(DType::int64, {3, 2});
  std::memcpy(t.data(), ids.data(), ids.size() * 8);
  const PermuteLayout l = make_permute_layout(t, 3, 2);
  // Expert 0: (0,1), (2,0) -> rows 0, 1. Expert 1: none. Expert 2: (0,0), (1,1) -> rows 2, 3.
  EXPECT_EQ(vec<std::int64_t>(l.seg_indptr), (std::vector<std::int64_t>{0, 2, 2, 4}));
  EXPECT_EQ(vec<std::int32_t>(l.num_tokens_per_expert), (std::vector<std::int32_t>{2, 0, 2}));
  EXPECT_EQ(vec<std::int32_t>(l.src2dst), (std::vector<std::int32_t>{2, 0, -1, 3, 1, -1}));
  EXPECT_EQ(l.capacity, 6 + 3 * 1);
  EXPECT_EQ(vec<std::int32_t>(l.dst2src), (std::vector<std::int32_t>{0, 2, 0, 1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(vec<std::int32_t>(l.reorder_topk_ids), (std::vector<std::int32_t>{0, 0, 2, 2, -1, -1, -1, -1, -1}));

  // x rows are 8 bf16 values of 1, 2, 3 (token index + 1).
  Tensor x = Tensor::empty(DType::bf16, {3, 8});
  for (int m = 0; m < 3; ++m)
    for (int h = 0; h < 8; ++h) x.ptr<bf16_t>()[m * 8 + h] = float_to_bf16(static_cast<float>(m + 1));
  const Permuted p = permute(x, l);
  const float want_rows[4] = {1, 3, 1, 2};
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 8; ++h) EXPECT_EQ(bf16_to_float(p.x.ptr<bf16_t>()[r * 8 + h]), want_rows[r]) << r;

  // y row r holds r + 1; weights 0.5 / 0.25: out[0] = 0.5*3 + 0.25*1, out[1] = 0.25*4, out[2] = 0.5*2.
  Tensor y = Tensor::empty(DType::bf16, {l.capacity, 8});
  for (int r = 0; r < l.capacity; ++r)
    for (int h = 0; h < 8; ++h) y.ptr<bf16_t>()[r * 8 + h] = float_to_bf16(static_cast<float>(r + 1));
  Tensor w = Tensor::empty(DType::fp32, {3, 2});
  const float wv[6] = {0.5f, 0.25f, 0.0f, 0.25f, 0.5f, 0.0f};
  std::memcpy(w.data(), wv, sizeof wv);
  const Tensor out = unpermute(y, l, w);
  const float want_out[3] = {1.75f, 1.0f, 1.0f};
  for (int m = 0; m < 3; ++m)
    for (int h = 0; h < 8; ++h) EXPECT_EQ(bf16_to_float(out.ptr<bf16_t>()[m * 8 + h]), want_out[m]) << m;
}

TEST(Permute, LayoutMatchesReference) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t M : {0, 1, 7, 300})
    for (int K : {1, 2, 8, 9})
      for (int E : {1, 3, 16, 64})
        for (int alignment : {1, 4, 128})
          for (int variant = 0; variant < 3; ++variant) {
            if (K > E) continue;
            test::RoutingOptions o;
            if (variant == 1) o.p_minus_one = 0.4;
            if (variant == 2) o.only_expert = E - 1;
            const Tensor ids = test::random_topk_idx(rng, M, K, E, o);
            const std::string what = "M=" + std::to_string(M) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
                                     " align=" + std::to_string(alignment) + " variant=" + std::to_string(variant);
            const auto want = test::ref_permute_layout(ids_of(ids), M, K, E, alignment);
            expect_layout(make_permute_layout(ids, E, alignment), want, what);
            if (HasFailure()) return;
          }
}

TEST(Permute, Int32AndStridedIdsGiveTheSameLayout) {
  std::mt19937_64 rng(test::fresh_seed());
  const Tensor ids = test::random_topk_idx(rng, 50, 6, 20, {0.3, -1});
  const auto want = test::ref_permute_layout(ids_of(ids), 50, 6, 20, 8);
  Tensor i32 = Tensor::empty(DType::int32, {50, 6});
  for (int i = 0; i < 300; ++i) i32.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(ids.ptr<std::int64_t>()[i]);
  expect_layout(make_permute_layout(i32, 20, 8), want, "int32");
  // Transposed storage: [K, M] buffer viewed as [M, K] with strides (1, M).
  Tensor tr = Tensor::empty(DType::int64, {6, 50});
  for (int m = 0; m < 50; ++m)
    for (int k = 0; k < 6; ++k) tr.ptr<std::int64_t>()[k * 50 + m] = ids.ptr<std::int64_t>()[m * 6 + k];
  const TensorView strided(tr.data(), DType::int64, {50, 6}, {1, 50}, Device::cpu());
  expect_layout(make_permute_layout(strided, 20, 8), want, "strided");
}

TEST(Permute, PermutedRowsAndScalesFollowTheLayoutAndPaddingIsZero) {
  std::mt19937_64 rng(test::fresh_seed());
  for (DType dtype : {DType::bf16, DType::fp8_e4m3, DType::fp32}) {
    const std::int64_t M = 40, H = 2880 / 4;  // 720 channels: rows of 720, 1440 or 2880 bytes
    const int K = 4, E = 8, alignment = 16;
    const Tensor ids = test::random_topk_idx(rng, M, K, E, {0.3, -1});
    const PermuteLayout l = make_permute_layout(ids, E, alignment);
    Tensor x = Tensor::empty(dtype, {M, H});
    auto* xb = static_cast<std::uint8_t*>(x.data());
    std::uniform_int_distribution<int> byte(1, 255);
    for (std::size_t i = 0; i < x.nbytes(); ++i) xb[i] = static_cast<std::uint8_t>(byte(rng));
    Tensor xs = test::random_f32(rng, M, 6, 0.5f, 2.0f);
    // Out buffer larger than needed and poisoned: rows past the used ones stay untouched.
    Tensor out = Tensor::empty(dtype, {l.capacity + 3, H});
    Tensor out_s = Tensor::empty(DType::fp32, {l.capacity + 3, 6});
    std::memset(out.data(), 0xab, out.nbytes());
    std::memset(out_s.data(), 0xab, out_s.nbytes());
    permute_into(x, l, out, xs, out_s);
    const auto ref = test::ref_permute_layout(ids_of(ids), M, K, E, alignment);
    const std::size_t rb = static_cast<std::size_t>(H) * dtype_size(dtype);
    const auto* ob = static_cast<const std::uint8_t*>(out.data());
    const std::int64_t used = ref.seg_indptr.back();
    for (std::int64_t r = 0; r < l.capacity + 3; ++r) {
      const std::int32_t m = r < l.capacity ? ref.dst2src[static_cast<std::size_t>(r)] : -1;
      const bool padding = r < used && m < 0;
      for (std::size_t b = 0; b < rb; ++b) {
        const std::uint8_t want = m >= 0 ? xb[static_cast<std::size_t>(m) * rb + b] : padding ? 0 : 0xab;
        ASSERT_EQ(ob[static_cast<std::size_t>(r) * rb + b], want) << dtype_name(dtype) << " row " << r << " byte " << b;
      }
      for (int j = 0; j < 6; ++j) {
        const float got = out_s.ptr<float>()[r * 6 + j];
        if (m >= 0)
          EXPECT_EQ(got, xs.ptr<float>()[m * 6 + j]) << r;
        else if (padding)
          EXPECT_EQ(got, 0.0f) << r;
      }
    }
  }
}

TEST(Permute, UnpermuteMatchesFloat64Reference) {
  std::mt19937_64 rng(test::fresh_seed());
  for (DType dtype : {DType::bf16, DType::fp32})
    for (int K : {1, 8, 9}) {
      const std::int64_t M = 64, H = 256;
      const int E = 16;
      const Tensor ids = test::random_topk_idx(rng, M, K, E, {0.3, -1});
      const PermuteLayout l = make_permute_layout(ids, E, 4);
      const Tensor yb = random_bf16_rows(rng, l.capacity, H);
      Tensor y = yb;
      if (dtype == DType::fp32) {
        y = Tensor::empty(DType::fp32, {l.capacity, H});
        for (std::int64_t i = 0; i < y.numel(); ++i) y.ptr<float>()[i] = bf16_to_float(yb.ptr<bf16_t>()[i]);
      }
      const Tensor w = test::random_topk_weights(rng, ids);
      const Tensor out = unpermute(y, l, w);
      ASSERT_EQ(out.dtype(), dtype);
      ASSERT_EQ(out.shape(), Shape({M, H}));
      std::vector<double> yd(static_cast<std::size_t>(y.numel())), wd(static_cast<std::size_t>(w.numel()));
      for (std::size_t i = 0; i < yd.size(); ++i) yd[i] = bf16_to_float(yb.ptr<bf16_t>()[i]);
      for (std::size_t i = 0; i < wd.size(); ++i) wd[i] = w.ptr<float>()[i];
      const auto ref = test::ref_permute_layout(ids_of(ids), M, K, E, 4);
      const auto want = test::ref_unpermute(yd, H, ref, wd, M, K);
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::size_t i = static_cast<std::size_t>(m * H + h);
          const double got = dtype == DType::bf16 ? bf16_to_float(out.ptr<bf16_t>()[i]) : out.ptr<float>()[i];
          // One bf16 (or float32) rounding of the result plus K float32 roundings of the terms (|y| <= 4).
          const double tol = (dtype == DType::bf16 ? 0x1p-8 : 0x1p-23) * std::fabs(want[i]) + K * 4 * 0x1p-23;
          ASSERT_NEAR(got, want[i], tol) << "m=" << m << " h=" << h << " K=" << K << " " << dtype_name(dtype);
        }
    }
}

TEST(Permute, BadIdsAndArgumentsAreRejected) {
  Tensor ids = Tensor::empty(DType::int64, {3, 2});
  const std::int64_t v[6] = {0, 1, 2, 5, -1, 0};
  std::memcpy(ids.data(), v, sizeof v);
  try {
    make_permute_layout(ids, 4, 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'topk_idx'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("5 at [1, 1]"), std::string::npos) << msg;
  }
  ids.ptr<std::int64_t>()[3] = 3;
  EXPECT_THROW(make_permute_layout(ids, 0, 1), Error);
  EXPECT_THROW(make_permute_layout(ids, 1025, 1), Error);
  EXPECT_THROW(make_permute_layout(ids, 4, 0), Error);
  Tensor f = Tensor::empty(DType::fp32, {3, 2});
  EXPECT_THROW(make_permute_layout(f, 4, 1), Error);

  const PermuteLayout l = make_permute_layout(ids, 4, 1);
  Tensor x = Tensor::empty(DType::bf16, {3, 16});
  std::memset(x.data(), 0, x.nbytes());
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Tensor x_wrong_rows = Tensor::empty(DType::bf16, {4, 16});
  EXPECT_NE(message([&] { permute(x_wrong_rows, l); }).find("'x'"), std::string::npos);
  Tensor x_odd = Tensor::empty(DType::bf16, {3, 12});  // 24-byte rows
  EXPECT_NE(message([&] { permute(x_odd, l); }).find("'x'"), std::string::npos);
  Tensor small = Tensor::empty(DType::bf16, {l.capacity - 1, 16});
  EXPECT_NE(message([&] { permute_into(x, l, small); }).find("'out'"), std::string::npos);
  Tensor wrong_dtype = Tensor::empty(DType::fp32, {l.capacity, 16});
  EXPECT_NE(message([&] { permute_into(x, l, wrong_dtype); }).find("'out'"), std::string::npos);
  Tensor xs = Tensor::empty(DType::fp32, {3, 1});
  Tensor out = Tensor::empty(DType::bf16, {l.capacity, 16});
  EXPECT_NE(message([&] { permute_into(x, l, out, xs); }).find("'out_scales'"), std::string::npos);

  Tensor y = Tensor::empty(DType::bf16, {l.capacity, 16});
  Tensor w_wrong = Tensor::empty(DType::fp32, {3, 3});
  EXPECT_NE(message([&] { unpermute(y, l, w_wrong); }).find("'topk_weights'"), std::string::npos);
  Tensor y_short = Tensor::empty(DType::bf16, {l.capacity - 1, 16});
  Tensor w = Tensor::empty(DType::fp32, {3, 2});
  EXPECT_NE(message([&] { unpermute(y_short, l, w); }).find("'y'"), std::string::npos);
  Tensor y_fp8 = Tensor::empty(DType::fp8_e4m3, {l.capacity, 16});
  EXPECT_NE(message([&] { unpermute(y_fp8, l, w); }).find("'y'"), std::string::npos);
}

TEST(Permute, NoTokens) {
  Tensor ids = Tensor::empty(DType::int64, {0, 8});
  const PermuteLayout l = make_permute_layout(ids, 16, 64);
  EXPECT_EQ(l.capacity, 0);
  EXPECT_EQ(vec<std::int64_t>(l.seg_indptr), std::vector<std::int64_t>(17, 0));
  Tensor x = Tensor::empty(DType::bf16, {0, 64});
  EXPECT_EQ(permute(x, l).x.shape(), Shape({0, 64}));
  Tensor w = Tensor::empty(DType::fp32, {0, 8});
  EXPECT_EQ(unpermute(Tensor::empty(DType::bf16, {0, 64}), l, w).shape(), Shape({0, 64}));
}

}  // namespace
}  // namespace epmoe
