// What the client-streaming RPCs (Push, Init) share on gRPC's callback API:
// a reactor that keeps itself alive until gRPC's OnDone, runs each reaction
// under one lock, holds a stream slot (stream_limits.h) while it is open,
// and cuts a stream that keeps the server waiting: one that sends nothing
// for the idle timeout, or that is still sending when a deadline of its own
// (a Push's barrier round) passes. Reads are raw, parsed by the subclass,
// so an unparseable message is an error of the call, never its quiet end.
// A stream refused for bad input is a strike against its client; a client
// in the tarpit has its streams' first read held back (stream_limits.h).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/stream_limits.h"
#include "server/wakeups.h"

namespace shardopt {

// What every stream gets from the service.
struct StreamSettings {
  absl::Duration idle_timeout;               // a stream that sends nothing this long is cut
  std::unique_ptr<StreamLimits::Slot> slot;  // held while the stream is open
  // Each message is charged from its arrival until the next read (or the
  // stream's end): a message the budget has no room for ends the stream,
  // RESOURCE_EXHAUSTED.
  MemoryBudget* budget;
};

class ReadReactor : public grpc::ServerReadReactor<grpc::ByteBuffer>, public std::enable_shared_from_this<ReadReactor> {
 public:
  using Clock = std::chrono::steady_clock;

  // `what` names the stream in messages ("push", "init").
  ReadReactor(const char* what, grpc::CallbackServerContext* context, Wakeups* wakeups, StreamSettings settings);

  // Starts the first read. Call once, on the reactor made by make_shared.
  void Begin();

  void OnReadDone(bool ok) final;
  void OnCancel() final;
  void OnDone() final;

 protected:
  // Each reaction runs under mu_, and none after End.
  // A message arrived: call Read for the next, End, or wait and later do so.
  virtual void OnMessage(grpc::ByteBuffer* message) = 0;
  // The client closed its side: the stream is whole.
  virtual void OnClosed() = 0;
  // The stream is cut before its end, by the client (cancelled) or by the
  // server (idle, or past its deadline): let go of what it holds. Returns
  // what the caller should do now, for the status message.
  virtual std::string OnCut(bool by_server) = 0;
  // A deadline of the stream's own, besides the idle timeout; and at it,
  // the status the stream ends with (OK: carry on, it no longer applies).
  virtual std::optional<Clock::time_point> CutOffAt() { return std::nullopt; }
  virtual absl::Status AtCutOff() { return absl::OkStatus(); }

  void Read();
  // The last message's charge, for a subclass that reads the next message
  // before it is done with this one (Read releases what it still holds).
  MemoryBudget::Charge TakeMessageCharge() { return std::move(message_charge_); }
  // Charges the last message `bytes` more, for as long as its own charge
  // (what reading it made beside its bytes); RESOURCE_EXHAUSTED if they do
  // not fit.
  absl::Status ChargeMessage(uint64_t bytes) { return message_charge_.Grow(bytes, charge_what_); }
  // The last message is dealt with before the next read starts (a push
  // whose chunk went into the window, and which waits for room to read):
  // its bytes and its charge go now. Only between reads: a read in flight
  // is reading into the message.
  void ReleaseMessage();
  void End(const grpc::Status& status);
  bool finished() const { return finished_; }
  template <typename T>
  std::weak_ptr<T> WeakSelf() {
    return std::static_pointer_cast<T>(shared_from_this());
  }

  grpc::CallbackServerContext* const context_;
  // Recursive in case gRPC runs a reaction inline from a Start call.
  std::recursive_mutex mu_;

 private:
  void Arm(Clock::time_point when);
  void TimerFired(Clock::time_point when);

  const char* const what_;
  Wakeups* const wakeups_;
  const Clock::duration idle_timeout_;
  std::unique_ptr<StreamLimits::Slot> slot_;
  MemoryBudget* const budget_;
  const std::string charge_what_;  // what a refused charge names, made once, not per message
  metrics::Counter* const received_;  // bytes of this method's messages
  MemoryBudget::Charge message_charge_;
  std::shared_ptr<ReadReactor> self_;
  grpc::ByteBuffer message_;
  bool reading_ = false;  // a read is outstanding: the client's turn
  Clock::time_point read_started_;
  Clock::time_point armed_for_ = Clock::time_point::max();  // the earliest timer pending
  bool finished_ = false;  // Finish was called
  bool done_ = false;      // OnDone ran
};

// Makes a reactor of type R (a ReadReactor), which holds itself until its
// OnDone, and starts its first read.
template <typename R, typename... Args>
grpc::ServerReadReactor<grpc::ByteBuffer>* StartReadReactor(Args&&... args) {
  auto reactor = std::make_shared<R>(std::forward<Args>(args)...);
  reactor->Begin();
  return reactor.get();
}

}  // namespace shardopt
