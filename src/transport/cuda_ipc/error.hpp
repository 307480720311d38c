// The host-mapped error record both cuda_ipc modes' kernels report to (normal: cuda_ipc/normal_kernels.hpp's HostRecord,
// low-latency: cuda_ipc/low_latency_kernels.hpp's). Plain C++ (no CUDA): included by host sources and .cu files.
#pragma once

namespace epmoe::cuda_ipc {

/// The first error a rank's kernels found (cudaHostAlloc mapped; cuda_ipc/device.cuh's report_error writes it,
/// error_code last). Codes and phases are each mode's own; error_code 0 means none.
struct ErrorRecord {
  int error_code, error_rank, error_peer, error_phase;
  long long error_value, error_value2;
  unsigned long long error_index;  // normal: the mismatching setting; low-latency: the call
  unsigned long long error_seq;    // normal: the op's sequence number; low-latency: unused (0)
};

}  // namespace epmoe::cuda_ipc
