// The client's hand-built bulk messages against protobuf's own encoding.
#include "client/wire.h"

#include "base/pieces.h"
#include "client/push_messages.h"
#include "rpc/chunk_size.h"

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/escaping.h"
#include "google/protobuf/stubs/common.h"
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

// A commit's params (ParamChunk) and a read's state (StateChunk), whose
// fields are numbered apart: each read whole, wherever gRPC cut its slices.
TEST(Wire, ChunksAreReadAcrossAnySliceBoundaries) {
  std::string data(5000, '\0');
  std::mt19937_64 rng(5);
  for (char& c : data) c = static_cast<char>(rng());
  const auto chunk = [&](auto message) {  // the same fields in either message
    message.set_tensor("gain");
    message.set_offset(4096 * 3);
    message.set_step(77);
    message.set_dtype(v1::FP32);
    message.set_data(data);
    return message.SerializeAsString();
  };
  for (const auto& [bytes, fields] : {std::pair(chunk(v1::ParamChunk()), &kParamChunk),
                                      std::pair(chunk(v1::StateChunk()), &kStateChunk)}) {
    for (std::vector<size_t> cuts :
         std::vector<std::vector<size_t>>{{}, {1}, {3, 4, 5, 6, 7}, {9, 2500, 4999}, {bytes.size() - 1}}) {
      grpc::ByteBuffer message = Sliced(bytes, cuts);
      std::string out(data.size(), 'x');
      ASSERT_TRUE(ReadChunks(&message, *fields, [&](const ChunkHead& h) -> char* {
        EXPECT_EQ(h.tensor, "gain");
        EXPECT_EQ(h.offset, 4096u * 3);
        EXPECT_EQ(h.dtype, uint64_t{v1::FP32});
        EXPECT_EQ(h.step, 77u);
        return h.data_bytes == out.size() ? out.data() : nullptr;
      }));
      EXPECT_EQ(out, data);
    }
  }
}

// A client-streaming call's one answer (Push, Init): parsed; a second one,
// one that does not parse, or an OK call without one is INTERNAL.
TEST(Wire, OneAnswerIsParsedAndAnythingElseIsInternal) {
  v1::PushResponse sent;
  sent.set_sum_squares(2.5);
  v1::PushResponse got;
  const OneAnswer answer(&got, "push");
  EXPECT_EQ(answer.Ended(grpc::Status::OK).error_code(), grpc::StatusCode::INTERNAL);  // none yet
  grpc::ByteBuffer message = Sliced(sent.SerializeAsString(), {});
  ASSERT_TRUE(answer(&message).ok());
  EXPECT_EQ(got.sum_squares(), 2.5);
  EXPECT_TRUE(answer.Ended(grpc::Status::OK).ok());
  EXPECT_EQ(answer.Ended(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone")).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  const grpc::Status twice = answer(&message);
  EXPECT_EQ(twice.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(twice.error_message().find("answered a push twice"), std::string::npos) << twice.error_message();
  v1::InitResponse init;
  const OneAnswer malformed(&init, "init");
  grpc::ByteBuffer garbage = Sliced(std::string("\x0a\x05" "ab", 4), {});  // a length past the end
  EXPECT_EQ(malformed(&garbage).error_code(), grpc::StatusCode::INTERNAL);
}

TEST(Wire, MalformedOrRefusedParamChunksAreReported) {
  v1::ParamChunk chunk;
  chunk.set_tensor("w");
  chunk.set_data(std::string(64, 'a'));
  const std::string bytes = chunk.SerializeAsString();
  char sink[64];
  auto accept = [&](const ChunkHead&) -> char* { return sink; };
  grpc::ByteBuffer truncated = Sliced(bytes.substr(0, bytes.size() - 1), {});
  EXPECT_FALSE(ReadChunks(&truncated, kParamChunk, accept));
  grpc::ByteBuffer refused = Sliced(bytes, {});
  EXPECT_FALSE(ReadChunks(&refused, kParamChunk, [](const ChunkHead&) -> char* { return nullptr; }));
  grpc::ByteBuffer bad_type = Sliced(std::string("\x0d\x00\x00\x00\x00", 5), {});  // a fixed32 field, no data
  EXPECT_FALSE(ReadChunks(&bad_type, kParamChunk, accept));
  grpc::ByteBuffer no_data = Sliced(std::string("\x20\x05", 2), {});  // step only
  EXPECT_FALSE(ReadChunks(&no_data, kParamChunk, accept));
}

// A packed commit message (CommitRequest.pack): the chunk, then its `more`
// in order, each read whole wherever gRPC cut the slices. A packed chunk
// without data, or with `more` of its own (which no server sends), makes
// the message malformed; a refused one stops the reading there, the chunks
// before it written.
TEST(Wire, PackedParamChunksAreReadInOrder) {
  std::mt19937_64 rng(11);
  v1::ParamChunk message;
  std::vector<std::string> sent;
  for (int i = 0; i < 4; ++i) {
    v1::ParamChunk* chunk = i == 0 ? &message : message.add_more();
    chunk->set_tensor("t" + std::to_string(i));
    chunk->set_offset(16384 * i);
    chunk->set_step(9);
    if (i == 2) chunk->set_dtype(v1::FP32);
    std::string data(100 + 37 * i, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    chunk->set_data(data);
    sent.push_back(data);
  }
  const std::string bytes = message.SerializeAsString();
  for (std::vector<size_t> cuts : std::vector<std::vector<size_t>>{{}, {1}, {150, 151, 400}, {bytes.size() - 1}}) {
    grpc::ByteBuffer buffer = Sliced(bytes, cuts);
    std::vector<std::string> got;
    ASSERT_TRUE(ReadChunks(&buffer, kParamChunk, [&](const ChunkHead& h) -> char* {
      const size_t i = got.size();
      EXPECT_EQ(h.tensor, "t" + std::to_string(i));
      EXPECT_EQ(h.offset, 16384u * i);
      EXPECT_EQ(h.step, 9u);
      EXPECT_EQ(h.dtype, i == 2 ? uint64_t{v1::FP32} : uint64_t{v1::DTYPE_UNSPECIFIED});
      got.emplace_back(h.data_bytes, '\0');
      return got.back().data();
    }));
    EXPECT_EQ(got, sent);
  }
  // A refused third chunk: the first two are written, and the message is refused.
  {
    grpc::ByteBuffer buffer = Sliced(bytes, {});
    std::vector<std::string> got;
    EXPECT_FALSE(ReadChunks(&buffer, kParamChunk, [&](const ChunkHead& h) -> char* {
      if (got.size() == 2) return nullptr;
      got.emplace_back(h.data_bytes, '\0');
      return got.back().data();
    }));
    EXPECT_EQ(got, std::vector<std::string>(sent.begin(), sent.begin() + 2));
  }
  char sink[1000];
  const auto accept = [&](const ChunkHead&) -> char* { return sink; };
  v1::ParamChunk nested = message;
  nested.mutable_more(1)->add_more()->set_data("x");
  grpc::ByteBuffer packed_twice = Sliced(nested.SerializeAsString(), {});
  EXPECT_FALSE(ReadChunks(&packed_twice, kParamChunk, accept));
  v1::ParamChunk empty = message;
  empty.mutable_more(2)->clear_data();
  grpc::ByteBuffer without_data = Sliced(empty.SerializeAsString(), {});
  EXPECT_FALSE(ReadChunks(&without_data, kParamChunk, accept));
  // A read's StateChunk has no `more`: field 6 there is an unknown field, skipped.
  v1::StateChunk state;
  state.set_data("abcd");
  std::string state_bytes = state.SerializeAsString();
  AppendBytesField(&state_bytes, 6, nested.SerializeAsString());
  grpc::ByteBuffer state_buffer = Sliced(state_bytes, {});
  int chunks = 0;
  EXPECT_TRUE(ReadChunks(&state_buffer, kStateChunk, [&](const ChunkHead&) -> char* {
    ++chunks;
    return sink;
  }));
  EXPECT_EQ(chunks, 1);
}

// The client reads a server's ParamChunk and StateChunk by hand; protobuf's
// parser is the reference, over mutated chunks cut into random slices (the
// server's reader has a fuzzer of its own, tests/fuzz/). What ScanFields
// leaves to protobuf (groups, a tag past 32 bits, which protobuf cuts to
// 32), the client refuses, as no server sends it. Of the rest, what protobuf
// takes the client takes if it has a data field (a chunk without data is no
// chunk), reading the same fields and data: the last of a repeated field,
// as protobuf keeps it, and no field of the wrong wire type. A ParamChunk's
// packed chunks (`more`) are read after it, in order, under the same rules,
// and one with `more` of its own is refused. Where only a tensor name that
// is not UTF-8 parts them, protobuf refuses and the client leaves it to its
// name lookup (no tensor is so named).
TEST(Wire, ReadChunksAgreesWithProtobufOnMutatedChunks) {
  std::mt19937_64 rng(17);
  const auto next = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
  int taken = 0, taken_packed = 0, refused = 0, left_to_protobuf = 0, not_utf8 = 0;
  for (int round = 0; round < 20000; ++round) {
    const bool param = round % 2 == 0;
    const ChunkFields& fields = param ? kParamChunk : kStateChunk;
    const auto fill = [&](auto* message) {
      message->set_tensor(std::string(1 + next(8), static_cast<char>('a' + next(26))));
      message->set_offset(next(3) == 0 ? rng() : next(5000));
      message->set_step(next(300));
      message->set_dtype(static_cast<v1::DType>(next(3)));
      std::string data(next(40), '\0');
      for (char& c : data) c = static_cast<char>(rng());
      message->set_data(data);
    };
    std::string bytes;
    if (param) {
      v1::ParamChunk chunk;
      fill(&chunk);
      for (uint64_t packed = next(3); packed > 0; --packed) fill(chunk.add_more());
      bytes = chunk.SerializeAsString();
    } else {
      v1::StateChunk chunk;
      fill(&chunk);
      bytes = chunk.SerializeAsString();
    }
    if (next(4) == 0) bytes += bytes;  // every field twice: the last wins, `more` twice over
    for (uint64_t edits = next(4); edits > 0 && !bytes.empty(); --edits) {
      const size_t at = next(bytes.size());
      switch (next(4)) {
        case 0: bytes[at] = static_cast<char>(bytes[at] ^ (1 << next(8))); break;
        case 1: bytes.erase(at, 1); break;
        case 2: bytes.insert(at, 1, static_cast<char>(rng())); break;
        default: bytes.resize(at); break;
      }
    }
    std::vector<size_t> cuts;
    for (uint64_t c = next(4); c > 0 && !bytes.empty(); --c) cuts.push_back(next(bytes.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    grpc::ByteBuffer message = Sliced(bytes, cuts);
    std::vector<std::pair<ChunkHead, std::string>> got;
    const bool took = ReadChunks(&message, fields, [&](const ChunkHead& h) -> char* {
      got.emplace_back(h, std::string(h.data_bytes, '\0'));
      return got.back().second.data();
    });

    SCOPED_TRACE(absl::CHexEscape(bytes));
    const Pieces whole = Pieces::Own(bytes);
    // The chunk's fields, then those of each of its packed chunks.
    std::vector<std::vector<Field>> chunks(1);
    std::vector<Pieces> bytes_of = {whole};
    bool scans = ScanFields(whole, &chunks[0]);
    for (size_t i = 0; scans && param && i < chunks[0].size(); ++i) {
      const Field f = chunks[0][i];
      if (f.number != fields.more || f.wire_type != kLengthDelimited) continue;
      bytes_of.push_back(whole.Sub(f.value, f.end - f.value));
      chunks.emplace_back();
      scans = ScanFields(bytes_of.back(), &chunks.back());
    }
    if (!scans) {
      EXPECT_FALSE(took);
      ++left_to_protobuf;
      continue;
    }
    v1::ParamChunk as_param;
    v1::StateChunk as_state;
    if (!(param ? as_param.ParseFromString(bytes) : as_state.ParseFromString(bytes))) {
      // Only a tensor name that is not UTF-8 may part the two here.
      bool named_badly = false;
      for (size_t c = 0; c < chunks.size(); ++c) {
        for (const Field& f : chunks[c]) {
          if (f.number != fields.tensor || f.wire_type != kLengthDelimited) continue;
          std::string name(f.end - f.value, '\0');
          bytes_of[c].Sub(f.value, f.end - f.value).CopyTo(name.data());
          named_badly = named_badly ||
                        !google::protobuf::internal::IsStructurallyValidUTF8(name.data(), static_cast<int>(name.size()));
        }
      }
      EXPECT_TRUE(named_badly) << "ScanFields read a message protobuf refuses";
      ++not_utf8;
      continue;
    }
    const auto has = [&](const std::vector<Field>& scanned, int number) {
      return number != 0 && std::any_of(scanned.begin(), scanned.end(), [&](const Field& f) {
               return f.number == number && f.wire_type == kLengthDelimited;
             });
    };
    bool readable = true;
    for (size_t c = 0; c < chunks.size(); ++c) {
      readable = readable && has(chunks[c], fields.data) && (c == 0 || !has(chunks[c], fields.more));
    }
    ASSERT_EQ(took, readable);
    if (!took) {
      ++refused;
      continue;
    }
    ++taken;
    if (chunks.size() > 1) ++taken_packed;
    ASSERT_EQ(got.size(), chunks.size());
    const auto expect_read = [&](const auto& want, const std::pair<ChunkHead, std::string>& read) {
      const ChunkHead& head = read.first;
      EXPECT_EQ(read.second, want.data());
      EXPECT_EQ(head.data_bytes, want.data().size());
      EXPECT_EQ(head.tensor, want.tensor());
      EXPECT_EQ(head.offset, want.offset());
      EXPECT_EQ(head.step, want.step());
      EXPECT_EQ(static_cast<int32_t>(head.dtype), static_cast<int32_t>(want.dtype()));  // an enum: 32 bits
    };
    if (param) {
      ASSERT_EQ(as_param.more_size() + 1, static_cast<int>(got.size()));
      expect_read(as_param, got[0]);
      for (int i = 0; i < as_param.more_size(); ++i) expect_read(as_param.more(i), got[i + 1]);
    } else {
      expect_read(as_state, got[0]);
    }
  }
  // Each outcome many times: a mutation that broke every chunk, or none,
  // would test one side only.
  EXPECT_GT(taken, 2000);
  EXPECT_GT(taken_packed, 1000);
  EXPECT_GT(refused + left_to_protobuf, 2000);
  EXPECT_LT(not_utf8, 2000);
}

// One server's push stream, message by message: the head, then for each
// tensor in order a wait for its gradient (asked for once) and its chunks as
// slices over the gradient at their offsets, an absent gradient named last.
// Gradients that may block are asked for through kLater and Wait, on the
// caller's thread; those `ready` says are there are asked for inside Next,
// on gRPC's thread, without a hop per tensor. The messages are the same
// either way.
// Packing changes nothing here: no tensor after a's last chunk fits it.
enum class Readiness { kNoneSaid, kAllReady, kSomeReady };
class PushMessagesTest : public ::testing::TestWithParam<std::tuple<Readiness, bool>> {};

TEST_P(PushMessagesTest, AskForEachGradientOnceAndNameTheAbsentLast) {
  const auto [readiness, pack] = GetParam();
  const std::function<bool(size_t)> ready = readiness == Readiness::kNoneSaid   ? nullptr
                                            : readiness == Readiness::kAllReady ? [](size_t) { return true; }
                                                                                : [](size_t i) { return i == 1; };
  std::mt19937 rng(5);
  std::vector<uint16_t> a(5000), c(300);
  std::vector<float> b(1000);
  for (auto& x : a) x = static_cast<uint16_t>(rng());
  for (auto& x : b) x = static_cast<float>(rng());
  for (auto& x : c) x = static_cast<uint16_t>(rng());
  v1::GradChunk head;
  head.set_job("j");
  head.set_step(7);
  head.add_no_grad("declared");
  // a's range [1000, 4000) and b's [0, 1000) are this server's; c has no gradient.
  std::vector<PushMessages::Send> sends = {{"a", 1000, 3000, v1::BF16, 2}, {"c", 0, 300, v1::BF16, 0},
                                           {"b", 0, 1000, v1::FP32, 1}};
  std::vector<size_t> asked;
  const std::function<const void*(size_t)> grad = [&](size_t i) -> const void* {
    asked.push_back(i);
    return i == 2 ? static_cast<const void*>(a.data()) : i == 1 ? static_cast<const void*>(b.data()) : nullptr;
  };
  PushMessages messages(head, sends, 2048, pack, grad, ready);
  using Ready = StreamCall::Ready;
  std::vector<v1::GradChunk> sent;
  std::vector<size_t> waits_before;  // messages sent before each wait
  for (int guard = 0; guard < 100; ++guard) {
    grpc::ByteBuffer out;
    const Ready r = messages.Next(&out);
    if (r == Ready::kEnd) break;
    if (r == Ready::kLater) {
      waits_before.push_back(sent.size());
      messages.Wait();
      continue;
    }
    v1::GradChunk m;
    ASSERT_TRUE(m.ParseFromString(Flatten(out)));
    sent.push_back(m);
  }
  EXPECT_EQ(asked, (std::vector<size_t>{2, 0, 1}));
  // a: 3000 bf16 in chunks of 1024; c: none; b: 1000 fp32 in chunks of 512.
  // a (index 2) after the head, c (0) after a's 3 chunks, b (1, with data: the one said ready in kSomeReady)
  // after them too.
  const std::map<Readiness, std::vector<size_t>> waits = {
      {Readiness::kNoneSaid, {1, 4, 4}}, {Readiness::kAllReady, {}}, {Readiness::kSomeReady, {1, 4}}};
  EXPECT_EQ(waits_before, waits.at(readiness));
  ASSERT_EQ(sent.size(), 1u + 3 + 2 + 1);
  EXPECT_EQ(sent[0].job(), "j");
  EXPECT_EQ(sent[0].step(), 7u);
  EXPECT_EQ(std::vector<std::string>(sent[0].no_grad().begin(), sent[0].no_grad().end()),
            std::vector<std::string>{"declared"});
  uint64_t a_at = 1000;
  for (int i = 1; i <= 3; ++i) {
    const uint64_t n = std::min<uint64_t>(1024, 4000 - a_at);
    EXPECT_EQ(sent[i].tensor(), "a");
    EXPECT_EQ(sent[i].offset(), a_at);
    EXPECT_EQ(sent[i].data(), std::string(reinterpret_cast<const char*>(a.data() + a_at), n * 2));
    a_at += n;
  }
  for (int i = 4; i <= 5; ++i) {
    const uint64_t at = (i - 4) * 512;
    EXPECT_EQ(sent[i].tensor(), "b");
    EXPECT_EQ(sent[i].dtype(), v1::FP32);
    EXPECT_EQ(sent[i].offset(), at);
    const uint64_t n = std::min<uint64_t>(512, 1000 - at);
    EXPECT_EQ(sent[i].data(), std::string(reinterpret_cast<const char*>(b.data() + at), n * 4));
  }
  EXPECT_EQ(std::vector<std::string>(sent[6].no_grad().begin(), sent[6].no_grad().end()), std::vector<std::string>{"c"});
  EXPECT_TRUE(sent[6].data().empty());
}

INSTANTIATE_TEST_SUITE_P(Wire, PushMessagesTest,
                         ::testing::Combine(::testing::Values(Readiness::kNoneSaid, Readiness::kAllReady,
                                                              Readiness::kSomeReady),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Readiness, bool>>& p) {
                           const Readiness r = std::get<0>(p.param);
                           return std::string(r == Readiness::kNoneSaid   ? "NoneSaid"
                                              : r == Readiness::kAllReady ? "AllReady"
                                                                          : "SomeReady") +
                                  (std::get<1>(p.param) ? "Packed" : "");
                         });

// A message packs at most chunk_bytes / 256 chunks after its own, so that
// what the server charges for them (kPackedChunkCharge each) stays within
// chunk_bytes, however small the tensors: here 8 after the first.
TEST(Wire, PushMessagesPackAtMostChunkBytesOverTheServersChargeEach) {
  std::vector<uint16_t> g(2 * 20, 0x3f80);
  std::vector<PushMessages::Send> sends;
  for (size_t i = 0; i < 20; ++i) sends.push_back({"t" + std::to_string(i), 0, 2, v1::BF16, i});
  const std::function<const void*(size_t)> grad = [&](size_t i) -> const void* { return g.data() + 2 * i; };
  const std::function<bool(size_t)> ready = [](size_t) { return true; };
  PushMessages messages(v1::GradChunk(), sends, 2048, /*pack=*/true, grad, ready);
  std::vector<int> chunks;
  for (int guard = 0; guard < 100; ++guard) {
    grpc::ByteBuffer out;
    const StreamCall::Ready r = messages.Next(&out);
    if (r == StreamCall::Ready::kEnd) break;
    ASSERT_EQ(r, StreamCall::Ready::kMessage);
    v1::GradChunk m;
    ASSERT_TRUE(m.ParseFromString(Flatten(out)));
    if (guard > 0) chunks.push_back(1 + m.more_size());
  }
  EXPECT_EQ(chunks, (std::vector<int>{9, 9, 2}));
}

// To a server that takes packed chunks, a message that ends a tensor carries
// the next tensors whole as `more`, while they fit in chunk_bytes with their
// fields and their gradients are there (`ready`); a tensor that does not
// fit, or is not there, starts the next message. Without `pack`, one chunk
// a message. Either way every element goes once, in order, as protobuf
// reads the messages. Each gradient is asked for once, and one that `ready`
// does not say is there is asked for in Wait (the caller's thread), never in
// Next. A message that packs stays within chunk_bytes, its fields included.
TEST(Wire, PushMessagesPackWholeTensorsThatFitAndAreThere) {
  std::mt19937 rng(6);
  std::vector<std::vector<uint16_t>> bf16 = {std::vector<uint16_t>(100), {}, {}, std::vector<uint16_t>(300),
                                             std::vector<uint16_t>(1500), std::vector<uint16_t>(50)};
  std::vector<float> fp32(200);
  for (auto& t : bf16) {
    for (auto& x : t) x = static_cast<uint16_t>(rng());
  }
  for (auto& x : fp32) x = static_cast<float>(rng());
  const std::vector<PushMessages::Send> sends = {{"t0", 0, 100, v1::BF16, 0},  {"t1", 0, 200, v1::FP32, 1},
                                                 {"t2", 0, 10, v1::BF16, 2},   {"t3", 0, 300, v1::BF16, 3},
                                                 {"t4", 0, 1500, v1::BF16, 4}, {"t5", 0, 50, v1::BF16, 5}};
  bool in_wait = false;
  std::vector<std::pair<size_t, bool>> asked;  // each gradient asked for, and whether in Wait
  const std::function<const void*(size_t)> grad = [&](size_t i) -> const void* {
    asked.emplace_back(i, in_wait);
    if (i == 1) return fp32.data();
    return i == 2 ? nullptr : static_cast<const void*>(bf16[i].data());
  };
  struct Case {
    bool pack;
    std::function<bool(size_t)> ready;
    std::vector<std::vector<std::string>> messages;  // each data message's tensors, in order
  };
  const std::vector<Case> cases = {
      // t0, t1 and t3 (t2 absent) fit 2048 bytes; t4 does not, and its last
      // chunk takes t5 along.
      {true, [](size_t) { return true; }, {{"t0", "t1", "t3"}, {"t4"}, {"t4", "t5"}}},
      // t3 is not there when t1 is sent: it starts the next message.
      {true, [](size_t i) { return i != 3; }, {{"t0", "t1"}, {"t3"}, {"t4"}, {"t4", "t5"}}},
      {false, [](size_t) { return true; }, {{"t0"}, {"t1"}, {"t3"}, {"t4"}, {"t4"}, {"t5"}}},
  };
  for (const Case& c : cases) {
    asked.clear();
    PushMessages messages(v1::GradChunk(), sends, 2048, c.pack, grad, c.ready);
    std::vector<std::vector<std::string>> got;
    std::map<std::string, std::string> data;  // each tensor's bytes as sent, in order
    std::vector<std::string> absent;
    for (int guard = 0; guard < 100; ++guard) {
      grpc::ByteBuffer out;
      const StreamCall::Ready r = messages.Next(&out);
      if (r == StreamCall::Ready::kEnd) break;
      if (r == StreamCall::Ready::kLater) {
        in_wait = true;
        messages.Wait();
        in_wait = false;
        continue;
      }
      const std::string bytes = Flatten(out);
      v1::GradChunk m;
      ASSERT_TRUE(m.ParseFromString(bytes));
      if (guard == 0) continue;  // the head
      if (m.no_grad_size() > 0) {
        absent.assign(m.no_grad().begin(), m.no_grad().end());
        continue;
      }
      // One chunk: at most chunk_bytes of data and its fields; packed: at
      // most chunk_bytes in all.
      EXPECT_LE(bytes.size(), m.more_size() > 0 ? 2048u : 2048u + 32) << "message " << got.size();
      got.emplace_back();
      for (int i = -1; i < m.more_size(); ++i) {
        const v1::GradChunk& chunk = i < 0 ? m : m.more(i);
        if (i >= 0) EXPECT_EQ(chunk.more_size(), 0);
        const uint64_t esize = chunk.tensor() == "t1" ? 4 : 2;
        EXPECT_EQ(chunk.offset() * esize, data[chunk.tensor()].size()) << chunk.tensor();
        EXPECT_EQ(chunk.dtype(), chunk.tensor() == "t1" ? v1::FP32 : v1::BF16);
        data[chunk.tensor()] += chunk.data();
        got.back().push_back(chunk.tensor());
      }
    }
    EXPECT_EQ(got, c.messages) << "pack " << c.pack;
    std::vector<std::pair<size_t, bool>> want_asked;
    for (size_t i = 0; i < sends.size(); ++i) want_asked.emplace_back(i, !c.ready(i));
    EXPECT_EQ(asked, want_asked) << "pack " << c.pack;
    EXPECT_EQ(absent, std::vector<std::string>{"t2"});
    EXPECT_EQ(data["t1"], std::string(reinterpret_cast<const char*>(fp32.data()), fp32.size() * 4));
    for (size_t t : {0, 3, 4, 5}) {
      EXPECT_EQ(data["t" + std::to_string(t)],
                std::string(reinterpret_cast<const char*>(bf16[t].data()), bf16[t].size() * 2))
          << t;
    }
  }
}

// 4 MiB for one or two ranks, 8 MiB shared out over more, 256 KiB from 32
// ranks on; at most half the smallest message a server takes; at most 256
// KiB for a server that does not say, beside one that does or alone; a size
// the caller chose, as given.
TEST(Wire, AClientLeftToChooseSizesItsMessagesByTheRanksAndTheServers) {
  const std::vector<uint64_t> roomy = {8 << 20, 8 << 20};
  EXPECT_EQ(ChunkBytesFor(0, 1, roomy), uint64_t{4} << 20);
  EXPECT_EQ(ChunkBytesFor(0, 2, roomy), uint64_t{4} << 20);
  EXPECT_EQ(ChunkBytesFor(0, 4, roomy), uint64_t{2} << 20);
  EXPECT_EQ(ChunkBytesFor(0, 8, roomy), uint64_t{1} << 20);
  EXPECT_EQ(ChunkBytesFor(0, 16, roomy), uint64_t{512} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 32, roomy), uint64_t{256} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1024, roomy), uint64_t{256} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1, {8 << 20, 1 << 20}), uint64_t{512} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 64, {256 << 10}), uint64_t{128} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1, {0}), uint64_t{256} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1, {8 << 20, 0}), uint64_t{256} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1, {0, 128 << 10}), uint64_t{64} << 10);
  EXPECT_EQ(ChunkBytesFor(0, 1, {}), uint64_t{4} << 20);
  EXPECT_EQ(ChunkBytesFor(3 << 20, 64, {1 << 20}), uint64_t{3} << 20);
}

}  // namespace
}  // namespace shardopt::wire
