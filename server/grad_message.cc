#include "server/grad_message.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "rpc/wire_format.h"

namespace shardopt {
namespace {

absl::Status TooManyNoGrad(uint64_t names, uint64_t allowed) {
  return absl::InvalidArgumentError(absl::StrCat("a push message names ", names,
                                                 " no_grad tensors; this stream may name ", allowed, " more at most"));
}

absl::Status TooManyPacked(uint64_t chunks, uint64_t allowed) {
  return absl::InvalidArgumentError(absl::StrCat("a push message packs ", chunks,
                                                 " chunks; a message of this job packs at most ", allowed,
                                                 ", its number of tensors"));
}

absl::Status DoesNotParse() {
  return absl::InvalidArgumentError("a GradChunk message does not parse; the stream is refused");
}

// A chunk's fields but data into `head` (by protobuf), its data as pieces
// of `bytes` where they lie; with `more`, the packed chunks' bytes into it
// unparsed. False where protobuf refuses the bytes.
bool Split(const Pieces& bytes, const std::vector<wire::Field>& fields, v1::GradChunk* head, Pieces* data,
           std::vector<Pieces>* more) {
  int data_fields = 0;
  for (const wire::Field& f : fields) {
    data_fields += f.number == v1::GradChunk::kDataFieldNumber && f.wire_type == wire::kLengthDelimited;
  }
  // Everything but the data (and the packed chunks) goes to protobuf; a
  // data field sent twice (the last one wins) is rare enough to leave to it
  // whole. A field of the right number but another wire type is neither:
  // protobuf keeps it as an unknown field.
  std::string rest;
  const wire::Field* data_field = nullptr;
  for (const wire::Field& f : fields) {
    if (f.wire_type == wire::kLengthDelimited) {
      if (data_fields == 1 && f.number == v1::GradChunk::kDataFieldNumber) {
        data_field = &f;
        continue;
      }
      if (more != nullptr && f.number == v1::GradChunk::kMoreFieldNumber) {
        more->push_back(bytes.Sub(f.value, f.end - f.value));
        continue;
      }
    }
    const size_t at = rest.size();
    rest.resize(at + (f.end - f.begin));
    bytes.Sub(f.begin, f.end - f.begin).CopyTo(rest.data() + at);
  }
  if (!head->ParseFromString(rest)) return false;
  if (data_field != nullptr) {
    *data = bytes.Sub(data_field->value, data_field->end - data_field->value);
  } else {
    *data = Pieces::Own(std::move(*head->mutable_data()));
    head->clear_data();
  }
  return true;
}

// Malformed, or holding a group: protobuf's parser decides. Rare, so its
// copies of the data do not matter.
bool ParseWhole(const Pieces& bytes, v1::GradChunk* head, Pieces* data) {
  std::string joined(bytes.size(), '\0');
  bytes.CopyTo(joined.data());
  if (!head->ParseFromString(joined)) return false;
  *data = Pieces::Own(std::move(*head->mutable_data()));
  head->clear_data();
  return true;
}

// A packed chunk: tensor, offset, dtype and data, nothing else. The stream's
// fields come in its first message, and a no_grad name or a packed chunk
// inside a packed one would be a second way to say what the message says.
absl::Status CheckPacked(const v1::GradChunk& head) {
  if (head.tensor().empty()) return absl::InvalidArgumentError("a chunk packed in GradChunk.more names no tensor");
  // Field by field, not by reflection, which took a fifth of the server's
  // CPU under a flood of packed chunks (`perf`); a field added to GradChunk
  // must be added here (GradMessage.APackedChunkCarryingAnyOtherFieldIs-
  // Refused walks the descriptor). Unknown fields (what newer clients may
  // add) are let through.
  std::string names;
  const auto other = [&](bool set, const char* name) {
    if (set) absl::StrAppend(&names, names.empty() ? "" : ", ", name);
  };
  other(!head.job().empty(), "job");
  other(head.step() != 0, "step");
  other(head.rank() != 0, "rank");
  other(head.no_grad_size() > 0, "no_grad");
  other(head.incarnation() != 0, "incarnation");
  other(head.trainer() != 0, "trainer");
  other(head.attached_at() != 0, "attached_at");
  other(head.has_intent(), "intent");
  other(head.chunk_bytes() != 0, "chunk_bytes");
  other(head.more_size() > 0, "more");
  if (names.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a chunk packed in GradChunk.more carries only tensor, offset, dtype and data; this one also has ", names));
}

absl::Status ReadPacked(const Pieces& bytes, GradPart* part) {
  std::vector<wire::Field> fields;
  const bool parsed = wire::ScanFields(bytes, &fields) ? Split(bytes, fields, &part->head, &part->data, nullptr)
                                                       : ParseWhole(bytes, &part->head, &part->data);
  if (!parsed) return DoesNotParse();
  return CheckPacked(part->head);
}

}  // namespace

absl::Status ReadGradChunk(grpc::ByteBuffer* message, uint64_t max_no_grad, uint64_t max_packed, v1::GradChunk* head,
                           Pieces* data, std::vector<GradPart>* more) {
  more->clear();
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!message->Dump(slices.get()).ok()) return DoesNotParse();
  message->Clear();
  std::vector<absl::string_view> views;
  for (const grpc::Slice& s : *slices) views.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  const Pieces bytes(std::move(views), slices);

  std::vector<wire::Field> fields;
  if (!wire::ScanFields(bytes, &fields)) {
    if (bytes.size() > kMaxUnscannedBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a GradChunk message of ", bytes.size(), " bytes holds a group or a varint longer than protobuf's; such a "
          "message is read up to ", kMaxUnscannedBytes, " bytes (no client sends one); the stream is refused"));
    }
    if (!ParseWhole(bytes, head, data)) return DoesNotParse();
    if (static_cast<uint64_t>(head->no_grad_size()) > max_no_grad) return TooManyNoGrad(head->no_grad_size(), max_no_grad);
    if (static_cast<uint64_t>(head->more_size()) > max_packed) return TooManyPacked(head->more_size(), max_packed);
    for (v1::GradChunk& packed : *head->mutable_more()) {
      GradPart part;
      part.data = Pieces::Own(std::move(*packed.mutable_data()));
      packed.clear_data();
      part.head = std::move(packed);
      SHARDOPT_RETURN_IF_ERROR(CheckPacked(part.head));
      more->push_back(std::move(part));
    }
    head->clear_more();
    return absl::OkStatus();
  }
  uint64_t names = 0, packed_chunks = 0;
  for (const wire::Field& f : fields) {
    if (f.wire_type != wire::kLengthDelimited) continue;
    names += f.number == v1::GradChunk::kNoGradFieldNumber;
    packed_chunks += f.number == v1::GradChunk::kMoreFieldNumber;
  }
  if (names > max_no_grad) return TooManyNoGrad(names, max_no_grad);
  if (packed_chunks > max_packed) return TooManyPacked(packed_chunks, max_packed);
  std::vector<Pieces> packed;
  if (!Split(bytes, fields, head, data, &packed)) return DoesNotParse();
  more->resize(packed.size());
  for (size_t i = 0; i < packed.size(); ++i) SHARDOPT_RETURN_IF_ERROR(ReadPacked(packed[i], &(*more)[i]));
  return absl::OkStatus();
}

}  // namespace shardopt
