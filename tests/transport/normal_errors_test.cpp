// Normal-mode argument errors (raised before any exchange) and cross-rank mismatches (raised on
// every rank, no hang).
#include "transport/normal_harness.hpp"

#include <cstring>
#include <functional>

namespace epmoe::test {
namespace {

/// One rank's ready-made dispatch inputs.
struct Ready {
  RefDispatchInput in;
  DispatchLayout layout;
};

Ready ready(std::mt19937_64& rng, const NormalCase& c, int rank) {
  NormalCase one = c;
  one.R = 1;
  one.T = {c.T.empty() ? 24 : c.T[static_cast<std::size_t>(rank)]};
  Ready r;
  r.in = make_inputs(rng, one)[0];
  r.layout = get_dispatch_layout(r.in.topk_idx, c.E, c.R);
  return r;
}

/// Runs `fn(rank, buffer)` on R ranks (short timeout) and returns what each rank threw.
std::vector<std::exception_ptr> on_ranks(int R, const std::function<void(int, Buffer&)>& fn, double timeout_s = 20.0) {
  return run_thread_ranks_collect(
      R,
      [&](Group& g) {
        Buffer buf(borrow(g));
        fn(g.rank(), buf);
      },
      timeout_s);
}

/// Every rank threw an epmoe::Error with `code` whose message contains every one of `parts`.
void expect_all(const std::vector<std::exception_ptr>& errs, ErrorCode code, std::vector<std::string> parts) {
  for (std::size_t r = 0; r < errs.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(errs[r] != nullptr) << "no error";
    try {
      std::rethrow_exception(errs[r]);
    } catch (const Error& e) {
      EXPECT_EQ(error_code_name(e.code()), error_code_name(code)) << e.what();
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not an epmoe::Error: " << e.what();
    }
  }
}

NormalCase small(int R) {
  NormalCase c;
  c.R = R;
  c.E = 4 * R;
  c.K = 2;
  c.H = 128;
  return c;
}

/// Every rank calls dispatch with its ready inputs after `edit` changed the arguments.
std::vector<std::exception_ptr> dispatch_with(const NormalCase& c, const std::function<void(int, DispatchArgs&)>& edit) {
  std::mt19937_64 rng(fresh_seed());
  std::vector<Ready> rd;
  for (int r = 0; r < c.R; ++r) rd.push_back(ready(rng, c, r));
  return on_ranks(c.R, [&](int r, Buffer& buf) {
    DispatchArgs a = dispatch_args(rd[static_cast<std::size_t>(r)].in, rd[static_cast<std::size_t>(r)].layout, c);
    edit(r, a);
    buf.dispatch(a);
  });
}

// ---- local argument errors (every rank passes the same bad argument) ----

TEST(NormalErrors, BadXDtype) {
  Tensor f = Tensor::zeros(DType::fp32, {24, 128});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = f; }), ErrorCode::invalid_argument,
             {"'x'", "bfloat16 or float8_e4m3fn", "float32[24, 128]"});
}

TEST(NormalErrors, HiddenNotMultipleOf8ForBf16) {
  Tensor x = Tensor::zeros(DType::bf16, {24, 132});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; }), ErrorCode::invalid_argument,
             {"'x'", "multiple of 8", "132"});
}

TEST(NormalErrors, HiddenNotMultipleOf16ForFp8) {
  Tensor x = Tensor::zeros(DType::fp8_e4m3, {24, 136});
  Tensor s = Tensor::zeros(DType::fp32, {24, 2});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = s; }), ErrorCode::invalid_argument,
             {"'x'", "multiple of 16", "136"});
}

TEST(NormalErrors, Fp8NeedsScalesOfTheRightShape) {
  Tensor x = Tensor::zeros(DType::fp8_e4m3, {24, 2880});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; }), ErrorCode::invalid_argument,
             {"'x_scales'", "float32[24, 23]", "int32[24, 6]", "None"});
  Tensor bad = Tensor::zeros(DType::fp32, {24, 22});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = bad; }), ErrorCode::invalid_argument,
             {"'x_scales'", "[24, 23]", "float32[24, 22]"});
  Tensor u = Tensor::zeros(DType::int32, {24, 5});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = u; }), ErrorCode::invalid_argument,
             {"'x_scales'", "int32[24, 6]"});
  Tensor s16 = Tensor::zeros(DType::bf16, {24, 23});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = s16; }), ErrorCode::invalid_argument,
             {"'x_scales'", "float32 or int32"});
}

// x_scales must be row-major (unit stride in dimension 1) or column-major (unit stride in dimension 0), the other
// stride at least the other extent; anything else is refused before any exchange.
TEST(NormalErrors, Fp8ScalesNeitherRowNorColumnMajor) {
  Tensor x = Tensor::zeros(DType::fp8_e4m3, {24, 2880});
  Tensor storage = Tensor::zeros(DType::fp32, {24 * 23 * 2});
  const TensorView every_other(storage.data(), DType::fp32, {24, 23}, {46, 2}, Device::cpu());
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = every_other; }),
             ErrorCode::invalid_argument, {"'x_scales'", "row-major", "column-major", "strides [46, 2]"});
  const TensorView overlapping_columns(storage.data(), DType::fp32, {24, 23}, {1, 20}, Device::cpu());
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = x; a.x_scales = overlapping_columns; }),
             ErrorCode::invalid_argument, {"'x_scales'", "a column stride >= 24", "strides [1, 20]"});
}

TEST(NormalErrors, Bf16MustNotHaveScales) {
  Tensor s = Tensor::zeros(DType::fp32, {24, 1});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x_scales = s; }), ErrorCode::invalid_argument,
             {"'x_scales'", "None with bfloat16 x"});
}

TEST(NormalErrors, TopkOf33IsRejected) {
  NormalCase c = small(2);
  c.E = 64;
  Tensor idx = Tensor::zeros(DType::int64, {24, 33});
  expect_all(dispatch_with(c, [&](int, DispatchArgs& a) { a.topk_idx = idx; a.topk_weights = {}; }),
             ErrorCode::invalid_argument, {"'topk_idx'", "1..32", "33"});
}

TEST(NormalErrors, TopkRowsMustMatchX) {
  Tensor idx = Tensor::zeros(DType::int64, {23, 2});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.topk_idx = idx; }), ErrorCode::invalid_argument,
             {"'topk_idx'", "[24, K]"});
}

TEST(NormalErrors, OutOfRangeIdNamesValueAndPosition) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  Ready r = ready(rng, c, 0);
  r.in.topk_idx.ptr<std::int64_t>()[5 * 2 + 1] = 8;  // E = 8
  expect_all(on_ranks(2, [&](int, Buffer& buf) {
               DispatchArgs a = dispatch_args(r.in, r.layout, c);
               buf.dispatch(a);
             }),
             ErrorCode::invalid_argument, {"'topk_idx'", "[-1, 8)", "8 at [5, 1]"});
}

TEST(NormalErrors, BadIdOnOneRankFailsThereAndTimesOutElsewhere) {
  // semantics §11: values are checked before sending; the other rank does not hang forever.
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  Ready r0 = ready(rng, c, 0), r1 = ready(rng, c, 1);
  r1.in.topk_idx.ptr<std::int64_t>()[0] = -7;
  const auto errs = on_ranks(
      2,
      [&](int rank, Buffer& buf) {
        const Ready& r = rank == 0 ? r0 : r1;
        buf.dispatch(dispatch_args(r.in, r.layout, c));
      },
      0.5);
  ASSERT_TRUE(errs[0] && errs[1]);
  try { std::rethrow_exception(errs[1]); } catch (const Error& e) { EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what(); }
  try { std::rethrow_exception(errs[0]); } catch (const Error& e) { EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what(); }
}

TEST(NormalErrors, LayoutInconsistentWithTopk) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  const auto errs = dispatch_with(c, [&](int, DispatchArgs& a) {
    static thread_local Tensor t;
    t = Tensor::empty(DType::int32, {2});
    std::memcpy(t.data(), a.num_tokens_per_rank.data, 8);
    t.ptr<std::int32_t>()[1] += 1;
    a.num_tokens_per_rank = t;
  });
  expect_all(errs, ErrorCode::invalid_argument, {"'num_tokens_per_rank'", "layout of topk_idx", "at [1]"});
  Tensor shape_bad = Tensor::zeros(DType::boolean, {24, 3});
  expect_all(dispatch_with(c, [&](int, DispatchArgs& a) { a.is_token_in_rank = shape_bad; }), ErrorCode::invalid_argument,
             {"'is_token_in_rank'", "bool[24, 2]"});
  Tensor e_bad = Tensor::zeros(DType::int32, {5});
  expect_all(dispatch_with(c, [&](int, DispatchArgs& a) { a.num_tokens_per_expert = e_bad; }), ErrorCode::invalid_argument,
             {"'num_tokens_per_expert'", "multiple of the 2 ranks", "got 5"});
}

// E_local = 1025, one past the most a rank may own (semantics §1), is refused before any exchange on every rank: by
// the layout, naming num_experts, and by the dispatch, naming num_tokens_per_expert (the list it reads E from).
TEST(NormalErrors, MoreThan1024LocalExpertsAreRefused) {
  const NormalCase c = small(2);
  const int E = 1025 * c.R;
  std::mt19937_64 rng(fresh_seed());
  const Ready rd = ready(rng, c, 0);
  expect_all(on_ranks(c.R, [&](int, Buffer& buf) { buf.get_dispatch_layout(rd.in.topk_idx, E); }),
             ErrorCode::invalid_argument, {"'num_experts'", "at most 1024 experts per rank", std::to_string(E)});
  // The layout's counts, and none for the experts past them.
  Tensor counts = Tensor::zeros(DType::int32, {E});
  std::memcpy(counts.data(), rd.layout.num_tokens_per_expert.data(), rd.layout.num_tokens_per_expert.nbytes());
  expect_all(dispatch_with(c, [&](int, DispatchArgs& a) { a.num_tokens_per_expert = counts; }),
             ErrorCode::invalid_argument,
             {"'num_tokens_per_expert'", "at most 1024 experts per rank", std::to_string(E)});
}

TEST(NormalErrors, MissingLayoutAndLayoutOnlyCounts) {
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.num_tokens_per_expert = {}; }),
             ErrorCode::invalid_argument, {"'num_tokens_per_expert'", "None"});
  // Without topk_idx (DeepEP's layout-only dispatch) num_tokens_per_rank must count is_token_in_rank's columns.
  Tensor wrong = Tensor::zeros(DType::int32, {2});
  expect_all(dispatch_with(small(2),
                           [&](int, DispatchArgs& a) {
                             a.topk_idx = {};
                             a.topk_weights = {};
                             a.num_tokens_per_rank = wrong;
                           }),
             ErrorCode::invalid_argument, {"'num_tokens_per_rank'", "is_token_in_rank"});
}

// A dispatch without topk_idx moves the rows the layout says, returns no top-k outputs, and takes each local
// expert's count from the ranks' num_tokens_per_expert: the same rows and counts as the dispatch with topk_idx.
TEST(NormalDispatch, LayoutOnlyMatchesDispatchWithTopk) {
  const NormalCase c = small(3);
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::vector<Ready> rd;
  for (int r = 0; r < c.R; ++r) rd.push_back(ready(rng, c, r));
  std::vector<int> same(static_cast<std::size_t>(c.R), 0);
  const auto errs = on_ranks(c.R, [&](int r, Buffer& buf) {
    const Ready& mine = rd[static_cast<std::size_t>(r)];
    const DispatchResult with = buf.dispatch(dispatch_args(mine.in, mine.layout, c));
    DispatchArgs a = dispatch_args(mine.in, mine.layout, c);
    a.topk_idx = {};
    a.topk_weights = {};
    const DispatchResult without = buf.dispatch(a);
    const bool rows_equal = without.recv_x.nbytes() == with.recv_x.nbytes() &&
                            std::memcmp(without.recv_x.data(), with.recv_x.data(), with.recv_x.nbytes()) == 0;
    same[static_cast<std::size_t>(r)] = rows_equal && !without.recv_topk_idx.defined() &&
                                        !without.recv_topk_weights.defined() &&
                                        without.num_recv_tokens_per_expert_list == with.num_recv_tokens_per_expert_list;
    CombineArgs ca;
    ca.x = without.recv_x;
    ca.handle = &without.handle;
    buf.combine(ca);  // the layout-only handle combines
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_TRUE(errs[static_cast<std::size_t>(r)] == nullptr) << "rank " << r << " (seed " << seed << ")";
    EXPECT_EQ(same[static_cast<std::size_t>(r)], 1) << "rank " << r << " (seed " << seed << ")";
  }
}

TEST(NormalErrors, NonContiguousX) {
  Tensor big = Tensor::zeros(DType::bf16, {24, 256});
  TensorView v(big.data(), DType::bf16, Shape{24, 128}, Shape{256, 1}, Device::cpu());
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.x = v; }), ErrorCode::invalid_argument,
             {"'x'", "contiguous"});
}

TEST(NormalErrors, BadAlignmentAndWorstTokens) {
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.expert_alignment = 0; }), ErrorCode::invalid_argument,
             {"'expert_alignment'", ">= 1"});
  expect_all(dispatch_with(small(2), [&](int, DispatchArgs& a) { a.num_worst_tokens = -1; }), ErrorCode::invalid_argument,
             {"'num_worst_tokens'", ">= 0"});
}

// ---- errors every rank raises after the count all-gather ----

TEST(NormalErrors, MismatchedHiddenIsRankMismatchOnEveryRank) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(3);
  Tensor other = random_bf16(rng, 24, 256);
  expect_all(dispatch_with(c, [&](int r, DispatchArgs& a) { if (r == 2) a.x = other; }), ErrorCode::rank_mismatch,
             {"hidden", "rank 0 has 128", "rank 2 has 256"});
}

TEST(NormalErrors, MismatchedDtypeTopkAlignmentWorst) {
  std::mt19937_64 rng(fresh_seed());
  Tensor fp8 = random_fp8(rng, 24, 128);
  Tensor sc = random_f32(rng, 24, 1, 0.1f, 1.0f);
  expect_all(dispatch_with(small(2), [&](int r, DispatchArgs& a) { if (r == 1) { a.x = fp8; a.x_scales = sc; } }),
             ErrorCode::rank_mismatch, {"x dtype", "bfloat16", "float8_e4m3fn"});
  expect_all(dispatch_with(small(2), [&](int r, DispatchArgs& a) { if (r == 0) a.expert_alignment = 4; }),
             ErrorCode::rank_mismatch, {"expert_alignment"});
  expect_all(dispatch_with(small(2), [&](int r, DispatchArgs& a) { if (r == 1) a.num_worst_tokens = 100; }),
             ErrorCode::rank_mismatch, {"num_worst_tokens"});
  expect_all(dispatch_with(small(2), [&](int r, DispatchArgs& a) { if (r == 1) a.topk_weights = {}; }),
             ErrorCode::rank_mismatch, {"topk_weights given"});
}

TEST(NormalErrors, MismatchedTopkAndExperts) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  NormalCase c3 = c;
  c3.K = 3;
  Ready k3 = ready(rng, c3, 1);
  expect_all(dispatch_with(c, [&](int r, DispatchArgs& a) {
               if (r == 1) a = dispatch_args(k3.in, k3.layout, c3);
             }),
             ErrorCode::rank_mismatch, {"num_topk", "rank 0 has 2", "rank 1 has 3"});
  NormalCase e16 = c;
  e16.E = 16;
  Ready r16 = ready(rng, e16, 0);
  expect_all(dispatch_with(c, [&](int r, DispatchArgs& a) {
               if (r == 0) a = dispatch_args(r16.in, r16.layout, e16);
             }),
             ErrorCode::rank_mismatch, {"num_experts", "rank 0 has 16", "rank 1 has 8"});
}

TEST(NormalErrors, Int32AndInt64IdsMayBeMixed) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  NormalCase c32 = c;
  c32.int32_idx = true;
  std::vector<RefDispatchInput> in = {ready(rng, c, 0).in, ready(rng, c32, 1).in};
  const auto want = reference_dispatch(in, c.E, 1, 0);
  std::vector<DispatchResult> got(2);
  run_thread_ranks(2, [&](Group& g) {
    Buffer buf(borrow(g));
    const auto& mine = in[static_cast<std::size_t>(g.rank())];
    got[static_cast<std::size_t>(g.rank())] = buf.dispatch(dispatch_args(mine, buf.get_dispatch_layout(mine.topk_idx, c.E), c));
  });
  for (int r = 0; r < 2; ++r) expect_dispatch_eq(got[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)], c, r, false, 24);
}

TEST(NormalErrors, TooFewWorstTokensFailsOnEveryRank) {
  NormalCase c = small(3);
  c.K = 4;
  c.E = 6;  // 4 of 6 experts over 3 ranks: every token reaches at least 2 ranks, most rows > 24
  c.num_worst_tokens = 24;
  expect_all(dispatch_with(c, [&](int, DispatchArgs&) {}), ErrorCode::invalid_argument,
             {"'num_worst_tokens'", "receives", "got 24"});
}

// ---- handles ----

TEST(NormalErrors, HandleOfAnotherBuffer) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        Buffer a(borrow(g)), b(borrow(g));
        const Ready& r = rd[static_cast<std::size_t>(g.rank())];
        DispatchResult d = a.dispatch(dispatch_args(r.in, r.layout, c));
        CombineArgs ca;
        ca.x = d.recv_x;
        ca.handle = &d.handle;
        b.combine(ca);
      },
      20.0);
  expect_all(errs, ErrorCode::invalid_argument, {"'handle'", "a handle of this buffer"});
}

TEST(NormalErrors, CachedDispatchWithHandleOfAnotherBuffer) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        Buffer a(borrow(g)), b(borrow(g));
        const Ready& r = rd[static_cast<std::size_t>(g.rank())];
        DispatchResult d = a.dispatch(dispatch_args(r.in, r.layout, c));
        DispatchArgs again;
        again.x = r.in.x;
        again.handle = &d.handle;
        b.dispatch(again);
      },
      20.0);
  expect_all(errs, ErrorCode::invalid_argument, {"'handle'"});
}

TEST(NormalErrors, CombineArgumentErrors) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  // Each entry edits the combine arguments of every rank the same way.
  const std::vector<std::pair<std::function<void(CombineArgs&, const DispatchResult&, std::vector<Tensor>&)>,
                              std::vector<std::string>>>
      cases = {
          {[](CombineArgs& a, const DispatchResult& d, std::vector<Tensor>& keep) {
             keep.push_back(Tensor::zeros(DType::bf16, {d.recv_x.size(0) + 1, 128}));
             a.x = keep.back();
           },
           {"'x'", "one row per row of the dispatch"}},
          {[](CombineArgs& a, const DispatchResult& d, std::vector<Tensor>& keep) {
             keep.push_back(Tensor::zeros(DType::fp32, {d.recv_x.size(0), 128}));
             a.x = keep.back();
           },
           {"'x'", "bfloat16"}},
          {[](CombineArgs& a, const DispatchResult& d, std::vector<Tensor>& keep) {
             keep.push_back(Tensor::zeros(DType::bf16, {d.recv_x.size(0), 100}));
             a.x = keep.back();
           },
           {"'x'", "multiple of 8"}},
          {[](CombineArgs& a, const DispatchResult& d, std::vector<Tensor>& keep) {
             keep.push_back(Tensor::zeros(DType::fp32, {d.recv_x.size(0), 33}));
             a.topk_weights = keep.back();
           },
           {"'topk_weights'", "1..32"}},
          {[](CombineArgs& a, const DispatchResult& d, std::vector<Tensor>& keep) {
             keep.push_back(Tensor::zeros(DType::bf16, {d.handle.num_tokens + 1, 128}));
             a.bias_0 = keep.back();
           },
           {"'bias_0'", "bfloat16[24, 128]"}},
          {[](CombineArgs& a, const DispatchResult&, std::vector<Tensor>&) { a.handle = nullptr; },
           {"'handle'", "empty"}},
      };
  for (const auto& [edit, parts] : cases) {
    const auto errs = run_thread_ranks_collect(
        2,
        [&](Group& g) {
          Buffer buf(borrow(g));
          const Ready& r = rd[static_cast<std::size_t>(g.rank())];
          DispatchResult d = buf.dispatch(dispatch_args(r.in, r.layout, c));
          CombineArgs ca;
          ca.x = d.recv_x;
          ca.handle = &d.handle;
          std::vector<Tensor> keep;
          edit(ca, d, keep);
          buf.combine(ca);
        },
        20.0);
    expect_all(errs, ErrorCode::invalid_argument, parts);
  }
}

// Found by a fresh user: NaN weights were taken silently. With debug_validate (semantics §11) a weight that is not
// finite is refused before anything is sent, naming topk_weights, its [t, k] and the value; without it the weights
// are not read (the default path costs nothing) and the dispatch runs.
TEST(NormalErrors, NonFiniteWeightsAreRefusedWithDebugValidate) {
  std::mt19937_64 rng(fresh_seed());
  const NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto filled = [](std::int64_t rows, std::int64_t k, std::int64_t at, float bad) {
    Tensor w = Tensor::empty(DType::fp32, {rows, k});
    for (std::int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = i == at ? bad : 0.25f;
    return w;
  };
  BufferOptions validate;
  validate.debug_validate = true;
  std::vector<std::string> dispatch_error(2), combine_error(2);
  std::vector<std::int64_t> unchecked_rows(2, -1);
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        const std::size_t r = static_cast<std::size_t>(g.rank());
        Buffer checked(borrow(g), validate), unchecked(borrow(g));
        DispatchArgs a = dispatch_args(rd[r].in, rd[r].layout, c);
        const Tensor nan_at_1_0 = filled(a.topk_idx.size(0), c.K, 1 * c.K + 0, std::nanf(""));
        a.topk_weights = nan_at_1_0;
        try {
          checked.dispatch(a);
        } catch (const Error& e) {
          dispatch_error[r] = e.what();
        }
        const DispatchResult d = checked.dispatch(dispatch_args(rd[r].in, rd[r].layout, c));
        CombineArgs ca;
        ca.x = d.recv_x;
        ca.handle = &d.handle;
        const Tensor inf_at_0_1 = filled(d.recv_x.size(0), c.K, 1, -INFINITY);
        ca.topk_weights = inf_at_0_1;
        try {
          checked.combine(ca);
        } catch (const Error& e) {
          combine_error[r] = e.what();
        }
        unchecked_rows[r] = unchecked.dispatch(a).recv_topk_weights.size(0);
      },
      20.0);
  for (std::size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(errs[r], nullptr);
    EXPECT_EQ(dispatch_error[r],
              "epmoe: invalid argument 'topk_weights': expected finite weights (debug_validate), got nan at [1, 0]");
    EXPECT_EQ(combine_error[r],
              "epmoe: invalid argument 'topk_weights': expected finite weights (debug_validate), got -inf at [0, 1]");
    EXPECT_GT(unchecked_rows[r], 0);
  }
}

TEST(NormalErrors, CombineMismatchedHiddenOrWeightsOnEveryRank) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  for (int which = 0; which < 2; ++which) {
    const auto errs = run_thread_ranks_collect(
        2,
        [&](Group& g) {
          Buffer buf(borrow(g));
          const Ready& r = rd[static_cast<std::size_t>(g.rank())];
          DispatchResult d = buf.dispatch(dispatch_args(r.in, r.layout, c));
          Tensor y = Tensor::zeros(DType::bf16, {d.recv_x.size(0), which == 0 && g.rank() == 1 ? 256 : 128});
          CombineArgs ca;
          ca.x = y;
          ca.handle = &d.handle;
          if (which == 1 && g.rank() == 0) ca.topk_weights = d.recv_topk_weights;
          buf.combine(ca);
        },
        20.0);
    expect_all(errs, ErrorCode::rank_mismatch, {which == 0 ? "hidden" : "topk_weights"});
  }
}

TEST(NormalErrors, CachedAndUncachedMixedIsRankMismatch) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        Buffer buf(borrow(g));
        const Ready& r = rd[static_cast<std::size_t>(g.rank())];
        DispatchResult d = buf.dispatch(dispatch_args(r.in, r.layout, c));
        DispatchArgs again = dispatch_args(r.in, r.layout, c);
        if (g.rank() == 1) again.handle = &d.handle;
        buf.dispatch(again);
      },
      20.0);
  expect_all(errs, ErrorCode::rank_mismatch, {"cached dispatch"});
}

TEST(NormalErrors, CachedHandlesOfDifferentDispatchesIsRankMismatch) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> first = {ready(rng, c, 0), ready(rng, c, 1)}, second = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        Buffer buf(borrow(g));
        const int r = g.rank();
        DispatchResult d1 = buf.dispatch(dispatch_args(first[r].in, first[r].layout, c));
        DispatchResult d2 = buf.dispatch(dispatch_args(second[r].in, second[r].layout, c));
        DispatchArgs again;
        again.x = first[r].in.x;
        again.handle = r == 0 ? &d1.handle : &d2.handle;
        buf.dispatch(again);
      },
      20.0);
  expect_all(errs, ErrorCode::rank_mismatch, {"handle layout"});
}

TEST(NormalErrors, CachedTopkMustFollowTheHandlesRouting) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = small(2);
  std::vector<Ready> rd = {ready(rng, c, 0), ready(rng, c, 1)};
  const auto errs = run_thread_ranks_collect(
      2,
      [&](Group& g) {
        Buffer buf(borrow(g));
        const Ready& r = rd[static_cast<std::size_t>(g.rank())];
        DispatchResult d = buf.dispatch(dispatch_args(r.in, r.layout, c));
        Tensor other = Tensor::empty(DType::int64, {24, 2});
        for (int i = 0; i < 48; ++i) other.ptr<std::int64_t>()[i] = -1;
        DispatchArgs again;
        again.x = r.in.x;
        again.topk_idx = other;
        again.handle = &d.handle;
        buf.dispatch(again);
      },
      20.0);
  expect_all(errs, ErrorCode::invalid_argument, {"'topk_idx'", "routing the handle was made with"});
}

// The normal-mode buffer size: a size past 2^63 bytes is named, not wrapped to a small hint.
TEST(NormalErrors, NvlSizeHintPast63BitsNamesMaxTokensPerRank) {
  EXPECT_EQ(Buffer::get_normal_nvl_size_hint(1, 128, 2, 8) > 0, true);
  for (std::int64_t huge : {std::int64_t{1} << 50, std::int64_t{1} << 62}) {
    try {
      Buffer::get_normal_nvl_size_hint(huge, 7168, 8, 8);
      ADD_FAILURE() << "no error for max_tokens_per_rank = " << huge;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'max_tokens_per_rank'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(huge)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace epmoe::test
