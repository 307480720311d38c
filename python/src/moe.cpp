// epmoe._ext: the modular MoE layer (semantics §7, 8): experts, prepare/finalize, MoELayer.
#include "ext.hpp"

#include <epmoe/eplb.hpp>  // MoELayer.set_load_recorder
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/moe.hpp>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>  // MoELayer.set_load_recorder
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include <fmt/format.h>

namespace epmoe::py {

namespace {

struct PyExperts {
  std::shared_ptr<Experts> experts;
};
struct PyPrepareFinalize {
  std::shared_ptr<PrepareFinalize> pf;
  int num_ranks = 1;
};
struct PyWorkspaces {
  std::shared_ptr<WorkspaceCache> cache;
};
struct PyMoELayer {
  std::unique_ptr<MoELayer> layer;
  int num_ranks = 1;
  bool has_shared = false;
  /// Python hooks stay registered until handle.remove() (as torch's), not until the handle is collected.
  std::vector<std::shared_ptr<DispatchHookHandle>> hooks;
};
struct PyDispatchHookHandle {
  std::shared_ptr<DispatchHookHandle> handle;
};
/// The framework CUDA tensors are handed to Python callables in when the caller named none: torch when it
/// imports, else CuPy (the two that hold CUDA arrays).
Framework cuda_framework() {
  static const Framework fw = [] {
    try {
      nb::module_::import_("torch");
      return Framework::torch;
    } catch (const nb::python_error&) {
      return Framework::cupy;
    }
  }();
  return fw;
}

/// make_cuda_shared_experts' callable (shared experts on a GPU).
struct PySharedExperts {
  SharedExperts fn;
};

DispatchMode parse_dispatch_mode(std::string_view s) {
  if (s == "normal") return DispatchMode::normal;
  if (s == "low_latency") return DispatchMode::low_latency;
  if (s == "auto") return DispatchMode::automatic;
  throw_invalid_argument("mode", "'normal', 'low_latency' or 'auto'", fmt::format("'{}'", s));
}

ActivationFormat parse_format(std::string_view s) {
  if (s == "standard") return ActivationFormat::standard;
  if (s == "batched_experts") return ActivationFormat::batched_experts;
  throw_invalid_argument("activation_format", "'standard' or 'batched_experts'", fmt::format("'{}'", s));
}

PrepareFinalizeOptions pf_options(std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0) {
  PrepareFinalizeOptions o;
  if (dispatch_dtype == "bfloat16") {
    o.dispatch_dtype = DispatchDtype::bf16;
  } else if (dispatch_dtype == "float8_e4m3fn") {
    o.dispatch_dtype = DispatchDtype::fp8;
  } else {
    throw_invalid_argument("dispatch_dtype", "'bfloat16' or 'float8_e4m3fn'", fmt::format("'{}'", dispatch_dtype));
  }
  o.round_scale = round_scale;
  o.use_ue8m0 = use_ue8m0;
  return o;
}

// A contiguous copy of `v` (any strides), so Python code never holds a view into C++ scratch memory.
Tensor clone(const TensorView& v) {
  Tensor t = Tensor::empty(v.dtype, v.shape);
  if (v.is_contiguous()) {
    if (v.nbytes()) std::memcpy(t.data(), v.data, v.nbytes());
    return t;
  }
  const std::size_t es = dtype_size(v.dtype);
  const int n = v.ndim();
  std::int64_t idx[Shape::kMaxDims] = {};
  auto* out = static_cast<std::byte*>(t.data());
  for (std::int64_t o = 0; o < v.numel(); ++o) {
    std::int64_t off = 0;
    for (int d = 0; d < n; ++d) off += idx[d] * v.stride(d);
    std::memcpy(out + static_cast<std::size_t>(o) * es, static_cast<const std::byte*>(v.data) + off * es, es);
    for (int d = n - 1; d >= 0 && ++idx[d] == v.size(d); --d) idx[d] = 0;
  }
  return t;
}

enum class ExpertsKind { reference, blas, cuda };

ExpertsQuant parse_quant(std::string_view s) {
  if (s == "none") return ExpertsQuant::none;
  if (s == "fp8_block") return ExpertsQuant::fp8_block;
  throw_invalid_argument("quant", "'none' or 'fp8_block'", fmt::format("'{}'", s));
}

std::shared_ptr<Experts> make_experts(ExpertsKind kind, std::string_view format, bool reduce,
                                      std::string_view quant = "none") {
  ExpertsConfig c;
  c.format = parse_format(format);
  c.reduce = reduce;
  c.quant = parse_quant(quant);
  switch (kind) {
    case ExpertsKind::reference: return std::shared_ptr<Experts>(make_reference_experts(c));
    case ExpertsKind::blas: return std::shared_ptr<Experts>(make_blas_experts(c));
    case ExpertsKind::cuda: break;
  }
  // Without CUDA this raises unsupported ("built without CUDA"), after the arguments were checked above.
  return std::shared_ptr<Experts>(make_cuda_experts(c));
}

}  // namespace

void bind_moe(nb::module_& m) {
  // May wait for epmoe's current stream (the Python wrapper sets it to the caller's): the GIL is let go.
  m.def("check_moe_faults", [] {
    nb::gil_scoped_release release;
    cuda::check_moe_faults();
  });
  nb::class_<PyExperts>(m, "Experts",
                        "Expert MLPs (semantics §7): 'reference' (float64), 'blas' (OpenBLAS) on the CPU; 'cuda' on a GPU.")
      .def_prop_ro("name", [](const PyExperts& e) { return std::string(e.experts->name()); })
      .def_prop_ro("activation_format",
                   [](const PyExperts& e) {
                     return std::string(activation_format_name(e.experts->activation_format()));
                   })
      .def_prop_ro("weight_and_reduce", [](const PyExperts& e) {
        return std::string(weight_and_reduce_name(e.experts->weight_and_reduce()));
      });
  m.def(
      "make_reference_experts",
      [](std::string_view format, bool reduce) {
        return PyExperts{make_experts(ExpertsKind::reference, format, reduce)};
      },
      nb::arg("activation_format") = "standard", nb::arg("reduce") = true);
  m.def(
      "make_blas_experts",
      [](std::string_view format, bool reduce) { return PyExperts{make_experts(ExpertsKind::blas, format, reduce)}; },
      nb::arg("activation_format") = "standard", nb::arg("reduce") = true);
  m.def(
      "make_cuda_experts",
      [](std::string_view format, bool reduce, std::string_view quant) {
        return PyExperts{make_experts(ExpertsKind::cuda, format, reduce, quant)};
      },
      nb::arg("activation_format") = "standard", nb::arg("reduce") = true, nb::arg("quant") = "none");
  // ---- shared experts on a GPU ----
  nb::class_<PySharedExperts>(m, "SharedExperts", "Built-in GPU shared experts (make_cuda_shared_experts).");
  m.def(
      "make_cuda_shared_experts",
      [](nb::handle w1, nb::handle w2, std::string_view activation) {
        Tensor a = tensor_from_py(w1, "w1_shared", "bfloat16"), b = tensor_from_py(w2, "w2_shared", "bfloat16");
        return PySharedExperts{make_cuda_shared_experts(std::move(a), std::move(b), parse_activation(activation))};
      },
      nb::arg("w1_shared"), nb::arg("w2_shared"), nb::arg("activation") = "silu");

  nb::class_<PyPrepareFinalize>(m, "PrepareFinalize", "Quantize + dispatch and combine behind one interface (semantics §8).")
      .def_prop_ro("name", [](const PyPrepareFinalize& p) { return std::string(p.pf->name()); })
      .def_prop_ro("activation_format",
                   [](const PyPrepareFinalize& p) {
                     return std::string(activation_format_name(p.pf->activation_format()));
                   })
      .def_prop_ro("stage", [](const PyPrepareFinalize& p) { return std::string(stage_name(p.pf->stage())); })
      .def_ro("num_ranks", &PyPrepareFinalize::num_ranks);
  m.def(
      "make_no_ep_prepare_finalize",
      [](std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0, std::string_view format,
         std::int64_t max_tokens_per_expert) {
        NoEpOptions no_ep;
        no_ep.format = parse_format(format);
        no_ep.max_tokens_per_expert = max_tokens_per_expert;
        return PyPrepareFinalize{
            make_no_ep_prepare_finalize(pf_options(dispatch_dtype, round_scale, use_ue8m0), no_ep), 1};
      },
      nb::arg("dispatch_dtype") = "bfloat16", nb::arg("round_scale") = false, nb::arg("use_ue8m0") = false,
      nb::arg("activation_format") = "standard", nb::arg("max_tokens_per_expert") = 0);
  m.def(
      "make_normal_prepare_finalize",
      [](PyBuffer& b, std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0) {
        if (!b.buffer) throw Error(ErrorCode::unusable, "epmoe: this Buffer was destroyed (Buffer.destroy())");
        return PyPrepareFinalize{
            make_normal_prepare_finalize(b.buffer, pf_options(dispatch_dtype, round_scale, use_ue8m0)),
            b.buffer->num_ranks()};
      },
      nb::arg("buffer"), nb::arg("dispatch_dtype") = "bfloat16", nb::arg("round_scale") = false,
      nb::arg("use_ue8m0") = false);
  // All-gather + reduce-scatter baseline over the buffer's group (the buffer itself moves nothing; the prepare/finalize
  // keeps it, and so its group, alive through an aliasing shared_ptr).
  m.def(
      "make_all_gather_prepare_finalize",
      [](PyBuffer& b, std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0) {
        if (!b.buffer) throw Error(ErrorCode::unusable, "epmoe: this Buffer was destroyed (Buffer.destroy())");
        std::shared_ptr<Group> group(b.buffer, &b.buffer->group());
        return PyPrepareFinalize{
            make_all_gather_prepare_finalize(group, pf_options(dispatch_dtype, round_scale, use_ue8m0)),
            b.buffer->num_ranks()};
      },
      nb::arg("buffer"), nb::arg("dispatch_dtype") = "bfloat16", nb::arg("round_scale") = false,
      nb::arg("use_ue8m0") = false);
  // The same over a Group itself (any Group, e.g. one over a Python all-gather, which a CPU Buffer cannot take).
  m.def(
      "make_all_gather_prepare_finalize",
      [](PyGroup& g, std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0) {
        return PyPrepareFinalize{
            make_all_gather_prepare_finalize(g.group, pf_options(dispatch_dtype, round_scale, use_ue8m0)),
            g.group->size()};
      },
      nb::arg("group"), nb::arg("dispatch_dtype") = "bfloat16", nb::arg("round_scale") = false,
      nb::arg("use_ue8m0") = false);
  m.def(
      "make_low_latency_prepare_finalize",
      [](PyBuffer& b, int tmax, std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0) {
        if (!b.buffer) throw Error(ErrorCode::unusable, "epmoe: this Buffer was destroyed (Buffer.destroy())");
        return PyPrepareFinalize{make_low_latency_prepare_finalize(
                                     b.buffer, tmax, pf_options(dispatch_dtype, round_scale, use_ue8m0)),
                                 b.buffer->num_ranks()};
      },
      nb::arg("buffer"), nb::arg("num_max_dispatch_tokens_per_rank"), nb::arg("dispatch_dtype") = "bfloat16",
      nb::arg("round_scale") = false, nb::arg("use_ue8m0") = false);

  nb::class_<PyWorkspaces>(m, "WorkspaceCache", "Workspaces shared by the layers of a model (one set per micro-batch).")
      .def("__init__", [](PyWorkspaces* self) { new (self) PyWorkspaces{std::make_shared<WorkspaceCache>()}; })
      .def("bytes", [](const PyWorkspaces& w) { return w.cache->bytes(); });

  nb::class_<PyDispatchHookHandle>(m, "DispatchHookHandle",
                                   "One registration of MoELayer.register_dispatch_hook; remove() unregisters it.")
      .def("remove", [](PyDispatchHookHandle& h) { h.handle->remove(); })
      .def_prop_ro("active", [](const PyDispatchHookHandle& h) { return h.handle->active(); });

  nb::class_<PyMoELayer>(m, "MoELayer", "The modular MoE layer (use epmoe.MoELayer).")
      .def(
          "__init__",
          [](PyMoELayer* self, PyPrepareFinalize& pf, PyExperts& experts, nb::handle shared_experts,
             std::int64_t chunk_size, int micro_batch, PyWorkspaces* workspaces, std::string_view framework) {
            const Framework fw = parse_framework(framework);
            SharedExperts shared;
            if (nb::isinstance<PySharedExperts>(shared_experts)) {
              shared = nb::cast<PySharedExperts&>(shared_experts).fn;  // runs without the GIL
            } else if (!shared_experts.is_none()) {
              // CPU: runs on the layer's side thread: takes the GIL, hands Python a copy of the hidden states.
              // CUDA: runs on the calling thread with the layer's side stream current, whose handle Python gets
              // (epmoe/moe.py makes it torch's or CuPy's current stream), over hidden itself (no copy).
              shared = [fn = make_ref(shared_experts), fw](const TensorView& hidden) -> Tensor {
                if (hidden.device.is_cuda()) {
                  const auto stream = reinterpret_cast<std::uintptr_t>(current_stream().handle);
                  nb::gil_scoped_acquire gil;
                  // A CUDA tensor has no NumPy form: the callable gets torch's (CuPy's when torch is absent).
                  nb::object result = (*fn)(view_to_py(hidden, nb::none(), fw != Framework::numpy ? fw : cuda_framework()),
                                            stream);
                  return tensor_from_py(result, "shared_experts(hidden)", "bfloat16");
                }
                Tensor copy = clone(hidden);
                nb::gil_scoped_acquire gil;
                nb::object result = (*fn)(to_py(copy, fw));
                return tensor_from_py(result, "shared_experts(hidden)", "bfloat16");
              };
            }
            MoELayerOptions o;
            o.chunk_size = chunk_size;
            o.micro_batch = micro_batch;
            if (workspaces) o.workspaces = workspaces->cache;
            new (self) PyMoELayer{std::make_unique<MoELayer>(pf.pf, experts.experts, std::move(shared), std::move(o)),
                                  pf.num_ranks, !shared_experts.is_none()};
          },
          nb::arg("prepare_finalize"), nb::arg("experts"), nb::arg("shared_experts").none() = nb::none(),
          nb::arg("chunk_size") = 0, nb::arg("micro_batch") = 0, nb::arg("workspaces").none() = nb::none(),
          nb::arg("framework") = "numpy")
      .def(
          "__init__",
          [](PyMoELayer* self, PyBuffer& b, std::string_view mode, int tmax, PyExperts* normal_experts,
             PyExperts* low_latency_experts, std::string_view dispatch_dtype, bool round_scale, bool use_ue8m0,
             std::int64_t chunk_size, int micro_batch, PyWorkspaces* workspaces) {
            if (!b.buffer) throw Error(ErrorCode::unusable, "epmoe: this Buffer was destroyed (Buffer.destroy())");
            MoELayerOptions o;
            o.chunk_size = chunk_size;
            o.micro_batch = micro_batch;
            if (workspaces) o.workspaces = workspaces->cache;
            new (self) PyMoELayer{
                std::make_unique<MoELayer>(b.buffer, parse_dispatch_mode(mode), tmax,
                                           normal_experts ? normal_experts->experts : nullptr,
                                           low_latency_experts ? low_latency_experts->experts : nullptr,
                                           pf_options(dispatch_dtype, round_scale, use_ue8m0), SharedExperts{},
                                           std::move(o)),
                b.buffer->num_ranks(), false};
          },
          nb::arg("buffer"), nb::arg("mode"), nb::arg("num_max_dispatch_tokens_per_rank"),
          nb::arg("normal_experts").none(), nb::arg("low_latency_experts").none(),
          nb::arg("dispatch_dtype") = "bfloat16", nb::arg("round_scale") = false, nb::arg("use_ue8m0") = false,
          nb::arg("chunk_size") = 0, nb::arg("micro_batch") = 0, nb::arg("workspaces").none() = nb::none())
      .def(
          "register_dispatch_hook",
          [](PyMoELayer& l, nb::handle hook) {
            if (!PyCallable_Check(hook.ptr()))
              throw_invalid_argument("hook", "a callable taking the PrepareFinalize",
                                     fmt::format("an object of type {}", nb::inst_name(hook).c_str()));
            MoELayer* layer = l.layer.get();
            const int num_ranks = l.num_ranks;
            // forward runs without the GIL: the hook takes it, and the reference is copied without touching it.
            auto handle = std::make_shared<DispatchHookHandle>(
                layer->register_dispatch_hook([fn = make_ref(hook), layer, num_ranks](PrepareFinalize&) {
                  nb::gil_scoped_acquire gil;
                  (*fn)(PyPrepareFinalize{layer->shared_prepare_finalize(), num_ranks});
                }));
            std::erase_if(l.hooks, [](const auto& h) { return !h->active(); });
            l.hooks.push_back(handle);
            return PyDispatchHookHandle{std::move(handle)};
          },
          nb::arg("hook"))
      .def_prop_ro("num_dispatch_hooks", [](const PyMoELayer& l) { return l.layer->num_dispatch_hooks(); })
      .def_prop_ro("dispatch_mode",
                   [](const PyMoELayer& l) { return std::string(dispatch_mode_name(l.layer->dispatch_mode())); })
      .def_prop_ro("last_resolved_mode",
                   [](const PyMoELayer& l) { return std::string(dispatch_mode_name(l.layer->last_resolved_mode())); })
      .def_prop_ro("num_low_latency_cleans", [](const PyMoELayer& l) { return l.layer->num_low_latency_cleans(); })
      .def_prop_ro("prepare_finalize",
                   [](const PyMoELayer& l) {
                     return PyPrepareFinalize{l.layer->shared_prepare_finalize(), l.num_ranks};
                   })
      .def(
          "forward",
          [](PyMoELayer& l, nb::handle hidden, nb::handle w1, nb::handle w2, nb::handle topk_weights,
             nb::handle topk_idx, std::string_view activation, int global_num_experts, nb::handle expert_map,
             bool apply_router_weight_on_input, nb::handle output, std::string_view framework,
             std::optional<bool> is_extend_in_batch, nb::handle w1_scale, nb::handle w2_scale) {
            const Framework fw = parse_framework(framework);
            Inputs in;
            MoEForwardArgs a;
            a.hidden = arg(hidden, "hidden", in, "bfloat16");
            a.w1 = arg(w1, "w1", in, "bfloat16 (or float8_e4m3fn with w1_scale)");
            a.w2 = arg(w2, "w2", in, "bfloat16 (or float8_e4m3fn with w2_scale)");
            a.topk_weights = arg(topk_weights, "topk_weights", in, "float32");
            a.topk_idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
            a.activation = parse_activation(activation);
            a.global_num_experts = global_num_experts;
            a.expert_map = arg(expert_map, "expert_map", in, "int32");
            a.apply_router_weight_on_input = apply_router_weight_on_input;
            a.output = arg(output, "output", in, "bfloat16");
            a.is_extend_in_batch = is_extend_in_batch;
            a.w1_scale = arg(w1_scale, "w1_scale", in, "float32");
            a.w2_scale = arg(w2_scale, "w2_scale", in, "float32");
            MoEForwardResult r;
            {
              nb::gil_scoped_release release;
              r = l.layer->forward(a);
            }
            return nb::make_tuple(to_py(r.output, fw), to_py_or_none(r.shared_output, fw));
          },
          nb::arg("hidden"), nb::arg("w1"), nb::arg("w2"), nb::arg("topk_weights"), nb::arg("topk_idx"),
          nb::arg("activation") = "silu", nb::arg("global_num_experts") = 0,
          nb::arg("expert_map").none() = nb::none(), nb::arg("apply_router_weight_on_input") = false,
          nb::arg("output").none() = nb::none(), nb::arg("framework") = "numpy",
          nb::arg("is_extend_in_batch").none() = nb::none(), nb::arg("w1_scale").none() = nb::none(),
          nb::arg("w2_scale").none() = nb::none())
      // ---- EPLB mapping (semantics §9): the plan's arrays flattened row-major ----
      .def(
          "set_eplb_plan",
          [](PyMoELayer& l, std::vector<std::int64_t> physical_to_logical, std::vector<std::int64_t> logical_to_physical,
             std::vector<std::int64_t> logical_replica_count, std::int64_t num_layers, std::int64_t num_logical_experts,
             std::int64_t num_physical_experts, std::int64_t max_replicas, std::int64_t layer) {
            EplbPlan plan;
            plan.num_layers = num_layers;
            plan.num_logical_experts = num_logical_experts;
            plan.num_physical_experts = num_physical_experts;
            plan.max_replicas = max_replicas;
            plan.physical_to_logical = std::move(physical_to_logical);
            plan.logical_to_physical = std::move(logical_to_physical);
            plan.logical_replica_count = std::move(logical_replica_count);
            l.layer->set_eplb_plan(std::move(plan), layer);
          },
          nb::arg("physical_to_logical"), nb::arg("logical_to_physical"), nb::arg("logical_replica_count"),
          nb::arg("num_layers"), nb::arg("num_logical_experts"), nb::arg("num_physical_experts"),
          nb::arg("max_replicas"), nb::arg("layer"))
      .def("clear_eplb_plan", [](PyMoELayer& l) { l.layer->clear_eplb_plan(); })
      .def_prop_ro("eplb_layer", [](const PyMoELayer& l) { return l.layer->eplb_layer(); })
      // ---- expert load recorder (semantics §9) ----
      .def(
          "set_load_recorder",
          [](PyMoELayer& l, std::shared_ptr<ExpertLoadRecorder> recorder, std::int64_t layer) {
            l.layer->set_load_recorder(std::move(recorder), layer);
          },
          nb::arg("recorder").none(), nb::arg("layer"))
      .def_prop_ro("load_recorder_layer", [](const PyMoELayer& l) { return l.layer->load_recorder_layer(); })
      .def_ro("num_ranks", &PyMoELayer::num_ranks)
      .def_ro("has_shared_experts", &PyMoELayer::has_shared)
      .def_prop_ro("last_chunk_rows", [](const PyMoELayer& l) { return l.layer->last_chunk_rows(); })
      .def_prop_ro("stage", [](PyMoELayer& l) { return std::string(stage_name(l.layer->prepare_finalize().stage())); });
}

}  // namespace epmoe::py
