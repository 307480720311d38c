// Checks of low-latency arguments shared by the CPU and GPU implementations: see args/low_latency.hpp.
#include "transport/args/low_latency.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/quant.hpp>

namespace epmoe::low_latency_args {

namespace {
constexpr int kMaxTopk = kLowLatencyMaxTopk;  // semantics §1: K in 1..16 in low-latency mode
constexpr int kMaxLocalExperts = 1024;        // semantics §1
}  // namespace

std::string strides_of(const TensorView& t) {
  return fmt::format("{} with strides {}", describe(t), to_string(t.strides));
}

void check_on(const TensorView& t, std::string_view name, Device device) {
  if (device.is_cpu())
    EPMOE_CHECK_ARG(t.device.is_cpu(), name, "a CPU tensor (the threads/mpi low-latency backends run on the host)",
                    describe(t));
  else
    EPMOE_CHECK_ARG(t.device == device, name,
                    fmt::format("a tensor on {} (this rank's device of the cuda_ipc buffer; CPU tensors go to the "
                                "group's CPU transport, all of a call's tensors on one side)",
                                to_string(device)),
                    describe(t));
}

// topk_idx [T, K] int64/int32, K in 1..16, ids in [-1, E) and distinct per token (a token has at most
// one row per expert: the R*Tmax rows of an expert hold every token of every rank at most once).
// Returns it as int32, row-major.
std::vector<std::int32_t> read_topk_idx(const TensorView& t, std::int64_t T, int E) {
  EPMOE_CHECK_ARG(t.defined(), "topk_idx", "an int64 or int32 tensor [T, K]", "None");
  check_on(t, "topk_idx", Device::cpu());
  check_topk_idx_dtype(t);
  EPMOE_CHECK_ARG(t.ndim() == 2, "topk_idx", "a 2-d [T, K] tensor", describe(t));
  EPMOE_CHECK_ARG(t.size(0) == T, "topk_idx", fmt::format("{} rows (T of x)", T), describe(t));
  const std::int64_t K = t.size(1);
  EPMOE_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk_idx", fmt::format("K in 1..{} in low-latency mode", kMaxTopk),
                  fmt::format("K = {}", K));
  EPMOE_CHECK_ARG(t.data != nullptr || T == 0, "topk_idx", "a non-null data pointer", "nullptr");
  std::vector<std::int32_t> out(static_cast<std::size_t>(T * K));
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t off = i * t.stride(0) + k * t.stride(1);
      const std::int64_t v = t.dtype == DType::int64 ? static_cast<const std::int64_t*>(t.data)[off]
                                                     : static_cast<const std::int32_t*>(t.data)[off];
      if (v < -1 || v >= E)
        throw_invalid_argument("topk_idx", fmt::format("expert ids in [-1, {})", E),
                               fmt::format("{} at [{}, {}]", v, i, k));
      out[static_cast<std::size_t>(i * K + k)] = static_cast<std::int32_t>(v);
      for (std::int64_t j = 0; j < k && v >= 0; ++j)
        if (out[static_cast<std::size_t>(i * K + j)] == v)
          throw_invalid_argument("topk_idx", "distinct expert ids per token (or -1)",
                                 fmt::format("expert {} at both [{}, {}] and [{}, {}]", v, i, j, i, k));
    }
  return out;
}

std::vector<float> read_topk_weights(const TensorView& t, std::int64_t T, std::int64_t K) {
  check_on(t, "topk_weights", Device::cpu());
  EPMOE_CHECK_ARG(t.ndim() == 2 && t.dtype == DType::fp32 && t.size(0) == T && t.size(1) == K, "topk_weights",
                  fmt::format("float32[{}, {}]", T, K), describe(t));
  EPMOE_CHECK_ARG(t.data != nullptr || T == 0, "topk_weights", "a non-null data pointer", "nullptr");
  std::vector<float> out(static_cast<std::size_t>(T * K));
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t k = 0; k < K; ++k)
      out[static_cast<std::size_t>(i * K + k)] = static_cast<const float*>(t.data)[i * t.stride(0) + k * t.stride(1)];
  return out;
}

void check_settings(int tmax, std::int64_t hidden, int R, int E) {
  EPMOE_CHECK_ARG(tmax >= 1, "num_max_dispatch_tokens_per_rank", ">= 1", tmax);
  EPMOE_CHECK_ARG(static_cast<std::int64_t>(tmax) * R < (std::int64_t{1} << 31), "num_max_dispatch_tokens_per_rank",
                  fmt::format("R * Tmax < 2^31 (R = {})", R), tmax);
  EPMOE_CHECK_ARG(hidden >= 8 && hidden % 8 == 0, "hidden", "a positive multiple of 8 (bf16 rows of 16-byte units)",
                  hidden);
  EPMOE_CHECK_ARG(R >= 1, "num_ranks", ">= 1", R);
  EPMOE_CHECK_ARG(E >= 1 && E % R == 0, "num_experts", fmt::format("a positive multiple of num_ranks = {}", R), E);
  EPMOE_CHECK_ARG(E / R <= kMaxLocalExperts, "num_experts",
                  fmt::format("at most {} experts per rank ({} ranks)", kMaxLocalExperts, R), E);
  // The window's layout (low_latency_protocol.hpp) sums products of these in 64 bits: past ~2^64 bytes its size
  // would wrap around to a small figure that passes any memory check. A bound above every term of Layout::make, in
  // double: E_local x R x Tmax rows of two bf16 slabs plus their per-row words and scale columns (padded), and the
  // staging of R sources' records or Tmax x 16 combine rows.
  const double H = static_cast<double>(hidden), Tm = tmax, Rd = R, El = E / R, rows = El * Rd * Tm;
  const double bound = 2.0 * (rows * (4.0 * H + 64.0) + El * (Rd * Tm + 256.0) * (H / 8.0 + 64.0) +
                              Rd * Tm * (3.0 * H + 256.0) + Tm * 32.0 * H + Rd * 4096.0);
  EPMOE_CHECK_ARG(bound < 0x1p62, "hidden",
                  fmt::format("settings whose low-latency window stays below 2^62 bytes (Tmax = {}, R = {}, E = {}: "
                              "about {:.3g} bytes)",
                              tmax, R, E, bound),
                  hidden);
}

void check_against_config(bool set, int cfg_tmax, std::int64_t cfg_hidden, int cfg_e, int tmax, std::int64_t hidden,
                          int num_experts, int R, std::int64_t num_rdma_bytes, std::int64_t needed,
                          std::string_view hidden_name) {
  if (set) {
    EPMOE_CHECK_ARG(tmax == cfg_tmax, "num_max_dispatch_tokens_per_rank",
                    fmt::format("{} (fixed by the buffer's first low-latency call)", cfg_tmax), tmax);
    EPMOE_CHECK_ARG(hidden == cfg_hidden, hidden_name,
                    fmt::format("H = {} (fixed by the buffer's first low-latency call)", cfg_hidden),
                    fmt::format("H = {}", hidden));
    EPMOE_CHECK_ARG(num_experts == cfg_e, "num_experts",
                    fmt::format("{} (fixed by the buffer's first low-latency call)", cfg_e), num_experts);
    return;
  }
  if (num_rdma_bytes > 0 && num_rdma_bytes < needed)
    raise(ErrorCode::out_of_memory,
          "num_rdma_bytes too small: the low-latency buffer needs {} bytes per rank (Tmax = {}, H = {}, "
          "R = {}, E = {}; see get_low_latency_rdma_size_hint), got {}",
          needed, tmax, hidden, R, num_experts, num_rdma_bytes);
}

DispatchSpec check_dispatch(const LowLatencyDispatchArgs& a, int R, Device device) {
  const int tmax = a.num_max_dispatch_tokens_per_rank, E = a.num_experts;
  const bool cpu = device.is_cpu();
  EPMOE_CHECK_ARG(a.x.defined(), "x", "a bfloat16 tensor [T, H]", "None");
  check_on(a.x, "x", device);
  EPMOE_CHECK_ARG(a.x.ndim() == 2 && a.x.dtype == DType::bf16, "x", "a 2-d bfloat16 tensor [T, H]", describe(a.x));
  const std::int64_t T = a.x.size(0), H = a.x.size(1);
  EPMOE_CHECK_ARG(H <= 1 || a.x.stride(1) == 1, "x", "unit stride in dimension 1", strides_of(a.x));
  EPMOE_CHECK_ARG(T <= 1 || a.x.stride(0) >= H, "x", fmt::format("a row stride >= {}", H), strides_of(a.x));
  EPMOE_CHECK_ARG(a.x.data != nullptr || T == 0, "x", "a non-null data pointer", "nullptr");
  if (!cpu)  // the GPU kernels move rows as 16-byte vectors
    EPMOE_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.x.data) % 16 == 0 && (T <= 1 || a.x.stride(0) % 8 == 0), "x",
                    "16-byte aligned rows on CUDA (data pointer and row stride)", strides_of(a.x));
  // H is x's width: named as x, not as the 'hidden' setting check_settings names (clean_low_latency_buffer's).
  EPMOE_CHECK_ARG(H >= 8 && H % 8 == 0, "x", "H a positive multiple of 8 (bf16 rows of 16-byte units)",
                  fmt::format("H = {}", H));
  check_settings(tmax, H, R, E);
  if (T > tmax)
    throw_invalid_argument("x", fmt::format("at most num_max_dispatch_tokens_per_rank = {} tokens", tmax),
                           fmt::format("T = {} tokens ({} > {})", T, T, tmax));
  EPMOE_CHECK_ARG(!a.use_fp8 || H % 16 == 0, "x", "H a multiple of 16 with use_fp8 (fp8 rows of 16-byte units)",
                  fmt::format("H = {}", H));
  EPMOE_CHECK_ARG(a.use_fp8 || (!a.round_scale && !a.use_ue8m0), "use_fp8", "true when round_scale or use_ue8m0 is set",
                  "false");
  EPMOE_CHECK_ARG(!a.use_ue8m0 || a.round_scale, "use_ue8m0", "round_scale = true (UE8M0 holds powers of two only)",
                  "round_scale = false");
  EPMOE_CHECK_ARG(!(a.use_nvfp4 && a.use_fp8), "use_nvfp4", "use_fp8 = false with use_nvfp4 (one wire format per call)",
                  "use_fp8 = true");
  EPMOE_CHECK_ARG(!a.use_nvfp4 || H % 64 == 0, "x",
                  "H a multiple of 64 with use_nvfp4 (blocks of 16 channels, scales in swizzled tiles of 4 blocks)",
                  fmt::format("H = {}", H));
  EPMOE_CHECK_ARG(!(a.return_recv_hook && a.async_finish), "async_finish",
                  "false with return_recv_hook (the hook and async_finish exclude each other)", "true");
  DispatchSpec spec;
  if (a.use_nvfp4) spec.global_scale = quant_detail::check_global_scale(a.x_global_scale, "x_global_scale", device);
  spec.T = T;
  spec.H = H;
  spec.tmax = tmax;
  spec.E = E;
  spec.El = E / R;
  if (cpu) {
    spec.idx = read_topk_idx(a.topk_idx, T, E);
  } else {
    const TensorView& t = a.topk_idx;
    EPMOE_CHECK_ARG(t.defined(), "topk_idx", "an int64 or int32 tensor [T, K]", "None");
    check_on(t, "topk_idx", device);
    check_topk_idx_dtype(t);
    EPMOE_CHECK_ARG(t.ndim() == 2, "topk_idx", "a 2-d [T, K] tensor", describe(t));
    EPMOE_CHECK_ARG(t.size(0) == T, "topk_idx", fmt::format("{} rows (T of x)", T), describe(t));
    EPMOE_CHECK_ARG(t.size(1) >= 1 && t.size(1) <= kMaxTopk, "topk_idx",
                    fmt::format("K in 1..{} in low-latency mode", kMaxTopk), fmt::format("K = {}", t.size(1)));
    EPMOE_CHECK_ARG(t.data != nullptr || T == 0, "topk_idx", "a non-null data pointer", "nullptr");
    EPMOE_CHECK_ARG(T <= 1 || (t.stride(1) == 1 && t.stride(0) == t.size(1)), "topk_idx", "a contiguous tensor on CUDA",
                    strides_of(t));
  }
  spec.K = a.topk_idx.size(1);
  if (a.topk_weights.defined()) {
    if (cpu) {
      (void)read_topk_weights(a.topk_weights, T, spec.K);
    } else {
      const TensorView& w = a.topk_weights;
      check_on(w, "topk_weights", device);
      EPMOE_CHECK_ARG(w.ndim() == 2 && w.dtype == DType::fp32 && w.size(0) == T && w.size(1) == spec.K,
                      "topk_weights", fmt::format("float32[{}, {}]", T, spec.K), describe(w));
    }
  }
  if (a.cumulative_local_expert_recv_stats.defined()) {
    const TensorView& s = a.cumulative_local_expert_recv_stats;
    check_on(s, "cumulative_local_expert_recv_stats", device);
    EPMOE_CHECK_ARG(s.ndim() == 1 && s.dtype == DType::int32 && s.size(0) == spec.El && s.data != nullptr,
                    "cumulative_local_expert_recv_stats", fmt::format("int32[{}]", spec.El), describe(s));
  }
  check_wait_cost_stats(a.dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", R, device);
  return spec;
}

void check_wait_cost_stats(const TensorView& stats, std::string_view name, int R, Device device) {
  if (!stats.defined()) return;
  check_on(stats, name, device);
  EPMOE_CHECK_ARG(stats.ndim() == 1 && stats.dtype == DType::int64 && stats.size(0) == R && stats.data != nullptr &&
                      (R <= 1 || stats.stride(0) == 1),
                  name, fmt::format("None or a contiguous int64[{}] (one entry per source rank)", R),
                  stats.ndim() == 1 && stats.stride(0) != 1 ? describe(stats) + " with strides " + strides_of(stats)
                                                             : describe(stats));
}

const LowLatencyHandle& combine_handle(const LowLatencyCombineArgs& a, std::uint64_t buffer_id) {
  EPMOE_CHECK_ARG(a.handle != nullptr && a.handle->defined(), "handle", "the handle of a low_latency_dispatch",
                  "an empty handle");
  const LowLatencyHandle& hd = *a.handle;
  EPMOE_CHECK_ARG(hd.buffer_id == buffer_id, "handle", fmt::format("a handle of this buffer (id {})", buffer_id),
                  fmt::format("a handle of buffer {}", hd.buffer_id));
  return hd;
}

void check_combine_x(const TensorView& x, int El, std::int64_t rows, std::int64_t H, Device device) {
  EPMOE_CHECK_ARG(x.defined(), "x", fmt::format("bfloat16[{}, {}, {}]", El, rows, H), "None");
  check_on(x, "x", device);
  EPMOE_CHECK_ARG(
      x.ndim() == 3 && x.dtype == DType::bf16 && x.size(0) == El && x.size(1) == rows && x.size(2) == H, "x",
      fmt::format("bfloat16[{}, {}, {}] ([E_local, R * Tmax, H], H = {} of the handle's dispatch)", El, rows, H, H),
      describe(x));
  if (device.is_cpu())
    EPMOE_CHECK_ARG(x.stride(2) == 1 && x.data != nullptr, "x", "unit stride in dimension 2", strides_of(x));
  else
    EPMOE_CHECK_ARG(x.stride(2) == 1 && x.data != nullptr && reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 &&
                        x.stride(1) % 8 == 0 && x.stride(0) % 8 == 0,
                    "x", "unit stride in dimension 2 and 16-byte aligned rows on CUDA", strides_of(x));
}

TensorView combine_input(const LowLatencyCombineArgs& a, const TensorView& slab, int El, std::int64_t rows,
                         std::int64_t H, Device device) {
  if (!a.zero_copy) {
    check_combine_x(a.x, El, rows, H, device);
    return a.x;
  }
  if (a.x.defined()) check_combine_x(a.x, El, rows, H, device);
  return slab;
}

TensorView combine_slab_view(const low_latency_protocol::Layout& L, void* half, Device device) {
  const std::int64_t El = L.local_experts, rows = static_cast<std::int64_t>(L.num_ranks) * L.tmax, H = L.hidden;
  return TensorView(static_cast<std::byte*>(half) + L.combine_slab, DType::bf16, {El, rows, H}, {rows * H, H, 1},
                    device);
}

void check_combine_out(const TensorView& out, std::int64_t T, std::int64_t H, Device device) {
  check_on(out, "out", device);
  if (device.is_cpu())
    EPMOE_CHECK_ARG(out.ndim() == 2 && out.dtype == DType::bf16 && out.size(0) == T && out.size(1) == H &&
                        (H <= 1 || out.stride(1) == 1) && (T <= 1 || out.stride(0) >= H) &&
                        (out.data != nullptr || T == 0),
                    "out", fmt::format("bfloat16[{}, {}] with unit stride in dimension 1", T, H), strides_of(out));
  else
    EPMOE_CHECK_ARG(
        out.ndim() == 2 && out.dtype == DType::bf16 && out.size(0) == T && out.size(1) == H &&
            (H <= 1 || out.stride(1) == 1) && (T <= 1 || (out.stride(0) >= H && out.stride(0) % 8 == 0)) &&
            (out.data != nullptr || T == 0) && reinterpret_cast<std::uintptr_t>(out.data) % 16 == 0,
        "out", fmt::format("bfloat16[{}, {}] with unit stride in dimension 1 and 16-byte aligned rows", T, H),
        strides_of(out));
}

void check_combine_handle(const LowLatencyHandle& hd, int rank, int tmax, std::int64_t hidden, int num_experts,
                          std::uint64_t base, std::uint64_t generation, bool routing_kept, bool receive_pending) {
  EPMOE_CHECK_ARG(
      hd.num_max_dispatch_tokens_per_rank == tmax && hd.hidden == hidden && hd.num_experts == num_experts, "handle",
      fmt::format("Tmax = {}, H = {}, E = {}", tmax, hidden, num_experts),
      fmt::format("Tmax = {}, H = {}, E = {}", hd.num_max_dispatch_tokens_per_rank, hd.hidden, hd.num_experts));
  if (hd.generation < base)
    raise(ErrorCode::stale_handle,
          "rank {}: the handle comes from low-latency call {}, before clean_low_latency_buffer (this combine is call {})",
          rank, hd.generation, generation);
  if (!routing_kept)
    raise(ErrorCode::stale_handle,
          "rank {}: the handle comes from low-latency call {}, and a later low_latency_dispatch reused its half of the "
          "buffer (this combine is call {}; a dispatch's handle can be combined until the next dispatch but one)",
          rank, hd.generation, generation);
  EPMOE_CHECK_ARG(!receive_pending, "handle", "the handle of a received dispatch",
                  "a dispatch whose recv hook was not called yet");
}

void check_combine_idx_shape(const TensorView& topk_idx, std::int64_t T, std::int64_t K) {
  EPMOE_CHECK_ARG(topk_idx.defined() && topk_idx.ndim() == 2 && topk_idx.size(0) == T && topk_idx.size(1) == K,
                  "topk_idx", fmt::format("[{}, {}] (the shape at dispatch)", T, K), describe(topk_idx));
}

namespace {

// A 1-d signal-like tensor of `dtype` with unit stride and at least (exactly with `exact`) `n` entries on `device`.
void check_vector(const TensorView& t, std::string_view name, DType dtype, std::int64_t n, bool exact,
                  std::string_view what, Device device) {
  const std::string want = fmt::format("{} [{}{}] ({}) with unit stride", dtype_name(dtype), exact ? "" : ">= ", n, what);
  EPMOE_CHECK_ARG(t.defined(), name, want, "None");
  check_on(t, name, device);
  EPMOE_CHECK_ARG(t.ndim() == 1 && t.dtype == dtype && (exact ? t.size(0) == n : t.size(0) >= n), name, want,
                  describe(t));
  EPMOE_CHECK_ARG((t.size(0) <= 1 || t.stride(0) == 1) && (t.data != nullptr || t.size(0) == 0), name, want,
                  strides_of(t));
}

}  // namespace

OverlapSpec check_combine_overlap(const LowLatencyCombineArgs& a, int El, std::int64_t rows, Device device) {
  OverlapSpec o;
  if (!a.overlap) return o;  // DeepEP's rule: without overlap the signal fields are not looked at
  constexpr int kMaxSendSms = 1024;
  EPMOE_CHECK_ARG(a.num_sms >= 0 && a.num_sms <= kMaxSendSms, "num_sms",
                  fmt::format("0..{} (0 = a block per local expert)", kMaxSendSms), a.num_sms);
  o.num_sms = a.num_sms;
  if (a.send_stamps.defined()) {
    check_vector(a.send_stamps, "send_stamps", DType::int64, 2, true, "the first and last row store's time", device);
    o.send_stamps = static_cast<std::int64_t*>(a.send_stamps.data);
  }
  const bool blocks = a.comp_signal.defined(), experts = a.src_signals.defined();
  EPMOE_CHECK_ARG(blocks || experts, "overlap",
                  "comp_signal (with packed_recv_count, block_m, threshold) or src_signals (with "
                  "src_signal_expect_value) when overlap is true",
                  "overlap = true without a signal tensor");
  if (blocks) {
    EPMOE_CHECK_ARG(!experts, "src_signals", "None with comp_signal (one signal form per call)", describe(a.src_signals));
    EPMOE_CHECK_ARG(a.src_signal_expect_value == 0, "src_signal_expect_value",
                    "unset (0) with comp_signal (it belongs to the src_signals form; comp_signal waits for threshold)",
                    a.src_signal_expect_value);
    EPMOE_CHECK_ARG(a.block_m >= 1, "block_m", ">= 1 (rows per signal block, the down GEMM's BLOCK_M)", a.block_m);
    EPMOE_CHECK_ARG(a.threshold >= 1, "threshold",
                    ">= 1 (the adds that mark a block done: ceil(H / block_n) for DeepGEMM's down GEMM)", a.threshold);
    o.form = OverlapSpec::Form::blocks;
    o.block_m = a.block_m;
    o.blocks_per_expert = (rows + a.block_m - 1) / a.block_m;
    o.expect = static_cast<std::uint32_t>(a.threshold);
    check_vector(a.comp_signal, "comp_signal", DType::int32, El * o.blocks_per_expert, false,
                 fmt::format("E_local = {} times ceil(R * Tmax = {} / block_m = {})", El, rows, a.block_m), device);
    check_vector(a.packed_recv_count, "packed_recv_count", DType::int32, El, true, "the dispatch's packed_recv_count",
                 device);
    o.signal = a.comp_signal.data;
    o.packed_recv_count = static_cast<const std::int32_t*>(a.packed_recv_count.data);
    return o;
  }
  EPMOE_CHECK_ARG(!a.packed_recv_count.defined(), "packed_recv_count",
                  "None with src_signals (it belongs to the comp_signal form)", describe(a.packed_recv_count));
  EPMOE_CHECK_ARG(a.block_m == 0, "block_m", "unset (0) with src_signals (it belongs to the comp_signal form)",
                  a.block_m);
  EPMOE_CHECK_ARG(a.threshold == 0, "threshold",
                  "unset (0) with src_signals (it belongs to the comp_signal form; src_signals wait for "
                  "src_signal_expect_value)",
                  a.threshold);
  EPMOE_CHECK_ARG(a.src_signal_expect_value >= 1 && a.src_signal_expect_value <= 0xffffffffll,
                  "src_signal_expect_value", "1..2^32-1 (the value of src_signals[e] that marks expert e done)",
                  a.src_signal_expect_value);
  check_vector(a.src_signals, "src_signals", DType::uint32, El, true, "one counter per local expert", device);
  o.form = OverlapSpec::Form::experts;
  o.expect = static_cast<std::uint32_t>(a.src_signal_expect_value);
  o.signal = a.src_signals.data;
  return o;
}

TensorView recv_scales_view(const low_latency_protocol::Layout& L, void* area, bool ue8m0, Device device) {
  const std::int64_t rows = static_cast<std::int64_t>(L.num_ranks) * L.tmax;
  const std::int64_t cols = ue8m0 ? num_ue8m0_words(L.hidden) : L.groups, R = L.scale_rows;
  return TensorView(area, ue8m0 ? DType::int32 : DType::fp32, {L.local_experts, rows, cols}, {cols * R, 1, R}, device);
}

}  // namespace epmoe::low_latency_args
