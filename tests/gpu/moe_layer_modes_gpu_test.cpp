// The MoE layer's per-forward machinery on GPU ranks (semantics §8): DispatchMode::automatic on one cuda_ipc Buffer
// (normal mode for prefill batches, low-latency mode for decode batches, the low-latency buffer cleaned on each
// switch) and the dispatch hooks run between dispatch_a and dispatch_b (order, once per forward, removal), with
// the CUDA experts, R = thread_ranks() thread ranks (rank r on cuda:r; R = 1 sends to itself). Every forward's
// output is checked against the independent float64 layer reference and against the same layer on CPU ranks
// (threads backend, BLAS experts) by gputest::check_layer_case; the modes chosen, the cleans counted and the hook
// calls are checked against hand-written expectations, the same on both kinds of ranks. Fresh random inputs per
// call (seed logged), outputs poisoned (0xff) first.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "gpu/moe_layer_test_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::borrow;
using gputest::cuda_ok;

constexpr int kLogWidth = 72;

struct Case : gputest::LayerCase {
  int E = 16, tmax = 32;
  Case() { K = 4; }
  std::string name(const std::string& what) const {
    return what + " H=" + std::to_string(H) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
           (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16");
  }
};

// A buffer holding both modes: normal-mode bytes for T up to the largest per-rank count, low-latency bytes for tmax.
std::shared_ptr<Buffer> make_buffer(Group& g, const Case& c, int R, bool gpu) {
  BufferOptions bo;
  if (!gpu) {
    bo.backend = Backend::threads;
    return std::make_shared<Buffer>(borrow(g), bo);
  }
  cuda_ok(cudaSetDevice(g.rank()), "cudaSetDevice");
  bo.backend = Backend::cuda_ipc;
  bo.device = g.rank();
  const std::int64_t t_max = std::max<std::int64_t>(1, *std::max_element(c.T.begin(), c.T.end()));
  bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(t_max, c.H, R, c.K);
  bo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(c.tmax, c.H, R, c.E);
  bo.low_latency_mode = true;
  return std::make_shared<Buffer>(borrow(g), bo);
}

std::shared_ptr<Experts> make_experts(ActivationFormat format, bool gpu) {
  ExpertsConfig ec;
  ec.format = format;
  return std::shared_ptr<Experts>(gpu ? make_cuda_experts(ec) : make_blas_experts(ec));
}

// Prefill, decode (a switch: clean), decode, prefill, decode (clean), prefill, decode (clean).
const std::vector<bool> kExtend{true, false, false, true, false, true, false};
const std::vector<std::string> kModes{"normal", "low_latency", "low_latency", "normal",
                                      "low_latency", "normal", "low_latency"};
constexpr std::int64_t kCleans = 3;

TEST(GpuMoELayerAutomaticMode, AlternatingPrefillAndDecodeMatchesFloat64AndTheCpuRanks) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{7168}})
    for (int wire = 0; wire < 2; ++wire) {
      Case c;
      c.H = H;
      c.fp8 = wire == 1;
      c.T = {32, 9, 0, 17};  // T = Tmax on rank 0, a rank with no tokens when R >= 3
      c.forwards = static_cast<int>(kExtend.size());
      const std::string name = c.name("automatic");
      // [gpu][rank]: the modes each forward resolved to, and the cleans.
      std::vector<std::vector<std::vector<std::string>>> modes(2);
      std::vector<std::vector<std::int64_t>> cleans(2);
      const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
        gputest::Outs outs(static_cast<std::size_t>(R));
        auto& my_modes = modes[gpu ? 1 : 0];
        auto& my_cleans = cleans[gpu ? 1 : 0];
        my_modes.assign(static_cast<std::size_t>(R), {});
        my_cleans.assign(static_cast<std::size_t>(R), -1);
        run_thread_ranks(R, [&](Group& g) {
          const int r = g.rank();
          const auto ru = static_cast<std::size_t>(r);
          MoELayer layer(make_buffer(g, c, R, gpu), DispatchMode::automatic, c.tmax,
                         make_experts(ActivationFormat::standard, gpu),
                         make_experts(ActivationFormat::batched_experts, gpu), c.options());
          const gputest::ExpertWeights w = gputest::rank_weights(m, r, c.E / R, gpu);
          for (int f = 0; f < c.forwards; ++f) {
            const bool extend = kExtend[static_cast<std::size_t>(f)];
            outs[ru].push_back(gputest::forward_checked(
                layer, c, name, in[ru][static_cast<std::size_t>(f)], w, c.E, r, gpu, /*give_output=*/f % 2 == 0,
                [extend](MoEForwardArgs& a) { a.is_extend_in_batch = extend; }));
            my_modes[ru].emplace_back(dispatch_mode_name(layer.last_resolved_mode()));
          }
          my_cleans[ru] = layer.num_low_latency_cleans();
          if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
        });
        return outs;
      };
      gputest::check_layer_case(c, name, seed + i++, [&](int) { return c.E; }, run, kLogWidth);
      for (int gpu = 0; gpu < 2; ++gpu)
        for (std::size_t r = 0; r < modes[static_cast<std::size_t>(gpu)].size(); ++r) {
          EXPECT_EQ(modes[static_cast<std::size_t>(gpu)][r], kModes) << name << (gpu ? " GPU" : " CPU") << " rank " << r;
          EXPECT_EQ(cleans[static_cast<std::size_t>(gpu)][r], kCleans) << name << (gpu ? " GPU" : " CPU") << " rank " << r;
        }
    }
}

// Forward 0 runs with no hook, forward 1 with `first` then `second`, forward 2 with `first` (second's handle
// destroyed), forward 3 with none (first removed, twice).
const std::vector<std::string> kHookCalls{"forward",
                                          "forward", "first:AFTER_DISPATCH_A", "second:AFTER_DISPATCH_A",
                                          "forward", "first:AFTER_DISPATCH_A",
                                          "forward"};

TEST(GpuMoELayerDispatchHooks, RunOncePerForwardInOrderAndRemovalWorksInBothModes) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (DispatchMode mode : {DispatchMode::normal, DispatchMode::low_latency}) {
    Case c;
    c.forwards = 4;
    c.T = {24, 9};
    const std::string name = c.name(std::string("hooks ") + std::string(dispatch_mode_name(mode)));
    std::vector<std::vector<std::vector<std::string>>> calls(2);  // [gpu][rank]
    const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
      gputest::Outs outs(static_cast<std::size_t>(R));
      auto& my_calls = calls[gpu ? 1 : 0];
      my_calls.assign(static_cast<std::size_t>(R), {});
      run_thread_ranks(R, [&](Group& g) {
        const int r = g.rank();
        const auto ru = static_cast<std::size_t>(r);
        const bool ll = mode == DispatchMode::low_latency;
        MoELayer layer(make_buffer(g, c, R, gpu), mode, c.tmax,
                       ll ? nullptr : make_experts(ActivationFormat::standard, gpu),
                       ll ? make_experts(ActivationFormat::batched_experts, gpu) : nullptr, c.options());
        auto& log = my_calls[ru];
        const auto hook = [&log](std::string who) {
          return [&log, who](PrepareFinalize& pf) { log.push_back(who + ":" + std::string(stage_name(pf.stage()))); };
        };
        const gputest::ExpertWeights w = gputest::rank_weights(m, r, c.E / R, gpu);
        const auto forward = [&](int f) {
          log.emplace_back("forward");
          outs[ru].push_back(gputest::forward_checked(layer, c, name, in[ru][static_cast<std::size_t>(f)], w, c.E, r,
                                                      gpu, /*give_output=*/true));
        };
        forward(0);
        DispatchHookHandle first = layer.register_dispatch_hook(hook("first"));
        {
          DispatchHookHandle second = layer.register_dispatch_hook(hook("second"));
          EXPECT_EQ(layer.num_dispatch_hooks(), 2u);
          forward(1);
        }
        forward(2);
        first.remove();
        first.remove();  // a no-op
        EXPECT_FALSE(first.active());
        EXPECT_EQ(layer.num_dispatch_hooks(), 0u);
        forward(3);
        if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
      });
      return outs;
    };
    gputest::check_layer_case(c, name, seed + i++, [&](int) { return c.E; }, run, kLogWidth);
    for (int gpu = 0; gpu < 2; ++gpu)
      for (std::size_t r = 0; r < calls[static_cast<std::size_t>(gpu)].size(); ++r)
        EXPECT_EQ(calls[static_cast<std::size_t>(gpu)][r], kHookCalls) << name << (gpu ? " GPU" : " CPU") << " rank " << r;
  }
}

}  // namespace
}  // namespace epmoe
