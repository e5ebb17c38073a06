// What both edges of the wire share: the one conversion between absl::Status
// and grpc::Status, and the transport tuning measured in docs/design.md
// (section 10.2).
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace grpc {
class ServerBuilder;
}

namespace shardopt {

grpc::Status ToGrpcStatus(const absl::Status& status);
// `peer` names the other side in the message, so a user of many servers sees
// which one refused.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer = {});

// Large enough for 4 MiB chunks with room for the message's other fields.
inline constexpr int kDefaultMaxMessageBytes = 8 << 20;

// HTTP/2 BDP probing off and a large lookahead: with probing on, the
// flow-control window swings and loopback throughput halves.
void TuneChannelArguments(grpc::ChannelArguments* args, int max_message_bytes = kDefaultMaxMessageBytes);
void TuneServerBuilder(grpc::ServerBuilder* builder, int max_message_bytes = kDefaultMaxMessageBytes);

// glibc returns freed MiB-sized buffers to the OS, so every received chunk
// faults its pages in again; keeping them is worth 5x on loopback. Affects the
// whole process.
void TuneAllocatorForStreaming();

}  // namespace shardopt
