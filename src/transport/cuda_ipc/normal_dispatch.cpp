// cuda-ipc normal mode, dispatch: the host side's steps, in the order dispatch() runs them. Three data paths, chosen
// by the count exchange (the same choice on every rank): zero-copy (senders store into the receiver's free receive
// slot, which is the output), copy engine (each sender stages its rows per destination, each receiver pulls them
// with cudaMemcpyAsync in pipeline stages) and SM stores (senders store into the receiver's data region, a receive
// pass copies them out). The class: cuda_ipc/normal_impl.hpp; protocol: cuda_ipc/normal.hpp and
// docs/cuda_ipc_design.md.
#if defined(EPMOE_HAVE_CUDA)

#include <epmoe/error.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <memory>
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
using ipc::capturing;
using ipc::Carver;

constexpr std::string_view kDispatchPhase = "cuda_ipc normal dispatch";

/// Field arrays of `capacity` rows each, one after the other, 16-byte aligned.
ipc::DataLayout make_layout(std::int64_t data_bytes, std::int64_t x_row, std::int64_t scale_row, int K, bool src) {
  const std::int64_t per_row = x_row + scale_row + 12 * static_cast<std::int64_t>(K) + (src ? 4 : 0);
  ipc::DataLayout L;
  L.capacity = std::max<std::int64_t>(0, (data_bytes - 5 * ipc::kFieldSlack) / per_row);
  std::int64_t off = 0;
  L.x_off = static_cast<std::size_t>(off);
  off += ipc::align16(L.capacity * x_row);
  L.scale_off = static_cast<std::size_t>(off);
  off += ipc::align16(L.capacity * scale_row);
  L.idx_off = static_cast<std::size_t>(off);
  off += ipc::align16(L.capacity * 8 * K);
  L.w_off = static_cast<std::size_t>(off);
  off += ipc::align16(L.capacity * 4 * K);
  L.src_off = static_cast<std::size_t>(off);
  return L;
}

/// The copy-engine dispatch's staging area: half `half` (0 or 1) of the data region. Consecutive eager ops
/// alternate halves (CudaIpcNormalImpl::ops_, the same count on every rank), so an op may stage before its count
/// exchange: the peers may still pull the previous op's rows, but from the other half, and the last op that used
/// this half finished on every rank (this rank passed the previous op's handshake, which says so).
ipc::DataLayout half_layout(int half, std::int64_t data_bytes, std::int64_t x_row, std::int64_t scale_row, int K,
                            bool src) {
  const std::int64_t half_bytes = data_bytes / 2 / 16 * 16;
  ipc::DataLayout L = make_layout(half_bytes, x_row, scale_row, K, src);
  const std::size_t base = static_cast<std::size_t>(half * half_bytes);
  L.x_off += base;
  L.scale_off += base;
  L.idx_off += base;
  L.w_off += base;
  L.src_off += base;
  return L;
}

}  // namespace

DispatchResult CudaIpcNormalImpl::dispatch(const DispatchArgs& a) {
  require_normal_region("dispatch");
  trace_begin();  // before the checks: the trace's host times include them
  trace_host("h:begun");
  check_state();
  const DispatchShape shape = check_dispatch(a);
  trace_host("h:checked");

  DeviceGuard guard(shape.gpu);
  const Stream caller = current_stream();
  if (shape.worst == 0 && capturing(cuda_util::to_cuda(caller)))
    throw_invalid_argument("num_worst_tokens",
                           "> 0 while the caller's stream captures a CUDA graph (without it the receive counts are "
                           "read on the host, which a graph cannot do)",
                           "0");
  StreamGuard on_comm(Stream{comm_});  // outputs and temporaries are allocated (stream-ordered) on the comm stream
  trace_host("h:guards");
  enter(a.previous_event, caller);
  trace_mark("entered");
  DispatchOp op(shape);
  op.caller = caller;
  op.c = common();

  plan_dispatch(op);
  prepare_gather(op);
  launch_dispatch_notify(op);
  if (op.slot) send_zero_copy(op);
  if (op.host_read) read_dispatch_counts(op);  // the one host read of normal mode
  op.rows = op.worst > 0 ? op.worst : op.num_recv;

  DispatchResult out;
  allocate_dispatch_outputs(op, out);
  if (op.ce) {
    pull_dispatch_rows(op, out);
  } else if (!op.direct) {
    ipc::launch_dispatch_send(op.c, dispatch_send_args(op), blocks_, comm_);
    trace_mark("rows sent");
  }
  if (!op.ce && !op.direct) receive_dispatch_rows(op, out);
  finish_dispatch(op, out);
  out.event = leave(a.async_finish, op.caller);
  trace_end(op.cached ? "cached dispatch" : "dispatch");
  return out;
}

// Validates everything locally (no peer, no device read) and sizes the rows: an op that cannot fit raises here.
CudaIpcNormalImpl::DispatchShape CudaIpcNormalImpl::check_dispatch(const DispatchArgs& a) const {
  DispatchShape op;
  op.a = &a;
  op.gpu = Device::cuda(device_);
  op.spec = check_dispatch_args(a, R_, buffer_id_, op.gpu);
  const DispatchSpec& spec = op.spec;
  op.fp8 = spec.fp8;
  op.cached = spec.cached;
  op.has_topk = spec.has_topk;
  op.has_weights = spec.has_weights;
  op.T = spec.T;
  op.H = spec.H;
  op.scale_cols = spec.scale_cols;
  op.K = spec.K;
  op.E = spec.E;
  op.alignment = spec.alignment;
  op.worst = spec.worst;
  op.E_local = op.E / R_;
  op.x_row = static_cast<std::size_t>(op.H) * dtype_size(a.x.dtype);
  op.scale_row = static_cast<std::size_t>(op.scale_cols) * 4;
  op.L = make_layout(data_bytes_, static_cast<std::int64_t>(op.x_row), static_cast<std::int64_t>(op.scale_row), op.K,
                     !op.cached);
  if (op.worst > op.L.capacity)
    raise(ErrorCode::out_of_memory,
          "rank {}: num_worst_tokens = {} rows do not fit num_nvl_bytes = {} ({} rows of {} "
          "bytes fit; Buffer::get_normal_nvl_size_hint gives the size)",
          me_, op.worst, data_bytes_, op.L.capacity,
          ipc::dispatch_row_bytes(static_cast<std::int64_t>(op.x_row), static_cast<std::int64_t>(op.scale_row), op.K));
  return op;
}

// Before the count exchange: whether the copy-engine path may be taken, this op's staging half, the receive slot
// offered for the zero-copy path, the routing tensors (a fresh dispatch) or the handle's (a cached one), and the
// notify's arguments.
void CudaIpcNormalImpl::plan_dispatch(DispatchOp& op) {
  const DispatchArgs& a = *op.a;
  const int R = R_;
  const std::int64_t T = op.T;
  const auto set_dispatch_settings = [&](ipc::NotifyArgs& n) {
    set_settings(n, {op.H, static_cast<long long>(a.x.dtype), op.K, op.E,
                     static_cast<long long>(op.spec.scale_format), op.alignment, op.worst, op.cached ? 1 : 0,
                     op.has_weights ? 1 : 0});
  };
  // The copy-engine path needs the counts on the host (no num_worst_tokens); a fresh dispatch's count exchange
  // decides on the device whether it is taken, a cached dispatch on the host (its counts are in the handle).
  op.ce_allowed = op.worst == 0 && use_copy_engine_;
  op.Lh = half_layout(static_cast<int>(ops_++ & 1), data_bytes_, static_cast<std::int64_t>(op.x_row),
                      static_cast<std::int64_t>(op.scale_row), op.K, !op.cached);
  // Zero-copy: a fresh dispatch without num_worst_tokens offers a free receive slot in the count exchange; when
  // every rank offered one, the senders store straight into the slots, which are the outputs (no staging, no
  // receive pass), from right after the exchange: their kernel is enqueued before the host read.
  if (op.worst == 0) op.slot = ipc::RecvSlots::acquire(recv_slots_);
  trace_host("h:slot");
  ipc::NotifyArgs& notify = op.notify;
  if (op.cached) {
    notify.phase = ipc::kPhaseCachedNotify;
    set_dispatch_settings(notify);
    op.pm = a.handle->rank_prefix_matrix;
    op.send_pos = a.handle->send_pos;
    if (op.worst == 0) op.num_recv = a.handle->num_recv_tokens;
    op.pm_host = a.handle->rank_prefix_matrix_host;
    op.ce = op.ce_allowed && ipc::copy_engine_fits(op.pm_host.data(), R, op.Lh.capacity, copy_engine_min_rows_);
    notify.recv_slot = op.slot ? *op.slot : -1;
    if (op.ce) op.list = Tensor::empty(DType::int32, {R, T}, op.gpu);
  } else {
    // The routing side of the op in one block: prefix matrix, expert counts, send positions, the handle's copy of
    // is_token_in_rank, the send lists.
    op.routing_block.emplace(
        std::initializer_list<std::size_t>{Carver::bytes(DType::int32, {R, R}),
                                           Carver::bytes(DType::int32, {op.E_local}),
                                           Carver::bytes(DType::int32, {T, R}), Carver::bytes(DType::boolean, {T, R}),
                                           Carver::bytes(DType::int32, {R, T})},
        op.gpu);
    op.pm = op.routing_block->take(DType::int32, {R, R});
    op.expert_counts = op.routing_block->take(DType::int32, {op.E_local});
    op.send_pos = op.routing_block->take(DType::int32, {T, R});
    op.in_rank = op.routing_block->take(DType::boolean, {T, R});
    op.list = op.routing_block->take(DType::int32, {R, T});
    trace_host("h:allocated");
    notify.per_rank = static_cast<const std::int32_t*>(a.num_tokens_per_rank.data);
    notify.per_expert = static_cast<const std::int32_t*>(a.num_tokens_per_expert.data);
    notify.experts_per_rank = op.E_local;
    notify.alignment = op.alignment;
    notify.recv_capacity = op.worst > 0 ? op.worst : op.L.capacity;
    notify.worst = op.worst > 0;
    notify.pm_out = op.pm.ptr<std::int32_t>();
    notify.expert_out = op.expert_counts.ptr<std::int32_t>();
    notify.phase = ipc::kPhaseDispatchNotify;
    notify.ce_min_rows = op.ce_allowed ? copy_engine_min_rows_ : -1;
    notify.ce_capacity = op.Lh.capacity;
    notify.recv_slot = op.slot ? *op.slot : -1;
    if (op.slot) {  // zero-copy attempt: local positions in the notify, the offsets added by the send kernel
      notify.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
      notify.local_pos = op.send_pos.ptr<std::int32_t>();
      notify.T = T;
    }
    set_dispatch_settings(notify);
  }
}

// The copy-engine path's gather arguments (staging and own-rows passes): this rank's rows, routing and staging half.
void CudaIpcNormalImpl::prepare_gather(DispatchOp& op) const {
  const DispatchArgs& a = *op.a;
  ipc::GatherArgs& ga = op.ga;
  ga.x = a.x.data;
  ga.x_row = op.x_row;
  ga.scales = op.fp8 ? a.x_scales.data : nullptr;
  ga.scale_row = op.scale_row;
  if (op.fp8) {  // row- or column-major (check_dispatch_args)
    ga.scale_stride = a.x_scales.stride(0);
    ga.scale_col_stride = a.x_scales.stride(1);
  }
  ga.topk_idx = op.has_topk ? a.topk_idx.data : nullptr;
  ga.idx64 = op.has_topk && a.topk_idx.dtype == DType::int64;
  ga.K = op.K;
  ga.weights = op.has_weights ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  ga.experts_per_rank = op.E_local;
  ga.write_src = !op.cached;
  ga.T = op.T;
  ga.pm = op.pm.ptr<std::int32_t>();
  ga.chunks = chunks_;
  ga.layout = op.Lh;
}

// The SM-store and zero-copy paths' send arguments: every row stored at its final position in the receiver.
ipc::DispatchSendArgs CudaIpcNormalImpl::dispatch_send_args(const DispatchOp& op) const {
  const DispatchArgs& a = *op.a;
  ipc::DispatchSendArgs sa;
  sa.x = a.x.data;
  sa.x_row = op.x_row;
  sa.scales = op.fp8 ? a.x_scales.data : nullptr;
  sa.scale_row = op.scale_row;
  if (op.fp8) {  // row- or column-major (check_dispatch_args)
    sa.scale_stride = a.x_scales.stride(0);
    sa.scale_col_stride = a.x_scales.stride(1);
  }
  sa.topk_idx = op.has_topk ? a.topk_idx.data : nullptr;
  sa.idx64 = op.has_topk && a.topk_idx.dtype == DType::int64;
  sa.K = op.K;
  sa.weights = op.has_weights ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  sa.T = op.T;
  sa.send_pos = op.send_pos.ptr<std::int32_t>();
  sa.experts_per_rank = op.E_local;
  sa.write_src = !op.cached;
  sa.layout = op.L;
  return sa;
}

// The staging stream joins the communication stream here (`forked_`).
void CudaIpcNormalImpl::fork_stage_stream() {
  EPMOE_CUDA_CHECK(cudaEventRecord(forked_, comm_));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stage_, forked_, 0));
}

// The staging (send lists, stage counters reset, the staging pass on its own stream). It needs only this rank's
// routing, so it starts before the count exchange (begin_op advances the op's sequence number first) when the
// copy-engine path is known (cached) or likely (this rank has copy_engine_min_rows tokens; should the exchange
// choose the SM path, its send kernel meets every peer first: see sm_barrier_seq). Otherwise it runs after the
// host read, if chosen: small batches skip its launches.
// Everything of the staging runs on its own stream, which joined the communication stream at `forked_`; the
// own-rows pass waits only for its send list (`listed_`). A staging before the exchange is enqueued after the
// notify, whose launch it would otherwise delay by its host calls (the host then waits for the counts anyway).
void CudaIpcNormalImpl::enqueue_staging(DispatchOp& op, bool before_exchange) {
  const DispatchArgs& a = *op.a;
  if (before_exchange && !op.cached) {  // the lists from local positions: final ones need the prefix matrix
    ipc::SendPosArgs sp;
    sp.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
    sp.T = op.T;
    sp.list = op.list.ptr<std::int32_t>();
    ipc::launch_send_pos(op.c, sp, stage_);
    op.ga.per_rank = static_cast<const std::int32_t*>(a.num_tokens_per_rank.data);
  } else {
    ipc::SendListArgs sl;
    sl.send_pos = op.send_pos.ptr<std::int32_t>();
    sl.pm = op.pm.ptr<std::int32_t>();
    sl.T = op.T;
    sl.list = op.list.ptr<std::int32_t>();
    ipc::launch_send_list(op.c, sl, stage_);
  }
  EPMOE_CUDA_CHECK(cudaEventRecord(listed_, stage_));
  auto* ctrl = static_cast<ipc::Control*>(base_);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(ctrl->chunk_arrive, 0, sizeof(ctrl->chunk_arrive), stage_));
  op.ga.list = op.list.ptr<std::int32_t>();
  op.ga.part = ipc::kGatherStages;
  ipc::launch_gather(op.c, op.ga, blocks_, stage_);
  EPMOE_CUDA_CHECK(cudaEventRecord(staged_, stage_));
  trace_mark("staged", stage_);
  op.staging_enqueued = true;
}

// A fresh dispatch's final send positions (the prefix matrix's offsets included), on the communication stream.
void CudaIpcNormalImpl::launch_final_send_pos(const DispatchOp& op) {
  const DispatchArgs& a = *op.a;
  ipc::SendPosArgs sp;
  sp.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
  sp.pm = op.pm.ptr<std::int32_t>();
  sp.T = op.T;
  sp.send_pos = op.send_pos.ptr<std::int32_t>();
  ipc::launch_send_pos(op.c, sp, comm_);
}

// The count exchange (a fresh dispatch) or handshake (a cached one), with an early staging around it when the
// copy-engine path is known or likely, then the final send positions unless the zero-copy path is attempted.
void CudaIpcNormalImpl::launch_dispatch_notify(DispatchOp& op) {
  op.stage_early = !op.slot && (op.cached ? op.ce : op.ce_allowed && op.T >= copy_engine_min_rows_);
  if (op.stage_early) {
    ipc::launch_begin_op(op.c, comm_);
    fork_stage_stream();
  }
  op.notify.advance = !op.stage_early;
  op.notify.prestaged = op.stage_early;
  // The host reads the count exchange's result (a fresh dispatch: the counts and the path; a cached one offering a
  // slot: whether the zero-copy path was chosen).
  op.host_read = op.worst == 0 && (!op.cached || op.slot);
  if (op.host_read) op.notify.ticket = ++ticket_;
  trace_host("h:notify args");
  ipc::launch_notify(op.c, op.notify, comm_);
  trace_host("h:notify launched");
  // No event here: the zero-copy send kernel right behind is the notify's programmatic dependent (an event between
  // them would serialise the two launches; the device stamps trace this stretch).
  if (!op.slot) trace_mark(op.cached ? "handshake" : "count exchange");
  if (op.stage_early) enqueue_staging(op, true);
  if (!op.cached && !op.slot) launch_final_send_pos(op);
}

// Zero-copy attempt: the send kernel, enqueued before the host read, stores every row into the receivers' slots if
// the exchange chose that path (and returns at once otherwise). The source indices land in a capacity-sized tensor
// (the send kernel's last block copies them there once every sender is done; num_recv is not known on the host yet).
void CudaIpcNormalImpl::send_zero_copy(DispatchOp& op) {
  ipc::DispatchSendArgs sa = dispatch_send_args(op);
  sa.slot_base = slot_stride_;
  sa.slot_bytes = slot_stride_;
  if (!op.cached) {
    sa.pm = op.pm.ptr<std::int32_t>();
    sa.final_pos = op.send_pos.ptr<std::int32_t>();
    op.src_block = std::make_shared<Tensor>(Tensor::empty(DType::int32, {op.L.capacity}, op.gpu));
    sa.recv_src = op.src_block->ptr<std::int32_t>();
  }
  ipc::launch_dispatch_send(op.c, sa, blocks_, comm_, /*after_notify=*/true);
  trace_mark("rows sent");
}

// The host read of the count exchange: the counts and the path (a fresh dispatch), whether the zero-copy path was
// taken; then what the chosen path still needs before the outputs exist (final send positions, a late staging).
void CudaIpcNormalImpl::read_dispatch_counts(DispatchOp& op) {
  const int R = R_, me = me_;
  wait_notified(kDispatchPhase);
  trace_mark("host read");
  if (!op.cached) {
    op.num_recv = host_->pm[(R - 1) * R + me];
    op.pm_host.assign(host_->pm, host_->pm + R * R);
    op.ce = op.ce_allowed && host_->use_copy_engine != 0;
  }
  op.direct = op.slot && host_->use_direct != 0;
  // Not chosen after a fresh zero-copy attempt: send_pos holds local positions; the other paths need final ones.
  if (op.slot && !op.direct && !op.cached) launch_final_send_pos(op);
  if (!op.direct) op.slot.reset();
  if (op.ce && !op.staging_enqueued) {
    fork_stage_stream();
    enqueue_staging(op, false);
  }
}

// The outputs: views of this rank's receive slot (zero-copy), or one pool block (the source indices too: they go
// into the handle), after which the staging's streams may write into them.
void CudaIpcNormalImpl::allocate_dispatch_outputs(DispatchOp& op, DispatchResult& out) {
  const DispatchArgs& a = *op.a;
  const TensorView& x = a.x;
  const std::int64_t rows = op.rows, H = op.H, scale_cols = op.scale_cols;
  const int K = op.K;
  if (op.direct) {
    // The outputs are views of this rank's slot (field arrays of layout L); the handle's source indices are copied
    // out, so a kept handle does not hold the slot.
    char* mine =
        static_cast<char*>(base_) + ipc::kControlBytes + slot_stride_ * (1 + static_cast<std::size_t>(*op.slot));
    const auto view = [&](std::size_t off, DType dtype, Shape shape) {
      return Tensor::wrap(TensorView(mine + off, dtype, shape, op.gpu), op.slot);
    };
    out.recv_x = view(op.L.x_off, x.dtype, {rows, H});
    if (op.fp8) out.recv_x_scales = view(op.L.scale_off, a.x_scales.dtype, {rows, scale_cols});
    if (op.has_topk) out.recv_topk_idx = view(op.L.idx_off, DType::int64, {rows, K});
    if (op.has_weights) out.recv_topk_weights = view(op.L.w_off, DType::fp32, {rows, K});
    // The send kernel's last block waited for every sender's rows and copied the source indices: no kernel here.
    if (!op.cached)
      op.recv_src = Tensor::wrap(TensorView(op.src_block->data(), DType::int32, {rows}, op.gpu), op.src_block);
  } else {
    Carver outputs({Carver::bytes(x.dtype, {rows, H}),
                    op.fp8 ? Carver::bytes(a.x_scales.dtype, {rows, scale_cols}) : 0,
                    op.has_topk ? Carver::bytes(DType::int64, {rows, K}) : 0,
                    op.has_weights ? Carver::bytes(DType::fp32, {rows, K}) : 0,
                    op.cached ? 0 : Carver::bytes(DType::int32, {rows})},
                   op.gpu);
    out.recv_x = outputs.take(x.dtype, {rows, H});
    if (op.fp8) out.recv_x_scales = outputs.take(a.x_scales.dtype, {rows, scale_cols});
    if (op.has_topk) out.recv_topk_idx = outputs.take(DType::int64, {rows, K});
    if (op.has_weights) out.recv_topk_weights = outputs.take(DType::fp32, {rows, K});
    if (!op.cached) op.recv_src = outputs.take(DType::int32, {rows});
    if (op.staging_enqueued) {
      EPMOE_CUDA_CHECK(cudaEventRecord(allocated_, comm_));
      for (cudaStream_t st : side_) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(st, allocated_, 0));
      if (!op.ce) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, staged_, 0));  // before the SM path's stores
    }
  }
}

// Copy-engine path: this rank's own rows into the outputs by SMs, beside the staging (after its send list), on the
// communication stream, which then waits for the staging.
void CudaIpcNormalImpl::gather_own_rows(DispatchOp& op, DispatchResult& out) {
  ipc::GatherArgs& ga = op.ga;
  ga.part = ipc::kGatherOwn;
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, listed_, 0));
  ga.recv_x = out.recv_x.data();
  ga.recv_scales = op.fp8 ? out.recv_x_scales.data() : nullptr;
  ga.recv_idx = op.has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
  ga.recv_w = op.has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
  ga.recv_src = op.cached ? nullptr : op.recv_src.ptr<std::int32_t>();
  ipc::launch_gather(op.c, ga, blocks_, comm_);
  trace_mark("own rows done");
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, staged_, 0));
}

// Copy-engine path: every receiver pulls each stage of each source's run with the copy engine as soon as the source
// publishes it (side streams; the first stage's copies are enqueued first: the engines are idle until then), while
// the own rows go into the outputs by SMs, beside the staging (measured: fp8 225 -> 192 us).
void CudaIpcNormalImpl::pull_dispatch_rows(DispatchOp& op, DispatchResult& out) {
  const int R = R_, me = me_;
  const std::vector<std::int32_t>& pm_host = op.pm_host;
  const auto at = [&](int r, int d) -> std::int64_t { return pm_host[static_cast<std::size_t>(r * R + d)]; };
  // Per source: where its run for me starts in its region (rows it staged for peers before me) and in my outputs.
  std::vector<std::int64_t> src_first(static_cast<std::size_t>(R)), dst_first(static_cast<std::size_t>(R)),
      count(static_cast<std::size_t>(R));
  for (int src = 0; src < R; ++src) {
    dst_first[src] = src > 0 ? at(src - 1, me) : 0;
    count[src] = at(src, me) - dst_first[src];
    for (int d = 0; d < me; ++d)
      if (d != src) src_first[src] += at(src, d) - (src > 0 ? at(src - 1, d) : 0);
  }
  const auto pull = [&](int src, void* dst, std::size_t off, std::size_t row_bytes, std::int64_t lo, std::int64_t hi,
                        cudaStream_t st) {
    if (hi <= lo) return;
    const char* region = static_cast<const char*>(peers_[src]) + ipc::kControlBytes;
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + (dst_first[src] + lo) * row_bytes,
                                     region + off + (src_first[src] + lo) * row_bytes, (hi - lo) * row_bytes,
                                     cudaMemcpyDeviceToDevice, st));
  };
  for (int j = 0; j < chunks_; ++j) {
    const cudaStream_t st = side_[j & 1];
    ipc::launch_wait_chunk(op.c, j, ipc::kPhaseDispatchData, st);
    for (int src = 0; src < R; ++src) {
      if (src == me) continue;
      const std::int64_t lo = ipc::stage_begin(count[src], j, chunks_),
                         hi = ipc::stage_begin(count[src], j + 1, chunks_);
      pull(src, out.recv_x.data(), op.Lh.x_off, op.x_row, lo, hi, st);
    }
    trace_mark("stage pulled", st);
    if (j == 0) gather_own_rows(op, out);
    if (j + 2 == chunks_ || chunks_ == 1) {
      // The small fields of every run, read by a kernel once every stage is published; on the stream that
      // does not carry the last stage, so it overlaps that stage's copies.
      ipc::PullSmallArgs ps;
      ps.chunks = chunks_;
      ps.scale_row = op.fp8 ? op.scale_row : 0;
      ps.K = op.has_topk ? op.K : 0;
      ps.layout = op.Lh;
      for (int src = 0; src < R; ++src) {
        ps.src_first[src] = src_first[src];
        ps.dst_first[src] = dst_first[src];
        ps.count[src] = src == me ? 0 : count[src];
      }
      ps.recv_scales = op.fp8 ? out.recv_x_scales.data() : nullptr;
      ps.recv_idx = op.has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
      ps.recv_w = op.has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
      ps.recv_src = op.cached ? nullptr : op.recv_src.ptr<std::int32_t>();
      ipc::launch_pull_small(op.c, ps, ipc::kPullSmallBlocks, chunks_ == 1 ? side_[1] : st);
    }
  }
  join_side_streams();
  trace_mark("pulls done");
}

// SM-store path: the receive pass copies the rows the senders stored into this rank's data region to the outputs.
void CudaIpcNormalImpl::receive_dispatch_rows(const DispatchOp& op, DispatchResult& out) {
  ipc::DispatchRecvArgs ra;
  ra.pm = op.pm.ptr<std::int32_t>();
  ra.rows = op.rows;
  ra.x_row = op.x_row;
  ra.scale_row = op.scale_row;
  ra.K = op.K;
  ra.recv_x = out.recv_x.data();
  ra.recv_scales = op.fp8 ? out.recv_x_scales.data() : nullptr;
  ra.recv_idx = op.has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
  ra.recv_w = op.has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
  ra.recv_src = op.cached ? nullptr : op.recv_src.ptr<std::int32_t>();
  ra.layout = op.L;
  ipc::launch_dispatch_recv(op.c, ra, recv_blocks_, blocks_, comm_);
}

// The handle (a fresh dispatch's, with its copy of is_token_in_rank; a cached dispatch's own) and the per-expert
// counts on the host (none with num_worst_tokens).
void CudaIpcNormalImpl::finish_dispatch(const DispatchOp& op, DispatchResult& out) {
  const DispatchArgs& a = *op.a;
  if (op.cached) {
    out.handle = *a.handle;
  } else {
    if (op.T > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(op.in_rank.data(), a.is_token_in_rank.data, op.in_rank.nbytes(),
                                       cudaMemcpyDeviceToDevice, comm_));
    NormalHandle& h = out.handle;
    h.rank_prefix_matrix = op.pm;
    h.is_token_in_rank = op.in_rank;
    h.send_pos = op.send_pos;
    h.recv_src_idx = op.recv_src;
    h.num_recv_tokens_per_expert = op.expert_counts;
    h.num_tokens = op.T;
    h.num_recv_tokens = op.num_recv;  // -1 with num_worst_tokens: known on the device only
    h.num_recv_rows = op.rows;
    h.hidden = op.H;
    h.num_experts = op.E;
    h.expert_alignment = op.alignment;
    h.num_worst_tokens = op.worst;
    h.buffer_id = buffer_id_;
    h.rank_prefix_matrix_host = op.pm_host;
  }
  if (op.worst == 0) {
    if (op.cached) {
      out.num_recv_tokens_per_expert_list.resize(static_cast<std::size_t>(op.E_local));
      EPMOE_CUDA_CHECK(cudaMemcpy(out.num_recv_tokens_per_expert_list.data(),
                                  a.handle->num_recv_tokens_per_expert.data(),
                                  sizeof(std::int32_t) * static_cast<std::size_t>(op.E_local), cudaMemcpyDeviceToHost));
    } else {
      out.num_recv_tokens_per_expert_list.assign(host_->expert_counts, host_->expert_counts + op.E_local);
    }
  }
}

}  // namespace epmoe

#endif  // EPMOE_HAVE_CUDA
