// The load recorder on a GPU (semantics §9): one single-block kernel per record. The ring slot lives in device
// memory and the kernel advances it, so no record needs the host (and a CUDA-graph replay records into the next
// slot, as an eager call would). Integer adds, one writer per expert: the sums are exact and order-free.
#include <algorithm>

#include "core/cuda_util.hpp"
#include "eplb/eplb.hpp"

namespace epmoe::eplb_detail {

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

}  // namespace epmoe::eplb_detail
