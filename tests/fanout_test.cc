// The client's retries tell a server's CANCELLED, which they retry (a
// stopping server's gRPC answers so the calls it had not begun), from their
// own fan-out's, which they neither retry nor pass off as the server's. A
// real gRPC server on loopback answers as each case needs.
#include "client/fanout.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace shardopt::fanout {
namespace {

using ::testing::HasSubstr;

// /t/CancelledOnce: CANCELLED "CANCELLED" the first time, as a stopping
// server's gRPC answers, then OK. /t/Refused: INVALID_ARGUMENT. /t/Held: no
// answer until the caller cancels. Each counts its calls.
class Answers final : public grpc::CallbackGenericService {
 public:
  std::atomic<int> cancelled_once{0}, refused{0}, held{0};

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new Call(this, context->method());
  }

 private:
  class Call final : public grpc::ServerGenericBidiReactor {
   public:
    Call(Answers* answers, std::string method) : answers_(answers), method_(std::move(method)) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status(grpc::StatusCode::INTERNAL, "no request"));
      if (method_ == "/t/CancelledOnce") {
        const bool first = answers_->cancelled_once++ == 0;
        return Finish(first ? grpc::Status(grpc::StatusCode::CANCELLED, "CANCELLED") : grpc::Status::OK);
      }
      if (method_ == "/t/Refused") {
        ++answers_->refused;
        return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "refused"));
      }
      ++answers_->held;  // answered at OnCancel
    }
    void OnCancel() override { Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the caller cancelled")); }
    void OnDone() override { delete this; }

   private:
    Answers* const answers_;
    const std::string method_;
    grpc::ByteBuffer in_;
  };
};

class FanoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&answers_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port_);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  // fanout::Call of `method` with an empty request.
  absl::Status CallOf(const std::string& method, int max_attempts) {
    return Call(channel_.get(), address_, "", max_attempts, 5000, [&](grpc::ClientContext* ctx) {
      grpc::CompletionQueue cq;
      grpc::ByteBuffer request(nullptr, 0), response;
      auto rpc = stub_->PrepareUnaryCall(ctx, method, request, &cq);
      rpc->StartCall();
      grpc::Status status;
      rpc->Finish(&response, &status, reinterpret_cast<void*>(1));
      void* tag;
      bool ok;
      cq.Next(&tag, &ok);
      return status;
    });
  }

  Answers answers_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

TEST_F(FanoutTest, AServersCancelledIsRetried) {
  EXPECT_TRUE(CallOf("/t/CancelledOnce", 3).ok());
  EXPECT_EQ(answers_.cancelled_once.load(), 2);
}

TEST_F(FanoutTest, AServersCancelledLeftAfterTheLastAttemptSaysItIsTheServersAndSafeToRetry) {
  const absl::Status st = CallOf("/t/CancelledOnce", 1);
  EXPECT_TRUE(absl::IsCancelled(st)) << st;
  EXPECT_FALSE(IsFanoutCancelled(st)) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("the server cancelled the call"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("safe to retry"));
}

// Server 1's call waits; server 0's is refused 0.2 s later, which cancels
// server 1's. That cancellation is not retried, and the caller gets server
// 0's error.
TEST_F(FanoutTest, TheFanoutsOwnCancellationIsNotRetriedNorTheCallersError) {
  absl::Status held;
  const absl::Status first = ForEach({0, 1}, [&](uint32_t target) -> absl::Status {
    if (target == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return FailFanout(CallOf("/t/Refused", 3));
    }
    held = CallOf("/t/Held", 3);
    return FailFanout(held);
  });
  EXPECT_TRUE(absl::IsInvalidArgument(first)) << first;
  EXPECT_TRUE(IsFanoutCancelled(held)) << held;
  EXPECT_EQ(answers_.held.load(), 1);
  EXPECT_EQ(answers_.refused.load(), 1);
}

// Server 0's own CANCELLED, left after its one attempt, fails the fan-out
// and cancels server 1's call: the caller gets server 0's, which says what
// it means, not server 1's cancellation, which used to replace it.
TEST_F(FanoutTest, AServersCancelledIsTheCallersErrorOverTheFanoutsOwn) {
  const absl::Status first = ForEach({0, 1}, [&](uint32_t target) -> absl::Status {
    if (target == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return FailFanout(CallOf("/t/CancelledOnce", 1));
    }
    return FailFanout(CallOf("/t/Held", 3));
  });
  EXPECT_TRUE(absl::IsCancelled(first)) << first;
  EXPECT_FALSE(IsFanoutCancelled(first)) << first;
  EXPECT_THAT(std::string(first.message()), HasSubstr("the server cancelled the call"));
}

}  // namespace
}  // namespace shardopt::fanout
