// Subcommands of the `epmoe` tool. Each registers its options on the CLI11 app and runs on the
// public API only.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace epmoe::cli {

/// `epmoe run`: a full expert-parallel MoE layer checked against the float64 reference.
/// Returns the callback that runs it (exit code 0 on PASS, 1 on FAIL).
std::function<int()> add_run_command(CLI::App& app);

}  // namespace epmoe::cli
