// The low-latency MoE layer with and without the combine's send overlapped with the experts (MoELayerOptions::overlap,
// docs/semantics.md "Overlapped low-latency combine"), on R GPUs (one thread per rank, rank r on cuda:r, cuda_ipc
// buffer, CUDA bf16 experts; R = every visible GPU up to 8 unless --ranks says otherwise), in one run:
//  - layer_plain / layer_overlap: one MoELayer::forward (dispatch, experts, combine) timed with CUDA events on the
//    caller's stream, median over --runs after 5 warm-up runs, the slower rank's; the two alternate run by run on
//    the same routing;
//  - stamps (one instrumented forward, built from the same pieces as the layer's overlap path): the %globaltimer
//    of the combine send's first row store (LowLatencyCombineArgs::send_stamps) against a stamp kernel enqueued on
//    the experts' stream after the last expert's down GEMM (its copy and signal); overlap shows as
//    first_send < last_gemm_end on every rank, by `lead_us`.
//  - outputs_equal: the two layers' outputs of the last run compared bit for bit (rank by rank).
// At R = 1 the combine only sends to itself: the overlap can only save the send's own copy, and the side stream and
// the per-expert down GEMMs (cuBLAS calls one by one instead of one strided-batched call) can make it a loss;
// the JSON says so ("r1_note").
//
// Usage: bench_gpu_low_latency_overlap [--runs N] [--tokens T] [--hidden H] [--intermediate N] [--topk K]
//                                      [--experts E] [--ranks R] [--num-sms S] [--json PATH]
#include <epmoe/buffer.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace {

using namespace epmoe;

constexpr int kWarmup = 5;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_low_latency_overlap: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__global__ void stamp_kernel(unsigned long long* slot) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *slot = t;
}

__global__ void fill_kernel(__nv_bfloat16* p, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = __float2bfloat16((static_cast<float>(z >> 40) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
}

Tensor random_bf16(Shape shape, int device, std::uint64_t seed, float scale) {
  Tensor t = Tensor::empty(DType::bf16, shape, Device::cuda(device));
  fill_kernel<<<256, 256>>>(static_cast<__nv_bfloat16*>(t.data()), t.numel(), seed, scale);
  check(cudaGetLastError(), "fill");
  return t;
}

struct Options {
  int runs = 50, ranks = 0, topk = 8, experts = 0, num_sms = 0;
  std::int64_t tokens = 128, hidden = 7168, intermediate = 2048;
  std::string json;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_gpu_low_latency_overlap: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--runs") o.runs = std::atoi(next());
    else if (a == "--tokens") o.tokens = std::atoll(next());
    else if (a == "--hidden") o.hidden = std::atoll(next());
    else if (a == "--intermediate") o.intermediate = std::atoll(next());
    else if (a == "--topk") o.topk = std::atoi(next());
    else if (a == "--experts") o.experts = std::atoi(next());
    else if (a == "--ranks") o.ranks = std::atoi(next());
    else if (a == "--num-sms") o.num_sms = std::atoi(next());
    else if (a == "--json") o.json = next();
    else {
      std::fprintf(stderr, "bench_gpu_low_latency_overlap: unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  return o;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct RankOut {
  std::vector<double> plain_us, overlap_us;
  long long first_send = 0, last_send = 0, last_gemm_end = 0;
  bool equal = false;
};

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "bench_gpu_low_latency_overlap: no GPU\n");
    return 77;
  }
  const int R = o.ranks > 0 ? o.ranks : std::min(gpus, 8);
  const int E = o.experts > 0 ? o.experts : 8 * R;
  const int El = E / R, K = o.topk;
  const std::int64_t T = o.tokens, H = o.hidden, N = o.intermediate, rows = static_cast<std::int64_t>(R) * T;
  const std::uint64_t seed = std::random_device{}();
  std::printf("bench_gpu_low_latency_overlap: R=%d T=%lld H=%lld N=%lld E=%d K=%d num_sms=%d seed=%llu\n", R,
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(N), E, K, o.num_sms,
              static_cast<unsigned long long>(seed));
  std::vector<RankOut> out(static_cast<std::size_t>(R));
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    RankOut& ro = out[static_cast<std::size_t>(r)];
    check(cudaSetDevice(r), "cudaSetDevice");
    BufferOptions bo;
    bo.backend = Backend::cuda_ipc;
    bo.device = r;
    bo.low_latency_mode = true;
    auto buffer = std::make_shared<Buffer>(std::shared_ptr<Group>(&g, [](Group*) {}), bo);
    ExpertsConfig ec;
    ec.format = ActivationFormat::batched_experts;
    std::shared_ptr<Experts> experts(make_cuda_experts(ec));
    MoELayerOptions plain_o, overlap_o;
    overlap_o.overlap = true;
    overlap_o.overlap_num_sms = o.num_sms;
    auto pf_plain = make_low_latency_prepare_finalize(buffer, static_cast<int>(T), {});
    auto pf_overlap = make_low_latency_prepare_finalize(buffer, static_cast<int>(T), {});
    MoELayer plain(pf_plain, experts, {}, plain_o), overlapped(pf_overlap, experts, {}, overlap_o);
    const std::uint64_t s = seed + 7919ull * static_cast<std::uint64_t>(r);
    const Tensor x = random_bf16({T, H}, r, s + 1, 2.0f);
    const Tensor w1 = random_bf16({El, 2 * N, H}, r, s + 2, 0.03f), w2 = random_bf16({El, H, N}, r, s + 3, 0.03f);
    std::mt19937_64 rng(s + 4);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(T * K));
    std::vector<float> wts(static_cast<std::size_t>(T * K), 1.0f / static_cast<float>(K));
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<int> pick(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) pick[static_cast<std::size_t>(e)] = e;
      std::shuffle(pick.begin(), pick.end(), rng);
      for (int k = 0; k < K; ++k) ids[static_cast<std::size_t>(t * K + k)] = pick[static_cast<std::size_t>(k)];
    }
    Tensor idx = Tensor::empty(DType::int64, {T, K}, Device::cuda(r)), wt = Tensor::empty(DType::fp32, {T, K}, Device::cuda(r));
    check(cudaMemcpy(idx.data(), ids.data(), ids.size() * 8, cudaMemcpyHostToDevice), "H2D");
    check(cudaMemcpy(wt.data(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice), "H2D");
    MoEForwardArgs a;
    a.hidden = x;
    a.w1 = w1;
    a.w2 = w2;
    a.topk_idx = idx;
    a.topk_weights = wt;
    a.global_num_experts = E;
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    const cudaStream_t main = static_cast<cudaStream_t>(current_stream().handle);
    Tensor last_plain, last_overlap;
    for (int i = 0; i < kWarmup + o.runs; ++i)
      for (MoELayer* layer : {&plain, &overlapped}) {
        g.barrier("bench");
        check(cudaEventRecord(e0, main), "record");
        Tensor y = layer->forward(a).output;
        check(cudaEventRecord(e1, main), "record");
        check(cudaEventSynchronize(e1), "sync");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
        if (i >= kWarmup) (layer == &plain ? ro.plain_us : ro.overlap_us).push_back(ms * 1000.0);
        (layer == &plain ? last_plain : last_overlap) = y;
      }
    std::vector<char> hp(static_cast<std::size_t>(last_plain.nbytes())), ho(hp.size());
    if (!hp.empty()) {
      check(cudaMemcpy(hp.data(), last_plain.data(), hp.size(), cudaMemcpyDeviceToHost), "D2H");
      check(cudaMemcpy(ho.data(), last_overlap.data(), ho.size(), cudaMemcpyDeviceToHost), "D2H");
    }
    ro.equal = hp == ho;

    // One instrumented overlapped forward: the layer's pieces, with the send's stamps and a stamp after the experts.
    g.barrier("bench: stamps");
    PrepareInputs pin{a.hidden, a.topk_idx, a.topk_weights, E, false, {}};
    pf_plain->dispatch_a(pin);
    const PrepareOutput p = pf_plain->dispatch_b();
    constexpr int kBlockM = 64, kBlockN = 128;
    const std::int64_t bpe = (rows + kBlockM - 1) / kBlockM;
    Tensor signal = Tensor::empty(DType::int32, {El * bpe}, Device::cuda(r));
    Tensor stamps = Tensor::empty(DType::int64, {2}, Device::cuda(r));
    const long long init[2] = {LLONG_MAX, 0};
    check(cudaMemcpyAsync(stamps.data(), init, sizeof(init), cudaMemcpyHostToDevice, main), "H2D");
    check(cudaMemsetAsync(signal.data(), 0, signal.nbytes(), main), "memset");
    Tensor gemm_end = Tensor::empty(DType::int64, {1}, Device::cuda(r));
    Tensor fused = Tensor::empty(DType::bf16, p.hidden.shape(), Device::cuda(r));
    cudaStream_t side;
    cudaEvent_t fork, join;
    check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "stream");
    check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "event");
    check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "event");
    check(cudaEventRecord(fork, main), "record");
    check(cudaStreamWaitEvent(side, fork, 0), "wait");
    LowLatencyCombineArgs ov;
    ov.overlap = true;
    ov.comp_signal = signal;
    ov.packed_recv_count = p.expert_num_tokens;
    ov.block_m = kBlockM;
    ov.threshold = static_cast<int>((H + kBlockN - 1) / kBlockN);
    ov.num_sms = o.num_sms;
    ov.send_stamps = stamps;
    pf_plain->set_next_combine_overlap(ov);
    {
      const StreamGuard on(Stream{side});
      pf_plain->combine_a(fused, experts->weight_and_reduce());
    }
    check(cudaEventRecord(join, side), "record");
    ExpertsInputs ein;
    ein.hidden = p.hidden;
    ein.w1 = a.w1;
    ein.w2 = a.w2;
    ein.expert_num_tokens = p.expert_num_tokens;
    ein.combine_signal = {signal, kBlockM, kBlockN};
    experts->apply(ein, fused);
    stamp_kernel<<<1, 1, 0, main>>>(static_cast<unsigned long long*>(gemm_end.data()));
    check(cudaGetLastError(), "stamp");
    check(cudaStreamWaitEvent(main, join, 0), "wait");
    (void)pf_plain->combine_b();
    check(cudaDeviceSynchronize(), "sync");
    long long st[2], ge = 0;
    check(cudaMemcpy(st, stamps.data(), sizeof(st), cudaMemcpyDeviceToHost), "D2H");
    check(cudaMemcpy(&ge, gemm_end.data(), sizeof(ge), cudaMemcpyDeviceToHost), "D2H");
    ro.first_send = st[0];
    ro.last_send = st[1];
    ro.last_gemm_end = ge;
    check(cudaStreamDestroy(side), "stream");
  });

  std::vector<double> plain_us(static_cast<std::size_t>(o.runs), 0), overlap_us(plain_us.size(), 0);
  bool equal = true, overlapped = true;
  for (const RankOut& ro : out) {
    for (int i = 0; i < o.runs; ++i) {
      plain_us[static_cast<std::size_t>(i)] = std::max(plain_us[static_cast<std::size_t>(i)], ro.plain_us[static_cast<std::size_t>(i)]);
      overlap_us[static_cast<std::size_t>(i)] = std::max(overlap_us[static_cast<std::size_t>(i)], ro.overlap_us[static_cast<std::size_t>(i)]);
    }
    equal = equal && ro.equal;
    overlapped = overlapped && ro.first_send != LLONG_MAX && ro.first_send < ro.last_gemm_end;
  }
  const double mp = median(plain_us), mo = median(overlap_us);
  std::printf("layer_plain   %10.1f us (median of %d, slower rank)\n", mp, o.runs);
  std::printf("layer_overlap %10.1f us (%+.1f%%)\n", mo, mp > 0 ? (mo - mp) / mp * 100.0 : 0.0);
  for (int r = 0; r < R; ++r) {
    const RankOut& ro = out[static_cast<std::size_t>(r)];
    std::printf("rank %d: first send %+.1f us, last send %+.1f us, relative to the last GEMM's end (<0: overlapped)\n", r,
                static_cast<double>(ro.first_send - ro.last_gemm_end) / 1000.0,
                static_cast<double>(ro.last_send - ro.last_gemm_end) / 1000.0);
  }
  std::printf("outputs_equal %s; first send before the last GEMM's end on every rank: %s\n", equal ? "yes" : "NO",
              overlapped ? "yes" : "NO");
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "bench_gpu_low_latency_overlap: cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::fprintf(f, "{\n  \"ranks\": %d, \"tokens\": %lld, \"hidden\": %lld, \"intermediate\": %lld, \"experts\": %d, "
                 "\"topk\": %d, \"num_sms\": %d, \"runs\": %d, \"seed\": %llu,\n",
                 R, static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(N), E, K, o.num_sms,
                 o.runs, static_cast<unsigned long long>(seed));
    std::fprintf(f, "  \"layer_plain_us\": %.2f, \"layer_overlap_us\": %.2f, \"outputs_equal\": %s,\n", mp, mo,
                 equal ? "true" : "false");
    std::fprintf(f, "  \"stamps_ns\": [");
    for (int r = 0; r < R; ++r) {
      const RankOut& ro = out[static_cast<std::size_t>(r)];
      std::fprintf(f, "%s{\"rank\": %d, \"first_send_minus_last_gemm_end\": %lld, \"last_send_minus_last_gemm_end\": %lld}",
                   r ? ", " : "", r, ro.first_send - ro.last_gemm_end, ro.last_send - ro.last_gemm_end);
    }
    std::fprintf(f, "],\n  \"first_send_before_last_gemm_end\": %s,\n", overlapped ? "true" : "false");
    std::fprintf(f, "  \"r1_note\": \"%s\"\n}\n",
                 R == 1 ? "R = 1: the combine sends only to itself, so the overlap can hide little; the side stream "
                          "and the down GEMM run expert by expert (one cuBLAS call each instead of one strided-batched "
                          "call) cost more than the hidden send"
                        : "");
    std::fclose(f);
  }
  return equal && overlapped ? 0 : 1;
}
