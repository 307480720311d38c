// Device time stamps (globaltimer.hpp).
#include "gpu/globaltimer.hpp"

namespace epmoe::gputest {
namespace {

__device__ __forceinline__ std::uint64_t globaltimer() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void stamp_kernel(std::uint64_t* slot) { *slot = globaltimer(); }

__global__ void spin_kernel(std::uint64_t ns) {
  const std::uint64_t start = globaltimer();
  while (globaltimer() - start < ns) {
  }
}

}  // namespace

void stamp_globaltimer(std::uint64_t* slot, cudaStream_t stream) { stamp_kernel<<<1, 1, 0, stream>>>(slot); }

void spin_globaltimer(std::uint64_t ns, cudaStream_t stream) { spin_kernel<<<1, 1, 0, stream>>>(ns); }

}  // namespace epmoe::gputest
