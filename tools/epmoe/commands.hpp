// Subcommands of the `epmoe` tool. Each registers its options on the CLI11 app and runs on the
// public API only.
#pragma once

#include <epmoe/error.hpp>

#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <system_error>

namespace epmoe::cli {

/// A word of the command line as a message says it: quoted as typed, so that blanks show (" 2" reads "got ' 2'").
inline std::string as_typed(const std::string& word) { return "'" + word + "'"; }

/// Why `v` is not an integer as the README says integers are read (an optional sign, then decimal digits: not "0x10",
/// "1e3", " 2" or ""), as an option's message ends ("expected a decimal integer, got '0x10'"); "" when it is one.
inline std::string decimal_integer_error(const std::string& v) {
  if (v.empty()) return "expected a decimal integer, got an empty value";
  const std::size_t sign = v[0] == '-' || v[0] == '+' ? 1 : 0;
  if (v.size() == sign || v.find_first_not_of("0123456789", sign) != std::string::npos)
    return "expected a decimal integer, got " + as_typed(v);
  return "";
}

/// A CLI11 check for unsigned 64-bit flags (CLI11 would wrap "-1" around and saturate past 2^64 - 1): names the
/// value when it is not a decimal integer, negative or out of range.
/// No description: CLI11 appends it to the type in --help, which already says UINT ("--seed UINT:UINT").
inline CLI::Validator non_negative_integer() {
  return CLI::Validator(
      [](std::string& v) {
        if (std::string not_decimal = decimal_integer_error(v); !not_decimal.empty()) return not_decimal;
        if (v[0] == '-') return "expected a non-negative integer, got " + v;
        // CLI11 would saturate a value past 2^64 - 1 silently: parsed here first.
        const std::size_t sign = v[0] == '+' ? 1 : 0;
        std::uint64_t n = 0;
        if (std::from_chars(v.data() + sign, v.data() + v.size(), n).ec == std::errc::result_out_of_range)
          return "expected an integer in [0, 18446744073709551615], got " + v;
        return std::string();
      },
      "");
}

/// The values an integer option takes, as at_least or in_range declared them: from `least`, up to `most` where the
/// command has a largest value of its own (else up to its type's largest).
struct DeclaredRange {
  std::int64_t least = 0;
  std::optional<std::int64_t> most;
};

/// The range of each integer option declared with at_least or in_range. An option lives as long as its app, so its
/// address names it.
inline std::map<const CLI::Option*, DeclaredRange>& declared_ranges() {
  static std::map<const CLI::Option*, DeclaredRange> ranges;
  return ranges;
}

/// Declares that integer option `o` takes values >= `least`, up to its type's largest. A smaller value in its type is
/// refused after parsing, by the command's own check in its words; a value past its type is refused while parsing,
/// and that message gives the option's range from `least` ("[1, 2147483647]"), not its type's ("[-2147483648,
/// 2147483647]"). Returns `o`.
inline CLI::Option* at_least(std::int64_t least, CLI::Option* o) {
  declared_ranges()[o] = {least, std::nullopt};
  return o;
}

/// As at_least, for an option the command never takes past `most` (--topk: 32, the most experts per token any mode
/// dispatches): a value past its type is refused naming [least, most], the bound the command's own checks quote for
/// a value the type holds ("--topk 33": in [1, 32]), not the type's largest. Those checks stay the command's, with
/// any narrower bound other flags set (--topk <= --experts); `most` is the largest any of them takes. Returns `o`.
inline CLI::Option* in_range(std::int64_t least, std::int64_t most, CLI::Option* o) {
  declared_ranges()[o] = {least, most};
  return o;
}

/// The range `o` takes as at_least or in_range declared it; none when neither did.
inline std::optional<DeclaredRange> declared_range(const CLI::Option& o) {
  const auto it = declared_ranges().find(&o);
  return it == declared_ranges().end() ? std::nullopt : std::optional<DeclaredRange>(it->second);
}

/// An error whose message this process has written already, or left to another process of the same mpirun job that
/// raised the same one (run's stop_unless_every_rank_passed): the command exits as for the error, without a line.
class AlreadyReported : public Error {
 public:
  using Error::Error;
};

/// `epmoe run`: a full expert-parallel MoE layer checked against the float64 reference.
/// Returns the callback that runs it (exit code 0 on PASS, 1 on FAIL).
std::function<int()> add_run_command(CLI::App& app);

/// `epmoe bench`: dispatch/combine over a sweep of T beside a peer-copy (memcpy on CPU) floor and NCCL;
/// table on stdout, progress on stderr, JSON with --json.
std::function<int()> add_bench_command(CLI::App& app);

/// `epmoe tune`: num_sms sweep of the cuda_ipc backend on the GPUs; writes the best config JSON.
/// Refuses (ErrorCode::unsupported, exit 2) without CUDA GPUs.
std::function<int()> add_tune_command(CLI::App& app);

}  // namespace epmoe::cli

namespace epmoe {
struct RoutingTrace;
}

namespace epmoe::cli {

/// `epmoe run --eplb` (eplb_report.cpp): replays every layer of `trace` onto `num_experts` experts over
/// `num_ranks` ranks; plans each layer on the first half of the tokens (rebalance_experts with num_experts +
/// redundant_experts slots, one group and one node) and reports max / mean choices per rank of both halves before
/// (expert e on rank e / (E / R)) and after the plan (topk_idx mapped by map_to_physical, counted by the dispatch's
/// own get_dispatch_layout). Rank r's share of a half is its tokens [r*T, (r+1)*T) (T = half / R), as a run would
/// give them. Table on stdout; JSON to `json` when not empty. Returns 0.
int run_eplb_report(const RoutingTrace& trace, int num_experts, int num_ranks, int redundant_experts,
                    const std::string& json, const std::string& routing_flag);

}  // namespace epmoe::cli
