#include "client/wire.h"

#include <cstring>
#include <vector>

#include "shardopt/v1/optimizer.pb.h"

namespace shardopt::wire {

namespace v1 = ::shardopt::v1;

namespace {

constexpr int kVarint = 0;
constexpr int kLengthDelimited = 2;

// Reads a message that gRPC received as several slices, without joining them.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) { Skip(); }

  bool done() const { return index_ == slices_.size(); }

  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t byte;
      if (!Bytes(reinterpret_cast<char*>(&byte), 1)) return false;
      *v |= uint64_t{byte & 0x7Fu} << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Copies the next n bytes to dst (nullptr: skips them).
  bool Bytes(char* dst, uint64_t n) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      const uint64_t take = std::min<uint64_t>(n, s.size() - pos_);
      if (dst != nullptr) {
        std::memcpy(dst, s.begin() + pos_, take);
        dst += take;
      }
      pos_ += take;
      n -= take;
      Skip();
    }
    return true;
  }

 private:
  void Skip() {
    while (index_ < slices_.size() && pos_ == slices_[index_].size()) {
      ++index_;
      pos_ = 0;
    }
  }

  std::vector<grpc::Slice> slices_;
  size_t index_ = 0;
  size_t pos_ = 0;
};

}  // namespace

grpc::ByteBuffer HeadAndBorrowedBytes(const std::string& head, const void* bytes, size_t length) {
  grpc::Slice slices[2] = {grpc::Slice(head), grpc::Slice(bytes, length, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(slices, length > 0 ? 2 : 1);
}

Stream::Stream(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method)
    : call_(stub->PrepareCall(context, method, &queue_)) {
  call_->StartCall(this);
  started_ = Await();
}

Stream::~Stream() {
  if (!finished_) {
    grpc::Status ignored = Finish();
    (void)ignored;
  }
  queue_.Shutdown();
  void* tag;
  bool ok;
  while (queue_.Next(&tag, &ok)) {
  }
}

bool Stream::Await() {
  void* tag;
  bool ok = false;
  return queue_.Next(&tag, &ok) && ok;
}

bool Stream::Write(const grpc::ByteBuffer& message) {
  if (!started_) return false;
  call_->Write(message, this);
  return Await();
}

bool Stream::WritesDone() {
  if (!started_) return false;
  call_->WritesDone(this);
  return Await();
}

bool Stream::Read(grpc::ByteBuffer* message) {
  if (!started_) return false;
  call_->Read(message, this);
  return Await();
}

grpc::Status Stream::Finish() {
  grpc::Status status;
  finished_ = true;
  call_->Finish(&status, this);
  Await();
  return status;
}

std::string GradChunkHead(absl::string_view tensor, uint64_t offset, int dtype, uint64_t data_bytes) {
  std::string head;
  AppendBytesField(&head, v1::GradChunk::kTensorFieldNumber, tensor);
  AppendVarintField(&head, v1::GradChunk::kOffsetFieldNumber, offset);
  AppendVarintField(&head, v1::GradChunk::kDtypeFieldNumber, static_cast<uint64_t>(dtype));
  AppendBytesHeader(&head, v1::GradChunk::kDataFieldNumber, data_bytes);
  return head;
}

bool ReadParamChunk(grpc::ByteBuffer* message, absl::FunctionRef<char*(const ParamChunkHead&)> place,
                    ParamChunkHead* head) {
  std::vector<grpc::Slice> slices;
  if (!message->Dump(&slices).ok()) return false;
  SliceReader in(std::move(slices));
  *head = ParamChunkHead{};
  bool placed = false;
  while (!in.done()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return false;
    const int field = static_cast<int>(tag >> 3);
    const int type = static_cast<int>(tag & 7);
    if (type == kVarint) {
      uint64_t v;
      if (!in.Varint(&v)) return false;
      if (field == v1::ParamChunk::kOffsetFieldNumber) head->offset = v;
      if (field == v1::ParamChunk::kStepFieldNumber) head->step = v;
      if (field == v1::ParamChunk::kDtypeFieldNumber) head->dtype = v;
    } else if (type == kLengthDelimited) {
      uint64_t n;
      if (!in.Varint(&n)) return false;
      if (field == v1::ParamChunk::kTensorFieldNumber) {
        head->tensor.resize(n);
        if (!in.Bytes(head->tensor.data(), n)) return false;
      } else if (field == v1::ParamChunk::kDataFieldNumber) {
        // Protobuf writes fields in number order, so tensor and offset are
        // known by now; the step and dtype come after, for the caller to check.
        head->data_bytes = n;
        char* dst = place(*head);
        if (dst == nullptr || !in.Bytes(dst, n)) return false;
        placed = true;
      } else if (!in.Bytes(nullptr, n)) {
        return false;
      }
    } else {
      return false;
    }
  }
  return placed;
}

}  // namespace shardopt::wire
