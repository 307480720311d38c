// epmoe._ext: the module, its exception type, groups and thread ranks.
#include "ext.hpp"

#include <epmoe/error.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/timeout.hpp>
#include <epmoe/version.hpp>

#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <thread>

#include <fmt/format.h>

namespace epmoe::py {

namespace {
PyObject* g_error_type = nullptr;

/// The kind of `p` for first_root_cause: 0 a root cause, 1 an epmoe timeout, 2 epmoe unusable (both what a rank sees
/// of another rank's failure). A rank's Python function re-raises an epmoe::Error as epmoe.Error, which comes back
/// here as nb::python_error: its `code` attribute is checked, so a Python exception never hides behind one.
/// Needs the GIL.
int python_cause_class(const std::exception_ptr& p) {
  const auto of_name = [](std::string_view name) {
    return name == error_code_name(ErrorCode::timeout) ? 1 : name == error_code_name(ErrorCode::unusable) ? 2 : 0;
  };
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    return of_name(error_code_name(e.code()));
  } catch (nb::python_error& e) {
    if (g_error_type == nullptr || !e.matches(g_error_type)) return 0;
    nb::handle value = e.value();
    if (!nb::hasattr(value, "code")) return 0;
    nb::object code = value.attr("code");
    if (!nb::isinstance<nb::str>(code)) return 0;
    return of_name(nb::cast<std::string>(code));
  } catch (...) {
    return 0;
  }
}

/// Names rank `rank` in the Python exception `value` its function raised, editing the object itself (not making a new
/// one), so its type, attributes (an epmoe.Error's `code`) and traceback stay as raised. Where its message is its one
/// string argument (str(e) is e.args[0]: ValueError("..."), epmoe.Error) that argument becomes naming_rank's ("rank 1:
/// ...", "epmoe: rank 1: ..."). Any other (no argument or several, or a type with its own __str__, as KeyError and
/// OSError, whose arguments are data, not the message) gets a note "raised by rank R of run_thread_ranks" instead
/// (add_note: Python 3.11+; older Pythons leave it as it is). Needs the GIL.
void name_the_rank(nb::handle value, int rank) {
  nb::object args = value.attr("args");
  const nb::object own_str = nb::getattr(value.type(), "__str__");
  const nb::object base_str = nb::getattr(nb::handle(PyExc_BaseException), "__str__");
  if (nb::len(args) == 1 && nb::isinstance<nb::str>(args[0]) && own_str.is(base_str)) {
    value.attr("args") = nb::make_tuple(naming_rank(nb::cast<std::string>(args[0]), rank));
  } else if (nb::hasattr(value, "add_note")) {
    value.attr("add_note")(fmt::format("raised by rank {} of run_thread_ranks", rank));
  }
}

/// Rank `rank`'s exception `p` as run_thread_ranks re-raises it, naming the rank: a Python exception as the same object
/// (name_the_rank), a C++ one as epmoe::rethrow_naming_rank says (an epmoe::Error keeps its code). Needs the GIL.
[[noreturn]] void reraise_naming_rank(const std::exception_ptr& p, int rank) {
  try {
    std::rethrow_exception(p);
  } catch (nb::python_error& e) {
    name_the_rank(e.value(), rank);
    throw;
  } catch (...) {
  }
  epmoe::rethrow_naming_rank(p, rank);
}
}  // namespace

void bind_errors(nb::module_& m) {
  // epmoe.Error: a RuntimeError whose message is the C++ one ("epmoe: invalid argument 'x': expected ...,
  // got ...") and whose `code` attribute names the ErrorCode ("invalid_argument", "timeout", ...).
  g_error_type = PyErr_NewExceptionWithDoc(
      "epmoe.Error",
      "Every failure epmoe reports. str(e) is the C++ message (for bad arguments it names the argument, what "
      "was expected and what came); e.code is one of 'invalid_argument', 'rank_mismatch', 'timeout', "
      "'stale_handle', 'unusable', 'out_of_memory', 'unsupported', 'internal'.",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (const Error& e) {
          PyObject* inst = PyObject_CallFunction(g_error_type, "s", e.what());
          if (inst == nullptr) return;  // the call's own exception stands
          const std::string_view code = error_code_name(e.code());
          PyObject* code_str = PyUnicode_FromStringAndSize(code.data(), static_cast<Py_ssize_t>(code.size()));
          if (code_str != nullptr) {
            PyObject_SetAttrString(inst, "code", code_str);
            Py_DECREF(code_str);
          }
          PyErr_SetObject(g_error_type, inst);
          Py_DECREF(inst);
        }
      });
}

void bind_group(nb::module_& m) {
  nb::class_<PyGroup>(m, "Group",
                      "The ranks of one expert-parallel group (epmoe::Group): rank(), size() and small collectives. "
                      "Made by run_thread_ranks (threads backend), or by as_group from a torch ProcessGroup or an "
                      "mpi4py communicator.")
      .def("rank", [](const PyGroup& g) { return g.group->rank(); })
      .def("size", [](const PyGroup& g) { return g.group->size(); })
      .def_prop_ro("backend", [](const PyGroup& g) { return std::string(g.group->backend()); })
      .def_prop_rw(
          "timeout_s", [](const PyGroup& g) { return g.group->timeout_s(); },
          [](PyGroup& g, double s) {
            if (!(s > 0)) throw_invalid_argument("timeout_s", "> 0", fmt::format("{}", s));
            g.group->set_timeout_s(s);
          })
      .def(
          "barrier",
          [](PyGroup& g, const std::string& phase) {
            nb::gil_scoped_release release;
            g.group->barrier(phase);
          },
          nb::arg("phase") = "python barrier")
      .def(
          "all_gather_bytes",
          [](PyGroup& g, nb::bytes data, const std::string& phase) {
            // Every rank must pass the same length (the group's all_gather is fixed-size): exchange lengths first.
            const std::int64_t n = static_cast<std::int64_t>(data.size());
            const int R = g.group->size();
            std::vector<std::int64_t> sizes(static_cast<size_t>(R));
            std::string mine(data.c_str(), data.size());
            std::vector<char> all;
            {
              nb::gil_scoped_release release;
              g.group->all_gather(&n, sizes.data(), sizeof(n), phase);
              std::int64_t longest = 0;
              for (auto s : sizes) longest = std::max(longest, s);
              mine.resize(static_cast<size_t>(longest));
              all.resize(static_cast<size_t>(longest) * static_cast<size_t>(R));
              g.group->all_gather(mine.data(), all.data(), static_cast<size_t>(longest), phase);
            }
            nb::list out;
            const size_t stride = R > 0 ? all.size() / static_cast<size_t>(R) : 0;
            for (int r = 0; r < R; ++r)
              out.append(nb::bytes(all.data() + static_cast<size_t>(r) * stride,
                                   static_cast<size_t>(sizes[static_cast<size_t>(r)])));
            return out;
          },
          nb::arg("data"), nb::arg("phase") = "python all_gather_bytes")
      .def_static(
          "from_all_gather",
          [](int rank, int size, std::string backend, nb::callable all_gather) {
            return PyGroup{make_callback_group(rank, size, std::move(backend), std::move(all_gather))};
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("backend"), nb::arg("all_gather"),
          "A Group over ranks of another runtime (torch.distributed, mpi4py): every collective calls "
          "all_gather(data: bytes, phase: str) -> bytes, which returns every rank's data rank-major (each rank "
          "passes the same length). Use epmoe.as_group(torch_group) / as_group(None, comm=...) instead.")
      .def(
          "broadcast_bytes",
          [](PyGroup& g, nb::bytes data, int root, const std::string& phase) {
            std::string buf(data.c_str(), data.size());
            {
              nb::gil_scoped_release release;
              g.group->broadcast(buf.data(), buf.size(), root, phase);
            }
            return nb::bytes(buf.data(), buf.size());
          },
          nb::arg("data"), nb::arg("root"), nb::arg("phase") = "python broadcast_bytes",
          "root's `data` on every rank (every rank passes the same length).")
      .def(
          "check_agreement",
          [](PyGroup& g, const std::vector<std::pair<std::string, std::int64_t>>& settings, const std::string& phase) {
            std::vector<Setting> s;
            for (const auto& [name, value] : settings) s.push_back(Setting{name, value});
            nb::gil_scoped_release release;
            g.group->check_agreement(s, phase);
          },
          nb::arg("settings"), nb::arg("phase") = "python check_agreement",
          "Compares (name, int) settings across ranks; a mismatch raises epmoe.Error('rank_mismatch') on every rank.")
      .def("__repr__", [](const PyGroup& g) {
        return fmt::format("epmoe.Group(backend='{}', rank={}, size={})", g.group->backend(), g.group->rank(),
                           g.group->size());
      });

  m.def(
      "run_thread_ranks",
      [](int num_ranks, nb::callable fn, std::optional<double> timeout_s) {
        if (num_ranks < 1) throw_invalid_argument("num_ranks", ">= 1", fmt::format("{}", num_ranks));
        if (timeout_s && !(*timeout_s > 0))
          throw_invalid_argument("timeout_s", "> 0 or None", fmt::format("{}", *timeout_s));
        ThreadWorld world(num_ranks);
        std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
        std::vector<nb::object> results(static_cast<size_t>(num_ranks));
        {
          // The ranks take the GIL only while they run Python code; every collective releases it.
          nb::gil_scoped_release release;
          world.run_threads([&](int r) {
            std::string reason = "its function raised";
            try {
              PyGroup g{world.group(r)};
              if (timeout_s) g.group->set_timeout_s(*timeout_s);
              nb::gil_scoped_acquire gil;
              try {
                results[static_cast<size_t>(r)] = fn(g);
              } catch (nb::python_error& e) {
                // Its message breaks the group (below), so peers that find it broken name the cause.
                reason = nb::cast<std::string>(nb::str(e.value()));
                errors[static_cast<size_t>(r)] = std::current_exception();
              } catch (...) {
                errors[static_cast<size_t>(r)] = std::current_exception();
              }
            } catch (...) {
              errors[static_cast<size_t>(r)] = std::current_exception();
            }
            // A failed rank fails the others at once (ErrorCode::unusable naming it) instead of leaving them to
            // wait out their timeout in the next collective; the world records the order of the failures.
            if (errors[static_cast<size_t>(r)]) {
              world.abort(r, reason);
            } else {
              world.mark_returned(r);
            }
          });
        }
        // The root cause (not the timeouts or 'unusable' other ranks saw of it, whatever their rank order), else a
        // timeout, else the first 'unusable' (first_root_cause), naming the rank that raised it: a Python exception as
        // the same object, its message or a note naming the rank (reraise_naming_rank).
        if (auto e = first_root_cause(errors, world.failure_order(), python_cause_class))
          reraise_naming_rank(e, static_cast<int>(std::find(errors.begin(), errors.end(), e) - errors.begin()));
        nb::list out;
        for (auto& r : results) out.append(r);
        return out;
      },
      nb::arg("num_ranks"), nb::arg("fn"), nb::arg("timeout_s") = nb::none());

  m.def("default_timeout_s", &default_timeout_s);
}

}  // namespace epmoe::py

NB_MODULE(_ext, m) {
  namespace py = epmoe::py;
  m.doc() = "epmoe's C++ core (nanobind). Use the `epmoe` package; this module is its implementation.";
  m.def("version", [] { return std::string(epmoe::version()); });
  m.def("built_with_cuda", &epmoe::built_with_cuda);
  m.def(
      "set_current_stream",
      [](std::optional<std::uintptr_t> handle) -> std::optional<std::uintptr_t> {
        // epmoe's current stream is per thread (stream.hpp); the GIL-released calls run on this thread.
        const epmoe::Stream previous = epmoe::current_stream();
        epmoe::stream_detail::current_slot() = epmoe::Stream{handle ? reinterpret_cast<void*>(*handle) : nullptr};
        if (previous.handle == nullptr) return std::nullopt;
        return reinterpret_cast<std::uintptr_t>(previous.handle);
      },
      nanobind::arg("stream").none(),
      "Sets the calling thread's current CUDA stream for epmoe's functions (a cudaStream_t as an int; None: the "
      "legacy default stream) and returns the previous one. epmoe.ops uses it to run on torch's current stream.");
  m.def("cuda_device_count", &epmoe::cuda_device_count);
  m.def("register_torch", &py::register_torch, nanobind::arg("tensor_type"), nanobind::arg("strided"),
        nanobind::arg("dtypes"), nanobind::arg("slow_arg"), nanobind::arg("from_dlpack").none(),
        "torch's types for reading torch.Tensor arguments without DLPack and making torch outputs (epmoe/_tensor.py "
        "calls it once).");
  m.attr("has_mpi") =
#if defined(EPMOE_HAVE_MPI)
      true;
#else
      false;
#endif
  py::bind_mpi(m);
  py::bind_errors(m);
  py::bind_group(m);
  py::bind_buffer(m);
  py::bind_ops(m);
  py::bind_moe(m);
  py::bind_eplb(m);
}
