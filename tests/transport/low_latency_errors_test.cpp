// Low-latency mode's errors (semantics §5, 11): bad arguments before any communication, settings fixed
// for the buffer's life and compared across ranks, stale handles, timeouts naming rank/peer/phase,
// a buffer too small, ranks in different calls.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <epmoe/version.hpp>
#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

Case small_case(int R = 2) {
  Case c;
  c.R = R;
  c.E = 4 * R;
  c.K = 2;
  c.H = 128;
  c.tmax = 4;
  return c;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs `fn` on every rank, which must throw; returns what each rank threw.
std::vector<Caught> errors_on_all(int R, const std::function<void(Buffer&, Group&)>& fn, BufferOptions o = {},
                                  double timeout_s = default_timeout_s()) {
  std::vector<Caught> out;
  for (const auto& e : run_buffers_collect(R, fn, o, timeout_s)) out.push_back(caught(e));
  return out;
}

TEST(LowLatencyErrors, TokensAboveTmaxNameBoth) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  Case big = c;
  big.tmax = 9;
  const auto in = make_inputs(rng, big);  // 9 tokens per rank
  for (const auto& e : errors_on_all(c.R, [&](Buffer&b, Group&g) {
         auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
         a.num_max_dispatch_tokens_per_rank = 8;
         b.low_latency_dispatch(a);
       })) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_TRUE(contains(e.what, "T = 9") && contains(e.what, "num_max_dispatch_tokens_per_rank = 8")) << e.what;
  }
}

TEST(LowLatencyErrors, BadTopkRejectedBeforeSending) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  struct Bad {
    std::int64_t value;
    std::string expect;
  };
  for (const Bad& bad : {Bad{c.E, "[-1, 8)"}, Bad{-2, "[-1, 8)"}}) {
    for (const auto& e : errors_on_all(c.R, [&](Buffer&b, Group&g) {
           Tensor idx = clone(in[static_cast<std::size_t>(g.rank())].topk_idx);
           idx.ptr<std::int64_t>()[1] = bad.value;
           auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
           a.topk_idx = idx;
           b.low_latency_dispatch(a);
         })) {
      ASSERT_TRUE(e.thrown);
      EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
      EXPECT_TRUE(contains(e.what, "topk_idx") && contains(e.what, bad.expect) &&
                  contains(e.what, std::to_string(bad.value)))
          << e.what;
    }
  }
  // K = 17 > 16.
  Case k17 = c;
  k17.K = 17;
  k17.E = 40;
  const auto in17 = make_inputs(rng, k17);
  for (const auto& e : errors_on_all(c.R, [&](Buffer&b, Group&g) {
         b.low_latency_dispatch(dispatch_args(k17, in17[static_cast<std::size_t>(g.rank())]));
       })) {
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_TRUE(contains(e.what, "K = 17")) << e.what;
  }
  // The same expert twice in one token.
  for (const auto& e : errors_on_all(c.R, [&](Buffer&b, Group&g) {
         Tensor idx = clone(in[static_cast<std::size_t>(g.rank())].topk_idx);
         idx.ptr<std::int64_t>()[1] = idx.ptr<std::int64_t>()[0] = 3;
         auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
         a.topk_idx = idx;
         b.low_latency_dispatch(a);
       })) {
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_TRUE(contains(e.what, "distinct")) << e.what;
  }
}

// A topk_idx of another dtype than int64 or int32 is said in one wording by every call that takes it: the layout,
// the low-latency dispatch and the normal dispatch name the argument, the dtypes it takes and the one it has.
TEST(LowLatencyErrors, TopkIdxOfAnotherDtypeIsSaidInOneWording) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  std::vector<std::int16_t> ids(static_cast<std::size_t>(c.tmax * c.K), 0);
  const TensorView idx16(ids.data(), DType::int16, {c.tmax, c.K});
  const std::string want = "epmoe: invalid argument 'topk_idx': expected dtype int64 or int32, got int16[" +
                           std::to_string(c.tmax) + ", " + std::to_string(c.K) + "] cpu";
  const Caught layout = catch_error([&] { get_dispatch_layout(idx16, c.E, c.R); });
  EXPECT_EQ(layout.code, ErrorCode::invalid_argument);
  EXPECT_EQ(layout.what, want);
  for (const auto& e : errors_on_all(c.R, [&](Buffer& b, Group& g) {
         auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
         a.topk_idx = idx16;
         b.low_latency_dispatch(a);
       })) {
    EXPECT_EQ(e.code, ErrorCode::invalid_argument);
    EXPECT_EQ(e.what, want);
  }
  for (const auto& e : errors_on_all(c.R, [&](Buffer& b, Group& g) {
         const LowLatencyRankInput& mine = in[static_cast<std::size_t>(g.rank())];
         const DispatchLayout l = b.get_dispatch_layout(mine.topk_idx, c.E);
         b.dispatch(make_dispatch_args(l, mine.x, idx16, mine.topk_weights));
       })) {
    EXPECT_EQ(e.code, ErrorCode::invalid_argument);
    EXPECT_EQ(e.what, want);
  }
}

TEST(LowLatencyErrors, BadShapesAndOptions) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  struct Variant {
    std::string name;
    std::function<void(LowLatencyDispatchArgs&)> edit;
    std::string expect;
  };
  Tensor x_f32 = random_f32(rng, c.tmax, c.H);
  Tensor x_h120 = random_bf16(rng, c.tmax, 120);
  Tensor weights_bad = random_f32(rng, c.tmax, c.K + 1);
  Tensor stats_bad = Tensor::zeros(DType::int32, {c.E});
  Tensor cost_int32 = Tensor::zeros(DType::int32, {c.R}), cost_square = Tensor::zeros(DType::int64, {c.R, c.R});
  const std::vector<Variant> variants = {
      {"float32 x", [&](auto& a) { a.x = x_f32; }, "'x'"},
      {"fp8 with H % 16 != 0", [&](auto& a) { a.x = x_h120; }, "multiple of 16"},
      {"ue8m0 without round_scale", [&](auto& a) { a.use_ue8m0 = true; }, "use_ue8m0"},
      {"round_scale without fp8",
       [&](auto& a) {
         a.use_fp8 = false;
         a.round_scale = true;
       },
       "use_fp8"},
      {"E % R != 0", [&](auto& a) { a.num_experts = 7; }, "num_experts"},
      {"E_local = 1025", [&](auto& a) { a.num_experts = 1025 * c.R; },
       "'num_experts': expected at most 1024 experts per rank"},
      {"weights shape", [&](auto& a) { a.topk_weights = weights_bad; }, "topk_weights"},
      {"stats shape", [&](auto& a) { a.cumulative_local_expert_recv_stats = stats_bad; },
       "cumulative_local_expert_recv_stats"},
      {"wait-cost stats int32", [&](auto& a) { a.dispatch_wait_recv_cost_stats = cost_int32; },
       "'dispatch_wait_recv_cost_stats': expected None or a contiguous int64[2]"},
      {"wait-cost stats [R, R]", [&](auto& a) { a.dispatch_wait_recv_cost_stats = cost_square; },
       "dispatch_wait_recv_cost_stats"},
  };
  for (const auto& v : variants) {
    SCOPED_TRACE(v.name);
    for (const auto& e : errors_on_all(c.R, [&](Buffer&b, Group&g) {
           auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
           a.use_fp8 = true;
           v.edit(a);
           b.low_latency_dispatch(a);
         })) {
      ASSERT_TRUE(e.thrown);
      EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
      EXPECT_TRUE(contains(e.what, v.expect)) << e.what;
    }
  }
  EXPECT_THROW(Buffer::get_low_latency_rdma_size_hint(0, 128, 2, 8), Error);
  EXPECT_THROW(Buffer::get_low_latency_rdma_size_hint(4, 100, 2, 8), Error);
  EXPECT_THROW(Buffer::get_low_latency_rdma_size_hint(4, 128, 3, 8), Error);
}

// A window past 64-bit sizes is refused naming hidden, where its 64-bit sums wrapped around to a small figure (hidden
// 2^60 gave 2^32 GiB, 2^62 gave 0) that passed memory checks; the largest accepted sizes stay exact and monotonic.
TEST(LowLatencyErrors, WindowPastSixtyFourBitsIsRefusedNamingHidden) {
  for (const std::int64_t hidden : {std::int64_t{1} << 60, std::int64_t{1} << 62, std::int64_t{1} << 50}) {
    try {
      (void)Buffer::get_low_latency_rdma_size_hint(128, hidden, 8, 256);
      ADD_FAILURE() << "hidden = " << hidden << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_TRUE(contains(e.what(), "'hidden'")) << e.what();
      EXPECT_TRUE(contains(e.what(), "2^62")) << e.what();
    }
  }
  // DeepEP's decode shape and a large one below the bound: the hint grows with hidden (no wrap-around).
  const std::int64_t small = Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 256);
  const std::int64_t large = Buffer::get_low_latency_rdma_size_hint(128, std::int64_t{1} << 40, 8, 256);
  EXPECT_GT(small, 0);
  EXPECT_GT(large, small);
  EXPECT_GT(static_cast<double>(large), 0x1p40 * 128 * 32 * 8 * 4);  // at least the two bf16 slabs of every row
}

// A Tmax whose window no machine's memory holds is named before any allocation (the allocator's failure named no
// setting), and nothing is fixed by the refused call: the next call, with a fitting Tmax, runs.
TEST(LowLatencyErrors, WindowPastHostMemoryNamesTmaxAndTheBufferStaysUsable) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const int huge = 1 << 29;  // two halves of 4 experts x 2^30 rows of ~1.3 KB: about 11 TB
  std::vector<DispatchCopy> got(static_cast<std::size_t>(c.R));
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const auto& mine = in[static_cast<std::size_t>(g.rank())];
    auto a = dispatch_args(c, mine);
    a.num_max_dispatch_tokens_per_rank = huge;
    const Caught e = catch_error([&] { b.low_latency_dispatch(a); });
    EXPECT_TRUE(e.thrown) << "num_max_dispatch_tokens_per_rank = " << huge << " was accepted";
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_TRUE(contains(e.what, "'num_max_dispatch_tokens_per_rank'") && contains(e.what, std::to_string(huge)) &&
                contains(e.what, "memory"))
        << e.what;
    got[static_cast<std::size_t>(g.rank())] = copy_dispatch(b.low_latency_dispatch(dispatch_args(c, mine)));
  });
  const auto ref = reference_low_latency_dispatch(in, c.E);
  for (int d = 0; d < c.R; ++d) expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
}

// Thread ranks' windows share one process: a Tmax whose one window fits this machine's memory but whose two (two
// thread ranks) do not is refused, not left to an allocation that overcommits.
TEST(LowLatencyErrors, ThreadRanksWindowsAddUpAgainstHostMemory) {
  const Case c = small_case();
  const double have = host_memory_bytes();
  if (have <= 0) GTEST_SKIP() << "the system does not say its memory";
  int tmax = 1;
  while (2.0 * static_cast<double>(Buffer::get_low_latency_rdma_size_hint(tmax, c.H, c.R, c.E)) <= have) tmax *= 2;
  const double one = static_cast<double>(Buffer::get_low_latency_rdma_size_hint(tmax, c.H, c.R, c.E));
  ASSERT_LE(one, have) << "Tmax = " << tmax;  // one rank's window alone would fit
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  for (const auto& e : errors_on_all(c.R, [&](Buffer& b, Group& g) {
         auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
         a.num_max_dispatch_tokens_per_rank = tmax;
         b.low_latency_dispatch(a);
       })) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_TRUE(contains(e.what, "'num_max_dispatch_tokens_per_rank'") && contains(e.what, "x 2 thread ranks"))
        << e.what;
  }
}

TEST(LowLatencyErrors, BufferTooSmallNamesBytesNeeded) {
  const Case c = small_case();
  const std::int64_t need = Buffer::get_low_latency_rdma_size_hint(c.tmax, c.H, c.R, c.E);
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  BufferOptions o;
  o.num_rdma_bytes = need - 1;
  for (const auto& e : errors_on_all(
           c.R,
           [&](Buffer&b, Group&g) { b.low_latency_dispatch(dispatch_args(c, in[static_cast<std::size_t>(g.rank())])); },
           o)) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::out_of_memory) << e.what;
    EXPECT_TRUE(contains(e.what, std::to_string(need)) && contains(e.what, "num_rdma_bytes")) << e.what;
  }
}

// Tmax, H and E are fixed by the first call, which compares them across ranks: one rank's other value is a
// rank_mismatch on every rank (within the short timeout: never a hang), naming the setting.
TEST(LowLatencyErrors, FirstCallSettingsDifferingAcrossRanksAreAMismatchOnEveryRank) {
  const Case c = small_case(3);
  std::mt19937_64 rng(fresh_seed());
  Case few = c;
  few.tmax = 2;
  const auto in = make_inputs(rng, few);
  const auto errs = errors_on_all(
      c.R,
      [&](Buffer& b, Group& g) {
        auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
        a.num_max_dispatch_tokens_per_rank = g.rank() == 2 ? 8 : 4;
        b.low_latency_dispatch(a);
      },
      {}, 10.0);
  for (const auto& e : errs) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::rank_mismatch) << e.what;
    EXPECT_TRUE(contains(e.what, "num_max_dispatch_tokens_per_rank")) << e.what;
  }
  // Hidden sizes differing across ranks, likewise.
  Tensor wide = random_bf16(rng, 2, 256);
  const auto errs_h = errors_on_all(
      c.R,
      [&](Buffer& b, Group& g) {
        auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
        if (g.rank() == 0) a.x = wide;
        b.low_latency_dispatch(a);
      },
      {}, 10.0);
  for (const auto& e : errs_h) {
    EXPECT_EQ(e.code, ErrorCode::rank_mismatch) << e.what;
    EXPECT_TRUE(contains(e.what, "hidden")) << e.what;
  }
  // The number of experts likewise (the ids, drawn below 12, are valid for both).
  const auto errs_e = errors_on_all(
      c.R,
      [&](Buffer& b, Group& g) {
        auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
        if (g.rank() == 1) a.num_experts = 2 * c.E;
        b.low_latency_dispatch(a);
      },
      {}, 10.0);
  for (const auto& e : errs_e) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::rank_mismatch) << e.what;
    EXPECT_TRUE(contains(e.what, "num_experts") && contains(e.what, std::to_string(c.E)) &&
                contains(e.what, std::to_string(2 * c.E)))
        << e.what;
  }
}

TEST(LowLatencyErrors, SettingsFixedByFirstCall) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  std::vector<Caught> tmax_err(2), e_err(2), h_err(2), clean_err(2);
  Tensor wide = random_bf16(rng, c.tmax, 256);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
    b.low_latency_dispatch(a);
    auto t = a;
    t.num_max_dispatch_tokens_per_rank = 8;
    tmax_err[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_dispatch(t); });
    auto e = a;
    e.num_experts = 16;
    e_err[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_dispatch(e); });
    auto h = a;
    h.x = wide;
    h_err[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_dispatch(h); });
    clean_err[static_cast<std::size_t>(r)] = catch_error([&] { b.clean_low_latency_buffer(8, c.H, c.E); });
    b.low_latency_dispatch(a);  // still usable
  });
  for (int r = 0; r < c.R; ++r) {
    for (const auto* e : {&tmax_err[static_cast<std::size_t>(r)], &e_err[static_cast<std::size_t>(r)],
                          &h_err[static_cast<std::size_t>(r)], &clean_err[static_cast<std::size_t>(r)]}) {
      EXPECT_TRUE(e->thrown);
      EXPECT_EQ(e->code, ErrorCode::invalid_argument) << e->what;
      EXPECT_TRUE(contains(e->what, "first low-latency call")) << e->what;
    }
  }
}

// Found by a fresh user: a bf16 x whose width no low-latency buffer takes (H = 100), or another width than the
// buffer's first call fixed, was named 'hidden', an argument the dispatch has not. Named as x, with both H;
// clean_low_latency_buffer, which takes hidden, still names it.
TEST(LowLatencyErrors, WidthOfXIsNamedAsX) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const Tensor x100 = random_bf16(rng, c.tmax, 100), x256 = random_bf16(rng, c.tmax, 256);
  std::vector<Caught> odd(2), other(2), clean(2);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const std::size_t r = static_cast<std::size_t>(g.rank());
    auto a = dispatch_args(c, in[r]);
    a.x = x100;
    odd[r] = catch_error([&] { b.low_latency_dispatch(a); });
    b.low_latency_dispatch(dispatch_args(c, in[r]));  // fixes H = 128
    a.x = x256;
    other[r] = catch_error([&] { b.low_latency_dispatch(a); });
    clean[r] = catch_error([&] { b.clean_low_latency_buffer(c.tmax, 256, c.E); });
  });
  for (std::size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(odd[r].what,
              "epmoe: invalid argument 'x': expected H a positive multiple of 8 (bf16 rows of 16-byte units), got H = "
              "100");
    EXPECT_EQ(other[r].what,
              "epmoe: invalid argument 'x': expected H = 128 (fixed by the buffer's first low-latency call), got H = "
              "256");
    EXPECT_EQ(clean[r].what,
              "epmoe: invalid argument 'hidden': expected H = 128 (fixed by the buffer's first low-latency call), got "
              "H = 256");
  }
}

// With debug_validate (semantics §11) weights that are not finite are refused before anything is sent, in the
// low-latency calls as in normal mode; without it the combine runs.
TEST(LowLatencyErrors, NonFiniteWeightsAreRefusedWithDebugValidate) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::vector<Caught> dispatch(2), combine(2), unchecked(2);
  for (const bool validate : {true, false}) {
    BufferOptions o;
    o.debug_validate = validate;
    run_buffers(
        c.R,
        [&](Buffer& b, Group& g) {
          const std::size_t r = static_cast<std::size_t>(g.rank());
          Tensor w = clone(in[r].topk_weights);
          w.ptr<float>()[1 * c.K + 1] = std::nanf("");
          auto a = dispatch_args(c, in[r]);
          a.topk_weights = w;
          if (validate) dispatch[r] = catch_error([&] { b.low_latency_dispatch(a); });
          const LowLatencyDispatchResult d = b.low_latency_dispatch(dispatch_args(c, in[r]));
          LowLatencyCombineArgs ca;
          ca.x = y[r];
          ca.topk_idx = in[r].topk_idx;
          ca.topk_weights = w;
          ca.handle = &d.handle;
          (validate ? combine : unchecked)[r] = catch_error([&] { b.low_latency_combine(ca); });
        },
        o);
  }
  for (std::size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const std::string want =
        "epmoe: invalid argument 'topk_weights': expected finite weights (debug_validate), got nan at [1, 1]";
    EXPECT_EQ(dispatch[r].what, want);
    EXPECT_EQ(combine[r].what, want);
    EXPECT_FALSE(unchecked[r].thrown) << unchecked[r].what;
  }
}

TEST(LowLatencyErrors, HandleOfReusedHalfAndOtherBufferAndOtherTopk) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::vector<Caught> stale(2), other(2), topk(2);
  run_thread_ranks(c.R, [&](Group& g) {
    std::shared_ptr<Group> shared(&g, [](Group*) {});
    Buffer b(shared), b2(shared);
    const int r = g.rank();
    const auto& mine = in[static_cast<std::size_t>(r)];
    auto d0 = b.low_latency_dispatch(dispatch_args(c, mine));
    auto d1 = b.low_latency_dispatch(dispatch_args(c, mine));
    auto d2 = b.low_latency_dispatch(dispatch_args(c, mine));  // reuses d0's half: d0's routing is gone
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = mine.topk_idx;
    ca.topk_weights = mine.topk_weights;
    ca.handle = &d0.handle;
    stale[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
    ca.handle = &d1.handle;
    other[static_cast<std::size_t>(r)] = catch_error([&] { b2.low_latency_combine(ca); });
    Tensor idx = clone(mine.topk_idx);
    idx.ptr<std::int64_t>()[0] = idx.ptr<std::int64_t>()[0] == 0 ? 1 : 0;
    if (idx.ptr<std::int64_t>()[0] == idx.ptr<std::int64_t>()[1]) idx.ptr<std::int64_t>()[0] = -1;
    ca.topk_idx = idx;
    topk[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
    ca.topk_idx = mine.topk_idx;
    b.low_latency_combine(ca);  // the right one still works
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(stale[static_cast<std::size_t>(r)].code, ErrorCode::stale_handle)
        << stale[static_cast<std::size_t>(r)].what;
    EXPECT_TRUE(contains(stale[static_cast<std::size_t>(r)].what, "reused its half"))
        << stale[static_cast<std::size_t>(r)].what;
    EXPECT_EQ(other[static_cast<std::size_t>(r)].code, ErrorCode::invalid_argument)
        << other[static_cast<std::size_t>(r)].what;
    EXPECT_TRUE(contains(other[static_cast<std::size_t>(r)].what, "handle")) << other[static_cast<std::size_t>(r)].what;
    EXPECT_EQ(topk[static_cast<std::size_t>(r)].code, ErrorCode::invalid_argument)
        << topk[static_cast<std::size_t>(r)].what;
    EXPECT_TRUE(contains(topk[static_cast<std::size_t>(r)].what, "topk_idx")) << topk[static_cast<std::size_t>(r)].what;
  }
}

// run_thread_ranks: rank 1 returns after its first dispatch. Rank 0's second receive, waiting for rank 1's data
// signal, raises unusable naming rank 1 at once instead of waiting out its 60 s timeout.
TEST(LowLatencyErrors, ARankReturningBeforeItsSendReleasesTheReceiverAtOnce) {
  const Case c = small_case();
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto in = make_inputs(rng, c);
  const auto start = std::chrono::steady_clock::now();
  try {
    run_thread_ranks(
        c.R,
        [&](Group& g) {
          std::shared_ptr<Group> shared(&g, [](Group*) {});
          Buffer b(shared, BufferOptions{});
          b.low_latency_dispatch(dispatch_args(c, in[static_cast<std::size_t>(g.rank())]));
          if (g.rank() == 1) return;
          b.low_latency_dispatch(dispatch_args(c, in[0]));
        },
        60.0);
    ADD_FAILURE() << "nothing thrown (seed " << seed << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unusable) << e.what();
    EXPECT_TRUE(contains(e.what(), "rank 0") && contains(e.what(), "rank 1 returned") &&
                contains(e.what(), "low_latency_dispatch receive"))
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// Rank 1 makes the first call, then never arrives at the second: rank 0 times out naming itself, the
// peer and the phase. Rank 1 keeps its buffer until rank 0 is done.
TEST(LowLatencyErrors, MissingRankTimesOutNamingRankPeerPhase) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  std::atomic<bool> rank0_done{false};
  const auto errs = run_buffers_collect(
      c.R,
      [&](Buffer& b, Group& g) {
        const auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
        b.low_latency_dispatch(a);
        if (g.rank() == 1) {
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return;
        }
        try {
          b.low_latency_dispatch(a);
        } catch (...) {
          rank0_done = true;
          throw;
        }
        rank0_done = true;
      },
      {}, 0.3);
  const Caught e0 = caught(errs[0]);
  EXPECT_FALSE(errs[1]);
  ASSERT_TRUE(e0.thrown);
  EXPECT_EQ(e0.code, ErrorCode::timeout) << e0.what;
  EXPECT_TRUE(contains(e0.what, "rank 0") && contains(e0.what, "peer 1") &&
              contains(e0.what, "low_latency_dispatch receive"))
      << e0.what;
}

// Rank 1 never reaches the combine: rank 0's combine receive times out naming peer 1; afterwards the
// buffer is unusable.
TEST(LowLatencyErrors, CombineTimeoutThenUnusable) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::atomic<bool> rank0_done{false};
  Caught after;
  const auto errs = run_buffers_collect(
      c.R,
      [&](Buffer& b, Group& g) {
        const auto& mine = in[static_cast<std::size_t>(g.rank())];
        auto d = b.low_latency_dispatch(dispatch_args(c, mine));
        if (g.rank() == 1) {
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return;
        }
        LowLatencyCombineArgs ca;
        ca.x = y[0];
        ca.topk_idx = mine.topk_idx;
        ca.topk_weights = mine.topk_weights;
        ca.handle = &d.handle;
        const Caught e = catch_error([&] { b.low_latency_combine(ca); });
        after = catch_error([&] { b.low_latency_dispatch(dispatch_args(c, mine)); });
        rank0_done = true;
        if (e.thrown) throw Error(e.code, e.what);
      },
      {}, 0.3);
  const Caught e0 = caught(errs[0]);
  ASSERT_TRUE(e0.thrown);
  EXPECT_EQ(e0.code, ErrorCode::timeout) << e0.what;
  EXPECT_TRUE(contains(e0.what, "peer 1") && contains(e0.what, "low_latency_combine receive")) << e0.what;
  EXPECT_EQ(after.code, ErrorCode::unusable) << after.what;
}

// Per-call settings differ (fp8 on one rank, bf16 on the other), or ranks are in different calls:
// every rank raises rank_mismatch instead of misreading the other's bytes.
TEST(LowLatencyErrors, RanksInDifferentCallsOrFormatsAreMismatch) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  const auto fmt_errs = errors_on_all(
      c.R,
      [&](Buffer& b, Group& g) {
        auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
        a.use_fp8 = g.rank() == 0;
        b.low_latency_dispatch(a);
      },
      {}, 10.0);
  for (const auto& e : fmt_errs) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::rank_mismatch) << e.what;
    EXPECT_TRUE(contains(e.what, "use_fp8")) << e.what;
  }
  const auto call_errs = errors_on_all(
      c.R,
      [&](Buffer& b, Group& g) {
        const auto& mine = in[static_cast<std::size_t>(g.rank())];
        auto d = b.low_latency_dispatch(dispatch_args(c, mine));
        if (g.rank() == 0) {
          b.low_latency_dispatch(dispatch_args(c, mine));
        } else {
          LowLatencyCombineArgs ca;
          ca.x = y[1];
          ca.topk_idx = mine.topk_idx;
          ca.topk_weights = mine.topk_weights;
          ca.handle = &d.handle;
          b.low_latency_combine(ca);
        }
      },
      {}, 10.0);
  for (const auto& e : call_errs) {
    ASSERT_TRUE(e.thrown);
    EXPECT_EQ(e.code, ErrorCode::rank_mismatch) << e.what;
    EXPECT_TRUE(contains(e.what, "same low-latency call")) << e.what;
  }
}

}  // namespace
}  // namespace epmoe::test::ll
