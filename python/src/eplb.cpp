// epmoe._ext: expert load statistics and EPLB (semantics §9): the planner on the host, the recorder on the host or a GPU.
#include "ext.hpp"

#include <epmoe/eplb.hpp>
#include <epmoe/error.hpp>
#include <epmoe/version.hpp>
#include <epmoe/group.hpp>

#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <fmt/format.h>

#include <span>

namespace epmoe::py {

namespace {

template <class T>
nb::object numpy_array(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  if (heap->empty()) heap->reserve(1);  // a valid pointer for empty arrays
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.begin(), owner));
}

// A C-contiguous host array of T with `ndim` dimensions; anything else is invalid_argument naming `name`.
template <class T>
std::span<const T> host_array(const nb::ndarray<nb::ro>& a, size_t ndim, const char* name, const char* dtype_name) {
  const bool ok_dtype = a.dtype() == nb::dtype<T>();
  bool contiguous = true;
  int64_t expect = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expect) contiguous = false;
    expect *= static_cast<int64_t>(a.shape(d));
  }
  if (!ok_dtype || a.ndim() != ndim || a.device_type() != nb::device::cpu::value || !contiguous) {
    std::string shape = "[";
    for (size_t d = 0; d < a.ndim(); ++d) shape += fmt::format("{}{}", d ? ", " : "", a.shape(d));
    throw_invalid_argument(name, fmt::format("a C-contiguous {}-d {} host array", ndim, dtype_name),
                           fmt::format("{}-d shape {}{}", a.ndim(), shape + "]", ok_dtype ? "" : " of another dtype"));
  }
  return {static_cast<const T*>(a.data()), a.size()};
}

// The recorder keeps num_layers x window x num_experts int64 counts: settings whose history cannot fit this machine's
// memory are named before the constructor allocates it (a bad_alloc, or an overcommitted allocation ending the
// process, would not name them). Settings the constructor refuses are left for it to name.
void check_recorder_fits(std::int64_t num_layers, std::int64_t num_experts, std::int64_t num_ranks,
                         std::int64_t window) {
  if (num_layers < 1 || num_experts < 1 || num_ranks < 1 || num_experts % num_ranks != 0 || window < 1) return;
  const double need = static_cast<double>(num_layers) * static_cast<double>(window) *
                      static_cast<double>(num_experts) * sizeof(std::int64_t);
  const double have = host_memory_bytes();
  if (have > 0 && need > have)
    throw Error(ErrorCode::out_of_memory,
                fmt::format("epmoe: out of memory: 'window' = {} keeps num_layers ({}) x window x num_experts ({}) "
                            "int64 counts: {:.0f} bytes, more than this machine's {:.0f} bytes of memory",
                            window, num_layers, num_experts, need, have));
}

// The planner and the id/load mappings: plain functions on host arrays.
void bind_planner(nb::module_& m) {
  m.def(
      "rebalance_experts",
      [](nb::ndarray<nb::ro> weight, std::int64_t num_replicas, std::int64_t num_groups, std::int64_t num_nodes,
         std::int64_t num_gpus) {
        const auto w = host_array<double>(weight, 2, "weight", "float64");
        const auto L = static_cast<std::int64_t>(weight.shape(0)), E = static_cast<std::int64_t>(weight.shape(1));
        EplbPlan plan;
        {
          nb::gil_scoped_release release;
          plan = rebalance_experts(w, L, E, num_replicas, num_groups, num_nodes, num_gpus);
        }
        const auto uL = static_cast<size_t>(L), uE = static_cast<size_t>(E);
        return nb::make_tuple(
            numpy_array(std::move(plan.physical_to_logical), {uL, static_cast<size_t>(plan.num_physical_experts)}),
            numpy_array(std::move(plan.logical_to_physical), {uL, uE, static_cast<size_t>(plan.max_replicas)}),
            numpy_array(std::move(plan.logical_replica_count), {uL, uE}));
      },
      nb::arg("weight"), nb::arg("num_replicas"), nb::arg("num_groups"), nb::arg("num_nodes"), nb::arg("num_gpus"));
  m.def(
      "map_to_physical",
      [](nb::handle topk_idx, nb::ndarray<nb::ro> log2phy, nb::ndarray<nb::ro> logcnt, std::int64_t layer,
         std::string_view framework) {
        const Framework fw = parse_framework(framework);
        Inputs in;
        const TensorView idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
        const auto l2p = host_array<std::int64_t>(log2phy, 3, "logical_to_physical", "int64");
        const auto cnt = host_array<std::int64_t>(logcnt, 2, "logical_replica_count", "int64");
        const auto L = static_cast<std::int64_t>(log2phy.shape(0)), E = static_cast<std::int64_t>(log2phy.shape(1));
        if (logcnt.shape(0) != log2phy.shape(0) || logcnt.shape(1) != log2phy.shape(1))
          throw_invalid_argument("logical_replica_count", fmt::format("shape [{}, {}]", L, E),
                                 fmt::format("[{}, {}]", logcnt.shape(0), logcnt.shape(1)));
        Tensor out;
        {
          nb::gil_scoped_release release;
          out = map_to_physical(idx, l2p, cnt, L, E, static_cast<std::int64_t>(log2phy.shape(2)), layer);
        }
        return to_py(out, fw);
      },
      nb::arg("topk_idx"), nb::arg("logical_to_physical"), nb::arg("logical_replica_count"), nb::arg("layer"),
      nb::arg("framework") = "numpy");

  m.def(
      "logical_loads",
      [](nb::ndarray<nb::ro> physical_loads, nb::ndarray<nb::ro> phy2log, std::int64_t num_logical_experts) {
        const auto loads = host_array<std::int64_t>(physical_loads, 2, "physical_loads", "int64");
        EplbPlan plan;
        const auto p2l = host_array<std::int64_t>(phy2log, 2, "physical_to_logical", "int64");
        plan.physical_to_logical.assign(p2l.begin(), p2l.end());
        plan.num_layers = static_cast<std::int64_t>(phy2log.shape(0));
        plan.num_physical_experts = static_cast<std::int64_t>(phy2log.shape(1));
        plan.num_logical_experts = num_logical_experts;
        if (physical_loads.shape(0) != phy2log.shape(0) || physical_loads.shape(1) != phy2log.shape(1))
          throw_invalid_argument("physical_loads",
                                 fmt::format("shape [{}, {}] (physical_to_logical's)", phy2log.shape(0), phy2log.shape(1)),
                                 fmt::format("[{}, {}]", physical_loads.shape(0), physical_loads.shape(1)));
        std::vector<std::int64_t> out = logical_loads(plan, loads);
        return numpy_array(std::move(out), {static_cast<size_t>(plan.num_layers), static_cast<size_t>(num_logical_experts)});
      },
      nb::arg("physical_loads"), nb::arg("physical_to_logical"), nb::arg("num_logical_experts"));

  m.def(
      "load_balancedness",
      [](nb::ndarray<nb::ro> loads, std::int64_t num_ranks) {
        const auto l = host_array<std::int64_t>(loads, 2, "loads", "int64");
        std::vector<double> b = load_balancedness(l, static_cast<std::int64_t>(loads.shape(0)),
                                                  static_cast<std::int64_t>(loads.shape(1)), num_ranks);
        const auto L = static_cast<size_t>(loads.shape(0));
        return numpy_array(std::move(b), {L});
      },
      nb::arg("loads"), nb::arg("num_ranks"));

}

}  // namespace

void bind_eplb(nb::module_& m) {
  bind_planner(m);
  // device: -1 = the CPU, else the CUDA device index.
  nb::class_<ExpertLoadRecorder>(m, "ExpertLoadRecorder", "Tokens per (layer, expert) over a window (semantics §9).")
      .def(
          "__init__",
          [](ExpertLoadRecorder* self, std::int64_t num_layers, std::int64_t num_experts, std::int64_t num_ranks,
             std::int64_t window, int device) {
            if (device < 0) check_recorder_fits(num_layers, num_experts, num_ranks, window);
            nb::gil_scoped_release release;  // a GPU recorder waits once for its zeroed state
            new (self) ExpertLoadRecorder(num_layers, num_experts, num_ranks, window,
                                          device < 0 ? Device::cpu() : Device::cuda(device));
          },
          nb::arg("num_layers"), nb::arg("num_experts"), nb::arg("num_ranks"), nb::arg("window"),
          nb::arg("device") = -1)
      .def(
          "record",
          [](ExpertLoadRecorder& r, std::int64_t layer, nb::handle counts) {
            Inputs in;
            r.record(layer, arg(counts, "num_tokens_per_expert", in, "int32 or int64"));
          },
          nb::arg("layer"), nb::arg("num_tokens_per_expert"))
      .def(
          "record_local",
          [](ExpertLoadRecorder& r, std::int64_t layer, nb::handle counts, std::int64_t expert_offset) {
            Inputs in;
            r.record_local(layer, arg(counts, "num_recv_tokens_per_expert", in, "int32 or int64"), expert_offset);
          },
          nb::arg("layer"), nb::arg("num_recv_tokens_per_expert"), nb::arg("expert_offset"))
      .def(
          "global_loads",
          [](const ExpertLoadRecorder& r, PyGroup& g) {
            std::vector<std::int64_t> loads;
            {
              nb::gil_scoped_release release;  // a collective: the other (thread) ranks must run
              loads = r.global_loads(*g.group);
            }
            return numpy_array(std::move(loads),
                               {static_cast<size_t>(r.num_layers()), static_cast<size_t>(r.num_experts())});
          },
          nb::arg("group"))
      .def(
          "to_json",
          [](const ExpertLoadRecorder& r, PyGroup* g) {
            nb::gil_scoped_release release;
            return g ? r.to_json(*g->group) : r.to_json();
          },
          nb::arg("group").none() = nb::none())
      .def_prop_ro("device", [](const ExpertLoadRecorder& r) { return to_string(r.device()); })
      .def("loads",
           [](const ExpertLoadRecorder& r) {
             return numpy_array(r.loads(), {static_cast<size_t>(r.num_layers()), static_cast<size_t>(r.num_experts())});
           })
      .def("balancedness",
           [](const ExpertLoadRecorder& r) {
             return numpy_array(r.balancedness(), {static_cast<size_t>(r.num_layers())});
           })
      .def("num_records",
           [](const ExpertLoadRecorder& r) {
             return numpy_array(r.num_records(), {static_cast<size_t>(r.num_layers())});
           })
      .def("reset", &ExpertLoadRecorder::reset)
      .def_prop_ro("num_layers", &ExpertLoadRecorder::num_layers)
      .def_prop_ro("num_experts", &ExpertLoadRecorder::num_experts)
      .def_prop_ro("num_ranks", &ExpertLoadRecorder::num_ranks)
      .def_prop_ro("window", &ExpertLoadRecorder::window);
}

}  // namespace epmoe::py
