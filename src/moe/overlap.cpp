// MoELayerOptions::overlap: a low-latency forward's experts write a combine signal block by block while the
// combine's send waits on it (docs/semantics.md "Overlapped low-latency combine"), so the send hides under the
// experts' GEMMs: on a GPU the combine_a is enqueued on the layer's side stream, on CPU ranks the experts run on a
// side thread. The combine's receive (combine_b) stays on the caller's stream / thread, after both.
#include <epmoe/moe.hpp>

#include <climits>
#include <exception>
#include <thread>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/layer_extensions.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "core/cuda_check.hpp"
#endif

namespace epmoe {

namespace {

constexpr int kOverlapBlockM = 64;   // rows per signal block (SGLang sizes its signals for this smallest block_m)
constexpr int kOverlapBlockN = 128;  // columns per N-tile: a block is done after ceil(H / 128) adds

}  // namespace

bool MoELayer::run_experts_overlapped(const PrepareOutput& p, const MoEForwardArgs& args, Tensor& fused) {
  if (!options_.overlap || p.format != ActivationFormat::batched_experts || prepare_finalize_->name() != "low_latency" ||
      !experts_->writes_combine_signal())
    return false;
  const Device device = p.hidden.device();
  const std::int64_t El = p.hidden.size(0), rows = p.hidden.size(1), H = p.hidden.size(2);
  const std::int64_t blocks = (rows + kOverlapBlockM - 1) / kOverlapBlockM;
  ExpertsInputs in;
  in.w1 = args.w1;
  in.w2 = args.w2;
  in.w1_scales = args.w1_scale;
  in.w2_scales = args.w2_scale;
  in.activation = args.activation;
  in.hidden = p.hidden;
  in.expert_num_tokens = p.expert_num_tokens;
  last_chunk_rows_.assign(1, El * rows);
  LowLatencyCombineArgs o;
  o.overlap = true;
  o.packed_recv_count = p.expert_num_tokens;
  o.block_m = kOverlapBlockM;
  o.threshold = static_cast<int>((H + kOverlapBlockN - 1) / kOverlapBlockN);
  o.num_sms = options_.overlap_num_sms;
  const WeightAndReduce reduce = experts_->weight_and_reduce();

  if (device.is_cpu()) {
    Tensor out = Tensor::zeros(DType::bf16, p.hidden.shape());
    Tensor signal = Tensor::zeros(DType::int32, {El * blocks});
    in.combine_signal = {signal, kOverlapBlockM, kOverlapBlockN};
    o.comp_signal = signal;
    prepare_finalize_->set_next_combine_overlap(o);
    std::exception_ptr experts_error;
    std::thread side([&] {
      try {
        experts_->apply(in, out.view());
      } catch (...) {
        experts_error = std::current_exception();
        // Every block marked done: the combine completes (with whatever rows there are) instead of timing out,
        // so the ranks stay in step until forward raises the experts' error.
        for (std::int64_t i = 0; i < signal.numel(); ++i)
          __atomic_store_n(signal.ptr<std::int32_t>() + i, INT_MAX, __ATOMIC_RELEASE);
      }
    });
    try {
      prepare_finalize_->combine_a(out, reduce);
    } catch (...) {
      side.join();
      if (experts_error) std::rethrow_exception(experts_error);
      throw;
    }
    side.join();
    if (experts_error) std::rethrow_exception(experts_error);
    fused = std::move(out);
    return true;
  }
#if defined(EPMOE_HAVE_CUDA)
  cuda_util::DeviceGuard guard(device);
  const cudaStream_t main = cuda_util::to_cuda(current_stream());
  const TensorView ws =
      options_.workspaces->get(options_.micro_batch, "experts_out", DType::bf16, p.hidden.shape(), device);
  const TensorView signal =
      options_.workspaces->get(options_.micro_batch, "overlap.signal", DType::int32, {El * blocks}, device);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(signal.data, 0, signal.nbytes(), main));  // the signals of this forward
  in.combine_signal = {signal, kOverlapBlockM, kOverlapBlockN};
  o.comp_signal = signal;
  // The first overlapped forward of a layer runs its experts before the send is enqueued. Why: under CUDA's lazy
  // module loading (the default since CUDA 12.2) the first launch of a kernel loads its module, which waits for
  // the kernels already running on the device; a send spinning on a signal whose producer kernel (cuBLAS's
  // per-expert GEMM, the signal kernel) is not loaded yet would wait for itself until its timeout. The shapes of
  // a layer's batched slabs never change, so once every kernel has run once the later forwards overlap.
  const bool experts_first = !overlap_kernels_loaded_;
  std::exception_ptr experts_error;
  if (experts_first) {
    try {
      experts_->apply(in, ws);
    } catch (...) {
      experts_error = std::current_exception();
      EPMOE_CUDA_CHECK(cudaMemsetAsync(signal.data, 0x7f, signal.nbytes(), main));  // every block done (below)
    }
  }
  prepare_finalize_->set_next_combine_overlap(o);
  PrepareFinalize& pf = *prepare_finalize_;
  // The send on the side stream, after what the caller's stream holds now (the dispatch's receive, the zeroed
  // signals); it waits on the device for each block while the experts below run on the caller's stream.
  layer_detail::GpuSharedRun run = layer_detail::start_gpu_shared_experts(
      overlap_stream_,
      [&](const TensorView&) {
        pf.combine_a(ws, reduce);
        return Tensor();
      },
      p.hidden.view());
  if (run.error) {
    layer_detail::join_gpu_shared_experts(run);
    std::rethrow_exception(run.error);
  }
  if (!experts_first) {
    try {
      experts_->apply(in, ws);
    } catch (...) {
      // Every block marked done (0x7f7f7f7f >= any threshold): the send completes instead of timing out.
      cudaMemsetAsync(signal.data, 0x7f, signal.nbytes(), main);
      layer_detail::join_gpu_shared_experts(run);
      throw;
    }
  }
  layer_detail::join_gpu_shared_experts(run);  // the caller's stream (the receive) waits for the send
  if (experts_error) std::rethrow_exception(experts_error);
  overlap_kernels_loaded_ = true;
  fused = Tensor::wrap(ws, nullptr);
  return true;
#else
  return false;
#endif
}

}  // namespace epmoe
