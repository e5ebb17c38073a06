// The client's parallel RPCs: one call per server on its own thread, each
// retried on UNAVAILABLE, DEADLINE_EXCEEDED and a server's CANCELLED
// (Retriable) with exponential backoff, and
// the others cancelled as soon as one fails for good. A push parked at a
// barrier would otherwise hold the caller until the barrier's deadline, and
// the error the caller needs is the first server's.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "rpc/grpc_edge.h"

namespace shardopt::fanout {

// Backoff before retry a (1, 2, ...): kBackoffBaseMs * 2^a, at most kBackoffCapMs.
// A restarted server is back within seconds (TuneChannelArguments keeps the
// channel's own reconnect backoff as short).
inline constexpr int kBackoffBaseMs = 50;
inline constexpr int kBackoffCapMs = 2000;
inline std::chrono::milliseconds Backoff(int a) {
  return std::chrono::milliseconds(std::min(kBackoffCapMs, kBackoffBaseMs << std::min(a, 6)));
}

// The calls in flight of one fan-out.
class Fanout {
 public:
  // False when the fan-out has already failed: do not start the call.
  bool Register(grpc::ClientContext* ctx);
  void Unregister(grpc::ClientContext* ctx);
  // Cancels every call in flight, and every call not started yet.
  void Fail();
  bool failed();

 private:
  std::mutex mu_;
  std::vector<grpc::ClientContext*> active_;
  bool failed_ = false;
};

// The fan-out the calling thread belongs to, if any: set by ForEach for its
// threads, so that Call need not take it through every caller. Inline, with
// its constant initializer in sight of every user: declared extern, it was
// reached through a wrapper that first tests a weak initialization function,
// and GCC 12's -fsanitize=null then took that test's result for the
// variable's address being null (a false report in every sanitized run).
inline thread_local Fanout* current = nullptr;

// The calls made in its scope are outside the thread's fan-out: another
// server's failure does not cancel them. For calls that must finish once
// begun (a job a call created on a server, which it must drop again).
class Detached {
 public:
  Detached() : saved_(current) { current = nullptr; }
  ~Detached() { current = saved_; }
  Detached(const Detached&) = delete;
  Detached& operator=(const Detached&) = delete;

 private:
  Fanout* saved_;
};

// Waits `pause` before a call on `channel`, or less if it is not connected
// and connects meanwhile, or if the calling thread's fan-out fails. The
// wait polls the channel: gRPC notices how a connection attempt ended only
// while something polls the channel (else its backup poller, every 5 s),
// and a call that fails at once on a channel in TRANSIENT_FAILURE polls
// nothing, so a client retrying a restarted server found it 8-10 s after it
// was back, past every retry of its own.
void AwaitChannel(grpc::Channel* channel, std::chrono::milliseconds pause);

// The error of a call of `address` that this client's fan-out cancelled
// (another server's call failed), marked so: the caller is given that
// server's error instead (ForEach), and it is not retried. A server's own
// CANCELLED is not marked.
absl::Status FanoutCancelled(const std::string& address);
bool IsFanoutCancelled(const absl::Status& st);

// Whether an attempt's error is worth another: UNAVAILABLE, DEADLINE_EXCEEDED
// and CANCELLED. Every RPC of the protocol is safe to retry. This client
// cancels a call only through its fan-out, which Call tells apart, so a
// CANCELLED that reaches a retry is the server's: a stopping server's gRPC
// answers the calls it has received but not begun with CANCELLED
// "CANCELLED" (gRPC 1.51; grpc/grpc#41785), and a server ends a stream whose
// caller read nothing for its idle timeout so.
inline bool Retriable(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
         st.error_code() == grpc::StatusCode::CANCELLED;
}

// An UNAVAILABLE or CANCELLED, or gRPC's own DEADLINE_EXCEEDED, left after `attempts`
// tries, with what it may mean (the server is down, unreachable, stopping,
// hung or overloaded, or the TLS handshake failed) and that retrying the RPC
// is safe: every RPC of the protocol is.
absl::Status WithRetryAdvice(absl::Status st, int attempts);

// Runs one RPC over `channel` to `address`, retrying: `attempt` builds its
// call on a fresh context with the deadline set, and the bearer token if
// `token` is not empty. The error names the address. The caller fails the
// fan-out (FailFanout) once an error is final: it may first recover from one.
template <typename Attempt>
absl::Status Call(grpc::Channel* channel, const std::string& address, const std::string& token, int max_attempts,
                  uint32_t timeout_ms, const Attempt& attempt) {
  grpc::Status st;
  int attempts = 0;
  for (int a = 0; a < std::max(1, max_attempts); ++a) {
    // A channel that failed to connect retries only after its reconnect
    // backoff, which grows to 1 s while the server is down: a call made
    // once the server is back failed at once, attempt after attempt, until
    // that timer ran out. The calls' own backoff spaces the attempts, so
    // the channel tries at once instead.
    const bool failed = channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE;
    if (failed) grpc::experimental::ChannelResetConnectionBackoff(channel);
    // A first attempt on a channel that failed to connect waits a little
    // for it, so that a caller's own loop of single attempts finds the
    // server too.
    AwaitChannel(channel, a > 0    ? Backoff(a)
                          : failed ? std::chrono::milliseconds(kBackoffBaseMs)
                                   : std::chrono::milliseconds(0));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    if (current != nullptr && !current->Register(&ctx)) return FanoutCancelled(address);
    st = attempt(&ctx);
    ++attempts;
    if (current != nullptr) current->Unregister(&ctx);
    if (st.error_code() == grpc::StatusCode::CANCELLED && current != nullptr && current->failed()) {
      return FanoutCancelled(address);
    }
    if (!Retriable(st)) break;
  }
  return WithRetryAdvice(FromGrpcStatus(st, address), attempts);
}

// Cancels the calling thread's fan-out, if it is in one and `st` is an
// error: the other servers' calls are of no use once this one failed.
inline absl::Status FailFanout(absl::Status st) {
  if (!st.ok() && current != nullptr) current->Fail();
  return st;
}

// Runs fn(target) for every target at once, one thread each, and returns the
// first error in target order that is not a cancellation by the fan-out
// (IsFanoutCancelled).
template <typename Fn>
absl::Status ForEach(const std::vector<uint32_t>& targets, const Fn& fn) {
  std::vector<absl::Status> results(targets.size());
  Fanout fanout;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < targets.size(); ++i) {
    threads.emplace_back([&, i] {
      current = &fanout;
      results[i] = fn(targets[i]);
    });
  }
  for (auto& t : threads) t.join();
  absl::Status first;
  for (const absl::Status& st : results) {
    if (!st.ok() && (first.ok() || IsFanoutCancelled(first))) first = st;
  }
  return first;
}

}  // namespace shardopt::fanout
