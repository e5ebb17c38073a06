#include "bench/echo.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "rpc/grpc_edge.h"

namespace shardopt::bench {

namespace {

constexpr char kEchoMethod[] = "/shardopt.bench.Echo/Echo";
constexpr char kRelayMethod[] = "/shardopt.bench.Echo/Relay";

// Writes back each message as it arrives while the next one is read (Echo),
// or only once the client has sent them all (Relay: a step's shape, all in
// and then all out). Only one write may be in flight, so messages wait in a
// queue, which holds references to the received slices, not copies.
class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit EchoReactor(bool relay) : relay_(relay) { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    grpc::ByteBuffer* to_write = nullptr;
    bool stop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop = reads_done_ = !ok || failed_;
      if (!stop) pending_.push_back(std::move(in_));
      const bool may_write = stop ? relay_ && !failed_ : !relay_;
      if (may_write && !writing_ && !pending_.empty()) {
        writing_ = true;
        to_write = &pending_.front();  // a deque keeps references across push_back
      }
    }
    if (to_write != nullptr) StartWrite(to_write);
    if (stop) return MaybeFinish();
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    grpc::ByteBuffer* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.pop_front();
      failed_ = failed_ || !ok;
      if (!failed_ && !pending_.empty()) {
        next = &pending_.front();
      } else {
        writing_ = false;
      }
    }
    if (next != nullptr) return StartWrite(next);
    MaybeFinish();
  }

  void OnDone() override { delete this; }

 private:
  void MaybeFinish() {
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || writing_ || !(reads_done_ || failed_)) return;
      finished_ = true;
      failed = failed_;
    }
    Finish(failed ? grpc::Status(grpc::StatusCode::CANCELLED, "echo write failed") : grpc::Status::OK);
  }

  const bool relay_;
  std::mutex mu_;
  grpc::ByteBuffer in_;
  std::deque<grpc::ByteBuffer> pending_;
  bool writing_ = false;
  bool reads_done_ = false;
  bool failed_ = false;
  bool finished_ = false;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new EchoReactor(context->method() == kRelayMethod);
  }
};

// Sends `src` in chunks whose slices point into it, so gRPC hands the
// caller's memory to the socket, and copies each echoed message into `dst`,
// as a client must to put the bytes where its user wants them.
class EchoCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  EchoCall(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes)
      : src_(src), dst_(dst), bytes_(bytes), chunk_bytes_(chunk_bytes) {}

  absl::Status Run(grpc::GenericStub* stub, const char* method) {
    stub->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartRead(&in_);
    WriteNext();
    StartCall();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_; });
    if (!status_.ok()) return FromGrpcStatus(status_, "echo");
    if (!error_.empty()) return absl::DataLossError(error_);
    if (received_ != bytes_) {
      return absl::DataLossError(absl::StrCat("echo returned ", received_, " bytes of ", bytes_));
    }
    return absl::OkStatus();
  }

  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();  // else the call has failed, and OnDone says how
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    std::vector<grpc::Slice> slices;
    if (!in_.Dump(&slices).ok() || received_ + in_.Length() > bytes_) {
      error_ = "echo returned more bytes than were sent";
      return ctx_.TryCancel();
    }
    for (const grpc::Slice& s : slices) {
      std::memcpy(dst_ + received_, s.begin(), s.size());
      received_ += s.size();
    }
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    done_ = true;
    done_cv_.notify_all();
  }

 private:
  void WriteNext() {
    if (sent_ == bytes_) return StartWritesDone();
    const uint64_t n = std::min(chunk_bytes_, bytes_ - sent_);
    grpc::Slice slice(src_ + sent_, n, grpc::Slice::STATIC_SLICE);
    out_ = grpc::ByteBuffer(&slice, 1);
    sent_ += n;
    StartWrite(&out_);
  }

  const char* src_;
  char* dst_;
  const uint64_t bytes_;
  const uint64_t chunk_bytes_;
  grpc::ClientContext ctx_;
  grpc::ByteBuffer out_;
  grpc::ByteBuffer in_;
  uint64_t sent_ = 0;      // touched only by the write side
  uint64_t received_ = 0;  // touched only by the read side until OnDone
  std::string error_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
  grpc::Status status_;
};

absl::Status ErrnoStatus(const char* what) { return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno))); }

// Sends all of [data, data+n), as send() may take less at a time.
bool SendAll(int fd, const char* data, uint64_t n) {
  while (n > 0) {
    const ssize_t sent = send(fd, data, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    data += sent;
    n -= static_cast<uint64_t>(sent);
  }
  return true;
}

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcEcho>> GrpcEcho::Start() {
  std::unique_ptr<GrpcEcho> echo(new GrpcEcho);
  echo->service_ = std::make_unique<EchoService>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  TuneServerBuilder(&builder);
  builder.RegisterCallbackGenericService(echo->service_.get());
  echo->server_ = builder.BuildAndStart();
  if (!echo->server_ || port == 0) return absl::UnavailableError("cannot start the gRPC echo server");
  grpc::ChannelArguments args;
  TuneChannelArguments(&args);
  echo->stub_ = std::make_unique<grpc::GenericStub>(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args));
  return echo;
}

GrpcEcho::~GrpcEcho() {
  if (server_) server_->Shutdown();
}

absl::Status GrpcEcho::Run(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes) {
  EchoCall call(src, dst, bytes, chunk_bytes);
  return call.Run(stub_.get(), kEchoMethod);
}

absl::Status GrpcEcho::Relay(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes) {
  EchoCall call(src, dst, bytes, chunk_bytes);
  return call.Run(stub_.get(), kRelayMethod);
}

absl::StatusOr<std::unique_ptr<TcpEcho>> TcpEcho::Start() {
  std::unique_ptr<TcpEcho> echo(new TcpEcho);
  echo->listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
  if (echo->listen_fd_ < 0) return ErrnoStatus("socket");
  sockaddr_in addr = Loopback(0);
  socklen_t len = sizeof addr;
  if (bind(echo->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return ErrnoStatus("bind");
  if (listen(echo->listen_fd_, 1) != 0) return ErrnoStatus("listen");
  if (getsockname(echo->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return ErrnoStatus("getsockname");
  echo->port_ = ntohs(addr.sin_port);
  echo->thread_ = std::thread([e = echo.get()] { e->Serve(); });
  return echo;
}

TcpEcho::~TcpEcho() {
  if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);  // wakes accept(), so Serve returns
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void TcpEcho::Serve() {
  std::vector<char> buffer(1 << 20);
  for (;;) {
    const int fd = accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;
    }
    for (;;) {
      const ssize_t got = recv(fd, buffer.data(), buffer.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0 || !SendAll(fd, buffer.data(), static_cast<uint64_t>(got))) break;
    }
    close(fd);
  }
}

absl::Status TcpEcho::Run(const char* src, char* dst, uint64_t bytes, uint64_t chunk_bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return ErrnoStatus("socket");
  const sockaddr_in addr = Loopback(port_);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const absl::Status st = ErrnoStatus("connect");
    close(fd);
    return st;
  }
  bool sent = true;
  std::thread writer([&] {
    for (uint64_t off = 0; sent && off < bytes; off += chunk_bytes) {
      sent = SendAll(fd, src + off, std::min(chunk_bytes, bytes - off));
    }
    shutdown(fd, SHUT_WR);
  });
  uint64_t received = 0;
  while (received < bytes) {
    const ssize_t got = recv(fd, dst + received, bytes - received, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    received += static_cast<uint64_t>(got);
  }
  if (received != bytes) shutdown(fd, SHUT_RDWR);  // unblocks the writer if the echo stopped reading
  writer.join();
  close(fd);
  if (!sent || received != bytes) {
    return absl::DataLossError(absl::StrCat("TCP echo returned ", received, " bytes of ", bytes));
  }
  return absl::OkStatus();
}

}  // namespace shardopt::bench
