// Where a low-latency launch's time goes (EPMOE_CUDA_IPC_TRACE=1): device stamps of every launch of the cuda_ipc
// low-latency mode (the points of cuda_ipc_ll::kTrace*), summed per kind of launch and printed to stderr when the
// buffer is destroyed. A diagnosis tool: each traced launch is waited for (a host synchronisation after it), and
// launches inside a CUDA-graph capture and overlapped combines (whose signals may be produced later) are not
// traced. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <map>
#include <string>

#include "transport/cuda_ipc/low_latency_kernels.hpp"

namespace epmoe::cuda_ipc_ll {

class LaunchTrace {
 public:
  /// `rank`: printed with the figures. Allocates the device stamps on the current device.
  explicit LaunchTrace(int rank);
  ~LaunchTrace();  ///< prints the means (stderr) and frees the stamps
  LaunchTrace(const LaunchTrace&) = delete;
  LaunchTrace& operator=(const LaunchTrace&) = delete;

  /// Clears the stamps on `s` and returns them for Common::stamps (null while `s` is capturing: not traced).
  long long* arm(cudaStream_t s);
  /// After the launch on `s` that arm() armed: waits for it and adds its stamps to `kind`'s sums (the first
  /// kWarmup launches of each kind are left out).
  void collect(const std::string& kind, cudaStream_t s);

 private:
  static constexpr int kWarmup = 5;
  struct Sums {
    long long launches = 0, skipped = 0;
    std::array<double, 2 * kNumTracePoints> us{};  // first / last block, us after the first block's start
    std::array<long long, kNumTracePoints> passed{};
  };
  int rank_ = 0;
  long long* stamps_ = nullptr;  // device [2 * kNumTracePoints]
  bool armed_ = false;
  std::map<std::string, Sums> sums_;
};

}  // namespace epmoe::cuda_ipc_ll
