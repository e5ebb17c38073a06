// The messages of one server's push stream, in order: the head (job, step,
// rank and the tensors declared without a gradient up front), each tensor's
// chunks as slices over the caller's gradient (no copy), and, if some
// gradient turned out to be absent, a last message naming those tensors.
// It drives a wire::StreamCall: Next makes the messages on gRPC's thread
// without blocking, and when the next tensor's gradient is not known yet it
// answers kLater; Wait then asks for it on the caller's thread, where the
// caller's callback may block until backward produces it. A gradient that
// `ready` says is there (all of them, where the gradients are given) is
// asked for in Next, on gRPC's thread, instead: the hop to the caller's
// thread and back cost about 60 µs a tensor, most of a push of many small
// ones. Each gradient is asked for once per stream.
//
// To a server that takes them (`pack`: CreateJobResponse.takes_packed_grads)
// a message that ends a tensor carries the next tensors whole too, as
// GradChunk.more, while they fit in chunk_bytes and their gradients are
// there without waiting: a message costs about 20 µs of CPU whatever its
// size, so a job of many small tensors would otherwise pay one per tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "client/wire.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

class PushMessages {
 public:
  // One tensor's range on this server, in the order it is sent.
  struct Send {
    std::string tensor;
    uint64_t offset = 0;  // in the tensor, elements
    uint64_t length = 0;
    v1::DType dtype = v1::BF16;  // of its gradient
    size_t grad_index = 0;       // what `grad` is asked with
  };
  // `grad(i)` gives Send::grad_index i's gradient (the whole tensor's), or
  // null when it has none this step; the gradient must outlive the stream.
  // `ready(i)`, where not null, says without blocking that grad(i) will not
  // block.
  PushMessages(v1::GradChunk head, std::vector<Send> sends, uint64_t chunk_bytes, bool pack,
               const std::function<const void*(size_t)>& grad, const std::function<bool(size_t)>& ready)
      : head_(std::move(head)), sends_(std::move(sends)), chunk_bytes_(chunk_bytes), pack_(pack), grad_(grad),
        ready_(ready) {}

  wire::StreamCall::Ready Next(grpc::ByteBuffer* out);
  void Wait();

 private:
  // Once the tensor being sent is done, moves on to the next one with a
  // gradient; false when that gradient must be asked for on the caller's
  // thread first (Wait).
  bool Advance();
  // The next chunk of the tensor being sent, at most `elements` of it, as a
  // head and a slice over its gradient; `packed`: as a GradChunk.more.
  // Returns the bytes it adds to the message.
  uint64_t AddChunk(uint64_t elements, bool packed, std::vector<grpc::Slice>* slices);
  uint64_t ElementBytes() const { return sending_->dtype == v1::FP32 ? 4 : 2; }
  // A packed chunk's fields but its name and data take at most this many
  // bytes (tags, lengths, offset, dtype, and its tag in `more`).
  static constexpr uint64_t kMostFieldBytes = 32;

  const v1::GradChunk head_;
  const std::vector<Send> sends_;
  const uint64_t chunk_bytes_;
  const bool pack_;
  const std::function<const void*(size_t)>& grad_;
  const std::function<bool(size_t)>& ready_;
  bool head_sent_ = false;
  size_t next_send_ = 0;             // in sends_: the next tensor to start
  std::optional<const char*> asked_;  // sends_[next_send_]'s gradient, once Wait asked for it
  const Send* sending_ = nullptr;    // the tensor whose chunks go out now
  const char* data_ = nullptr;       // its gradient
  uint64_t off_ = 0, end_ = 0;       // what of it is left to send
  v1::GradChunk absent_;             // tensors whose gradient turned out to be absent
  bool absent_sent_ = false;
};

}  // namespace shardopt
