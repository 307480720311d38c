// Tensors across the Python boundary (see ext.hpp).
#include "ext.hpp"

#include <epmoe/error.hpp>

#include <nanobind/stl/string.h>

#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace epmoe::py {

namespace {

namespace dl = nb::dlpack;

constexpr int kDLCPU = 1, kDLCUDA = 2;

std::string dlpack_dtype_name(dl::dtype d) {
  std::string base;
  switch (static_cast<dl::dtype_code>(d.code)) {
    case dl::dtype_code::Int: base = "int"; break;
    case dl::dtype_code::UInt: base = "uint"; break;
    case dl::dtype_code::Float: base = "float"; break;
    case dl::dtype_code::Bfloat: base = "bfloat"; break;
    case dl::dtype_code::Complex: base = "complex"; break;
    case dl::dtype_code::Bool: return "bool";
    case dl::dtype_code::Float8_E4M3FN: return "float8_e4m3fn";
    case dl::dtype_code::Float8_E5M2: return "float8_e5m2";
    default: base = fmt::format("dlpack_code{}_", static_cast<int>(d.code)); break;
  }
  std::string s = fmt::format("{}{}", base, d.bits);
  if (d.lanes != 1) s += fmt::format("x{}", d.lanes);
  return s;
}

std::optional<DType> dtype_from_dlpack(dl::dtype d) {
  if (d.lanes != 1) return std::nullopt;
  switch (static_cast<dl::dtype_code>(d.code)) {
    case dl::dtype_code::Int:
      if (d.bits == 8) return DType::int8;
      if (d.bits == 16) return DType::int16;
      if (d.bits == 32) return DType::int32;
      if (d.bits == 64) return DType::int64;
      break;
    case dl::dtype_code::UInt:
      if (d.bits == 8) return DType::uint8;
      if (d.bits == 32) return DType::uint32;
      break;
    case dl::dtype_code::Float:
      if (d.bits == 16) return DType::fp16;
      if (d.bits == 32) return DType::fp32;
      break;
    case dl::dtype_code::Bfloat:
      if (d.bits == 16) return DType::bf16;
      break;
    case dl::dtype_code::Float8_E4M3FN:
      if (d.bits == 8) return DType::fp8_e4m3;
      break;
    case dl::dtype_code::Bool:
      if (d.bits == 8) return DType::boolean;
      break;
    default: break;
  }
  return std::nullopt;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::bf16, DType::fp16, DType::fp32, DType::fp8_e4m3, DType::int8, DType::int16, DType::int32,
                  DType::int64, DType::boolean, DType::uint8, DType::uint32})
    if (dtype_name(t) == name) return t;
  return std::nullopt;
}

// What a DType travels as: the real DLPack type where the framework takes it, else the unsigned integer
// of the same width, re-viewed afterwards (view_to_py): NumPy and CuPy lack bfloat16 and fp8 (re-viewed
// as ml_dtypes), and PyTorch's DLPack import of float8 is too recent to rely on (re-viewed as
// torch.float8_e4m3fn).
dl::dtype dlpack_of(DType t, Framework fw) {
  const auto code = [](dl::dtype_code c, int bits) {
    return dl::dtype{static_cast<std::uint8_t>(c), static_cast<std::uint8_t>(bits), 1};
  };
  switch (t) {
    case DType::bf16: return fw == Framework::torch ? code(dl::dtype_code::Bfloat, 16) : code(dl::dtype_code::UInt, 16);
    case DType::fp8_e4m3: return code(dl::dtype_code::UInt, 8);
    case DType::fp16: return code(dl::dtype_code::Float, 16);
    case DType::fp32: return code(dl::dtype_code::Float, 32);
    case DType::int8: return code(dl::dtype_code::Int, 8);
    case DType::int16: return code(dl::dtype_code::Int, 16);
    case DType::int32: return code(dl::dtype_code::Int, 32);
    case DType::int64: return code(dl::dtype_code::Int, 64);
    case DType::boolean: return code(dl::dtype_code::Bool, 8);
    case DType::uint8: return code(dl::dtype_code::UInt, 8);
    case DType::uint32: return code(dl::dtype_code::UInt, 32);
  }
  return code(dl::dtype_code::UInt, 8);
}

// ml_dtypes' scalar types, looked up once; the references are deliberately never released so they
// outlive every array at interpreter shutdown.
nb::handle ml_dtype(DType t) {
  static nb::handle bf16 = nb::object(nb::module_::import_("ml_dtypes").attr("bfloat16")).release();
  static nb::handle fp8 = nb::object(nb::module_::import_("ml_dtypes").attr("float8_e4m3fn")).release();
  return t == DType::bf16 ? bf16 : fp8;
}

Shape make_shape(const std::int64_t* v, int n) {
  switch (n) {
    case 0: return Shape{};
    case 1: return Shape{v[0]};
    case 2: return Shape{v[0], v[1]};
    case 3: return Shape{v[0], v[1], v[2]};
    default: return Shape{v[0], v[1], v[2], v[3]};
  }
}

// An array as the library describes a tensor ("float64[4, 8] cpu", describe in tensor.hpp), for one whose dtype or
// rank epmoe cannot hold (no TensorView can describe it).
std::string describe_array(const nb::ndarray<nb::ro>& a) {
  std::string dims;
  for (size_t i = 0; i < a.ndim(); ++i) dims += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  std::string device = fmt::format("dlpack device {}", a.device_type());
  if (a.device_type() == kDLCPU) device = to_string(Device::cpu());
  if (a.device_type() == kDLCUDA) device = to_string(Device::cuda(a.device_id()));
  return fmt::format("{}[{}] {}", dlpack_dtype_name(a.dtype()), dims, device);
}

// Every dtype epmoe holds: what a dtype tag of the Python layer (epmoe/_tensor.py) names.
constexpr const char* kSupported =
    "a tensor of dtype bfloat16, float16, float32, float8_e4m3fn, int8, int16, int32, int64, bool, uint8 or uint32";

// torch's types, handed over by epmoe/_tensor.py once torch is imported (register_torch). The references are never
// released, as ml_dtype's.
struct TorchTypes {
  PyTypeObject* tensor = nullptr;  // torch.Tensor itself (subclasses take the DLPack route)
  PyObject* strided = nullptr;     // torch.strided
  std::vector<std::pair<PyObject*, DType>> dtypes;
  PyObject* slow_arg = nullptr;  // epmoe._tensor._torch_arg: the DLPack route's form of a tensor
  PyObject* from_dlpack = nullptr;  // torch._C._from_dlpack (a capsule in, a tensor out), or null
  PyObject* float8 = nullptr;       // torch.float8_e4m3fn, or null
};
TorchTypes& torch_types() {
  static TorchTypes t;
  return t;
}

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }  // kept for the module's life

// An attribute read (or a method called without arguments); raises nb::python_error.
nb::object get(nb::handle obj, PyObject* name, bool call) {
  PyObject* r = call ? PyObject_CallMethodNoArgs(obj.ptr(), name) : PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

bool read_int64s(nb::handle seq, int n, std::int64_t* out) {
  if (!PyTuple_Check(seq.ptr()) || PyTuple_GET_SIZE(seq.ptr()) != n) return false;
  for (int i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq.ptr(), i));
    if (out[i] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// A torch.Tensor read from its attributes (data_ptr, shape, stride, dtype, device): the view its DLPack export gives,
// without the export (~10 us of host time per tensor: torch's __dlpack__ checks and queries the device in Python,
// then makes a capsule). nullopt where the DLPack route decides (and words its errors): another dtype, layout or
// device, more dimensions, a tensor whose attributes raise (no storage). A CUDA tensor of another device than the
// current one, which torch refuses to export, is read too: epmoe's device checks then name both devices.
std::optional<TensorView> torch_view(nb::handle obj) {
  static PyObject *layout = interned("layout"), *dtype = interned("dtype"), *is_cuda = interned("is_cuda"),
                  *is_cpu = interned("is_cpu"), *get_device = interned("get_device"), *shape = interned("shape"),
                  *stride = interned("stride"), *data_ptr = interned("data_ptr");
  const TorchTypes& t = torch_types();
  try {
    if (get(obj, layout, false).ptr() != t.strided) return std::nullopt;
    const nb::object d = get(obj, dtype, false);
    std::optional<DType> type;
    for (const auto& [object, value] : t.dtypes)
      if (object == d.ptr()) type = value;
    if (!type) return std::nullopt;
    Device device;
    if (get(obj, is_cuda, false).ptr() == Py_True) {
      const long index = PyLong_AsLong(get(obj, get_device, true).ptr());
      if (index == -1 && PyErr_Occurred()) throw nb::python_error();
      if (index < 0) return std::nullopt;
      device = Device::cuda(static_cast<int>(index));
    } else if (get(obj, is_cpu, false).ptr() != Py_True) {
      return std::nullopt;
    }
    const nb::object dims = get(obj, shape, false);  // torch.Size, a tuple
    if (!PyTuple_Check(dims.ptr()) || PyTuple_GET_SIZE(dims.ptr()) > Shape::kMaxDims) return std::nullopt;
    const int n = static_cast<int>(PyTuple_GET_SIZE(dims.ptr()));
    std::int64_t sizes[Shape::kMaxDims] = {}, steps[Shape::kMaxDims] = {};
    if (!read_int64s(dims, n, sizes) || !read_int64s(get(obj, stride, true), n, steps)) return std::nullopt;
    void* data = PyLong_AsVoidPtr(get(obj, data_ptr, true).ptr());
    if (data == nullptr && PyErr_Occurred()) throw nb::python_error();
    // As torch's DLPack export (and so the DLPack route): one element of a 1-d tensor has stride 1.
    if (n == 1 && sizes[0] == 1) steps[0] = 1;
    const Shape s = make_shape(sizes, n);
    // An empty tensor's strides carry no information: call it contiguous (as the DLPack route does).
    return TensorView(data, *type, s, s.numel() == 0 ? s.contiguous_strides() : make_shape(steps, n), device);
  } catch (nb::python_error&) {
    return std::nullopt;
  }
}

}  // namespace

Framework parse_framework(std::string_view name) {
  if (name == "numpy") return Framework::numpy;
  if (name == "torch") return Framework::torch;
  if (name == "cupy") return Framework::cupy;
  throw_invalid_argument("framework", "'numpy', 'torch' or 'cupy'", fmt::format("'{}'", name));
}

void GilDecref::operator()(nb::object* p) const {
  if (!Py_IsInitialized()) {
    // The interpreter is gone: the reference cannot be dropped any more (and need not be).
    (void)p->release();
    delete p;
    return;
  }
  nb::gil_scoped_acquire gil;
  delete p;
}

PyRef make_ref(nb::handle obj) { return PyRef(new nb::object(nb::borrow(obj)), GilDecref{}); }

namespace {

// An array argument through DLPack (nanobind's ndarray), or a (view, dtype name) pair of one (see arg).
TensorView dlpack_arg(nb::handle obj, const char* name, Inputs& keep, const char* takes) {
  nb::handle array = obj;
  std::optional<DType> tag;
  if (nb::isinstance<nb::tuple>(obj) && nb::len(obj) == 2 && nb::isinstance<nb::str>(obj[1])) {
    const std::string tag_name = nb::cast<std::string>(obj[1]);
    tag = dtype_from_name(tag_name);
    if (!tag) throw_invalid_argument(name, kSupported, fmt::format("dtype tag '{}'", tag_name));
    array = nb::borrow(obj[0]);
  }
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(array, a, /*convert=*/false))
    throw_invalid_argument(name, "an array (NumPy with ml_dtypes, or a DLPack tensor)",
                           fmt::format("an object of type {}", nb::type_name(array.type()).c_str()));
  DType dtype;
  if (tag) {
    // The Python layer passes ml_dtypes arrays as same-width integer views.
    const dl::dtype d = a.dtype();
    const bool integer_view = (d.code == static_cast<std::uint8_t>(dl::dtype_code::UInt) ||
                               d.code == static_cast<std::uint8_t>(dl::dtype_code::Int)) && d.lanes == 1;
    if (!integer_view || d.bits / 8 != dtype_size(*tag))
      throw_invalid_argument(name, fmt::format("a {}-byte integer view for dtype tag '{}'", dtype_size(*tag),
                                               dtype_name(*tag)),
                             describe_array(a));
    dtype = *tag;
  } else {
    const std::optional<DType> d = dtype_from_dlpack(a.dtype());
    // Such an array never reaches the call's own checks, which say what the argument takes: said here instead, in
    // their words (a dtype epmoe holds but the argument does not take reads the same).
    if (!d) throw_wrong_dtype(name, takes, describe_array(a));
    dtype = *d;
  }
  if (a.ndim() > static_cast<size_t>(Shape::kMaxDims))
    throw_invalid_argument(name, fmt::format("at most {} dimensions", Shape::kMaxDims), describe_array(a));
  Device device;
  if (a.device_type() == kDLCPU) {
    device = Device::cpu();
  } else if (a.device_type() == kDLCUDA) {
    device = Device::cuda(a.device_id());
  } else {
    throw_invalid_argument(name, "a CPU or CUDA tensor", fmt::format("DLPack device type {}", a.device_type()));
  }
  const int n = static_cast<int>(a.ndim());
  std::int64_t shape[Shape::kMaxDims] = {}, strides[Shape::kMaxDims] = {};
  for (int i = 0; i < n; ++i) {
    shape[i] = static_cast<std::int64_t>(a.shape(static_cast<size_t>(i)));
    strides[i] = a.stride(static_cast<size_t>(i));
  }
  const Shape dims = make_shape(shape, n);
  // An empty array's strides carry no information (DLPack exporters may report 0): call it contiguous.
  const Shape steps = dims.numel() == 0 ? dims.contiguous_strides() : make_shape(strides, n);
  TensorView v(const_cast<void*>(a.data()), dtype, dims, steps, device);
  keep.arrays.push_back(std::move(a));
  return v;
}

}  // namespace

void register_torch(nb::handle tensor_type, nb::handle strided, nb::handle dtypes, nb::handle slow_arg,
                    nb::handle from_dlpack) {
  TorchTypes t;
  t.tensor = reinterpret_cast<PyTypeObject*>(tensor_type.inc_ref().ptr());
  t.strided = strided.inc_ref().ptr();
  for (nb::handle pair : dtypes) {
    const std::string name = nb::cast<std::string>(pair[1]);
    const std::optional<DType> d = dtype_from_name(name);
    if (!d) throw_invalid_argument("dtypes", "epmoe dtype names", fmt::format("'{}'", name));
    t.dtypes.emplace_back(nb::handle(pair[0]).inc_ref().ptr(), *d);
    if (*d == DType::fp8_e4m3) t.float8 = t.dtypes.back().first;
  }
  t.slow_arg = slow_arg.inc_ref().ptr();
  if (!from_dlpack.is_none()) t.from_dlpack = from_dlpack.inc_ref().ptr();
  torch_types() = std::move(t);
}

// A torch.Tensor itself (not a subclass), once register_torch ran: read from its attributes where it can be.
bool plain_torch_tensor(nb::handle obj) {
  return torch_types().tensor != nullptr && Py_TYPE(obj.ptr()) == torch_types().tensor;
}

TensorView arg(nb::handle obj, const char* name, Inputs& keep, const char* takes) {
  if (!obj.is_valid() || obj.is_none()) return {};
  if (plain_torch_tensor(obj)) {
    if (std::optional<TensorView> v = torch_view(obj)) return *v;
    // The DLPack route: its checks and messages, on the form epmoe/_tensor.py gives it (detached; float8 as a tagged
    // uint8 view). The converted object lives in `keep` (as the arrays do).
    keep.objects.push_back(nb::steal(PyObject_CallOneArg(torch_types().slow_arg, obj.ptr())));
    if (!keep.objects.back().is_valid()) throw nb::python_error();
    return dlpack_arg(keep.objects.back(), name, keep, takes);
  }
  return dlpack_arg(obj, name, keep, takes);
}

Tensor tensor_from_py(nb::handle obj, const char* name, const char* takes) {
  auto keep = std::make_shared<Inputs>();
  const TensorView v = arg(obj, name, *keep, takes);
  // Hold the Python array (through its ndarray handles) until the Tensor's storage is released. A torch tensor read
  // directly is held as a detached alias, which keeps its storage as a DLPack export does (whatever later
  // set_() or resize_() calls do to the caller's tensor).
  nb::object held = plain_torch_tensor(obj) ? obj.attr("detach")() : nb::borrow(obj);
  auto holder = std::shared_ptr<void>(new PyRef(make_ref(held)), [keep](void* p) mutable {
    auto* ref = static_cast<PyRef*>(p);
    if (Py_IsInitialized()) {
      nb::gil_scoped_acquire gil;
      keep.reset();
      delete ref;
    } else {
      delete ref;
    }
  });
  return Tensor::wrap(v, std::move(holder));
}

nb::object view_to_py(const TensorView& v, nb::handle owner, Framework fw) {
  const int n = v.ndim();
  size_t shape[Shape::kMaxDims] = {};
  std::int64_t strides[Shape::kMaxDims] = {};
  for (int i = 0; i < n; ++i) {
    shape[i] = static_cast<size_t>(v.size(i));
    strides[i] = v.stride(i);
  }
  const dl::dtype dt = dlpack_of(v.dtype, fw);
  const int device_type = v.device.is_cuda() ? kDLCUDA : kDLCPU;
  const bool reviewed = v.dtype == DType::fp8_e4m3 || (v.dtype == DType::bf16 && fw != Framework::torch);
  if (fw == Framework::torch) {
    const TorchTypes& t = torch_types();
    nb::object out;
    if (t.from_dlpack != nullptr) {
      // torch._C._from_dlpack on the export's capsule: where torch.utils.dlpack.from_dlpack (nanobind's torch
      // export) ends, without its per-call work (keyword probing; on CUDA a torch.cuda.Stream for the producer,
      // which nanobind's export ignores).
      static PyObject* dlpack = interned("__dlpack__");
      nb::ndarray<> a(v.data, static_cast<size_t>(n), shape, owner, strides, dt, device_type, v.device.index);
      nb::object capsule = nb::cast(a, nb::rv_policy::reference);  // a capsule, or an array exporting one
      if (!PyCapsule_CheckExact(capsule.ptr())) capsule = get(capsule, dlpack, true);
      out = nb::steal(PyObject_CallOneArg(t.from_dlpack, capsule.ptr()));
      if (!out.is_valid()) throw nb::python_error();
    } else {
      nb::ndarray<nb::pytorch> a(v.data, static_cast<size_t>(n), shape, owner, strides, dt, device_type,
                                 v.device.index);
      out = nb::cast(a, nb::rv_policy::reference);
    }
    if (reviewed)
      out = out.attr("view")(t.float8 != nullptr ? nb::borrow(t.float8)
                                                 : nb::module_::import_("torch").attr("float8_e4m3fn"));
    return out;
  }
  if (fw == Framework::cupy) {
    nb::ndarray<nb::cupy> a(v.data, static_cast<size_t>(n), shape, owner, strides, dt, device_type, v.device.index);
    nb::object out = nb::cast(a, nb::rv_policy::reference);
    if (reviewed) {
      // CuPy builds without ml_dtypes support keep the same-width unsigned view (documented in epmoe/_tensor.py).
      try {
        out = out.attr("view")(ml_dtype(v.dtype));
      } catch (nb::python_error&) {
      }
    }
    return out;
  }
  if (v.device.is_cuda())
    throw Error(ErrorCode::unsupported,
                "epmoe: a CUDA tensor cannot be returned as a NumPy array (pass torch or CuPy tensors for the GPU path)");
  nb::ndarray<nb::numpy> a(v.data, static_cast<size_t>(n), shape, owner, strides, dt, device_type, 0);
  nb::object out = nb::cast(a, nb::rv_policy::reference);
  if (reviewed) out = out.attr("view")(ml_dtype(v.dtype));
  return out;
}

nb::object to_py(const Tensor& t, Framework fw) {
  auto* copy = new Tensor(t);
  nb::capsule owner(copy, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return view_to_py(t.view(), owner, fw);
}

nb::object to_py_or_none(const Tensor& t, Framework fw) { return t.defined() ? to_py(t, fw) : nb::none(); }

}  // namespace epmoe::py
