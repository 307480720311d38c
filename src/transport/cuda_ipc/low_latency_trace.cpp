// EPMOE_CUDA_IPC_TRACE=1 for the cuda_ipc low-latency mode: see low_latency_trace.hpp.
#if defined(EPMOE_HAVE_CUDA)

#include "transport/cuda_ipc/low_latency_trace.hpp"

#include <cstdio>

#include <fmt/format.h>

#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"

namespace epmoe::cuda_ipc_ll {

namespace {
constexpr const char* kPointNames[kNumTracePoints] = {"start",   "index",   "ids",     "writable", "sent",
                                                      "published", "counted", "arrived", "headers",  "scanned", "end"};
}

LaunchTrace::LaunchTrace(int rank) : rank_(rank) {
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&stamps_), 2 * kNumTracePoints * sizeof(long long)));
}

LaunchTrace::~LaunchTrace() {
  for (const auto& [kind, t] : sums_) {
    if (t.launches == 0) continue;
    std::string line = fmt::format(
        "epmoe cuda_ipc low-latency trace, rank {}, {} ({} launches after {} left out): us after the first block's "
        "start, first / last block to pass each point (%globaltimer):",
        rank_, kind, t.launches, t.skipped);
    for (int p = 0; p < kNumTracePoints; ++p)
      if (t.passed[p] > 0)
        line += fmt::format("  {} {:.2f}/{:.2f}", kPointNames[p], t.us[p] / t.passed[p],
                            t.us[kNumTracePoints + p] / t.passed[p]);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  cudaFree(stamps_);
}

long long* LaunchTrace::arm(cudaStream_t s) {
  armed_ = !cuda_util::capturing(s);
  if (!armed_) return nullptr;
  // 0x7f.. bytes: a large positive start for atomicMin; zeros for atomicMax.
  EPMOE_CUDA_CHECK(cudaMemsetAsync(stamps_, 0x7f, kNumTracePoints * sizeof(long long), s));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(stamps_ + kNumTracePoints, 0, kNumTracePoints * sizeof(long long), s));
  return stamps_;
}

void LaunchTrace::collect(const std::string& kind, cudaStream_t s) {
  if (!armed_) return;
  armed_ = false;
  std::array<long long, 2 * kNumTracePoints> h{};
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(h.data(), stamps_, sizeof(h), cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  Sums& t = sums_[kind];
  if (t.skipped < kWarmup) {
    ++t.skipped;
    return;
  }
  const long long start = h[kTraceStart];
  for (int p = 0; p < kNumTracePoints; ++p) {
    if (h[kNumTracePoints + p] == 0) continue;  // no block passed it
    t.us[p] += static_cast<double>(h[p] - start) / 1e3;
    t.us[kNumTracePoints + p] += static_cast<double>(h[kNumTracePoints + p] - start) / 1e3;
    ++t.passed[p];
  }
  ++t.launches;
}

}  // namespace epmoe::cuda_ipc_ll

#endif
