// A Client used as client.h says it must not be: from a second thread while
// a call runs, or in a process forked from the one that made it. Each is
// refused with FAILED_PRECONDITION before anything is sent, where two
// threads' Steps had each taken the other's push for a retry (half the
// gradients lost, every call OK), and a forked child's call hung writing on
// the parent's connections, as did its exit (outside probes).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::ConnectOnce;
using testing::OneTensorJob;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ServerProcess;

constexpr uint64_t kN = 8192;

// A server, and a client attached to a job of one tensor of kN elements
// with random initial values.
class ClientMisuseTest : public ::testing::Test {
 protected:
  // A step, then a forked child that runs `refused` (whether its call was
  // refused as it should be), drops the parent's Client and exits 0 if so;
  // the child must exit so, and the parent steps on.
  void ForkAfterAStep(const std::function<bool()>& refused) {
    const auto grad = RandomBf16(rng, kN, 1.0f);
    std::vector<uint16_t> params(kN);
    ASSERT_TRUE(client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
    const uint64_t step = client->step();
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      alarm(20);  // a hang ends the child, which the parent sees
      const bool ok = refused();
      client.reset();  // hung in gRPC's shutdown before
      _exit(ok ? 0 : 3);
    }
    const std::optional<int> status = testing::WaitProcess(child, std::chrono::seconds(30));  // its alarm ends it first
    if (!status) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
    }
    ASSERT_TRUE(status.has_value()) << "the child outlived its alarm";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "child status " << *status;
    ASSERT_TRUE(client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
    EXPECT_EQ(client->step(), step + 1);
  }
  void SetUp() override {
    server = ServerProcess::Start();
    ASSERT_NE(server, nullptr);
    client = ConnectOnce(server->address());
    ASSERT_TRUE(client->CreateOrAttach(OneTensorJob("misused", kN)).ok());
    ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  }

  std::mt19937_64 rng{7};
  const std::vector<float> init = RandomFloats(rng, kN, -1, 1);
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Client> client;
};

// While one thread's push is under way (held in PushInOrder's gradient
// callback, which the client calls from inside the call), a call of the same
// Client from another thread is refused and sends nothing: the step then
// applied is the first push's gradient alone, bitwise as a job that is
// only pushed it.
TEST_F(ClientMisuseTest, ACallFromASecondThreadWhileOneRunsIsRefused) {
  const auto g0 = RandomBf16(rng, kN, 1.0f), g1 = RandomBf16(rng, kN, 1.0f);
  absl::Notification inside, go_on;
  absl::StatusOr<PushResult> pushed = absl::UnknownError("not run");
  std::thread pushing([&] {
    const std::vector<std::string> order = {"w"};
    pushed = client->PushInOrder(1, order, [&](size_t) -> const void* {
      inside.Notify();
      go_on.WaitForNotificationWithTimeout(absl::Seconds(30));
      return g0.data();
    });
  });
  ASSERT_TRUE(inside.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::vector<float> one(1, NAN);
  const absl::Status refused = client->Read("w", StateToRead::kMaster, 0, 1, one.data());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("another thread is in a call of this Client"));
  EXPECT_TRUE(std::isnan(one[0]));
  const auto again = client->Push(1, {{"w", g1.data()}});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  go_on.Notify();
  pushing.join();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  std::vector<uint16_t> params(kN);
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}}).ok());
  // The same step of a job pushed g0 alone.
  auto other = ConnectOnce(server->address());
  ASSERT_TRUE(other->CreateOrAttach(OneTensorJob("g0-alone", kN)).ok());
  ASSERT_TRUE(other->InitFp32("w", init.data()).ok());
  std::vector<uint16_t> reference(kN);
  ASSERT_TRUE(other->Step({{"w", g0.data()}}, StepOptions{}, {{"w", reference.data()}}).ok());
  std::vector<float> master(kN, NAN), expected(kN, NAN);
  ASSERT_TRUE(client->Read("w", StateToRead::kMaster, 0, kN, master.data()).ok());
  ASSERT_TRUE(other->Read("w", StateToRead::kMaster, 0, kN, expected.data()).ok());
  EXPECT_EQ(master, expected);
  EXPECT_EQ(params, reference);
}

// An empty grad function is refused, and nothing is sent: the client calls
// it on gRPC's threads, where std::function's throw ended the process (an
// outside probe's trainer, exit 134). The step is then pushed as usual.
TEST_F(ClientMisuseTest, APushInOrderWithoutAGradFunctionIsRefused) {
  const std::vector<std::string> order = {"w"};
  const auto refused = client->PushInOrder(1, order, std::function<const void*(size_t)>());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("needs a grad function"));
  const auto grad = RandomBf16(rng, kN, 1.0f);
  std::vector<uint16_t> params(kN);
  ASSERT_TRUE(client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
  EXPECT_EQ(client->step(), 1u);
}

// After a step, a forked child's call of the parent's Client is refused at
// once, its destructor returns, and the child exits; the parent steps on.
TEST_F(ClientMisuseTest, AForkedChildsCallIsRefusedAndItExits) {
  ForkAfterAStep([&] {
    const auto described = client->Describe();
    return described.status().code() == absl::StatusCode::kFailedPrecondition &&
           std::string(described.status().message()).find("fork") != std::string::npos;
  });
}

// A new Client in a forked child is refused too, at Connect, before gRPC
// is touched: one made there, as the README once said to, hung in its
// calls past their deadlines, or took the answers of the parent's calls,
// which then waited out their own deadlines (an outside probe). The parent's
// step after the child and its calls are answered at once.
TEST_F(ClientMisuseTest, ANewClientInAForkedChildIsRefusedAndLeavesTheParentsAlone) {
  const auto t0 = std::chrono::steady_clock::now();
  ForkAfterAStep([&] {
    ClientOptions options;
    options.servers = {server->address()};
    const auto connected = Client::Connect(options);
    return connected.status().code() == absl::StatusCode::kFailedPrecondition &&
           std::string(connected.status().message()).find("is a fork of process") != std::string::npos;
  });
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->Describe().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

}  // namespace
}  // namespace shardopt
