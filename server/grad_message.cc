#include "server/grad_message.h"

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "rpc/wire_format.h"

namespace shardopt {
namespace {

// `past`: the scan stopped at the message's most fields, `names` of them
// names, so it names more.
absl::Status TooManyNoGrad(uint64_t names, uint64_t allowed, bool past = false) {
  return absl::InvalidArgumentError(absl::StrCat("a push message names ", past ? "more than " : "", names,
                                                 " no_grad tensors; this stream may name ", allowed, " more at most"));
}

absl::Status TooManyPacked(uint64_t chunks, uint64_t allowed, bool past = false) {
  return absl::InvalidArgumentError(absl::StrCat("a push message packs ", past ? "more than " : "", chunks,
                                                 " chunks; a message of this job packs at most ", allowed,
                                                 ", its number of tensors"));
}

absl::Status DoesNotParse() {
  return absl::InvalidArgumentError("a GradChunk message does not parse; the stream is refused");
}

// Fields beside no_grad names and packed chunks a message may have (a
// client sends about ten), and a packed chunk or the intent (beside one
// group lr per group) may have: a field is 2 bytes on the wire and 32 in
// the scan.
constexpr uint64_t kMostOtherFields = 256;

absl::Status TooManyFields(const char* what, uint64_t most) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has more than ", most, " fields; the stream is refused"));
}

absl::Status TooLargeUnscanned(uint64_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat(
      "a GradChunk message, or a message in it, of ", bytes, " bytes holds a group or a varint longer than "
      "protobuf's; such a message is read up to ", kMaxUnscannedBytes, " bytes (no client sends one); the stream is "
      "refused"));
}

// GradChunk's field numbered `number`, or null: by table, since every
// field of every packed chunk asks.
const google::protobuf::FieldDescriptor* GradChunkField(int number) {
  static const auto* const table = [] {
    auto* t = new std::array<const google::protobuf::FieldDescriptor*, 32>{};
    const google::protobuf::Descriptor* d = v1::GradChunk::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      if (d->field(i)->number() < 32) (*t)[d->field(i)->number()] = d->field(i);
    }
    return t;
  }();
  return number > 0 && number < 32 ? (*table)[number] : v1::GradChunk::descriptor()->FindFieldByNumber(number);
}

// Whether protobuf keeps a field that comes in wire type `wire` as field `f`
// (null: no such field), rather than among the message's unknown fields.
bool Stored(const google::protobuf::FieldDescriptor* f, int wire) {
  using FD = google::protobuf::FieldDescriptor;
  if (f == nullptr) return false;
  int want = 0;  // the varints
  switch (f->type()) {
    case FD::TYPE_STRING:
    case FD::TYPE_BYTES:
    case FD::TYPE_MESSAGE: want = wire::kLengthDelimited; break;
    case FD::TYPE_DOUBLE:
    case FD::TYPE_FIXED64:
    case FD::TYPE_SFIXED64: want = 1; break;
    case FD::TYPE_FLOAT:
    case FD::TYPE_FIXED32:
    case FD::TYPE_SFIXED32: want = 5; break;
    case FD::TYPE_GROUP: return false;
    default: break;
  }
  return wire == want || (f->is_packable() && wire == wire::kLengthDelimited);
}

// Appends `f` of `bytes` to `out` as protobuf would keep it: nothing where
// it would be an unknown field, and a message-typed field with its own
// unknown fields left out likewise (StripUnknown). Protobuf keeps each
// unknown field in an allocation of its own, 30 to 50 times its bytes on
// the wire: an 8 MB message of empty unknown fields took a server to
// 423 MB, charged 8 MB. The server reads none of them.
// `most`: the fields a message-typed field may have. `*whole`: a message in
// it was copied whole, the scan unable to read it.
absl::Status AppendStored(const Pieces& bytes, const wire::Field& f, const google::protobuf::FieldDescriptor* field,
                          uint64_t most, std::string* out, bool* whole);

absl::Status StripUnknown(const Pieces& bytes, const google::protobuf::Descriptor* d, uint64_t most, std::string* out,
                          bool* whole) {
  std::vector<wire::Field> fields;
  bool too_many = false;
  if (!wire::ScanFields(bytes, &fields, most, &too_many)) {
    if (too_many) return TooManyFields("a message in a GradChunk", most);
    // Protobuf's parser decides, within the same bound as a whole message;
    // what it keeps unknown is discarded after (Split).
    if (bytes.size() > kMaxUnscannedBytes) return TooLargeUnscanned(bytes.size());
    *whole = true;
    const size_t at = out->size();
    out->resize(at + bytes.size());
    bytes.CopyTo(out->data() + at);
    return absl::OkStatus();
  }
  for (const wire::Field& f : fields) {
    SHARDOPT_RETURN_IF_ERROR(AppendStored(bytes, f, d->FindFieldByNumber(f.number), most, out, whole));
  }
  return absl::OkStatus();
}

absl::Status AppendStored(const Pieces& bytes, const wire::Field& f, const google::protobuf::FieldDescriptor* field,
                          uint64_t most, std::string* out, bool* whole) {
  if (!Stored(field, f.wire_type)) return absl::OkStatus();
  if (field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
    std::string inner;
    SHARDOPT_RETURN_IF_ERROR(
        StripUnknown(bytes.Sub(f.value, f.end - f.value), field->message_type(), most, &inner, whole));
    wire::AppendBytesField(out, f.number, inner);
    return absl::OkStatus();
  }
  const size_t at = out->size();
  out->resize(at + (f.end - f.begin));
  bytes.Sub(f.begin, f.end - f.begin).CopyTo(out->data() + at);
  return absl::OkStatus();
}

// A chunk's fields but data into `head` (by protobuf, unknown fields left
// out), its data as pieces of `bytes` where they lie; with `more`, the
// packed chunks' bytes into it unparsed. `most`: the fields a
// message-typed field in it may have.
absl::Status Split(const Pieces& bytes, const std::vector<wire::Field>& fields, uint64_t most, v1::GradChunk* head,
                   Pieces* data, std::vector<Pieces>* more) {
  int data_fields = 0;
  for (const wire::Field& f : fields) {
    data_fields += f.number == v1::GradChunk::kDataFieldNumber && f.wire_type == wire::kLengthDelimited;
  }
  // Everything but the data (and the packed chunks) goes to protobuf; a
  // data field sent twice (the last one wins) is rare enough to leave to it
  // whole. A field of the right number but another wire type is neither:
  // protobuf would keep it as an unknown field.
  std::string rest;
  bool whole = false;
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
    SHARDOPT_RETURN_IF_ERROR(AppendStored(bytes, f, GradChunkField(f.number), most, &rest, &whole));
  }
  if (!head->ParseFromString(rest)) return DoesNotParse();
  if (whole) head->DiscardUnknownFields();
  if (data_field != nullptr) {
    *data = bytes.Sub(data_field->value, data_field->end - data_field->value);
  } else {
    *data = Pieces::Own(std::move(*head->mutable_data()));
    head->clear_data();
  }
  return absl::OkStatus();
}

// Malformed, or holding a group: protobuf's parser decides. Rare, so its
// copies of the data do not matter.
bool ParseWhole(const Pieces& bytes, v1::GradChunk* head, Pieces* data) {
  std::string joined(bytes.size(), '\0');
  bytes.CopyTo(joined.data());
  if (!head->ParseFromString(joined)) return false;
  head->DiscardUnknownFields();  // as Split leaves them out: the server reads none
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
  bool too_many = false;
  if (wire::ScanFields(bytes, &fields, kMostOtherFields, &too_many)) {
    SHARDOPT_RETURN_IF_ERROR(Split(bytes, fields, kMostOtherFields, &part->head, &part->data, nullptr));
  } else if (too_many) {
    return TooManyFields("a chunk packed in GradChunk.more", kMostOtherFields);
  } else {
    if (bytes.size() > kMaxUnscannedBytes) return TooLargeUnscanned(bytes.size());
    if (!ParseWhole(bytes, &part->head, &part->data)) return DoesNotParse();
  }
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

  // The fields the message may have: its no_grad names, its packed chunks,
  // and the few others; each costs the scan 32 bytes.
  const uint64_t most = std::min<uint64_t>(max_no_grad, kMaxUnscannedBytes) +
                        std::min<uint64_t>(max_packed, kMaxUnscannedBytes) + kMostOtherFields;
  std::vector<wire::Field> fields;
  bool too_many = false;
  const bool scanned = wire::ScanFields(bytes, &fields, most, &too_many);
  uint64_t names = 0, packed_chunks = 0;
  for (const wire::Field& f : fields) {
    if (f.wire_type != wire::kLengthDelimited) continue;
    names += f.number == v1::GradChunk::kNoGradFieldNumber;
    packed_chunks += f.number == v1::GradChunk::kMoreFieldNumber;
  }
  if (names > max_no_grad) return TooManyNoGrad(names, max_no_grad, too_many);
  if (packed_chunks > max_packed) return TooManyPacked(packed_chunks, max_packed, too_many);
  if (too_many) return TooManyFields("a GradChunk message", most);
  if (!scanned) {
    if (bytes.size() > kMaxUnscannedBytes) return TooLargeUnscanned(bytes.size());
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
  std::vector<Pieces> packed;
  // The intent holds a group lr per group, and a job has at most as many
  // groups as tensors.
  SHARDOPT_RETURN_IF_ERROR(
      Split(bytes, fields, std::min<uint64_t>(max_packed, kMaxUnscannedBytes) + kMostOtherFields, head, data, &packed));
  more->resize(packed.size());
  for (size_t i = 0; i < packed.size(); ++i) SHARDOPT_RETURN_IF_ERROR(ReadPacked(packed[i], &(*more)[i]));
  return absl::OkStatus();
}

}  // namespace shardopt
