// epmoe._ext.Buffer: the C++ Buffer with tensors as Python arrays. The DeepEP-compatible argument
// handling (tuples, handles, events, defaults) lives in epmoe/buffer.py; this layer converts, releases
// the GIL around every collective, and keeps what the C++ side still reads alive.
#include "ext.hpp"

#include <epmoe/error.hpp>
#include <epmoe/version.hpp>
#include <epmoe/quant.hpp>

#include <epmoe/stream.hpp>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <thread>

#include <fmt/format.h>

namespace epmoe::py {

namespace {

// Copies rows [0, rows) of slab e of a 3-d view into the same place of `dst` (same shape, any strides: the scales
// are column-major).
void copy_slab_rows(const TensorView& src, const Tensor& dst, std::int64_t e, std::int64_t rows) {
  const std::size_t es = dtype_size(src.dtype);
  const TensorView& dv = dst.view();
  const std::int64_t cols = src.size(2);
  auto* d = static_cast<std::byte*>(dst.data());
  const auto* s = static_cast<const std::byte*>(src.data);
  const bool rows_contiguous = (src.stride(2) == 1 && dv.stride(2) == 1) || cols <= 1;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::byte* out = d + static_cast<std::size_t>(e * dv.stride(0) + r * dv.stride(1)) * es;
    const std::byte* in = s + static_cast<std::size_t>(e * src.stride(0) + r * src.stride(1)) * es;
    if (rows_contiguous) {
      std::memcpy(out, in, static_cast<std::size_t>(cols) * es);
    } else {
      for (std::int64_t c = 0; c < cols; ++c)
        std::memcpy(out + static_cast<std::size_t>(c * dv.stride(2)) * es,
                    in + static_cast<std::size_t>(c * src.stride(2)) * es, es);
    }
  }
}

// Copies a whole 1-, 2- or 3-d view into a contiguous tensor of the same shape.
void copy_all(const TensorView& src, const Tensor& dst) {
  const std::size_t es = dtype_size(src.dtype);
  const int n = src.ndim();
  const std::int64_t d0 = n > 0 ? src.size(0) : 1, d1 = n > 1 ? src.size(1) : 1, d2 = n > 2 ? src.size(2) : 1;
  const std::int64_t s0 = n > 0 ? src.stride(0) : 0, s1 = n > 1 ? src.stride(1) : 0, s2 = n > 2 ? src.stride(2) : 0;
  auto* d = static_cast<std::byte*>(dst.data());
  const auto* s = static_cast<const std::byte*>(src.data);
  std::size_t o = 0;
  for (std::int64_t i = 0; i < d0; ++i)
    for (std::int64_t j = 0; j < d1; ++j)
      for (std::int64_t k = 0; k < d2; ++k, ++o)
        std::memcpy(d + o * es, s + static_cast<std::size_t>(i * s0 + j * s1 + k * s2) * es, es);
}

Tensor empty_like(const TensorView& v) { return v.defined() ? Tensor::empty(v.dtype, v.shape) : Tensor(); }

// A caller's CUDA stream handle (torch.cuda.current_stream().cuda_stream), or None: the legacy default stream.
Stream stream_of(std::optional<std::uintptr_t> handle) {
  return Stream{handle ? reinterpret_cast<void*>(*handle) : nullptr};
}

// A low-latency dispatch as Python sees it. CPU: the C++ results live in the buffer's receive area, which
// the next low-latency calls and clean_low_latency_buffer reuse or free; Python gets copies (the valid
// rows of each expert), made when the data has arrived: at once, or when the hook is called. GPU (a cuda_ipc
// buffer on CUDA tensors): Python gets the views of the receive half themselves, as DeepEP does (filled on the
// stream by the receive kernel; valid until the low-latency call two later reuses the half), each keeping the
// buffer alive.
struct LowLatencyDispatchState {
  std::shared_ptr<Buffer> buffer;  // the receive half (hook) runs on this buffer
  LowLatencyDispatchResult native;
  Tensor x, scales, count, src_info, layout_range;
  PyRef keep;  // (cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats), which the receive half writes

  void copy_out() {
    copy_all(native.packed_recv_count, count);
    copy_all(native.handle.src_info, src_info);
    copy_all(native.handle.layout_range, layout_range);
    const auto* c = count.ptr<std::int32_t>();
    // nvfp4's scales are one swizzled matrix per expert, a matrix row per 128 received rows.
    const bool nvfp4 = native.packed_recv_x.dtype == DType::uint8;
    for (std::int64_t e = 0; e < x.size(0); ++e) {
      copy_slab_rows(native.packed_recv_x, x, e, c[e]);
      if (scales.defined()) copy_slab_rows(native.packed_recv_x_scales, scales, e, nvfp4 ? (c[e] + 127) / 128 : c[e]);
    }
  }
};

// The receive half of a low-latency call (return_recv_hook=True). Call exactly once.
struct PyRecvHook {
  RecvHook native;
  std::shared_ptr<Buffer> buffer;
  std::shared_ptr<LowLatencyDispatchState> dispatch;  // null for a combine
  PyRef keep;                                         // arrays the receive half writes (combine's `out`)

  // GPU: the receive kernel is enqueued on `stream` (the caller's current stream, passed by epmoe/buffer.py at
  // call time); CPU: the stream is ignored.
  void call(std::optional<std::uintptr_t> stream) {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    native();
    if (dispatch) dispatch->copy_out();
  }
};

Backend parse_backend(std::string_view name) {
  if (name == "auto") return Backend::automatic;
  if (name == "threads") return Backend::threads;
  if (name == "mpi") return Backend::mpi;
  if (name == "cuda_ipc") return Backend::cuda_ipc;
  throw_invalid_argument("backend", "'auto', 'threads', 'mpi' or 'cuda_ipc'", fmt::format("'{}'", name));
}

Buffer& buf(PyBuffer& b) {
  if (!b.buffer) throw Error(ErrorCode::unusable, "epmoe: this Buffer was destroyed (Buffer.destroy())");
  return *b.buffer;
}

// A num_worst_tokens that pads the CPU outputs beyond this machine's memory: named here, before the dispatch
// allocates (a failed allocation would name only the bytes; an overcommitted one could end the process). GPU
// outputs are checked by the cuda_ipc backend against num_nvl_bytes.
void check_worst_rows_fit(const DispatchArgs& a) {
  if (a.num_worst_tokens <= 0 || !a.x.defined() || !a.x.device.is_cpu() || a.x.ndim() != 2) return;
  const double H = static_cast<double>(a.x.size(1));
  const double K = a.topk_idx.defined() && a.topk_idx.ndim() == 2 ? static_cast<double>(a.topk_idx.size(1)) : 0.0;
  double row = H * static_cast<double>(dtype_size(a.x.dtype)) + K * (8.0 + 4.0);  // recv_x, topk_idx, topk_weights
  if (a.x_scales.defined() && a.x_scales.ndim() == 2)
    row += static_cast<double>(a.x_scales.size(1)) * static_cast<double>(dtype_size(a.x_scales.dtype));
  const double need = static_cast<double>(a.num_worst_tokens) * row, have = host_memory_bytes();
  if (have > 0 && need > have)
    throw Error(ErrorCode::out_of_memory,
                fmt::format("epmoe: out of memory: 'num_worst_tokens' = {} pads the dispatch outputs to {} rows of "
                            "{:.0f} bytes (recv_x and its scales, topk_idx, topk_weights): {:.0f} bytes, more than "
                            "this machine's {:.0f} bytes of memory",
                            a.num_worst_tokens, a.num_worst_tokens, row, need, have));
}

// ---- the Buffer's methods, bound by bind_buffer_class below ----

void buffer_init(PyBuffer* self, PyGroup& group, std::int64_t num_nvl_bytes, std::int64_t num_rdma_bytes,
                 bool low_latency_mode, std::string_view backend, int device, int num_sms, int num_recv_slots,
                 bool debug_validate) {
  if (!group.group) throw_invalid_argument("group", "an epmoe Group", "None");
  BufferOptions o;
  o.backend = parse_backend(backend);
  o.num_nvl_bytes = num_nvl_bytes;
  o.num_rdma_bytes = num_rdma_bytes;
  o.low_latency_mode = low_latency_mode;
  o.device = device;
  o.num_sms = num_sms;
  o.num_recv_slots = num_recv_slots;
  o.debug_validate = debug_validate;
  std::shared_ptr<Buffer> b;
  {
    nb::gil_scoped_release release;
    b = std::make_shared<Buffer>(group.group, o);
  }
  new (self) PyBuffer{std::move(b)};
}

nb::tuple get_dispatch_layout(PyBuffer& b, nb::handle topk_idx, int num_experts, std::string_view framework,
                              std::optional<std::uintptr_t> stream) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  const TensorView idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
  DispatchLayout l;
  {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    l = buf(b).get_dispatch_layout(idx, num_experts);
  }
  return nb::make_tuple(to_py(l.num_tokens_per_rank, fw), to_py(l.num_tokens_per_expert, fw),
                        to_py(l.is_token_in_rank, fw));
}

nb::tuple dispatch(PyBuffer& b, nb::handle x, nb::handle x_scales, nb::handle topk_idx, nb::handle topk_weights,
                   nb::handle num_tokens_per_rank, nb::handle is_token_in_rank, nb::handle num_tokens_per_expert,
                   const NormalHandle* handle, int expert_alignment, int num_worst_tokens, const Event* previous_event,
                   bool async_finish, bool allocate_on_comm_stream, std::string_view framework,
                   std::optional<std::uintptr_t> stream) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  DispatchArgs a;
  // Python callers give fp8 x and its scales as one tuple x (DeepEP's API): the scales are named x[1].
  a.x = arg(x, "x", in, "bfloat16 or float8_e4m3fn");
  a.x_scales = arg(x_scales, "x[1]", in, "float32 or int32 (UE8M0)");
  a.topk_idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
  a.topk_weights = arg(topk_weights, "topk_weights", in, "float32");
  a.num_tokens_per_rank = arg(num_tokens_per_rank, "num_tokens_per_rank", in, "int32");
  a.is_token_in_rank = arg(is_token_in_rank, "is_token_in_rank", in, "bool");
  a.num_tokens_per_expert = arg(num_tokens_per_expert, "num_tokens_per_expert", in, "int32");
  a.handle = handle;
  a.expert_alignment = expert_alignment;
  a.num_worst_tokens = num_worst_tokens;
  a.previous_event = previous_event;
  a.async_finish = async_finish;
  a.allocate_on_comm_stream = allocate_on_comm_stream;
  check_worst_rows_fit(a);
  DispatchResult r;
  {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    r = with_python_names({{"x_scales", "x[1]"}}, [&] { return buf(b).dispatch(a); });
  }
  const NormalHandle& h = r.handle;
  nb::tuple handle_arrays = nb::make_tuple(to_py_or_none(h.rank_prefix_matrix, fw), to_py_or_none(h.recv_src_idx, fw),
                                           to_py_or_none(h.is_token_in_rank, fw), to_py_or_none(h.send_pos, fw));
  nb::list counts;
  for (int c : r.num_recv_tokens_per_expert_list) counts.append(c);
  return nb::make_tuple(to_py(r.recv_x, fw), to_py_or_none(r.recv_x_scales, fw), to_py_or_none(r.recv_topk_idx, fw),
                        to_py_or_none(r.recv_topk_weights, fw), counts, nb::cast(r.handle), nb::cast(r.event),
                        handle_arrays);
}

nb::tuple combine(PyBuffer& b, nb::handle x, const NormalHandle* handle, nb::handle topk_weights, nb::handle bias_0,
                  nb::handle bias_1, const Event* previous_event, bool async_finish, bool allocate_on_comm_stream,
                  std::string_view framework, std::optional<std::uintptr_t> stream) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  CombineArgs a;
  a.x = arg(x, "x", in, "bfloat16");
  a.handle = handle;
  a.topk_weights = arg(topk_weights, "topk_weights", in, "float32");
  a.bias_0 = arg(bias_0, "bias", in, "bfloat16");
  a.bias_1 = arg(bias_1, "bias", in, "bfloat16");
  a.previous_event = previous_event;
  a.async_finish = async_finish;
  a.allocate_on_comm_stream = allocate_on_comm_stream;
  CombineResult r;
  {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    r = buf(b).combine(a);
  }
  return nb::make_tuple(to_py(r.combined_x, fw), to_py_or_none(r.combined_topk_weights, fw), nb::cast(r.event));
}

void clean_low_latency_buffer(PyBuffer& b, int num_max_dispatch_tokens_per_rank, std::int64_t hidden,
                              int num_experts) {
  b.window_views.clear();  // the clean may lay the window out anew
  nb::gil_scoped_release release;
  buf(b).clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts);
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.shape == b.shape && a.strides == b.strides && a.device == b.device;
}

/// `t` (a view of b's window, keeping the buffer alive) as a Python object: a fresh alias (torch: detach(), CuPy:
/// view()) of the object made the first time this view was returned (PyBuffer::window_views).
nb::object window_view(PyBuffer& b, const Tensor& t, Framework fw) {
  if (!t.defined()) return nb::none();
  if (fw == Framework::numpy) return to_py(t, fw);  // (not a GPU view; no cache)
  // The names made once (a name per call costs a string each), never released (as the other module-life objects).
  static const nb::handle detach = nb::str("detach").release(), view = nb::str("view").release();
  const auto fresh = [&](const nb::object& o) { return o.attr(fw == Framework::torch ? detach : view)(); };
  for (const PyBuffer::WindowView& w : b.window_views)
    if (w.framework == fw && same_view(w.view, t.view())) return fresh(w.object);
  if (b.window_views.size() >= PyBuffer::kMaxWindowViews) b.window_views.erase(b.window_views.begin());
  b.window_views.push_back({t.view(), fw, to_py(t, fw)});
  return fresh(b.window_views.back().object);
}

nb::tuple low_latency_dispatch(PyBuffer& b, nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                               int num_max_dispatch_tokens_per_rank, int num_experts, nb::handle stats, bool use_fp8,
                               bool round_scale, bool use_ue8m0, bool async_finish, bool return_recv_hook,
                               std::string_view framework, std::optional<std::uintptr_t> stream, bool use_nvfp4,
                               nb::handle x_global_scale, nb::handle wait_cost_stats) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  LowLatencyDispatchArgs a;
  a.use_nvfp4 = use_nvfp4;
  a.x_global_scale = arg(x_global_scale, "x_global_scale", in, "float32");
  a.x = arg(x, "x", in, "bfloat16");
  a.topk_idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
  a.topk_weights = arg(topk_weights, "topk_weights", in, "float32");
  a.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank;
  a.num_experts = num_experts;
  a.use_fp8 = use_fp8;
  a.round_scale = round_scale;
  a.use_ue8m0 = use_ue8m0;
  a.async_finish = async_finish;
  a.return_recv_hook = return_recv_hook;
  a.cumulative_local_expert_recv_stats = arg(stats, "cumulative_local_expert_recv_stats", in, "int32");
  a.dispatch_wait_recv_cost_stats = arg(wait_cost_stats, "dispatch_wait_recv_cost_stats", in, "int64");
  auto st = std::make_shared<LowLatencyDispatchState>();
  st->buffer = b.buffer;
  if (!stats.is_none() || !wait_cost_stats.is_none()) st->keep = make_ref(nb::make_tuple(stats, wait_cost_stats));
  bool gpu = false;
  {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    st->native = buf(b).low_latency_dispatch(a);
    const LowLatencyDispatchResult& r = st->native;
    gpu = r.packed_recv_x.device.is_cuda();
    if (gpu) {
      // The window's views, each keeping the buffer (and so the window) alive.
      const auto view = [&](const TensorView& v) { return v.defined() ? Tensor::wrap(v, b.buffer) : Tensor(); };
      st->x = view(r.packed_recv_x);
      st->scales = view(r.packed_recv_x_scales);
      st->count = view(r.packed_recv_count);
      st->src_info = view(r.handle.src_info);
      st->layout_range = view(r.handle.layout_range);
    } else {
      st->x = empty_like(r.packed_recv_x);
      // fp8: DeepEP's column-major layout, as the buffer's own view (semantics §5); nvfp4: the swizzled bytes.
      if (r.packed_recv_x_scales.defined())
        st->scales = r.packed_recv_x_scales.dtype == DType::fp8_e4m3
                         ? empty_like(r.packed_recv_x_scales)
                         : empty_fp8_scales(r.packed_recv_x_scales.dtype, r.packed_recv_x_scales.shape,
                                            ScaleLayout::column_major);
      st->count = empty_like(r.packed_recv_count);
      st->src_info = empty_like(r.handle.src_info);
      st->layout_range = empty_like(r.handle.layout_range);
      if (!return_recv_hook) st->copy_out();
    }
  }
  nb::object hook = nb::none();
  if (return_recv_hook) hook = nb::cast(PyRecvHook{st->native.hook, b.buffer, gpu ? nullptr : st, st->keep});
  // GPU: views of the window, the same every other call (made once each); CPU: fresh arrays.
  const auto out = [&](const Tensor& t) { return gpu ? window_view(b, t, fw) : to_py_or_none(t, fw); };
  return nb::make_tuple(out(st->x), out(st->scales), out(st->count), out(st->src_info), out(st->layout_range),
                        nb::cast(st->native.handle), nb::cast(st->native.event), hook);
}

nb::tuple low_latency_combine(PyBuffer& b, nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                              const LowLatencyHandle& handle, bool zero_copy, bool async_finish, bool return_recv_hook,
                              nb::handle out, std::string_view framework, std::optional<std::uintptr_t> stream,
                              bool overlap, nb::handle packed_recv_count, nb::handle comp_signal, int block_m,
                              int threshold, int num_sms, nb::handle src_signals,
                              std::int64_t src_signal_expect_value, nb::handle wait_cost_stats) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  LowLatencyCombineArgs a;
  a.x = arg(x, "x", in, "bfloat16");
  a.topk_idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
  a.topk_weights = arg(topk_weights, "topk_weights", in, "float32");
  a.handle = &handle;
  a.zero_copy = zero_copy;
  a.async_finish = async_finish;
  a.return_recv_hook = return_recv_hook;
  a.out = arg(out, "out", in, "bfloat16");
  a.combine_wait_recv_cost_stats = arg(wait_cost_stats, "combine_wait_recv_cost_stats", in, "int64");
  a.overlap = overlap;
  a.packed_recv_count = arg(packed_recv_count, "packed_recv_count", in, "int32");
  a.comp_signal = arg(comp_signal, "comp_signal", in, "int32");
  a.block_m = block_m;
  a.threshold = threshold;
  a.num_sms = num_sms;
  a.src_signals = arg(src_signals, "src_signals", in, "uint32");
  a.src_signal_expect_value = src_signal_expect_value;
  LowLatencyCombineResult r;
  {
    nb::gil_scoped_release release;
    StreamGuard guard(stream_of(stream));
    r = buf(b).low_latency_combine(a);
  }
  nb::object hook = nb::none();
  // The hook keeps what its receive writes: `out` and the statistic.
  if (return_recv_hook)
    hook = nb::cast(PyRecvHook{r.hook, b.buffer, nullptr, make_ref(nb::make_tuple(out, wait_cost_stats))});
  // With `out` the result is the caller's own array (epmoe/buffer.py returns it).
  nb::object combined = out.is_none() ? to_py(r.combined_x, fw) : nb::none();
  return nb::make_tuple(combined, nb::cast(r.event), hook);
}

// ---- the classes ----

void bind_event(nb::module_& m) {
  nb::class_<Event>(m, "Event",
                    "Completion of an operation: a CUDA event of a cuda_ipc buffer (async_finish=True), else "
                    "already complete.")
      .def(nb::init<>())
      .def("done", &Event::done)
      .def_prop_ro("is_cuda", [](const Event& e) { return e.backend() != nullptr; })
      .def(
          "current_stream_wait",
          [](const Event& e, std::optional<std::uintptr_t> stream) {
            StreamGuard guard(stream_of(stream));
            e.current_stream_wait();
          },
          nb::arg("stream").none() = nb::none(),
          "Makes `stream` (a cudaStream_t as an int; None: the legacy default stream) wait for the event. "
          "No-op for a complete event.")
      .def(
          "wait_host",
          [](const Event& e) {
            // The GIL is released: with thread ranks, the peer rank's Python thread may still have to enqueue its
            // part of this op. Bounded: a device wait that times out ends its kernel (the op then raises).
            nb::gil_scoped_release release;
            while (!e.done()) std::this_thread::yield();
          },
          "Blocks the host until the event completes, without holding the GIL.");
}

void bind_handles(nb::module_& m) {
  nb::class_<NormalHandle>(m, "NormalHandle", "What combine and a cached dispatch need from a normal-mode dispatch.")
      .def_ro("num_tokens", &NormalHandle::num_tokens)
      .def_ro("num_recv_tokens", &NormalHandle::num_recv_tokens)
      .def_ro("num_recv_rows", &NormalHandle::num_recv_rows)
      .def_ro("hidden", &NormalHandle::hidden)
      .def_ro("num_experts", &NormalHandle::num_experts)
      .def_ro("expert_alignment", &NormalHandle::expert_alignment)
      .def_ro("num_worst_tokens", &NormalHandle::num_worst_tokens);

  nb::class_<LowLatencyHandle>(m, "LowLatencyHandle", "What low_latency_combine needs from a low-latency dispatch.")
      .def_ro("num_max_dispatch_tokens_per_rank", &LowLatencyHandle::num_max_dispatch_tokens_per_rank)
      .def_ro("hidden", &LowLatencyHandle::hidden)
      .def_ro("num_experts", &LowLatencyHandle::num_experts)
      .def_ro("generation", &LowLatencyHandle::generation);

  nb::class_<PyRecvHook>(m, "RecvHook",
                         "Receive half of a low-latency call made with return_recv_hook=True. Call it exactly once; "
                         "a second call raises epmoe.Error (code 'stale_handle').")
      .def("__call__", &PyRecvHook::call, nb::arg("stream").none() = nb::none(),
           "Runs the receive half; on a GPU buffer it is enqueued on `stream` (a cudaStream_t as an int; None: the "
           "legacy default stream).");
}

void bind_buffer_class(nb::module_& m) {
  nb::class_<PyBuffer>(m, "Buffer", "epmoe::Buffer of one rank (use epmoe.Buffer).")
      .def("__init__", &buffer_init, nb::arg("group"), nb::arg("num_nvl_bytes") = 0, nb::arg("num_rdma_bytes") = 0,
           nb::arg("low_latency_mode") = false, nb::arg("backend") = "auto", nb::arg("device") = -1,
           nb::arg("num_sms") = 0, nb::arg("num_recv_slots") = 0, nb::arg("debug_validate") = false)
      .def("rank", [](PyBuffer& b) { return buf(b).rank(); })
      .def("num_ranks", [](PyBuffer& b) { return buf(b).num_ranks(); })
      .def("destroy",
           [](PyBuffer& b) {
             b.window_views.clear();  // they hold the buffer (and its window) too
             b.buffer.reset();
           })
      .def(
          "comm_stream",
          [](PyBuffer& b) -> std::optional<std::uintptr_t> {
            const Stream s = buf(b).comm_stream();
            if (s.handle == nullptr) return std::nullopt;
            return reinterpret_cast<std::uintptr_t>(s.handle);
          },
          "The cudaStream_t of async_finish work as an int; None on CPU backends.")
      .def(
          "local_buffer",
          [](PyBuffer& b, bool low_latency_window, std::string_view framework) -> nb::object {
            const TensorView v = buf(b).local_buffer(low_latency_window);
            if (!v.defined()) return nb::none();
            return to_py(Tensor::wrap(v, b.buffer), parse_framework(framework));
          },
          nb::arg("low_latency_window"), nb::arg("framework") = "torch",
          "This rank's normal-mode data region or low-latency window as uint8 bytes (a view kept alive with the "
          "buffer); None where there is none.")
      .def(
          "next_low_latency_combine_buffer",
          [](PyBuffer& b, const LowLatencyHandle& handle, std::string_view framework) -> nb::object {
            TensorView v;
            {
              nb::gil_scoped_release release;
              v = buf(b).get_next_low_latency_combine_buffer(handle);
            }
            return to_py(Tensor::wrap(v, b.buffer), parse_framework(framework));
          },
          nb::arg("handle"), nb::arg("framework") = "torch",
          "Buffer::get_next_low_latency_combine_buffer: a bfloat16 [E_local, R*Tmax, H] view into the window (kept "
          "alive with the buffer).")
      .def_static("get_normal_nvl_size_hint", &Buffer::get_normal_nvl_size_hint, nb::arg("max_tokens_per_rank"),
                  nb::arg("hidden"), nb::arg("num_ranks"), nb::arg("num_topk"))
      .def_static("get_low_latency_rdma_size_hint", &Buffer::get_low_latency_rdma_size_hint,
                  nb::arg("num_max_dispatch_tokens_per_rank"), nb::arg("hidden"), nb::arg("num_ranks"),
                  nb::arg("num_experts"))
      .def("get_dispatch_layout", &get_dispatch_layout, nb::arg("topk_idx"), nb::arg("num_experts"),
           nb::arg("framework") = "numpy", nb::arg("stream").none() = nb::none())
      .def("dispatch", &dispatch, nb::arg("x"), nb::arg("x_scales").none(), nb::arg("topk_idx").none(),
           nb::arg("topk_weights").none(), nb::arg("num_tokens_per_rank").none(), nb::arg("is_token_in_rank").none(),
           nb::arg("num_tokens_per_expert").none(), nb::arg("handle").none(), nb::arg("expert_alignment") = 1,
           nb::arg("num_worst_tokens") = 0, nb::arg("previous_event").none() = nb::none(),
           nb::arg("async_finish") = false, nb::arg("allocate_on_comm_stream") = false, nb::arg("framework") = "numpy",
           nb::arg("stream").none() = nb::none())
      .def("combine", &combine, nb::arg("x"), nb::arg("handle").none(), nb::arg("topk_weights").none(),
           nb::arg("bias_0").none(), nb::arg("bias_1").none(), nb::arg("previous_event").none() = nb::none(),
           nb::arg("async_finish") = false, nb::arg("allocate_on_comm_stream") = false, nb::arg("framework") = "numpy",
           nb::arg("stream").none() = nb::none())
      .def("clean_low_latency_buffer", &clean_low_latency_buffer, nb::arg("num_max_dispatch_tokens_per_rank"),
           nb::arg("hidden"), nb::arg("num_experts"))
      .def("low_latency_dispatch", &low_latency_dispatch, nb::arg("x"), nb::arg("topk_idx"),
           nb::arg("topk_weights").none(), nb::arg("num_max_dispatch_tokens_per_rank"), nb::arg("num_experts"),
           nb::arg("cumulative_local_expert_recv_stats").none(), nb::arg("use_fp8") = true,
           nb::arg("round_scale") = false, nb::arg("use_ue8m0") = false, nb::arg("async_finish") = false,
           nb::arg("return_recv_hook") = false, nb::arg("framework") = "numpy", nb::arg("stream").none() = nb::none(),
           nb::arg("use_nvfp4") = false, nb::arg("x_global_scale").none() = nb::none(),
           nb::arg("dispatch_wait_recv_cost_stats").none() = nb::none())
      .def("low_latency_combine", &low_latency_combine, nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"),
           nb::arg("handle"), nb::arg("zero_copy") = false, nb::arg("async_finish") = false,
           nb::arg("return_recv_hook") = false, nb::arg("out").none() = nb::none(), nb::arg("framework") = "numpy",
           nb::arg("stream").none() = nb::none(), nb::arg("overlap") = false,
           nb::arg("packed_recv_count").none() = nb::none(), nb::arg("comp_signal").none() = nb::none(),
           nb::arg("block_m") = 0, nb::arg("threshold") = 0, nb::arg("num_sms") = 0,
           nb::arg("src_signals").none() = nb::none(), nb::arg("src_signal_expect_value") = 0,
           nb::arg("combine_wait_recv_cost_stats").none() = nb::none());
}

}  // namespace

void bind_buffer(nb::module_& m) {
  bind_event(m);
  bind_handles(m);
  bind_buffer_class(m);
}

}  // namespace epmoe::py
