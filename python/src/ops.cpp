// epmoe._ext: router (semantics §2), dispatch layout (semantics §3) and fp8 quantization (semantics §6).
#include "ext.hpp"

#include <epmoe/error.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/nvfp4.hpp>
#include <epmoe/permute.hpp>  // cuda::check_invalid_ids
#include <epmoe/quant.hpp>
#include <epmoe/router.hpp>

#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <fmt/format.h>

namespace epmoe::py {

namespace {

template <class F>
nb::tuple run_topk(nb::handle logits, std::string_view framework, F&& f) {
  const Framework fw = parse_framework(framework);
  Inputs in;
  const TensorView l = arg(logits, "logits", in, "float32 or bfloat16");
  TopkResult r;
  {
    nb::gil_scoped_release release;
    r = f(l, in);
  }
  return nb::make_tuple(to_py(r.topk_weights, fw), to_py(r.topk_idx, fw));
}

ScaleLayout scale_layout_of(std::string_view name) {
  if (name == scale_layout_name(ScaleLayout::row_major)) return ScaleLayout::row_major;
  if (name == scale_layout_name(ScaleLayout::column_major)) return ScaleLayout::column_major;
  throw_invalid_argument("scale_layout", "'row_major' or 'column_major'", fmt::format("'{}'", name));
}

Nvfp4ScaleLayout nvfp4_scale_layout_of(std::string_view name) {
  for (const Nvfp4ScaleLayout l : {Nvfp4ScaleLayout::swizzled, Nvfp4ScaleLayout::linear})
    if (name == nvfp4_scale_layout_name(l)) return l;
  throw_invalid_argument("scale_layout", "'swizzled' or 'linear'", fmt::format("'{}'", name));
}

DType out_dtype_of(std::string_view name) {
  if (name == "bfloat16") return DType::bf16;
  if (name == "float32") return DType::fp32;
  throw_invalid_argument("out_dtype", "'bfloat16' or 'float32'", fmt::format("'{}'", name));
}

// fp8 and NVFP4 quantization (semantics §6).
void bind_quant(nb::module_& m) {
  m.def(
      "quantize_fp8",
      [](nb::handle x, bool round_scale, bool use_ue8m0, std::string_view scale_layout, std::string_view framework) {
        const Framework fw = parse_framework(framework);
        const Fp8Options o{round_scale, use_ue8m0, scale_layout_of(scale_layout)};
        Inputs in;
        const TensorView v = arg(x, "x", in, "bfloat16 or float32");
        Fp8Tensor r;
        {
          nb::gil_scoped_release release;
          // The Python arguments are Fp8Options' fields: its messages name them as the caller does.
          r = with_python_names({{"options.use_ue8m0", "use_ue8m0"}}, [&] { return quantize_fp8(v, o); });
        }
        return nb::make_tuple(to_py(r.data, fw), to_py(r.scales, fw));
      },
      nb::arg("x"), nb::arg("round_scale") = false, nb::arg("use_ue8m0") = false, nb::arg("scale_layout") = "row_major",
      nb::arg("framework") = "numpy");
  m.def(
      "dequantize_fp8",
      [](nb::handle q, nb::handle scales, std::string_view out_dtype, std::string_view framework) {
        const Framework fw = parse_framework(framework);
        const DType od = out_dtype_of(out_dtype);
        Inputs in;
        const TensorView qv = arg(q, "q", in, "float8_e4m3fn");
        const TensorView sv = arg(scales, "scales", in, "float32 or int32 (UE8M0)");
        Tensor r;
        {
          nb::gil_scoped_release release;
          r = dequantize_fp8(qv, sv, od);
        }
        return to_py(r, fw);
      },
      nb::arg("q"), nb::arg("scales"), nb::arg("out_dtype") = "bfloat16", nb::arg("framework") = "numpy");
  m.def(
      "quantize_nvfp4",
      [](nb::handle x, nb::handle global_scale, std::string_view scale_layout, std::string_view framework) {
        const Framework fw = parse_framework(framework);
        const Nvfp4ScaleLayout layout = nvfp4_scale_layout_of(scale_layout);
        Inputs in;
        const TensorView v = arg(x, "x", in, "bfloat16 or float32");
        const TensorView gs = arg(global_scale, "global_scale", in, "float32");
        Nvfp4Tensor r;
        {
          nb::gil_scoped_release release;
          r = quantize_nvfp4(v, gs, layout);
        }
        return nb::make_tuple(to_py(r.data, fw), to_py(r.scales, fw));
      },
      nb::arg("x"), nb::arg("global_scale"), nb::arg("scale_layout") = "swizzled", nb::arg("framework") = "numpy");
  m.def(
      "dequantize_nvfp4",
      [](nb::handle q, nb::handle scales, nb::handle global_scale, std::string_view scale_layout,
         std::string_view out_dtype, std::string_view framework) {
        const Framework fw = parse_framework(framework);
        const Nvfp4ScaleLayout layout = nvfp4_scale_layout_of(scale_layout);
        const DType od = out_dtype_of(out_dtype);
        Inputs in;
        const TensorView qv = arg(q, "q", in, "uint8");
        const TensorView sv = arg(scales, "scales", in, "float8_e4m3fn");
        const TensorView gs = arg(global_scale, "global_scale", in, "float32");
        Tensor r;
        {
          nb::gil_scoped_release release;
          r = dequantize_nvfp4(qv, sv, gs, layout, od);
        }
        return to_py(r, fw);
      },
      nb::arg("q"), nb::arg("scales"), nb::arg("global_scale"), nb::arg("scale_layout") = "swizzled",
      nb::arg("out_dtype") = "bfloat16", nb::arg("framework") = "numpy");
  m.def("fp8_group_scale", &fp8_group_scale, nb::arg("amax"), nb::arg("round_scale") = false);
  m.def("ue8m0_from_scale", &ue8m0_from_scale, nb::arg("pow2_scale"));
  m.def("ue8m0_to_scale", &ue8m0_to_scale, nb::arg("byte"));
}

}  // namespace

void bind_ops(nb::module_& m) {
  m.def(
      "topk_softmax",
      [](nb::handle logits, int num_topk, bool renormalize, std::string_view framework) {
        return run_topk(logits, framework,
                        [&](const TensorView& l, Inputs&) { return topk_softmax(l, num_topk, renormalize); });
      },
      nb::arg("logits"), nb::arg("num_topk"), nb::arg("renormalize") = false, nb::arg("framework") = "numpy");
  m.def(
      "topk_sigmoid",
      [](nb::handle logits, int num_topk, bool renormalize, std::string_view framework) {
        return run_topk(logits, framework,
                        [&](const TensorView& l, Inputs&) { return topk_sigmoid(l, num_topk, renormalize); });
      },
      nb::arg("logits"), nb::arg("num_topk"), nb::arg("renormalize") = false, nb::arg("framework") = "numpy");
  m.def(
      "grouped_topk",
      [](nb::handle logits, int num_topk, int num_expert_group, int topk_group, std::string_view scoring_func,
         bool renormalize, float routed_scaling_factor, nb::handle bias, std::string_view framework) {
        GroupedTopkOptions o;
        o.num_topk = num_topk;
        o.num_expert_group = num_expert_group;
        o.topk_group = topk_group;
        if (scoring_func == "softmax") {
          o.scoring = ScoringFunc::softmax;
        } else if (scoring_func == "sigmoid") {
          o.scoring = ScoringFunc::sigmoid;
        } else {
          throw_invalid_argument("scoring_func", "'softmax' or 'sigmoid'", fmt::format("'{}'", scoring_func));
        }
        o.renormalize = renormalize;
        o.routed_scaling_factor = routed_scaling_factor;
        Inputs keep;
        o.e_score_correction_bias = arg(bias, "e_score_correction_bias", keep, "float32");
        // The Python arguments are GroupedTopkOptions' fields: its messages name them as the caller does.
        return with_python_names({{"options.num_topk", "num_topk"},
                                  {"options.num_expert_group", "num_expert_group"},
                                  {"options.topk_group", "topk_group"},
                                  {"options.routed_scaling_factor", "routed_scaling_factor"},
                                  {"options.e_score_correction_bias", "e_score_correction_bias"}},
                                 [&] {
                                   return run_topk(logits, framework, [&](const TensorView& l, Inputs&) {
                                     return grouped_topk(l, o);
                                   });
                                 });
      },
      nb::arg("logits"), nb::arg("num_topk"), nb::arg("num_expert_group"), nb::arg("topk_group"),
      nb::arg("scoring_func") = "softmax", nb::arg("renormalize") = true, nb::arg("routed_scaling_factor") = 1.0f,
      nb::arg("e_score_correction_bias").none() = nb::none(), nb::arg("framework") = "numpy");

  m.def(
      "get_dispatch_layout",
      [](nb::handle topk_idx, int num_experts, int num_ranks, std::string_view framework) {
        const Framework fw = parse_framework(framework);
        Inputs in;
        const TensorView idx = arg(topk_idx, "topk_idx", in, "int64 or int32");
        DispatchLayout l;
        {
          nb::gil_scoped_release release;
          l = get_dispatch_layout(idx, num_experts, num_ranks);
        }
        return nb::make_tuple(to_py(l.num_tokens_per_rank, fw), to_py(l.num_tokens_per_expert, fw),
                              to_py(l.is_token_in_rank, fw));
      },
      nb::arg("topk_idx"), nb::arg("num_experts"), nb::arg("num_ranks"), nb::arg("framework") = "numpy");

  // Waits for epmoe's current stream (the Python wrapper sets it to the caller's), so the GIL is let go.
  m.def("check_invalid_ids", [] {
    nb::gil_scoped_release release;
    cuda::check_invalid_ids();
  });
  bind_quant(m);
}

}  // namespace epmoe::py
