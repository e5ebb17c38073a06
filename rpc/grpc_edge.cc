#include "rpc/grpc_edge.h"


#include <malloc.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/message.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace shardopt {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // The message travels as a header, which a client's gRPC refuses past its
  // metadata limit (8 KiB by default), and the caller would see that
  // RESOURCE_EXHAUSTED instead of the status: long messages are cut, at a
  // character's first byte.
  absl::string_view message = status.message();
  std::string text;
  if (message.size() > kMaxStatusMessageBytes) {
    size_t cut = kMaxStatusMessageBytes;
    while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xc0) == 0x80) --cut;
    text = absl::StrCat(message.substr(0, cut), "... (", message.size() - cut, " more bytes)");
  } else {
    text = std::string(message);
  }
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), text);
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (peer.empty()) return absl::Status(code, status.error_message());
  return absl::Status(code, absl::StrCat(peer, ": ", status.error_message()));
}

namespace {
// What a receiver lets a sender put ahead of what it has read. A client
// receives params from every server at once and reads them as they come, so
// it lets them run far ahead. A server stops reading a push that must wait
// for the window (running_sum.h): whatever the sender may put ahead then sits
// in gRPC's buffers, for each of the job's ranks. 64 KiB keeps that small
// (W = 64: 93-95 MB peak RSS against 107-109 MB at 256 KiB) and measured no
// slower for one rank's push here: a read the server starts opens the
// window to the whole message anyway.
constexpr int kClientLookaheadBytes = 64 << 20;
constexpr int kServerLookaheadBytes = 64 << 10;
// How often a client pings a connection with a call open, and how long it
// waits for the answer before it closes it (TuneChannelArguments).
constexpr int kKeepaliveMs = 10000;
constexpr int kKeepaliveTimeoutMs = 5000;
}

void TuneChannelArguments(grpc::ChannelArguments* args, int max_message_bytes) {
  args->SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args->SetInt("grpc.http2.lookahead_bytes", kClientLookaheadBytes);
  args->SetMaxReceiveMessageSize(max_message_bytes);
  args->SetMaxSendMessageSize(max_message_bytes);
  // A restarted server is back within seconds; gRPC's default reconnect
  // backoff (up to 120 s) would outlast every retry the client makes.
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the time
  // one connection attempt may take (default 20 s). At 100 ms, a server busy
  // with 64 ranks' pushes on 2 cores could not answer a new connection's
  // HTTP/2 SETTINGS in time, and that rank never connected.
  // A connection that stops answering without a reset (the server's machine
  // died, the path went away) is found dead by an unanswered ping, and the
  // call is retried on a new one: without pings every retry went over it
  // until its deadline, and TCP gives it up only after about 15 minutes.
  // Pinged while a call is open only, and also while nothing is sent (a
  // push waiting at its barrier): at gRPC's default of two pings until the
  // client sends something, a server that died after the second went
  // unnoticed.
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

void TuneServerBuilder(grpc::ServerBuilder* builder, int max_message_bytes) {
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder->AddChannelArgument("grpc.http2.lookahead_bytes", kServerLookaheadBytes);
  builder->SetMaxReceiveMessageSize(max_message_bytes);
  builder->SetMaxSendMessageSize(max_message_bytes);
  // The clients ping every kKeepaliveMs with a call open, also while the
  // server sends nothing (a push waiting at its barrier). gRPC's default
  // allows one such ping per 5 minutes and answers the third or fourth with
  // a GOAWAY ("too_many_pings"): the call in flight completes, but later
  // calls need a new connection, and the client's gRPC doubles its ping
  // interval for this server.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveMs / 2);
  RefuseCompressedMessages(builder);
}

void RefuseCompressedMessages(grpc::ServerBuilder* builder) {
  // gRPC 1.51 inflates a compressed message whole before it checks the
  // size: a 256 KiB gzip of zeros became 256 MiB held by the server, from
  // a caller without a token. Clients send bf16 and fp32, which do not
  // compress, so the server takes no compressed messages at all.
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const std::string& root_certs_pem,
                                                                const std::string& cert_chain_pem,
                                                                const std::string& private_key_pem) {
  if (root_certs_pem.empty() && cert_chain_pem.empty() && private_key_pem.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = root_certs_pem;  // empty: gRPC's default roots
  ssl.pem_cert_chain = cert_chain_pem;
  ssl.pem_private_key = private_key_pem;
  return grpc::SslCredentials(ssl);
}

absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::Message* message, absl::string_view what) {
  // No message at all: a Read or Commit whose caller cancelled it before its
  // request came reaches its handler so. Not bad input (a strike against the
  // caller), and nothing to parse.
  if (!buffer->Valid()) return absl::CancelledError(absl::StrCat("the call ended before its ", what, " came"));
  grpc::ProtoBufferReader reader(buffer);  // ParseFromZeroCopyStream clears `message` first
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat("the ", what, " message does not parse; the stream is refused"));
  }
  return absl::OkStatus();
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

void TuneAllocatorForStreaming() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_TOP_PAD, 64 << 20);
}

}  // namespace shardopt
