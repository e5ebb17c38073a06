#include "client/push_messages.h"

#include <algorithm>
#include <utility>

namespace shardopt {

wire::StreamCall::Ready PushMessages::Next(grpc::ByteBuffer* out) {
  using Ready = wire::StreamCall::Ready;
  if (!head_sent_) {
    head_sent_ = true;
    *out = wire::HeadAndBorrowedBytes(head_.SerializeAsString(), nullptr, 0);
    return Ready::kMessage;
  }
  while (off_ == end_ && next_send_ < sends_.size()) {
    if (!asked_) {
      if (!ready_ || !ready_(sends_[next_send_].grad_index)) return Ready::kLater;
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
  if (off_ < end_) {
    const uint64_t esize = sending_->dtype == v1::FP32 ? 4 : 2;
    const uint64_t n = std::min(std::max<uint64_t>(1, chunk_bytes_ / esize), end_ - off_);
    *out = wire::HeadAndBorrowedBytes(wire::GradChunkHead(sending_->tensor, off_, sending_->dtype, n * esize),
                                      data_ + off_ * esize, n * esize);
    off_ += n;
    return Ready::kMessage;
  }
  if (!absent_sent_ && absent_.no_grad_size() > 0) {
    absent_sent_ = true;
    *out = wire::HeadAndBorrowedBytes(absent_.SerializeAsString(), nullptr, 0);
    return Ready::kMessage;
  }
  return Ready::kEnd;
}

void PushMessages::Wait() { asked_ = static_cast<const char*>(grad_(sends_[next_send_].grad_index)); }

}  // namespace shardopt
