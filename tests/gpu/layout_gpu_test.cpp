// CUDA get_dispatch_layout against the CPU one on the same inputs, bit for bit (counts and
// is_token_in_rank), over T in {0, 1, 7, 128, 4096}, K in {1, 8, 9}, E in {64, 256}, several rank counts,
// int64/int32 and strided ids, -1 entries and one expert taking every token; outputs poisoned first.
// Out-of-range ids: skipped on the GPU and reported by cuda::check_invalid_ids with the CPU's message.
#include <gtest/gtest.h>

#include <epmoe/layout.hpp>
#include <epmoe/permute.hpp>

#include <random>

#include "gpu/gpu_util.hpp"
#include "layout/layout.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::same_bits;
using gputest::to_device;
using gputest::to_host;

Tensor to_int32(const Tensor& ids) {
  Tensor t = Tensor::empty(DType::int32, ids.shape());
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    t.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(ids.ptr<std::int64_t>()[i]);
  return t;
}

// ids [T, K] inside a [T, 2K] buffer (row stride 2K), the other half filled with garbage ids.
Tensor strided_copy(const Tensor& ids, std::mt19937_64& rng, Tensor& storage) {
  const auto T = ids.size(0), K = ids.size(1);
  storage = Tensor::empty(DType::int64, {T, 2 * K});
  std::uniform_int_distribution<std::int64_t> junk(-1000, 1000);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < 2 * K; ++k)
      storage.ptr<std::int64_t>()[t * 2 * K + k] = k < K ? ids.ptr<std::int64_t>()[t * K + k] : junk(rng);
  return Tensor::wrap(TensorView(storage.data(), DType::int64, {T, K}, {2 * K, 1}, Device::cpu()), nullptr);
}

void compare(const TensorView& ids_host, int E, int R, const std::string& what) {
  const DispatchLayout cpu = get_dispatch_layout(ids_host, E, R);
  // Device copy keeping the strides: copy the whole row-strided buffer.
  Tensor dev_storage;
  TensorView dev_ids;
  if (ids_host.is_contiguous()) {
    dev_storage = to_device(ids_host);
    dev_ids = dev_storage;
  } else {
    const TensorView whole(ids_host.data, ids_host.dtype, {ids_host.size(0), ids_host.stride(0)}, Device::cpu());
    dev_storage = to_device(whole);
    dev_ids = TensorView(dev_storage.data(), ids_host.dtype, ids_host.shape, ids_host.strides, gputest::gpu());
  }
  // Public path.
  const DispatchLayout gpu = get_dispatch_layout(dev_ids, E, R);
  EXPECT_TRUE(same_bits(cpu.num_tokens_per_rank, to_host(gpu.num_tokens_per_rank))) << what;
  EXPECT_TRUE(same_bits(cpu.num_tokens_per_expert, to_host(gpu.num_tokens_per_expert))) << what;
  EXPECT_TRUE(same_bits(cpu.is_token_in_rank, to_host(gpu.is_token_in_rank))) << what;
  // Internal path into poisoned buffers.
  const std::int64_t T = ids_host.size(0);
  Tensor per_rank = Tensor::empty(DType::int32, {R}, gputest::gpu());
  Tensor per_expert = Tensor::empty(DType::int32, {E}, gputest::gpu());
  Tensor in_rank = Tensor::empty(DType::boolean, {T, R}, gputest::gpu());
  gputest::poison(per_rank);
  gputest::poison(per_expert);
  gputest::poison(in_rank);
  layout_detail::dispatch_layout_cuda(dev_ids, E, R, per_rank.ptr<std::int32_t>(), per_expert.ptr<std::int32_t>(),
                                      in_rank.ptr<bool>(), Stream{});
  gputest::sync_ok();
  EXPECT_TRUE(same_bits(cpu.num_tokens_per_rank, to_host(per_rank))) << what << " (poisoned)";
  EXPECT_TRUE(same_bits(cpu.num_tokens_per_expert, to_host(per_expert))) << what << " (poisoned)";
  EXPECT_TRUE(same_bits(cpu.is_token_in_rank, to_host(in_rank))) << what << " (poisoned)";
}

TEST(GpuDispatchLayout, MatchesCpuBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t T : gputest::token_counts())
    for (int K : {1, 8, 9})
      for (int E : {64, 256})
        for (int R : {1, 2, 8, 64})
          for (int variant = 0; variant < 3; ++variant) {
            test::RoutingOptions o;
            if (variant == 1) o.p_minus_one = 0.3;
            if (variant == 2) o.only_expert = E - 3;  // one expert takes every token
            const Tensor ids = test::random_topk_idx(rng, T, K, E, o);
            const std::string what = "T=" + std::to_string(T) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
                                     " R=" + std::to_string(R) + " variant=" + std::to_string(variant);
            compare(ids, E, R, what + " int64");
            if (R == 8) {
              compare(to_int32(ids), E, R, what + " int32");
              Tensor storage;
              compare(strided_copy(ids, rng, storage), E, R, what + " strided");
            }
            if (HasFailure()) return;
          }
}

TEST(GpuDispatchLayout, ManyRanksNeedSeveralMaskWords) {
  std::mt19937_64 rng(test::fresh_seed());
  // R = 256 ranks of one expert each (8 words of rank bits), and E + R beyond the shared-memory counters.
  compare(test::random_topk_idx(rng, 300, 9, 256, {0.2, -1}), 256, 256, "R=256");
  compare(test::random_topk_idx(rng, 200, 8, 16384, {0.1, -1}), 16384, 16, "E=16384");
}

// Bad ids: the CPU throws; the GPU skips them, and check_invalid_ids throws the CPU's message for the
// first one in row-major order, then the flag is clear again.
TEST(GpuDispatchLayout, OutOfRangeIdsAreFlaggedAndReportedLikeTheCpu) {
  std::mt19937_64 rng(test::fresh_seed());
  Tensor ids = test::random_topk_idx(rng, 64, 8, 64, {});
  ids.ptr<std::int64_t>()[9 * 8 + 0] = -7;
  ids.ptr<std::int64_t>()[5 * 8 + 2] = 300;
  ids.ptr<std::int64_t>()[40 * 8 + 7] = 64;
  std::string cpu_message;
  try {
    get_dispatch_layout(ids, 64, 4);
  } catch (const Error& e) {
    cpu_message = e.what();
  }
  ASSERT_NE(cpu_message.find("300 at [5, 2]"), std::string::npos) << cpu_message;
  const Tensor dev = to_device(ids);
  ASSERT_NO_THROW(cuda::check_invalid_ids());  // nothing flagged yet
  const DispatchLayout gpu = get_dispatch_layout(dev, 64, 4);
  try {
    cuda::check_invalid_ids();
    ADD_FAILURE() << "check_invalid_ids did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(std::string(e.what()), cpu_message);
  }
  EXPECT_NO_THROW(cuda::check_invalid_ids());  // cleared
  // The valid ids were counted as the CPU counts them without the bad ones.
  Tensor cleaned = Tensor::empty(DType::int64, ids.shape());
  for (std::int64_t i = 0; i < ids.numel(); ++i) {
    const std::int64_t v = ids.ptr<std::int64_t>()[i];
    cleaned.ptr<std::int64_t>()[i] = v < -1 || v >= 64 ? -1 : v;
  }
  const DispatchLayout want = get_dispatch_layout(cleaned, 64, 4);
  EXPECT_TRUE(same_bits(want.num_tokens_per_expert, to_host(gpu.num_tokens_per_expert)));
  EXPECT_TRUE(same_bits(want.num_tokens_per_rank, to_host(gpu.num_tokens_per_rank)));
  EXPECT_TRUE(same_bits(want.is_token_in_rank, to_host(gpu.is_token_in_rank)));
}

}  // namespace
}  // namespace epmoe
