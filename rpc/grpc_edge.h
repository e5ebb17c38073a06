// What both edges of the wire share: the one conversion between absl::Status
// and grpc::Status, and the transport tuning measured in docs/design.md
// (section 10.2).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"
#include "rpc/chunk_size.h"

namespace grpc {
class ByteBuffer;
class ChannelCredentials;
class ServerBuilder;
}  // namespace grpc
namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace shardopt {

// Status messages longer than this are cut (ToGrpcStatus): a client's gRPC
// takes headers of up to 8 KiB by default, and the message is one,
// percent-encoded (a byte outside printable ASCII takes three).
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// The same code and message, the message cut to kMaxStatusMessageBytes.
grpc::Status ToGrpcStatus(const absl::Status& status);
// `peer` names the other side in the message, so a user of many servers sees
// which one refused.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer = {});

// A channel's credentials: TLS when `root_certs_pem` (the CA that signed
// the servers' certificates) is set, with a client certificate when
// `cert_chain_pem` and `private_key_pem` are too (mutual TLS); plaintext
// when all are empty.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const std::string& root_certs_pem,
                                                                const std::string& cert_chain_pem,
                                                                const std::string& private_key_pem);

// A raw message into `message`: INVALID_ARGUMENT naming `what` when it does
// not parse, where gRPC's typed readers would only end the stream.
absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::Message* message, absl::string_view what);
// A message into a raw buffer, for a raw handler's answer.
grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message);


// HTTP/2 BDP probing off and a large lookahead: with probing on, the
// flow-control window swings and loopback throughput halves.
void TuneChannelArguments(grpc::ChannelArguments* args, int max_message_bytes = kDefaultMaxMessageBytes);
void TuneServerBuilder(grpc::ServerBuilder* builder, int max_message_bytes = kDefaultMaxMessageBytes);
// Compressed messages refused unread (UNIMPLEMENTED), on every server port:
// gRPC 1.51 inflates one whole before it checks the message size.
void RefuseCompressedMessages(grpc::ServerBuilder* builder);

// glibc returns freed MiB-sized buffers to the OS, so every received chunk
// faults its pages in again; keeping them is worth 5x on loopback. Affects the
// whole process.
void TuneAllocatorForStreaming();

}  // namespace shardopt
