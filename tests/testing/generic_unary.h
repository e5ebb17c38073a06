// One unary call through gRPC's generic stub, for tests that send bytes no
// generated stub would (a raw health check, a compressed request).
#pragma once

#include <chrono>
#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace shardopt::testing {

// The call's status and the answer's bytes. The client sends messages of any
// size, so that what the server takes is the server's limit; and each of
// `authorization` as an 'authorization' metadata entry.
inline std::pair<grpc::Status, std::string> GenericUnary(const std::string& address, const std::string& method,
                                                         const std::string& request,
                                                         grpc_compression_algorithm compression = GRPC_COMPRESS_NONE,
                                                         const std::vector<std::string>& authorization = {}) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(INT_MAX);
  grpc::GenericStub generic(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (compression != GRPC_COMPRESS_NONE) ctx.set_compression_algorithm(compression);
  for (const std::string& entry : authorization) ctx.AddMetadata("authorization", entry);
  grpc::CompletionQueue cq;
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1), received;
  auto rpc = generic.PrepareUnaryCall(&ctx, method, send, &cq);
  rpc->StartCall();
  grpc::Status status;
  rpc->Finish(&received, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  std::vector<grpc::Slice> slices;
  std::string out;
  if (status.ok() && received.Dump(&slices).ok()) {
    for (auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return {status, out};
}

}  // namespace shardopt::testing
