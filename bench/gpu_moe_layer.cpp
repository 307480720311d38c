// The whole no-EP MoE layer on one GPU: CUDA router (top-k softmax) -> no-EP prepare -> CUDA experts
// -> finalize, at DeepSeek-V3 shapes H = 7168, N = 2048, K = 8, E = 256 experts, all on this GPU (22.5 GB of
// bf16 weights), T = 128 (decode) and T = 4096 (prefill) tokens, per semantics §12: CUDA events around each call,
// median (and minimum) of >= 50 runs after warm-up, the L2 flushed (256 MiB memset) before each run, random
// inputs (never zeros).
//
// Rows, bf16 and fp8 dispatch each:
//   standard eager  -- Standard format (permute, per-expert cuBLAS GEMMs chosen by GemmMode::automatic,
//                      unpermute); the experts wait once for the stream (cuBLAS takes row counts on the host)
//   batched eager   -- BatchedExperts: scatter into [E, max_tokens, H] slabs, strided-batched GEMMs over every
//                      slab row, NaiveBatched finalize; no host synchronisation
//   batched graph   -- the same sequence, router included, captured once in a CUDA graph and replayed
//   all_gather R=1  -- the all-gather + reduce-scatter prepare/finalize over a one-rank group with the standard
//                      experts (the baseline's R = 1 path: no gather, no copy; should equal standard eager)
// max_tokens (the slab height) is the largest per-expert count of this run's routing rounded up to 16, so
// the batched GEMMs do E * max_tokens rows of work for T * K useful ones; the ratio is printed ("waste").
// TFLOP/s counts useful work only: T * K * 6 * H * N (gated gemm1 2N x H, gemm2 H x N).
//
// Usage: bench_gpu_moe_layer [--runs N (>= 50)] [--json PATH] [--experts E]
#if !defined(EPMOE_HAVE_CUDA)
#include <cstdio>
int main() {
  std::printf("bench_gpu_moe_layer: epmoe was built without CUDA: skipped\n");
  return 77;
}
#else
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "bench_util.hpp"

#include "router/router.hpp"

namespace {

using namespace epmoe;

void check(cudaError_t e, const char* what) { bench::check_cuda("bench_gpu_moe_layer", e, what); }

struct Timer {
  cudaEvent_t start{}, stop{};
  void* flush = nullptr;
  std::size_t flush_bytes = std::size_t{256} << 20;
  int runs;
  cudaStream_t stream = nullptr;
  explicit Timer(int n) : runs(n) {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    check(cudaMalloc(&flush, flush_bytes), "cudaMalloc flush");
  }
  // Median and minimum in milliseconds over the runs, after 3 warm-up calls.
  std::pair<double, double> time(const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    check(cudaStreamSynchronize(stream), "warm-up");
    std::vector<double> ms;
    for (int i = 0; i < runs; ++i) {
      check(cudaMemsetAsync(flush, i & 0xff, flush_bytes, stream), "L2 flush");
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      fn();
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      ms.push_back(t);
    }
    check(cudaGetLastError(), "kernels");
    std::sort(ms.begin(), ms.end());
    return {ms[ms.size() / 2], ms.front()};
  }
};

using bench::splitmix;

float uniform(std::uint64_t& seed) {
  return (static_cast<float>(splitmix(seed) & 0xffffffu) + 0.5f) / 16777216.0f * 2.0f - 1.0f;
}

// bf16 values uniform in (-scale, scale): a 64 MiB random tile (distinct per call) repeated. Repetition does
// not matter to GEMM or copy speed; zeros would.
void fill_bf16(void* dev, std::size_t elements, float scale, std::uint64_t& seed) {
  const std::size_t tile = std::min<std::size_t>(elements, std::size_t{32} << 20);
  std::vector<bf16_t> host(tile);
  for (std::size_t i = 0; i < tile; ++i) host[i] = float_to_bf16(uniform(seed) * scale);
  auto* d = static_cast<bf16_t*>(dev);
  check(cudaMemcpy(d, host.data(), tile * sizeof(bf16_t), cudaMemcpyHostToDevice), "fill upload");
  for (std::size_t off = tile; off < elements; off += tile)
    check(cudaMemcpy(d + off, d, std::min(tile, elements - off) * sizeof(bf16_t), cudaMemcpyDeviceToDevice),
          "fill replicate");
}

struct Row {
  std::string name;
  std::int64_t tokens = 0, max_tokens = 0;
  double median_ms = 0, min_ms = 0, tflops = 0;
};

std::vector<bf16_t> download(const void* dev, std::size_t n) {
  std::vector<bf16_t> h(n);
  check(cudaMemcpy(h.data(), dev, n * sizeof(bf16_t), cudaMemcpyDeviceToHost), "download");
  return h;
}

double rel_diff(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    num += (x - y) * (x - y);
    den += x * x;
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 50;
  int E = 256;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(50, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--experts") && i + 1 < argc) E = std::max(8, std::atoi(argv[++i]));
    else {
      std::printf("usage: %s [--runs N (>= 50)] [--json PATH] [--experts E (default 256)]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gpu_moe_layer: no CUDA device: skipped\n");
    return 77;
  }
  constexpr std::int64_t H = 7168, N = 2048;
  constexpr int K = 8;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::uint64_t seed = std::random_device{}();
  const double weight_gb = static_cast<double>(E) * 3 * N * H * 2 / 1e9;
  std::printf("bench_gpu_moe_layer: %s, %d SMs, seed %llu, median of %d runs; H=%lld N=%lld K=%d E=%d (%.1f GB of "
              "weights)\n",
              prop.name, prop.multiProcessorCount, static_cast<unsigned long long>(seed), runs,
              static_cast<long long>(H), static_cast<long long>(N), K, E, weight_gb);
  Timer timer(runs);
  // A stream of our own: the legacy default stream cannot be captured into a CUDA graph.
  check(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  StreamGuard guard(Stream{timer.stream});
  const Device gpu = Device::cuda(0);

  Tensor w1 = Tensor::empty(DType::bf16, {E, 2 * N, H}, gpu);
  Tensor w2 = Tensor::empty(DType::bf16, {E, H, N}, gpu);
  fill_bf16(w1.data(), static_cast<std::size_t>(w1.numel()), 1.0f / std::sqrt(static_cast<float>(H)), seed);
  fill_bf16(w2.data(), static_cast<std::size_t>(w2.numel()), 1.0f / std::sqrt(static_cast<float>(N)), seed);

  std::vector<Row> rows;
  for (std::int64_t T : {std::int64_t{128}, std::int64_t{4096}}) {
    // Inputs: logits (routing on the GPU in every timed call) and tokens.
    std::vector<float> h_logits(static_cast<std::size_t>(T * E));
    for (float& v : h_logits) v = 3.0f * uniform(seed);
    Tensor logits = Tensor::empty(DType::fp32, {T, E}, gpu);
    check(cudaMemcpy(logits.data(), h_logits.data(), logits.nbytes(), cudaMemcpyHostToDevice), "logits");
    Tensor x = Tensor::empty(DType::bf16, {T, H}, gpu);
    fill_bf16(x.data(), static_cast<std::size_t>(x.numel()), 1.0f, seed);
    Tensor idx = Tensor::empty(DType::int64, {T, K}, gpu);
    Tensor tw = Tensor::empty(DType::fp32, {T, K}, gpu);
    Tensor out = Tensor::empty(DType::bf16, {T, H}, gpu);
    router_detail::RoutingProblem rp;
    rp.logits = logits;
    rp.num_tokens = T;
    rp.num_experts = E;
    rp.num_topk = K;
    rp.renormalize = true;
    auto route = [&] { router_detail::route_cuda(rp, tw.ptr<float>(), idx.ptr<std::int64_t>(), Stream{timer.stream}); };
    route();
    std::vector<std::int64_t> h_idx(static_cast<std::size_t>(T * K));
    check(cudaStreamSynchronize(timer.stream), "route");
    check(cudaMemcpy(h_idx.data(), idx.data(), idx.nbytes(), cudaMemcpyDeviceToHost), "idx");
    std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0);
    for (std::int64_t e : h_idx) ++counts[static_cast<std::size_t>(e)];
    const std::int64_t max_count = *std::max_element(counts.begin(), counts.end());
    const std::int64_t max_tokens = (max_count + 15) / 16 * 16;
    const double useful = static_cast<double>(T) * K * 6.0 * H * N;
    std::printf("T=%lld: busiest expert %lld choices (mean %.1f) -> max_tokens %lld, batched waste %.2fx\n",
                static_cast<long long>(T), static_cast<long long>(max_count), static_cast<double>(T * K) / E,
                static_cast<long long>(max_tokens), static_cast<double>(E * max_tokens) / static_cast<double>(T * K));

    MoEForwardArgs a;
    a.hidden = x;
    a.w1 = w1;
    a.w2 = w2;
    a.topk_idx = idx;
    a.topk_weights = tw;
    a.global_num_experts = E;
    a.output = out;
    std::vector<bf16_t> reference;  // the first row's output, to compare the others with
    for (DispatchDtype dtype : {DispatchDtype::bf16, DispatchDtype::fp8}) {
      const char* dn = dtype == DispatchDtype::fp8 ? "fp8" : "bf16";
      PrepareFinalizeOptions po;
      po.dispatch_dtype = dtype;
      po.round_scale = dtype == DispatchDtype::fp8;
      for (ActivationFormat format : {ActivationFormat::standard, ActivationFormat::batched_experts}) {
        auto workspaces = std::make_shared<WorkspaceCache>();
        NoEpOptions no;
        no.format = format;
        no.max_tokens_per_expert = format == ActivationFormat::batched_experts ? max_tokens : 0;
        no.workspaces = workspaces;
        ExpertsConfig ec;
        ec.format = format;
        MoELayerOptions lo;
        lo.workspaces = workspaces;
        MoELayer layer(make_no_ep_prepare_finalize(po, no), make_cuda_experts(ec), SharedExperts{}, lo);
        auto step = [&] {
          route();
          layer.forward(a);
        };
        const bool batched = format == ActivationFormat::batched_experts;
        const std::string base = std::string(batched ? "batched" : "standard") + " " + dn;
        auto [med, mn] = timer.time(step);
        rows.push_back({base + " eager", T, batched ? max_tokens : 0, med, mn, useful / (med * 1e-3) / 1e12});
        check(cudaStreamSynchronize(timer.stream), "eager");
        const std::vector<bf16_t> got = download(out.data(), static_cast<std::size_t>(T * H));
        if (reference.empty()) reference = got;
        std::printf("  %-24s %9.3f ms (min %.3f)  %6.1f TFLOP/s  rel. diff to standard bf16 %.2e\n",
                    rows.back().name.c_str(), med, mn, rows.back().tflops, rel_diff(reference, got));
        if (!batched) {
          // The all-gather + reduce-scatter baseline at R = 1 (make_all_gather_prepare_finalize over a one-rank
          // group): nothing to gather, nothing copied, so it should time as the no-EP standard row above.
          ThreadWorld one(1);
          MoELayer ag(make_all_gather_prepare_finalize(one.group(0), po), make_cuda_experts(ec), SharedExperts{}, lo);
          std::tie(med, mn) = timer.time([&] {
            route();
            ag.forward(a);
          });
          rows.push_back({std::string("all_gather R=1 ") + dn + " eager", T, 0, med, mn, useful / (med * 1e-3) / 1e12});
          check(cudaStreamSynchronize(timer.stream), "all_gather");
          const std::vector<bf16_t> got_ag = download(out.data(), static_cast<std::size_t>(T * H));
          std::printf("  %-24s %9.3f ms (min %.3f)  %6.1f TFLOP/s  rel. diff to standard bf16 %.2e\n",
                      rows.back().name.c_str(), med, mn, rows.back().tflops, rel_diff(reference, got_ag));
          continue;
        }
        cudaGraph_t graph = nullptr;
        check(cudaStreamBeginCapture(timer.stream, cudaStreamCaptureModeGlobal), "begin capture");
        step();
        check(cudaStreamEndCapture(timer.stream, &graph), "end capture");
        cudaGraphExec_t exec = nullptr;
        check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        check(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), timer.stream), "poison");
        std::tie(med, mn) = timer.time([&] { check(cudaGraphLaunch(exec, timer.stream), "graph launch"); });
        rows.push_back({base + " graph", T, max_tokens, med, mn, useful / (med * 1e-3) / 1e12});
        check(cudaStreamSynchronize(timer.stream), "graph");
        const std::vector<bf16_t> replayed = download(out.data(), static_cast<std::size_t>(T * H));
        std::printf("  %-24s %9.3f ms (min %.3f)  %6.1f TFLOP/s  rel. diff to standard bf16 %.2e\n",
                    rows.back().name.c_str(), med, mn, rows.back().tflops, rel_diff(reference, replayed));
        check(cudaGraphExecDestroy(exec), "graph destroy");
        check(cudaGraphDestroy(graph), "graph destroy");
      }
    }
    cuda::check_moe_faults(Stream{timer.stream});  // an overflow or a bad id would be an error here
  }

  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"H\": %lld, \"N\": %lld, \"K\": %d, \"E\": %d, \"runs\": %d, \"rows\": [\n",
                 prop.name, static_cast<long long>(H), static_cast<long long>(N), K, E, runs);
    for (std::size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f,
                   "  {\"name\": \"%s\", \"T\": %lld, \"max_tokens\": %lld, \"median_ms\": %.4f, \"min_ms\": %.4f, "
                   "\"useful_tflops\": %.2f}%s\n",
                   rows[i].name.c_str(), static_cast<long long>(rows[i].tokens),
                   static_cast<long long>(rows[i].max_tokens), rows[i].median_ms, rows[i].min_ms, rows[i].tflops,
                   i + 1 < rows.size() ? "," : "");
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
#endif
