// A push message read without copying its data (server/grad_message.h)
// agrees with protobuf's own parser: on well-formed messages in any field
// order, with unknown and repeated fields, cut into slices anywhere; and on
// broken ones, which it refuses exactly when protobuf does.
#include "server/grad_message.h"

#include <random>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "google/protobuf/util/message_differencer.h"
#include "rpc/wire_format.h"

namespace shardopt {
namespace {

// `bytes` cut into slices at random points, as gRPC may deliver a message.
grpc::ByteBuffer Sliced(const std::string& bytes, std::mt19937_64& rng) {
  std::vector<size_t> cuts = {0, bytes.size()};
  for (int i = rng() % 8; i > 0; --i) cuts.push_back(rng() % (bytes.size() + 1));
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) slices.emplace_back(bytes.data() + cuts[i], cuts[i + 1] - cuts[i]);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Random(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// ReadGradChunk of `bytes`, cut anywhere, with the given caps; the packed
// chunks into `more`.
absl::Status ReadBytes(const std::string& bytes, std::mt19937_64& rng, uint64_t max_no_grad, uint64_t max_packed,
                       std::vector<GradPart>* more) {
  grpc::ByteBuffer message = Sliced(bytes, rng);
  v1::GradChunk head;
  Pieces data;
  return ReadGradChunk(&message, max_no_grad, max_packed, &head, &data, more);
}

// A GradChunk's fields in random order, some twice (the last one counts),
// with unknown fields of every wire type among them.
std::string RandomMessage(std::mt19937_64& rng) {
  std::vector<std::string> fields;
  auto add = [&](std::string f) { fields.push_back(std::move(f)); };
  for (int copies = 1 + rng() % 2; copies > 0; --copies) {
    std::string f;
    wire::AppendBytesField(&f, v1::GradChunk::kJobFieldNumber, "job-" + std::to_string(rng() % 100));
    add(f);
    f.clear();
    wire::AppendVarintField(&f, v1::GradChunk::kStepFieldNumber, rng() % 1000);
    add(f);
    f.clear();
    wire::AppendBytesField(&f, v1::GradChunk::kTensorFieldNumber, "layers." + std::to_string(rng() % 10));
    add(f);
    f.clear();
    wire::AppendVarintField(&f, v1::GradChunk::kOffsetFieldNumber, rng());
    add(f);
  }
  for (int names = rng() % 3; names > 0; --names) {
    std::string f;
    wire::AppendBytesField(&f, v1::GradChunk::kNoGradFieldNumber, "t" + std::to_string(rng() % 50));
    add(f);
  }
  for (int data = rng() % 3; data > 0; --data) {  // none, once or twice
    std::string f;
    wire::AppendBytesField(&f, v1::GradChunk::kDataFieldNumber, Random(rng, rng() % 5000));
    add(f);
  }
  // Packed chunks (GradChunk.more), now and then one with a field a packed
  // chunk may not carry, or with unknown fields, which it may.
  for (int packed = rng() % 3; packed > 0; --packed) {
    v1::GradChunk chunk;
    chunk.set_tensor("packed." + std::to_string(rng() % 10));
    chunk.set_offset(rng() % 100000);
    chunk.set_dtype(rng() % 2 == 0 ? v1::BF16 : v1::FP32);
    chunk.set_data(Random(rng, rng() % 300));
    std::string bytes = chunk.SerializeAsString();
    switch (rng() % 8) {
      case 0: wire::AppendVarintField(&bytes, v1::GradChunk::kStepFieldNumber, 1 + rng() % 10); break;
      case 1: wire::AppendBytesField(&bytes, v1::GradChunk::kNoGradFieldNumber, "t"); break;
      case 2: wire::AppendVarintField(&bytes, 100, rng()); break;
      default: break;
    }
    std::string f;
    wire::AppendBytesField(&f, v1::GradChunk::kMoreFieldNumber, bytes);
    add(f);
  }
  std::string unknown;
  wire::AppendVarintField(&unknown, 100, rng());
  wire::AppendBytesField(&unknown, 101, Random(rng, rng() % 20));
  unknown += std::string("\xB1\x06", 2) + Random(rng, 8);  // field 102, fixed64
  unknown += std::string("\xBD\x06", 2) + Random(rng, 4);  // field 103, fixed32
  add(unknown);
  std::shuffle(fields.begin(), fields.end(), rng);
  std::string message;
  for (const std::string& f : fields) message += f;
  return message;
}

// What ReadGradChunk should give: protobuf's parse, the data and the
// packed chunks apart (each with its data apart), and refused where a packed
// chunk names no tensor or has a field beside tensor, offset, dtype, data
// and unknown ones. (The messages here are far under kMaxUnscannedBytes.)
struct Expected {
  bool ok = false;
  v1::GradChunk head;
  std::string data;
  std::vector<std::pair<v1::GradChunk, std::string>> more;
};
Expected Protobuf(const std::string& bytes) {
  Expected e;
  e.ok = e.head.ParseFromString(bytes);
  e.head.DiscardUnknownFields();  // the reader leaves them out
  e.data = e.head.data();
  e.head.clear_data();
  for (const v1::GradChunk& packed : e.head.more()) {
    v1::GradChunk others = packed;
    others.clear_tensor();
    others.clear_offset();
    others.clear_dtype();
    others.clear_data();
    others.GetReflection()->MutableUnknownFields(&others)->Clear();
    e.ok = e.ok && others.ByteSizeLong() == 0 && !packed.tensor().empty();
    e.more.emplace_back(packed, packed.data());
    e.more.back().first.clear_data();
  }
  e.head.clear_more();
  return e;
}

void ExpectAgrees(const std::string& bytes, std::mt19937_64& rng, const std::string& what) {
  const Expected want = Protobuf(bytes);
  grpc::ByteBuffer message = Sliced(bytes, rng);
  v1::GradChunk head;
  head.set_job("poison");  // must be overwritten
  Pieces data = Pieces::Own("poison");
  std::vector<GradPart> more(1);  // must be replaced
  const absl::Status got = ReadGradChunk(&message, 1 << 20, 1 << 20, &head, &data, &more);
  ASSERT_EQ(got.ok(), want.ok) << what << ": " << got;
  if (!got.ok()) {
    EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << what;
    return;
  }
  google::protobuf::util::MessageDifferencer diff;
  diff.set_repeated_field_comparison(google::protobuf::util::MessageDifferencer::AS_LIST);
  const auto same = [&](const v1::GradChunk& want_head, const std::string& want_data, const v1::GradChunk& got_head,
                        const Pieces& got_pieces) {
    EXPECT_TRUE(diff.Compare(want_head, got_head)) << what << "\nwant " << want_head.ShortDebugString() << "\ngot "
                                                   << got_head.ShortDebugString();
    std::string got_data(got_pieces.size(), '\0');
    got_pieces.CopyTo(got_data.data());
    EXPECT_EQ(got_data, want_data) << what;
  };
  same(want.head, want.data, head, data);
  ASSERT_EQ(more.size(), want.more.size()) << what;
  for (size_t i = 0; i < more.size(); ++i) same(want.more[i].first, want.more[i].second, more[i].head, more[i].data);
}

TEST(GradMessage, WellFormedMessagesReadAsProtobufReadsThem) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2000; ++i) ExpectAgrees(RandomMessage(rng), rng, "message " + std::to_string(i));
}

TEST(GradMessage, BrokenMessagesAreRefusedExactlyWhenProtobufRefusesThem) {
  std::mt19937_64 rng(12);
  int refused = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string bytes = RandomMessage(rng);
    switch (rng() % 4) {
      case 0:  // cut short
        bytes.resize(rng() % (bytes.size() + 1));
        break;
      case 1:  // a byte flipped
        if (!bytes.empty()) bytes[rng() % bytes.size()] ^= static_cast<char>(1 + rng() % 255);
        break;
      case 2:  // garbage inserted
        bytes.insert(rng() % (bytes.size() + 1), Random(rng, 1 + rng() % 4));
        break;
      case 3:  // a group, which the fast path leaves to protobuf
        bytes += std::string("\xA3\x06", 2) + std::string("\xA4\x06", 2);  // field 100: start, end
        break;
    }
    refused += !Protobuf(bytes).ok;
    ExpectAgrees(bytes, rng, "mutation " + std::to_string(i));
  }
  // The mutations must have exercised both answers.
  EXPECT_GT(refused, 500);
  EXPECT_LT(refused, 3500);
}

TEST(GradMessage, TooManyNoGradNamesAreRefusedBeforeTheParse) {
  v1::GradChunk chunk;
  for (int i = 0; i < 5; ++i) chunk.add_no_grad("t" + std::to_string(i));
  std::mt19937_64 rng(13);
  grpc::ByteBuffer message = Sliced(chunk.SerializeAsString(), rng);
  v1::GradChunk head;
  Pieces data;
  std::vector<GradPart> more;
  const absl::Status st = ReadGradChunk(&message, 4, 1 << 20, &head, &data, &more);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("names 5 no_grad tensors"), std::string::npos) << st;
  grpc::ByteBuffer again = Sliced(chunk.SerializeAsString(), rng);
  EXPECT_TRUE(ReadGradChunk(&again, 5, 1 << 20, &head, &data, &more).ok());
  EXPECT_EQ(head.no_grad_size(), 5);
}

// The pieces' runs of whole elements put back together are the bytes, for
// every way of cutting them.
// Varints longer than protobuf reads them: a tag of more than 5 bytes, or a
// length of more than 5 or past 2^31 (found by a differential fuzzer, which
// the scan took for a well-formed message of empty data), and the longest
// that protobuf does read.
TEST(GradMessage, OverlongVarintsAreRefusedExactlyWhenProtobufRefusesThem) {
  std::mt19937_64 rng(15);
  struct Case {
    std::string what, bytes;
    bool protobuf_reads;  // so that the cases hold both answers
  };
  const std::vector<Case> cases = {
      {"data's length 0 in 7 bytes", std::string("\x3a\x80\x80\x80\x80\x80\x80\x00", 8), false},
      {"data's length 1 in 6 bytes", std::string("\x3a\x81\x80\x80\x80\x80\x00x", 8), false},
      {"data's length 1 in 5 bytes", std::string("\x3a\x81\x80\x80\x80\x00x", 7), true},
      {"data's length 2^31 in 5 bytes", std::string("\x3a\x80\x80\x80\x80\x08", 6), false},
      {"job's tag in 6 bytes", std::string("\x8a\x80\x80\x80\x80\x00\x01j", 8), false},
      {"job's tag in 5 bytes", std::string("\x8a\x80\x80\x80\x00\x01j", 7), true},
      {"step's value 1 in 10 bytes", std::string("\x10\x81\x80\x80\x80\x80\x80\x80\x80\x80\x00", 11), true},
      {"step's value 1 in 11 bytes", std::string("\x10\x81\x80\x80\x80\x80\x80\x80\x80\x80\x80\x00", 12), false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Protobuf(c.bytes).ok, c.protobuf_reads) << c.what;
    ExpectAgrees(c.bytes, rng, c.what);
  }
}

// A field 8 that is not length-delimited is no name: protobuf keeps it as an
// unknown field. The cap counts what protobuf would count, so such a message
// is neither refused for them nor let past the cap.
TEST(GradMessage, OnlyNoGradNamesOfTheirWireTypeCountTowardTheirCap) {
  std::string bytes;
  for (int i = 0; i < 5; ++i) wire::AppendVarintField(&bytes, v1::GradChunk::kNoGradFieldNumber, i);
  for (int i = 0; i < 2; ++i) wire::AppendBytesField(&bytes, v1::GradChunk::kNoGradFieldNumber, "t" + std::to_string(i));
  std::mt19937_64 rng(14);
  for (uint64_t cap : {0, 1, 2, 3}) {
    grpc::ByteBuffer message = Sliced(bytes, rng);
    v1::GradChunk head;
    Pieces data;
    std::vector<GradPart> more;
    const absl::Status st = ReadGradChunk(&message, cap, 1 << 20, &head, &data, &more);
    if (cap < 2) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << cap;
      EXPECT_NE(st.message().find("names 2 no_grad tensors"), std::string::npos) << cap << ": " << st;
    } else {
      ASSERT_TRUE(st.ok()) << cap << ": " << st;
      EXPECT_EQ(head.no_grad_size(), 2);
    }
  }
}

// A packed chunk carries tensor, offset, dtype and data: one that also says
// the stream's fields is refused, naming them; unknown fields (a newer
// client's) are let through, as everywhere.
TEST(GradMessage, APackedChunkCarryingMoreThanItsOwnFieldsIsRefusedNamingThem) {
  v1::GradChunk message;
  message.set_tensor("a");
  message.set_data("xx");
  v1::GradChunk* packed = message.add_more();
  packed->set_tensor("b");
  packed->set_offset(4);
  packed->set_dtype(v1::BF16);
  packed->set_data("yy");
  std::string fine = message.SerializeAsString();
  std::string unknown;
  wire::AppendVarintField(&unknown, 100, 7);
  std::string packed_with_unknown = packed->SerializeAsString() + unknown;
  wire::AppendBytesField(&fine, v1::GradChunk::kMoreFieldNumber, packed_with_unknown);
  packed->set_step(3);
  packed->add_no_grad("c");
  std::mt19937_64 rng(16);
  std::vector<GradPart> more;
  const absl::Status st = ReadBytes(message.SerializeAsString(), rng, 10, 10, &more);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("carries only tensor, offset, dtype and data; this one also has step, no_grad"),
            std::string::npos)
      << st;
  ASSERT_TRUE(ReadBytes(fine, rng, 10, 10, &more).ok());
  ASSERT_EQ(more.size(), 2u);
  for (const GradPart& part : more) {
    EXPECT_EQ(part.head.tensor(), "b");
    EXPECT_EQ(part.head.offset(), 4u);
    std::string bytes(part.data.size(), '\0');
    part.data.CopyTo(bytes.data());
    EXPECT_EQ(bytes, "yy");
  }
}

// Every field of GradChunk but tensor, offset, dtype and data, set in a
// packed chunk, is refused naming it: the check lists them one by one, so a
// field added to the message must be added to it, and this finds one that
// is not.
TEST(GradMessage, APackedChunkCarryingAnyOtherFieldIsRefused) {
  const google::protobuf::Descriptor* d = v1::GradChunk::descriptor();
  std::mt19937_64 rng(18);
  int checked = 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->number() == v1::GradChunk::kTensorFieldNumber || f->number() == v1::GradChunk::kOffsetFieldNumber ||
        f->number() == v1::GradChunk::kDtypeFieldNumber || f->number() == v1::GradChunk::kDataFieldNumber) {
      continue;
    }
    v1::GradChunk message;
    message.set_tensor("a");
    message.set_data("xx");
    v1::GradChunk* packed = message.add_more();
    packed->set_tensor("b");
    packed->set_data("yy");
    const google::protobuf::Reflection* r = packed->GetReflection();
    if (f->is_repeated()) {
      if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_STRING) r->AddString(packed, f, "x");
      if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) r->AddMessage(packed, f);
    } else if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_STRING) {
      r->SetString(packed, f, "x");
    } else if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT64) {
      r->SetUInt64(packed, f, 1);
    } else if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT32) {
      r->SetUInt32(packed, f, 1);
    } else if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      r->MutableMessage(packed, f);
    } else {
      ADD_FAILURE() << "a field of a type this test does not set: " << f->name();
      continue;
    }
    std::vector<GradPart> more;
    const absl::Status st = ReadBytes(message.SerializeAsString(), rng, 10, 10, &more);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << f->name();
    EXPECT_NE(st.message().find("this one also has " + f->name()), std::string::npos) << f->name() << ": " << st;
    ++checked;
  }
  EXPECT_EQ(checked, d->field_count() - 4);
}

// Unknown fields are left out before protobuf parses the rest: it keeps
// each in an allocation of its own (an 8 MB message of empty ones took a
// server to 423 MB), and the server reads none. So are those in a
// message-typed field (the intent) and in packed chunks, and a known field
// in another wire type, which protobuf keeps as unknown too. What is known
// is read as protobuf reads it. A message of more fields than it may have
// (its no_grad names, its packed chunks and 256 more), or a packed chunk or
// an intent of more than 256 beside a group lr per tensor, is refused before
// they are all scanned: the scan holds 32 bytes for each 2-byte field.
TEST(GradMessage, UnknownFieldsAreLeftOutUnread) {
  v1::GradChunk message;
  message.set_job("j");
  message.set_step(3);
  message.set_tensor("a");
  message.set_data("xxxx");
  message.mutable_intent()->set_lr(0.5);
  message.mutable_intent()->add_group_lr(0.25);
  v1::GradChunk* packed = message.add_more();
  packed->set_tensor("b");
  packed->set_data("yy");
  std::string bytes = message.SerializeAsString();
  std::string intent = message.intent().SerializeAsString();
  for (int i = 0; i < 200; ++i) wire::AppendBytesField(&intent, 9, "");
  wire::AppendBytesField(&bytes, v1::GradChunk::kIntentFieldNumber, intent);  // merged into the first
  std::string packed_bytes = packed->SerializeAsString();
  for (int i = 0; i < 200; ++i) wire::AppendVarintField(&packed_bytes, 15, i);
  wire::AppendBytesField(&bytes, v1::GradChunk::kMoreFieldNumber, packed_bytes);
  for (int i = 0; i < 200; ++i) wire::AppendBytesField(&bytes, 15, "");
  wire::AppendVarintField(&bytes, v1::GradChunk::kJobFieldNumber, 7);  // a string's number as a varint
  v1::GradChunk want;
  ASSERT_TRUE(want.ParseFromString(bytes));
  ASSERT_GT(want.GetReflection()->GetUnknownFields(want).field_count(), 200);
  std::mt19937_64 rng(19);
  grpc::ByteBuffer buffer = Sliced(bytes, rng);
  v1::GradChunk head;
  Pieces data;
  std::vector<GradPart> more;
  ASSERT_TRUE(ReadGradChunk(&buffer, 10, 10, &head, &data, &more).ok());
  EXPECT_EQ(head.GetReflection()->GetUnknownFields(head).field_count(), 0);
  EXPECT_EQ(head.intent().GetReflection()->GetUnknownFields(head.intent()).field_count(), 0);
  want.DiscardUnknownFields();
  want.clear_data();
  want.clear_more();
  EXPECT_EQ(head.SerializeAsString(), want.SerializeAsString()) << head.ShortDebugString();
  EXPECT_EQ(head.intent().group_lr_size(), 2);
  ASSERT_EQ(more.size(), 2u);
  for (const GradPart& part : more) {
    EXPECT_EQ(part.head.GetReflection()->GetUnknownFields(part.head).field_count(), 0);
    EXPECT_EQ(part.head.tensor(), "b");
  }
  std::string got(data.size(), '\0');
  data.CopyTo(got.data());
  EXPECT_EQ(got, "xxxx");

  // Too many: 10 no_grad names and 10 packed chunks allowed, so 276 fields.
  std::string many = message.SerializeAsString();
  for (int i = 0; i < 300; ++i) wire::AppendBytesField(&many, 15, "");
  const absl::Status st = ReadBytes(many, rng, 10, 10, &more);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a GradChunk message has more than 276 fields"), std::string::npos) << st;
  std::string many_packed = packed->SerializeAsString();
  for (int i = 0; i < 300; ++i) wire::AppendVarintField(&many_packed, 15, i);
  std::string in_packed = message.SerializeAsString();
  wire::AppendBytesField(&in_packed, v1::GradChunk::kMoreFieldNumber, many_packed);
  const absl::Status packed_st = ReadBytes(in_packed, rng, 10, 10, &more);
  EXPECT_NE(packed_st.message().find("a chunk packed in GradChunk.more has more than 256 fields"), std::string::npos)
      << packed_st;
  std::string many_intent = message.intent().SerializeAsString();
  for (int i = 0; i < 300; ++i) wire::AppendBytesField(&many_intent, 9, "");
  std::string in_intent = message.SerializeAsString();
  wire::AppendBytesField(&in_intent, v1::GradChunk::kIntentFieldNumber, many_intent);
  const absl::Status intent_st = ReadBytes(in_intent, rng, 10, 10, &more);
  EXPECT_NE(intent_st.message().find("a message in a GradChunk has more than 266 fields"), std::string::npos)
      << intent_st;
}

// A message that packs more chunks than its job has tensors is refused
// before a chunk is parsed, as one naming too many no_grad tensors: each
// packed chunk costs the server about 200 bytes read, and a message of
// empty ones (2 bytes each) would cost a hundred times its size. So is a
// packed chunk that names no tensor, and a message the fast scan cannot
// read past kMaxUnscannedBytes, which protobuf's parser would read whole,
// every packed chunk allocated, before any could be counted.
TEST(GradMessage, PackedChunksAreCountedBeforeTheyAreParsed) {
  v1::GradChunk message;
  message.set_tensor("a");
  message.set_data("xx");
  for (int i = 0; i < 5; ++i) {
    v1::GradChunk* packed = message.add_more();
    packed->set_tensor("b");
    packed->set_data("yy");
  }
  std::mt19937_64 rng(17);
  std::vector<GradPart> more;
  const absl::Status st = ReadBytes(message.SerializeAsString(), rng, 10, 4, &more);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("packs 5 chunks; a message of this job packs at most 4"), std::string::npos) << st;
  ASSERT_TRUE(ReadBytes(message.SerializeAsString(), rng, 10, 5, &more).ok());
  EXPECT_EQ(more.size(), 5u);

  message.mutable_more(3)->clear_tensor();
  const absl::Status no_name = ReadBytes(message.SerializeAsString(), rng, 10, 10, &more);
  EXPECT_EQ(no_name.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_name.message().find("names no tensor"), std::string::npos) << no_name;

  // A group (which protobuf skips) makes the message one the scan leaves to
  // protobuf: taken under the cap, refused past it.
  const std::string group = std::string("\xA3\x06", 2) + std::string("\xA4\x06", 2);  // field 100: start, end
  v1::GradChunk small;
  small.set_tensor("a");
  small.set_data(std::string(1000, 'x'));
  EXPECT_TRUE(ReadBytes(small.SerializeAsString() + group, rng, 10, 10, &more).ok());
  small.set_data(std::string(kMaxUnscannedBytes, 'x'));
  const std::string over = small.SerializeAsString() + group;
  EXPECT_TRUE(v1::GradChunk().ParseFromString(over));  // protobuf would take it
  const absl::Status big = ReadBytes(over, rng, 10, 10, &more);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("holds a group or a varint longer than protobuf's"), std::string::npos) << big;
}

TEST(GradMessage, PiecesGiveRunsOfWholeElementsAcrossAnyCut) {
  std::mt19937_64 rng(14);
  for (int i = 0; i < 500; ++i) {
    const uint64_t unit = rng() % 2 == 0 ? 2 : 4;
    const std::string bytes = Random(rng, unit * (rng() % 300));
    grpc::ByteBuffer sliced = Sliced(bytes, rng);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(sliced.Dump(&slices).ok());
    std::vector<absl::string_view> views;
    for (const grpc::Slice& s : slices) views.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    const Pieces pieces(views, nullptr);
    const uint64_t from = unit * (rng() % (bytes.size() / unit + 1));
    const uint64_t n = unit * (rng() % ((bytes.size() - from) / unit + 1));
    std::vector<absl::string_view> runs;
    std::string scratch;
    pieces.Sub(from, n).Runs(unit, &runs, &scratch);
    std::string joined;
    for (absl::string_view r : runs) {
      EXPECT_EQ(r.size() % unit, 0u);
      joined.append(r.data(), r.size());
    }
    EXPECT_EQ(joined, bytes.substr(from, n)) << "cut " << i;
  }
}

}  // namespace
}  // namespace shardopt
