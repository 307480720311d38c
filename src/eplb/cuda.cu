// The EPLB stage on a GPU: the CUDA twins of the id mappings (map_to_physical, the no-EP expert_map; one thread
// per (t, k) entry) and the load recorder (one single-block kernel per record; eplb.hpp).
#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"
#include "eplb/eplb.hpp"

#include <algorithm>

namespace epmoe::eplb_cuda {

namespace {

constexpr int kThreads = 256;

template <typename Id>
__global__ void map_to_physical_kernel(const Id* __restrict__ in, Id* __restrict__ out, std::int64_t n, int K,
                                       const std::int64_t* __restrict__ l2p, const std::int64_t* __restrict__ cnt,
                                       std::int64_t E, std::int64_t X, std::int64_t P) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = static_cast<std::int64_t>(in[i]);
    std::int64_t v;
    if (e == -1 || e < -1) {
      v = e;
    } else if (e >= E) {
      v = e - E + P;  // stays out of range, so the dispatch flags it
    } else {
      const std::int64_t t = i / K;
      v = l2p[e * X + t % cnt[e]];
    }
    out[i] = static_cast<Id>(v);
  }
}

template <typename Id>
__global__ void apply_expert_map_kernel(const Id* __restrict__ in, Id* __restrict__ out, std::int64_t n,
                                        const std::int32_t* __restrict__ map, std::int64_t E, std::int64_t E_local) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t g = static_cast<std::int64_t>(in[i]);
    const std::int64_t v = g < 0 ? g : (g >= E ? g - E + E_local : static_cast<std::int64_t>(map[g]));
    out[i] = static_cast<Id>(v);
  }
}

int blocks_for(std::int64_t n) {
  return static_cast<int>(std::min<std::int64_t>(cuda_util::ceil_div(n, kThreads), 4096));
}

}  // namespace

void map_to_physical(const TensorView& topk_idx, const std::int64_t* logical_to_physical,
                     const std::int64_t* logical_replica_count, std::int64_t num_logical_experts,
                     std::int64_t max_replicas, std::int64_t num_physical_experts, const TensorView& out,
                     Stream stream) {
  const std::int64_t n = topk_idx.numel();
  if (n == 0) return;
  const int K = static_cast<int>(topk_idx.size(1));
  const cudaStream_t s = cuda_util::to_cuda(stream);
  if (topk_idx.dtype == DType::int64)
    map_to_physical_kernel<<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<const std::int64_t*>(topk_idx.data), static_cast<std::int64_t*>(out.data), n, K,
        logical_to_physical, logical_replica_count, num_logical_experts, max_replicas, num_physical_experts);
  else
    map_to_physical_kernel<<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<const std::int32_t*>(topk_idx.data), static_cast<std::int32_t*>(out.data), n, K,
        logical_to_physical, logical_replica_count, num_logical_experts, max_replicas, num_physical_experts);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void apply_expert_map(const TensorView& topk_idx, const std::int32_t* expert_map, std::int64_t num_experts,
                      std::int64_t num_local_experts, const TensorView& out, Stream stream) {
  const std::int64_t n = topk_idx.numel();
  if (n == 0) return;
  const cudaStream_t s = cuda_util::to_cuda(stream);
  if (topk_idx.dtype == DType::int64)
    apply_expert_map_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<const std::int64_t*>(topk_idx.data),
                                                               static_cast<std::int64_t*>(out.data), n, expert_map,
                                                               num_experts, num_local_experts);
  else
    apply_expert_map_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<const std::int32_t*>(topk_idx.data),
                                                               static_cast<std::int32_t*>(out.data), n, expert_map,
                                                               num_experts, num_local_experts);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes) EPMOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_to_device_async(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes) EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_util::to_cuda(stream)));
}

}  // namespace epmoe::eplb_cuda

// The load recorder on a GPU (semantics §9): one single-block kernel per record. The ring slot lives in device
// memory and the kernel advances it, so no record needs the host (and a CUDA-graph replay records into the next
// slot, as an eager call would). Integer adds, one writer per expert: the sums are exact and order-free.
namespace epmoe::eplb_cuda {

namespace {

template <class Count>
__global__ void record_loads_kernel(const Count* __restrict__ counts, std::int64_t stride, std::int64_t n,
                                    std::int64_t offset, std::int64_t E, std::int64_t W, std::int64_t* history,
                                    std::int64_t* sums, std::int64_t* held, std::int64_t* next) {
  __shared__ std::int64_t slot;
  if (threadIdx.x == 0) slot = *next;
  __syncthreads();
  std::int64_t* row = history + slot * E;
  for (std::int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const std::int64_t v = e >= offset && e < offset + n ? static_cast<std::int64_t>(counts[(e - offset) * stride]) : 0;
    sums[e] += v - row[e];  // the slot holds the record dropping out (zeros until the window is full)
    row[e] = v;
  }
  // Thread 0 alone read *next (before the barrier): no other thread reads it afterwards.
  if (threadIdx.x == 0) {
    *next = (slot + 1) % W;
    *held = *held < W ? *held + 1 : W;
  }
}

}  // namespace

void record_loads_cuda(int device, const TensorView& counts, std::int64_t expert_offset, std::int64_t num_experts,
                       std::int64_t window, std::int64_t* history, std::int64_t* sums, std::int64_t* held,
                       std::int64_t* next, Stream stream) {
  cuda_util::DeviceGuard guard(device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const int threads = static_cast<int>(std::min<std::int64_t>(1024, (num_experts + 31) / 32 * 32));
  const std::int64_t n = counts.numel(), stride = n > 0 ? counts.stride(0) : 1;
  if (counts.dtype == DType::int64)
    record_loads_kernel<std::int64_t><<<1, threads, 0, s>>>(static_cast<const std::int64_t*>(counts.data), stride, n,
                                                            expert_offset, num_experts, window, history, sums, held,
                                                            next);
  else
    record_loads_kernel<std::int32_t><<<1, threads, 0, s>>>(static_cast<const std::int32_t*>(counts.data), stride, n,
                                                            expert_offset, num_experts, window, history, sums, held,
                                                            next);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void zero_cuda(int device, void* p, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  cuda_util::DeviceGuard guard(device);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_util::to_cuda(stream)));
}

void copy_to_host_cuda(int device, void* dst, const void* src, std::size_t bytes, Stream stream) {
  cuda_util::DeviceGuard guard(device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  if (bytes) EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
}

void synchronize_cuda(int device, Stream stream) {
  cuda_util::DeviceGuard guard(device);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_util::to_cuda(stream)));
}

}  // namespace epmoe::eplb_cuda
