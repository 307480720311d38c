// Device helpers shared by the kernels of both cuda_ipc modes (cuda_ipc/normal_kernels.cu, cuda_ipc/low_latency_kernels.cu):
// system-scope release/acquire flags, %globaltimer deadlines, the host-mapped error report, a warp's row copy.
// CUDA sources only.
#pragma once

#include <cstddef>

#include "transport/cuda_ipc/error.hpp"

namespace epmoe::cuda_ipc_device {

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/// Adds v to *p with system-scope release (no value returned): after a barrier, it publishes the block's stores.
__device__ __forceinline__ void red_release_sys_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/// A system-scope acquire-release fence: what publishing through a counter or flag needs (release of this thread's
/// and, after a barrier, its block's earlier stores; acquire of what the counter's other writers released).
/// Lighter than __threadfence_system (fence.sc.sys), whose sequential consistency nothing here relies on.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
}
__device__ __forceinline__ unsigned long long read_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

/// Records an error in `h` unless one was recorded before (`claim`, a word of the reporting rank's own buffer,
/// 0 until the first error wins it; later errors are dropped). error_code is stored last, after a system fence, so
/// the host sees every field once it sees the code.
__device__ inline void report_error(int* claim, volatile cuda_ipc::ErrorRecord* h, int code, int rank, int peer,
                                    int phase, long long value, long long value2, unsigned long long index,
                                    unsigned long long seq) {
  if (atomicCAS(claim, 0, 1) != 0) return;
  h->error_rank = rank;
  h->error_peer = peer;
  h->error_phase = phase;
  h->error_value = value;
  h->error_value2 = value2;
  h->error_index = index;
  h->error_seq = seq;
  __threadfence_system();
  h->error_code = code;
  __threadfence_system();
}

/// Spins until *p >= target: false once `timeout_ns` passed (the caller reports the timeout). `sleep_ns` > 0 backs
/// off between polls.
__device__ inline bool spin_geq(const unsigned long long* p, unsigned long long target, long long timeout_ns,
                                unsigned sleep_ns = 0) {
  if (ld_acquire_sys(p) >= target) return true;
  const long long start = now_ns();
  while (ld_acquire_sys(p) < target) {
    if (sleep_ns) __nanosleep(sleep_ns);
    if (now_ns() - start > timeout_ns) return false;
  }
  return true;
}

/// One warp copies `n` 16-byte vectors from src to dst, kVec loads in flight per lane before their stores.
/// kFresh: the source was written by another GPU (read through L2 with ld.global.cg); else read-only (__ldg).
template <int kVec, bool kFresh>
__device__ __forceinline__ void warp_copy_vectors(const int4* src, int4* dst, int n, int lane) {
  for (int i0 = lane; i0 < n; i0 += 32 * kVec) {
    int4 v[kVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      if (i0 + u * 32 < n) v[u] = kFresh ? __ldcg(src + i0 + u * 32) : __ldg(src + i0 + u * 32);
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      if (i0 + u * 32 < n) dst[i0 + u * 32] = v[u];
  }
}

}  // namespace epmoe::cuda_ipc_device
