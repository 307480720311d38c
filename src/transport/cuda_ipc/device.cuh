// Device helpers shared by the kernels of both cuda_ipc modes (cuda_ipc/normal_kernels.cu,
// cuda_ipc/low_latency_kernels.cu): release/acquire flags (gpu scope for a rank's own, system scope across ranks),
// %globaltimer deadlines, the host-mapped error report, a warp's row copy, bulk copies (TMA) through shared memory.
// CUDA sources only.
#pragma once

#include <cstddef>

#include "transport/cuda_ipc/error.hpp"

namespace epmoe::cuda_ipc_device {

// The flag operations at one scope: ld_acquire_<scope>, st_release_<scope>, red_release_<scope>_add (the add returns
// no value; after a barrier it publishes the block's stores). PTX names the scope in the instruction, hence a macro.
// sys: what crosses ranks (another GPU, or another process). gpu: a flag that one rank both writes and reads (its
// own, peer == rank) never leaves the GPU: a system-scope release waits until the block's stores are visible to
// every device and the host, a gpu-scope one only until the GPU's L2 has them.
#define EPMOE_CUDA_IPC_FLAG_OPS(scope)                                                                   \
  __device__ __forceinline__ unsigned long long ld_acquire_##scope(const unsigned long long* p) {       \
    unsigned long long v;                                                                                \
    asm volatile("ld.acquire." #scope ".global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");           \
    return v;                                                                                            \
  }                                                                                                      \
  __device__ __forceinline__ void st_release_##scope(unsigned long long* p, unsigned long long v) {      \
    asm volatile("st.release." #scope ".global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");             \
  }                                                                                                      \
  __device__ __forceinline__ void red_release_##scope##_add(unsigned long long* p, unsigned long long v) { \
    asm volatile("red.release." #scope ".global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");        \
  }
EPMOE_CUDA_IPC_FLAG_OPS(sys)
EPMOE_CUDA_IPC_FLAG_OPS(gpu)
#undef EPMOE_CUDA_IPC_FLAG_OPS
/// The same three with the scope picked by `local` (the flag's writer and reader are one rank): gpu, else sys.
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p, bool local) {
  return local ? ld_acquire_gpu(p) : ld_acquire_sys(p);
}
__device__ __forceinline__ void st_release(unsigned long long* p, unsigned long long v, bool local) {
  if (local)
    st_release_gpu(p, v);
  else
    st_release_sys(p, v);
}
__device__ __forceinline__ void red_release_add(unsigned long long* p, unsigned long long v, bool local) {
  if (local)
    red_release_gpu_add(p, v);
  else
    red_release_sys_add(p, v);
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
/// off between polls. `local`: the flag's writer is this GPU's own rank (gpu-scope acquire; else system scope).
__device__ inline bool spin_geq(const unsigned long long* p, unsigned long long target, long long timeout_ns,
                                unsigned sleep_ns = 0, bool local = false) {
  if (ld_acquire(p, local) >= target) return true;
  const long long start = now_ns();
  while (ld_acquire(p, local) < target) {
    if (sleep_ns) __nanosleep(sleep_ns);
    if (now_ns() - start > timeout_ns) return false;
  }
  return true;
}

// ---- bulk copies (TMA, sm_90): global -> shared under an mbarrier, shared -> global in bulk groups ----
// PTX ISA, "Data movement: cp.async.bulk" and "mbarrier". Addresses 16-byte aligned, sizes multiples of 16. They hold
// no registers per byte in flight, which is what a copy bound by load latency needs.

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
/// Initializes an mbarrier expecting one arrival per phase, visible to the async proxy before its first bulk load.
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/// Orders this thread's view of global memory (what its acquires made visible) before its later bulk loads.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
/// Loads `bytes` from global `src` into shared `dst`; `bar` completes its phase once they landed.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
/// Stores `bytes` from shared `src` to global `dst` as one bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
/// Prefetches `bytes` at global `src` into the L2: one request, nothing to wait for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
/// Waits until this thread's bulk stores have read their shared memory (the buffers may be written again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/// Waits for phase `parity` of `bar`: false once `timeout_ns` passed.
__device__ inline bool mbar_wait(unsigned long long* bar, unsigned parity, long long timeout_ns) {
  const auto done = [&] {
    unsigned ok;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return ok != 0;
  };
  if (done()) return true;
  const long long start = now_ns();
  while (!done())
    if (now_ns() - start > timeout_ns) return false;
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
