// MPI backend bandwidth: epmoe's exchange primitive (and dispatch/combine when the modes exist) next
// to a plain MPI_Alltoallv of the same bytes, in one run.
//
//   mpirun --oversubscribe -np 4 build/<dir>/bench/bench_mpi_alltoall [--benchmark_filter=...]
//
// Shapes (args T, H): T tokens per rank, bf16 rows of H, K = 8 of E = 256 experts routed uniformly at
// random (fresh routing per rank, fixed for the run). A token goes once to every rank owning one of
// its experts, as in normal-mode dispatch. Every benchmark runs a fixed number of iterations on every
// rank (so the collectives stay matched); the time of an iteration is the slowest rank's.
// Counters, per rank: logical_GBps = received row bytes (own rows included, DeepEP's convention) per
// second; remote_GBps = the bytes that came from other ranks per second.
// BM_threads_normal_mode: the same dispatch/combine on the threads backend (R threads inside rank 0).
// BM_low_latency: T = Tmax = 128 per rank, the decode shape; dispatch (bf16 or fp8) and combine.
#include <benchmark/benchmark.h>

#include <cstdio>

#if defined(EPMOE_HAVE_MPI)

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/mpi.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "transport/cpu/transport.hpp"

namespace {

using epmoe::RowBlock;

constexpr int kTopK = 8;
constexpr int kExperts = 256;
constexpr int kIterations = 10;

int world_rank() {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// One rank's inputs: bf16 x [T, H] (random bits of finite values), topk_idx [T, K], and the token
/// lists per destination rank.
struct Inputs {
  std::int64_t T = 0, H = 0;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk_idx;
  std::vector<float> topk_weights;
  std::vector<std::vector<std::int32_t>> tokens_to;  // [R] ascending token ids
  std::int64_t rows_sent = 0, rows_received = 0, remote_rows_received = 0;
};

/// Rank `me`'s inputs out of R ranks, without the receive counts (no MPI): the threads-backend
/// benchmark rebuilds every rank's inputs in one process from this.
Inputs make_rank_inputs(std::int64_t T, std::int64_t H, int me, int R) {
  Inputs in;
  in.T = T;
  in.H = H;
  std::mt19937_64 rng(0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(me + 1));
  in.x.resize(static_cast<std::size_t>(T * H));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : in.x) {
    const float f = u(rng);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<std::uint16_t>(bits >> 16);
  }
  in.topk_idx.resize(static_cast<std::size_t>(T * kTopK));
  in.topk_weights.resize(static_cast<std::size_t>(T * kTopK));
  in.tokens_to.assign(static_cast<std::size_t>(R), {});
  std::vector<int> ids(kExperts);
  for (int e = 0; e < kExperts; ++e) ids[static_cast<std::size_t>(e)] = e;
  const int per_rank = kExperts / R;
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<bool> to(static_cast<std::size_t>(R), false);
    for (int k = 0; k < kTopK; ++k) {
      std::uniform_int_distribution<int> d(k, kExperts - 1);
      std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(d(rng))]);
      const int e = ids[static_cast<std::size_t>(k)];
      in.topk_idx[static_cast<std::size_t>(t * kTopK + k)] = e;
      in.topk_weights[static_cast<std::size_t>(t * kTopK + k)] =
          0.05f + 0.9f * static_cast<float>(rng() % 1000) / 1000.0f;
      to[static_cast<std::size_t>(e / per_rank)] = true;
    }
    for (int d = 0; d < R; ++d)
      if (to[static_cast<std::size_t>(d)])
        in.tokens_to[static_cast<std::size_t>(d)].push_back(static_cast<std::int32_t>(t));
  }
  return in;
}

Inputs make_inputs(std::int64_t T, std::int64_t H) {
  const int R = world_size(), me = world_rank();
  Inputs in = make_rank_inputs(T, H, me, R);
  // Rows received: the count from every source (one small all-to-all, outside the timing).
  std::vector<int> send_counts(static_cast<std::size_t>(R)), recv_counts(static_cast<std::size_t>(R));
  for (int d = 0; d < R; ++d) {
    send_counts[static_cast<std::size_t>(d)] = static_cast<int>(in.tokens_to[static_cast<std::size_t>(d)].size());
    in.rows_sent += send_counts[static_cast<std::size_t>(d)];
  }
  MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int s = 0; s < R; ++s) {
    in.rows_received += recv_counts[static_cast<std::size_t>(s)];
    if (s != me) in.remote_rows_received += recv_counts[static_cast<std::size_t>(s)];
  }
  return in;
}

/// Inputs of the last shape, kept between benchmarks of the same shape.
Inputs& inputs_for(std::int64_t T, std::int64_t H) {
  static Inputs cached;
  if (cached.T != T || cached.H != H) {
    cached = Inputs{};
    cached = make_inputs(T, H);
  }
  return cached;
}

/// Times `fn` over the iterations of `state`: each iteration starts together (a barrier, untimed) and
/// counts as long as the slowest rank took.
template <class Fn>
void time_iterations(benchmark::State& state, Fn&& fn) {
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    fn();
    double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    state.SetIterationTime(slowest);
  }
}

void set_counters(benchmark::State& state, double logical_bytes, double remote_bytes) {
  state.counters["R"] = world_size();
  constexpr auto rate = benchmark::Counter::kIsIterationInvariantRate;
  state.counters["logical_GBps"] = benchmark::Counter(logical_bytes / 1e9, rate);
  state.counters["remote_GBps"] = benchmark::Counter(remote_bytes / 1e9, rate);
  state.counters["MB_per_rank"] = logical_bytes / 1e6;
}

/// The floor: MPI_Alltoallv of the rows, already packed per destination, into a contiguous buffer.
void BM_plain_alltoallv(benchmark::State& state) {
  const Inputs& in = inputs_for(state.range(0), state.range(1));
  const int R = world_size(), me = world_rank();
  const std::size_t row_bytes = static_cast<std::size_t>(in.H) * 2;
  std::vector<int> send_counts(static_cast<std::size_t>(R)), send_displs(static_cast<std::size_t>(R)),
      recv_counts(static_cast<std::size_t>(R)), recv_displs(static_cast<std::size_t>(R));
  int offset = 0;
  for (int d = 0; d < R; ++d) {
    send_counts[static_cast<std::size_t>(d)] = static_cast<int>(in.tokens_to[static_cast<std::size_t>(d)].size());
    send_displs[static_cast<std::size_t>(d)] = offset;
    offset += send_counts[static_cast<std::size_t>(d)];
  }
  MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  offset = 0;
  for (int s = 0; s < R; ++s) {
    recv_displs[static_cast<std::size_t>(s)] = offset;
    offset += recv_counts[static_cast<std::size_t>(s)];
  }
  std::vector<std::byte> send(static_cast<std::size_t>(in.rows_sent) * row_bytes),
      recv(static_cast<std::size_t>(offset) * row_bytes);
  std::size_t at = 0;
  for (int d = 0; d < R; ++d)
    for (const std::int32_t t : in.tokens_to[static_cast<std::size_t>(d)]) {
      std::memcpy(send.data() + at, in.x.data() + static_cast<std::size_t>(t * in.H), row_bytes);
      at += row_bytes;
    }
  std::memset(recv.data(), 0, recv.size());
  MPI_Datatype row;
  MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  time_iterations(state, [&] {
    MPI_Alltoallv(send.data(), send_counts.data(), send_displs.data(), row, recv.data(), recv_counts.data(),
                  recv_displs.data(), row, MPI_COMM_WORLD);
  });
  MPI_Type_free(&row);
  (void)me;
  set_counters(state, static_cast<double>(in.rows_received) * static_cast<double>(row_bytes),
               static_cast<double>(in.remote_rows_received) * static_cast<double>(row_bytes));
}

/// epmoe's exchange of the same rows, offered as indexed blocks straight from x (one field), including
/// the count exchange and end_exchange. strategy: 0 = pack indexed rows, 1 = hindexed datatype.
void BM_exchange(benchmark::State& state) {
  const Inputs& in = inputs_for(state.range(0), state.range(1));
  const int R = world_size();
  auto group = epmoe::make_mpi_group();
  auto transport = epmoe::make_mpi_transport(group, /*pack_rows=*/state.range(2) == 0);
  const std::size_t row_bytes = static_cast<std::size_t>(in.H) * 2;
  std::vector<RowBlock> offered(static_cast<std::size_t>(R));
  for (int d = 0; d < R; ++d) {
    const auto& tokens = in.tokens_to[static_cast<std::size_t>(d)];
    offered[static_cast<std::size_t>(d)] = RowBlock{reinterpret_cast<const std::byte*>(in.x.data()), row_bytes,
                                                    row_bytes, tokens.data(), static_cast<std::int64_t>(tokens.size())};
  }
  std::int64_t checksum = 0;
  time_iterations(state, [&] {
    const auto received = transport->exchange(offered, 1, "bench exchange");
    checksum += received[0].count;
    transport->end_exchange("bench end_exchange");
  });
  benchmark::DoNotOptimize(checksum);
  set_counters(state, static_cast<double>(in.rows_received) * static_cast<double>(row_bytes),
               static_cast<double>(in.remote_rows_received) * static_cast<double>(row_bytes));
}

/// Normal-mode dispatch (bf16) and combine over the MPI backend. mode: 0 = dispatch, 1 = combine.
void BM_normal_mode(benchmark::State& state) {
  const Inputs& in = inputs_for(state.range(0), state.range(1));
  const std::size_t row_bytes = static_cast<std::size_t>(in.H) * 2;
  auto group = epmoe::make_mpi_group();
  epmoe::Buffer buffer(group);
  epmoe::TensorView x(const_cast<std::uint16_t*>(in.x.data()), epmoe::DType::bf16, {in.T, in.H});
  epmoe::TensorView topk_idx(const_cast<std::int64_t*>(in.topk_idx.data()), epmoe::DType::int64, {in.T, kTopK});
  epmoe::TensorView topk_weights(const_cast<float*>(in.topk_weights.data()), epmoe::DType::fp32, {in.T, kTopK});
  try {
    const epmoe::DispatchLayout layout = buffer.get_dispatch_layout(topk_idx, kExperts);
    const epmoe::DispatchArgs args = epmoe::make_dispatch_args(layout, x, topk_idx, topk_weights);
    epmoe::DispatchResult result = buffer.dispatch(args);
    if (state.range(2) == 0) {
      time_iterations(state, [&] { result = buffer.dispatch(args); });
    } else {
      epmoe::CombineArgs cargs;
      cargs.x = result.recv_x;
      cargs.handle = &result.handle;
      epmoe::CombineResult combined;
      time_iterations(state, [&] { combined = buffer.combine(cargs); });
      benchmark::DoNotOptimize(combined.combined_x.data());
    }
  } catch (const epmoe::Error& e) {
    state.SkipWithError(e.what());  // every rank throws alike (e.g. the mode is not implemented yet)
    return;
  }
  set_counters(state, static_cast<double>(in.rows_received) * static_cast<double>(row_bytes),
               static_cast<double>(in.remote_rows_received) * static_cast<double>(row_bytes));
}

/// The same dispatch/combine on the threads backend, in the same run: MPI rank 0 runs R thread ranks,
/// thread r with MPI rank r's inputs; the other processes wait. mode: 0 = dispatch, 1 = combine.
void BM_threads_normal_mode(benchmark::State& state) {
  const std::int64_t T = state.range(0), H = state.range(1);
  const int R = world_size();
  const std::size_t iters = static_cast<std::size_t>(state.max_iterations);
  std::vector<double> seconds(iters, 0.0);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(R), 0), remote(static_cast<std::size_t>(R), 0);
  if (world_rank() == 0) {
    std::mutex mutex;
    epmoe::run_thread_ranks(R, [&](epmoe::Group& g) {
      const int r = g.rank();
      const Inputs in = make_rank_inputs(T, H, r, R);
      std::shared_ptr<epmoe::Group> group(std::shared_ptr<epmoe::Group>{}, &g);
      epmoe::Buffer buffer(group);
      epmoe::TensorView x(const_cast<std::uint16_t*>(in.x.data()), epmoe::DType::bf16, {T, H});
      epmoe::TensorView topk_idx(const_cast<std::int64_t*>(in.topk_idx.data()), epmoe::DType::int64, {T, kTopK});
      epmoe::TensorView topk_weights(const_cast<float*>(in.topk_weights.data()), epmoe::DType::fp32, {T, kTopK});
      const epmoe::DispatchLayout layout = buffer.get_dispatch_layout(topk_idx, kExperts);
      const epmoe::DispatchArgs args = epmoe::make_dispatch_args(layout, x, topk_idx, topk_weights);
      epmoe::DispatchResult result = buffer.dispatch(args);  // warm-up (fills the output pool)
      rows[static_cast<std::size_t>(r)] = result.handle.num_recv_tokens;
      const auto* prefix = result.handle.rank_prefix_matrix.ptr<std::int32_t>();  // [s][d], inclusive over s
      const std::int64_t own = prefix[r * R + r] - (r > 0 ? prefix[(r - 1) * R + r] : 0);
      remote[static_cast<std::size_t>(r)] = result.handle.num_recv_tokens - own;
      epmoe::CombineArgs cargs;
      cargs.x = result.recv_x;
      cargs.handle = &result.handle;
      for (std::size_t i = 0; i < iters; ++i) {
        g.barrier("bench threads");
        const auto start = std::chrono::steady_clock::now();
        if (state.range(2) == 0) {
          result = buffer.dispatch(args);
          cargs.x = result.recv_x;
          cargs.handle = &result.handle;
        } else {
          benchmark::DoNotOptimize(buffer.combine(cargs).combined_x.data());
        }
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::lock_guard lock(mutex);
        seconds[i] = std::max(seconds[i], t);
      }
    });
  }
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(std::max(seconds[i++], 1e-9));
  const std::size_t row_bytes = static_cast<std::size_t>(H) * 2;
  set_counters(state, static_cast<double>(rows[0]) * static_cast<double>(row_bytes),
               static_cast<double>(remote[0]) * static_cast<double>(row_bytes));
}

/// Low-latency dispatch (fp8 or bf16) + combine (bf16) over MPI windows, Tmax = T. mode: 0 = dispatch
/// bf16, 1 = dispatch fp8, 2 = combine. Logical bytes: one row per (token, expert) received, as DeepEP
/// counts them; remote: the same for the rows from other ranks.
void BM_low_latency(benchmark::State& state) {
  const Inputs& in = inputs_for(state.range(0), state.range(1));
  const int R = world_size(), me = world_rank();
  auto group = epmoe::make_mpi_group();
  epmoe::Buffer buffer(group);
  epmoe::TensorView x(const_cast<std::uint16_t*>(in.x.data()), epmoe::DType::bf16, {in.T, in.H});
  epmoe::TensorView topk_idx(const_cast<std::int64_t*>(in.topk_idx.data()), epmoe::DType::int64, {in.T, kTopK});
  epmoe::TensorView topk_weights(const_cast<float*>(in.topk_weights.data()), epmoe::DType::fp32, {in.T, kTopK});
  const int mode = static_cast<int>(state.range(2));
  const std::int64_t El = kExperts / R, rows = static_cast<std::int64_t>(R) * in.T;
  std::vector<std::uint16_t> expert_out(static_cast<std::size_t>(El * rows * in.H), 0x3f80);  // 1.0
  // (token, expert) pairs this rank receives, and how many of them come from other ranks.
  std::int64_t pairs = 0, remote_pairs = 0;
  try {
    epmoe::LowLatencyDispatchArgs a;
    a.x = x;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.num_max_dispatch_tokens_per_rank = static_cast<int>(in.T);
    a.num_experts = kExperts;
    a.use_fp8 = mode == 1;
    epmoe::LowLatencyDispatchResult d = buffer.low_latency_dispatch(a);
    for (std::int64_t e = 0; e < El; ++e)
      for (int s = 0; s < R; ++s) {
        const std::int64_t n = d.handle.layout_range.ptr<std::int64_t>()[e * R + s] & 0xffffffff;
        pairs += n;
        if (s != me) remote_pairs += n;
      }
    if (mode < 2) {
      time_iterations(state, [&] { d = buffer.low_latency_dispatch(a); });
    } else {
      epmoe::LowLatencyCombineArgs ca;
      ca.x = epmoe::TensorView(expert_out.data(), epmoe::DType::bf16, {El, rows, in.H});
      ca.topk_idx = topk_idx;
      ca.topk_weights = topk_weights;
      // Each combine consumes a dispatch's handle (two-buffer rule): dispatch untimed, combine timed.
      for (auto _ : state) {
        d = buffer.low_latency_dispatch(a);
        ca.handle = &d.handle;
        MPI_Barrier(MPI_COMM_WORLD);
        const auto start = std::chrono::steady_clock::now();
        epmoe::LowLatencyCombineResult r = buffer.low_latency_combine(ca);
        double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), slowest = 0;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        state.SetIterationTime(slowest);
        benchmark::DoNotOptimize(r.combined_x.data());
      }
    }
  } catch (const epmoe::Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double row = mode == 1 ? static_cast<double>(in.H) * (1.0 + 4.0 / 128.0) : static_cast<double>(in.H) * 2.0;
  set_counters(state, static_cast<double>(pairs) * row, static_cast<double>(remote_pairs) * row);
}

void shapes(benchmark::internal::Benchmark* b, std::vector<std::int64_t> extra) {
  for (const std::int64_t T : {std::int64_t{4096}})
    for (const std::int64_t H : {std::int64_t{7168}, std::int64_t{2048}})
      for (const std::int64_t x : extra) b->Args({T, H, x});
  b->Iterations(kIterations)->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_plain_alltoallv)->ArgNames({"T", "H", "_"})->Apply([](auto* b) { shapes(b, {0}); });
BENCHMARK(BM_exchange)->ArgNames({"T", "H", "datatype"})->Apply([](auto* b) { shapes(b, {0, 1}); });
BENCHMARK(BM_normal_mode)->ArgNames({"T", "H", "combine"})->Apply([](auto* b) { shapes(b, {0, 1}); });
BENCHMARK(BM_threads_normal_mode)->ArgNames({"T", "H", "combine"})->Apply([](auto* b) { shapes(b, {0, 1}); });
BENCHMARK(BM_low_latency)
    ->ArgNames({"T", "H", "mode"})
    ->Args({128, 7168, 0})
    ->Args({128, 7168, 1})
    ->Args({128, 7168, 2})
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

/// Drops every report (ranks other than 0).
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  epmoe::MpiSession mpi(&argc, &argv);
  benchmark::Initialize(&argc, argv);
  if (world_rank() == 0) {
    std::printf("MPI ranks: %d\n", world_size());
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}

#else  // !EPMOE_HAVE_MPI

int main() {
  std::printf("bench_mpi_alltoall: built without MPI, nothing to measure\n");
  return 0;
}

#endif
