// The Commit RPC on gRPC's callback API, with raw messages: each params
// piece goes out as slices over the memory it lies in (ParamStream::Piece),
// with the ParamChunk's other fields hand-encoded around it
// (rpc/wire_format.h), so the params are not copied on their way out. The
// next message's pieces are applied while gRPC sends the one before, and
// written once that write is done: one write outstanding, as gRPC's flow
// control asks of a writer, and at most one message applied ahead (and a
// piece that did not fit it). A message is one piece; for a caller that
// reads ParamChunk.more (CommitRequest.pack), the pieces that follow while
// they fit in JobStore::packed_message_bytes: a message costs about 20 µs
// of CPU whatever its size, so a job of many small tensors would otherwise
// pay one per tensor.
#pragma once

#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/stream_limits.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Commit call; gRPC owns it until its OnDone.
// `caller` must be allowed to commit the request's job; `slot` is held
// until the stream ends. A write that waits `idle_timeout` (the caller
// stopped reading) cancels the call (write_watch.h): the step is still
// applied whole.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartCommitReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request, const Caller& caller,
                                                               std::unique_ptr<StreamLimits::Slot> slot,
                                                               absl::Duration idle_timeout);

}  // namespace shardopt
