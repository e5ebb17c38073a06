// The Push RPC on gRPC's callback API, with raw messages parsed here (so an
// unparseable one is INVALID_ARGUMENT, never the stream's quiet end): one
// reactor per stream, driving a PushSession with its non-blocking calls. It reads the next chunk only
// once the session has taken the last one, so a full window stops reading
// and gRPC's flow control holds the sender back; a wait at the barrier
// holds no thread. The session's wakes resume it.
#pragma once

#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/read_reactor.h"
#include "shardopt/v1/optimizer.pb.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Push call; gRPC owns it until its OnDone.
// A stream that sends nothing for `idle_timeout` while the reactor waits to
// read from it is cancelled with DEADLINE_EXCEEDED, as a refused push: its
// round is left as if it never came (push_session.h). Waiting for the window
// or at the barrier is the server's wait, not the stream's, and never counts.
// The stream is also cut, DEADLINE_EXCEEDED, if it is still sending when its
// round's barrier deadline passes. `allows` is asked at each
// message whether its caller may push the stream's job.
grpc::ServerReadReactor<grpc::ByteBuffer>* StartPushReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response, CallerCheck allows,
                                                            StreamSettings settings);

}  // namespace shardopt
