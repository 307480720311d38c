// BufferOptions' tunables as JSON (buffer.hpp): the file `epmoe tune` writes and `--config` reads.
//
// One table row per field: adding a tunable to BufferOptions is one line in kFields.
#include <epmoe/buffer.hpp>

#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <sstream>
#include <set>
#include <string>
#include <variant>

#include "core/check.hpp"

namespace epmoe {
namespace {

struct Field {
  const char* name;
  std::variant<int BufferOptions::*, std::int64_t BufferOptions::*, bool BufferOptions::*> member;
  std::int64_t min;  // inclusive range of integer fields
  std::int64_t max;
  const char* meaning;
};

constexpr std::int64_t kNoMax = std::numeric_limits<std::int64_t>::max();

// The tunables. Sizes that follow from the workload (num_nvl_bytes, num_rdma_bytes) and the device are
// not here: they are set per run, not tuned.
const Field kFields[] = {
    {"num_sms", &BufferOptions::num_sms, 0, 64, "blocks of each cuda_ipc data kernel (0 = the default)"},
    {"use_copy_engine", &BufferOptions::use_copy_engine, 0, 1, "cuda_ipc: bulk rows by copy engine (else SM stores)"},
    {"num_chunks", &BufferOptions::num_chunks, 0, 16, "cuda_ipc copy-engine pipeline stages (0 = the default)"},
    {"copy_engine_min_rows", &BufferOptions::copy_engine_min_rows, 0, kNoMax,
     "cuda_ipc: fewer rows per rank take the SM-store path"},
    {"num_recv_slots", &BufferOptions::num_recv_slots, 0, 64, "cuda_ipc zero-copy receive slots (0 = none)"},
    {"combine_sm_push", &BufferOptions::combine_sm_push, 0, 1,
     "cuda_ipc copy-engine combine: pushes by SM stores (else copy engines)"},
    {"low_latency_separate_quant", &BufferOptions::low_latency_separate_quant, 0, 1,
     "cuda_ipc low-latency fp8 dispatch: quantize before the send kernel (else inside it)"},
    {"mpi_pack_rows", &BufferOptions::mpi_pack_rows, 0, 1, "mpi: pack scattered rows before sending (else a datatype)"},
};

std::string known_fields() {
  std::string s;
  for (const Field& f : kFields) s += std::string(s.empty() ? "" : ", ") + f.name;
  return s;
}

std::string type_name(const nlohmann::json& v) { return v.type_name(); }

}  // namespace

void apply_buffer_config_json(std::string_view json_text, BufferOptions& options, std::string_view source) {
  nlohmann::json j;
  // A field given twice would silently keep its last value (what nlohmann::json does): refused, naming it.
  std::set<std::string> seen;
  std::string repeated;
  const auto note_keys = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second &&
        repeated.empty())
      repeated = parsed.get<std::string>();
    return true;
  };
  try {
    j = nlohmann::json::parse(json_text, note_keys);
  } catch (const nlohmann::json::parse_error& e) {
    throw_invalid_argument(source, "a JSON object of BufferOptions fields",
                           fmt::format("text that is not JSON ({})", e.what()));
  }
  if (!repeated.empty())
    throw_invalid_argument(fmt::format("{}:{}", source, repeated), "each field at most once", "given twice or more");
  EPMOE_CHECK_ARG(j.is_object(), source, "a JSON object of BufferOptions fields",
                  fmt::format("a JSON {}", type_name(j)));
  // Check every field before setting any, so a bad file leaves `options` as it was.
  BufferOptions out = options;
  for (const auto& [key, value] : j.items()) {
    if (!key.empty() && key[0] == '_') continue;  // notes
    const Field* field = nullptr;
    for (const Field& f : kFields)
      if (key == f.name) field = &f;
    const std::string arg = fmt::format("{}:{}", source, key);  // e.g. "cfg.json:num_sms"
    EPMOE_CHECK_ARG(field != nullptr, arg,
                    fmt::format("one of the known fields ({}) or a note starting with '_'", known_fields()),
                    "an unknown field");
    std::visit(
        [&](auto member) {
          using T = std::remove_reference_t<decltype(out.*member)>;
          if constexpr (std::is_same_v<T, bool>) {
            EPMOE_CHECK_ARG(value.is_boolean(), arg, "true or false", value.dump());
            out.*member = value.get<bool>();
          } else {
            EPMOE_CHECK_ARG(value.is_number_integer(), arg,
                            fmt::format("an integer in [{}, {}]", field->min, field->max),
                            fmt::format("{} ({})", value.dump(), type_name(value)));
            const std::int64_t v =
                value.is_number_unsigned() && value.get<std::uint64_t>() > kNoMax ? kNoMax : value.get<std::int64_t>();
            EPMOE_CHECK_ARG(v >= field->min && v <= field->max, arg,
                            fmt::format("an integer in [{}, {}]", field->min, field->max), v);
            out.*member = static_cast<T>(v);
          }
        },
        field->member);
  }
  options = out;
}

void load_buffer_config(const std::string& path, BufferOptions& options) {
  std::ifstream in(path);
  EPMOE_CHECK_ARG(in.good(), "config", "a readable JSON file", path);
  std::ostringstream text;
  text << in.rdbuf();
  apply_buffer_config_json(text.str(), options, path);
}

std::string buffer_config_json(const BufferOptions& options) {
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : kFields) std::visit([&](auto member) { j[f.name] = options.*member; }, f.member);
  return j.dump(2);
}

}  // namespace epmoe
