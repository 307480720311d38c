// BufferOptions from JSON (buffer.hpp: apply_buffer_config_json, load_buffer_config, buffer_config_json):
// hand-made files, each expectation written from the documented fields and ranges.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "support/random.hpp"
#include "support/temp_path.hpp"

namespace epmoe {
namespace {

// The message of the invalid_argument that `fn` throws ("" when it throws nothing).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  return "";
}

TEST(BufferConfig, SetsOnlyTheFieldsPresent) {
  std::mt19937_64 rng(test::fresh_seed());
  BufferOptions o;
  o.num_nvl_bytes = 12345;
  o.device = 1;
  const int sms = static_cast<int>(rng() % 64) + 1;
  apply_buffer_config_json("{\"num_sms\": " + std::to_string(sms) + "}", o);
  EXPECT_EQ(o.num_sms, sms);
  EXPECT_EQ(o.num_nvl_bytes, 12345);  // not a tunable: untouched
  EXPECT_EQ(o.device, 1);
  apply_buffer_config_json("{}", o);
  EXPECT_EQ(o.num_sms, sms);
}

TEST(BufferConfig, EveryTunableIsRead) {
  BufferOptions o;
  apply_buffer_config_json(R"({"num_sms": 12, "use_copy_engine": false, "num_chunks": 7})", o);
  EXPECT_EQ(o.num_sms, 12);
  EXPECT_FALSE(o.use_copy_engine);
  EXPECT_EQ(o.num_chunks, 7);
  apply_buffer_config_json(R"({"use_copy_engine": true})", o);
  EXPECT_TRUE(o.use_copy_engine);
  EXPECT_EQ(o.num_chunks, 7);
  // The A/B switches, off by default.
  EXPECT_FALSE(o.combine_sm_push || o.low_latency_separate_quant || o.mpi_pack_rows);
  apply_buffer_config_json(R"({"combine_sm_push": true, "low_latency_separate_quant": true, "mpi_pack_rows": true})",
                           o);
  EXPECT_TRUE(o.combine_sm_push);
  EXPECT_TRUE(o.low_latency_separate_quant);
  EXPECT_TRUE(o.mpi_pack_rows);
  EXPECT_EQ(o.num_sms, 12);
  const std::string msg = error_of([&] { apply_buffer_config_json(R"({"use_copy_engine": 1})", o, "c.json"); });
  EXPECT_NE(msg.find("'c.json:use_copy_engine'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("true or false"), std::string::npos) << msg;
  const std::string msg2 = error_of([&] { apply_buffer_config_json(R"({"num_chunks": 17})", o, "c.json"); });
  EXPECT_NE(msg2.find("an integer in [0, 16], got 17"), std::string::npos) << msg2;
}

TEST(BufferConfig, IgnoresNotesStartingWithUnderscore) {
  BufferOptions o;
  apply_buffer_config_json(R"({"num_sms": 24, "_tune": {"results": [1, 2]}, "_comment": "x"})", o);
  EXPECT_EQ(o.num_sms, 24);
}

TEST(BufferConfig, UnknownFieldIsNamedWithTheKnownOnes) {
  BufferOptions o;
  o.num_sms = 8;
  const std::string msg = error_of([&] { apply_buffer_config_json(R"({"num_sms": 16, "num_smz": 4})", o, "cfg.json"); });
  EXPECT_NE(msg.find("cfg.json:num_smz"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown field"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_sms"), std::string::npos) << msg;
  EXPECT_EQ(o.num_sms, 8);  // a bad file changes nothing, not even its good fields
}

TEST(BufferConfig, AFieldGivenTwiceIsNamed) {
  BufferOptions o;
  o.num_sms = 8;
  const std::string msg =
      error_of([&] { apply_buffer_config_json(R"({"num_sms": 16, "num_chunks": 2, "num_sms": 32})", o, "cfg.json"); });
  EXPECT_NE(msg.find("'cfg.json:num_sms'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at most once"), std::string::npos) << msg;
  EXPECT_EQ(o.num_sms, 8);
  // The same name inside a note's object is the note's business.
  apply_buffer_config_json(R"({"num_sms": 16, "_tune": {"num_sms": 8, "x": {"num_sms": 4}}})", o);
  EXPECT_EQ(o.num_sms, 16);
}

TEST(BufferConfig, WrongTypeAndRangeAreNamed) {
  BufferOptions o;
  std::string msg = error_of([&] { apply_buffer_config_json(R"({"num_sms": "16"})", o, "c.json"); });
  EXPECT_NE(msg.find("'c.json:num_sms'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("an integer in [0, 64]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("string"), std::string::npos) << msg;
  msg = error_of([&] { apply_buffer_config_json(R"({"num_sms": 65})", o, "c.json"); });
  EXPECT_NE(msg.find("got 65"), std::string::npos) << msg;
  msg = error_of([&] { apply_buffer_config_json(R"({"num_sms": -1})", o, "c.json"); });
  EXPECT_NE(msg.find("got -1"), std::string::npos) << msg;
  msg = error_of([&] { apply_buffer_config_json(R"({"num_sms": 8.5})", o, "c.json"); });
  EXPECT_NE(msg.find("8.5"), std::string::npos) << msg;
  EXPECT_EQ(o.num_sms, 0);
}

TEST(BufferConfig, NotAnObjectOrNotJson) {
  BufferOptions o;
  std::string msg = error_of([&] { apply_buffer_config_json("[16]", o, "c.json"); });
  EXPECT_NE(msg.find("'c.json'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a JSON array"), std::string::npos) << msg;
  msg = error_of([&] { apply_buffer_config_json("{\"num_sms\": ", o, "c.json"); });
  EXPECT_NE(msg.find("not JSON"), std::string::npos) << msg;
}

TEST(BufferConfig, FileRoundTrip) {
  std::mt19937_64 rng(test::fresh_seed());
  BufferOptions o;
  o.num_sms = static_cast<int>(rng() % 64) + 1;
  o.num_chunks = static_cast<int>(rng() % 16) + 1;
  o.use_copy_engine = (rng() & 1) != 0;
  o.copy_engine_min_rows = static_cast<std::int64_t>(rng() % 100000);
  o.num_recv_slots = static_cast<int>(rng() % 65);
  o.combine_sm_push = (rng() & 1) != 0;
  o.low_latency_separate_quant = (rng() & 1) != 0;
  o.mpi_pack_rows = (rng() & 1) != 0;
  const auto b = [](bool v) -> std::string { return v ? "true" : "false"; };
  const std::string text = buffer_config_json(o);
  // Hand-made: every tunable, keys sorted (nlohmann's object order).
  EXPECT_EQ(text, "{\n  \"combine_sm_push\": " + b(o.combine_sm_push) + ",\n  \"copy_engine_min_rows\": " +
                      std::to_string(o.copy_engine_min_rows) + ",\n  \"low_latency_separate_quant\": " +
                      b(o.low_latency_separate_quant) + ",\n  \"mpi_pack_rows\": " + b(o.mpi_pack_rows) +
                      ",\n  \"num_chunks\": " + std::to_string(o.num_chunks) + ",\n  \"num_recv_slots\": " +
                      std::to_string(o.num_recv_slots) + ",\n  \"num_sms\": " +
                      std::to_string(o.num_sms) + ",\n  \"use_copy_engine\": " +
                      (o.use_copy_engine ? "true" : "false") + "\n}");
  const std::string path = epmoe::test::temp_path("epmoe_buffer_config", "test.json");
  std::ofstream(path) << text;
  BufferOptions back;
  load_buffer_config(path, back);
  EXPECT_EQ(back.num_sms, o.num_sms);
  EXPECT_EQ(back.num_chunks, o.num_chunks);
  EXPECT_EQ(back.use_copy_engine, o.use_copy_engine);
  EXPECT_EQ(back.copy_engine_min_rows, o.copy_engine_min_rows);
  EXPECT_EQ(back.num_recv_slots, o.num_recv_slots);
  EXPECT_EQ(back.combine_sm_push, o.combine_sm_push);
  EXPECT_EQ(back.low_latency_separate_quant, o.low_latency_separate_quant);
  EXPECT_EQ(back.mpi_pack_rows, o.mpi_pack_rows);
  std::remove(path.c_str());
  const std::string msg = error_of([&] { load_buffer_config(path, back); });
  EXPECT_NE(msg.find("'config'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

}  // namespace
}  // namespace epmoe
