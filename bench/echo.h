// The ceilings that docs/design.md (section 10.2) states end-to-end
// throughput against: a bare gRPC streaming echo, tuned as the design
// measured best, and a plain TCP echo. Both send `bytes` from `src` and land
// the echo in `dst`, with both directions in flight at once; the gRPC
// relay sends them one way and then the other.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/server.h"

namespace shardopt::bench {

// A bidi-streaming echo over raw grpc::ByteBuffer: no protobuf, and no copy
// on the server, which writes back the very slices it received.
class GrpcEcho {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcEcho>> Start();
  ~GrpcEcho();
  absl::Status Run(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes);
  // The same bytes all the way to the server first, and only then back: a
  // step's shape (every gradient in before any param goes out), so the two
  // directions never overlap.
  absl::Status Relay(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes);

 private:
  GrpcEcho() = default;
  std::unique_ptr<grpc::CallbackGenericService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

// A thread that echoes one loopback connection at a time.
class TcpEcho {
 public:
  static absl::StatusOr<std::unique_ptr<TcpEcho>> Start();
  ~TcpEcho();
  absl::Status Run(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes);

 private:
  TcpEcho() = default;
  void Serve();
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace shardopt::bench
