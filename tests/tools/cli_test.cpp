// The `epmoe` command line, run as a process (EPMOE_CLI_PATH): the CPU/GPU choice of `run`, --config
// files, `bench` on CPU ranks (a tiny sweep whose JSON is checked against the documented byte formulas),
// `tune` refusing without GPUs, bad flags named in the error, and scripts/plot_bench.py when matplotlib
// is installed. GPU behaviour is checked where GPUs exist (the same tests, other expectations).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(EPMOE_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "support/npy_writer.hpp"
#include "support/random.hpp"
#include "support/temp_path.hpp"

namespace {

struct CliResult {
  int code = -1;
  std::string out, err;
};

std::string test_name() { return ::testing::UnitTest::GetInstance()->current_test_info()->name(); }

// A path in the test's temporary directory, unique per test and process (ctest runs tests in parallel).
std::string temp_path(const std::string& leaf) { return epmoe::test::temp_path("epmoe_cli", leaf); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The binary under test: $EPMOE_CLI when set (a build carried to another machine), else this build's.
std::string cli_path() {
  const char* env = std::getenv("EPMOE_CLI");
  return env && *env ? env : EPMOE_CLI_PATH;
}

/// Runs the CLI with `args`; `env` (e.g. "NAME=value") is set for that process only.
CliResult run_cli(const std::string& args, const std::string& env = "") {
  const std::string o = temp_path("stdout.txt"), e = temp_path("stderr.txt");
  const std::string cmd = (env.empty() ? "" : "env " + env + " ") + "'" + cli_path() + "' " + args + " >'" + o +
                          "' 2>'" + e + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(o);
  r.err = slurp(e);
  std::remove(o.c_str());  // the captures only: a test removes what it wrote itself
  std::remove(e.c_str());
  return r;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

// run_cli under an 8 GiB virtual-memory limit (not under AddressSanitizer, whose shadow needs more): a size that
// slipped past the memory checks fails its allocation instead of swapping the machine.
CliResult run_cli_limited(const std::string& args) {
  const std::string limit = kAsan ? "" : "ulimit -v 8388608 2>/dev/null; ";
  const std::string o = temp_path("stdout.txt"), e = temp_path("stderr.txt");
  const int status =
      std::system(("(" + limit + "'" + cli_path() + "' " + args + ") >'" + o + "' 2>'" + e + "'").c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(o);
  r.err = slurp(e);
  std::remove(o.c_str());
  std::remove(e.c_str());
  return r;
}

/// A command line refused before any work (exit 2, nothing run) with `want` in its message, and never `unwanted`.
struct Refusal {
  std::string args, want;
};
void expect_refused_before_work(const std::vector<Refusal>& cases, const std::string& unwanted) {
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.find(unwanted), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << c.args << ": refused only after starting\n" << r.out;
  }
}

int gpu_count() {
#if defined(EPMOE_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

template <class... Args>
std::string fmt_args(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

const std::string kTinyRun = "--tokens 16 --hidden 128 --intermediate 64 --experts 8 --topk 2 --iters 1 --check-tokens 4";

TEST(Cli, HelpListsTheCommandsAndFlags) {
  const CliResult top = run_cli("--help");
  EXPECT_EQ(top.code, 0);
  for (const char* s : {"run", "bench", "tune"}) EXPECT_NE(top.out.find(s), std::string::npos) << s << "\n" << top.out;
  // Found by a fresh user: no help said what the exit codes mean (README: 0, 1, 2).
  EXPECT_NE(top.out.find("Exit status: 0 success (run: PASS); 1 a failed check"), std::string::npos) << top.out;
  const CliResult run = run_cli("run --help");
  for (const char* s : {"--device", "--config", "int16 [tokens, layers, K]", "float32, same shape"})
    EXPECT_NE(run.out.find(s), std::string::npos) << s << "\n" << run.out;
  const CliResult bench = run_cli("bench --help");
  for (const char* s : {"--tokens-min", "--tokens-max", "--hidden", "--topk", "--experts", "--runs", "--json", "--config"})
    EXPECT_NE(bench.out.find(s), std::string::npos) << s;
  const CliResult tune = run_cli("tune --help");
  for (const char* s : {"--sms", "--chunks", "--objective", "--output"}) EXPECT_NE(tune.out.find(s), std::string::npos) << s;
  // Found by a fresh user: the seed's check repeated its type ("--seed UINT:UINT=2024").
  for (const CliResult* r : {&run, &bench, &tune}) {
    EXPECT_NE(r->out.find("--seed UINT"), std::string::npos) << r->out;
    EXPECT_EQ(r->out.find("UINT:UINT"), std::string::npos) << r->out;
  }
}

// Found by a fresh user: a bad flag beside -h won over the help ("epmoe run -h --tokens abc" said the --tokens error).
TEST(Cli, HelpWinsOverABadFlagBesideIt) {
  for (const char* line : {"run -h --tokens abc", "run --tokens abc -h", "run --tokne 3 --help", "-h run --ranks -1"}) {
    const CliResult r = run_cli(line);
    EXPECT_EQ(r.code, 0) << line << "\n" << r.err;
    EXPECT_NE(r.out.find("Run a full expert-parallel MoE layer"), std::string::npos) << line << "\n" << r.out;
    EXPECT_EQ(r.err.find("invalid argument"), std::string::npos) << line << "\n" << r.err;
  }
  const CliResult top = run_cli("--tokens abc --help");
  EXPECT_EQ(top.code, 0) << top.err;
  EXPECT_NE(top.out.find("Exit status: 0 success"), std::string::npos) << top.out;
}

// Found by a fresh user: on a terminal (stdout and stderr on one stream) bench on CPU ranks printed each row in
// the middle of the stderr progress line ("[1/2] T=1: dispatch_bf16      1 dispatch_bf16    4025.84 ...").
TEST(Cli, BenchOnCpuRanksKeepsTheRowsOffTheProgressLine) {
  const std::string both = temp_path("both.txt");
  const std::string cmd = "'" + cli_path() +
                          "' bench --device cpu --ranks 2 --tokens-min 1 --tokens-max 2 --hidden 64 --experts 4 "
                          "--topk 2 --runs 1 --warmup 0 >'" + both + "' 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(both);
  const std::regex row(R"(^ *[0-9]+ (ll_)?(dispatch|combine)_(bf16|fp8) +[0-9.]+ .*\|.*)");
  std::istringstream text(slurp(both));
  int progress = 0, rows = 0;
  for (std::string line; std::getline(text, line);) {
    if (line.starts_with("[")) {  // stderr: "[i/n] T=t: op op ... (x s)", nothing else on its line
      ++progress;
      EXPECT_TRUE(line.ends_with(" s)")) << line;
      EXPECT_EQ(line.find('|'), std::string::npos) << line;
    } else if (std::regex_match(line, row)) {
      ++rows;
    }
  }
  EXPECT_EQ(progress, 2) << slurp(both);
  EXPECT_EQ(rows, 2 * 6) << slurp(both);  // T = 1, 2; three normal-mode and three low-latency ops each
}

// Found by a fresh user: through a pipe (`epmoe run 2>&1 | tee log`) the run's header came after the progress lines
// ("iteration 1/3 done"), stdout being block-buffered there. Both commands' lines come in a terminal's order.
TEST(Cli, HeaderComesBeforeTheProgressLinesThroughAPipe) {
  const std::string both = temp_path("both.txt");
  const auto lines_through_pipe = [&](const std::string& args) {
    const std::string cmd = "'" + cli_path() + "' " + args + " 2>&1 | cat >'" + both + "'";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << args;
    std::vector<std::string> lines;
    std::istringstream text(slurp(both));
    for (std::string line; std::getline(text, line);) lines.push_back(line);
    return lines;
  };
  // The first line starting with `prefix`, or lines.size().
  const auto at = [](const std::vector<std::string>& lines, const std::string& prefix) {
    return static_cast<std::size_t>(std::find_if(lines.begin(), lines.end(),
                                                 [&](const std::string& l) { return l.starts_with(prefix); }) -
                                    lines.begin());
  };
  std::vector<std::string> lines = lines_through_pipe("run --device cpu --ranks 2 " + kTinyRun);
  const std::size_t header = at(lines, "epmoe "), weights = at(lines, "  generating expert weights"),
                    iteration = at(lines, "  iteration 1/1 done"), table = at(lines, "phase ");
  ASSERT_LT(at(lines, "PASS"), lines.size()) << slurp(both);
  EXPECT_LT(header, weights) << slurp(both);
  EXPECT_LT(weights, iteration) << slurp(both);
  EXPECT_LT(iteration, table) << slurp(both);
  lines = lines_through_pipe("bench --device cpu --ranks 2 --modes normal --tokens-max 1 --hidden 64 --experts 4 "
                             "--topk 1 --runs 1 --warmup 0");
  const std::size_t bench_header = at(lines, "epmoe "), columns = at(lines, "     T op"), progress = at(lines, "[1/1]");
  ASSERT_LT(progress, lines.size()) << slurp(both);
  EXPECT_LT(bench_header, columns) << slurp(both);
  EXPECT_LT(columns, progress) << slurp(both);
}

TEST(Cli, RunWithoutDeviceFlagPicksGpusWhenPresentElseCpuRanks) {
  const CliResult r = run_cli("run " + kTinyRun);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  if (gpu_count() > 0)
    EXPECT_NE(r.out.find(std::to_string(gpu_count()) + " GPU ranks"), std::string::npos) << r.out;
  else
    EXPECT_NE(r.out.find("CPU ranks"), std::string::npos) << r.out;
}

TEST(Cli, RunDeviceCudaWithoutGpuNamesTheFlag) {
  if (gpu_count() > 0) GTEST_SKIP() << "GPUs present";
  const CliResult r = run_cli("run --device cuda " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--device'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got cuda"), std::string::npos) << r.err;
}

TEST(Cli, RunDeviceCpuLowLatencyAndBadDevice) {
  const CliResult r = run_cli("run --device cpu --mode low-latency --ranks 2 " + kTinyRun);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("2 CPU ranks"), std::string::npos) << r.out;
  const CliResult b = run_cli("run --device tpu " + kTinyRun);
  EXPECT_EQ(b.code, 2);
  EXPECT_NE(b.err.find("--device"), std::string::npos) << b.err;
}

// semantics §1: bf16 rows need H % 8 == 0, fp8 rows H % 16 == 0; the run takes what its wire allows and names the
// flag, the wire and the multiple otherwise.
TEST(Cli, RunHiddenMultipleFollowsTheDispatchDtype) {
  const std::string tiny = " --device cpu --ranks 2 --tokens 4 --intermediate 8 --experts 4 --topk 2 --iters 1";
  for (const char* mode : {"normal", "low-latency"}) {
    const CliResult r = run_cli(std::string("run --mode ") + mode + " --hidden 8" + tiny);
    EXPECT_EQ(r.code, 0) << mode << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  }
  const CliResult fp8 = run_cli("run --dispatch-dtype fp8 --hidden 8" + tiny);
  EXPECT_EQ(fp8.code, 2) << fp8.out << fp8.err;
  EXPECT_NE(fp8.err.find("'--hidden'"), std::string::npos) << fp8.err;
  EXPECT_NE(fp8.err.find("multiple of 16 for --dispatch-dtype fp8"), std::string::npos) << fp8.err;
  const CliResult odd = run_cli("run --hidden 12" + tiny);
  EXPECT_EQ(odd.code, 2) << odd.out << odd.err;
  EXPECT_NE(odd.err.find("multiple of 8 for --dispatch-dtype bf16"), std::string::npos) << odd.err;
}

// --overlap: the low-latency combine's send overlapped with the experts (on CPU ranks the reference experts, which
// write the combine signal, by default); refused in normal mode and with the BLAS experts, naming the flag.
TEST(Cli, RunLowLatencyOverlapPassesAndIsRefusedWhereItCannotRun) {
  const CliResult r = run_cli("run --device cpu --mode low-latency --overlap --ranks 2 " + kTinyRun);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  const CliResult normal = run_cli("run --device cpu --overlap --ranks 2 " + kTinyRun);
  EXPECT_EQ(normal.code, 2);
  EXPECT_NE(normal.err.find("'--overlap'"), std::string::npos) << normal.err;
  const CliResult blas = run_cli("run --device cpu --mode low-latency --overlap --experts-impl blas --ranks 2 " + kTinyRun);
  EXPECT_EQ(blas.code, 2);
  EXPECT_NE(blas.err.find("'--experts-impl'"), std::string::npos) << blas.err;
  if (gpu_count() < 1) return;
  const CliResult gpu = run_cli("run --device cuda --mode low-latency --overlap --tokens 16 --hidden 256 "
                                "--intermediate 64 --experts 8 --topk 2 --iters 2 --check-tokens 16");
  EXPECT_EQ(gpu.code, 0) << gpu.out << gpu.err;
  EXPECT_NE(gpu.out.find("PASS"), std::string::npos) << gpu.out;
}

// Low-latency mode on GPU ranks (the MoE layer's low-latency prepare/finalize on the cuda_ipc GPU low-latency mode,
// batched CUDA experts), both wires, two iterations (both halves of the buffer): PASS against the float64 reference,
// and the payload as the header defines it: with random routing every token reaches K distinct experts, so the ranks
// received R * T * K rows of H values (bf16: 2 bytes each; fp8: 1 byte plus a float32 scale per 128).
TEST(Cli, RunLowLatencyOnGpusPassesWithBothWires) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  for (const char* wire : {"bf16", "fp8"}) {
    const std::string out = temp_path(std::string("run_ll_") + wire + ".json");
    const CliResult r = run_cli(std::string("run --device cuda --mode low-latency --dispatch-dtype ") + wire +
                                " --json '" + out + "' --tokens 16 --hidden 256 --intermediate 64 --experts 8 --topk 2 "
                                "--iters 2 --check-tokens 16");
    ASSERT_EQ(r.code, 0) << wire << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
    const nlohmann::json j = read_json(out);
    EXPECT_EQ(j["device"], "cuda");
    EXPECT_EQ(j["transport"], "cuda_ipc");
    EXPECT_EQ(j["mode"], "low-latency");
    EXPECT_EQ(j["pass"], true);
    EXPECT_LE(j["relative_l2_error"].get<double>(), 1e-2);
    const double R = j["ranks"].get<double>(), rows = R * 16 * 2;
    const double elt = std::string(wire) == "fp8" ? 1.0 + 4.0 / 128 : 2.0;
    EXPECT_DOUBLE_EQ(j["phases"][1]["bytes"].get<double>(), rows * 256 * elt) << wire;
    EXPECT_DOUBLE_EQ(j["phases"][3]["bytes"].get<double>(), rows * 256 * 2.0) << wire;
  }
}

// Normal mode on GPU ranks (the MoE layer's normal prepare/finalize on CUDA tensors over the cuda_ipc backend,
// standard CUDA experts chunked by --chunk-size), both wires, two iterations: PASS against the float64 reference,
// and the payload: every token goes once to each rank owning one of its K distinct experts, so the ranks received
// between R * T and R * T * min(K, R) rows of H values.
TEST(Cli, RunNormalOnGpusPassesWithBothWires) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  for (const char* wire : {"bf16", "fp8"}) {
    const std::string out = temp_path(std::string("run_normal_") + wire + ".json");
    const CliResult r = run_cli(std::string("run --device cuda --mode normal --dispatch-dtype ") + wire +
                                " --json '" + out + "' --tokens 16 --hidden 256 --intermediate 64 --experts 8 --topk 2 "
                                "--chunk-size 5 --iters 2 --check-tokens 16");
    ASSERT_EQ(r.code, 0) << wire << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
    const nlohmann::json j = read_json(out);
    EXPECT_EQ(j["device"], "cuda");
    EXPECT_EQ(j["transport"], "cuda_ipc");
    EXPECT_EQ(j["mode"], "normal");
    EXPECT_EQ(j["pass"], true);
    EXPECT_LE(j["relative_l2_error"].get<double>(), 1e-2);
    const double R = j["ranks"].get<double>();
    const double elt = std::string(wire) == "fp8" ? 1.0 + 4.0 / 128 : 2.0;
    const double bytes = j["phases"][1]["bytes"].get<double>();
    EXPECT_GE(bytes, R * 16 * 256 * elt) << wire;
    EXPECT_LE(bytes, R * 16 * std::min(2.0, R) * 256 * elt) << wire;
    EXPECT_DOUBLE_EQ(j["phases"][3]["bytes"].get<double>(), bytes / elt * 2.0) << wire;
  }
}

TEST(Cli, RunConfigIsAppliedAndRecorded) {
  std::mt19937_64 rng(epmoe::test::fresh_seed());
  const int sms = static_cast<int>(rng() % 64) + 1;
  const std::string cfg = temp_path("cfg.json"), out = temp_path("run.json");
  write_file(cfg, "{\"num_sms\": " + std::to_string(sms) + ", \"_note\": \"hand-made\"}");
  const CliResult r = run_cli("run --device cpu --ranks 2 --config '" + cfg + "' --json '" + out + "' " + kTinyRun);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["buffer_config"]["num_sms"], sms);
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["pass"], true);
}

TEST(Cli, RunConfigBadFieldsAreNamed) {
  const std::string cfg = temp_path("cfg.json");
  write_file(cfg, R"({"num_sms": 16, "warp_count": 3})");
  CliResult r = run_cli("run --device cpu --config '" + cfg + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--config " + cfg + ":warp_count'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unknown field"), std::string::npos) << r.err;
  write_file(cfg, R"({"num_sms": 16,)");  // not JSON: the flag and the file are named (found by a fresh user)
  r = run_cli("run --device cpu --config '" + cfg + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("invalid argument '--config " + cfg), std::string::npos) << r.err;
  write_file(cfg, R"({"num_sms": 100})");
  r = run_cli("run --device cpu --config '" + cfg + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("num_sms"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got 100"), std::string::npos) << r.err;
  r = run_cli("run --device cpu --config '" + temp_path("missing.json") + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--config'"), std::string::npos) << r.err;
  r = run_cli("bench --device cpu --config '" + cfg + "' --tokens-max 2 --hidden 128 --experts 8 --topk 2 --runs 1");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("num_sms"), std::string::npos) << r.err;
}

// Row bytes as bench.cpp's header defines them (written here from that text).
double dispatch_row(double H, double K, bool fp8) {
  return (fp8 ? H + 4 * std::ceil(H / 128) : 2 * H) + 8 * K + 4 * K + 4;
}

TEST(Cli, BenchOnCpuRanksWritesTheSweepAsJson) {
  std::mt19937_64 rng(epmoe::test::fresh_seed());
  const std::uint64_t seed = rng() | 1;
  const int H = 128, K = 2, E = 8, R = 2;
  const std::string out = temp_path("bench.json");
  const CliResult r = run_cli(fmt_args("bench --device cpu --ranks 2 --tokens-min 2 --tokens-max 8 --hidden ", H, " --topk ", K,
                                       " --experts ", E, " --runs 3 --warmup 1 --seed ", seed, " --json '", out, "'"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("[3/3] T=8"), std::string::npos) << r.err;  // progress on stderr
  EXPECT_NE(r.out.find("dispatch_fp8"), std::string::npos) << r.out;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["command"], "bench");
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["floor"], "memcpy");
  EXPECT_EQ(j["ranks"], R);
  EXPECT_EQ(j["seed"], seed);
  const std::set<std::string> want_ops = {"dispatch_bf16", "dispatch_fp8", "combine_bf16",
                                          "ll_dispatch_bf16", "ll_dispatch_fp8", "ll_combine_bf16"};
  std::map<std::int64_t, std::map<std::string, nlohmann::json>> by_t;
  for (const auto& s : j["results"]) by_t[s["tokens"].get<std::int64_t>()][s["op"].get<std::string>()] = s;
  ASSERT_EQ(by_t.size(), 3u);
  for (const auto& [T, ops] : by_t) {
    SCOPED_TRACE("T=" + std::to_string(T));
    EXPECT_TRUE(T == 2 || T == 4 || T == 8);
    std::set<std::string> got;
    for (const auto& [op, s] : ops) {
      got.insert(op);
      EXPECT_GT(s["median_us"].get<double>(), 0.0) << op;
      EXPECT_LE(s["min_us"].get<double>(), s["median_us"].get<double>()) << op;
      EXPECT_GE(s["floor_us"].get<double>(), 0.0) << op;
      EXPECT_TRUE(s["nccl_us"].is_null()) << op;
      EXPECT_NEAR(s["gb_per_s"].get<double>(), s["remote_bytes"].get<double>() / s["median_us"].get<double>() / 1e3,
                  1e-9 + 1e-9 * s["gb_per_s"].get<double>())
          << op;
    }
    EXPECT_EQ(got, want_ops);
    // Rows crossing ranks: a token goes once to the other rank, or not at all.
    const double rows = ops.at("dispatch_bf16")["remote_bytes"].get<double>() / dispatch_row(H, K, false);
    EXPECT_EQ(rows, std::floor(rows));
    EXPECT_GE(rows, 0);
    EXPECT_LE(rows, static_cast<double>(R * T));
    EXPECT_DOUBLE_EQ(ops.at("dispatch_fp8")["remote_bytes"].get<double>(), rows * dispatch_row(H, K, true));
    EXPECT_DOUBLE_EQ(ops.at("combine_bf16")["remote_bytes"].get<double>(), rows * 2 * H);
    EXPECT_DOUBLE_EQ(ops.at("ll_dispatch_bf16")["remote_bytes"].get<double>(), rows * 2 * H);
    EXPECT_DOUBLE_EQ(ops.at("ll_dispatch_fp8")["remote_bytes"].get<double>(), rows * (H + 4 * std::ceil(H / 128.0)));
    // DeepEP's logical bytes: every received row, local ones included (each token sends >= 1 row with K >= 1).
    const double logical_rows = ops.at("combine_bf16")["logical_bytes"].get<double>() / (2 * H);
    EXPECT_GE(logical_rows, std::max(rows, static_cast<double>(R * T)));
    EXPECT_LE(logical_rows, static_cast<double>(R * R * T));
    EXPECT_DOUBLE_EQ(ops.at("dispatch_bf16")["logical_bytes"].get<double>(), logical_rows * 2 * H);
    EXPECT_DOUBLE_EQ(ops.at("dispatch_fp8")["logical_bytes"].get<double>(), logical_rows * H);
    EXPECT_TRUE(ops.at("ll_combine_bf16")["logical_bytes"].is_null());
    const double pairs = ops.at("ll_combine_bf16")["remote_bytes"].get<double>() / (2 * H);
    EXPECT_GE(pairs, rows);
    EXPECT_LE(pairs, K * rows);
  }
}

TEST(Cli, BenchModesAndBadFlags) {
  const std::string out = temp_path("bench.json");
  CliResult r = run_cli("bench --device cpu --modes normal --tokens-min 4 --tokens-max 4 --hidden 64 --experts 4 --topk 1 "
                        "--runs 2 --warmup 0 --no-floors --json '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["results"].size(), 3u);  // T = 4 only, three normal-mode ops
  for (const auto& s : j["results"]) {
    EXPECT_EQ(s["tokens"], 4);
    EXPECT_EQ(s["mode"], "normal");
    EXPECT_TRUE(s["floor_us"].is_null());
  }
  const std::string tiny = " --device cpu --tokens-max 2 ";
  for (const auto& [args, flag] : std::map<std::string, std::string>{
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --tokens-min 4", "'--tokens-max'"},
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --tokens-min 0", "'--tokens-min'"},
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --modes fast", "'--modes'"},
           // Found by a fresh user: a trailing comma and a repeated mode passed.
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --modes normal,",
            "'--modes': expected a comma-separated subset of normal,low-latency, each once, got 'normal,'"},
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --modes normal,normal",
            "'--modes': expected a comma-separated subset of normal,low-latency, each once, got 'normal,normal'"},
           {"--hidden 64 --experts 4 --topk 1 --runs 1 --modes ,normal", "'--modes'"},
           {"--hidden 100 --experts 4 --topk 1 --runs 1", "'--hidden'"},
           {"--hidden 64 --experts 5 --topk 1 --runs 1", "'--experts'"},
           {"--hidden 64 --experts 4 --topk 5 --runs 1", "'--topk'"},
           {"--hidden 64 --experts 4 --topk 1 --runs 0", "'--runs'"}}) {
    r = run_cli("bench" + tiny + " " + args);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_NE(r.err.find(flag), std::string::npos) << args << ": " << r.err;
  }
}

// A seed past 2^64 - 1 was saturated silently by CLI11 (and "-1" wrapped around before the check existed).
TEST(Cli, SeedsOutsideSixtyFourBitsAreNamed) {
  // A number past the range is said as the number; a spelling that is none, quoted as typed.
  for (const auto& [bad, said] : std::map<std::string, std::string>{
           {"-1", "-1"}, {"18446744073709551616", "18446744073709551616"}, {"12x", "'12x'"}})
    for (const std::string cmd : {"run --device cpu ", "bench --device cpu --tokens-max 1 "}) {
      const CliResult r = run_cli(cmd + "--seed " + bad);
      EXPECT_EQ(r.code, 2) << cmd << bad;
      EXPECT_NE(r.err.find("--seed"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find("got " + said), std::string::npos) << r.err;
    }
  const CliResult r = run_cli("run --device cpu --seed 18446744073709551615 " + kTinyRun);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
}

// Found by a fresh user: integers were converted as C does (base 0): `--tokens 010` ran T = 8 (octal) and
// `--hidden 9223372036854775808` (2^63) was refused as "got 9223372036854775807", a value never typed. Decimal, as
// typed: leading zeros dropped, a value past 64 bits named as given.
TEST(Cli, IntegersAreReadInDecimalAsTyped) {
  const CliResult r = run_cli("run --device cpu --tokens 010 --hidden 0128 --intermediate 64 --experts 8 --topk 2 "
                              "--iters 1 --check-tokens 4 --seed 007");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("T=10 per rank, H=128,"), std::string::npos) << r.out;
  for (const std::string v : {"9223372036854775808", "-9223372036854775809", "99999999999999999999"}) {
    const CliResult bad = run_cli("run --device cpu --hidden " + v);
    EXPECT_EQ(bad.code, 2) << v;
    EXPECT_NE(bad.err.find("'--hidden': expected an integer in [8, 9223372036854775807], got " + v),
              std::string::npos)
        << bad.err;
  }
}

// Found by a fresh user: `run --ranks 99999999999` said "expected an integer in range" without the range (CLI11's
// conversion into an int failed). A value past an int option's 32 bits is named as typed with the flag's range (from
// the least value it takes to the int's largest), as a value past 64 bits is for the 64-bit options; a value past 64
// bits given to an int names the int's largest too. The range starts at the flag's least value, not at the type's
// negative one ("[-2147483648, 2147483647]" for --ranks, which takes >= 1).
TEST(Cli, IntOptionsPastThirtyTwoBitsNameTheirRange) {
  const std::string positive_int = "expected an integer in [1, 2147483647], got ";
  const struct {
    std::string args, want;
  } cases[] = {
      {"run --device cpu --ranks 99999999999", "'--ranks': " + positive_int + "99999999999"},
      {"run --device cpu --experts 2147483648", "'--experts': " + positive_int + "2147483648"},
      {"run --device cpu --topk -2147483649", "'--topk': expected an integer in [1, 32], got -2147483649"},
      {"run --device cpu --iters 0099999999999", "'--iters': " + positive_int + "0099999999999"},
      {"run --device cpu --ranks 99999999999999999999", "'--ranks': " + positive_int + "99999999999999999999"},
      {"run --device cpu --layer -99999999999", "'--layer': expected an integer in [0, 2147483647], got -99999999999"},
      {"bench --device cpu --runs 3000000000", "'--runs': " + positive_int + "3000000000"},
      {"bench --device cpu --warmup 3000000000", "'--warmup': expected an integer in [0, 2147483647], got 3000000000"},
      {"tune --topk 3000000000", "'--topk': expected an integer in [1, 32], got 3000000000"},
      {"run --device cpu --tokens 99999999999999999999",
       "'--tokens': expected an integer in [1, 9223372036854775807], got 99999999999999999999"},
      {"bench --device cpu --hidden -9223372036854775809",
       "'--hidden': expected an integer in [16, 9223372036854775807], got -9223372036854775809"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.find("in range (see --help)"), std::string::npos) << c.args << "\n" << r.err;
  }
  // The bounds themselves are read as typed: the largest int reaches the check that --layer needs --routing (named
  // with the value as read), the smallest the flag's own check.
  CliResult r = run_cli("run --device cpu --layer 2147483647 " + kTinyRun);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("invalid argument '--layer': expected --routing beside it"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got 2147483647"), std::string::npos) << r.err;
  r = run_cli("run --device cpu --layer -2147483648 " + kTinyRun);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("invalid argument '--layer': expected >= 0, got -2147483648"), std::string::npos) << r.err;
}

// Found by a fresh user: `--topk 99999999999` was refused as "expected an integer in [1, 2147483647]" while `--topk 33`
// said [1, 32]. A value past the flag's type quotes the flag's own largest value where the command has one, as the
// command's own check does for a value the type holds.
TEST(Cli, AValuePastItsTypeQuotesTheFlagsOwnLargestValue) {
  expect_refused_before_work(
      {
          {"run --device cpu --topk 99999999999",
           "invalid argument '--topk': expected an integer in [1, 32], got 99999999999"},
          {"run --device cpu --topk 33",
           "invalid argument '--topk': expected in [1, 32] (at most --experts and 32 in normal mode), got 33"},
          {"bench --device cpu --topk 99999999999",
           "invalid argument '--topk': expected an integer in [1, 32], got 99999999999"},
          {"bench --device cpu --topk 33", "invalid argument '--topk': expected in [1, 32], got 33"},
          {"tune --topk 99999999999", "invalid argument '--topk': expected an integer in [1, 32], got 99999999999"},
          {"bench --device cpu --tokens-max 99999999999999999999",
           "invalid argument '--tokens-max': expected an integer in [1, 1048576], got 99999999999999999999"},
          {"bench --device cpu --tokens-max 2097152",
           "invalid argument '--tokens-max': expected in [--tokens-min (1), 1048576], got 2097152"},
          {"bench --device cpu --tokens-min 99999999999999999999",
           "invalid argument '--tokens-min': expected an integer in [1, 1048576], got 99999999999999999999"},
      },
      "2147483647");
}

// Every integer flag of every command (read from its --help) names a range from the least value it takes for a value
// past its type: none quotes its type's negative bound, none of them taking a negative value; its largest is the flag's
// own where the command has one (32 for --topk, 2^20 for bench's T), else its type's.
TEST(Cli, EveryIntegerFlagPastItsTypeNamesARangeWithoutANegativeBound) {
  const std::regex flag_line(R"(^\s+(?:-\w,)?(--[\w-]+) U?INT\b)");
  const std::regex range(R"(expected an integer in \[(0|1|8|16), )"
                         R"((32|1048576|2147483647|9223372036854775807|18446744073709551615)\], )"
                         R"(got 99999999999999999999 )"
                         R"(\(see --help\)\n$)");
  int flags = 0;
  for (const std::string command : {"run", "bench", "tune"}) {
    std::istringstream help(run_cli(command + " --help").out);
    for (std::string line; std::getline(help, line);) {
      std::smatch m;
      if (!std::regex_search(line, m, flag_line)) continue;
      ++flags;
      const CliResult r = run_cli(command + " " + m[1].str() + " 99999999999999999999");
      EXPECT_EQ(r.code, 2) << command << " " << m[1] << "\n" << r.err;
      EXPECT_TRUE(std::regex_search(r.err, range)) << command << " " << m[1] << "\n" << r.err;
    }
  }
  EXPECT_GE(flags, 31);  // the help was read: 13 of run, 10 of bench, 8 of tune
}

// Found by a fresh user: the README says integers are read in decimal as typed, yet `run --ranks 0x10` ran 16 ranks
// (CLI11 converts in base 0) and `--seed 0x10` was refused as out of [0, 2^64 - 1]. Only an optional sign and decimal
// digits are taken, for every integer option and the integer lists of tune; "010" and "+2" still read as 10 and 2.
TEST(Cli, IntegerOptionsTakeOnlyDecimalDigits) {
  expect_refused_before_work({
      {"run --device cpu --ranks 0x10", "'--ranks': expected a decimal integer, got '0x10'"},
      {"run --device cpu --tokens 0x8", "'--tokens': expected a decimal integer, got '0x8'"},
      {"bench --device cpu --tokens-max 0x10", "'--tokens-max': expected a decimal integer, got '0x10'"},
      {"run --device cpu --seed 0x10", "'--seed': expected a decimal integer, got '0x10'"},
      {"bench --device cpu --tokens-max 1 --seed 0x10", "'--seed': expected a decimal integer, got '0x10'"},
      {"run --device cpu --ranks 0b1", "'--ranks': expected a decimal integer, got '0b1'"},
      {"run --device cpu --ranks ' 2'", "'--ranks': expected a decimal integer, got ' 2'"},
      {"run --device cpu --iters 1e3", "'--iters': expected a decimal integer, got '1e3'"},
      {"tune --topk +0x2", "'--topk': expected a decimal integer, got '+0x2'"},
      {"tune --sms 8,0x10",
       "invalid argument '--sms': expected a comma-separated list of integers in [1, 64], each once, got '8,0x10'"},
      {"tune --sms ' 8'",
       "invalid argument '--sms': expected a comma-separated list of integers in [1, 64], each once, got ' 8'"},
      // Found by a fresh user: a value twice was timed twice, while `bench --modes normal,normal` was refused.
      {"tune --sms 8,16,8",
       "invalid argument '--sms': expected a comma-separated list of integers in [1, 64], each once, got '8,16,8'"},
      {"tune --chunks 2,2",
       "invalid argument '--chunks': expected a comma-separated list of integers in [1, 16], each once, got '2,2'"},
  }, "expected an integer in");
  const CliResult r = run_cli("run --device cpu --ranks +2 --seed +5 " + kTinyRun);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("2 CPU ranks"), std::string::npos) << r.out;
}

// Found by a fresh user: `--tokens " 2"` was refused as "got  2", the blank lost in the message. A word refused as
// typed (a spelling, a choice, an unknown flag) is quoted.
TEST(Cli, RefusedWordsAreQuotedAsTyped) {
  const struct {
    std::string args, message;
  } cases[] = {
      {"run --tokens ' 2'", "epmoe: invalid argument '--tokens': expected a decimal integer, got ' 2' (see --help)\n"},
      {"run --tolerance '0.01 '",
       "epmoe: invalid argument '--tolerance': expected a decimal number (such as 0.01 or 1e-3), got '0.01 ' (see "
       "--help)\n"},
      {"run --device ' cpu'", "epmoe: invalid argument '--device': expected one of auto, cpu, cuda, got ' cpu' (see "
                              "--help)\n"},
      {"bench --device cpu --modes ' normal'",
       "epmoe: invalid argument '--modes': expected a comma-separated subset of normal,low-latency, each once, got "
       "' normal'\n"},
      {"tune --objective 'max '", "epmoe: invalid argument '--objective': expected max, sum, dispatch or combine, got "
                                  "'max '\n"},
      {"'run '", "epmoe: invalid argument 'run ': expected a command (run, bench or tune), got 'run ' (see --help)\n"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args;
    EXPECT_EQ(r.err, c.message) << c.args;
    EXPECT_EQ(r.out, "") << c.args;
  }
}

// Found by a fresh user: an empty value (an unset shell variable) ran as 0 (`run --ranks ""` said "expected >= 1,
// got 0", `--tolerance ""` "got 0") or was named as "got " with nothing after it (`bench --modes ""`), and
// `tune --chunks ""` swept nothing silently. Every option that takes a value refuses it as that, paths too.
TEST(Cli, EmptyValuesAreRefusedNamingTheOption) {
  expect_refused_before_work({
      {"run --device cpu --ranks ''", "'--ranks': expected a decimal integer, got an empty value"},
      {"run --device cpu --tokens ''", "'--tokens': expected a decimal integer, got an empty value"},
      {"run --device cpu --tolerance ''", "'--tolerance': expected a number, got an empty value"},
      {"run --device cpu --seed ''", "'--seed': expected a decimal integer, got an empty value"},
      {"run --device cpu --domain ''", "'--domain': expected a value, got an empty value"},
      {"run --device cpu --redundant-experts ''", "'--redundant-experts': expected a decimal integer, got an empty value"},
      {"run --device ''", "'--device': expected a value, got an empty value"},
      {"bench --device cpu --modes ''", "'--modes': expected a value, got an empty value"},
      {"bench --device cpu --tokens-max=", "'--tokens-max': expected a decimal integer, got an empty value"},
      {"run --device cpu --json=", "'--json': expected a path, got an empty value"},
      {"tune --sms ''", "'--sms': expected a value, got an empty value"},
      {"tune --chunks ''", "'--chunks': expected a value, got an empty value"},
      {"tune --objective ''", "'--objective': expected a value, got an empty value"},
      {"tune --output ''", "'--output': expected a path, got an empty value"},
  }, "got 0");
}

// Found by a fresh user: an option last on the line with no value (`run --ranks`) said CLI11's "1 required INT
// missing"; and a --routing directory without the default domain's file named the file but not that its name came
// from --domain's default.
TEST(Cli, MissingValueAndRoutingDomainAreSaid) {
  CliResult r = run_cli("run --device cpu --ranks");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("'--ranks': expected a decimal integer after it, got nothing"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("required INT missing"), std::string::npos) << r.err;
  r = run_cli("run --device cpu --tolerance");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("'--tolerance': expected a number after it, got nothing"), std::string::npos) << r.err;
  const std::string dir = temp_path("routing-dir");
  std::filesystem::create_directories(dir);
  r = run_cli("run --device cpu --routing '" + dir + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("general.topk_idx.npy (domain 'general' of that directory), got no such file"),
            std::string::npos)
      << r.err;
  std::filesystem::remove_all(dir);
}

// Found by a fresh user: `run --ranks 4 -- --tokens 8` said "expected a flag of run; did you mean --tokens?", the
// word it named being that very flag. After "--" every word is positional: said as that.
TEST(Cli, WordsAfterDoubleDashAreNamedAsPositional) {
  CliResult r = run_cli("run --device cpu --ranks 4 -- --tokens 8");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("invalid argument '--tokens': expected no positional arguments (run takes none; see epmoe "
                       "run --help), got '--tokens' after '--' (so it was not read as a flag)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("did you mean"), std::string::npos) << r.err;
  r = run_cli("bench --device cpu -- 4");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("invalid argument '4': expected no positional arguments (bench takes none"), std::string::npos)
      << r.err;
  // A mistyped flag before the "--" is still named as one.
  r = run_cli("run --device cpu --tokne 4 -- --tokens 8");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("invalid argument '--tokne': expected a flag of run, got '--tokne'; did you mean --tokens?"), std::string::npos)
      << r.err;
}

// Found by a fresh user: `run --tokens 4 -- -h` printed the help (exit 0), `-- --version` the version: CLI11 read
// them as the app's flags after the "--". Such words are refused as every other word after "--" is.
TEST(Cli, HelpAndVersionAfterDoubleDashAreNotFlags) {
  for (const std::string word : {"-h", "--help", "--version"}) {
    const CliResult r = run_cli("run --tokens 4 -- " + word);
    EXPECT_EQ(r.code, 2) << word << "\n" << r.out << r.err;
    EXPECT_EQ(r.err, "epmoe: invalid argument '" + word + "': expected no positional arguments (run takes none; see "
                     "epmoe run --help), got '" + word + "' after '--' (so it was not read as a flag)\n")
        << word;
    EXPECT_EQ(r.out, "") << word;
  }
  // A help before the "--" is still the help; a "--" with nothing after it is no word at all.
  CliResult r = run_cli("run -h -- --tokens 8");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("Run a full expert-parallel MoE layer"), std::string::npos) << r.out;
  r = run_cli("run --device cpu " + kTinyRun + " --");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
}

// `epmoe -- run` said "expected run, bench or tune, got none": the command typed after the "--" (never read as one)
// is named, as are other words there.
TEST(Cli, ACommandAfterDoubleDashIsNamedAsTyped) {
  for (const std::string word : {"run", "--tokens", "help"}) {
    const CliResult r = run_cli("-- " + word + " 8");
    EXPECT_EQ(r.code, 2) << word << "\n" << r.out << r.err;
    EXPECT_EQ(r.err, "epmoe: invalid argument '" + word + "': expected a command (run, bench or tune) before '--', "
                     "got '" + word + "' after it (words after '--' are never flags or commands)\n")
        << word;
    EXPECT_EQ(r.out, "") << word;
  }
  // Nothing after the "--": no word to name.
  const CliResult r = run_cli("--");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "epmoe: invalid argument 'command': expected run, bench or tune (see --help), got none\n");
}

// Found by a fresh user: `run --tolerance 1e400` was refused as "got inf" (and 1e-400 as "got 0"), values never
// typed. The value is named as given, with the range the option takes.
TEST(Cli, ToleranceOutsideADoubleIsNamedAsTyped) {
  for (const std::string v : {"1e400", "-1e400", "1e-400"}) {
    const CliResult r = run_cli("run --device cpu --tolerance " + v + " " + kTinyRun);
    EXPECT_EQ(r.code, 2) << v << "\n" << r.err;
    EXPECT_NE(r.err.find("invalid argument '--tolerance': expected a positive finite number (a double: in [5e-324, "
                         "1.7976931348623157e+308]), got " + v + "\n"),
              std::string::npos)
        << v << "\n" << r.err;
  }
}

// Number options read decimal spellings only, as integer options do: CLI11 took " 0.01", "0x1p-7", "inf" and "nan".
TEST(Cli, ToleranceIsReadInDecimalOnly) {
  for (const std::string v : {"' 0.01'", "'0.01 '", "0x1p-7", "inf", "nan", "1e", "1.2.3", "+"}) {
    const CliResult r = run_cli("run --device cpu --tolerance " + v + " " + kTinyRun);
    EXPECT_EQ(r.code, 2) << v << "\n" << r.err;
    EXPECT_NE(r.err.find("'--tolerance': expected a decimal number (such as 0.01 or 1e-3), got "), std::string::npos)
        << v << "\n" << r.err;
  }
  for (const std::string v : {"0.5", ".5", "5.", "+1e-1", "2E0"}) {
    const CliResult r = run_cli("run --device cpu --tolerance " + v + " " + kTinyRun);
    EXPECT_EQ(r.code, 0) << v << "\n" << r.err;
  }
}

// Found by a fresh user: `--config /nonexistent` gave no reason, `--config /tmp` did not say it is a directory, and
// inline JSON (`--config '{"num_sms":16}'`, as the README's example reads) got no hint that a path is taken.
TEST(Cli, ConfigThatIsNoFileSaysWhy) {
  const std::string want = "invalid argument '--config': expected a readable JSON file of BufferOptions fields";
  const std::string missing = temp_path("missing.json"), folder = temp_path("folder");
  std::filesystem::create_directories(folder);
  const struct {
    std::string args, want;
  } cases[] = {
      {"run --device cpu --config '" + missing + "'", want + ", got " + missing + " (No such file or directory)"},
      {"bench --device cpu --tokens-max 1 --config '" + missing + "'",
       want + ", got " + missing + " (No such file or directory)"},
      {"run --device cpu --config '" + folder + "'", want + ", got " + folder + " (a directory)"},
      {"run --device cpu --config '{\"num_sms\":16}'",
       want + " (a path to a JSON file; inline JSON is not taken), got {\"num_sms\":16}"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args + (c.args.rfind("run", 0) == 0 ? " " + kTinyRun : std::string()));
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
  }
  std::filesystem::remove(folder);
}

// Under mpirun every process parsed the same bad command line and printed the same error, once per rank: the first
// process says it at once and exits, which stops the job; another rank says it only after a pause, naming itself
// (alone here, as when only its command line differs), and --help prints once.
TEST(Cli, UnderMpirunTheFirstProcessReportsAParseErrorAndAnotherNamesItself) {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    CliResult r = run_cli("run --tokenz 3", std::string(var) + "=1");
    EXPECT_EQ(r.code, 2) << var;
    EXPECT_EQ(r.err.rfind("epmoe: rank 1: invalid argument", 0), 0u) << var << ": " << r.err;
    EXPECT_NE(r.err.find("--tokenz"), std::string::npos) << var << ": " << r.err;
    r = run_cli("run --tokenz 3", std::string(var) + "=0");
    EXPECT_EQ(r.code, 2) << var;
    EXPECT_EQ(r.err.rfind("epmoe: invalid argument", 0), 0u) << var << ": " << r.err;
    EXPECT_NE(r.err.find("--tokenz"), std::string::npos) << var << ": " << r.err;
  }
  EXPECT_TRUE(run_cli("run --help", "OMPI_COMM_WORLD_RANK=2").out.empty());
  EXPECT_NE(run_cli("run --help", "OMPI_COMM_WORLD_RANK=0").out.find("--tokens"), std::string::npos);
}

/// Whether this build can launch epmoe under mpirun: built with MPI, and mpirun on the PATH.
bool mpirun_available() {
#if defined(EPMOE_HAVE_MPI)
  return std::system("command -v mpirun >/dev/null 2>&1") == 0;
#else
  return false;
#endif
}
#define SKIP_WITHOUT_MPIRUN() \
  if (!mpirun_available()) GTEST_SKIP() << "needs a build with MPI and mpirun on the PATH"

/// An MPMD launch of `epmoe run --backend mpi --device cpu` processes on kTinyRun, one per entry of `flags` with those
/// extra flags (the group's timeout 30 s, so a wait shows as a timeout, not as a hung test): the exit status and the
/// output of all.
std::pair<int, std::string> run_processes(const std::vector<std::string>& flags) {
  const std::string o = temp_path("mpmd.txt");
  const std::string job = "'" + cli_path() + "' run --backend mpi --device cpu " + kTinyRun;
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EPMOE_TIMEOUT_S=30 timeout 120 "
                    "mpirun --oversubscribe";
  for (std::size_t p = 0; p < flags.size(); ++p) cmd += (p == 0 ? "" : " :") + (" -np 1 " + job + " " + flags[p]);
  const int status = std::system((cmd + " >'" + o + "' 2>&1").c_str());
  std::string out = slurp(o);
  std::filesystem::remove(o);
  return {status, std::move(out)};
}
std::pair<int, std::string> run_two_processes(const std::string& flags0, const std::string& flags1) {
  return run_processes({flags0, flags1});
}

/// Whether an mpirun job of epmoe processes exited as a refusal does: status 2. Under AddressSanitizer any non-zero
/// status: LeakSanitizer's report of Open MPI's own allocations at exit changes it.
bool refused_status(int status) {
  return WIFEXITED(status) && (kAsan ? WEXITSTATUS(status) != 0 : WEXITSTATUS(status) == 2);
}

/// The lines of `out` that epmoe wrote ("epmoe: ..."), in order (mpirun's own lines left out).
std::vector<std::string> epmoe_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("epmoe: ", 0) == 0) lines.push_back(line);
  return lines;
}

// Under mpirun each process parses its own flags: an MPMD launch whose processes differ in a job flag (--seed) is a
// rank_mismatch naming the flag on every rank, before any work, not a run whose check then fails.
TEST(Cli, MpirunProcessesWithDifferentSeedsAreRefusedNamingTheFlag) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_two_processes("--seed 1", "--seed 2");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("setting '--seed' must be equal on all ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0 has 1, rank 1 has 2"), std::string::npos) << out;
  EXPECT_EQ(out.find("PASS"), std::string::npos) << out;
}

// A text flag that differs across processes is named with both texts as typed (they used to show as two hashes).
TEST(Cli, MpirunProcessesWithDifferentModesAreRefusedNamingBothTexts) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_two_processes("--mode normal --activation silu", "--mode low-latency --activation gelu");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("setting '--mode' must be equal on all ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0 has 'normal', rank 1 has 'low-latency'"), std::string::npos) << out;
  EXPECT_EQ(out.find("PASS"), std::string::npos) << out;
}

// A flag refused on one process alone (here a --json folder that does not exist there, as a path missing on one node)
// stops every process at once: the others name the refusing rank instead of waiting in their first collective until
// the group's timeout.
TEST(Cli, MpirunFlagRefusedOnOneProcessStopsEveryProcess) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_two_processes("", "--json '" + temp_path("no-such-folder") + "/out.json'");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("invalid argument '--json'"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0: its flags were accepted, but rank(s) 1 refused theirs"), std::string::npos) << out;
  EXPECT_EQ(out.find("timed out"), std::string::npos) << out;
  EXPECT_EQ(out.find("PASS"), std::string::npos) << out;
}

// Found by a fresh user: choices, a missing command and a command's flag typed before the command still spoke
// CLI11's words ("gpu not in {auto,cpu,cuda}", "A subcommand is required", "did you mean --tokens?" of --tokens).
// Every parse error now reads "invalid argument 'X': expected ..., got ...".
TEST(Cli, EveryParseErrorNamesTheArgumentWithExpectedAndGot) {
  expect_refused_before_work(
      {
          {"run --device gpu", "epmoe: invalid argument '--device': expected one of auto, cpu, cuda, got 'gpu'"},
          {"bench --device gpu", "epmoe: invalid argument '--device': expected one of auto, cpu, cuda, got 'gpu'"},
          {"run --device cpu --mode fast",
           "epmoe: invalid argument '--mode': expected one of normal, low-latency, got 'fast'"},
          {"", "epmoe: invalid argument 'command': expected run, bench or tune (see --help), got none"},
          {"--tokens 3 run --device cpu",
           "epmoe: invalid argument '--tokens': expected the flags after the command (epmoe run --tokens ...), got it "
           "before 'run'"},
          {"--tokenz 3 run", "epmoe: invalid argument '--tokenz': expected a flag of run, got '--tokenz'; did you mean --tokens?"},
          // CLI11 read "=2" as a count, "=" and "=true" as set, and "=foo" as "a value in range".
          {"run --device cpu --eplb=foo",
           "epmoe: invalid argument '--eplb': expected no value (it is a flag: --eplb alone), got '--eplb=foo'"},
          {"run --device cpu --overlap=2", "'--overlap': expected no value (it is a flag: --overlap alone), got '--overlap=2'"},
          {"run --device cpu --overlap=", "'--overlap': expected no value (it is a flag: --overlap alone), got '--overlap='"},
          {"run --device cpu --overlap=true", "'--overlap': expected no value"},
          {"bench --device cpu --no-floors=1", "'--no-floors': expected no value"},
          {"--version=1", "'--version': expected no value (it is a flag: --version alone), got '--version=1'"},
          // Found by a fresh user: "--tokens= 16" took the next word and ran with 16.
          {"run --device cpu --tokens= 16", "'--tokens': expected a decimal integer, got an empty value"},
          {"run --device cpu --tolerance= 0.5", "'--tolerance': expected a number, got an empty value"},
          {"bench --device cpu --modes= normal", "'--modes': expected a value, got an empty value"},
      },
      "invalid argument: ");
}

// A refusal of one process's own flags (a value check, after parsing) says which rank refused, beside rank 0's
// summary; the first process's messages keep no prefix.
TEST(Cli, MpirunValueRefusedOnAnotherProcessNamesThatRank) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_two_processes("", "--tolerance 0");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("epmoe: rank 1: invalid argument '--tolerance': expected a positive finite number"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("epmoe: rank 0: its flags were accepted, but rank(s) 1 refused theirs"), std::string::npos)
      << out;
}

// A flag typo on one process of an MPMD launch (rank 0's command line parses): that rank names itself and the flag,
// where it used to exit 2 in silence and the job stopped with no word of why.
TEST(Cli, MpirunParseErrorOnAnotherProcessAloneNamesThatRankAndTheFlag) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_two_processes("", "--tokenz 3");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("epmoe: rank 1: invalid argument"), std::string::npos) << out;
  EXPECT_NE(out.find("--tokenz"), std::string::npos) << out;
  EXPECT_EQ(out.find("PASS"), std::string::npos) << out;
}

/// `epmoe <args>` as every process of `mpirun -np <n>` (no MPI group: each runs the command on its own): the exit status
/// and the output of all.
std::pair<int, std::string> run_under_mpirun(int n, const std::string& args) {
  const std::string o = temp_path("mpirun.txt");
  const std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpirun --oversubscribe -np " +
                          std::to_string(n) + " '" + cli_path() + "' " + args;
  const int status = std::system((cmd + " >'" + o + "' 2>&1").c_str());
  std::string out = slurp(o);
  std::filesystem::remove(o);
  return {status, std::move(out)};
}

// Refusals that every process raises on its own, with no group to agree on who speaks (run without --backend mpi
// under mpirun; bench's flags), are said as the command line's are: the first process at once, another only after a
// pause, so the job ends with one line. They printed one line per rank (a fresh user's report).
TEST(Cli, MpirunRefusalsWithoutAGroupAreSaidOnce) {
  SKIP_WITHOUT_MPIRUN();
  auto [status, out] = run_under_mpirun(3, "run --device cpu " + kTinyRun);
  EXPECT_TRUE(refused_status(status)) << out;
  // Under AddressSanitizer the first process may start later than another's pause lasts: at least one line there.
  const auto said_once = [](const std::vector<std::string>& l) { return kAsan ? !l.empty() : l.size() == 1; };
  std::vector<std::string> lines = epmoe_lines(out);
  ASSERT_TRUE(said_once(lines)) << out;
  EXPECT_NE(lines[0].find("invalid argument '--backend': expected mpi when started by mpirun"), std::string::npos) << out;
  std::tie(status, out) = run_under_mpirun(3, "bench --device cpu --tokens-max 0");
  EXPECT_TRUE(refused_status(status)) << out;
  lines = epmoe_lines(out);
  ASSERT_TRUE(said_once(lines)) << out;
  EXPECT_NE(lines[0].find("'--tokens-max'"), std::string::npos) << out;
  if (!kAsan) EXPECT_EQ(lines[0].find("rank "), std::string::npos) << out;  // rank 0's line, which names no rank
}

// A flag refused alike on every process (here --experts 8 that 3 processes do not divide) is said once, by rank 0,
// with no rank named: it printed one line per rank, the same error three times at -np 3.
TEST(Cli, MpirunRefusalRaisedAlikeOnEveryProcessIsSaidOnce) {
  SKIP_WITHOUT_MPIRUN();
  const auto [status, out] = run_processes({"", "", ""});
  EXPECT_TRUE(refused_status(status)) << out;
  EXPECT_EQ(epmoe_lines(out),
            std::vector<std::string>{"epmoe: invalid argument 'mpirun -np': expected a divisor of --experts (8), got 3"})
      << out;
}

// Messages that differ are each said once, by the lowest rank that has it, naming the ranks that have it: ranks 1 and
// 2 refuse the same --chunk-size and ranks 0 and 3, whose flags passed, say so in one line; then rank 2 refuses its
// own --offset beside the others' --chunk-size. Every line comes out, whichever process exits first.
TEST(Cli, MpirunRefusalsThatDifferAreEachSaidOnceNamingTheirRanks) {
  SKIP_WITHOUT_MPIRUN();
  const std::string chunk = "--chunk-size -1", offset = "--offset -2";
  auto [status, out] = run_processes({"", chunk, chunk, ""});
  EXPECT_TRUE(refused_status(status)) << out;
  std::vector<std::string> lines = epmoe_lines(out);
  std::sort(lines.begin(), lines.end());  // the processes speak in any order
  EXPECT_EQ(lines, (std::vector<std::string>{
                       "epmoe: ranks 0, 3: their flags were accepted, but rank(s) 1, 2 refused theirs (their messages "
                       "name the flag); no rank runs",
                       "epmoe: ranks 1, 2: invalid argument '--chunk-size': expected >= 0, got -1"}))
      << out;
  std::tie(status, out) = run_processes({chunk, chunk, offset, chunk});
  EXPECT_TRUE(refused_status(status)) << out;
  lines = epmoe_lines(out);
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"epmoe: rank 2: invalid argument '--offset': expected >= 0, got -2",
                                             "epmoe: ranks 0, 1, 3: invalid argument '--chunk-size': expected >= 0, "
                                             "got -1"}))
      << out;
}

TEST(Cli, TuneRefusesWithoutGpus) {
  CliResult r = run_cli("tune --device cpu");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("invalid argument '--device': expected auto or cuda"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got cpu"), std::string::npos) << r.err;
  if (gpu_count() > 0) return;
  std::filesystem::remove(temp_path("tune.json"));  // a file left by an earlier run would hide a regression
  // Found by a fresh user: without --device this said "invalid argument '--device': ..., got auto", a flag never
  // typed. Said of the machine instead, with why no GPU was found.
  r = run_cli("tune --tokens 8 --output '" + temp_path("tune.json") + "'");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.rfind("epmoe: tune needs a CUDA GPU (it sweeps the cuda_ipc backend's num_sms and num_chunks); ", 0),
            0u)
      << r.err;
  EXPECT_TRUE(r.err.find("; no CUDA device is visible: cudaGetDeviceCount ") != std::string::npos ||
              r.err.find("; this epmoe was built without CUDA\n") != std::string::npos)
      << r.err;  // the reason: a CUDA build without a device, or a CPU-only build
  EXPECT_EQ(r.err.find("--device"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("auto"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(temp_path("tune.json")));
}

// Found by a fresh user: limits the library would only hit after building the job (K per mode), defaults
// blamed instead of the flag given, CLI11's own messages, sizes bench could not hold, --version.
TEST(Cli, LimitsAndParseErrorsNameTheFlagBeforeAnyWork) {
  const struct {
    std::string args, want;
  } cases[] = {
      {"run --device cpu --topk 33", "invalid argument '--topk': expected in [1, 32]"},
      {"run --device cpu --mode low-latency --topk 17", "invalid argument '--topk': expected in [1, 16]"},
      {"run --device cpu --experts 63", "invalid argument '--experts': expected a multiple of the 4 ranks"},
      {"run --device cpu --ranks 4 --experts 63", "invalid argument '--ranks': expected a divisor of --experts"},
      {"run --device cpu --activation foo", "invalid argument '--activation'"},
      // Found by a fresh user: refused by the layout after the weights were made, naming 'num_experts'.
      {"run --device cpu --ranks 1 --experts 2048 --topk 2",
       "invalid argument '--experts': expected at most 1024 (1024 per rank on 1 rank), got 2048"},
      {"run --device cpu --ranks 2 --experts 2050 --topk 2 --mode low-latency",
       "invalid argument '--experts': expected at most 2048 (1024 per rank on 2 ranks), got 2050"},
      // Found by a fresh user: CLI11's "Could not convert: --ranks = abc" said nothing of what the flag takes.
      {"run --device cpu --tokens abc", "invalid argument '--tokens': expected a decimal integer, got 'abc'"},
      {"run --device cpu --ranks 99999999999", "'--ranks': expected an integer in [1, 2147483647]"},
      {"run --device cpu --tolerance x", "invalid argument '--tolerance': expected a decimal number"},
      {"bench --device cpu --modes low-latency --topk 20", "invalid argument '--topk': expected in [1, 16]"},
      {"bench --device cpu --modes low-latency --tokens-min 256 --tokens-max 256",
       "invalid argument '--ll-tokens-max': expected >= the sweep's smallest T (256"},
      {"bench --device cpu --tokens-min 1048576 --tokens-max 1048576", "expected sizes whose host memory fits"},
      {"tune --tokens 0", "invalid argument '--tokens'"},
      {"run --device cpu --json ''", "'--json': expected a path"},
      {"bench --device cpu --json ''", "'--json': expected a path"},
      // Found by a fresh user: '' (an unset shell variable) ran with random routing or without the config.
      {"run --device cpu --routing ''", "'--routing': expected a path, got an empty value"},
      {"run --device cpu --config ''", "'--config': expected a path, got an empty value"},
      {"bench --device cpu --config ''", "'--config': expected a path, got an empty value"},
      {"tune --config ''", "'--config': expected a path, got an empty value"},
      // Found by a fresh user: a flag where the command goes said only that a subcommand was required.
      {"--bogus", "invalid argument '--bogus': expected a command first (run, bench or tune"},
      // Found by a fresh user: a word that is no command said CLI11's "A subcommand is required".
      {"frobnicate --tokens 4", "invalid argument 'frobnicate': expected a command (run, bench or tune"},
      {"RUN", "invalid argument 'RUN': expected a command (run, bench or tune"},
      // Found by a fresh user: a mistyped flag said CLI11's "The following arguments were not expected: 4 --tokne".
      {"run --tokne 4", "invalid argument '--tokne': expected a flag of run, got '--tokne'; did you mean --tokens? (see epmoe run"},
      {"run --device cpu --Hidden=64", "invalid argument '--Hidden': expected a flag of run, got '--Hidden'; did you mean --hidden?"},
      {"bench --no-floor", "invalid argument '--no-floor': expected a flag of bench, got '--no-floor'; did you mean --no-floors?"},
      {"run --zzzzzzzz 3", "invalid argument '--zzzzzzzz': expected a flag of run, got '--zzzzzzzz' (see epmoe run --help)"},
      {"run 4", "invalid argument '4': expected a flag (run takes no positional arguments"},
      // A word before the command was named as the command's positional argument.
      {"help run", "invalid argument 'help': expected the command first (run, bench or tune), got 'help' before 'run' "
                   "(for a command's help: epmoe run --help)"},
      {"4 bench", "invalid argument '4': expected the command first (run, bench or tune), got '4' before 'bench' (see"},
      // Found by a fresh user: an option of one value given twice said CLI11's "At Most 1 required but received 2".
      {"run --device cpu --device cuda",
       "epmoe: invalid argument '--device': expected once (it takes one value), got 2 values: 'cpu', 'cuda'"},
      {"run -t 3 --tokens 4", "invalid argument '--tokens': expected once (it takes one value), got 2 values: '3', '4'"},
      {"bench --json a.json --json b.json --json c.json", "invalid argument '--json': expected once (it takes one "
                                                          "value), got 3 values: 'a.json', 'b.json', 'c.json'"},
      {"tune -o a.json --output b.json", "invalid argument '--output': expected once"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << c.args << ": refused only after starting\n" << r.out;
    EXPECT_EQ(r.err.find("generating"), std::string::npos) << c.args << ": refused only after starting\n" << r.err;
  }
  // A refused tune creates no output file.
  const std::string out = temp_path("never.json");
  std::filesystem::remove(out);
  const CliResult r = run_cli("tune --device cpu --output '" + out + "'");
  EXPECT_EQ(r.code, 2);
  EXPECT_FALSE(std::filesystem::exists(out));
  const CliResult v = run_cli("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_FALSE(v.out.empty());
}

// Found by a fresh user: `run --overlap --overlap` ran as if given once, where an option of one value given twice is
// refused. A flag given twice is refused the same way, before any work; --help given twice still prints the help.
TEST(Cli, FlagsGivenTwiceAreRefusedNamingTheFlag) {
  const struct {
    std::string args, want;
  } cases[] = {
      {"run --device cpu --mode low-latency --overlap --overlap " + kTinyRun,
       "epmoe: invalid argument '--overlap': expected once (it takes no value), got --overlap given twice"},
      {"run --eplb --routing '" + std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing' --eplb --eplb",
       "invalid argument '--eplb': expected once (it takes no value), got --eplb given 3 times"},
      {"bench --device cpu --no-floors --tokens-max 1 --no-floors",
       "invalid argument '--no-floors': expected once (it takes no value), got --no-floors given twice"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << c.args << ": refused only after starting\n" << r.out;
    EXPECT_EQ(r.err.find("generating"), std::string::npos) << c.args << ": refused only after starting\n" << r.err;
  }
  const CliResult r = run_cli("run --help --help");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("--overlap"), std::string::npos) << r.out;
}

TEST(Cli, RunRoutingAndMpirunMistakesNameTheFlag) {
  CliResult r = run_cli("run --device cpu --routing '" + temp_path("no-such-routing") + "'");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--routing'"), std::string::npos) << r.err;
  // As if started by mpirun with 2 processes but without --backend mpi: every process would run its own job.
  r = run_cli("run --device cpu", "OMPI_COMM_WORLD_SIZE=2");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--backend'"), std::string::npos) << r.err;
}

// Found by a fresh user: a --routing path that does not exist said "expected a directory or a DOMAIN.topk_idx.npy
// file", as if the path were of the wrong kind. It is named with the OS's reason before any work (with --eplb too,
// and beside a flag refused later).
TEST(Cli, RunRoutingThatDoesNotExistIsNamedWithTheReason) {
  const std::string missing = temp_path("no-such-routing");
  const std::string want = "epmoe: invalid argument '--routing': expected an existing directory or DOMAIN.topk_idx.npy "
                           "file, got ";
  for (const std::string extra : {"", " --eplb", " --overlap", " --tolerance 0"}) {
    const CliResult r = run_cli("run --device cpu --routing '" + missing + "'" + extra + " " + kTinyRun);
    EXPECT_EQ(r.code, 2) << extra << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(want + missing + " (No such file or directory)"), std::string::npos) << extra << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << extra << ": refused only after starting\n" << r.out;
    EXPECT_EQ(r.err.find("generating"), std::string::npos) << extra << ": refused only after starting\n" << r.err;
  }
  // A path through a regular file: the reason is the OS's, not always "no such file".
  const std::string file = temp_path("plain.txt");
  write_file(file, "x");
  const CliResult r = run_cli("run --device cpu --routing '" + file + "/general.topk_idx.npy' " + kTinyRun);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(want + file + "/general.topk_idx.npy (Not a directory)"), std::string::npos) << r.err;
  std::filesystem::remove(file);
}

// Found by a fresh user: thread ranks past OpenBLAS's buffer table crashed it (513 ranks: "precompiled
// NUM_THREADS exceeded", then SIGSEGV); the limit is named, and a run at the limit works.
TEST(Cli, RunRanksBeyondTheBlasLimitAreRefusedNamingTheLimit) {
  CliResult r = run_cli("run --device cpu --ranks 513 --experts 513 --tokens 2 --hidden 16 --intermediate 8 --topk 2");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  const std::string want = "invalid argument '--ranks': expected at most ";
  const auto at = r.err.find(want);
  ASSERT_NE(at, std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got 513"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("generating"), std::string::npos) << "refused only after starting\n" << r.err;
  const int limit = std::atoi(r.err.c_str() + at + want.size());
  ASSERT_GE(limit, 2) << r.err;
  ASSERT_LT(limit, 513) << r.err;
  r = run_cli(fmt_args("run --device cpu --ranks ", limit, " --experts ", limit,
                       " --tokens 8 --hidden 128 --intermediate 64 --topk 2 --iters 1 --check-tokens 2"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("NUM_THREADS exceeded"), std::string::npos) << r.err;
  // The reference experts do not call BLAS: no such limit.
  r = run_cli(fmt_args("run --device cpu --experts-impl reference --ranks ", limit + 1, " --experts ", limit + 1,
                       " --tokens 1 --hidden 16 --intermediate 8 --topk 1 --iters 1 --check-tokens 1"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
}

// A hand-made trace (T=4, L=1, K=2) in the test's directory; `mutate` edits ids/weights first.
std::string make_trace(const std::string& leaf, std::int64_t T = 4,
                       const std::function<void(std::vector<std::int16_t>&, std::vector<float>&)>& mutate = {}) {
  std::vector<std::int16_t> ids;
  std::vector<float> w;
  for (std::int64_t t = 0; t < T; ++t) {
    ids.insert(ids.end(), {static_cast<std::int16_t>(t % 64), static_cast<std::int16_t>((t + 7) % 64)});
    w.insert(w.end(), {0.75f, 0.25f});
  }
  if (mutate) mutate(ids, w);
  const std::string dir = temp_path(leaf);
  epmoe::test::write_routing_trace(dir, "general", T, 1, 2, ids, w);
  return dir;
}

// Found by a fresh user: an empty trace died of SIGFPE, a huge --offset overflowed into a segfault, NaN
// weights gave "relative L2 error 0.000e+00" and FAIL, an id past the model's experts reached the layer.
TEST(Cli, RunBadRoutingTracesAndOffsetsAreNamedBeforeAnyWork) {
  const std::string tiny = " --device cpu --ranks 2 --experts 64 --tokens 4 --hidden 128 --intermediate 64 --iters 1";
  CliResult r = run_cli("run --routing '" + make_trace("good") + "'" + tiny);
  ASSERT_EQ(r.code, 0) << r.out << r.err;  // the hand-made trace itself is fine
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  const struct {
    std::string args, want, got;
  } cases[] = {
      {"--routing '" + make_trace("empty", 0) + "'", "invalid argument '--routing topk_idx'", "[0, 1, 2]"},
      {"--routing '" + make_trace("good") + "' --offset 9223372036854775807",
       "invalid argument '--offset': expected in [0, 4)", "got 9223372036854775807"},
      {"--routing '" + make_trace("good") + "' --offset 4", "invalid argument '--offset'", "got 4"},
      {"--routing '" + make_trace("nan", 4, [](auto&, auto& w) { w[5] = std::nanf(""); }) + "'",
       "invalid argument '--routing topk_weights': expected finite weights", "nan at [2, 0, 1]"},
      {"--routing '" + make_trace("ids", 4, [](auto& ids, auto&) { ids[6] = 64; }) + "'",
       "invalid argument '--routing topk_idx': expected ids in [-1, 64)", "64 at [3, 0, 0]"},
  };
  // A trace whose K is past the mode's range (32 in normal mode, 16 in low-latency mode) is refused when loaded,
  // naming --routing, as --topk would be (found by a fresh user: K = 40 reached the layer after the weights).
  for (const auto& [mode, K] : {std::pair<std::string, std::int64_t>{"normal", 33}, {"low-latency", 17}}) {
    const std::string dir = temp_path("wide_" + mode);
    std::vector<std::int16_t> ids;
    for (std::int64_t t = 0; t < 4; ++t)
      for (std::int64_t k = 0; k < K; ++k) ids.push_back(static_cast<std::int16_t>((t + k) % 64));
    epmoe::test::write_routing_trace(dir, "general", 4, 1, K, ids, std::vector<float>(ids.size(), 1.0f / K));
    r = run_cli("run --mode " + mode + " --routing '" + dir + "'" + tiny);
    EXPECT_EQ(r.code, 2) << mode << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("invalid argument '--routing': expected a trace of K in 1.."), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("got K = " + std::to_string(K)), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << mode << ": refused only after starting\n" << r.out;
    std::filesystem::remove_all(dir);
  }
  // A file the .npy reader refuses is named as --routing too, with the reader's reason.
  const std::string text = make_trace("text");
  write_file(text + "/general.topk_idx.npy", "not a numpy file\n");
  r = run_cli("run --routing '" + text + "'" + tiny);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("invalid argument '--routing topk_idx': expected a .npy file"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(bad magic)"), std::string::npos) << r.err;
  for (const auto& c : cases) {
    r = run_cli("run " + c.args + tiny);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.got), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << c.args << ": refused only after starting\n" << r.out;
  }
}

// Found by a fresh user: `--routing DIR/math.topk_idx.npy --domain reasoning` replayed 'math' and said nothing of
// --domain. A file names its own domain: --domain beside it is refused naming both flags; with the directory it
// picks the file, and the file alone replays its own domain.
TEST(Cli, RunDomainWithARoutingFileIsRefusedNamingBothFlags) {
  const std::string tiny = " --device cpu --ranks 2 --experts 64 --tokens 4 --hidden 128 --intermediate 64 --iters 1";
  const std::string dir = make_trace("domain");
  std::filesystem::copy_file(dir + "/general.topk_idx.npy", dir + "/math.topk_idx.npy",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(dir + "/general.topk_weights.npy", dir + "/math.topk_weights.npy",
                             std::filesystem::copy_options::overwrite_existing);
  const std::string file = dir + "/math.topk_idx.npy";
  for (const std::string domain : {"reasoning", "math"}) {
    const CliResult r = run_cli("run --routing '" + file + "' --domain " + domain + tiny);
    EXPECT_EQ(r.code, 2) << domain << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("invalid argument '--domain': expected nothing when --routing is a file"), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("math.topk_idx.npy"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("got " + domain), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << "refused only after starting\n" << r.out;
  }
  CliResult r = run_cli("run --routing '" + file + "'" + tiny);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("routing: replaying 'math' layer 0"), std::string::npos) << r.out;
  r = run_cli("run --routing '" + dir + "' --domain math" + tiny);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("routing: replaying 'math' layer 0"), std::string::npos) << r.out;
}

// Found by a fresh user: --domain, --layer and --offset without --routing ran on random routing (exit 0) as if a
// trace had been replayed.
TEST(Cli, RunReplayFlagsWithoutRoutingAreRefusedNamingTheFlag) {
  const std::string tiny = " --device cpu --ranks 2 --experts 64 --tokens 4 --hidden 128 --intermediate 64 --iters 1";
  for (const auto& [flags, named, value] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--domain coding", "--domain", "coding"},
           {"--layer 3", "--layer", "3"},
           {"--offset 5", "--offset", "5"},
           {"--offset 5 --domain math", "--domain", "math"}}) {
    const CliResult r = run_cli("run " + flags + tiny);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("invalid argument '" + named + "': expected --routing beside it"), std::string::npos)
        << flags << "\n" << r.err;
    EXPECT_NE(r.err.find("got " + value), std::string::npos) << flags << "\n" << r.err;
    EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << "refused only after starting\n" << r.out;
  }
}

// Found by a fresh user: --json /proc/x.json passed the early check and failed after the whole job. The early check
// opens the file as the final write will (a full device passes it: RunResultsThatCannotBeWrittenAfterTheRunExitOne).
TEST(Cli, RunJsonPathsThatCannotBeWrittenAreNamedWithTheReason) {
  CliResult r = run_cli("run --device cpu --json /proc/epmoe_cli_test.json " + kTinyRun);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("invalid argument '--json': expected a writable file, got /proc/epmoe_cli_test.json ("),
            std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("dispatch"), std::string::npos) << "refused only after running\n" << r.out;
  r = run_cli("run --device cpu --json '" + temp_path("no-such-dir") + "/out.json' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("No such file or directory"), std::string::npos) << r.err;
  // A new name is not left behind when the command is refused after the check.
  const std::string fresh = temp_path("fresh.json");
  std::filesystem::remove(fresh);
  r = run_cli("run --device cpu --json '" + fresh + "' --routing '" + temp_path("no-such-routing") + "' " + kTinyRun);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--routing'"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(fresh));
  // An existing file keeps its contents until the final write.
  write_file(fresh, "old");
  r = run_cli("run --device cpu --json '" + fresh + "' --routing '" + temp_path("no-such-routing") + "' " + kTinyRun);
  EXPECT_EQ(slurp(fresh), "old");
}

// Found by a fresh user: `run --json /dev/full` ran, printed PASS and exited 2, "bad arguments". A write that fails
// once the job has run is a failure while running: exit 1, naming the flag, the path and the reason.
TEST(Cli, RunResultsThatCannotBeWrittenAfterTheRunExitOne) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  CliResult r = run_cli("run --device cpu --json /dev/full " + kTinyRun);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("epmoe: --json: could not write the results to /dev/full (No space left on device)"),
            std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("invalid argument"), std::string::npos) << r.err;
  r = run_cli("bench --device cpu --modes normal --tokens-max 1 --hidden 64 --experts 4 --topk 1 --runs 1 --warmup 0 "
              "--json /dev/full");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("epmoe: --json: could not write the results to /dev/full (No space left on device)"),
            std::string::npos) << r.err;
}

/// Runs the CLI with `args` and its standard output on /dev/full (every write fails: "No space left on device").
CliResult run_cli_to_full_device(const std::string& args) {
  const std::string e = temp_path("stderr.txt");
  const int status = std::system(("'" + cli_path() + "' " + args + " >/dev/full 2>'" + e + "'").c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = slurp(e);
  std::remove(e.c_str());
  return r;
}

// Found by a fresh user: `run > /dev/full` said "internal error: cannot write to file" (as if a bug).
TEST(Cli, StandardOutputThatCannotBeWrittenIsNamed) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const CliResult r = run_cli_to_full_device("run --device cpu " + kTinyRun);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("epmoe: could not write to standard output (No space left on device)"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
}

// Found by a fresh user: `tune --help` and `bench --help` ended with run's exit statuses ("run: PASS"). Each command's
// help ends with its own; the app's names them all.
TEST(Cli, EachHelpEndsWithItsOwnExitStatus) {
  const std::string failure = "a failure while running (a timeout, an internal error, results that could not be "
                              "written); 2 bad arguments, or a request this machine cannot serve (no GPU, sizes past "
                              "its memory).\n";
  const struct {
    std::string args, footer;
  } cases[] = {
      {"--help", "Exit status: 0 success (run: PASS); 1 a failed check (run: FAIL) or " + failure},
      {"run --help", "Exit status: 0 PASS; 1 FAIL or " + failure},
      {"bench --help", "Exit status: 0 success; 1 " + failure},
      {"tune --help", "Exit status: 0 success; 1 " + failure},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, 0) << c.args;
    const std::string tail = r.out.substr(r.out.size() - std::min(r.out.size(), c.footer.size()));
    EXPECT_EQ(tail, c.footer) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.find("Exit status"), r.out.rfind("Exit status")) << c.args << ": one exit-status text\n" << r.out;
  }
}

// Found by a fresh user: `epmoe --help > /dev/full` exited 0, as if the help had been read. A help or version text
// that cannot be written exits 1 naming standard output, as a command's output does.
TEST(Cli, HelpThatCannotBeWrittenExitsOne) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  for (const std::string args : {"--help", "run --help", "bench --help", "tune -h", "--version"}) {
    const CliResult r = run_cli_to_full_device(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find("epmoe: could not write to standard output (No space left on device)"), std::string::npos)
        << args << "\n" << r.err;
  }
}

TEST(Cli, RunSizesBeyondHostMemoryAreNamedBeforeAnyAllocation) {
  // 1e11 tokens of H=2048 need petabytes: named as a size problem (exit 2), not a failed allocation.
  const CliResult r = run_cli("run --device cpu --tokens 99999999999");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GiB"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("PASS"), std::string::npos) << r.out;
}

// Found by a fresh user: `bench --device cpu --hidden 256 --tokens-max 4 --ranks 1000 --experts 1000` passed the
// host-memory pre-check and was OOM-killed at ~24 GB (peak RSS roughly cubic in R: each of R thread ranks holds
// R x R count and prefix matrices); `run --ranks 1000 --experts-impl reference` likewise. At 40000 ranks and T = 1
// every estimate exceeds any machine's memory (low-latency run: ~718 GiB; 8000 ranks fit the GPU machine's 128 GiB,
// where 8000 threads then could not start). Both must be refused naming --ranks before any thread rank starts, under
// run_cli_limited's virtual-memory limit, so that a regression fails here instead of taking the machine's memory.
TEST(Cli, RanksWhoseCountExchangeOutgrowsHostMemoryAreRefusedNamingRanks) {
  const struct {
    std::string args;
  } cases[] = {
      {"bench --device cpu --modes normal --hidden 16 --topk 1 --tokens-max 1 --runs 1 --warmup 0 --no-floors "
       "--ranks 40000 --experts 40000"},
      {"bench --device cpu --hidden 16 --topk 1 --tokens-max 1 --runs 1 --warmup 0 --ranks 40000 --experts 40000"},
      {"run --device cpu --experts-impl reference --ranks 40000 --experts 40000 --tokens 1 --hidden 16 "
       "--intermediate 8 --topk 1 --iters 1 --check-tokens 1"},
      {"run --device cpu --mode low-latency --experts-impl reference --ranks 40000 --experts 40000 --tokens 1 "
       "--hidden 16 --intermediate 8 --topk 1 --iters 1 --check-tokens 1"},
  };
  for (const auto& c : cases) {
    const auto [code, out, err] = run_cli_limited(c.args);
    EXPECT_EQ(code, 2) << c.args << "\n" << out << err;
    EXPECT_NE(err.find("epmoe: invalid argument '--ranks/"), std::string::npos) << c.args << "\n" << err;
    EXPECT_NE(err.find("expected sizes whose host memory fits this machine's"), std::string::npos)
        << c.args << "\n" << err;
    EXPECT_NE(err.find("40000 "), std::string::npos) << c.args << ": the ranks are named in the estimate\n" << err;
    EXPECT_EQ(out.find("epmoe 0."), std::string::npos) << c.args << ": refused only after starting\n" << out;
    EXPECT_EQ(err.find("T=1:"), std::string::npos) << c.args << ": refused only after starting\n" << err;
    EXPECT_EQ(err.find("generating"), std::string::npos) << c.args << ": refused only after starting\n" << err;
  }
}

// Found by a fresh user: sizes past 64-bit byte counts printed 20-digit GiB figures (a run's 1e30 stand-in for
// R x T >= 2^31 too), and the low-latency window's hint wrapped around: `bench --modes low-latency --hidden 2^60`
// was estimated at 0.0 GiB, passed the check and started. Such sizes are refused before any work, the figures
// saturated ("more than 1 EiB"). Under the same virtual-memory limit as above.
TEST(Cli, SizesPastSixtyFourBitCountsAreRefusedWithSaneFigures) {
  const std::string huge = "4611686018427387904";  // 2^62
  const struct {
    std::string args, want;
  } cases[] = {
      {"run --device cpu --ranks 1 --experts 8 --topk 2 --tokens " + huge + " --hidden " + huge + " --intermediate " +
           huge,
       "got more than 1 EiB (weights more than 1 EiB, 1 rank's tokens and buffers more than 1 EiB)"},
      {"run --device cpu --mode low-latency --ranks 64 --experts 64 --tokens 99999999",
       "64 ranks' tokens and buffers more than 1 EiB"},
      {"bench --device cpu --modes low-latency --tokens-max 1 --hidden 1152921504606846976 --experts 4 --topk 2 "
       "--runs 1 --warmup 0",
       "low-latency more than 1 EiB"},
      {"bench --device cpu --tokens-max 1 --hidden " + huge + " --experts 4 --topk 2 --runs 1 --warmup 0",
       "normal mode more than 1 EiB, low-latency more than 1 EiB"},
      // A replayed trace's span (offset + R x T) overflowed before the memory check (undefined behaviour).
      {"run --device cpu --routing '" + make_trace("huge") + "' --ranks 4 --experts 64 --tokens " + huge +
           " --hidden 16 --intermediate 8",
       "4 ranks' tokens and buffers more than 1 EiB"},
  };
  const std::regex long_figure("[0-9]{11,}\\.[0-9] GiB");
  for (const auto& c : cases) {
    const auto [code, out, err] = run_cli_limited(c.args);
    EXPECT_EQ(code, 2) << c.args << "\n" << out << err;
    EXPECT_NE(err.find("expected sizes whose host memory fits this machine's"), std::string::npos)
        << c.args << "\n" << err;
    EXPECT_NE(err.find(c.want), std::string::npos) << c.args << "\n" << err;
    EXPECT_FALSE(std::regex_search(err, long_figure)) << c.args << "\n" << err;
    EXPECT_EQ(out.find("epmoe 0."), std::string::npos) << c.args << ": refused only after starting\n" << out;
    EXPECT_EQ(err.find("T=1:"), std::string::npos) << c.args << ": refused only after starting\n" << err;
  }
}

// Found by a fresh user: "4 tokens checked over 1 ranks", "median of 1 iterations", "1 ranks' tokens", "1 CPU ranks".
TEST(Cli, CountsOfOneAreSaidInTheSingular) {
  const std::regex plural_one(R"(\b1 (CPU |GPU )?(ranks|iterations|tokens|layers|runs|recorded tokens)\b)");
  CliResult r = run_cli("run --device cpu --ranks 1 " + kTinyRun);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("1 CPU rank (threads"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("median of 1 iteration (--iters)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(4 tokens checked over 1 rank)"), std::string::npos) << r.out;
  EXPECT_FALSE(std::regex_search(r.out + r.err, plural_one)) << r.out << r.err;
  r = run_cli("run --device cpu --ranks 1 --tokens 99999999999");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(", 1 rank's tokens and buffers "), std::string::npos) << r.err;
  EXPECT_FALSE(std::regex_search(r.err, plural_one)) << r.err;
  r = run_cli("bench --device cpu --ranks 1 --modes normal --tokens-max 1 --hidden 64 --experts 4 --topk 1 --runs 1 "
              "--warmup 0 --no-floors");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("bench: 1 CPU rank (threads; --device cpu)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", 1 run after 0 warm-up"), std::string::npos) << r.out;
  EXPECT_FALSE(std::regex_search(r.out + r.err, plural_one)) << r.out << r.err;
  r = run_cli("run --eplb --routing '" + make_trace("eplb") + "' --ranks 1 --experts 64");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("(1 layer, 4 tokens)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" slots on 1 rank ("), std::string::npos) << r.out;
  EXPECT_FALSE(std::regex_search(r.out + r.err, plural_one)) << r.out << r.err;
}

// --eplb runs no layer: the layer run's options given beside it are named as ignored, not dropped silently.
TEST(Cli, EplbNamesTheLayerOptionsItIgnores) {
  CliResult r = run_cli("run --eplb --routing '" + make_trace("eplb_ignored") +
                        "' --ranks 1 --experts 64 --iters 5 --dispatch-dtype fp8");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("note: ignored with --eplb (it plans and counts the trace's routing, no layer runs): "
                       "--dispatch-dtype, --iters\n"),
            std::string::npos)
      << r.err;
  r = run_cli("run --eplb --routing '" + make_trace("eplb_plain") + "' --ranks 1 --experts 64");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("ignored with --eplb"), std::string::npos) << r.err;
}

// A plan measured on the tokens it was planned from balances them at least as well as no plan, in every layer, also
// when --experts spreads the trace's 64 ids over more (the spread once followed t mod s, as the replica choice does,
// and with spares 5 of 16 layers came out worse than before the plan).
TEST(Cli, EplbPlanNeverWorsensItsOwnTokensWithSpreadExperts) {
  for (const char* experts : {"64", "128", "256"}) {
    const CliResult r = run_cli("run --eplb --routing '" + std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing' --experts " +
                                experts);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    std::istringstream lines(r.out);
    int layers = 0;
    for (std::string line; std::getline(lines, line);) {
      std::istringstream row(line);
      int layer = 0;
      double plan_before = 0, plan_after = 0;
      if (!(row >> layer >> plan_before >> plan_after)) continue;  // headers and the mean row
      ++layers;
      EXPECT_LE(plan_after, plan_before) << "--experts " << experts << ", layer " << layer << "\n" << r.out;
      EXPECT_LT(plan_after, 1.05) << "--experts " << experts << ", layer " << layer << "\n" << r.out;
    }
    EXPECT_EQ(layers, 16) << r.out;
  }
}

// bench's T sweep takes powers of two. Found by a fresh user: `--tokens-max 3` was taken (the sweep narrowed to 1..2
// with a note); bounds that are not powers of two are refused, naming the flag, what it takes and the value.
TEST(Cli, BenchRefusesTokenBoundsThatAreNotPowersOfTwo) {
  const std::string tiny = " --device cpu --ranks 1 --modes normal --hidden 64 --experts 4 --topk 1 --runs 1 --warmup 0 "
                           "--no-floors";
  const std::string powers = "expected a power of two (1, 2, 4, ...: the T bench sweeps), got ";
  expect_refused_before_work({
      {"bench --tokens-max 3" + tiny, "epmoe: invalid argument '--tokens-max': " + powers + "3\n"},
      {"bench --tokens-min 3 --tokens-max 12" + tiny, "epmoe: invalid argument '--tokens-min': " + powers + "3\n"},
      {"bench --tokens-min 2 --tokens-max 12" + tiny, "epmoe: invalid argument '--tokens-max': " + powers + "12\n"},
      {"bench --tokens-min 0" + tiny, "epmoe: invalid argument '--tokens-min': " + powers + "0\n"},
  }, "note:");
  const CliResult r = run_cli("bench --tokens-min 2 --tokens-max 4" + tiny);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("T in 2..4 (powers of two)"), std::string::npos) << r.out;
}

// bench with --ranks typed and --experts left at its default names --ranks (as run does), not the default it
// never typed; both typed, --experts.
TEST(Cli, BenchNamesTheRanksTypedBesideTheDefaultExperts) {
  CliResult r = run_cli("bench --device cpu --ranks 3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("invalid argument '--ranks': expected a divisor of --experts (256, its default), got 3"),
            std::string::npos)
      << r.err;
  r = run_cli("bench --device cpu --ranks 3 --experts 256");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("invalid argument '--experts': expected a multiple of the 3 ranks, got 256"), std::string::npos)
      << r.err;
}

// Found by a fresh user: --config read as inline JSON in the help; tune's help offered --device cpu (always
// refused) and described --ranks as bench's.
TEST(Cli, HelpSaysConfigIsAFileAndTuneRunsOnGpus) {
  for (const char* cmd : {"run", "bench", "tune"}) {
    const CliResult r = run_cli(std::string(cmd) + " --help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.out.find("--config FILE"), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("a JSON file of BufferOptions tunables"), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_EQ(r.out.find("tunables as JSON"), std::string::npos) << cmd << "\n" << r.out;
  }
  const CliResult tune = run_cli("tune --help");
  EXPECT_NE(tune.out.find("--device TEXT:{auto,cuda}"), std::string::npos) << tune.out;
  EXPECT_EQ(tune.out.find("{auto,cpu,cuda}"), std::string::npos) << tune.out;
  EXPECT_EQ(tune.out.find("bench on CPU"), std::string::npos) << tune.out;
  EXPECT_NE(tune.out.find("GPU ranks, one per GPU"), std::string::npos) << tune.out;
  // cpu is not offered but still refused with the reason (TuneRefusesWithoutGpus); other values by the choices.
  const CliResult bad = run_cli("tune --device tpu");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("'--device': expected auto or cuda, got 'tpu'"), std::string::npos) << bad.err;
}

// Found by a fresh user: the help read "--json TEXT:PATH" and "--no-floors{false}" (CLI11's type with its check's
// name, and the negated flag's value). Paths say PATH; flags say nothing but their name, and still work.
TEST(Cli, HelpSaysPathsAndFlagsPlainly) {
  const CliResult run = run_cli("run --help"), bench = run_cli("bench --help"), tune = run_cli("tune --help");
  for (const char* s : {"--json PATH ", "--routing PATH ", "--overlap ", "--eplb "})
    EXPECT_NE(run.out.find(s), std::string::npos) << s << "\n" << run.out;
  for (const char* s : {"--json PATH ", "--no-floors "})
    EXPECT_NE(bench.out.find(s), std::string::npos) << s << "\n" << bench.out;
  EXPECT_NE(tune.out.find("-o,--output PATH=epmoe_tune.json"), std::string::npos) << tune.out;
  for (const CliResult* r : {&run, &bench, &tune}) {
    EXPECT_EQ(r->code, 0);
    for (const char* s : {"TEXT:PATH", "{false}", "{true}", "--routing TEXT", "--output TEXT"})
      EXPECT_EQ(r->out.find(s), std::string::npos) << s << "\n" << r->out;
  }
  const CliResult r = run_cli("bench --device cpu --modes normal --tokens-max 1 --hidden 64 --experts 4 --topk 1 "
                              "--runs 1 --warmup 0 --no-floors");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("floor: off (--no-floors); nccl: off (--no-floors)"), std::string::npos) << r.out;
}

// Found by a fresh user: the header said "4 CPU ranks (threads)" without why, and the table's bytes column was
// not explained. Bytes, from a hand-made trace: every token goes to experts 0..10 (rank 0 of 2, E = 64); rank 0
// replays tokens 0..3 and rank 1 tokens 4..7 = 0..3 (wrapped), one row each to rank 0: 8 rows of 2H each way,
// rank 0's 4 rows to itself included (only 4 cross ranks).
TEST(Cli, RunHeaderSaysWhyCpuRanksAndTheBytesColumnCountsEveryReceivedRow) {
  const std::string out = temp_path("run.json");
  const std::int64_t H = 128;
  CliResult r = run_cli("run --device cpu --ranks 2 --experts 64 --tokens 4 --hidden 128 --intermediate 64 --iters 1 "
                        "--routing '" + make_trace("trace") + "' --json '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("2 CPU ranks (threads; --device cpu)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bytes: x rows each rank received (dispatch) or sent back (combine), its own rows included"),
            std::string::npos) << r.out;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["phases"].size(), 4u);
  EXPECT_EQ(j["phases"][1]["phase"], "dispatch");
  EXPECT_DOUBLE_EQ(j["phases"][1]["bytes"].get<double>(), 8.0 * 2 * H);
  EXPECT_EQ(j["phases"][3]["phase"], "combine");
  EXPECT_DOUBLE_EQ(j["phases"][3]["bytes"].get<double>(), 8.0 * 2 * H);
  // Bytes are whole numbers; the router and the experts move no rows: null bytes and rate (the table's "-").
  EXPECT_TRUE(j["phases"][1]["bytes"].is_number_integer()) << j["phases"][1];
  for (const int k : {0, 2}) {
    EXPECT_TRUE(j["phases"][k]["bytes"].is_null()) << j["phases"][k];
    EXPECT_TRUE(j["phases"][k]["gb_per_s"].is_null()) << j["phases"][k];
  }
  EXPECT_GT(j["phases"][1]["gb_per_s"].get<double>(), 0.0);
  if (gpu_count() > 0) {
    r = run_cli("run --mode low-latency " + kTinyRun);  // auto with GPUs: low-latency runs on them too
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find(" GPU ranks ("), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("CPU ranks"), std::string::npos) << r.out;
    return;
  }
  r = run_cli("run --ranks 2 " + kTinyRun);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(r.out.find("2 CPU ranks (threads; no CUDA GPU found)") != std::string::npos ||
              r.out.find("2 CPU ranks (threads; this epmoe was built without CUDA)") != std::string::npos)
      << r.out;
  r = run_cli("bench --modes normal --tokens-max 1 --hidden 64 --experts 4 --topk 1 --runs 1 --warmup 0 --no-floors");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(r.out.find("2 CPU ranks (threads; no CUDA GPU found)") != std::string::npos ||
              r.out.find("2 CPU ranks (threads; this epmoe was built without CUDA)") != std::string::npos)
      << r.out;
}

TEST(Cli, TuneNamesBadFlagsOnAnyMachine) {
  // Flags are checked before the GPU lookup: a bad list or objective is named with or without GPUs.
  CliResult r = run_cli("tune --device cpu --sms 8,abc");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--sms'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("8,abc"), std::string::npos) << r.err;
  r = run_cli("tune --device cpu --chunks 0,99");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--chunks'"), std::string::npos) << r.err;
  r = run_cli("tune --device cpu --objective foo");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'--objective'"), std::string::npos) << r.err;
}

TEST(Cli, BenchOnGpusHasPeerCopyFloorsAndNcclStatus) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::string out = temp_path("bench.json");
  const CliResult r = run_cli("bench --tokens-min 2 --tokens-max 4 --hidden 128 --experts 8 --topk 2 --runs 3 --warmup 1 "
                              "--json '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["device"], "cuda");
  EXPECT_EQ(j["floor"], "peer_copy");
  EXPECT_EQ(j["ranks"], gpu_count());
  const bool nccl = j["nccl"].get<std::string>().find('.') != std::string::npos;  // a version, else why not
  ASSERT_EQ(j["results"].size(), 12u);  // T = 2, 4; three normal-mode and three low-latency ops each
  std::map<std::string, int> ops;
  for (const auto& s : j["results"]) {
    const std::string op = s["op"];
    ++ops[op];
    EXPECT_EQ(s["mode"], op.rfind("ll_", 0) == 0 ? "low-latency" : "normal") << s.dump();
    EXPECT_GT(s["median_us"].get<double>(), 0.0);
    if (gpu_count() > 1) EXPECT_GT(s["floor_us"].get<double>(), 0.0);
    EXPECT_EQ(s["nccl_us"].is_null(), !nccl) << s.dump();
  }
  for (const char* op : {"dispatch_bf16", "dispatch_fp8", "combine_bf16", "ll_dispatch_fp8", "ll_dispatch_bf16",
                         "ll_combine_bf16"})
    EXPECT_EQ(ops[op], 2) << op;
}

TEST(Cli, TuneOnGpusWritesTheBestConfig) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::string out = temp_path("tune.json");
  CliResult r = run_cli("tune --tokens 64 --hidden 128 --experts 8 --topk 2 --sms 4,8 --chunks 2,4 --runs 3 --warmup 1 -o '" +
                        out + "'");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("[4/4] num_sms=8 num_chunks=4"), std::string::npos) << r.err;
  const nlohmann::json j = read_json(out);
  const auto& tried = j["_tune"]["results"];
  ASSERT_EQ(tried.size(), 4u);
  // The best is the lowest max(dispatch, combine), recomputed here from the recorded times.
  int best = -1, best_chunks = -1;
  double best_v = 1e300;
  for (const auto& t : tried) {
    const double v = std::max(t["dispatch_bf16_us"].get<double>(), t["combine_bf16_us"].get<double>());
    EXPECT_DOUBLE_EQ(t["objective_us"].get<double>(), v);
    if (v < best_v) best_v = v, best = t["num_sms"].get<int>(), best_chunks = t["num_chunks"].get<int>();
  }
  EXPECT_EQ(j["num_sms"], best);
  EXPECT_EQ(j["num_chunks"], best_chunks);
  // The file is a valid --config.
  r = run_cli("run --config '" + out + "' " + kTinyRun);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("num_sms " + std::to_string(best)), std::string::npos) << r.out;
}

TEST(Cli, PlotScriptRendersThePng) {
  std::string python = std::string(EPMOE_SOURCE_DIR) + "/build/venv/bin/python";
  if (!std::filesystem::exists(python)) python = "python3";
  if (std::system(("'" + python + "' -c 'import matplotlib' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "matplotlib is not installed (pip install -r scripts/requirements-plot.txt)";
  const std::string json = temp_path("bench.json"), png = temp_path("bench.png");
  std::filesystem::remove(png);
  const CliResult r = run_cli("bench --device cpu --tokens-max 4 --hidden 64 --experts 4 --topk 2 --runs 2 --json '" + json + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string cmd = "'" + python + "' '" + EPMOE_SOURCE_DIR + "/scripts/plot_bench.py' '" + json + "' -o '" + png + "' >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const std::string bytes = slurp(png);
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_EQ(bytes.substr(0, 4), "\x89PNG");
}

}  // namespace
