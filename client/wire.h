// The bulk paths of Push, Commit, Read and Init without protobuf's copies of `bytes`
// fields (docs/design.md, section 10.2: 6 user-space copies per round trip
// against 1). The wire format is the same shardopt.v1 messages; only the
// client builds and reads them by hand, so a gradient chunk goes out as a
// slice over the caller's buffer and a params chunk is copied once, into the
// caller's buffer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "rpc/wire_format.h"  // AppendVarintField and the rest

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace shardopt::wire {

// `head` copied, then `bytes` referenced in place: it must outlive the call.
grpc::ByteBuffer HeadAndBorrowedBytes(const std::string& head, const void* bytes, size_t length);

// A GradChunk's tensor, offset, dtype (a v1::DType) and data header, for
// HeadAndBorrowedBytes: the fields after the stream's first message.
std::string GradChunkHead(absl::string_view tensor, uint64_t offset, int dtype, uint64_t data_bytes);

// One streaming call through the generic stub on gRPC's callback API, for
// the bulk paths: each message to send is made as soon as the last one is
// written, and each message received is taken, on gRPC's own threads, so no
// message waits for a hop to the caller's thread. (Driving the call op by op
// from the caller's thread, as Stream below does, cost one rank's step on 2
// cores five times the context switches and 10-20% of its time.) Run blocks
// the caller until the call ends; only what may block runs on its thread.
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  enum class Ready {
    kMessage,  // the next message is in `out`
    kEnd,      // nothing more to send: the call half-closes
    kLater,    // the next message needs `wait` first (it may block)
  };
  // Makes the next message to send without blocking. Called on one side at
  // a time: gRPC's thread after a write, or the caller's after `wait`.
  using Next = absl::FunctionRef<Ready(grpc::ByteBuffer* out)>;
  // What may block before the next message can be made (a gradient that
  // backward has not produced yet); run on the caller's thread.
  using Wait = absl::FunctionRef<void()>;
  // Takes a received message; an error cancels the call, which then ends
  // with that error. Called for one message at a time, in order.
  using Received = absl::FunctionRef<grpc::Status(grpc::ByteBuffer* message)>;

  // Runs `method` on `context` to its end.
  static grpc::Status Run(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method,
                          Next next, Wait wait, Received received);

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  StreamCall(grpc::ClientContext* context, Next next, Wait wait, Received received)
      : context_(context), next_(next), wait_(wait), received_(received) {}
  // Starts the next write from the caller's thread, which holds the call
  // open (a hold) until it has.
  void WriteFromCaller();

  grpc::ClientContext* const context_;
  const Next next_;
  const Wait wait_;
  const Received received_;
  grpc::ByteBuffer out_;
  grpc::ByteBuffer in_;
  grpc::Status refused_;  // the first error of `received`: written by the read side before OnDone
  std::mutex mu_;
  std::condition_variable cv_;
  bool later_ = false;  // the write side waits for the caller's `wait`
  bool done_ = false;
  grpc::Status status_;
};

// StreamCall's Next for a call of one request, then the half-close: a
// server-streaming method (Commit, Read) through the generic stub.
class SendOnce {
 public:
  explicit SendOnce(std::string request) : request_(std::move(request)) {}
  StreamCall::Ready operator()(grpc::ByteBuffer* out) const;

 private:
  const std::string request_;
  mutable bool sent_ = false;  // absl::FunctionRef calls it as const
};

// StreamCall's Received for the one answer of a client-streaming call
// (Push, Init), parsed into `answer`: a second answer, or one that does not
// parse, is INTERNAL. `what` names the call in those errors.
class OneAnswer {
 public:
  OneAnswer(google::protobuf::Message* answer, std::string what) : answer_(answer), what_(std::move(what)) {}
  grpc::Status operator()(grpc::ByteBuffer* message) const;
  // The call's status; an OK one without the answer is INTERNAL, as the
  // typed writer's Finish made it.
  grpc::Status Ended(const grpc::Status& call) const;

 private:
  google::protobuf::Message* const answer_;
  const std::string what_;
  mutable int answers_ = 0;  // absl::FunctionRef calls it as const
};

// One streaming call through the generic stub, driven to completion op by op
// on a private queue, so it reads like a synchronous stream: for tests and
// tools that send messages one at a time, where a hop per message costs
// nothing that matters.
class Stream {
 public:
  Stream(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  bool Write(const grpc::ByteBuffer& message);
  bool WritesDone();
  bool Read(grpc::ByteBuffer* message);
  grpc::Status Finish();

 private:
  bool Await();

  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
};

// The fields of a chunk of a tensor's elements (shardopt.v1.ParamChunk, a
// commit's params, or StateChunk, a read's state) but its data.
struct ChunkHead {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t step = 0;
  uint64_t dtype = 0;  // a v1::DType; unspecified means BF16 in a ParamChunk
  uint64_t data_bytes = 0;
};

// Which field number each of those has: the two messages number them apart.
struct ChunkFields {
  int tensor, offset, data, step, dtype;  // as protobuf numbers them
  int more;  // the chunks packed after this one (ParamChunk.more); 0: none
};
extern const ChunkFields kParamChunk;
extern const ChunkFields kStateChunk;

// Reads a message's chunks (`fields` say which message: the chunk itself,
// then those packed in it as `more`, in order) straight out of the received
// slices into the place `place(head)` returns for each one's data (nullptr
// refuses the chunk); `place` sees every field (of the data, its size), so
// it can refuse a chunk before a byte of it is written. False for a
// malformed message (a packed chunk with `more` of its own included) or a
// refused chunk; the chunks before it are written.
bool ReadChunks(grpc::ByteBuffer* message, const ChunkFields& fields,
                absl::FunctionRef<char*(const ChunkHead&)> place);

}  // namespace shardopt::wire
