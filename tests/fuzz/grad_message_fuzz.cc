// A differential fuzzer of the server's push-message reader: whatever the
// bytes, and however they are cut into slices, ReadGradChunk must refuse
// exactly what protobuf's parser refuses (or what names more no_grad
// tensors or packs more chunks than allowed, or packs a chunk without a
// tensor or with a field beside tensor, offset, dtype and data), and read
// what it accepts as protobuf does: the same
// fields, and the same data bytes, of the message's chunk and of each chunk
// packed in it. tests/fuzz/run_fuzz.cmake builds it with clang's libFuzzer
// and runs it for a bounded time.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/grad_message.h"
#include "shardopt/v1/optimizer.pb.h"

namespace {

[[noreturn]] void Disagree(const char* what, const std::string& detail) {
  std::fprintf(stderr, "ReadGradChunk and protobuf disagree: %s %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

// The first byte picks how many cuts, the second the caps on no_grad names
// and packed chunks; the rest is the message, cut where its own bytes say.
// (run_fuzz.cmake's inputs are far under kMaxUnscannedBytes, past which a
// message the scan cannot read is refused whatever protobuf says; and 512
// bytes hold at most 256 fields, under the 256 beside no_grad names and
// packed chunks past which a message is refused too.)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const unsigned cuts = data[0] % 5;
  const uint64_t max_no_grad = data[1] % 4;
  const uint64_t max_packed = data[1] / 4 % 4;
  const std::string whole(reinterpret_cast<const char*>(data + 2), size - 2);
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (unsigned c = 0; c < cuts && at < whole.size(); ++c) {
    const size_t n = (static_cast<uint8_t>(whole[at]) & 0x7f) % (whole.size() - at + 1);
    slices.emplace_back(whole.data() + at, n);
    at += n;
  }
  slices.emplace_back(whole.data() + at, whole.size() - at);
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  shardopt::v1::GradChunk head;
  shardopt::Pieces got;
  std::vector<shardopt::GradPart> more;
  const absl::Status st = shardopt::ReadGradChunk(&buffer, max_no_grad, max_packed, &head, &got, &more);

  shardopt::v1::GradChunk want;
  const bool parses = want.ParseFromString(whole);
  want.DiscardUnknownFields();  // the reader leaves them out
  bool allowed = parses && static_cast<uint64_t>(want.no_grad_size()) <= max_no_grad &&
                 static_cast<uint64_t>(want.more_size()) <= max_packed;
  for (const shardopt::v1::GradChunk& packed : want.more()) {
    shardopt::v1::GradChunk others = packed;
    others.clear_tensor();
    others.clear_offset();
    others.clear_dtype();
    others.clear_data();
    others.GetReflection()->MutableUnknownFields(&others)->Clear();
    allowed = allowed && others.ByteSizeLong() == 0 && !packed.tensor().empty();
  }
  if (st.ok() != allowed) Disagree(parses ? "(protobuf parses it)" : "(protobuf refuses it)", st.ToString());
  if (!st.ok()) return 0;
  const auto same = [](shardopt::v1::GradChunk want_head, const shardopt::v1::GradChunk& got_head,
                       const shardopt::Pieces& got_data) {
    std::string data(got_data.size(), '\0');
    got_data.CopyTo(data.data());
    if (data != want_head.data()) Disagree("on the data", "");
    want_head.clear_data();
    if (got_head.SerializeAsString() != want_head.SerializeAsString()) {
      Disagree("on the fields", got_head.ShortDebugString());
    }
  };
  if (more.size() != static_cast<size_t>(want.more_size())) Disagree("on the packed chunks", "");
  for (size_t i = 0; i < more.size(); ++i) same(want.more(static_cast<int>(i)), more[i].head, more[i].data);
  want.clear_more();
  same(want, head, got);
  return 0;
}
