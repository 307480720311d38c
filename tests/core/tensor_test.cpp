// Shape, TensorView and Tensor: strides, row / slice views, contiguity, ownership, descriptions.
#include <gtest/gtest.h>

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

namespace epmoe {
namespace {

TEST(Shape, NumelStridesEqualityAndString) {
  const Shape s{2, 3, 4};
  EXPECT_EQ(s.ndim(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s.contiguous_strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(to_string(s), "[2, 3, 4]");
  EXPECT_FALSE(s == (Shape{2, 3}));
  EXPECT_FALSE(s == (Shape{2, 3, 5}));
  EXPECT_EQ(Shape{}.ndim(), 0);
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar
  EXPECT_EQ(to_string(Shape{}), "[]");
  EXPECT_EQ((Shape{5, 0}).numel(), 0);
  EXPECT_EQ((Shape{1, 2, 3, 4}).contiguous_strides(), (Shape{24, 12, 4, 1}));
}

TEST(Shape, MoreThanFourDimsIsAnInternalError) {
  try {
    Shape s{1, 2, 3, 4, 5};
    FAIL() << "accepted 5 dims";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::internal);
  }
}

TEST(TensorView, RowOfTwoAndThreeDims) {
  std::vector<float> buf(2 * 3 * 4);
  std::iota(buf.begin(), buf.end(), 0.0f);
  const TensorView t(buf.data(), DType::fp32, {2, 3, 4});
  const TensorView r = t.row(1);
  EXPECT_EQ(r.shape, (Shape{3, 4}));
  EXPECT_EQ(r.strides, (Shape{4, 1}));
  EXPECT_EQ(r.ptr<float>()[0], 12.0f);
  const TensorView rr = r.row(2);
  EXPECT_EQ(rr.shape, (Shape{4}));
  EXPECT_EQ(rr.ptr<float>()[3], 23.0f);
  const TensorView scalar = rr.row(3);
  EXPECT_EQ(scalar.ndim(), 0);
  EXPECT_EQ(*scalar.ptr<float>(), 23.0f);
  EXPECT_THROW(t.row(2), Error);
  EXPECT_THROW(t.row(-1), Error);
}

TEST(TensorView, RowHonoursRowStride) {
  // A [3, 4] bf16 view whose rows are 10 elements apart inside a larger buffer.
  std::vector<std::uint16_t> buf(30, 0);
  for (int i = 0; i < 30; ++i) buf[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(i);
  const TensorView t(buf.data(), DType::bf16, {3, 4}, {10, 1}, Device::cpu());
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.row(2).ptr<bf16_t>()[1].bits, 21);
  EXPECT_TRUE(t.row(2).is_contiguous());
  const TensorView s = t.slice_rows(1, 3);
  EXPECT_EQ(s.shape, (Shape{2, 4}));
  EXPECT_EQ(s.strides, (Shape{10, 1}));
  EXPECT_EQ(s.ptr<bf16_t>()[0].bits, 10);
  EXPECT_EQ(s.row(1).ptr<bf16_t>()[3].bits, 23);
}

TEST(TensorView, SliceRows) {
  std::vector<std::int64_t> buf(12);
  std::iota(buf.begin(), buf.end(), 0);
  const TensorView t(buf.data(), DType::int64, {6, 2});
  const TensorView s = t.slice_rows(2, 5);
  EXPECT_EQ(s.shape, (Shape{3, 2}));
  EXPECT_EQ(s.strides, (Shape{2, 1}));
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_EQ(s.ptr<std::int64_t>()[0], 4);
  EXPECT_EQ(s.numel(), 6);
  EXPECT_EQ(s.nbytes(), 48u);
  const TensorView empty = t.slice_rows(6, 6);
  EXPECT_EQ(empty.size(0), 0);
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_THROW(t.slice_rows(3, 2), Error);
  EXPECT_THROW(t.slice_rows(0, 7), Error);
  EXPECT_THROW(t.slice_rows(-1, 2), Error);
}

TEST(TensorView, IsContiguous) {
  float x = 0;
  EXPECT_TRUE(TensorView(&x, DType::fp32, {4, 8}).is_contiguous());
  EXPECT_FALSE(TensorView(&x, DType::fp32, {4, 8}, {16, 1}, Device::cpu()).is_contiguous());
  EXPECT_FALSE(TensorView(&x, DType::fp32, {4, 8}, {1, 4}, Device::cpu()).is_contiguous());  // transposed
  EXPECT_FALSE(TensorView(&x, DType::fp32, {4, 8}, {8, 2}, Device::cpu()).is_contiguous());
  // Dimensions of size 1 may have any stride.
  EXPECT_TRUE(TensorView(&x, DType::fp32, {1, 8}, {999, 1}, Device::cpu()).is_contiguous());
  EXPECT_TRUE(TensorView(&x, DType::fp32, {4, 1}, {1, 7}, Device::cpu()).is_contiguous());
  // Empty tensors are contiguous whatever their strides (NumPy exports them with zero strides).
  EXPECT_TRUE(TensorView(&x, DType::fp32, {0, 8}, {0, 0}, Device::cpu()).is_contiguous());
}

TEST(TensorView, AccessorsAndNegativeDims) {
  float x = 0;
  const TensorView t(&x, DType::fp32, {2, 5, 7});
  EXPECT_EQ(t.size(-1), 7);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.stride(0), 35);
  EXPECT_EQ(t.nbytes(), 2u * 5 * 7 * 4);
  EXPECT_TRUE(t.defined());
  EXPECT_FALSE(TensorView().defined());
}

TEST(TensorView, PtrChecksTheType) {
  float x = 0;
  const TensorView t(&x, DType::fp32, {1});
  EXPECT_NO_THROW(t.ptr<float>());
  EXPECT_THROW(t.ptr<bf16_t>(), Error);
  // Same-size integer types read the raw bits (int16_t of bfloat16, int8_t of fp8); other sizes throw.
  std::uint16_t b = 0;
  EXPECT_NO_THROW(TensorView(&b, DType::bf16, {1}).ptr<std::int16_t>());
  EXPECT_THROW(TensorView(&b, DType::bf16, {1}).ptr<std::int32_t>(), Error);
  EXPECT_THROW(TensorView(&b, DType::bf16, {1}).ptr<fp16_t>(), Error);
  std::int64_t i = 0;
  EXPECT_NO_THROW(TensorView(&i, DType::int64, {1}).ptr<std::int64_t>());
}

TEST(TensorView, Describe) {
  float x = 0;
  EXPECT_EQ(describe(TensorView(&x, DType::bf16, {4, 128})), "bfloat16[4, 128] cpu");
  EXPECT_EQ(describe(TensorView(&x, DType::fp8_e4m3, {2}, {1}, Device::cuda(1))), "float8_e4m3fn[2] cuda:1");
  EXPECT_EQ(describe(TensorView()), "None");
  EXPECT_EQ(to_string(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(to_string(Device::cpu()), "cpu");
}

TEST(Tensor, EmptyZerosAlignedAndShared) {
  Tensor t = Tensor::zeros(DType::fp32, {3, 5});
  EXPECT_EQ(t.shape(), (Shape{3, 5}));
  EXPECT_EQ(t.nbytes(), 60u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.ptr<float>()[i], 0.0f);
  Tensor copy = t;  // shares storage
  copy.ptr<float>()[4] = 7.0f;
  EXPECT_EQ(t.ptr<float>()[4], 7.0f);
  const TensorView& v = t;
  EXPECT_EQ(v.data, t.data());
  EXPECT_TRUE(v.is_contiguous());
  Tensor e = Tensor::empty(DType::int32, {0, 4});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.defined());
  EXPECT_THROW(Tensor::empty(DType::fp32, {-1, 2}), Error);
}

TEST(Tensor, WrapKeepsStorageAlive) {
  auto storage = std::make_shared<std::vector<float>>(8, 2.0f);
  std::weak_ptr<std::vector<float>> weak = storage;
  Tensor t = Tensor::wrap(TensorView(storage->data(), DType::fp32, {2, 4}), storage);
  storage.reset();
  EXPECT_FALSE(weak.expired());
  EXPECT_EQ(t.ptr<float>()[7], 2.0f);
  t = Tensor();
  EXPECT_TRUE(weak.expired());
}

TEST(Tensor, ASizeBeyondSizeTIsOutOfMemoryNamingTheShape) {
  // 2^40 * 2^40 elements of 2 bytes: the product wraps around 2^64, which must not become a small allocation.
  const std::int64_t big = std::int64_t{1} << 40;
  for (Device d : {Device::cpu(), Device::cuda(0)}) {
    try {
      Tensor::empty(DType::bf16, {big, big}, d);
      FAIL() << "allocated a tensor of 2^81 bytes on " << to_string(d);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
      EXPECT_NE(std::string(e.what()).find("[1099511627776, 1099511627776]"), std::string::npos) << e.what();
    }
  }
  // A zero dimension makes any other size empty, never an overflow.
  EXPECT_EQ(Tensor::empty(DType::bf16, {big, big, 0}).nbytes(), 0u);
}

#if !defined(EPMOE_HAVE_CUDA)
TEST(Tensor, DeviceAllocationWithoutCudaIsUnsupported) {
  try {
    Tensor::empty(DType::fp32, {4}, Device::cuda(0));
    FAIL() << "allocated device memory in a CPU-only build";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}
#endif

}  // namespace
}  // namespace epmoe
