// The client's hand-built bulk messages against protobuf's own encoding.
#include "client/wire.h"

#include <random>

#include "gtest/gtest.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt::wire {
namespace {

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at the given points, as gRPC may deliver them.
grpc::ByteBuffer Sliced(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  cuts.push_back(bytes.size());
  for (size_t to : cuts) {
    slices.emplace_back(bytes.data() + from, to - from);
    from = to;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(Wire, HandBuiltGradChunkParsesAsProtobufsOwn) {
  std::mt19937_64 rng(3);
  std::string data(300001, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (uint64_t offset : {uint64_t{0}, uint64_t{127}, uint64_t{128}, uint64_t{1} << 40}) {
    std::string head;
    AppendBytesField(&head, 4, "layers.0.w");
    AppendVarintField(&head, 5, offset);
    AppendVarintField(&head, 6, v1::BF16);
    AppendBytesHeader(&head, 7, data.size());
    v1::GradChunk parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(HeadAndBorrowedBytes(head, data.data(), data.size()))));
    EXPECT_EQ(parsed.tensor(), "layers.0.w");
    EXPECT_EQ(parsed.offset(), offset);
    EXPECT_EQ(parsed.dtype(), v1::BF16);
    EXPECT_EQ(parsed.data(), data);
  }
}

TEST(Wire, ParamChunkIsReadAcrossAnySliceBoundaries) {
  v1::ParamChunk chunk;
  chunk.set_tensor("gain");
  chunk.set_offset(4096 * 3);
  chunk.set_step(77);
  std::string data(5000, '\0');
  std::mt19937_64 rng(5);
  for (char& c : data) c = static_cast<char>(rng());
  chunk.set_data(data);
  const std::string bytes = chunk.SerializeAsString();
  for (std::vector<size_t> cuts : std::vector<std::vector<size_t>>{{}, {1}, {3, 4, 5, 6, 7}, {9, 2500, 4999}, {bytes.size() - 1}}) {
    grpc::ByteBuffer message = Sliced(bytes, cuts);
    std::string out(data.size(), 'x');
    ParamChunkHead head;
    ASSERT_TRUE(ReadParamChunk(
        &message,
        [&](const ParamChunkHead& h) -> char* {
          EXPECT_EQ(h.tensor, "gain");
          EXPECT_EQ(h.offset, 4096u * 3);
          return h.data_bytes == out.size() ? out.data() : nullptr;
        },
        &head));
    EXPECT_EQ(out, data);
    EXPECT_EQ(head.step, 77u);
  }
}

TEST(Wire, MalformedOrRefusedParamChunksAreReported) {
  v1::ParamChunk chunk;
  chunk.set_tensor("w");
  chunk.set_data(std::string(64, 'a'));
  const std::string bytes = chunk.SerializeAsString();
  char sink[64];
  auto accept = [&](const ParamChunkHead&) -> char* { return sink; };
  ParamChunkHead head;
  grpc::ByteBuffer truncated = Sliced(bytes.substr(0, bytes.size() - 1), {});
  EXPECT_FALSE(ReadParamChunk(&truncated, accept, &head));
  grpc::ByteBuffer refused = Sliced(bytes, {});
  EXPECT_FALSE(ReadParamChunk(&refused, [](const ParamChunkHead&) -> char* { return nullptr; }, &head));
  grpc::ByteBuffer bad_type = Sliced(std::string("\x0d\x00\x00\x00\x00", 5), {});  // fixed32: not in ParamChunk
  EXPECT_FALSE(ReadParamChunk(&bad_type, accept, &head));
  grpc::ByteBuffer no_data = Sliced(std::string("\x20\x05", 2), {});  // step only
  EXPECT_FALSE(ReadParamChunk(&no_data, accept, &head));
}

}  // namespace
}  // namespace shardopt::wire
