// cuda_ipc low-latency mode with one process per GPU (the MPI layout): the window is mapped through CUDA IPC
// handles exchanged over MPI; outputs bit for bit against the threads backend on the same inputs (every rank
// regenerates every rank's inputs and runs the threads reference in-process). Skipped where the host has fewer
// GPUs than ranks (CI: no GPU) unless EPMOE_TEST_SHARE_GPU=1, where ranks share the GPUs there are (rank % count,
// processes time-slice a GPU): the protocol on a one-GPU machine, not its speed.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/mpi.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mpi/compare.hpp"
#include "mpi/mpi_test_util.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <cuda_runtime.h>

namespace epmoe::test {
namespace {

constexpr int kTmax = 64;

struct Inputs {
  Tensor x, idx, w, y;
};

Inputs make_inputs(std::uint64_t seed, int rank, int call, int R, std::int64_t H, int K, int E) {
  auto rng = rank_rng(seed, rank, 100 + static_cast<std::uint64_t>(call));
  const std::int64_t T = rank == 1 ? 0 : 1 + static_cast<std::int64_t>(rng() % kTmax);  // rank 1: zero tokens
  Inputs in;
  in.x = random_bf16(rng, T, H, 2.0f);
  RoutingOptions o;
  o.p_minus_one = 0.2;
  in.idx = random_topk_idx(rng, T, K, E, o);
  in.w = random_topk_weights(rng, in.idx);
  const Tensor y2 = random_bf16(rng, static_cast<std::int64_t>(E / R) * R * kTmax, H, 2.0f);
  in.y = Tensor::empty(DType::bf16, {E / R, static_cast<std::int64_t>(R) * kTmax, H});
  std::memcpy(in.y.data(), y2.data(), y2.nbytes());
  return in;
}

struct Out {
  std::vector<Tensor> t;  // per call: count, layout_range, packed_x (valid rows), scales (valid rows), src_info
                          // (valid rows), combined_x
};

/// The valid rows [0, count[e]) of each expert of a [E_local, rows, ...] view, concatenated (host).
Tensor valid_rows(const TensorView& v, const Tensor& count) {
  if (!v.defined()) return {};
  const Tensor all = to_cpu(v);
  const std::int64_t El = v.size(0), rows = v.size(1);
  const std::size_t rb = static_cast<std::size_t>(v.ndim() == 3 ? v.size(2) : 1) * dtype_size(v.dtype);
  std::vector<char> bytes;
  for (std::int64_t e = 0; e < El; ++e) {
    const char* p = static_cast<const char*>(all.data()) + static_cast<std::size_t>(e * rows) * rb;
    bytes.insert(bytes.end(), p, p + static_cast<std::size_t>(count.ptr<std::int32_t>()[e]) * rb);
  }
  Tensor out = Tensor::empty(DType::int8, {static_cast<std::int64_t>(bytes.size())});
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

/// Three dispatch + combine pairs (the second with hooks), fp8 or bf16.
Out run(Buffer& buf, std::uint64_t seed, int R, std::int64_t H, int K, int E, bool fp8, int device) {
  const bool gpu = device >= 0;
  auto put = [&](const Tensor& t) { return gpu ? to_gpu(t, device) : t; };
  Out o;
  for (int call = 0; call < 3; ++call) {
    const Inputs in = make_inputs(seed, buf.rank(), call, R, H, K, E);
    const Tensor x = put(in.x), idx = put(in.idx), w = put(in.w);
    LowLatencyDispatchArgs a;
    a.x = x;
    a.topk_idx = idx;
    a.topk_weights = w;
    a.num_max_dispatch_tokens_per_rank = kTmax;
    a.num_experts = E;
    a.use_fp8 = fp8;
    a.round_scale = fp8;
    a.use_ue8m0 = fp8;
    a.return_recv_hook = call == 1;
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(a);
    if (call == 1) d.hook();
    const Tensor count = to_cpu(d.packed_recv_count);
    o.t.push_back(count);
    o.t.push_back(to_cpu(d.handle.layout_range));
    o.t.push_back(valid_rows(d.packed_recv_x, count));
    o.t.push_back(valid_rows(d.packed_recv_x_scales, count));
    o.t.push_back(valid_rows(d.handle.src_info, count));
    const Tensor y = put(in.y);
    LowLatencyCombineArgs ca;
    ca.x = y;
    ca.topk_idx = idx;
    ca.topk_weights = w;
    ca.handle = &d.handle;
    ca.return_recv_hook = call == 1;
    const LowLatencyCombineResult cr = buf.low_latency_combine(ca);
    if (call == 1) cr.hook();
    o.t.push_back(to_cpu(cr.combined_x));
  }
  return o;
}

TEST(MpiCudaIpcLowLatency, OneProcessPerGpuMatchesTheThreadsBackend) {
  const int R = world_size(), me = world_rank();
  const std::optional<int> gpu = rank_device(R, me);
  if (!gpu) GTEST_SKIP() << "needs one GPU per rank (" << R << "), found " << gpus();
  const int device = *gpu;
  const std::uint64_t seed = shared_seed();
  const int K = 4, E = 8 * R;
  for (const std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{7168}})
    for (const bool fp8 : {false, true}) {
      SCOPED_TRACE("hidden " + std::to_string(H) + (fp8 ? " fp8/ue8m0" : " bf16"));
      std::vector<Out> want(static_cast<std::size_t>(R));
      run_thread_ranks(R, [&](Group& g) {
        BufferOptions co;
        co.backend = Backend::threads;
        Buffer cpu(std::shared_ptr<Group>(&g, [](Group*) {}), co);
        want[static_cast<std::size_t>(g.rank())] = run(cpu, seed, R, H, K, E, fp8, -1);
      });
      cuda_ok(cudaSetDevice(device), "cudaSetDevice");
      BufferOptions o;
      o.backend = Backend::cuda_ipc;
      o.device = device;
      o.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, H, R, K);  // normal mode unused
      Buffer buf(test_group(), o);
      const Out got = run(buf, seed, R, H, K, E, fp8, device);
      const Out& ref = want[static_cast<std::size_t>(me)];
      ASSERT_EQ(got.t.size(), ref.t.size());
      const char* names[] = {"packed_recv_count",    "layout_range", "packed_recv_x",
                             "packed_recv_x_scales", "src_info",     "combined_x"};
      for (std::size_t i = 0; i < got.t.size(); ++i) {
        if (!ref.t[i].defined()) {
          EXPECT_FALSE(got.t[i].defined());
          continue;
        }
        EXPECT_TRUE(same_tensor(got.t[i], ref.t[i])) << "call " << i / 6 << " " << names[i % 6];
      }
    }
}

}  // namespace
}  // namespace epmoe::test
#endif  // EPMOE_HAVE_CUDA
