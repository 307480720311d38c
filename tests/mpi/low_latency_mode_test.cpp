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
  const std::int64_t T = rank == c.zero_token_rank ? 0 : 1 + static_cast<std::int64_t>(rng() % c.tmax);
  RankInput in;
  in.x = random_bf16(rng, T, c.H, 3.0f);
  RoutingOptions o;
  o.p_minus_one = 0.1;
  in.topk_idx = random_topk_idx(rng, T, c.K, c.experts_per_rank * R, o);
  in.topk_weights = random_topk_weights(rng, in.topk_idx);
  return in;
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

    auto rng = rank_rng(seed, me, 100 + static_cast<std::uint64_t>(round));
    const std::int64_t rows = static_cast<std::int64_t>(R) * c.tmax;
    Tensor flat = random_bf16(rng, c.experts_per_rank * rows, c.H, 2.0f);
    LowLatencyCombineArgs ca;
    ca.x = TensorView(flat.data(), DType::bf16, {c.experts_per_rank, rows, c.H});
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

TEST(MpiLowLatencyMode, TooManyTokensAreRejectedOnEveryRankAndTheBufferStillWorks) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size();
  LowLatencyCase c{.name = "T > Tmax", .rounds = 1};
  Buffer buffer(test_group());
  auto rng = rank_rng(seed, world_rank(), 7);
  const Tensor x = random_bf16(rng, c.tmax + 1, c.H);
  const Tensor idx = random_topk_idx(rng, c.tmax + 1, c.K, c.experts_per_rank * R);
  LowLatencyDispatchArgs a;
  a.x = x;
  a.topk_idx = idx;
  a.num_max_dispatch_tokens_per_rank = c.tmax;
  a.num_experts = c.experts_per_rank * R;
  a.use_fp8 = false;
  auto e = catch_error([&] { buffer.low_latency_dispatch(a); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument);
  EXPECT_NE(std::string(e->what()).find(std::to_string(c.tmax)), std::string::npos) << e->what();
  // Nothing was sent: the same buffer runs a valid call next.
  const auto rounds = run_rank(buffer, seed, c);
  EXPECT_EQ(rounds.size(), 1u);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiLowLatencyMode, TmaxDifferingOnOneRankIsAMismatchOnEveryRank) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size();
  LowLatencyCase c{.name = "Tmax mismatch"};
  Buffer buffer(test_group());
  auto rng = rank_rng(seed, world_rank(), 8);
  const Tensor x = random_bf16(rng, 2, c.H);
  const Tensor idx = random_topk_idx(rng, 2, c.K, c.experts_per_rank * R);
  LowLatencyDispatchArgs a;
  a.x = x;
  a.topk_idx = idx;
  a.num_max_dispatch_tokens_per_rank = world_rank() == R - 1 ? c.tmax + 4 : c.tmax;
  a.num_experts = c.experts_per_rank * R;
  a.use_fp8 = false;
  auto e = catch_error([&] { buffer.low_latency_dispatch(a); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::rank_mismatch) << e->what();
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace epmoe::test
