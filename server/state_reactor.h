// The Read RPC on gRPC's callback API, with raw messages: the state
// streamed chunk by chunk, the next one read from the job only once the last
// is written, so a caller slow to take them holds a stream slot and no
// thread; and a request that does not parse is INVALID_ARGUMENT (gRPC's
// typed path answered UNIMPLEMENTED).
#pragma once

#include <memory>

#include "absl/time/time.h"

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/stream_limits.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// The reactor for one Read call of a ReadRequest as received; gRPC owns it
// until its OnDone. It checks that `caller` may read the request's job;
// `slot` is held until the end. A write that waits `idle_timeout` (the
// caller stopped reading) cancels the call (write_watch.h).
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartStateReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request, const Caller& caller,
                                                              std::unique_ptr<StreamLimits::Slot> slot,
                                                              absl::Duration idle_timeout);

}  // namespace shardopt
