// Subcommands of the `epmoe` tool. Each registers its options on the CLI11 app and runs on the
// public API only.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace epmoe::cli {

/// A CLI11 check for unsigned flags (CLI11 would wrap "-1" around): names the value when it is negative.
/// No description: CLI11 appends it to the type in --help, which already says UINT ("--seed UINT:UINT").
inline CLI::Validator non_negative_integer() {
  return CLI::Validator(
      [](std::string& v) { return !v.empty() && v[0] == '-' ? "expected a non-negative integer, got " + v : std::string(); },
      "");
}

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
