// The bulk paths of Push and Commit without protobuf's copies of `bytes`
// fields (docs/design.md, section 10.2: 6 user-space copies per round trip
// against 1). The wire format is the same shardopt.v1 messages; only the
// client builds and reads them by hand, so a gradient chunk goes out as a
// slice over the caller's buffer and a params chunk is copied once, into the
// caller's buffer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "rpc/wire_format.h"  // AppendVarintField and the rest

namespace shardopt::wire {


// `head` copied, then `bytes` referenced in place: it must outlive the call.
grpc::ByteBuffer HeadAndBorrowedBytes(const std::string& head, const void* bytes, size_t length);

// A GradChunk's tensor, offset, dtype (a v1::DType) and data header, for
// HeadAndBorrowedBytes: the fields after the stream's first message.
std::string GradChunkHead(absl::string_view tensor, uint64_t offset, int dtype, uint64_t data_bytes);

// One streaming call through the generic stub, driven to completion op by op
// on a private queue, so it reads like a synchronous stream.
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

// The fields of a params chunk (shardopt.v1.ParamChunk) but its data.
struct ParamChunkHead {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t step = 0;
  uint64_t dtype = 0;  // a v1::DType; unspecified means BF16
  uint64_t data_bytes = 0;
};

// Reads a params chunk straight out of the received slices into the place
// `place(head)` returns for its data (nullptr refuses the chunk); `place`
// sees the tensor, offset and data size, and `head` has the step once this
// returns. False for a malformed message or a refused chunk.
bool ReadParamChunk(grpc::ByteBuffer* message, absl::FunctionRef<char*(const ParamChunkHead&)> place,
                    ParamChunkHead* head);

}  // namespace shardopt::wire
