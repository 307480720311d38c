// Normal-mode dispatch and combine over NVLink (cuda_ipc backend) on R GPUs, beside peer copies of the
// same bytes measured in the same run (semantics §12, PERF.md "Floors" and "Leads").
//
// One process, one thread per rank, rank r on cuda:r (threads group, peer access); R = every visible GPU (up to
// 8) unless --ranks says otherwise (R = 1: no NVLink, the path's fixed cost; no floors). Each figure is the
// median over >= 50 runs after 5 warm-up runs; one run = both devices idle and the L2 flushed (256 MiB
// memset), a host barrier, then CUDA events on each rank's caller stream around one Buffer call (the
// count exchange's host read included); the run's time is the slower rank's. Inputs are random (seed
// printed), routing uniform top-K of E.
//  - remote bytes: what crosses NVLink, all ranks together: dispatch rows sent to other ranks
//    (x + scales + int64 local ids + f32 weights + int32 source index), combine rows sent back (bf16
//    x + f32 weights); remote GB/s = remote bytes / R / time (what one rank sends; per direction at R = 2);
//  - logical bytes: DeepEP's convention: recv_x bytes of all ranks (local rows included), the same rows
//    for combine; logical GB/s = logical bytes / R / time (per rank);
//  - floors, cudaMemcpyPeerAsync (copy engine) of the bf16 dispatch rows each rank sends each peer (counts from
//    the dispatch's prefix matrix): rank 0 -> 1 alone ("1-way"), and every pair at once, one stream per peer
//    ("all pairs"; at R = 2 both directions); the ratios compare the op's remote GB/s per rank with each.
//
// Usage: bench_gpu_normal_mode [--runs N] [--tokens T] [--hidden H] [--topk K] [--experts E] [--ranks R]
//                              [--sms N] [--copy-engine 0|1] [--chunks N] [--recv-slots N]
//                              [--routing DIR [--domain D]] [--json PATH]
#include "bench_util.hpp"

#if !defined(EPMOE_HAVE_CUDA)
int main() { return epmoe::bench::cpu_only_build("bench_gpu_normal_mode"); }
#else

#include <epmoe/buffer.hpp>
#include <epmoe/group.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/replay.hpp>

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

void check(cudaError_t e, const char* what) { bench::check_cuda("bench_gpu_normal_mode", e, what); }

using bench::median;
using bench::splitmix;

/// Random bytes that are finite, non-zero values for bf16 / fp32 / fp8 (exponent bits kept in range).
Tensor random_device(DType dtype, Shape shape, int device, std::uint64_t seed) {
  Tensor h = Tensor::empty(dtype, shape);
  auto* p = static_cast<std::uint8_t*>(h.data());
  for (std::size_t i = 0; i < h.nbytes(); i += 8) {
    const std::uint64_t r = splitmix(seed);
    std::memcpy(p + i, &r, std::min<std::size_t>(8, h.nbytes() - i));
  }
  if (dtype == DType::bf16)
    for (std::int64_t i = 0; i < h.numel(); ++i) h.ptr<bf16_t>()[i].bits = (h.ptr<bf16_t>()[i].bits & 0x807f) | 0x3f00;
  if (dtype == DType::fp32)
    for (std::int64_t i = 0; i < h.numel(); ++i) h.ptr<float>()[i] = 0.01f + static_cast<float>(i % 97) / 97.0f;
  if (dtype == DType::fp8_e4m3)
    for (std::int64_t i = 0; i < h.numel(); ++i) h.ptr<fp8_e4m3_t>()[i].bits &= 0xbf;  // never NaN
  Tensor d = Tensor::empty(dtype, shape, Device::cuda(device));
  check(cudaMemcpy(d.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

/// Uniform random top-K of E (bench::random_topk_ids), on cuda:device.
Tensor random_routing(std::int64_t T, int K, int E, int device, std::uint64_t seed) {
  const std::vector<std::int64_t> h = bench::random_topk_ids(T, K, E, seed);
  Tensor d = Tensor::empty(DType::int64, {T, K}, Device::cuda(device));
  check(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice), "H2D");
  return d;
}

/// semantics §14: rank r replays tokens [r*T, (r+1)*T) of layer 0 of the recorded OLMoE routing, ids mapped to E experts.
Tensor replayed_routing(const RoutingTrace& trace, std::int64_t T, int E, int rank, int device) {
  const ReplayedRouting rr = replay_routing(trace, 0, 0, rank, T, E);
  Tensor d = Tensor::empty(DType::int64, rr.topk_idx.shape(), Device::cuda(device));
  check(cudaMemcpy(d.data(), rr.topk_idx.data(), rr.topk_idx.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

struct Result {
  std::string op;
  double median_us = 0, min_us = 0, remote_bytes = 0, logical_bytes = 0;
  double remote_gbps = 0, logical_gbps = 0, of_copy = 0, of_all_pairs = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int sms = 0, copy_engine = 1, chunks = 0, recv_slots = BufferOptions{}.num_recv_slots;
  int ranks = 0;  // 0: every visible GPU, up to kMaxRanks
  std::string routing, domain = "general";
  bench::OpOptions opt;
  opt.T = 4096;
  for (int i = 1; i < argc; ++i) {
    if (bench::parse_op_option(argc, argv, i, opt)) continue;
    auto next = [&] { return i + 1 < argc ? argv[++i] : argv[i]; };
    if (!std::strcmp(argv[i], "--sms"))
      sms = std::atoi(next());
    else if (!std::strcmp(argv[i], "--routing"))
      routing = next();
    else if (!std::strcmp(argv[i], "--domain"))
      domain = next();
    else if (!std::strcmp(argv[i], "--chunks"))
      chunks = std::atoi(next());
    else if (!std::strcmp(argv[i], "--copy-engine"))
      copy_engine = std::atoi(next());
    else if (!std::strcmp(argv[i], "--recv-slots"))
      recv_slots = std::atoi(next());
    else if (!std::strcmp(argv[i], "--ranks"))
      ranks = std::atoi(next());
    else {
      std::printf(
          "usage: %s [--runs N] [--tokens T] [--hidden H] [--topk K] [--experts E] [--ranks R] [--sms N] [--copy-engine 0|1] "
          "[--chunks N] [--recv-slots N] [--routing DIR [--domain D]] [--json PATH]\n",
          argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (ranks == 0) ranks = std::min(devices, kMaxRanks);
  if (!bench::have_gpus("bench_gpu_normal_mode", std::max(ranks, 1))) return 77;
  if (ranks < 1 || ranks > kMaxRanks || opt.E % ranks != 0) {
    std::printf("bench_gpu_normal_mode: --ranks must be 1..%d and divide --experts (%d), got %d\n", kMaxRanks, opt.E,
                ranks);
    return 2;
  }
  const int R = ranks;
  const int runs = opt.runs, E = opt.E;
  int K = opt.K;  // a replayed routing sets it
  const std::int64_t T = opt.T, H = opt.H;
  const std::string json_path = opt.json_path;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::uint64_t seed = bench::run_seed();
  std::printf(
      "bench_gpu_normal_mode: %s x%d, T=%lld H=%lld K=%d E=%d, sms=%d, copy_engine=%d, chunks=%d, recv_slots=%d, "
      "runs=%d, seed %llu\n",
      prop.name, R, static_cast<long long>(T), static_cast<long long>(H), K, E, sms, copy_engine, chunks,
      recv_slots, runs,
      static_cast<unsigned long long>(seed));

  // times[op][rank][run]
  const char* ops[] = {"dispatch_bf16", "dispatch_fp8", "dispatch_bf16_cached", "combine_bf16"};
  constexpr int kOps = 4;
  std::vector<std::vector<std::vector<double> > > times(kOps, std::vector<std::vector<double> >(R));
  std::vector<double> sent_rows(R), recv_rows(R);
  std::vector<std::vector<double> > pair_rows(R, std::vector<double>(R));  // [src][dst], src != dst
  std::vector<double> copy_one_us, copy_both_us;
  std::mutex mutex;
  const std::int64_t scale_cols = num_scale_groups(H);
  RoutingTrace trace;
  if (!routing.empty()) {
    trace = load_routing_trace(routing, domain);
    K = trace.num_topk();
    std::printf("routing: %s, domain %s, layer 0 (%lld recorded tokens, wrapped), K=%d, ids mapped to E=%d\n",
                routing.c_str(), domain.c_str(), static_cast<long long>(trace.num_tokens()), K, E);
  }

  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    check(cudaSetDevice(r), "cudaSetDevice");
    BufferOptions o;
    o.backend = Backend::cuda_ipc;
    o.device = r;
    o.num_sms = sms;
    o.use_copy_engine = copy_engine != 0;
    o.num_chunks = chunks;
    o.num_recv_slots = recv_slots;
    o.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(T, H, R, K);
    Buffer buf(std::shared_ptr<Group>(&g, [](Group*) {}), o);
    const std::uint64_t s = seed + 1000003ull * static_cast<std::uint64_t>(r);
    const Tensor x = random_device(DType::bf16, {T, H}, r, s + 1);
    const Tensor x8 = random_device(DType::fp8_e4m3, {T, H}, r, s + 2);
    const Tensor sc = random_device(DType::fp32, {T, scale_cols}, r, s + 3);
    const Tensor idx = routing.empty() ? random_routing(T, K, E, r, s + 4) : replayed_routing(trace, T, E, r, r);
    const Tensor w = random_device(DType::fp32, {T, K}, r, s + 5);
    const DispatchLayout layout = buf.get_dispatch_layout(idx, E);
    bench::RankTimer timer("bench_gpu_normal_mode");

    auto timed = [&](int op, const std::function<void()>& fn) {
      for (int i = 0; i < kWarmup + runs; ++i) {
        timer.flush_l2(i);
        g.barrier("bench");
        const double us = timer.time_us(fn);
        if (i >= kWarmup) times[static_cast<std::size_t>(op)][static_cast<std::size_t>(r)].push_back(us);
      }
    };
    DispatchArgs a = make_dispatch_args(layout, x, idx, w);
    DispatchResult keep;
    timed(0, [&] { keep = buf.dispatch(a); });
    a.x = x8;
    a.x_scales = sc;
    timed(1, [&] { buf.dispatch(a); });
    DispatchArgs cached;
    cached.x = x;
    cached.handle = &keep.handle;
    timed(2, [&] { buf.dispatch(cached); });
    const Tensor cx = random_device(DType::bf16, {keep.handle.num_recv_rows, H}, r, s + 6);
    const Tensor cw = random_device(DType::fp32, {keep.handle.num_recv_rows, K}, r, s + 7);
    CombineArgs ca;
    ca.x = cx;
    ca.topk_weights = cw;
    ca.handle = &keep.handle;
    timed(3, [&] { buf.combine(ca); });

    // Rows this rank sends to each peer and receives, from the handle's prefix matrix.
    std::vector<std::int32_t> pm(R * R);
    check(cudaMemcpy(pm.data(), keep.handle.rank_prefix_matrix.data(), pm.size() * 4, cudaMemcpyDeviceToHost), "D2H");
    auto count = [&](int src, int dst) {
      return pm[src * R + dst] - (src > 0 ? pm[(src - 1) * R + dst] : 0);
    };
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (int d = 0; d < R; ++d) {
        if (d == r) continue;
        pair_rows[static_cast<std::size_t>(r)][static_cast<std::size_t>(d)] = count(r, d);
        sent_rows[static_cast<std::size_t>(r)] += count(r, d);
      }
      recv_rows[static_cast<std::size_t>(r)] = keep.handle.num_recv_tokens;
    }
    g.barrier("bench copies");
    if (R < 2) return;  // no peers: no floors

    // Floors: peer copies of the bf16 dispatch rows this rank sends each peer: rank 0 -> 1 alone, then every pair
    // at once (one blocking stream per peer, so the timer's events on the legacy stream order with them).
    const std::size_t row = static_cast<std::size_t>(2 * H + 12 * K + 4);
    std::size_t most = 16;
    for (const auto& v : pair_rows)
      for (double n : v) most = std::max(most, static_cast<std::size_t>(n) * row);
    void* src = nullptr;
    void* dst = nullptr;  // a part per source
    check(cudaMalloc(&src, most), "cudaMalloc");
    check(cudaMalloc(&dst, most * static_cast<std::size_t>(R)), "cudaMalloc");
    std::vector<void*> dsts(R);
    g.all_gather(&dst, dsts.data(), sizeof(void*), "bench copies");
    std::vector<cudaStream_t> streams(R);
    for (cudaStream_t& st : streams) check(cudaStreamCreate(&st), "cudaStreamCreate");
    const auto copy_to = [&](int d, cudaStream_t st) {
      const std::size_t n = static_cast<std::size_t>(pair_rows[static_cast<std::size_t>(r)][static_cast<std::size_t>(d)]);
      check(cudaMemcpyPeerAsync(static_cast<char*>(dsts[static_cast<std::size_t>(d)]) + most * static_cast<std::size_t>(r),
                                d, src, r, n * row, st),
            "peer copy");
    };
    for (int mode = 0; mode < 2; ++mode) {
      std::vector<double> ts;
      for (int i = 0; i < kWarmup + runs; ++i) {
        check(cudaDeviceSynchronize(), "sync");
        g.barrier("bench copy");
        const double us = timer.time_us([&] {
          if (mode == 0 && r == 0) copy_to(1, nullptr);
          if (mode == 1)
            for (int d = 0; d < R; ++d)
              if (d != r) copy_to(d, streams[static_cast<std::size_t>(d)]);
        });
        if (i >= kWarmup) ts.push_back(us);
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (mode == 0 && r == 0) copy_one_us = ts;
      if (mode == 1) {
        if (copy_both_us.empty())
          copy_both_us = ts;
        else
          for (std::size_t i = 0; i < ts.size(); ++i) copy_both_us[i] = std::max(copy_both_us[i], ts[i]);
      }
    }
    g.barrier("bench done");
    for (cudaStream_t st : streams) cudaStreamDestroy(st);
    cudaFree(src);
    cudaFree(dst);
  });

  const double row_bf16 = static_cast<double>(2 * H + 12 * K + 4);
  const double remote_rows = std::accumulate(sent_rows.begin(), sent_rows.end(), 0.0);
  const double logical_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), 0.0);
  // Floors in GB/s per rank (what one rank sends), 0 without peers.
  const double one_bytes = R > 1 ? pair_rows[0][1] * row_bf16 : 0;
  const double one_gbps = R > 1 ? one_bytes / median(copy_one_us) / 1e3 : 0;
  const double all_gbps = R > 1 ? remote_rows * row_bf16 / R / median(copy_both_us) / 1e3 : 0;
  const double dispatch_bf16_row = 2.0 * H + 12.0 * K + 4, dispatch_fp8_row = H + 4.0 * scale_cols + 12.0 * K + 4;
  const double row_bytes[kOps] = {dispatch_bf16_row, dispatch_fp8_row, 2.0 * H, 2.0 * H + 4.0 * K};
  const double logical_row[kOps] = {2.0 * H, static_cast<double>(H), 2.0 * H, 2.0 * H};
  std::vector<Result> results;
  for (int op = 0; op < kOps; ++op) {
    const std::vector<double> slow = bench::slowest_of(times[static_cast<std::size_t>(op)]);
    Result res;
    res.op = ops[op];
    res.median_us = median(slow);
    res.min_us = slow.empty() ? 0 : *std::min_element(slow.begin(), slow.end());
    res.remote_bytes = remote_rows * row_bytes[op];
    res.logical_bytes = logical_rows * logical_row[op];
    res.remote_gbps = res.remote_bytes / R / res.median_us / 1e3;
    res.logical_gbps = res.logical_bytes / R / res.median_us / 1e3;
    res.of_copy = one_gbps > 0 ? res.remote_gbps / one_gbps : 0;
    res.of_all_pairs = all_gbps > 0 ? res.remote_gbps / all_gbps : 0;
    results.push_back(res);
  }
  if (R > 1)
    std::printf("\npeer copy of %.1f MB rank 0 -> 1: %.1f us (%.0f GB/s); every pair at once (%.1f MB in all): %.1f us "
                "(%.0f GB/s per rank)\n",
                one_bytes / 1e6, median(copy_one_us), one_gbps, remote_rows * row_bf16 / 1e6, median(copy_both_us),
                all_gbps);
  else
    std::printf("\none rank: no peer, no floors (the figures are the path's fixed cost)\n");
  std::printf(
      "\n| op | median us | min us | remote MB | remote GB/s/rank | logical GB/s/rank | of 1-way copy | of all-pairs "
      "copy |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Result& r : results)
    std::printf("| %s | %.1f | %.1f | %.1f | %.0f | %.0f | %.0f%% | %.0f%% |\n", r.op.c_str(), r.median_us, r.min_us,
                r.remote_bytes / 1e6, r.remote_gbps, r.logical_gbps, 100 * r.of_copy, 100 * r.of_all_pairs);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"ranks\": %d,\n  \"T\": %lld, \"H\": %lld, \"K\": %d, \"E\": %d, "
                 "\"sms\": %d, \"copy_engine\": %d, \"chunks\": %d, \"recv_slots\": %d,\n  \"routing\": \"%s\",\n",
                 prop.name, R, static_cast<long long>(T), static_cast<long long>(H), K, E, sms, copy_engine,
                 chunks, recv_slots, routing.empty() ? "uniform random" : (routing + ":" + domain + ":layer0").c_str());
    std::fprintf(f,
                 "  \"seed\": %llu,\n  \"runs\": %d,\n  \"peer_copy_one_way_gbps\": %.1f,\n  "
                 "\"peer_copy_all_pairs_gbps_per_rank\": %.1f,\n  \"peer_copy_all_pairs_us\": %.2f,\n",
                 static_cast<unsigned long long>(seed), runs, one_gbps, all_gbps, R > 1 ? median(copy_both_us) : 0.0);
    std::fprintf(f, "  \"results\": [\n");
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(
          f,
          "    {\"op\": \"%s\", \"median_us\": %.3f, \"min_us\": %.3f, \"remote_bytes\": %.0f, \"logical_bytes\": "
          "%.0f, \"remote_gbps_per_rank\": %.1f, \"logical_gbps_per_rank\": %.1f, \"of_one_way_copy\": %.3f, "
          "\"of_all_pairs_copy\": %.3f}%s\n",
          r.op.c_str(), r.median_us, r.min_us, r.remote_bytes, r.logical_bytes, r.remote_gbps, r.logical_gbps,
          r.of_copy, r.of_all_pairs, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}

#endif  // EPMOE_HAVE_CUDA
