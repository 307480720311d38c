// The .npy reader (src/core/npy.cpp) on hand-made files: a good one read back exactly, and headers that claim
// shapes the file cannot hold, refused before anything is allocated.
#include <gtest/gtest.h>

#include <epmoe/error.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/npy.hpp"
#include "support/temp_path.hpp"

namespace epmoe {
namespace {

// A format-1.0 file of dtype `descr` (default <i2) whose header says `shape` (written as text, so it may lie), then
// `data`.
std::string write_raw(const std::string& leaf, const std::string& shape, const std::vector<std::int16_t>& data,
                      const std::string& descr = "'<i2'") {
  const std::string path = epmoe::test::temp_path("epmoe_npy", leaf + ".npy");
  std::string header = "{'descr': " + descr + ", 'fortran_order': False, 'shape': (" + shape + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const unsigned char len[2] = {static_cast<unsigned char>(header.size() & 0xff),
                                static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(len), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * 2));
  return path;
}

std::string refusal(const std::string& path) {
  try {
    load_npy(path);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << path << " was accepted";
  return {};
}

TEST(Npy, ReadsAHandMadeInt16ArrayExactly) {
  const std::vector<std::int16_t> data = {1, -2, 300, -32768, 32767, 7};
  const Tensor t = load_npy(write_raw("good", "2, 3", data));
  ASSERT_EQ(t.dtype(), DType::int16);
  ASSERT_EQ(t.shape(), (Shape{2, 3}));
  for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(t.ptr<std::int16_t>()[i], data[i]) << i;
}

TEST(Npy, ReadsOneDimensionWrittenWithATrailingComma) {
  const std::vector<std::int16_t> data = {5, -6, 7};
  const Tensor t = load_npy(write_raw("one_dim", "3,", data));
  ASSERT_EQ(t.shape(), (Shape{3}));
  for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(t.ptr<std::int16_t>()[i], data[i]) << i;
}

TEST(Npy, RefusesAMalformedOrUnsupportedDtype) {
  for (const char* descr : {"'i2'", "'<2'", "'<i'", "'<ix'", "<i2", "'<i2"}) {
    const std::string what = refusal(write_raw("bad_descr", "2", {1, 2}, descr));
    EXPECT_NE(what.find("no dtype in header"), std::string::npos) << descr << ": " << what;
  }
  try {
    load_npy(write_raw("big_endian", "2", {1, 2}, "'>i2'"));
    ADD_FAILURE() << "a big-endian array was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
}

TEST(Npy, RefusesANegativeSize) {
  const std::string what = refusal(write_raw("negative", "-1, 16, 8", std::vector<std::int16_t>(128, 1)));
  EXPECT_NE(what.find("-1, 16, 8"), std::string::npos) << what;
}

TEST(Npy, RefusesASizeBeyondInt64WithoutCrashing) {
  const std::string what = refusal(write_raw("huge", "99999999999999999999, 16, 8", {1, 2}));
  EXPECT_NE(what.find("99999999999999999999"), std::string::npos) << what;
}

TEST(Npy, RefusesAShapeLargerThanTheFileBeforeAllocating) {
  // 2^32 x 16 x 8 int16 would be 1 TiB: named with the bytes the file has (4), never allocated.
  const std::string what = refusal(write_raw("short", "4294967296, 16, 8", {1, 2}));
  EXPECT_NE(what.find("1099511627776 bytes"), std::string::npos) << what;
  EXPECT_NE(what.find("got 4 bytes"), std::string::npos) << what;
}

TEST(Npy, RefusesAShapeWhoseSizeOverflows) {
  const std::string what = refusal(write_raw("overflow", "4611686018427387904, 4611686018427387904, 8", {1}));
  EXPECT_NE(what.find("more than 2^64"), std::string::npos) << what;
}

}  // namespace
}  // namespace epmoe
