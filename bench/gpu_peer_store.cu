// How fast can SMs store into a peer GPU over NVLink, and how many SMs does it take? (PERF.md "Leads": SM
// stores reach about 20 of 25 GB/s per link; copy engines the full peer rate.) This decides the cuda_ipc
// data path: SM stores straight into the receiver's buffer versus a local gather plus copy-engine copies.
//
// Two GPUs, both directions at once (as in dispatch/combine). For each block count B, one kernel per GPU
// streams `bytes` from local memory into the other GPU's memory with 16-byte vector stores (V vectors in
// flight per thread); variants: remote only, remote + the same bytes stored locally (a dispatch row goes to
// both ranks), 512 or 1024 threads. Beside them: cudaMemcpyPeerAsync both ways at once, and a local d2d copy.
// Figures: median of 20 runs, GB/s per direction.
//
// Usage: bench_gpu_peer_store [--mib N] [--json PATH]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_peer_store: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int V>
__global__ void store_kernel(const int4* __restrict__ src, int4* remote, int4* local, long long n) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i0 = static_cast<long long>(blockIdx.x) * blockDim.x * V + threadIdx.x; i0 < n; i0 += stride * V) {
    int4 v[V];
#pragma unroll
    for (int u = 0; u < V; ++u)
      if (i0 + u * blockDim.x < n) v[u] = __ldg(src + i0 + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < V; ++u)
      if (i0 + u * blockDim.x < n) {
        remote[i0 + u * blockDim.x] = v[u];
        if (local) local[i0 + u * blockDim.x] = v[u];
      }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  long long mib = 56;
  std::string json;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--mib")) mib = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--json")) json = argv[i + 1];
  }
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count < 2) {
    std::printf("bench_gpu_peer_store: needs 2 GPUs (found %d)\n", count);
    return 77;
  }
  const size_t bytes = static_cast<size_t>(mib) << 20;
  const long long n = static_cast<long long>(bytes / 16);
  void *src[2], *dst[2], *loc[2];
  cudaStream_t st[2];
  cudaEvent_t e0[2], e1[2];
  for (int d = 0; d < 2; ++d) {
    check(cudaSetDevice(d), "set");
    cudaDeviceEnablePeerAccess(1 - d, 0);
    cudaGetLastError();
    check(cudaMalloc(&src[d], bytes), "malloc");
    check(cudaMalloc(&dst[d], bytes), "malloc");
    check(cudaMalloc(&loc[d], bytes), "malloc");
    check(cudaMemset(src[d], d + 1, bytes), "memset");
    check(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking), "stream");
    check(cudaEventCreate(&e0[d]), "event");
    check(cudaEventCreate(&e1[d]), "event");
  }
  auto time_both = [&](auto&& launch) {
    std::vector<double> t;
    for (int run = 0; run < 23; ++run) {
      for (int d = 0; d < 2; ++d) {
        check(cudaSetDevice(d), "set");
        check(cudaDeviceSynchronize(), "sync");
      }
      for (int d = 0; d < 2; ++d) {
        check(cudaSetDevice(d), "set");
        check(cudaEventRecord(e0[d], st[d]), "record");
        launch(d);
        check(cudaEventRecord(e1[d], st[d]), "record");
      }
      double worst = 0;
      for (int d = 0; d < 2; ++d) {
        check(cudaSetDevice(d), "set");
        check(cudaEventSynchronize(e1[d]), "sync");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, e0[d], e1[d]), "elapsed");
        worst = std::max(worst, static_cast<double>(ms));
      }
      if (run >= 3) t.push_back(worst * 1e3);
    }
    return median(t);
  };
  std::FILE* js = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  if (js) std::fprintf(js, "{\"bytes_per_direction\": %zu, \"results\": [\n", bytes);
  bool first = true;
  auto report = [&](const char* what, int blocks, int threads, int vec, double us) {
    const double gbs = static_cast<double>(bytes) / (us * 1e3);
    std::printf("%-34s blocks %3d threads %4d vec %d: %8.1f us  %6.1f GB/s per direction\n", what, blocks, threads,
                vec, us, gbs);
    if (js)
      std::fprintf(js,
                   "%s{\"what\": \"%s\", \"blocks\": %d, \"threads\": %d, \"vec\": %d, \"us\": %.2f, \"gbs\": %.1f}",
                   first ? "" : ",\n", what, blocks, threads, vec, us, gbs);
    first = false;
  };
  std::printf("bytes per direction: %zu (both GPUs send at once)\n", bytes);
  const double ce = time_both([&](int d) {
    check(cudaMemcpyPeerAsync(dst[1 - d], 1 - d, src[d], d, bytes, st[d]), "peer copy");
  });
  report("copy engine, both directions", 0, 0, 0, ce);
  // Pull: each GPU's copy engine reads the peer's memory into its own (the receiver drives the copy).
  const double pull = time_both([&](int d) {
    check(cudaMemcpyAsync(dst[d], src[1 - d], bytes, cudaMemcpyDeviceToDevice, st[d]), "peer pull");
  });
  report("copy engine pull, both directions", 0, 0, 0, pull);
  // The same bytes in 8 copies (a dispatch pulls one contiguous run per source and field).
  const double ce8 = time_both([&](int d) {
    for (int c = 0; c < 8; ++c)
      check(cudaMemcpyAsync(static_cast<char*>(dst[d]) + c * (bytes / 8),
                            static_cast<const char*>(src[1 - d]) + c * (bytes / 8), bytes / 8,
                            cudaMemcpyDeviceToDevice, st[d]),
            "peer pull");
  });
  report("copy engine pull, 8 pieces", 0, 0, 0, ce8);
  const double d2d = time_both([&](int d) {
    if (d == 0) check(cudaMemcpyAsync(loc[0], src[0], bytes, cudaMemcpyDeviceToDevice, st[0]), "d2d");
  });
  report("local d2d copy (GPU 0 only)", 0, 0, 0, d2d);
  for (int threads : {512, 1024}) {
    for (int blocks : {4, 8, 12, 16, 20, 24, 32, 48, 64, 132}) {
      const double us = time_both([&](int d) {
        store_kernel<4><<<blocks, threads, 0, st[d]>>>(static_cast<const int4*>(src[d]),
                                                       static_cast<int4*>(dst[1 - d]), nullptr, n);
      });
      report("SM stores, remote only", blocks, threads, 4, us);
    }
  }
  for (int blocks : {8, 16, 24, 32}) {
    const double us = time_both([&](int d) {
      store_kernel<8><<<blocks, 512, 0, st[d]>>>(static_cast<const int4*>(src[d]), static_cast<int4*>(dst[1 - d]),
                                                 nullptr, n);
    });
    report("SM stores, remote only", blocks, 512, 8, us);
  }
  for (int blocks : {8, 16, 24, 32, 48}) {
    const double us = time_both([&](int d) {
      store_kernel<4><<<blocks, 512, 0, st[d]>>>(static_cast<const int4*>(src[d]), static_cast<int4*>(dst[1 - d]),
                                                 static_cast<int4*>(loc[d]), n);
    });
    report("SM stores, remote + local copy", blocks, 512, 4, us);
  }
  if (js) {
    std::fprintf(js, "\n]}\n");
    std::fclose(js);
  }
  return 0;
}
