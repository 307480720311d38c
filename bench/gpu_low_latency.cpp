// Low-latency dispatch and combine over NVLink (cuda_ipc backend, GPU mode) on R GPUs, DeepEP's decode shapes
// (semantics §12: T=128 tokens per rank, H=7168, K=8, E=256). DeepEP is compared in the same call by
// `scripts/gpu_check.sh anchors` (DeepEP's own test on the same GPU), never against figures typed in here.
//
// One process, one thread per rank, rank r on cuda:r (threads group, peer access); R = every visible GPU (up to 8)
// unless --ranks says otherwise. R = 1 measures the path's fixed cost (no NVLink). Each figure is the median over
// >= 50 runs after 5 warm-up runs; one run = both devices idle and the L2 flushed (256 MiB memset), a host barrier,
// then CUDA events on each rank's caller stream around one Buffer call; the run's time is the slower rank's.
// Routing is fresh uniform random top-K of E for every run set (seed printed); debug_validate is off (it would
// copy topk_idx to the host). Ops:
//  - dispatch_fp8 / dispatch_bf16: one low_latency_dispatch (send + receive);
//  - combine_bf16: one low_latency_combine (a dispatch before it, outside the timed region);
//  - *_send / *_recv (return_recv_hook): the call alone, then, once both ranks' sends are done (device sync and a
//    barrier), the hook alone (as DeepEP measures its hooks);
//  - dispatch_nvfp4: one low_latency_dispatch with use_nvfp4 (x quantized to NVFP4 by the library's CUDA quantizer into
//    the records, then sent; x_global_scale a device tensor as SGLang passes it; H % 64 == 0 only);
//  - dispatch_fp8+combine_graph: one replay of a CUDA graph holding an fp8 dispatch and its combine (captured once;
//    the routing tensor is refilled in place): what a decode step under CUDA graphs pays, without the host's enqueue
//    time that every eager figure above includes (DeepEP's test reports kernel times).
// Remote bytes (all ranks together): what crosses NVLink: dispatch, per (token, other rank it goes to) its 80-byte
// TokenMeta and its record (bf16 row, or fp8 / nvfp4 row + scales, 16-byte aligned), plus a 64-byte header per rank pair;
// combine, one bf16 row per (token, k) routed to another rank, plus the headers. GB/s = remote bytes / R / time (what
// one rank sends; per direction at R = 2).
//
// --no-flush keeps the L2 between runs (the device is still idle before each): the warm case of DeepEP's test,
// whose calls reuse the same buffers; with EPMOE_CUDA_IPC_TRACE=1 it gives the warm breakdown per launch.
//
// Usage: bench_gpu_low_latency [--runs N] [--tokens T] [--hidden H] [--topk K] [--experts E] [--ranks R]
//                              [--no-flush] [--json PATH]
#include "bench_util.hpp"

#if !defined(EPMOE_HAVE_CUDA)
int main() { return epmoe::bench::cpu_only_build("bench_gpu_low_latency"); }
#else

#include <epmoe/buffer.hpp>
#include <epmoe/group.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace {

using namespace epmoe;

constexpr int kWarmup = 5;
constexpr int kMaxRanks = 8;

void check(cudaError_t e, const char* what) { bench::check_cuda("bench_gpu_low_latency", e, what); }

using bench::median;
using bench::splitmix;

/// bf16 in [-2, 2) (finite, non-zero) or float32 weights in (0, 1], on cuda:device.
Tensor random_device(DType dtype, Shape shape, int device, std::uint64_t seed) {
  Tensor h = Tensor::empty(dtype, shape);
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    const std::uint64_t r = splitmix(seed);
    if (dtype == DType::bf16)
      h.ptr<bf16_t>()[i].bits = static_cast<std::uint16_t>((r & 0x807f) | 0x3f00);
    else
      h.ptr<float>()[i] = 0.01f + static_cast<float>(r % 997) / 1000.0f;
  }
  Tensor d = Tensor::empty(dtype, shape, Device::cuda(device));
  check(cudaMemcpy(d.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  bench::OpOptions opt;
  opt.T = 128;
  int ranks = 0;  // 0: every visible GPU, up to kMaxRanks
  bool flush = true;
  for (int i = 1; i < argc; ++i) {
    if (bench::parse_op_option(argc, argv, i, opt)) continue;
    if (!std::strcmp(argv[i], "--no-flush")) {
      flush = false;
      continue;
    }
    if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
      continue;
    }
    std::printf(
        "usage: %s [--runs N] [--tokens T] [--hidden H] [--topk K] [--experts E] [--ranks R] [--no-flush] "
        "[--json PATH]\n",
        argv[0]);
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (ranks == 0) ranks = std::min(devices, kMaxRanks);
  if (ranks < 1 || ranks > kMaxRanks) {
    std::printf("bench_gpu_low_latency: --ranks must be 1..%d, got %d\n", kMaxRanks, ranks);
    return 2;
  }
  const int num_ranks = ranks;
  const int runs = opt.runs, K = opt.K, E = opt.E;
  const std::int64_t T = opt.T, H = opt.H;
  const std::string json_path = opt.json_path;
  if (!bench::have_gpus("bench_gpu_low_latency", std::max(num_ranks, 1))) return 77;
  if (opt.E % num_ranks != 0) {
    std::printf("bench_gpu_low_latency: --experts (%d) must be a multiple of the ranks (%d)\n", opt.E, num_ranks);
    return 2;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::uint64_t seed = bench::run_seed();
  const int tmax = static_cast<int>(T);
  std::printf("bench_gpu_low_latency: %s x%d, T=%lld (Tmax) H=%lld K=%d E=%d, runs=%d, L2 %s, seed %llu\n", prop.name,
              num_ranks, static_cast<long long>(T), static_cast<long long>(H), K, E, runs,
              flush ? "flushed before each run" : "kept (--no-flush)", static_cast<unsigned long long>(seed));

  const char* ops[] = {"dispatch_fp8",      "dispatch_bf16",     "combine_bf16",     "dispatch_fp8_send",
                       "dispatch_fp8_recv", "combine_bf16_send", "combine_bf16_recv", "dispatch_fp8+combine_graph",
                       "dispatch_nvfp4"};
  constexpr int kOps = 9;
  const bool nvfp4 = H % 64 == 0;  // the nvfp4 wire's hidden sizes
  std::vector<std::vector<std::vector<double> > > times(kOps, std::vector<std::vector<double> >(num_ranks));
  // Per rank: (token, other rank) pairs it sends and (token, k) pairs it routes to other ranks, averaged over the
  // routing sets.
  std::vector<double> tokens_to_peer(num_ranks), pairs_to_peer(num_ranks);
  std::mutex mutex;
  const int El = E / num_ranks;
  const std::int64_t G = num_scale_groups(H);

  run_thread_ranks(num_ranks, [&](Group& g) {
    const int r = g.rank();
    check(cudaSetDevice(r), "cudaSetDevice");
    BufferOptions o;
    o.backend = Backend::cuda_ipc;
    o.device = r;
    o.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, H, num_ranks, 1);  // normal mode unused
    o.debug_validate = false;
    Buffer buf(std::shared_ptr<Group>(&g, [](Group*) {}), o);
    const std::uint64_t s = seed + 1000003ull * static_cast<std::uint64_t>(r);
    const Tensor x = random_device(DType::bf16, {T, H}, r, s + 1);
    const Tensor w = random_device(DType::fp32, {T, K}, r, s + 2);
    const Tensor y = random_device(DType::bf16, {El, num_ranks * T, H}, r, s + 3);
    Tensor idx = Tensor::empty(DType::int64, {T, K}, Device::cuda(r));
    // x is in [-2, 2): the producers' global scale 448 * 6 / amax, on the device.
    Tensor gs = Tensor::empty(DType::fp32, Shape{});
    *gs.ptr<float>() = 448.0f * 6.0f / 2.0f;
    Tensor gs_dev = Tensor::empty(DType::fp32, Shape{}, Device::cuda(r));
    check(cudaMemcpy(gs_dev.data(), gs.data(), sizeof(float), cudaMemcpyHostToDevice), "H2D");
    double tokens = 0, pairs = 0, sets = 0;
    auto new_routing = [&](std::uint64_t k) {
      const std::vector<std::int64_t> h = bench::random_topk_ids(T, K, E, s + 100 + k);
      check(cudaMemcpy(idx.data(), h.data(), h.size() * 8, cudaMemcpyHostToDevice), "H2D");
      for (std::int64_t t = 0; t < T; ++t) {
        bool to[kMaxRanks] = {};
        for (int j = 0; j < K; ++j) {
          const auto d = static_cast<int>(h[static_cast<std::size_t>(t * K + j)] / El);
          if (d != r) {
            to[d] = true;
            ++pairs;
          }
        }
        for (int d = 0; d < num_ranks; ++d) tokens += to[d] ? 1 : 0;
      }
      ++sets;
    };
    bench::RankTimer timer("bench_gpu_low_latency");
    // Fresh routing every 10 runs, only before a run's first op (a combine must see its dispatch's routing).
    auto prepare = [&](int i, bool first = false) {
      if (first && i % 10 == 0) new_routing(static_cast<std::uint64_t>(i));
      if (flush)
        timer.flush_l2(i);
      else
        timer.idle();
      g.barrier("bench");
    };
    auto time_it = [&](int op, int i, const std::function<void()>& fn) {
      const double us = timer.time_us(fn);
      if (i >= kWarmup) times[static_cast<std::size_t>(op)][static_cast<std::size_t>(r)].push_back(us);
    };
    auto dispatch_args = [&](bool fp8, bool hook, bool use_nvfp4 = false) {
      LowLatencyDispatchArgs a;
      a.use_nvfp4 = use_nvfp4;
      if (use_nvfp4) a.x_global_scale = gs_dev;
      a.x = x;
      a.topk_idx = idx;
      a.topk_weights = w;
      a.num_max_dispatch_tokens_per_rank = tmax;
      a.num_experts = E;
      a.use_fp8 = fp8 && !use_nvfp4;
      a.return_recv_hook = hook;
      return a;
    };
    auto combine_args = [&](const LowLatencyHandle& h, bool hook) {
      LowLatencyCombineArgs ca;
      ca.x = y;
      ca.topk_idx = idx;
      ca.topk_weights = w;
      ca.handle = &h;
      ca.return_recv_hook = hook;
      return ca;
    };
    // The graph: captured on a blocking stream, so the timer's events on the legacy default stream order with it.
    cudaStream_t graph_stream = nullptr;
    check(cudaStreamCreate(&graph_stream), "cudaStreamCreate");
    cudaGraphExec_t graph_exec = nullptr;
    LowLatencyDispatchResult captured;
    {
      new_routing(1000000);
      {  // an eager pair first (configures the window)
        const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(true, false));
        buf.low_latency_combine(combine_args(d.handle, false));
      }
      check(cudaDeviceSynchronize(), "sync");
      g.barrier("bench graph");
      StreamGuard on(Stream{graph_stream});
      cudaGraph_t graph = nullptr;
      check(cudaStreamBeginCapture(graph_stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
      captured = buf.low_latency_dispatch(dispatch_args(true, false));
      buf.low_latency_combine(combine_args(captured.handle, false));
      check(cudaStreamEndCapture(graph_stream, &graph), "cudaStreamEndCapture");
      check(cudaGraphInstantiate(&graph_exec, graph, 0), "cudaGraphInstantiate");
      check(cudaGraphDestroy(graph), "cudaGraphDestroy");
    }
    for (int i = 0; i < kWarmup + runs; ++i) {
      prepare(i, true);
      time_it(0, i, [&] { buf.low_latency_dispatch(dispatch_args(true, false)); });
      prepare(i);
      time_it(1, i, [&] { buf.low_latency_dispatch(dispatch_args(false, false)); });
      prepare(i);
      const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(true, false));
      time_it(2, i, [&] { buf.low_latency_combine(combine_args(d.handle, false)); });
      // hooks: send, then (both ranks' sends done) receive
      prepare(i);
      LowLatencyDispatchResult dh;
      time_it(3, i, [&] { dh = buf.low_latency_dispatch(dispatch_args(true, true)); });
      check(cudaDeviceSynchronize(), "sync");
      g.barrier("bench hook");
      time_it(4, i, [&] { dh.hook(); });
      prepare(i);
      LowLatencyCombineResult ch;
      time_it(5, i, [&] { ch = buf.low_latency_combine(combine_args(dh.handle, true)); });
      check(cudaDeviceSynchronize(), "sync");
      g.barrier("bench hook");
      time_it(6, i, [&] { ch.hook(); });
      prepare(i);
      time_it(7, i, [&] { check(cudaGraphLaunch(graph_exec, graph_stream), "cudaGraphLaunch"); });
      if (nvfp4) {
        prepare(i);
        time_it(8, i, [&] { buf.low_latency_dispatch(dispatch_args(false, false, true)); });
      }
    }
    check(cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy");
    check(cudaStreamDestroy(graph_stream), "cudaStreamDestroy");
    check(cudaDeviceSynchronize(), "sync");
    g.barrier("bench done");
    {
      std::lock_guard<std::mutex> lock(mutex);
      tokens_to_peer[static_cast<std::size_t>(r)] = tokens / sets;
      pairs_to_peer[static_cast<std::size_t>(r)] = pairs / sets;
    }
  });

  const double meta = 80, header = 64;
  const double fp8_record = static_cast<double>((H + 4 * G + 15) / 16 * 16), bf16_record = 2.0 * H;
  const double nvfp4_record = static_cast<double>((H / 2 + H / 16 + 15) / 16 * 16);
  const double tokens = std::accumulate(tokens_to_peer.begin(), tokens_to_peer.end(), 0.0);
  const double pairs = std::accumulate(pairs_to_peer.begin(), pairs_to_peer.end(), 0.0);
  const double headers = static_cast<double>(num_ranks) * (num_ranks - 1) * header;
  const double dispatch_fp8_bytes = tokens * (meta + fp8_record) + headers;
  const double dispatch_bf16_bytes = tokens * (meta + bf16_record) + headers;
  const double combine_bytes = pairs * 2.0 * H + headers;
  const double dispatch_nvfp4_bytes = nvfp4 ? tokens * (meta + nvfp4_record) + headers : 0;
  const double remote[kOps] = {dispatch_fp8_bytes, dispatch_bf16_bytes, combine_bytes,
                               dispatch_fp8_bytes, 0,                   combine_bytes,
                               0,                  dispatch_fp8_bytes + combine_bytes, dispatch_nvfp4_bytes};
  std::printf(
      "\n| op | median us | min us | remote MB | remote GB/s/rank |\n| --- | --- | --- | --- | --- |\n");
  std::vector<double> med(kOps), mins(kOps);
  for (int op = 0; op < kOps; ++op) {
    const std::vector<double> slow = bench::slowest_of(times[static_cast<std::size_t>(op)]);
    med[static_cast<std::size_t>(op)] = median(slow);
    mins[static_cast<std::size_t>(op)] = slow.empty() ? 0 : *std::min_element(slow.begin(), slow.end());
    const double gbps = remote[op] > 0 ? remote[op] / num_ranks / med[static_cast<std::size_t>(op)] / 1e3 : 0;
    std::printf("| %s | %.1f | %.1f | %.2f | %.0f |\n", ops[op], med[static_cast<std::size_t>(op)],
                mins[static_cast<std::size_t>(op)], remote[op] / 1e6, gbps);
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"ranks\": %d,\n  \"T\": %lld, \"H\": %lld, \"K\": %d, \"E\": %d,\n  "
                 "\"seed\": %llu,\n  \"runs\": %d,\n  \"results\": [\n",
                 prop.name, num_ranks, static_cast<long long>(T), static_cast<long long>(H), K, E,
                 static_cast<unsigned long long>(seed), runs);
    for (int op = 0; op < kOps; ++op) {
      const auto u = static_cast<std::size_t>(op);
      std::fprintf(f,
                   "    {\"op\": \"%s\", \"median_us\": %.3f, \"min_us\": %.3f, \"remote_bytes\": %.0f, "
                   "\"remote_gbps_per_rank\": %.1f}%s\n",
                   ops[op], med[u], mins[u], remote[op], remote[op] > 0 ? remote[op] / num_ranks / med[u] / 1e3 : 0.0,
                   op + 1 < kOps ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}

#endif  // EPMOE_HAVE_CUDA
