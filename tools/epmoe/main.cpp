// The `epmoe` command-line tool.
#include <epmoe/error.hpp>
#include <epmoe/version.hpp>

#include <cstdio>
#include <exception>

#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"epmoe: expert-parallel Mixture-of-Experts dispatch, experts and combine"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(epmoe::version()));
  auto run = epmoe::cli::add_run_command(app);
  auto bench = epmoe::cli::add_bench_command(app);
  auto tune = epmoe::cli::add_tune_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every other parse error is a bad argument: 2, as the README says, in the
    // same shape as the commands' own errors.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "epmoe: invalid argument: %s (see --help)\n", e.what());
    return 2;
  }
  try {
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("bench")) return bench();
    if (app.got_subcommand("tune")) return tune();
  } catch (const epmoe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    // Not an epmoe error: a bug or a library's own failure. Said, never a crash (exit 1: not a bad argument).
    std::fprintf(stderr, "epmoe: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
