#include "server/grad_message.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/wire_format.h"

namespace shardopt {
namespace {

absl::Status TooManyNoGrad(uint64_t names, uint64_t allowed) {
  return absl::InvalidArgumentError(absl::StrCat("a push message names ", names,
                                                 " no_grad tensors; this stream may name ", allowed, " more at most"));
}

absl::Status DoesNotParse() {
  return absl::InvalidArgumentError("a GradChunk message does not parse; the stream is refused");
}

}  // namespace

absl::Status ReadGradChunk(grpc::ByteBuffer* message, uint64_t max_no_grad, v1::GradChunk* head, Pieces* data) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!message->Dump(slices.get()).ok()) return DoesNotParse();
  message->Clear();
  std::vector<absl::string_view> views;
  for (const grpc::Slice& s : *slices) views.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  const Pieces bytes(std::move(views), slices);

  std::vector<wire::Field> fields;
  if (!wire::ScanFields(bytes, &fields)) {
    // Malformed, or holding a group: protobuf's parser decides. Rare, so its
    // copy of the data does not matter.
    std::string joined(bytes.size(), '\0');
    bytes.CopyTo(joined.data());
    if (!head->ParseFromString(joined)) return DoesNotParse();
    if (static_cast<uint64_t>(head->no_grad_size()) > max_no_grad) return TooManyNoGrad(head->no_grad_size(), max_no_grad);
    *data = Pieces::Own(std::move(*head->mutable_data()));
    head->clear_data();
    return absl::OkStatus();
  }
  uint64_t names = 0;
  int data_fields = 0;
  // A field of the right number but another wire type is no name and no
  // data: protobuf keeps it as an unknown field.
  for (const wire::Field& f : fields) {
    if (f.wire_type != wire::kLengthDelimited) continue;
    if (f.number == v1::GradChunk::kNoGradFieldNumber) ++names;
    if (f.number == v1::GradChunk::kDataFieldNumber) ++data_fields;
  }
  if (names > max_no_grad) return TooManyNoGrad(names, max_no_grad);
  // Everything but the data goes to protobuf; a data field sent twice (the
  // last one wins) is rare enough to leave to it whole.
  std::string rest;
  const wire::Field* data_field = nullptr;
  for (const wire::Field& f : fields) {
    if (data_fields == 1 && f.number == v1::GradChunk::kDataFieldNumber && f.wire_type == wire::kLengthDelimited) {
      data_field = &f;
      continue;
    }
    const size_t at = rest.size();
    rest.resize(at + (f.end - f.begin));
    bytes.Sub(f.begin, f.end - f.begin).CopyTo(rest.data() + at);
  }
  if (!head->ParseFromString(rest)) return DoesNotParse();
  if (data_field != nullptr) {
    *data = bytes.Sub(data_field->value, data_field->end - data_field->value);
  } else {
    *data = Pieces::Own(std::move(*head->mutable_data()));
    head->clear_data();
  }
  return absl::OkStatus();
}

}  // namespace shardopt
