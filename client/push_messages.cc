#include "client/push_messages.h"

#include <algorithm>
#include <utility>

#include "rpc/chunk_size.h"
#include "rpc/wire_format.h"

namespace shardopt {

wire::StreamCall::Ready PushMessages::Next(grpc::ByteBuffer* out) {
  using Ready = wire::StreamCall::Ready;
  if (!head_sent_) {
    head_sent_ = true;
    *out = wire::HeadAndBorrowedBytes(head_.SerializeAsString(), nullptr, 0);
    return Ready::kMessage;
  }
  if (!Advance()) return Ready::kLater;
  if (off_ < end_) {
    std::vector<grpc::Slice> slices;
    uint64_t used = AddChunk(std::max<uint64_t>(1, chunk_bytes_ / ElementBytes()), /*packed=*/false, &slices);
    // Whole tensors after it, while they fit and are there: one that does
    // not fit, or whose gradient is not known yet, starts the next message.
    // At most as many as keep the server's charge for them (what reading
    // them costs it) within chunk_bytes.
    const uint64_t most_packed = chunk_bytes_ / kPackedChunkCharge;
    uint64_t packed = 0;
    while (pack_ && packed < most_packed && off_ == end_ && used < chunk_bytes_ && Advance() && off_ < end_) {
      if ((end_ - off_) * ElementBytes() + sending_->tensor.size() + kMostFieldBytes > chunk_bytes_ - used) break;
      used += AddChunk(end_ - off_, /*packed=*/true, &slices);
      ++packed;
    }
    *out = grpc::ByteBuffer(slices.data(), slices.size());
    return Ready::kMessage;
  }
  if (!absent_sent_ && absent_.no_grad_size() > 0) {
    absent_sent_ = true;
    *out = wire::HeadAndBorrowedBytes(absent_.SerializeAsString(), nullptr, 0);
    return Ready::kMessage;
  }
  return Ready::kEnd;
}

bool PushMessages::Advance() {
  while (off_ == end_ && next_send_ < sends_.size()) {
    if (!asked_) {
      if (!ready_ || !ready_(sends_[next_send_].grad_index)) return false;
      Wait();
    }
    const Send& s = sends_[next_send_++];
    const char* data = *std::exchange(asked_, std::nullopt);
    if (data == nullptr) {
      absent_.add_no_grad(s.tensor);
      continue;
    }
    sending_ = &s;
    data_ = data;
    off_ = s.offset;
    end_ = s.offset + s.length;
  }
  return true;
}

uint64_t PushMessages::AddChunk(uint64_t elements, bool packed, std::vector<grpc::Slice>* slices) {
  const uint64_t esize = ElementBytes();
  const uint64_t n = std::min(elements, end_ - off_);
  std::string head = wire::GradChunkHead(sending_->tensor, off_, sending_->dtype, n * esize);
  if (packed) {
    std::string tag;
    wire::AppendBytesHeader(&tag, v1::GradChunk::kMoreFieldNumber, head.size() + n * esize);
    head.insert(0, tag);
  }
  const uint64_t bytes = head.size() + n * esize;
  slices->emplace_back(head);
  slices->emplace_back(data_ + off_ * esize, n * esize, grpc::Slice::STATIC_SLICE);
  off_ += n;
  return bytes;
}

void PushMessages::Wait() { asked_ = static_cast<const char*>(grad_(sends_[next_send_].grad_index)); }

}  // namespace shardopt
