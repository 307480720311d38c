// cuda-ipc normal mode, combine: the host side's steps, in the order combine() runs them. Two data paths, chosen on
// the host from the dispatch's counts (the same choice on every rank): copy engine (each rank pushes each peer's
// rows into that peer's half of the data region in pipeline stages, before the handshake, while the reduce waits
// per stage) and SM stores (a send kernel stores every rank's rows into the whole region after the handshake). The
// class: cuda_ipc/normal_impl.hpp; protocol: cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
#if defined(EPMOE_HAVE_CUDA)

#include <epmoe/error.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <vector>

#include <cuda_runtime.h>

#include "core/check.hpp"
#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"
#include "transport/cuda_ipc/normal_impl.hpp"
#include "transport/cuda_ipc/stream.hpp"

namespace epmoe {

namespace {

using cuda_util::DeviceGuard;
namespace ipc = cuda_ipc;
using ipc::Carver;

/// Combine rows: x then weights, `capacity` rows each, from `base`; every rank's rows in the whole region (SM
/// stores), or the peers' rows in this op's half (copy engine: pushed before the handshake, behind
/// launch_push_gate).
ipc::DataLayout combine_layout(std::int64_t bytes, std::size_t base, std::int64_t H, int K) {
  ipc::DataLayout l;
  l.capacity = std::max<std::int64_t>(0, (bytes - 5 * ipc::kFieldSlack) / ipc::combine_row_bytes(H, K));
  l.x_off = base;
  l.w_off = base + static_cast<std::size_t>(ipc::align16(l.capacity * 2 * H));
  return l;
}

}  // namespace

CombineResult CudaIpcNormalImpl::combine(const CombineArgs& a) {
  require_normal_region("combine");
  trace_begin();
  check_state();
  CombineOp op = check_combine(a);

  DeviceGuard guard(op.gpu);
  op.caller = current_stream();
  StreamGuard on_comm(Stream{comm_});
  enter(a.previous_event, op.caller);
  trace_mark("entered");
  op.c = common();

  choose_combine_path(op);
  if (op.ce) {
    ipc::launch_begin_op(op.c, comm_);
    fork_side_streams();
    ipc::launch_push_gate(op.c, side_[0]);
  }
  op.notify.phase = ipc::kPhaseCombineNotify;
  op.notify.advance = !op.ce;
  set_settings(op.notify, {op.H, op.K, op.h->num_worst_tokens});
  // The copy-engine path enqueues its first stage's pushes before the notify and the outputs' allocation (pushes
  // need no handshake: see launch_push_gate): the GPU is idle until the first push, so host time before it counts.
  if (!op.ce) combine_handshake(op);

  ipc::CombineSendArgs& sa = op.sa;
  sa.x = a.x.data;
  sa.x_row = static_cast<std::size_t>(op.H) * 2;
  sa.weights = op.has_w ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  sa.K = op.K;
  sa.pm = op.h->rank_prefix_matrix.ptr<std::int32_t>();
  sa.layout = op.L;
  if (!op.ce)
    ipc::launch_combine_send(op.c, sa, blocks_, comm_);
  else if (combine_sm_push_)
    push_combine_rows_by_sm(op);
  else
    push_combine_rows_by_copy_engine(op);

  CombineResult out;
  Carver outputs({Carver::bytes(DType::bf16, {op.T, op.H}), op.has_w ? Carver::bytes(DType::fp32, {op.T, op.K}) : 0},
                 op.gpu);
  out.combined_x = outputs.take(DType::bf16, {op.T, op.H});
  if (op.has_w) out.combined_topk_weights = outputs.take(DType::fp32, {op.T, op.K});
  reduce_combined_rows(op, out);
  if (op.ce) join_side_streams();
  trace_mark("reduce + pushes done");
  out.event = leave(a.async_finish, op.caller);
  trace_end("combine");
  return out;
}

// Validates everything locally (no peer) and lays out this op's half of the data region.
CudaIpcNormalImpl::CombineOp CudaIpcNormalImpl::check_combine(const CombineArgs& a) const {
  CombineOp op;
  op.a = &a;
  op.gpu = Device::cuda(device_);
  const CombineSpec spec = check_combine_args(a, R_, buffer_id_, op.gpu);
  op.h = a.handle;
  op.T = spec.T;
  op.H = spec.H;
  op.K = spec.K;
  op.has_w = op.K > 0;
  const std::int64_t half_bytes = data_bytes_ / 2 / 16 * 16;
  op.L_half = combine_layout(half_bytes, static_cast<std::size_t>((ops_ & 1) * half_bytes), op.H, op.K);
  return op;
}

// The copy-engine path when the dispatch's counts are on the host (no num_worst_tokens), its rows fit a half and
// some rank moves copy_engine_min_rows; else the SM-store path over the whole region.
void CudaIpcNormalImpl::choose_combine_path(CombineOp& op) const {
  const std::vector<std::int32_t>& pm_host = op.h->rank_prefix_matrix_host;
  op.ce = op.h->num_worst_tokens == 0 && use_copy_engine_ && !pm_host.empty() &&
          ipc::copy_engine_fits(pm_host.data(), R_, op.L_half.capacity, copy_engine_min_rows_);
  op.L = op.ce ? op.L_half : combine_layout(data_bytes_, 0, op.H, op.K);
  // Twice the dispatch's stages: the reduce's tail after the last stage lands shrinks with it (measured, 2x H200,
  // two runs: 250-260 -> 243 us at 8 stages, where the dispatch is slower: more copies per stage).
  op.chunks = std::min(ipc::kMaxChunks, 2 * chunks_);
}

// The handshake with every peer (the notify kernel without counts); the op count picks the next op's half.
void CudaIpcNormalImpl::combine_handshake(CombineOp& op) {
  ipc::launch_notify(op.c, op.notify, comm_);
  ++ops_;
  trace_mark("handshake");
}

CudaIpcNormalImpl::CombineRun CudaIpcNormalImpl::combine_run(const CombineOp& op, int dst) const {
  const int R = R_, me = me_;
  const std::vector<std::int32_t>& pm_host = op.h->rank_prefix_matrix_host;
  const auto at = [&](int r, int d) -> std::int64_t { return pm_host[static_cast<std::size_t>(r * R + d)]; };
  CombineRun run;
  run.first = dst > 0 ? at(dst - 1, me) : 0;
  run.count = at(dst, me) - run.first;
  run.slot = 0;  // rows `dst` receives back from its peers before me (its own rows stay in its x)
  for (int d = 0; d < me; ++d)
    if (d != dst) run.slot += at(dst, d) - (dst > 0 ? at(dst - 1, d) : 0);
  return run;
}

// Copy-engine path, pushes by SM stores (BufferOptions::combine_sm_push): one kernel on the push stream stores every
// peer's run and publishes each stage; the handshake follows it.
void CudaIpcNormalImpl::push_combine_rows_by_sm(CombineOp& op) {
  const int me = me_;
  ipc::CombinePushArgs pa;
  pa.x = op.a->x.data;
  pa.x_row = op.sa.x_row;
  pa.weights = op.sa.weights;
  pa.K = op.K;
  pa.chunks = op.chunks;
  pa.layout = op.L;
  for (int dst = 0; dst < R_; ++dst)
    if (dst != me) {
      const CombineRun run = combine_run(op, dst);
      pa.first[dst] = run.first;
      pa.count[dst] = run.count;
      pa.slot[dst] = run.slot;
    }
  ipc::launch_combine_push(op.c, pa, blocks_, side_[0]);
  trace_mark("pushed", side_[0]);
  combine_handshake(op);
}

// Copy-engine path: each peer's rows are one contiguous run of x (received rows are grouped by source): push each run
// into that peer's half with the copy engine in `chunks` stages, publishing each stage; the reduce kernel (on the
// communication stream, concurrently) waits per stage. This rank's own rows stay in x.
// The copies run back to back on side stream 0 (the weights first, all at once: each copy pays the copy engine's
// start-up); each stage's signal kernel runs on side stream 1 once the stage's copies are done, so the copy queue
// never waits for a kernel and the stages land one after another, not together. The handshake follows the first
// stage's copies.
void CudaIpcNormalImpl::push_combine_rows_by_copy_engine(CombineOp& op) {
  const int R = R_, me = me_, K = op.K;
  const ipc::DataLayout& L = op.L;
  const std::size_t x_row = op.sa.x_row;
  const cudaStream_t copies = side_[0], signals = side_[1];
  for (int dst = 0; dst < R && op.has_w; ++dst) {
    const CombineRun run = combine_run(op, dst);
    if (dst == me || run.count == 0) continue;
    char* region = static_cast<char*>(peers_[dst]) + ipc::kControlBytes;
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(region + L.w_off + run.slot * 4 * K,
                                     static_cast<const float*>(op.a->topk_weights.data) + run.first * K,
                                     run.count * 4 * static_cast<std::size_t>(K), cudaMemcpyDeviceToDevice, copies));
  }
  for (int j = 0; j < op.chunks; ++j) {
    for (int dst = 0; dst < R; ++dst) {
      if (dst == me) continue;
      const CombineRun run = combine_run(op, dst);
      const std::int64_t lo = ipc::stage_begin(run.count, j, op.chunks),
                         hi = ipc::stage_begin(run.count, j + 1, op.chunks);
      if (hi <= lo) continue;
      char* region = static_cast<char*>(peers_[dst]) + ipc::kControlBytes;
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(region + L.x_off + (run.slot + lo) * x_row,
                                       static_cast<const char*>(op.a->x.data) + (run.first + lo) * x_row,
                                       (hi - lo) * x_row, cudaMemcpyDeviceToDevice, copies));
    }
    EPMOE_CUDA_CHECK(cudaEventRecord(stage_copied_[j], copies));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(signals, stage_copied_[j], 0));
    ipc::launch_signal_chunk(op.c, j, signals);
    trace_mark("stage pushed", copies);
    if (j == 0) combine_handshake(op);
  }
}

// The reduce: per token, the rows every destination rank sent back (from the data region, or from x for this rank's
// own), summed in ascending rank order, biases last; on the copy-engine path stage by stage as the pushes land.
void CudaIpcNormalImpl::reduce_combined_rows(CombineOp& op, CombineResult& out) {
  const CombineArgs& a = *op.a;
  const NormalHandle& h = *op.h;
  const int R = R_;
  ipc::CombineReduceArgs ra;
  ra.send_pos = h.send_pos.ptr<std::int32_t>();
  ra.pm = h.rank_prefix_matrix.ptr<std::int32_t>();
  ra.T = op.T;
  ra.H = op.H;
  ra.K = op.K;
  ra.bias_0 = a.bias_0.defined() ? a.bias_0.data : nullptr;
  ra.bias_1 = a.bias_1.defined() ? a.bias_1.data : nullptr;
  ra.out = out.combined_x.data();
  ra.out_w = op.has_w ? out.combined_topk_weights.ptr<float>() : nullptr;
  ra.layout = op.L;
  if (op.ce) {
    const std::vector<std::int32_t>& pm_host = h.rank_prefix_matrix_host;
    ra.local_x = a.x.data;
    ra.local_w = op.has_w ? static_cast<const float*>(a.topk_weights.data) : nullptr;
    ra.chunks = op.chunks;
    for (int d = 0; d < R; ++d)  // rows d sends back = rows this rank sent it
      ra.n_back[d] = pm_host[static_cast<std::size_t>(me_ * R + d)] -
                     (me_ > 0 ? pm_host[static_cast<std::size_t>((me_ - 1) * R + d)] : 0);
  }
  // Pipelined, the reduce runs while the copies are in flight: fewer blocks, so the SMs stay free for others.
  ipc::launch_combine_reduce(op.c, ra, op.ce ? std::min(recv_blocks_, 2 * blocks_) : recv_blocks_, blocks_, comm_);
  trace_mark("reduce done");
}

}  // namespace epmoe

#endif  // EPMOE_HAVE_CUDA
