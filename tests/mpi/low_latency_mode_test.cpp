// Low-latency dispatch and combine over MPI windows, bit for bit against the threads backend on the
// same inputs (semantics §13). Every process regenerates every rank's inputs from the shared seed, runs the
// threads backend over all of them (inside the process), and compares its own rank's MPI results.
// Several rounds on one buffer exercise the two alternating halves of the window.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>
#include <epmoe/nvfp4.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "mpi/compare.hpp"
#include "mpi/mpi_test_util.hpp"
#include "support/low_latency_reference.hpp"

namespace epmoe::test {
namespace {

struct LowLatencyCase {
  std::string name;
  int experts_per_rank = 2;
  int K = 3;
  std::int64_t H = 128;
  int tmax = 12;
  bool fp8 = false, round_scale = false, ue8m0 = false;
  bool nvfp4 = false;  // with x_global_scale 1.5
  bool hook = false;
  int zero_token_rank = -1;
  int all_minus_one_rank = -1;  ///< this rank's ids are all -1 (its tokens go nowhere)
  int only_expert = -1;         ///< >= 0: every token of every rank goes to this expert alone
  bool full_batch = false;      ///< T = Tmax on every rank (else 1..Tmax at random)
  int rounds = 3;
  /// 1: the combine waits for comp_signal per block of 5 rows (3 adds, one per N-tile of 48 columns: H = 128);
  /// 2: for src_signals per expert. A producer thread writes x after a NaN fill, block by block, then signals.
  int overlap = 0;
};

struct RankInput {
  Tensor x, topk_idx, topk_weights;
};

RankInput make_input(std::uint64_t seed, int rank, int R, int round, const LowLatencyCase& c) {
  auto rng = rank_rng(seed, rank, 10 + static_cast<std::uint64_t>(round));
  const std::int64_t T = rank == c.zero_token_rank ? 0
                         : c.full_batch            ? c.tmax
                                                   : 1 + static_cast<std::int64_t>(rng() % c.tmax);
  RankInput in;
  in.x = random_bf16(rng, T, c.H, 3.0f);
  RoutingOptions o;
  o.p_minus_one = 0.1;
  o.only_expert = c.only_expert;
  in.topk_idx = random_topk_idx(rng, T, c.K, c.experts_per_rank * R, o);
  if (rank == c.all_minus_one_rank)
    for (std::int64_t i = 0; i < in.topk_idx.numel(); ++i) in.topk_idx.ptr<std::int64_t>()[i] = -1;
  in.topk_weights = random_topk_weights(rng, in.topk_idx);
  return in;
}

/// The experts' outputs of rank `rank` in round `round`: bf16 [E_local, R * Tmax, H], reproducible on any rank.
Tensor expert_output(std::uint64_t seed, int rank, int R, int round, const LowLatencyCase& c) {
  auto rng = rank_rng(seed, rank, 100 + static_cast<std::uint64_t>(round));
  const std::int64_t rows = static_cast<std::int64_t>(R) * c.tmax;
  Tensor flat = random_bf16(rng, c.experts_per_rank * rows, c.H, 2.0f);
  return Tensor::wrap(TensorView(flat.data(), DType::bf16, {c.experts_per_rank, rows, c.H}),
                      std::shared_ptr<void>(flat.data(), [flat](void*) {}));
}

/// The valid part of a dispatch (rows beyond an expert's count are unspecified) and the combine.
struct Snapshot {
  std::vector<std::byte> packed_x, scales;
  std::vector<std::int32_t> count, src_info;
  std::vector<std::int64_t> layout_range;
  Tensor combined_x;
};

void append_row(std::vector<std::byte>& out, const TensorView& v, std::int64_t e, std::int64_t j) {
  // Row (e, j) of a 3-d view, element by element (the scales may be column-major in the last two dims).
  const std::size_t es = dtype_size(v.dtype);
  for (std::int64_t k = 0; k < v.size(2); ++k) {
    const auto* p = static_cast<const std::byte*>(v.data) +
                    (e * v.stride(0) + j * v.stride(1) + k * v.stride(2)) * static_cast<std::int64_t>(es);
    out.insert(out.end(), p, p + es);
  }
}

Snapshot snapshot_dispatch(const LowLatencyDispatchResult& d) {
  Snapshot s;
  const std::int64_t El = d.packed_recv_x.size(0);
  for (std::int64_t e = 0; e < El; ++e) {
    const std::int32_t count = d.packed_recv_count.ptr<std::int32_t>()[e];
    s.count.push_back(count);
    for (std::int64_t j = 0; j < count; ++j) {
      append_row(s.packed_x, d.packed_recv_x, e, j);
      if (d.packed_recv_x.dtype == DType::uint8) {  // nvfp4: the row's block scales in its expert's swizzled matrix
        const TensorView& sv = d.packed_recv_x_scales;
        const std::int64_t blocks = 2 * d.packed_recv_x.size(2) / 16;
        for (std::int64_t b = 0; b < blocks; ++b)
          s.scales.push_back(static_cast<const std::byte*>(sv.data)[e * sv.stride(0) +
                                                                  nvfp4_swizzled_offset(j, b, blocks / 4)]);
      } else if (d.packed_recv_x_scales.defined()) {
        append_row(s.scales, d.packed_recv_x_scales, e, j);
      }
      const TensorView& si = d.handle.src_info;
      s.src_info.push_back(si.ptr<std::int32_t>()[e * si.stride(0) + j * si.stride(1)]);
    }
  }
  const TensorView& lr = d.handle.layout_range;
  for (std::int64_t i = 0; i < lr.numel(); ++i) s.layout_range.push_back(lr.ptr<std::int64_t>()[i]);
  return s;
}

/// The same rounds on any backend: dispatch, then combine of random expert outputs.
std::vector<Snapshot> run_rank(Buffer& buffer, std::uint64_t seed, const LowLatencyCase& c) {
  const int R = buffer.num_ranks(), me = buffer.rank(), E = c.experts_per_rank * R;
  std::vector<Snapshot> out;
  for (int round = 0; round < c.rounds; ++round) {
    const RankInput in = make_input(seed, me, R, round, c);
    LowLatencyDispatchArgs a;
    a.x = in.x;
    a.topk_idx = in.topk_idx;
    a.topk_weights = in.topk_weights;
    a.num_max_dispatch_tokens_per_rank = c.tmax;
    a.num_experts = E;
    a.use_fp8 = c.fp8;
    a.round_scale = c.round_scale;
    a.use_ue8m0 = c.ue8m0;
    Tensor gs = Tensor::empty(DType::fp32, Shape{});
    *gs.ptr<float>() = 1.5f;
    a.use_nvfp4 = c.nvfp4;
    if (c.nvfp4) a.x_global_scale = gs;
    a.return_recv_hook = c.hook;
    LowLatencyDispatchResult d = buffer.low_latency_dispatch(a);
    if (c.hook) d.hook();
    Snapshot s = snapshot_dispatch(d);

    const std::int64_t rows = static_cast<std::int64_t>(R) * c.tmax;
    const Tensor flat = expert_output(seed, me, R, round, c);
    LowLatencyCombineArgs ca;
    ca.x = flat;
    ca.topk_idx = in.topk_idx;
    ca.topk_weights = in.topk_weights;
    ca.handle = &d.handle;
    ca.return_recv_hook = c.hook;
    LowLatencyCombineResult r;
    if (c.overlap == 0) {
      r = buffer.low_latency_combine(ca);
    } else {
      constexpr int kBlockM = 5, kBlockN = 48;
      const std::int64_t bpe = (rows + kBlockM - 1) / kBlockM;
      Tensor x = Tensor::empty(DType::bf16, {c.experts_per_rank, rows, c.H});
      for (std::int64_t i = 0; i < x.numel(); ++i) x.ptr<bf16_t>()[i] = bf16_t{0x7fc0};  // NaN until produced
      Tensor sig = c.overlap == 1 ? Tensor::zeros(DType::int32, {c.experts_per_rank * bpe})
                                  : Tensor::zeros(DType::uint32, {c.experts_per_rank});
      const std::int32_t* count = d.packed_recv_count.ptr<std::int32_t>();
      std::thread producer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        for (int e = 0; e < c.experts_per_rank; ++e) {
          const std::int64_t n = count[e];
          for (std::int64_t b = 0; b * kBlockM < n; ++b)
            for (std::int64_t c0 = 0; c0 < c.H; c0 += kBlockN) {
              for (std::int64_t j = b * kBlockM; j < std::min(n, (b + 1) * kBlockM); ++j)
                std::memcpy(x.ptr<bf16_t>() + (e * rows + j) * c.H + c0, flat.ptr<bf16_t>() + (e * rows + j) * c.H + c0,
                            static_cast<std::size_t>(std::min<std::int64_t>(kBlockN, c.H - c0)) * 2);
              if (c.overlap == 1) __atomic_fetch_add(sig.ptr<std::int32_t>() + e * bpe + b, 1, __ATOMIC_RELEASE);
            }
          if (c.overlap == 2) __atomic_fetch_add(sig.ptr<std::uint32_t>() + e, 1u, __ATOMIC_RELEASE);
        }
      });
      ca.x = x;
      ca.overlap = true;
      if (c.overlap == 1) {
        ca.comp_signal = sig;
        ca.packed_recv_count = d.packed_recv_count;
        ca.block_m = kBlockM;
        ca.threshold = static_cast<int>((c.H + kBlockN - 1) / kBlockN);
      } else {
        ca.src_signals = sig;
        ca.src_signal_expect_value = 1;
      }
      try {
        r = buffer.low_latency_combine(ca);
      } catch (...) {
        producer.join();
        throw;
      }
      producer.join();
    }
    if (c.hook) r.hook();
    s.combined_x = r.combined_x;
    out.push_back(std::move(s));
  }
  return out;
}

// Each round's layout and combine against the independent reference (tests/support/low_latency_reference), from every
// rank's inputs and expert outputs regenerated in this process.
void expect_reference(std::uint64_t seed, const LowLatencyCase& c, const std::vector<Snapshot>& got) {
  const int R = world_size(), me = world_rank(), E = c.experts_per_rank * R;
  for (int round = 0; round < c.rounds; ++round) {
    SCOPED_TRACE("reference, round " + std::to_string(round));
    std::vector<LowLatencyRankInput> in;
    std::vector<Tensor> y;
    for (int s = 0; s < R; ++s) {
      const RankInput ri = make_input(seed, s, R, round, c);
      in.push_back({ri.x, ri.topk_idx, ri.topk_weights});
      y.push_back(expert_output(seed, s, R, round, c));
    }
    const auto ref = reference_low_latency_dispatch(in, E);
    const LowLatencyReferenceRank& mine = ref[static_cast<std::size_t>(me)];
    std::vector<std::int32_t> count, src_info;
    for (const auto& rows : mine.rows) {
      count.push_back(static_cast<std::int32_t>(rows.size()));
      for (const PackedRowSource& row : rows) src_info.push_back(row.token);
    }
    const Snapshot& g = got[static_cast<std::size_t>(round)];
    EXPECT_EQ(g.count, count);
    EXPECT_EQ(g.src_info, src_info);
    EXPECT_EQ(g.layout_range, mine.layout_range);
    EXPECT_TRUE(same_tensor(g.combined_x, reference_low_latency_combine(in, ref, y, E)[static_cast<std::size_t>(me)]))
        << "combined_x against the reference";
  }
}

void run_case(const LowLatencyCase& c) {
  SCOPED_TRACE(c.name);
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  std::vector<std::vector<Snapshot>> threads(static_cast<std::size_t>(R));
  run_thread_ranks(R, [&](Group& g) {
    Buffer buffer(std::shared_ptr<Group>(&g, [](Group*) {}));
    threads[static_cast<std::size_t>(g.rank())] = run_rank(buffer, seed, c);
  });

  Buffer buffer(test_group());
  const std::vector<Snapshot> got = run_rank(buffer, seed, c);
  const std::vector<Snapshot>& want = threads[static_cast<std::size_t>(me)];
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    EXPECT_EQ(got[i].count, want[i].count);
    EXPECT_EQ(got[i].layout_range, want[i].layout_range);
    EXPECT_EQ(got[i].src_info, want[i].src_info);
    EXPECT_TRUE(got[i].packed_x == want[i].packed_x) << "packed_recv_x differs";
    EXPECT_TRUE(got[i].scales == want[i].scales) << "packed_recv_x_scales differ";
    EXPECT_TRUE(same_tensor(got[i].combined_x, want[i].combined_x)) << "combined_x";
  }
  expect_reference(seed, c, got);
}

TEST(MpiLowLatencyMode, Bf16DispatchAndCombineMatchTheThreadsBackend) { run_case({.name = "bf16"}); }

TEST(MpiLowLatencyMode, Fp8DispatchMatchesTheThreadsBackend) {
  run_case({.name = "fp8", .H = 256, .fp8 = true, .zero_token_rank = 0});
}

TEST(MpiLowLatencyMode, Fp8Ue8m0RoundedScalesWithAPartialGroupMatchTheThreadsBackend) {
  run_case({.name = "fp8 ue8m0", .experts_per_rank = 4, .K = 5,
            .H = 2880, .tmax = 5, .fp8 = true, .round_scale = true, .ue8m0 = true,
            .rounds = 2});
}

TEST(MpiLowLatencyMode, Nvfp4DispatchMatchesTheThreadsBackend) {
  run_case({.name = "nvfp4", .H = 256, .tmax = 40, .nvfp4 = true, .zero_token_rank = 0});
  run_case({.name = "nvfp4 hooks", .experts_per_rank = 3, .H = 2880, .tmax = 5, .nvfp4 = true, .hook = true,
            .rounds = 2});
}

TEST(MpiLowLatencyMode, RecvHooksAndAZeroTokenRankMatchTheThreadsBackend) {
  run_case({.name = "hooks", .experts_per_rank = 3, .K = 4, .hook = true, .zero_token_rank = world_size() - 1,
            .rounds = 4});
}

TEST(MpiLowLatencyMode, OverlappedCombinesWaitingOnHostSignalsMatchTheThreadsBackend) {
  run_case({.name = "overlap blocks", .zero_token_rank = 0, .overlap = 1});
  run_case({.name = "overlap experts hooks", .experts_per_rank = 3, .K = 1, .hook = true, .overlap = 2});
}

/// A bf16 dispatch of T random tokens (rank_rng stream `stream`) to the case's experts, for a test to edit; `keep`
/// owns the tensors.
LowLatencyDispatchArgs random_dispatch(std::uint64_t seed, std::uint64_t stream, std::int64_t T,
                                       const LowLatencyCase& c, RankInput& keep) {
  const int R = world_size();
  auto rng = rank_rng(seed, world_rank(), stream);
  keep.x = random_bf16(rng, T, c.H);
  keep.topk_idx = random_topk_idx(rng, T, c.K, c.experts_per_rank * R);
  LowLatencyDispatchArgs a;
  a.x = keep.x;
  a.topk_idx = keep.topk_idx;
  a.num_max_dispatch_tokens_per_rank = c.tmax;
  a.num_experts = c.experts_per_rank * R;
  a.use_fp8 = false;
  return a;
}

TEST(MpiLowLatencyMode, TooManyTokensAreRejectedOnEveryRankAndTheBufferStillWorks) {
  const std::uint64_t seed = shared_seed();
  LowLatencyCase c{.name = "T > Tmax", .rounds = 1};
  Buffer buffer(test_group());
  RankInput keep;
  const LowLatencyDispatchArgs a = random_dispatch(seed, 7, c.tmax + 1, c, keep);
  auto e = catch_error([&] { buffer.low_latency_dispatch(a); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument);
  EXPECT_NE(std::string(e->what()).find(std::to_string(c.tmax)), std::string::npos) << e->what();
  // Nothing was sent: the same buffer runs a valid call next.
  const auto rounds = run_rank(buffer, seed, c);
  EXPECT_EQ(rounds.size(), 1u);
  MPI_Barrier(MPI_COMM_WORLD);
}

// Routing edge cases: a rank whose ids are all -1 (it sends nothing, its combine is +0), one expert taking every token
// of every rank at T = Tmax (R * Tmax rows: its slab's capacity), and T = Tmax exactly on every rank.
TEST(MpiLowLatencyMode, EdgeRoutingMatchesTheThreadsBackendAndTheReference) {
  run_case({.name = "a rank of -1 ids", .K = 4, .all_minus_one_rank = world_size() - 1});
  run_case({.name = "one expert takes every token", .fp8 = true, .only_expert = 1, .full_batch = true, .rounds = 2});
  run_case({.name = "T = Tmax", .experts_per_rank = 3, .K = 5, .tmax = 7, .hook = true, .full_batch = true});
}

// Settings fixed by the first low-latency call are compared across ranks: one rank's other value is a rank_mismatch
// on every rank, never a hang.
TEST(MpiLowLatencyMode, TmaxOrExpertsDifferingOnOneRankIsAMismatchOnEveryRank) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size();
  const LowLatencyCase c{.name = "first-call mismatch"};
  struct Edit {
    const char* setting;
    void (*apply)(LowLatencyDispatchArgs&);
  };
  const Edit edits[] = {
      {"num_max_dispatch_tokens_per_rank", [](LowLatencyDispatchArgs& a) { a.num_max_dispatch_tokens_per_rank += 4; }},
      {"num_experts", [](LowLatencyDispatchArgs& a) { a.num_experts *= 2; }},  // the ids stay valid for both
  };
  for (const Edit& edit : edits) {
    SCOPED_TRACE(edit.setting);
    Buffer buffer(test_group());
    RankInput keep;
    LowLatencyDispatchArgs a = random_dispatch(seed, 8, 2, c, keep);
    if (world_rank() == R - 1) edit.apply(a);
    auto e = catch_error([&] { buffer.low_latency_dispatch(a); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->code(), ErrorCode::rank_mismatch) << e->what();
    EXPECT_NE(std::string(e->what()).find(edit.setting), std::string::npos) << e->what();
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// Ids outside [-1, E) on every rank (a different one on each) are refused before sending, naming topk_idx and the
// value; nothing was sent, so the same buffer then runs a valid round, checked against the reference.
TEST(MpiLowLatencyMode, OutOfRangeIdsAreRejectedOnEveryRankAndTheBufferStillWorks) {
  const std::uint64_t seed = shared_seed();
  const LowLatencyCase c{.name = "bad ids", .rounds = 1};
  const int E = c.experts_per_rank * world_size();
  Buffer buffer(test_group());
  RankInput keep;
  const LowLatencyDispatchArgs a = random_dispatch(seed, 9, 2, c, keep);
  const std::int64_t bad = world_rank() % 2 == 0 ? E : -2;
  keep.topk_idx.ptr<std::int64_t>()[c.K + 1] = bad;  // token 1, k = 1
  auto e = catch_error([&] { buffer.low_latency_dispatch(a); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument) << e->what();
  const std::string what = e->what();
  EXPECT_TRUE(what.find("topk_idx") != std::string::npos && what.find(std::to_string(bad)) != std::string::npos)
      << what;
  expect_reference(seed, c, run_rank(buffer, seed, c));
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace epmoe::test
