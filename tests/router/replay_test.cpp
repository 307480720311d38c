// Replaying recorded OLMoE routing (semantics §14) from the committed slice.
#include <epmoe/replay.hpp>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "core/npy.hpp"
#include "support/npy_writer.hpp"
#include "support/temp_path.hpp"

namespace epmoe {
namespace {

const std::string kDir = std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing";

TEST(Replay, LoadsBothDomainsWithTheRecordedShapes) {
  for (const char* domain : {"general", "coding"}) {
    const RoutingTrace t = load_routing_trace(kDir, domain);
    EXPECT_EQ(t.num_tokens(), 2048);
    EXPECT_EQ(t.num_layers(), 16);
    EXPECT_EQ(t.num_topk(), 8);
    // Every row: 8 distinct ids in [0, 64) (the data set's README promises no duplicates).
    const auto* idx = t.topk_idx.ptr<std::int16_t>();
    double weight_sum = 0;
    for (std::int64_t r = 0; r < t.num_tokens() * 16; ++r) {
      std::set<int> ids;
      for (int k = 0; k < 8; ++k) {
        ASSERT_GE(idx[r * 8 + k], 0);
        ASSERT_LT(idx[r * 8 + k], 64);
        ids.insert(idx[r * 8 + k]);
        weight_sum += t.topk_weights.ptr<float>()[r * 8 + k];
      }
      ASSERT_EQ(ids.size(), 8u);
    }
    // Softmax probabilities of the top 8 of 64, not renormalised: about 0.38 per row on average.
    const double mean = weight_sum / static_cast<double>(t.num_tokens() * 16);
    EXPECT_GT(mean, 0.2);
    EXPECT_LT(mean, 0.6);
  }
}

TEST(Replay, LoadsFromAFilePathToo) {
  const RoutingTrace t = load_routing_trace(kDir + "/coding.topk_idx.npy");
  EXPECT_EQ(t.domain, "coding");
  EXPECT_EQ(t.num_tokens(), 2048);
}

TEST(Replay, GivesRankRItsConsecutiveTokensAndKeepsWeights) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  const int layer = 5, T = 16;
  const auto r = replay_routing(t, layer, /*offset=*/100, /*rank=*/2, T, 64);
  for (int i = 0; i < T; ++i)
    for (int k = 0; k < 8; ++k) {
      const std::int64_t at = ((100 + 2 * T + i) * 16 + layer) * 8 + k;
      EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[i * 8 + k], t.topk_idx.ptr<std::int16_t>()[at]);
      EXPECT_EQ(r.topk_weights.ptr<float>()[i * 8 + k], t.topk_weights.ptr<float>()[at]);
    }
}

// SplitMix64's output function of x (Steele, Lea and Flood, OOPSLA 2014), written out from the paper's constants.
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

TEST(Replay, MapsIdsOntoMoreExpertsAsSpec14Says) {
  const RoutingTrace t = load_routing_trace(kDir, "coding");
  const auto r = replay_routing(t, 0, 100, 0, 8, 256);  // E/64 = 4; trace tokens 100..107
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) {
      const int e = t.topk_idx.ptr<std::int16_t>()[((100 + i) * 16) * 8 + k];
      EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[i * 8 + k], e * 4 + static_cast<int>(splitmix64(100 + i) % 4));
    }
}

// The expert a token is spread to must not follow its index's residue, which EPLB's replica choice (t mod replicas,
// semantics §9) reads: with `t mod s` every token of a spread expert went to one of 2 replicas.
TEST(Replay, TheSpreadExpertIsIndependentOfTheTokensParity) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  const std::int64_t n = t.num_tokens();
  const auto r = replay_routing(t, 3, 0, 0, n, 128);  // E/64 = 2
  std::int64_t pairs[2][2] = {};                      // [t mod 2][spread slot]
  for (std::int64_t i = 0; i < n; ++i)
    for (int k = 0; k < 8; ++k)
      if (const std::int64_t id = r.topk_idx.ptr<std::int64_t>()[i * 8 + k]; id >= 0) ++pairs[i % 2][id % 2];
  const double all = static_cast<double>(pairs[0][0] + pairs[0][1] + pairs[1][0] + pairs[1][1]);
  for (int p = 0; p < 2; ++p)
    for (int q = 0; q < 2; ++q) EXPECT_NEAR(pairs[p][q] / all, 0.25, 0.03) << "parity " << p << ", slot " << q;
}

TEST(Replay, WrapsAroundTheEndOfTheTrace) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  const auto r = replay_routing(t, 0, 2047, 0, 2, 64);
  EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[8], t.topk_idx.ptr<std::int16_t>()[0]);  // token 2048 -> 0
}

TEST(Replay, RejectsBadArgumentsNamingThem) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  try {
    replay_routing(t, 16, 0, 0, 4, 64);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'layer'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
  }
  EXPECT_THROW(replay_routing(t, 0, 0, 0, 4, 96), Error);
  EXPECT_THROW(load_routing_trace(kDir, "nonexistent"), Error);
  EXPECT_THROW(load_npy(kDir + "/README.md"), Error);
}

std::string temp_dir(const std::string& leaf) { return epmoe::test::temp_path("epmoe_replay", leaf); }

std::string error_of(const std::string& dir) {
  try {
    load_routing_trace(dir, "general");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    return e.what();
  }
  return "(no error)";
}

// A directory where a trace file goes (a failed unpack) is said to be one, not a file missing inside it nor a .npy
// file with a bad magic: given as the file, inside a --routing directory, and as the weights beside the ids.
TEST(Replay, ADirectoryWhereATraceFileGoesIsSaidToBeOne) {
  namespace fs = std::filesystem;
  const std::string dir = temp_dir("general.topk_idx.npy");
  fs::create_directories(dir);
  std::string what = error_of(dir);
  EXPECT_NE(what.find("'routing': expected a DOMAIN.topk_idx.npy file, got " + dir + " (a directory)"),
            std::string::npos)
      << what;
  fs::remove_all(dir);
  const std::string outer = temp_dir("traces");
  fs::create_directories(outer + "/general.topk_idx.npy");
  fs::copy_file(kDir + "/general.topk_weights.npy", outer + "/general.topk_weights.npy",
                fs::copy_options::overwrite_existing);
  what = error_of(outer);
  EXPECT_NE(what.find("'routing': expected a file " + outer + "/general.topk_idx.npy (domain 'general' of that "
                      "directory), got a directory"),
            std::string::npos)
      << what;
  fs::remove_all(outer + "/general.topk_idx.npy");
  fs::remove(outer + "/general.topk_weights.npy");
  fs::copy_file(kDir + "/general.topk_idx.npy", outer + "/general.topk_idx.npy");
  fs::create_directories(outer + "/general.topk_weights.npy");
  what = error_of(outer + "/general.topk_idx.npy");
  EXPECT_NE(what.find("expected a file " + outer + "/general.topk_weights.npy, got a directory"), std::string::npos)
      << what;
  fs::remove_all(outer);
}

// Hand-made traces: a bad value is named at its [token, layer, k] when loading, before any replay.
TEST(Replay, BadTracesAreRefusedWhenLoadingNamingTheFirstBadEntry) {
  const std::string good = temp_dir("good");
  // T=3, L=2, K=2: ids and weights by hand.
  std::vector<std::int16_t> ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 63};
  std::vector<float> w = {0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f};
  test::write_routing_trace(good, "general", 3, 2, 2, ids, w);
  const RoutingTrace t = load_routing_trace(good, "general");
  EXPECT_EQ(t.num_tokens(), 3);
  EXPECT_EQ(t.topk_idx.ptr<std::int16_t>()[11], 63);

  const std::string empty = temp_dir("empty");
  test::write_routing_trace(empty, "general", 0, 2, 2, {}, {});
  EXPECT_NE(error_of(empty).find("'routing topk_idx'"), std::string::npos) << error_of(empty);

  auto w_nan = w;
  w_nan[7] = std::numeric_limits<float>::quiet_NaN();  // token 1, layer 1, k 1
  w_nan[9] = std::numeric_limits<float>::infinity();
  const std::string nan_dir = temp_dir("nan");
  test::write_routing_trace(nan_dir, "general", 3, 2, 2, ids, w_nan);
  const std::string m = error_of(nan_dir);
  EXPECT_NE(m.find("'routing topk_weights'"), std::string::npos) << m;
  EXPECT_NE(m.find("finite"), std::string::npos) << m;
  EXPECT_NE(m.find("nan at [1, 1, 1]"), std::string::npos) << m;

  auto ids_bad = ids;
  ids_bad[4] = 64;  // token 1, layer 0, k 0: the recorded model has 64 experts
  const std::string id_dir = temp_dir("ids");
  test::write_routing_trace(id_dir, "general", 3, 2, 2, ids_bad, w);
  const std::string mi = error_of(id_dir);
  EXPECT_NE(mi.find("'routing topk_idx'"), std::string::npos) << mi;
  EXPECT_NE(mi.find("64 at [1, 0, 0]"), std::string::npos) << mi;
  ids_bad[4] = -2;
  test::write_routing_trace(id_dir, "general", 3, 2, 2, ids_bad, w);
  EXPECT_NE(error_of(id_dir).find("-2 at [1, 0, 0]"), std::string::npos) << error_of(id_dir);

  // A repeated id within one token's top-k (token 2, layer 1: ids 10, 10); -1 twice is no repeat.
  auto ids_dup = ids;
  ids_dup[11] = 10;
  ids_dup[0] = ids_dup[1] = -1;
  test::write_routing_trace(id_dir, "general", 3, 2, 2, ids_dup, w);
  const std::string md = error_of(id_dir);
  EXPECT_NE(md.find("'routing topk_idx'"), std::string::npos) << md;
  EXPECT_NE(md.find("distinct ids within a token's top-k"), std::string::npos) << md;
  EXPECT_NE(md.find("10 at [2, 1, 0] and at [2, 1, 1]"), std::string::npos) << md;
  ids_dup[11] = 63;
  test::write_routing_trace(id_dir, "general", 3, 2, 2, ids_dup, w);
  EXPECT_EQ(load_routing_trace(id_dir, "general").num_tokens(), 3);  // only -1 repeats: loads
}

// Found by a fresh user: a file the .npy reader refuses was reported under its path alone ("'x.topk_idx.npy':
// file shorter than its header length"), without naming the routing argument as every other trace error does.
TEST(Replay, FilesTheNpyReaderRefusesAreNamedAsTheRoutingArgumentWithTheReason) {
  const std::string good = temp_dir("good");
  test::write_routing_trace(good, "general", 2, 1, 1, {3, 4}, {0.5f, 0.25f});
  namespace fs = std::filesystem;
  const auto copy_with = [&](const std::string& leaf, const std::string& file, const std::string& bytes) {
    const std::string dir = temp_dir(leaf);
    fs::create_directories(dir);
    for (const char* f : {"general.topk_idx.npy", "general.topk_weights.npy"})
      fs::copy_file(good + "/" + f, dir + "/" + f, fs::copy_options::overwrite_existing);
    std::ofstream(dir + "/" + file, std::ios::binary | std::ios::trunc) << bytes;
    return dir;
  };
  const std::string text = copy_with("text", "general.topk_idx.npy", "not a numpy file\n");
  std::string m = error_of(text);
  EXPECT_NE(m.find("invalid argument 'routing topk_idx': expected a .npy file"), std::string::npos) << m;
  EXPECT_NE(m.find("general.topk_idx.npy' is not a .npy file (bad magic)"), std::string::npos) << m;
  EXPECT_EQ(m.find("got epmoe:"), std::string::npos) << m;  // the reason without its own prefix

  std::string head;  // the weights file cut inside its header
  {
    std::ifstream in(good + "/general.topk_weights.npy", std::ios::binary);
    head.resize(20);
    in.read(head.data(), 20);
  }
  m = error_of(copy_with("cut", "general.topk_weights.npy", head));
  EXPECT_NE(m.find("invalid argument 'routing topk_weights'"), std::string::npos) << m;
  EXPECT_NE(m.find("shorter than its header"), std::string::npos) << m;
}

TEST(Replay, HugeOffsetWrapsWithoutOverflow) {
  const std::string dir = temp_dir("trace");
  // T=4, L=1, K=1: token t routes to expert 10 + t with weight t + 1.
  test::write_routing_trace(dir, "general", 4, 1, 1, {10, 11, 12, 13}, {1.0f, 2.0f, 3.0f, 4.0f});
  const RoutingTrace t = load_routing_trace(dir, "general");
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();  // = 3 mod 4
  // Rank 1 of T=2 takes tokens (3 + 2 + i) mod 4 = 1, 2.
  const ReplayedRouting r = replay_routing(t, 0, big, 1, 2, 64);
  EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[0], 11);
  EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[1], 12);
  EXPECT_EQ(r.topk_weights.ptr<float>()[0], 2.0f);
  EXPECT_EQ(r.topk_weights.ptr<float>()[1], 3.0f);
}

}  // namespace
}  // namespace epmoe
