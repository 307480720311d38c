// cuda_ipc normal mode with one process per GPU (the MPI layout): buffers mapped through CUDA IPC handles
// exchanged over MPI, bit for bit against the threads backend on the same inputs (as normal_mode_test.cpp does
// for the MPI transport). Skipped where the host has fewer GPUs than ranks (CI: no GPU).
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi/compare.hpp"
#include "mpi/mpi_test_util.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <cuda_runtime.h>

namespace epmoe::test {
namespace {

struct Inputs {
  Tensor x, idx, w, y, yw;
};

Inputs make_inputs(std::uint64_t seed, int rank, std::int64_t H, int K, int E) {
  auto rng = rank_rng(seed, rank, 7);
  const std::int64_t T = rank == 1 ? 0 : 50 + static_cast<std::int64_t>(rng() % 400);  // rank 1: zero tokens
  Inputs in;
  in.x = random_bf16(rng, T, H);
  RoutingOptions o;
  o.p_minus_one = 0.2;
  in.idx = random_topk_idx(rng, T, K, E, o);
  in.w = random_topk_weights(rng, in.idx);
  return in;
}

struct Out {
  Tensor recv_x, recv_idx, recv_w, cached_x, combined_x, combined_w;
};

/// dispatch, cached dispatch, combine of rows drawn from the seed after the dispatch (same on every backend).
Out run(Buffer& buf, const Inputs& in, std::uint64_t seed, std::int64_t H, int K, int E, int device) {
  const bool gpu = device >= 0;
  auto put = [&](const Tensor& t) { return gpu ? to_gpu(t, device) : t; };
  auto get = [&](const Tensor& t) { return gpu ? to_cpu(t) : t; };
  const Tensor x = put(in.x), idx = put(in.idx), w = put(in.w);
  const DispatchLayout layout = buf.get_dispatch_layout(idx, E);
  DispatchArgs a = make_dispatch_args(layout, x, idx, w);
  const DispatchResult d = buf.dispatch(a);
  DispatchArgs b;
  b.x = x;
  b.handle = &d.handle;
  const DispatchResult dc = buf.dispatch(b);
  auto rng = rank_rng(seed, buf.rank(), 8);
  const Tensor y = random_bf16(rng, d.recv_x.size(0), H), yw = random_f32(rng, d.recv_x.size(0), K, 0.0f, 1.0f);
  const Tensor gy = put(y), gyw = put(yw);
  CombineArgs ca;
  ca.x = gy;
  ca.topk_weights = gyw;
  ca.handle = &d.handle;
  const CombineResult cr = buf.combine(ca);
  return {get(d.recv_x), get(d.recv_topk_idx), get(d.recv_topk_weights), get(dc.recv_x), get(cr.combined_x),
          get(cr.combined_topk_weights)};
}

/// Every rank's inputs for hidden H, and the threads backend's outputs on them (the reference every path must match).
struct Reference {
  std::vector<Inputs> inputs;
  std::vector<Out> want;
};
Reference threads_reference(std::uint64_t seed, int R, std::int64_t H, int K, int E) {
  Reference ref;
  for (int r = 0; r < R; ++r) ref.inputs.push_back(make_inputs(seed, r, H, K, E));
  ref.want.resize(static_cast<std::size_t>(R));
  run_thread_ranks(R, [&](Group& g) {
    Buffer cpu(std::shared_ptr<Group>(&g, [](Group*) {}));
    const auto r = static_cast<std::size_t>(g.rank());
    ref.want[r] = run(cpu, ref.inputs[r], seed, H, K, E, -1);
  });
  return ref;
}

/// The data paths these tests force (every rank must pick the same one, except kZeroCopyRankZeroOnly).
enum Path { kZeroCopy, kCopyEngine, kSmStores, kZeroCopyRankZeroOnly };
const char* path_name(int path) {
  return path == kZeroCopy     ? "zero-copy path"
         : path == kCopyEngine ? "copy-engine path"
         : path == kSmStores   ? "SM-store path"
                               : "zero-copy offered by rank 0 only";
}
/// cuda_ipc options on `device` that force `path`, sized for 512 tokens of `hidden` (makes the device current).
BufferOptions path_options(int path, int device, int me, std::int64_t hidden, int R, int K) {
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  BufferOptions o;
  o.backend = Backend::cuda_ipc;
  o.device = device;
  o.num_recv_slots = path == kZeroCopy || (path == kZeroCopyRankZeroOnly && me == 0) ? 2 : 0;
  o.use_copy_engine = path != kSmStores;
  o.copy_engine_min_rows = 0;  // the copy-engine path even for these few rows
  o.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(512, hidden, R, K);
  return o;
}

TEST(MpiCudaIpc, OneProcessPerGpuMatchesTheThreadsBackend) {
  const int R = world_size(), me = world_rank();
  // EPMOE_TEST_SHARE_GPU=1: ranks share the GPUs there are (rank_device).
  const std::optional<int> gpu = rank_device(R, me);
  if (!gpu) GTEST_SKIP() << "needs one GPU per rank (" << R << "), found " << gpus();
  const int device = *gpu;
  const std::uint64_t seed = shared_seed();
  const int K = 4, E = 8 * R;
  for (const std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{7168}}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const Reference reference = threads_reference(seed, R, H, K, E);
    // kZeroCopyRankZeroOnly: only rank 0 offers a receive slot, so the exchange falls back (to the copy-engine path)
    // after rank 0's zero-copy attempt (its notify computed local send positions).
    for (int path = kZeroCopy; path <= kZeroCopyRankZeroOnly; ++path) {
      SCOPED_TRACE(path_name(path));
      Buffer buf(test_group(), path_options(path, device, me, H, R, K));
      const Out got = run(buf, reference.inputs[static_cast<std::size_t>(me)], seed, H, K, E, device);
      const Out& ref = reference.want[static_cast<std::size_t>(me)];
      EXPECT_TRUE(same_tensor(got.recv_x, ref.recv_x)) << "recv_x";
      EXPECT_TRUE(same_tensor(got.recv_idx, ref.recv_idx)) << "recv_topk_idx";
      EXPECT_TRUE(same_tensor(got.recv_w, ref.recv_w)) << "recv_topk_weights";
      EXPECT_TRUE(same_tensor(got.cached_x, ref.cached_x)) << "cached recv_x";
      EXPECT_TRUE(same_tensor(got.combined_x, ref.combined_x)) << "combined_x";
      EXPECT_TRUE(same_tensor(got.combined_w, ref.combined_w)) << "combined_topk_weights";
    }
  }
}

// The count exchange compares the ranks' settings on the device: a hidden size that differs across processes is
// raised on every rank naming the setting and both values (the host waits for the exchange's ticket or an error,
// never for a kernel), and the buffer stays usable: the next dispatch with agreeing settings matches the threads
// backend. On each path, zero-copy included (its send kernel is launched behind the exchange before the host read).
TEST(MpiCudaIpc, SettingsThatDifferAcrossProcessesAreNamedOnEveryRankAndTheBufferStaysUsable) {
  const int R = world_size(), me = world_rank();
  const std::optional<int> gpu = rank_device(R, me);
  if (!gpu) GTEST_SKIP() << "needs one GPU per rank (" << R << "), found " << gpus();
  if (R < 2) GTEST_SKIP() << "needs 2 ranks";
  const int device = *gpu;
  const std::uint64_t seed = shared_seed();
  const int K = 4, E = 8 * R;
  const std::int64_t H = 2048;
  const Reference reference = threads_reference(seed, R, H, K, E);
  for (int path = kZeroCopy; path <= kSmStores; ++path) {
    SCOPED_TRACE(path_name(path));
    Buffer buf(test_group(), path_options(path, device, me, 2 * H, R, K));
    // Rank 0 dispatches rows of H, the others of 2H (each call is valid on its own).
    const std::int64_t mine = me == 0 ? H : 2 * H;
    auto rng = rank_rng(seed, me, 9);
    const Tensor x = to_gpu(random_bf16(rng, 64, mine), device);
    const Tensor idx = to_gpu(random_topk_idx(rng, 64, K, E, {}), device);
    const DispatchLayout layout = buf.get_dispatch_layout(idx, E);
    try {
      (void)buf.dispatch(make_dispatch_args(layout, x, idx, Tensor{}));
      ADD_FAILURE() << "rank " << me << ": a dispatch whose hidden differs across ranks returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("'hidden' differs across ranks"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(H)), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(2 * H)), std::string::npos) << what;
    }
    const Out got = run(buf, reference.inputs[static_cast<std::size_t>(me)], seed, H, K, E, device);
    const Out& ref = reference.want[static_cast<std::size_t>(me)];
    EXPECT_TRUE(same_tensor(got.recv_x, ref.recv_x)) << "recv_x after the error";
    EXPECT_TRUE(same_tensor(got.combined_x, ref.combined_x)) << "combined_x after the error";
  }
}

}  // namespace
}  // namespace epmoe::test
#endif  // EPMOE_HAVE_CUDA
