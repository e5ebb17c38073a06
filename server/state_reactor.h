// The Read RPC on gRPC's callback API: the state streamed chunk by chunk,
// the next one read from the job only once the last is written, so a
// caller slow to take them holds a stream slot and no thread.
#pragma once

#include <memory>

#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/stream_limits.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// The reactor for one Read call; gRPC owns it until its OnDone. `caller`
// must be allowed to read the request's job; `slot` is held until the end.
grpc::ServerWriteReactor<v1::StateChunk>* StartStateReactor(JobStore* store, const v1::ReadRequest* request,
                                                            const Caller& caller,
                                                            std::unique_ptr<StreamLimits::Slot> slot);

}  // namespace shardopt
