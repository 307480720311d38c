// `epmoe bench`: dispatch and combine timed over a sweep of T (powers of two), beside a floor that moves
// the same bytes without epmoe (GPU: cudaMemcpyPeerAsync, every direction at once; CPU: memcpy on every
// rank at once) and, on GPUs when NCCL is there, an NCCL all-to-all-v of the same rows.
// `epmoe tune`: the same normal-mode measurement on the GPUs for each num_sms of a list; writes the best
// BufferOptions tunables as JSON (buffer.hpp: apply_buffer_config_json).
//
// Method (as bench/gpu_normal_mode.cpp): per op, `warmup` untimed runs then `runs` timed ones; a run is
// a barrier of all ranks then one call, timed on each rank (GPU: CUDA events on the caller's stream around
// the call, after an L2 flush and a device synchronisation; CPU: wall clock); a run's time is the
// slowest rank's; the median over runs is reported.
// Remote bytes: what crosses ranks, all ranks and directions together, counted as the payload rows:
//   normal dispatch: per (token, other rank it goes to) one row of x (bf16 2H, or fp8 H + 4 ceil(H/128)
//     scale bytes) + K int64 ids + K f32 weights + an int32 source index (the cuda_ipc layout);
//   normal combine: per such row 2H (bf16 x back);
//   low-latency dispatch: per (token, other rank) the x row (bf16 or fp8 + scales);
//   low-latency combine: per (token, k) pair whose expert is on another rank, 2H.
// GB/s = remote bytes / median time (aggregate over ranks). The JSON also has DeepEP's "logical" figure for
// normal mode: every received x row, local ones included (2H, or H for fp8), / R / time (per rank). The floor and NCCL move exactly the bytes each
// rank sends to each other rank in the op (NCCL: remote chunks only; the local rows are not part of it).
#include <epmoe/buffer.hpp>
#include <epmoe/group.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/version.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <set>

#include "commands.hpp"
#include "common.hpp"
#include "nccl.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace epmoe::cli {
namespace {

// The largest T bench sweeps (2^20 tokens per rank).
constexpr std::int64_t kMaxSweepTokens = std::int64_t{1} << 20;

struct BenchConfig {
  std::int64_t tokens_min = 1, tokens_max = 16384, ll_tokens_max = 128, hidden = 7168;
  int topk = 8, experts = 256, runs = 50, warmup = 5, ranks = 2;
  bool ranks_given = false, experts_given = false;
  std::string device = "auto", json, config, modes = "normal,low-latency";
  std::uint64_t seed = 0;  // 0: a fresh seed, printed
  bool floors = true;
  // tune
  std::int64_t tokens = 4096;
  std::string sms_list = "4,8,12,16,20,24,32", chunks_list, objective = "max", dispatch_dtype = "bf16", output = "epmoe_tune.json";
  // resolved
  DeviceKind kind = DeviceKind::cpu;
  BufferOptions options;
};

struct Sample {
  std::string mode, op;
  std::int64_t tokens = 0;
  int num_sms = 0;
  double median_us = 0, min_us = 0, remote_bytes = 0;
  double logical_bytes = -1;  // normal mode: DeepEP's count (received x rows of every rank, local ones included)
  int ranks = 1;
  double floor_us = -1, nccl_us = -1;  // < 0: not measured
};

double gbps(double bytes, double us) { return us > 0 ? bytes / us / 1e3 : 0.0; }

// Bytes of one row of `op` (see the header comment).
double row_bytes(std::string_view op, std::int64_t H, int K) {
  const double G = static_cast<double>(num_scale_groups(H)), h = static_cast<double>(H), meta = 12.0 * K + 4;
  if (op == "dispatch_bf16") return 2 * h + meta;
  if (op == "dispatch_fp8") return h + 4 * G + meta;
  if (op == "ll_dispatch_fp8") return h + 4 * G;
  return 2 * h;  // combine_bf16, ll_dispatch_bf16, ll_combine_bf16
}
bool per_pair(std::string_view op) { return op == "ll_combine_bf16"; }

// Per destination rank: rows (a token counts once per rank) and (token, k) pairs of this rank's routing.
struct Counts {
  std::vector<std::int64_t> rows, pairs;
};
Counts count_routing(const Tensor& topk_idx, int E, int R) {
  const std::int64_t T = topk_idx.size(0), K = topk_idx.size(1);
  const int E_local = E / R;
  Counts c{std::vector<std::int64_t>(static_cast<std::size_t>(R)), std::vector<std::int64_t>(static_cast<std::size_t>(R))};
  std::vector<char> seen(static_cast<std::size_t>(R));
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = topk_idx.ptr<std::int64_t>()[t * K + k];
      if (e < 0) continue;
      const auto d = static_cast<std::size_t>(e / E_local);
      ++c.pairs[d];
      if (!seen[d]) ++c.rows[d], seen[d] = 1;
    }
  }
  return c;
}

// What a rank needs of every rank's counts: its own row (what it sends to each destination), the totals over
// all ranks (remote rows, remote pairs, every row), and, only when `full` (GPU ranks: few of them), the whole
// [source][destination] matrix. The CPU path keeps O(R) per rank: the full matrix on every thread rank was
// 16 R^2 bytes per rank, R^3 in all (1000 ranks: 16 GB before the library allocated anything).
struct Matrix {
  int R = 0, me = 0;
  Counts mine;                             // this rank's row: rows/pairs to each destination
  std::vector<std::int64_t> rows, pairs;   // full only: R x R, [source][destination]
  double remote_rows = 0, remote_pairs = 0, all_rows = 0;  // summed over every source (remote: other ranks)
  // Units of `op` (rows or pairs) that source s sends to destination d (s == me unless gathered in full).
  std::int64_t units(std::string_view op, int s, int d) const {
    if (s == me) return (per_pair(op) ? mine.pairs : mine.rows)[static_cast<std::size_t>(d)];
    EPMOE_ASSERT(!rows.empty());
    return (per_pair(op) ? pairs : rows)[static_cast<std::size_t>(s * R + d)];
  }
  // DeepEP's "logical" bytes of a normal-mode op: every received x row (local ones included), x only.
  double logical_bytes(std::string_view op, std::int64_t H) const {
    return op.rfind("ll_", 0) == 0 ? -1.0 : all_rows * static_cast<double>(op == "dispatch_fp8" ? H : 2 * H);
  }
  double remote_units(std::string_view op) const { return per_pair(op) ? remote_pairs : remote_rows; }
};
Matrix gather_counts(Group& g, const Counts& mine, bool full) {
  const int R = g.size(), me = g.rank();
  Matrix m;
  m.R = R;
  m.me = me;
  m.mine = mine;
  std::int64_t sums[3] = {0, 0, 0};  // remote rows, remote pairs, all rows of this rank
  for (int d = 0; d < R; ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (d != me) sums[0] += mine.rows[i], sums[1] += mine.pairs[i];
    sums[2] += mine.rows[i];
  }
  std::vector<std::int64_t> all_sums(3 * static_cast<std::size_t>(R));
  g.all_gather(sums, all_sums.data(), sizeof(sums), "bench.counts");
  std::int64_t total[3] = {0, 0, 0};
  for (int s = 0; s < R; ++s)
    for (int k = 0; k < 3; ++k) total[k] += all_sums[static_cast<std::size_t>(3 * s + k)];
  m.remote_rows = static_cast<double>(total[0]);
  m.remote_pairs = static_cast<double>(total[1]);
  m.all_rows = static_cast<double>(total[2]);
  if (!full) return m;
  std::vector<std::int64_t> send(mine.rows);
  send.insert(send.end(), mine.pairs.begin(), mine.pairs.end());
  std::vector<std::int64_t> all(send.size() * static_cast<std::size_t>(R));
  g.all_gather(send.data(), all.data(), send.size() * sizeof(std::int64_t), "bench.counts");
  for (int s = 0; s < R; ++s) {
    const auto* p = all.data() + static_cast<std::size_t>(s) * send.size();
    m.rows.insert(m.rows.end(), p, p + R);
    m.pairs.insert(m.pairs.end(), p + R, p + 2 * R);
  }
  return m;
}

// The slowest rank per run, then the median (and min) over runs, on every rank.
class Collector {
 public:
  explicit Collector(int R) : t_(static_cast<std::size_t>(R)) {}
  std::pair<double, double> reduce(Group& g, std::vector<double> mine) {
    t_[static_cast<std::size_t>(g.rank())] = std::move(mine);
    g.barrier("bench.collect");
    std::vector<double> slow(t_[0].size(), 0.0);
    for (const auto& v : t_)
      for (std::size_t i = 0; i < slow.size() && i < v.size(); ++i) slow[i] = std::max(slow[i], v[i]);
    g.barrier("bench.collected");  // no rank overwrites its entry before every rank has read them all
    return {median(slow), slow.empty() ? 0.0 : *std::min_element(slow.begin(), slow.end())};
  }

 private:
  std::vector<std::vector<double>> t_;
};

// Deterministic host inputs of rank r at T.
struct HostInputs {
  Tensor x, topk_idx, topk_weights;
};
HostInputs host_inputs(const BenchConfig& c, std::uint64_t seed, int r, std::int64_t T) {
  const std::uint64_t id = static_cast<std::uint64_t>(r) * 1000003ull + static_cast<std::uint64_t>(T);
  HostInputs in;
  in.x = Tensor::empty(DType::bf16, {T, c.hidden});
  fill_bf16(in.x.ptr<bf16_t>(), T * c.hidden, seed, id, 1.0f);
  in.topk_idx = random_topk(T, c.topk, c.experts, seed ^ (id * 0x9E3779B97F4A7C15ull));
  in.topk_weights = Tensor::empty(DType::fp32, {T, c.topk});
  std::mt19937_64 rng(seed + id);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int64_t i = 0; i < in.topk_weights.numel(); ++i) in.topk_weights.ptr<float>()[i] = u(rng);
  return in;
}

std::vector<std::int64_t> sweep(const BenchConfig& c) {
  std::vector<std::int64_t> Ts;
  for (std::int64_t t = 1; t <= c.tokens_max; t *= 2)
    if (t >= c.tokens_min) Ts.push_back(t);
  return Ts;
}

void print_header() {
  fmt::print("{:>6} {:<16} {:>11} {:>11} {:>9} | {:>10} {:>9} {:>8} | {:>10} {:>9}\n", "T", "op", "median us", "remote MB",
             "GB/s", "floor us", "GB/s", "of floor", "nccl us", "GB/s");
}
void print_sample(const Sample& s) {
  const double g = gbps(s.remote_bytes, s.median_us);
  const std::string floor =
      s.floor_us >= 0 ? fmt::format("{:>10.2f} {:>9.1f} {:>7.0f}%", s.floor_us, gbps(s.remote_bytes, s.floor_us),
                                    s.median_us > 0 ? 100.0 * s.floor_us / s.median_us : 0.0)
                      : fmt::format("{:>10} {:>9} {:>8}", "-", "-", "-");
  const std::string nccl = s.nccl_us >= 0 ? fmt::format("{:>10.2f} {:>9.1f}", s.nccl_us, gbps(s.remote_bytes, s.nccl_us))
                                          : fmt::format("{:>10} {:>9}", "-", "-");
  fmt::print("{:>6} {:<16} {:>11.2f} {:>11.3f} {:>9.1f} | {} | {}\n", s.tokens, s.op, s.median_us, s.remote_bytes / 1e6, g,
             floor, nccl);
  std::fflush(stdout);
}

nlohmann::json sample_json(const Sample& s) {
  nlohmann::json j = {{"mode", s.mode},
                      {"op", s.op},
                      {"tokens", s.tokens},
                      {"num_sms", s.num_sms},
                      {"median_us", s.median_us},
                      {"min_us", s.min_us},
                      {"remote_bytes", s.remote_bytes},
                      {"gb_per_s", gbps(s.remote_bytes, s.median_us)}};
  j["logical_bytes"] = s.logical_bytes >= 0 ? nlohmann::json(s.logical_bytes) : nlohmann::json(nullptr);
  j["logical_gb_per_s_per_rank"] =
      s.logical_bytes >= 0 ? nlohmann::json(gbps(s.logical_bytes, s.median_us) / s.ranks) : nlohmann::json(nullptr);
  j["floor_us"] = s.floor_us >= 0 ? nlohmann::json(s.floor_us) : nlohmann::json(nullptr);
  j["floor_gb_per_s"] = s.floor_us >= 0 ? nlohmann::json(gbps(s.remote_bytes, s.floor_us)) : nlohmann::json(nullptr);
  j["nccl_us"] = s.nccl_us >= 0 ? nlohmann::json(s.nccl_us) : nlohmann::json(nullptr);
  j["nccl_gb_per_s"] = s.nccl_us >= 0 ? nlohmann::json(gbps(s.remote_bytes, s.nccl_us)) : nlohmann::json(nullptr);
  return j;
}

void write_json(const std::string& path, const nlohmann::json& j, std::string_view flag) {
  write_text_file(flag, path, j.dump(2) + "\n");
}

// ---------------------------------------------------------------------------------------------- CPU ranks

void cpu_rank(const std::shared_ptr<Group>& g, const BenchConfig& c, std::uint64_t seed, Collector& col,
              const std::function<void(const Sample&)>& emit) {
  const int R = g->size(), r = g->rank();
  const bool normal = c.modes.find("normal") != std::string::npos;
  const bool ll = c.modes.find("low-latency") != std::string::npos && c.topk <= kLowLatencyMaxTopk;
  const std::vector<std::int64_t> Ts = sweep(c);
  for (std::size_t i = 0; i < Ts.size(); ++i) {
    const std::int64_t T = Ts[i];
    const auto t_start = Clock::now();
    if (r == 0) fmt::print(stderr, "[{}/{}] T={}: ", i + 1, Ts.size(), T);
    // Rows go to stdout once this T's progress line (stderr) has ended, as on GPUs: on a terminal a row printed
    // between two op names of the progress line would share its line.
    std::vector<Sample> measured;
    const HostInputs in = host_inputs(c, seed, r, T);
    const Matrix m = gather_counts(*g, count_routing(in.topk_idx, c.experts, R), false);

    // Floor: this rank's remote bytes of the op, memcpy'd while every other rank does the same.
    double floor_bytes = 0;
    for (const char* op : {"dispatch_bf16", "ll_combine_bf16"}) {  // the largest row op and the pair op
      double mine = 0;
      for (int d = 0; d < R; ++d)
        if (d != r) mine += static_cast<double>(m.units(op, r, d)) * row_bytes(op, c.hidden, c.topk);
      floor_bytes = std::max(floor_bytes, mine);
    }
    std::vector<char> src(c.floors ? static_cast<std::size_t>(floor_bytes) + 64 : 0, 1), dst(src.size(), 0);
    auto timed = [&](const std::function<void()>& setup, const std::function<void()>& fn) {
      std::vector<double> us;
      for (int k = 0; k < c.warmup + c.runs; ++k) {
        if (setup) setup();
        g->barrier("bench.run");
        const auto t0 = Clock::now();
        fn();
        if (k >= c.warmup) us.push_back(seconds_since(t0) * 1e6);
      }
      return col.reduce(*g, std::move(us));
    };
    auto measure = [&](const char* mode, const char* op, const std::function<void()>& setup, const std::function<void()>& fn) {
      Sample s;
      s.mode = mode;
      s.op = op;
      s.tokens = T;
      std::tie(s.median_us, s.min_us) = timed(setup, fn);
      s.remote_bytes = m.remote_units(op) * row_bytes(op, c.hidden, c.topk);
      s.logical_bytes = m.logical_bytes(op, c.hidden);
      s.ranks = R;
      if (c.floors) {
        double mine = 0;
        for (int d = 0; d < R; ++d)
          if (d != r) mine += static_cast<double>(m.units(op, r, d)) * row_bytes(op, c.hidden, c.topk);
        const auto bytes = std::min(src.size(), static_cast<std::size_t>(mine));
        s.floor_us = timed({}, [&] { std::memcpy(dst.data(), src.data(), bytes); }).first;
      }
      if (r == 0) {
        fmt::print(stderr, "{} ", op);
        measured.push_back(s);
      }
    };

    if (normal) {
      Buffer buf(g, c.options);
      const DispatchLayout layout = buf.get_dispatch_layout(in.topk_idx, c.experts);
      const Fp8Tensor q = quantize_fp8(in.x);
      DispatchArgs a = make_dispatch_args(layout, in.x, in.topk_idx, in.topk_weights);
      DispatchResult keep, last;  // cleared before each run, so freeing outputs is not timed
      CombineResult last_combine;
      measure("normal", "dispatch_bf16", [&] { keep = {}; }, [&] { keep = buf.dispatch(a); });
      DispatchArgs a8 = a;
      a8.x = q.data;
      a8.x_scales = q.scales;
      measure("normal", "dispatch_fp8", [&] { last = {}; }, [&] { last = buf.dispatch(a8); });
      last = {};
      Tensor cx = Tensor::empty(DType::bf16, {keep.handle.num_recv_rows, c.hidden});
      fill_bf16(cx.ptr<bf16_t>(), cx.numel(), seed, 7, 1.0f);
      CombineArgs ca;
      ca.x = cx;
      ca.handle = &keep.handle;
      measure("normal", "combine_bf16", [&] { last_combine = {}; }, [&] { last_combine = buf.combine(ca); });
    }
    if (ll && T <= c.ll_tokens_max) {
      BufferOptions lo = c.options;
      lo.low_latency_mode = true;
      lo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(static_cast<int>(T), c.hidden, R, c.experts);
      Buffer buf(g, lo);
      LowLatencyDispatchArgs la;
      la.x = in.x;
      la.topk_idx = in.topk_idx;
      la.topk_weights = in.topk_weights;
      la.num_max_dispatch_tokens_per_rank = static_cast<int>(T);
      la.num_experts = c.experts;
      la.use_fp8 = false;
      measure("low-latency", "ll_dispatch_bf16", {}, [&] { buf.low_latency_dispatch(la); });
      LowLatencyDispatchArgs la8 = la;
      la8.use_fp8 = true;
      measure("low-latency", "ll_dispatch_fp8", {}, [&] { buf.low_latency_dispatch(la8); });
      // Each combine needs a handle from the call just before it (two-buffer rule): an untimed dispatch.
      LowLatencyDispatchResult d;
      LowLatencyCombineArgs ca;
      measure(
          "low-latency", "ll_combine_bf16",
          [&] {
            d = buf.low_latency_dispatch(la);
            ca.x = d.packed_recv_x;
            ca.topk_idx = in.topk_idx;
            ca.topk_weights = in.topk_weights;
            ca.handle = &d.handle;
          },
          [&] { buf.low_latency_combine(ca); });
    }
    if (r == 0) {
      fmt::print(stderr, "({:.1f} s)\n", seconds_since(t_start));
      for (const Sample& s : measured) emit(s);
    }
  }
}

// ---------------------------------------------------------------------------------------------- GPU ranks

#if defined(EPMOE_HAVE_CUDA)

// Per rank, for the whole command: events, an L2 flush buffer, peer streams, NCCL.
struct GpuContext {
  int device = 0;
  cudaEvent_t start = nullptr, stop = nullptr, fork = nullptr;
  std::vector<cudaStream_t> streams;  // one per peer: the peer copies of a rank run at once
  std::vector<cudaEvent_t> joins;
  void* flush = nullptr;
  std::size_t flush_bytes = std::size_t{256} << 20;
  std::unique_ptr<NcclComm> nccl;

  GpuContext(Group& g, bool want_nccl) : device(g.rank()) {
    cuda_set_device(device);
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    cuda_check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
    for (int p = 0; p < g.size(); ++p) {
      cudaStream_t s = nullptr;
      cudaEvent_t e = nullptr;
      cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      streams.push_back(s);
      joins.push_back(e);
      if (p != device) {
        const cudaError_t pe = cudaDeviceEnablePeerAccess(p, 0);
        if (pe != cudaSuccess && pe != cudaErrorPeerAccessAlreadyEnabled) cuda_check(pe, "cudaDeviceEnablePeerAccess");
        cudaGetLastError();
      }
    }
    cuda_check(cudaMalloc(&flush, flush_bytes), "cudaMalloc (L2 flush)");
    if (want_nccl && nccl_available()) nccl = std::make_unique<NcclComm>(g);
  }
  ~GpuContext() {
    cudaDeviceSynchronize();
    nccl.reset();
    for (auto s : streams) cudaStreamDestroy(s);
    for (auto e : joins) cudaEventDestroy(e);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaEventDestroy(fork);
    cudaFree(flush);
  }
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;
};

// Device memory freed at scope exit.
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(std::size_t n) { cuda_check(cudaMalloc(&p, std::max<std::size_t>(n, 256)), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// What the ops of one gpu_point share: the timing loop, the floor buffers and the samples made.
class GpuPoint {
 public:
  GpuPoint(Group& g, GpuContext& ctx, const BenchConfig& c, const Matrix& m, std::int64_t T,
           const std::vector<std::string>& ops, bool floors, Collector& col, bool progress)
      : g_(g), ctx_(ctx), c_(c), m_(m), ops_(ops), floors_(floors), col_(col), progress_(progress) {
    const int R = g.size();
    any_ll_ = std::any_of(ops.begin(), ops.end(), [](const std::string& op) { return op.rfind("ll_", 0) == 0; });
    // Floor buffers: chunk p of src goes to rank p; chunk s of each rank's dst receives from rank s.
    // (a low-latency combine sends up to K rows per token to a rank: one per (token, k) pair)
    const double per_token = std::max(row_bytes("dispatch_bf16", c.hidden, c.topk),
                                      any_ll_ ? c.topk * row_bytes("ll_combine_bf16", c.hidden, c.topk) : 0.0);
    chunk_ = static_cast<std::size_t>(static_cast<double>(T) * per_token) + 256;
    dsts_.resize(static_cast<std::size_t>(R));
    if (floors) {
      src_.emplace(chunk_ * static_cast<std::size_t>(R));
      dst_.emplace(chunk_ * static_cast<std::size_t>(R));
      cuda_check(cudaMemset(src_->p, 1, chunk_ * static_cast<std::size_t>(R)), "cudaMemset");
      void* mine = dst_->p;
      g.all_gather(&mine, dsts_.data(), sizeof(void*), "bench.floor_buffers");
    }
  }

  bool want(std::string_view op) const { return std::find(ops_.begin(), ops_.end(), op) != ops_.end(); }
  bool any_ll() const { return any_ll_; }

  // (median, min) over the runs of the slowest rank's time of `fn`. `setup` runs untimed before each run: it
  // releases the previous run's outputs, so freeing them is not part of the next call's time.
  std::pair<double, double> timed(const std::function<void()>& fn, const std::function<void()>& setup = {}) {
    std::vector<double> us;
    for (int k = 0; k < c_.warmup + c_.runs; ++k) {
      if (setup) setup();
      cuda_check(cudaMemsetAsync(ctx_.flush, k & 0xff, ctx_.flush_bytes, nullptr), "L2 flush");
      cuda_sync_device();
      g_.barrier("bench.run");
      cuda_check(cudaEventRecord(ctx_.start, nullptr), "cudaEventRecord");
      fn();
      cuda_check(cudaEventRecord(ctx_.stop, nullptr), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(ctx_.stop), "cudaEventSynchronize");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, ctx_.start, ctx_.stop), "cudaEventElapsedTime");
      if (k >= c_.warmup) us.push_back(ms * 1000.0);
    }
    return col_.reduce(g_, std::move(us));
  }

  // A measured op's bytes and, with floors, the peer copies and NCCL moving the same bytes; then the sample.
  void finish(Sample& s) {
    const int R = g_.size(), r = g_.rank();
    const double rb = row_bytes(s.op, c_.hidden, c_.topk);
    s.remote_bytes = m_.remote_units(s.op) * rb;
    s.logical_bytes = m_.logical_bytes(s.op, c_.hidden);
    s.ranks = R;
    if (floors_) {
      std::vector<std::size_t> send(static_cast<std::size_t>(R)), recv(send.size()), off(send.size());
      // Bytes of `op` from rank `from` to rank `to`, at most a chunk.
      const auto bytes = [&](int from, int to) {
        return std::min(chunk_, static_cast<std::size_t>(static_cast<double>(m_.units(s.op, from, to)) * rb));
      };
      for (int p = 0; p < R; ++p) {
        const auto q = static_cast<std::size_t>(p);
        off[q] = q * chunk_;
        send[q] = p == r ? 0 : bytes(r, p);
        recv[q] = p == r ? 0 : bytes(p, r);
      }
      s.floor_us = timed([&] { peer_copies(send, off); }).first;
      if (ctx_.nccl)
        s.nccl_us = timed([&] { ctx_.nccl->all_to_all_v(src_->p, send, off, dst_->p, recv, off, nullptr); }).first;
    }
    if (progress_ && r == 0) fmt::print(stderr, "{} ", s.op);
    out_.push_back(s);
  }

  std::vector<Sample> take_samples() { return std::move(out_); }

 private:
  // Peer copies, every direction at once: one stream per peer, forked from and joined to the caller's.
  void peer_copies(const std::vector<std::size_t>& send, const std::vector<std::size_t>& off) {
    const int R = g_.size(), r = g_.rank();
    cuda_check(cudaEventRecord(ctx_.fork, nullptr), "cudaEventRecord");
    for (int p = 0; p < R; ++p) {
      const auto q = static_cast<std::size_t>(p);
      if (send[q] == 0) continue;
      cuda_check(cudaStreamWaitEvent(ctx_.streams[q], ctx_.fork, 0), "cudaStreamWaitEvent");
      cuda_check(cudaMemcpyPeerAsync(static_cast<char*>(dsts_[q]) + static_cast<std::size_t>(r) * chunk_, p,
                                     static_cast<char*>(src_->p) + off[q], ctx_.device, send[q], ctx_.streams[q]),
                 "cudaMemcpyPeerAsync");
      cuda_check(cudaEventRecord(ctx_.joins[q], ctx_.streams[q]), "cudaEventRecord");
      cuda_check(cudaStreamWaitEvent(nullptr, ctx_.joins[q], 0), "cudaStreamWaitEvent");
    }
  }

  Group& g_;
  GpuContext& ctx_;
  const BenchConfig& c_;
  const Matrix& m_;
  const std::vector<std::string>& ops_;
  bool floors_, any_ll_ = false;
  Collector& col_;
  bool progress_;
  std::size_t chunk_ = 0;
  std::optional<DeviceBytes> src_, dst_;
  std::vector<void*> dsts_;
  std::vector<Sample> out_;
};

// Normal mode of a gpu_point: dispatch_bf16 (also run, untimed in the results, to make combine_bf16's handle),
// dispatch_fp8 and combine_bf16, those of the point's ops.
void measure_normal_ops(GpuPoint& point, Buffer& buf, const DispatchArgs& a, const Fp8Tensor& q, const BenchConfig& c,
                        std::uint64_t seed, int rank, int dev, std::int64_t T, int num_sms) {
  DispatchResult keep, last;
  CombineResult last_combine;
  Tensor cx;
  for (const char* op : {"dispatch_bf16", "dispatch_fp8", "combine_bf16"}) {
    if (!point.want(op) && !(std::string_view(op) == "dispatch_bf16" && point.want("combine_bf16"))) continue;
    Sample s;
    s.mode = "normal";
    s.op = op;
    s.tokens = T;
    s.num_sms = num_sms;
    if (std::string_view(op) == "dispatch_bf16") {
      std::tie(s.median_us, s.min_us) = point.timed([&] { keep = buf.dispatch(a); }, [&] { keep = {}; });
    } else if (std::string_view(op) == "dispatch_fp8") {
      DispatchArgs a8 = a;
      a8.x = q.data;
      a8.x_scales = q.scales;
      std::tie(s.median_us, s.min_us) = point.timed([&] { last = buf.dispatch(a8); }, [&] { last = {}; });
      last = {};
    } else {
      Tensor hx = Tensor::empty(DType::bf16, {keep.handle.num_recv_rows, c.hidden});
      fill_bf16(hx.ptr<bf16_t>(), hx.numel(), seed, 11 + static_cast<std::uint64_t>(rank), 1.0f);
      cx = to_device(hx, dev);
      CombineArgs ca;
      ca.x = cx;
      ca.handle = &keep.handle;
      std::tie(s.median_us, s.min_us) =
          point.timed([&] { last_combine = buf.combine(ca); }, [&] { last_combine = {}; });
      last_combine = {};
    }
    if (!point.want(op)) continue;  // dispatch_bf16 ran only to make the combine's handle
    point.finish(s);
  }
}

// Low-latency mode of a gpu_point: its own buffer (Tmax = T). debug_validate off: it copies topk_idx to the host
// on each call.
void measure_low_latency_ops(GpuPoint& point, const std::shared_ptr<Group>& gp, const BenchConfig& c,
                             const BufferOptions& options, std::uint64_t seed, int dev, std::int64_t T,
                             const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights) {
  const int R = gp->size(), r = gp->rank();
  BufferOptions lo = options;
  lo.backend = Backend::cuda_ipc;
  lo.device = dev;
  lo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, c.hidden, R, 1);  // normal mode unused
  lo.low_latency_mode = true;
  lo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(static_cast<int>(T), c.hidden, R, c.experts);
  lo.debug_validate = false;
  Buffer llbuf(gp, lo);
  LowLatencyDispatchArgs la;
  la.x = x;
  la.topk_idx = topk_idx;
  la.topk_weights = topk_weights;
  la.num_max_dispatch_tokens_per_rank = static_cast<int>(T);
  la.num_experts = c.experts;
  Tensor ll_x;  // combine input [E_local, R*T, H]
  LowLatencyDispatchResult ld;
  for (const char* op : {"ll_dispatch_fp8", "ll_dispatch_bf16", "ll_combine_bf16"}) {
    if (!point.want(op)) continue;
    Sample s;
    s.mode = "low-latency";
    s.op = op;
    s.tokens = T;
    s.num_sms = options.num_sms;
    if (std::string_view(op) != "ll_combine_bf16") {
      la.use_fp8 = std::string_view(op) == "ll_dispatch_fp8";
      std::tie(s.median_us, s.min_us) = point.timed([&] { llbuf.low_latency_dispatch(la); });
    } else {
      la.use_fp8 = false;
      if (!ll_x.defined()) {
        Tensor hx = Tensor::empty(DType::bf16, {c.experts / R, R * T, c.hidden});
        fill_bf16(hx.ptr<bf16_t>(), hx.numel(), seed, 13 + static_cast<std::uint64_t>(r), 1.0f);
        ll_x = to_device(hx, dev);
      }
      LowLatencyCombineArgs lc;
      lc.x = ll_x;
      lc.topk_idx = topk_idx;
      lc.topk_weights = topk_weights;
      // Each run combines the handle of a dispatch made (untimed) just before it.
      std::tie(s.median_us, s.min_us) = point.timed(
          [&] {
            lc.handle = &ld.handle;
            llbuf.low_latency_combine(lc);
          },
          [&] { ld = llbuf.low_latency_dispatch(la); });
    }
    point.finish(s);
  }
  cuda_sync_device();
}

// One point on the GPUs at T with `options`: the ops of `ops` (normal mode: dispatch_bf16, dispatch_fp8,
// combine_bf16; low-latency mode, Tmax = T: ll_dispatch_fp8, ll_dispatch_bf16, ll_combine_bf16), each with floors
// (peer copies, NCCL) of its bytes when `floors`. Collective; returns the samples on every rank.
std::vector<Sample> gpu_point(Group& g, const std::shared_ptr<Group>& gp, GpuContext& ctx, const BenchConfig& c,
                              std::uint64_t seed, std::int64_t T, const BufferOptions& options,
                              const std::vector<std::string>& ops, bool floors, Collector& col, bool progress) {
  const int R = g.size(), r = g.rank(), dev = ctx.device;
  const HostInputs hin = host_inputs(c, seed, r, T);
  const Matrix m = gather_counts(g, count_routing(hin.topk_idx, c.experts, R), true);
  BufferOptions bo = options;
  bo.backend = Backend::cuda_ipc;
  bo.device = dev;
  bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(T, c.hidden, R, c.topk);
  Buffer buf(gp, bo);
  const Tensor x = to_device(hin.x, dev), topk_idx = to_device(hin.topk_idx, dev),
               topk_weights = to_device(hin.topk_weights, dev);
  const Fp8Tensor q = quantize_fp8(x);
  const DispatchLayout layout = buf.get_dispatch_layout(topk_idx, c.experts);
  cuda_sync_device();

  GpuPoint point(g, ctx, c, m, T, ops, floors, col, progress);
  measure_normal_ops(point, buf, make_dispatch_args(layout, x, topk_idx, topk_weights), q, c, seed, r, dev, T,
                     options.num_sms);
  if (point.any_ll()) measure_low_latency_ops(point, gp, c, options, seed, dev, T, x, topk_idx, topk_weights);
  cuda_sync_device();
  g.barrier("bench.point_done");  // every rank done with the peers' floor buffers before they are freed
  return point.take_samples();
}

void gpu_bench_rank(const std::shared_ptr<Group>& g, const BenchConfig& c, std::uint64_t seed, Collector& col,
                    const std::function<void(const Sample&)>& emit) {
  GpuContext ctx(*g, c.floors);
  const bool normal = c.modes.find("normal") != std::string::npos;
  const bool ll = c.modes.find("low-latency") != std::string::npos && c.topk <= kLowLatencyMaxTopk;
  const std::vector<std::int64_t> Ts = sweep(c);
  for (std::size_t i = 0; i < Ts.size(); ++i) {
    std::vector<std::string> ops;
    if (normal) ops = {"dispatch_bf16", "dispatch_fp8", "combine_bf16"};
    if (ll && Ts[i] <= c.ll_tokens_max) ops.insert(ops.end(), {"ll_dispatch_fp8", "ll_dispatch_bf16", "ll_combine_bf16"});
    if (ops.empty()) continue;
    const auto t0 = Clock::now();
    if (g->rank() == 0) fmt::print(stderr, "[{}/{}] T={}: ", i + 1, Ts.size(), Ts[i]);
    const auto samples = gpu_point(*g, g, ctx, c, seed, Ts[i], c.options, ops, c.floors, col, true);
    if (g->rank() == 0) {
      fmt::print(stderr, "({:.1f} s)\n", seconds_since(t0));
      for (const auto& s : samples) emit(s);
    }
  }
}

#endif  // EPMOE_HAVE_CUDA

// ---------------------------------------------------------------------------------------------- commands

std::uint64_t fresh_seed(std::uint64_t s) {
  return s != 0 ? s : (static_cast<std::uint64_t>(std::random_device{}()) << 32 | std::random_device{}()) | 1;
}

void check_shape(const BenchConfig& c, int R) {
  if (c.hidden < 16 || c.hidden % 16 != 0) bad("--hidden", "a positive multiple of 16", c.hidden);
  if (c.experts < 1) bad("--experts", ">= 1", c.experts);
  if (c.experts % R != 0) {
    // --ranks typed beside the default --experts: the ranks are what was asked (as `run` names them)
    if (c.ranks_given && !c.experts_given)
      bad("--ranks", fmt::format("a divisor of --experts ({}, its default)", c.experts), R);
    bad("--experts", fmt::format("a multiple of the {} ranks", R), c.experts);
  }
  if (c.experts / R > 1024) bad("--experts", fmt::format("at most 1024 per rank ({})", plural(R, "rank")), c.experts);
  if (c.topk < 1 || c.topk > std::min(kNormalMaxTopk, c.experts))
    bad("--topk", fmt::format("in [1, {}]", std::min(kNormalMaxTopk, c.experts)), c.topk);
  if (c.runs < 1) bad("--runs", ">= 1", c.runs);
  if (c.warmup < 0) bad("--warmup", ">= 0", c.warmup);
}

int gpu_ranks(const BenchConfig& c) {
  const int n = cuda_device_count();
  if (!c.ranks_given) return n;
  if (c.ranks < 1 || c.ranks > n) bad("--ranks", fmt::format("in [1, {}] (one rank per visible GPU)", n), c.ranks);
  return c.ranks;
}

/// --modes as a set: every piece between commas, the last one too (getline dropped a trailing empty piece: "normal,"
/// passed), each once ("normal,normal" passed as normal). Errors: invalid_argument naming --modes.
std::set<std::string> parse_modes(const std::string& text) {
  std::set<std::string> modes;
  for (std::size_t from = 0;;) {
    const std::size_t comma = text.find(',', from);
    const std::string m = text.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    if ((m != "normal" && m != "low-latency") || !modes.insert(m).second)
      bad("--modes", "a comma-separated subset of normal,low-latency, each once", as_typed(text));
    if (comma == std::string::npos) return modes;
    from = comma + 1;
  }
}

int bench(BenchConfig c) {
  const std::set<std::string> modes = parse_modes(c.modes);
  if (modes.size() == 1 && modes.count("low-latency") && c.topk > kLowLatencyMaxTopk)
    bad("--topk", fmt::format("in [1, {}] with --modes low-latency", kLowLatencyMaxTopk), c.topk);
  c.kind = resolve_device(c.device);
  apply_config_flag(c.config, c.options);
  const int R = c.kind == DeviceKind::cuda ? gpu_ranks(c) : c.ranks;
  if (R < 1) bad("--ranks", ">= 1", R);
  c.ranks = R;
  check_shape(c, R);
  // The sweep's T are powers of two: bounds that are not one are refused, not narrowed to the powers between them.
  const auto power_of_two = [](std::int64_t t) { return t >= 1 && (t & (t - 1)) == 0; };
  const std::string powers = "a power of two (1, 2, 4, ...: the T bench sweeps)";
  if (!power_of_two(c.tokens_min)) bad("--tokens-min", powers, c.tokens_min);
  if (c.tokens_max < c.tokens_min || c.tokens_max > kMaxSweepTokens)
    bad("--tokens-max", fmt::format("in [--tokens-min ({}), {}]", c.tokens_min, kMaxSweepTokens), c.tokens_max);
  if (!power_of_two(c.tokens_max)) bad("--tokens-max", powers, c.tokens_max);
  if (c.ll_tokens_max < 1) bad("--ll-tokens-max", ">= 1", c.ll_tokens_max);
  if (modes.size() == 1 && modes.count("low-latency") && sweep(c).front() > c.ll_tokens_max)
    bad("--ll-tokens-max",
        fmt::format(">= the sweep's smallest T ({}, from --tokens-min) with --modes low-latency: nothing to measure",
                    sweep(c).front()),
        c.ll_tokens_max);
  if (c.kind == DeviceKind::cpu) {
    // Roughly, per rank at the largest T: its tokens, the rows it may receive (R x T) and the combine output;
    // normal mode's count exchange and two live handles (bf16 and fp8 dispatch), which grow with R^2 per rank
    // (threads_normal_bytes_per_rank); the low-latency window at the largest low-latency T (what bench
    // allocates: get_low_latency_rdma_size_hint, which holds E_local x R x T rows and an R x T staging area).
    const double row = 2.0 * static_cast<double>(c.hidden);
    const std::int64_t t_max = sweep(c).back();
    double normal = 0, ll = 0;
    if (modes.count("normal"))
      normal = R * ((2.0 + 2.0 * R) * static_cast<double>(t_max) * row + threads_normal_bytes_per_rank(R, t_max, 2));
    std::int64_t t_ll = 0;
    for (const std::int64_t t : sweep(c))
      if (t <= c.ll_tokens_max) t_ll = t;
    if (modes.count("low-latency") && c.topk <= kLowLatencyMaxTopk && t_ll > 0)
      // Infinite past the library's limit (R x Tmax >= 2^31) or past 64-bit counts, never a wrapped-around figure.
      ll = R * low_latency_window_estimate(t_ll, c.hidden, R, c.experts);
    check_host_memory(normal + ll,
                      ll > 0 ? "--ranks/--tokens-max/--ll-tokens-max/--hidden/--experts"
                             : "--ranks/--tokens-max/--hidden",
                      fmt::format("{} at T = {}: normal mode {}, low-latency {}", plural(R, "CPU rank"), t_max,
                                  gib(normal), gib(ll)));
  }
  if (!c.json.empty()) check_writable("--json", c.json);
  const std::uint64_t seed = fresh_seed(c.seed);
  const bool gpu = c.kind == DeviceKind::cuda;
  const std::string nccl = gpu ? nccl_status() : "n/a on CPU ranks";

  fmt::print("epmoe {} bench: {} ({}), H={}, K={}, E={}, T in {}..{} (powers of two), {} after {} warm-up, seed {}\n",
             version(), plural(R, gpu ? "GPU rank" : "CPU rank"),
             gpu ? fmt::format("cuda_ipc, {} x {}", R, device_name(0)) : "threads; " + cpu_ranks_reason(c.device),
             c.hidden, c.topk, c.experts, sweep(c).front(), sweep(c).back(), plural(c.runs, "run"), c.warmup, seed);
  fmt::print("floor: {}; nccl: {}; buffer config: {}\n",
             !c.floors ? "off (--no-floors)"
             : gpu     ? "cudaMemcpyPeerAsync of the same bytes, every direction at once"
                       : "memcpy of the same bytes on every rank at once",
             c.floors ? nccl : std::string("off (--no-floors)"), nlohmann::json::parse(buffer_config_json(c.options)).dump());
  if (modes.count("low-latency")) {
    if (c.topk > kLowLatencyMaxTopk)
      fmt::print("low-latency: skipped (K = {} > {})\n", c.topk, kLowLatencyMaxTopk);
    else
      fmt::print("low-latency: T <= {} (--ll-tokens-max; its buffers grow with E_local * R * T * H)\n", c.ll_tokens_max);
  }
  print_header();

  nlohmann::json j = {{"command", "bench"},
                      {"version", std::string(version())},
                      {"device", gpu ? "cuda" : "cpu"},
                      {"device_name", device_name(gpu ? 0 : -1)},
                      {"transport", gpu ? "cuda_ipc" : "threads"},
                      {"ranks", R},
                      {"hidden", c.hidden},
                      {"num_topk", c.topk},
                      {"num_experts", c.experts},
                      {"runs", c.runs},
                      {"warmup", c.warmup},
                      {"seed", seed},
                      {"routing", "uniform random top-K of E per token"},
                      {"buffer_config", nlohmann::json::parse(buffer_config_json(c.options))},
                      {"floor", gpu ? "peer_copy" : "memcpy"},
                      {"nccl", nccl},
                      {"gb_per_s", "remote bytes (all ranks, all directions) / median time"},
                      {"results", nlohmann::json::array()}};
  std::mutex mutex;
  auto emit = [&](const Sample& s) {
    std::lock_guard<std::mutex> lock(mutex);
    print_sample(s);
    j["results"].push_back(sample_json(s));
    if (!c.json.empty()) write_json(c.json, j, "--json");  // after every point, so a cut-short run keeps its figures
  };
  BenchConfig run_c = c;
  if (!modes.count("normal")) run_c.modes = "low-latency";
  if (!modes.count("low-latency")) run_c.modes = "normal";
  Collector col(R);
  if (gpu) {
#if defined(EPMOE_HAVE_CUDA)
    launch_ranks(R, [&](const std::shared_ptr<Group>& g) { gpu_bench_rank(g, run_c, seed, col, emit); });
#endif
  } else {
    launch_ranks(R, [&](const std::shared_ptr<Group>& g) { cpu_rank(g, run_c, seed, col, emit); });
  }
  if (!c.json.empty()) {
    write_json(c.json, j, "--json");
    fmt::print("wrote {}\n", c.json);
  }
  return 0;
}

int tune(BenchConfig c) {
  auto parse_list = [](std::string_view flag, const std::string& text, int lo, int hi) {
    std::vector<int> out;
    const std::string expected = fmt::format("a comma-separated list of integers in [{}, {}], each once", lo, hi);
    // Each item decimal as typed, as integer options are ("0x10", " 8" and an empty item such as "8,," or "8," are
    // refused; std::stoi would skip blanks and stop at the "x" or a trailing comma).
    for (std::size_t start = 0;;) {
      const std::size_t comma = std::min(text.find(',', start), text.size());
      const std::string v = text.substr(start, comma - start);
      const bool decimal = decimal_integer_error(v).empty();
      const long long n = decimal ? std::strtoll(v.c_str(), nullptr, 10) : -1;  // past 64 bits: saturated, refused
      // A value twice would time the same point twice (as --modes, refused rather than deduplicated).
      if (!decimal || n < lo || n > hi || std::find(out.begin(), out.end(), n) != out.end())
        bad(flag, expected, as_typed(text));
      out.push_back(static_cast<int>(n));
      if (comma == text.size()) break;
      start = comma + 1;
    }
    return out;
  };
  const std::vector<int> sms = parse_list("--sms", c.sms_list, 1, 64);
  // num_chunks (copy-engine pipeline stages) is swept only when asked; else the config's value is kept.
  const std::vector<int> chunks = c.chunks_list.empty() ? std::vector<int>{-1} : parse_list("--chunks", c.chunks_list, 1, 16);
  std::vector<std::pair<int, int>> points;
  for (int s : sms)
    for (int ch : chunks) points.emplace_back(s, ch);
  if (c.objective != "max" && c.objective != "sum" && c.objective != "dispatch" && c.objective != "combine")
    bad("--objective", "max, sum, dispatch or combine", as_typed(c.objective));
  // Flags are checked before looking for GPUs, so a bad value is named on any machine.
  if (c.tokens < 1) bad("--tokens", ">= 1", c.tokens);
  check_writable("--output", c.output);
  std::string why;
  if (c.device == "cpu")
    bad("--device", "auto or cuda (tune sweeps the cuda_ipc backend's num_sms and num_chunks on GPUs)", c.device);
  // Said of the machine, not of --device: without the flag its default (auto) is nothing the user chose.
  if (cuda_device_count(&why) == 0)
    throw Error(ErrorCode::unsupported, fmt::format("epmoe: tune needs a CUDA GPU (it sweeps the cuda_ipc backend's "
                                                    "num_sms and num_chunks); {}",
                                                    why));
  c.kind = DeviceKind::cuda;
  apply_config_flag(c.config, c.options);
  const int R = gpu_ranks(c);
  c.ranks = R;
  check_shape(c, R);
  const std::uint64_t seed = fresh_seed(c.seed);
  const std::string dop = c.dispatch_dtype == "fp8" ? "dispatch_fp8" : "dispatch_bf16";
  fmt::print("epmoe {} tune: {} ({} x {}), T={} H={} K={} E={}, num_sms in {{{}}}{}, objective {} of {} and combine, "
             "{} after {} warm-up, seed {}\n",
             version(), plural(R, "GPU rank"), R, device_name(0), c.tokens, c.hidden, c.topk, c.experts, c.sms_list,
             c.chunks_list.empty() ? "" : fmt::format(", num_chunks in {{{}}}", c.chunks_list), c.objective, dop,
             plural(c.runs, "run"), c.warmup, seed);
  struct Row {
    int sms, chunks;  // chunks -1: not swept
    double dispatch_us, combine_us, objective;
  };
  std::vector<Row> rows;
#if defined(EPMOE_HAVE_CUDA)
  Collector col(R);
  launch_ranks(R, [&](const std::shared_ptr<Group>& g) {
    GpuContext ctx(*g, false);
    for (std::size_t i = 0; i < points.size(); ++i) {
      const auto [sm, ch] = points[i];
      const auto t0 = Clock::now();
      if (g->rank() == 0)
        fmt::print(stderr, "[{}/{}] num_sms={}{}: ", i + 1, points.size(), sm, ch < 0 ? "" : fmt::format(" num_chunks={}", ch));
      BufferOptions o = c.options;
      o.num_sms = sm;
      if (ch >= 0) o.num_chunks = ch;
      const auto samples = gpu_point(*g, g, ctx, c, seed, c.tokens, o, {dop, "combine_bf16"}, false, col, true);
      if (g->rank() == 0) {
        Row row{sm, ch, 0, 0, 0};
        for (const auto& s : samples) (s.op == dop ? row.dispatch_us : row.combine_us) = s.median_us;
        row.objective = c.objective == "max"        ? std::max(row.dispatch_us, row.combine_us)
                        : c.objective == "sum"      ? row.dispatch_us + row.combine_us
                        : c.objective == "dispatch" ? row.dispatch_us
                                                    : row.combine_us;
        rows.push_back(row);
        fmt::print(stderr, "({:.1f} s)\n", seconds_since(t0));
      }
    }
  });
#endif
  if (rows.empty()) throw Error(ErrorCode::internal, "epmoe: tune: no measurement was made");
  const auto best = std::min_element(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.objective < b.objective; });
  fmt::print("\n{:>8} {:>10} {:>14} {:>14} {:>14}\n", "num_sms", "num_chunks", fmt::format("{} us", dop), "combine us",
             c.objective + " us");
  for (const auto& row : rows)
    fmt::print("{:>8} {:>10} {:>14.1f} {:>14.1f} {:>14.1f}{}\n", row.sms, row.chunks < 0 ? std::string("-") : std::to_string(row.chunks),
               row.dispatch_us, row.combine_us, row.objective, &row == &*best ? "  <- best" : "");
  BufferOptions chosen = c.options;
  chosen.num_sms = best->sms;
  if (best->chunks >= 0) chosen.num_chunks = best->chunks;
  nlohmann::json j = nlohmann::json::parse(buffer_config_json(chosen));
  nlohmann::json tried = nlohmann::json::array();
  for (const auto& row : rows) {
    nlohmann::json t = {{"num_sms", row.sms}, {dop + "_us", row.dispatch_us}, {"combine_bf16_us", row.combine_us},
                        {"objective_us", row.objective}};
    if (row.chunks >= 0) t["num_chunks"] = row.chunks;
    tried.push_back(t);
  }
  j["_tune"] = {{"version", std::string(version())}, {"device_name", device_name(0)}, {"ranks", R}, {"tokens", c.tokens},
                {"hidden", c.hidden}, {"num_topk", c.topk}, {"num_experts", c.experts}, {"runs", c.runs}, {"seed", seed},
                {"objective", c.objective}, {"dispatch", dop}, {"results", tried}};
  write_json(c.output, j, "--output");
  fmt::print("best num_sms = {}{} ({} {:.1f} us); wrote {}\n", best->sms,
             best->chunks < 0 ? "" : fmt::format(", num_chunks = {}", best->chunks), c.objective, best->objective, c.output);
  return 0;
}

void add_shape_options(CLI::App* cmd, BenchConfig& c, const std::string& ranks_help) {
  at_least(16, cmd->add_option("--hidden", c.hidden, "hidden size H"))->capture_default_str();
  // The most the normal dispatch takes (check_shape holds it to --experts, bench to --modes too).
  in_range(1, kNormalMaxTopk, cmd->add_option("-k,--topk", c.topk, "experts per token K"))->capture_default_str();
  at_least(1, cmd->add_option("-e,--experts", c.experts, "experts E (a multiple of the ranks)"))->capture_default_str();
  at_least(1, cmd->add_option("--runs", c.runs, "timed runs per point (median reported)"))->capture_default_str();
  at_least(0, cmd->add_option("--warmup", c.warmup, "untimed runs before them"))->capture_default_str();
  at_least(1, cmd->add_option("--ranks", c.ranks, ranks_help))->capture_default_str();
  cmd->add_option("--seed", c.seed, "seed of inputs and routing (0: a fresh one, printed)")
      ->check(non_negative_integer())
      ->capture_default_str();
  cmd->add_option("--config", c.config,
                  "a JSON file of BufferOptions tunables (what `epmoe tune` writes), e.g. containing {\"num_sms\": 16}")
      ->type_name("FILE")
      ->check(non_empty_path());
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  auto config = std::make_shared<BenchConfig>();
  auto& c = *config;
  CLI::App* cmd = app.add_subcommand(
      "bench", "Time dispatch and combine over T = powers of two, beside a peer-copy (or memcpy) floor and NCCL");
  in_range(1, kMaxSweepTokens,
           cmd->add_option("--tokens-min", c.tokens_min, "smallest T (tokens per rank; a power of two)"))
      ->capture_default_str();
  in_range(1, kMaxSweepTokens, cmd->add_option("--tokens-max", c.tokens_max, "largest T (a power of two)"))
      ->capture_default_str();
  at_least(1, cmd->add_option("--ll-tokens-max", c.ll_tokens_max,
                              "largest T of the low-latency sweep (any T >= 1: it runs the sweep's powers of two up to "
                              "it)"))
      ->capture_default_str();
  cmd->add_option("--modes", c.modes, "normal,low-latency or one of them")->capture_default_str();
  cmd->add_option("--device", c.device, "auto (all local GPUs when CUDA devices exist, else CPU ranks), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  // A callback, not CLI11's negated flag ("!--no-floors"), whose help would read "--no-floors{false}".
  cmd->add_flag_callback("--no-floors", [&c] { c.floors = false; }, "skip the peer-copy/memcpy floors and NCCL");
  cmd->add_option("--json", c.json, "write the results as JSON (scripts/plot_bench.py plots it)")
      ->type_name("PATH")
      ->check(non_empty_path());
  add_shape_options(cmd, c,
                    "ranks (on CPU: threads of this process; on GPUs: default all visible GPUs, one rank each)");
  return [config, cmd] {
    config->ranks_given = cmd->count("--ranks") > 0;
    config->experts_given = cmd->count("--experts") > 0;
    return bench(*config);
  };
}

std::function<int()> add_tune_command(CLI::App& app) {
  auto config = std::make_shared<BenchConfig>();
  auto& c = *config;
  c.runs = 20;
  CLI::App* cmd = app.add_subcommand("tune", "Sweep num_sms of the cuda_ipc backend on the GPUs and write the best config JSON");
  at_least(1, cmd->add_option("-t,--tokens", c.tokens, "tokens per rank T"))->capture_default_str();
  cmd->add_option("--sms", c.sms_list, "num_sms values to try (comma-separated)")->capture_default_str();
  cmd->add_option("--chunks", c.chunks_list, "also sweep num_chunks (copy-engine pipeline stages, 1..16), e.g. 2,4,8");
  cmd->add_option("--objective", c.objective, "max (of dispatch and combine), sum, dispatch or combine")->capture_default_str();
  cmd->add_option("--dispatch-dtype", c.dispatch_dtype, "bf16 or fp8")->check(CLI::IsMember({"bf16", "fp8"}))->capture_default_str();
  cmd->add_option("-o,--output", c.output, "where to write the best config")
      ->type_name("PATH")
      ->check(non_empty_path())
      ->capture_default_str();
  // tune runs on GPUs only: the help offers auto and cuda; cpu is still accepted here so that tune() refuses it
  // with the reason (num_sms is a GPU setting) instead of CLI11's bare "not in" message.
  const CLI::Validator gpu_device(
      [](std::string& v) {
        return v == "auto" || v == "cuda" || v == "cpu" ? std::string()
                                                         : "expected auto or cuda, got " + as_typed(v);
      },
      "{auto,cuda}");
  cmd->add_option("--device", c.device, "auto or cuda (tune runs on GPUs only: num_sms is a GPU setting)")
      ->check(gpu_device)
      ->capture_default_str();
  add_shape_options(cmd, c, "GPU ranks, one per GPU (default: all visible GPUs)");
  cmd->get_option("--ranks")->default_str("");  // bench's CPU default (2) means nothing here
  return [config, cmd] {
    config->ranks_given = cmd->count("--ranks") > 0;
    config->experts_given = cmd->count("--experts") > 0;
    return tune(*config);
  };
}

}  // namespace epmoe::cli
