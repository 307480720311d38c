// Low-latency receive hooks (semantics §5): the call only sends, the hook receives; two calls in flight;
// hook twice, hook with async_finish, and a third call over an uncalled hook are errors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

Case small_case() {
  Case c;
  c.R = 3;
  c.E = 6;
  c.K = 2;
  c.H = 128;
  c.tmax = 5;
  return c;
}

TEST(LowLatencyHook, DispatchDataVisibleOnlyAfterHookAndHookTwiceIsError) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  std::vector<std::vector<std::int32_t>> before(3);
  std::vector<DispatchCopy> got(3);
  std::vector<Caught> twice(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
    a.return_recv_hook = true;
    auto d = b.low_latency_dispatch(a);
    ASSERT_TRUE(d.hook.defined());
    g.barrier("test: every rank has sent");
    // Every peer's data is in this rank's window now, but nothing is unpacked before the hook.
    const auto* cnt = d.packed_recv_count.ptr<std::int32_t>();
    before[static_cast<std::size_t>(r)].assign(cnt, cnt + c.E / c.R);
    d.hook();
    got[static_cast<std::size_t>(r)] = copy_dispatch(d);
    twice[static_cast<std::size_t>(r)] = catch_error([&] { d.hook(); });
  });
  for (int d = 0; d < c.R; ++d) {
    for (int e = 0; e < c.E / c.R; ++e) EXPECT_EQ(before[static_cast<std::size_t>(d)][static_cast<std::size_t>(e)], 0);
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
    EXPECT_TRUE(twice[static_cast<std::size_t>(d)].thrown);
    EXPECT_EQ(twice[static_cast<std::size_t>(d)].code, ErrorCode::stale_handle)
        << twice[static_cast<std::size_t>(d)].what;
  }
}

TEST(LowLatencyHook, CombineWritesOutOnlyInHook) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want = reference_low_latency_combine(in, ref, y, c.E);
  std::vector<int> untouched(3, 0);
  std::vector<Tensor> got(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    const auto& mine = in[static_cast<std::size_t>(r)];
    auto a = dispatch_args(c, mine);
    a.return_recv_hook = true;
    auto d = b.low_latency_dispatch(a);
    d.hook();
    Tensor out = Tensor::empty(DType::bf16, {c.tokens(r), c.H});
    for (std::int64_t i = 0; i < out.numel(); ++i) out.ptr<bf16_t>()[i].bits = 0x7fc1;
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = mine.topk_idx;
    ca.topk_weights = mine.topk_weights;
    ca.handle = &d.handle;
    ca.out = out;
    ca.return_recv_hook = true;
    auto cr = b.low_latency_combine(ca);
    ASSERT_TRUE(cr.hook.defined());
    g.barrier("test: every rank has sent back");
    int same = 1;
    for (std::int64_t i = 0; i < out.numel(); ++i) same &= out.ptr<bf16_t>()[i].bits == 0x7fc1;
    untouched[static_cast<std::size_t>(r)] = same;
    cr.hook();
    got[static_cast<std::size_t>(r)] = clone(out);
    EXPECT_EQ(catch_error([&] { cr.hook(); }).code, ErrorCode::stale_handle);
  });
  for (int d = 0; d < c.R; ++d) {
    EXPECT_EQ(untouched[static_cast<std::size_t>(d)], 1) << "out written before the hook on rank " << d;
    expect_bf16_equal(got[static_cast<std::size_t>(d)], want[static_cast<std::size_t>(d)], "combine via hook");
  }
}

// Two micro-batches: dispatch A and B both with hooks, hooks called in reverse order; after a third dispatch
// reuses A's half the handle of A is rejected, and B (whose half was not reused) combines correctly.
TEST(LowLatencyHook, TwoCallsInFlight) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto inA = make_inputs(rng, c), inB = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::vector<DispatchCopy> gotA(3), gotB(3);
  std::vector<Caught> staleA(3);
  std::vector<Tensor> combB(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a = dispatch_args(c, inA[static_cast<std::size_t>(r)]);
    a.return_recv_hook = true;
    auto dA = b.low_latency_dispatch(a);
    auto bargs = dispatch_args(c, inB[static_cast<std::size_t>(r)]);
    bargs.return_recv_hook = true;
    auto dB = b.low_latency_dispatch(bargs);
    dB.hook();
    dA.hook();
    gotA[static_cast<std::size_t>(r)] = copy_dispatch(dA);
    gotB[static_cast<std::size_t>(r)] = copy_dispatch(dB);
    b.low_latency_dispatch(dispatch_args(c, inA[static_cast<std::size_t>(r)]));  // reuses A's half
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = inA[static_cast<std::size_t>(r)].topk_idx;
    ca.topk_weights = inA[static_cast<std::size_t>(r)].topk_weights;
    ca.handle = &dA.handle;
    staleA[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
    ca.topk_idx = inB[static_cast<std::size_t>(r)].topk_idx;
    ca.topk_weights = inB[static_cast<std::size_t>(r)].topk_weights;
    ca.handle = &dB.handle;
    combB[static_cast<std::size_t>(r)] = clone(b.low_latency_combine(ca).combined_x);
  });
  const auto refA = reference_low_latency_dispatch(inA, c.E), refB = reference_low_latency_dispatch(inB, c.E);
  const auto wantB = reference_low_latency_combine(inB, refB, y, c.E);
  for (int d = 0; d < c.R; ++d) {
    expect_dispatch_matches(c, d, gotA[static_cast<std::size_t>(d)], inA, refA, {});
    expect_dispatch_matches(c, d, gotB[static_cast<std::size_t>(d)], inB, refB, {});
    EXPECT_EQ(staleA[static_cast<std::size_t>(d)].code, ErrorCode::stale_handle)
        << staleA[static_cast<std::size_t>(d)].what;
    EXPECT_TRUE(staleA[static_cast<std::size_t>(d)].thrown);
    expect_bf16_equal(combB[static_cast<std::size_t>(d)], wantB[static_cast<std::size_t>(d)], "combine of B");
  }
}

// DeepEP's alternation (semantics §5): a handle combines any number of times, also after another dispatch into the
// other half, until a later dispatch reuses its own half (DeepEP's test combines each dispatch twice).
TEST(LowLatencyHook, HandleCombinesUntilItsHalfIsReused) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto inA = make_inputs(rng, c), inB = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  std::vector<std::vector<Tensor>> comb(static_cast<std::size_t>(c.R));
  std::vector<Caught> stale(static_cast<std::size_t>(c.R));
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    const auto& mine = inA[static_cast<std::size_t>(r)];
    auto dA = b.low_latency_dispatch(dispatch_args(c, mine));  // call 0, half 0
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = mine.topk_idx;
    ca.topk_weights = mine.topk_weights;
    ca.handle = &dA.handle;
    auto& out = comb[static_cast<std::size_t>(r)];
    out.push_back(clone(b.low_latency_combine(ca).combined_x));  // call 1
    out.push_back(clone(b.low_latency_combine(ca).combined_x));  // call 2, the same handle again
    b.low_latency_dispatch(dispatch_args(c, inB[static_cast<std::size_t>(r)]));  // call 3, half 1
    out.push_back(clone(b.low_latency_combine(ca).combined_x));  // call 4: half 0 still holds A
    b.low_latency_dispatch(dispatch_args(c, inB[static_cast<std::size_t>(r)]));  // call 5, half 1
    out.push_back(clone(b.low_latency_combine(ca).combined_x));  // call 6
    b.low_latency_dispatch(dispatch_args(c, inB[static_cast<std::size_t>(r)]));  // call 7, half 1
    b.low_latency_dispatch(dispatch_args(c, inB[static_cast<std::size_t>(r)]));  // call 8, half 0: A is gone
    stale[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
  });
  const auto refA = reference_low_latency_dispatch(inA, c.E);
  const auto want = reference_low_latency_combine(inA, refA, y, c.E);
  for (int d = 0; d < c.R; ++d) {
    ASSERT_EQ(comb[static_cast<std::size_t>(d)].size(), 4u);
    for (const Tensor& t : comb[static_cast<std::size_t>(d)])
      expect_bf16_equal(t, want[static_cast<std::size_t>(d)], "combine of A");
    EXPECT_EQ(stale[static_cast<std::size_t>(d)].code, ErrorCode::stale_handle) << stale[static_cast<std::size_t>(d)].what;
  }
}

// A third call while the first call's hook is uncalled would overwrite its receive buffer: an error
// on every rank (before sending, so nobody hangs); after calling the hook the buffer goes on.
TEST(LowLatencyHook, ThirdCallOverUncalledHookIsErrorThenRecovers) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  std::vector<Caught> third(3);
  std::vector<DispatchCopy> got(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
    a.return_recv_hook = true;
    auto d1 = b.low_latency_dispatch(a);
    auto d2 = b.low_latency_dispatch(a);
    a.return_recv_hook = false;
    third[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_dispatch(a); });
    d1.hook();
    d2.hook();
    auto d3 = b.low_latency_dispatch(a);
    got[static_cast<std::size_t>(r)] = copy_dispatch(d3);
  });
  for (int d = 0; d < c.R; ++d) {
    EXPECT_EQ(third[static_cast<std::size_t>(d)].code, ErrorCode::stale_handle)
        << third[static_cast<std::size_t>(d)].what;
    EXPECT_TRUE(third[static_cast<std::size_t>(d)].thrown);
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
  }
}

TEST(LowLatencyHook, HookWithAsyncFinishIsError) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  std::vector<Caught> err(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    auto a = dispatch_args(c, in[static_cast<std::size_t>(g.rank())]);
    a.return_recv_hook = true;
    a.async_finish = true;
    err[static_cast<std::size_t>(g.rank())] = catch_error([&] { b.low_latency_dispatch(a); });
  });
  for (const auto& e : err) {
    EXPECT_EQ(e.code, ErrorCode::invalid_argument) << e.what;
    EXPECT_NE(e.what.find("async_finish"), std::string::npos) << e.what;
  }
}

// Rank 1 leaves the hook of call 0 uncalled for a while and makes call 1; rank 0 makes calls 0, 1, 2.
// Call 2 reuses half 0, which rank 1 has not read yet: rank 0 must wait for it (the "consumed"
// signal), so rank 1's late hook still sees call 0's data. With a short timeout and a hook that is
// never called, rank 0's send times out naming the peer instead of overwriting.
TEST(LowLatencyHook, SlowReceiverIsWaitedForNotOverwritten) {
  Case c = small_case();
  c.R = 2;
  c.E = 4;
  std::mt19937_64 rng(fresh_seed());
  const auto in0 = make_inputs(rng, c), in1 = make_inputs(rng, c), in2 = make_inputs(rng, c);
  const auto ref0 = reference_low_latency_dispatch(in0, c.E), ref2 = reference_low_latency_dispatch(in2, c.E);
  std::vector<DispatchCopy> got0(2), got2(2);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a0 = dispatch_args(c, in0[static_cast<std::size_t>(r)]);
    a0.return_recv_hook = r == 1;
    auto d0 = b.low_latency_dispatch(a0);
    b.low_latency_dispatch(dispatch_args(c, in1[static_cast<std::size_t>(r)]));
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 is in call 2 by now
      d0.hook();
    }
    got0[static_cast<std::size_t>(r)] = copy_dispatch(d0);
    auto d2 = b.low_latency_dispatch(dispatch_args(c, in2[static_cast<std::size_t>(r)]));
    got2[static_cast<std::size_t>(r)] = copy_dispatch(d2);
  });
  for (int d = 0; d < c.R; ++d) {
    expect_dispatch_matches(c, d, got0[static_cast<std::size_t>(d)], in0, ref0, {});
    expect_dispatch_matches(c, d, got2[static_cast<std::size_t>(d)], in2, ref2, {});
  }

  std::atomic<bool> rank0_done{false};
  const auto errs = run_buffers_collect(
      c.R,
      [&](Buffer& b, Group& g) {
        const int r = g.rank();
        auto a0 = dispatch_args(c, in0[static_cast<std::size_t>(r)]);
        a0.return_recv_hook = r == 1;
        auto d0 = b.low_latency_dispatch(a0);
        b.low_latency_dispatch(dispatch_args(c, in1[static_cast<std::size_t>(r)]));
        if (r == 1) {
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return;
        }
        const Caught e = catch_error([&] { b.low_latency_dispatch(dispatch_args(c, in2[0])); });
        rank0_done = true;
        if (e.thrown) throw Error(e.code, e.what);
      },
      {}, 0.3);
  const Caught e0 = caught(errs[0]);
  EXPECT_FALSE(errs[1]);
  ASSERT_TRUE(e0.thrown);
  EXPECT_EQ(e0.code, ErrorCode::timeout) << e0.what;
  EXPECT_TRUE(e0.what.find("peer 1") != std::string::npos &&
              e0.what.find("low_latency_dispatch send") != std::string::npos)
      << e0.what;
}

TEST(LowLatencyHook, CombineBeforeDispatchHookIsError) {
  const Case c = small_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto y = make_expert_out(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want = reference_low_latency_combine(in, ref, y, c.E);
  std::vector<Caught> early(3);
  std::vector<Tensor> got(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    const auto& mine = in[static_cast<std::size_t>(r)];
    auto a = dispatch_args(c, mine);
    a.return_recv_hook = true;
    auto d = b.low_latency_dispatch(a);
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(r)];
    ca.topk_idx = mine.topk_idx;
    ca.topk_weights = mine.topk_weights;
    ca.handle = &d.handle;
    early[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
    d.hook();
    got[static_cast<std::size_t>(r)] = clone(b.low_latency_combine(ca).combined_x);
  });
  for (int d = 0; d < c.R; ++d) {
    EXPECT_EQ(early[static_cast<std::size_t>(d)].code, ErrorCode::invalid_argument)
        << early[static_cast<std::size_t>(d)].what;
    EXPECT_NE(early[static_cast<std::size_t>(d)].what.find("recv hook"), std::string::npos)
        << early[static_cast<std::size_t>(d)].what;
    expect_bf16_equal(got[static_cast<std::size_t>(d)], want[static_cast<std::size_t>(d)], "combine after the hook");
  }
}

}  // namespace
}  // namespace epmoe::test::ll
