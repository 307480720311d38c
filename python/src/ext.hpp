// Shared pieces of the epmoe._ext bindings: tensors in and out, the GIL, the wrapped objects.
//
// Tensors cross as DLPack / buffer-protocol arrays (nanobind's ndarray). NumPy has no bfloat16 or fp8
// of its own: the Python layer (epmoe/_tensor.py) hands ml_dtypes arrays over as a tuple
// (uint16/uint8 view, dtype name), and outputs of those dtypes come back as uint views re-viewed as
// ml_dtypes.bfloat16 / ml_dtypes.float8_e4m3fn, so the user only ever sees ml_dtypes arrays.
// Frameworks with the dtypes built in (PyTorch) pass their tensors directly; a torch.Tensor itself is read
// from its attributes (arg), without a DLPack export.
#pragma once

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/tensor.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe::py {

namespace nb = nanobind;

/// The name the C++ API gives an argument and the name a Python caller gives it: {"options.num_topk", "num_topk"}.
struct PythonName {
  std::string_view cpp, python;
};

/// Returns `f()`. An invalid_argument naming one of `names`' C++ arguments is rethrown naming the Python argument
/// instead (naming_argument; its code and the rest of its message kept), for bindings that hand Python arguments to
/// C++ under other names (a struct's fields, a tuple's part): the message names what the caller typed. Other errors
/// pass as they are.
template <class F>
decltype(auto) with_python_names(std::initializer_list<PythonName> names, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    std::string message = e.what();
    for (const PythonName& n : names) message = naming_argument(message, n.cpp, n.python);
    throw Error(e.code(), std::move(message));
  }
}

/// Which array type outputs are made as: NumPy (+ ml_dtypes), PyTorch or CuPy (via DLPack).
enum class Framework { numpy, torch, cupy };
/// "numpy", "torch" or "cupy"; anything else is invalid_argument naming 'framework'.
Framework parse_framework(std::string_view name);

/// Keeps the converted arrays of one call alive while the call's TensorViews are in use.
struct Inputs {
  std::vector<nb::ndarray<nb::ro>> arrays;
  std::vector<nb::object> objects;  // converted forms of arguments (torch tensors taking the DLPack route)
};

/// A tensor argument: None (an empty view), an array-like, or (array-like, dtype name) from the Python
/// layer. `takes` names the dtypes the argument takes ("float32", "int64 or int32"), for the message of a dtype
/// epmoe holds none of: every argument names its own, not the list of all that epmoe holds, in the words of the call's
/// own dtype checks (throw_wrong_dtype). Errors (invalid_argument naming `name`): not an array, an unsupported dtype
/// (float64, uint16, ...: "expected dtype float32, got float64[4, 8] cpu"), more than 4 dimensions, an unsupported
/// device, a tag whose element size differs from the array's. A torch.Tensor (once register_torch ran) is read from
/// its attributes where it is a strided CPU or CUDA tensor of a supported dtype, else converted by
/// epmoe._tensor._torch_arg and read by DLPack (the same checks and messages).
TensorView arg(nb::handle obj, const char* name, Inputs& keep, const char* takes);

/// Hands over torch.Tensor, torch.strided, the (torch dtype, epmoe dtype name) pairs that arg reads directly, the
/// Python function giving a torch tensor's DLPack form (epmoe._tensor._torch_arg), and torch._C._from_dlpack (or
/// None), which makes torch outputs from a capsule. Called once, by epmoe/_tensor.py, when torch is imported (the
/// extension never imports torch).
void register_torch(nb::handle tensor_type, nb::handle strided, nb::handle dtypes, nb::handle slow_arg,
                    nb::handle from_dlpack);

/// A Tensor owning its data that aliases a Python array (the array stays referenced as long as the
/// Tensor's storage lives; the reference is dropped under the GIL). `name` and `takes` as for arg.
Tensor tensor_from_py(nb::handle obj, const char* name, const char* takes);

/// A new Python array sharing `t`'s storage (no copy).
nb::object to_py(const Tensor& t, Framework fw);
/// A new Python array over `v`'s memory, kept alive by `owner` (no copy).
nb::object view_to_py(const TensorView& v, nb::handle owner, Framework fw);
/// None when `t` is undefined, else to_py(t, fw).
nb::object to_py_or_none(const Tensor& t, Framework fw);

/// A Group whose collectives call `all_gather(data: bytes, phase: str) -> bytes` (every rank's `data`,
/// rank-major; every rank passes the same length) under the GIL. `backend` names it ("torch", "mpi4py").
/// Errors: invalid_argument for size < 1, rank outside [0, size), a reserved backend name.
std::shared_ptr<Group> make_callback_group(int rank, int size, std::string backend, nb::callable all_gather);

/// Python-side Group: a shared_ptr to the C++ group.
struct PyGroup {
  std::shared_ptr<Group> group;
};

/// Python-side Buffer: a shared_ptr so hooks and layers can keep it alive.
struct PyBuffer {
  std::shared_ptr<Buffer> buffer;
  /// The Python objects of views of the buffer's window that low-latency calls return (a GPU dispatch's recv_x,
  /// scales, count, src_info and layout_range of each half), made once per view (address, dtype, shape, strides,
  /// device, framework) and handed out as fresh aliases (window_view). Making one through DLPack took ~10 us of
  /// host time per tensor per call. At most kMaxWindowViews, the oldest dropped first; cleared by a clean.
  struct WindowView {
    TensorView view;
    Framework framework;
    nb::object object;
  };
  static constexpr std::size_t kMaxWindowViews = 32;
  std::vector<WindowView> window_views;
};

/// Deleter that drops a Python reference under the GIL (for keep-alives held by C++ objects that may
/// be destroyed on threads without it).
struct GilDecref {
  void operator()(nb::object* p) const;
};
using PyRef = std::shared_ptr<nb::object>;
PyRef make_ref(nb::handle obj);

void bind_errors(nb::module_& m);
void bind_group(nb::module_& m);
void bind_buffer(nb::module_& m);
void bind_ops(nb::module_& m);
void bind_moe(nb::module_& m);
void bind_eplb(nb::module_& m);
/// mpi_library_version() and mpi_group_from_fortran() when built with MPI (nothing otherwise).
void bind_mpi(nb::module_& m);

}  // namespace epmoe::py
