// Helpers of the GPU suites (tests/gpu): device copies, poisoning, bit-for-bit comparison, fast random
// fills for large buffers, and the problem sizes the GPU tests cover (hidden sizes the field uses, decode and prefill T).
#pragma once

#include <gtest/gtest.h>

#include <epmoe/group.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#define GPU_CHECK(expr)                                                                \
  do {                                                                                 \
    const cudaError_t gpu_err_ = (expr);                                               \
    ASSERT_EQ(gpu_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(gpu_err_); \
  } while (0)

namespace epmoe::gputest {

inline Device gpu() { return Device::cuda(0); }

/// A contiguous copy of a host tensor (or view) on cuda:0.
Tensor to_device(const TensorView& host);
/// A contiguous host copy of a device tensor; rows may be strided (row stride of dimension 0).
Tensor to_host(const TensorView& device);
/// Fills the device memory a view spans (any non-negative strides) with 0xff bytes (every element of every dtype
/// becomes -1 / NaN / 0xff).
void poison(const TensorView& device);
/// Waits for the legacy default stream and checks no kernel failed.
void sync_ok();

/// Index of the first differing byte of two equally sized buffers, or -1.
std::int64_t first_difference(const void* a, const void* b, std::size_t bytes);
/// Asserts the two host tensors have the same shape, dtype and bytes; names the first differing element.
::testing::AssertionResult same_bits(const TensorView& want, const TensorView& got);
/// As same_bits over the first `rows` rows only.
::testing::AssertionResult same_rows(const TensorView& want, const TensorView& got, std::int64_t rows);

/// Fast seeded fills for big host buffers (mt19937 per element is too slow for 10^8 values): finite,
/// never all zeros. bf16/float32 values are uniform-ish in [-scale, scale] with varied exponents.
void fill_random(std::uint64_t seed, const TensorView& host, float scale = 1.0f);

/// Throws std::runtime_error naming `what` when `e` is not cudaSuccess (for code that is not a test body).
void cuda_ok(cudaError_t e, const char* what);
/// A group the caller keeps alive, as the shared_ptr a Buffer takes (thread ranks of run_thread_ranks).
std::shared_ptr<Group> borrow(Group& g);
/// Copy of a contiguous host view on cuda:device (undefined stays undefined).
Tensor to_gpu(const TensorView& host, int device);
/// Row-major host copy of a view of any non-negative strides (e.g. the column-major low-latency scales): a device one
/// after the whole device is idle (undefined stays undefined).
Tensor to_cpu(const TensorView& v);

/// Visible CUDA devices (0 when the runtime finds none).
int gpu_count();
/// Thread ranks of the multi-GPU tests, rank r on cuda:r: every visible GPU, at most 8 (EPMOE_TEST_RANKS caps it);
/// 0 without a GPU.
int thread_ranks();

/// Problem sizes of the GPU tests; EPMOE_GPU_TEST_QUICK=1 (used under compute-sanitizer) keeps the small ones.
bool quick();
std::vector<std::int64_t> token_counts();  ///< {0, 1, 7, 128, 4096}
std::vector<std::int64_t> hidden_sizes();  ///< {2048, 2880, 7168}

}  // namespace epmoe::gputest
