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
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

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

float Widen(uint16_t bf16) {
  const uint32_t bits = uint32_t{bf16} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rank 0's Step of a job of two ranks waits at the barrier for rank 1: a
// call of rank 0's Client from another thread meanwhile is refused, sends
// nothing (the job stays at step 0), and the Step completes once rank 1
// pushes, with both ranks' gradients summed.
TEST(ClientMisuseTest, ACallFromASecondThreadWhileOneRunsIsRefused) {
  auto server = ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  auto rank0 = ConnectOnce(server->address(), "", 0);
  auto rank1 = ConnectOnce(server->address(), "", 1);
  ASSERT_TRUE(rank0->CreateOrAttach(OneTensorJob("threads", kN, 2)).ok());
  ASSERT_TRUE(rank1->CreateOrAttach(OneTensorJob("threads", kN, 2)).ok());
  std::mt19937_64 rng(7);
  const auto init = RandomFloats(rng, kN, -1, 1);
  ASSERT_TRUE(rank0->InitFp32("w", init.data()).ok());
  const auto g0 = RandomBf16(rng, kN, 1.0f), g1 = RandomBf16(rng, kN, 1.0f);
  std::vector<uint16_t> p0(kN), p1(kN);
  absl::StatusOr<StepResult> stepped0 = absl::UnknownError("not run");
  std::thread waiting([&] { stepped0 = rank0->Step({{"w", g0.data()}}, StepOptions{}, {{"w", p0.data()}}); });
  // Rank 0's Step is in its push until rank 1 pushes (a barrier of 10 s).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const absl::Status refused = rank0->Read("w", StateToRead::kMaster, 0, 1, std::vector<float>(1).data());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("another thread is in a call of this Client"));
  const auto pushed = rank0->Push(1, {{"w", g1.data()}});
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kFailedPrecondition) << pushed.status();
  auto stepped1 = rank1->Step({{"w", g1.data()}}, StepOptions{}, {{"w", p1.data()}});
  waiting.join();
  ASSERT_TRUE(stepped0.ok()) << stepped0.status();
  ASSERT_TRUE(stepped1.ok()) << stepped1.status();
  EXPECT_EQ(rank0->step(), 1u);
  EXPECT_EQ(p0, p1);
  // The refused Push sent nothing: the step's sum is rank 0's and rank 1's
  // gradients, which a job of one rank fed their sum (and its scale)
  // reproduces, bitwise.
  std::vector<float> sum(kN);
  for (uint64_t i = 0; i < kN; ++i) sum[i] = Widen(g0[i]) + Widen(g1[i]);  // the server's fp32 sum in rank order
  auto one = ConnectOnce(server->address());
  JobOptions fp32 = OneTensorJob("summed", kN);
  fp32.tensors[0].param_type = ParamType::kFp32;
  ASSERT_TRUE(one->CreateOrAttach(fp32).ok());
  ASSERT_TRUE(one->InitFp32("w", init.data()).ok());
  StepOptions halved;  // two ranks' step scales their sum by 1 / world_size
  halved.loss_scale = 2;
  std::vector<float> reference(kN, NAN);
  ASSERT_TRUE(one->Step({{"w", sum.data()}}, halved, {{"w", reference.data()}}).ok());
  std::vector<float> master(kN, NAN);
  ASSERT_TRUE(rank1->Read("w", StateToRead::kMaster, 0, kN, master.data()).ok());
  EXPECT_EQ(master, reference);
}

// After a step, a forked child's call of the parent's Client is refused at
// once, its destructor returns, and the child exits; the parent steps on.
TEST(ClientMisuseTest, AForkedChildsCallIsRefusedAndItExits) {
  auto server = ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  auto client = ConnectOnce(server->address());
  ASSERT_TRUE(client->CreateOrAttach(OneTensorJob("forked", kN)).ok());
  std::mt19937_64 rng(8);
  const auto init = RandomFloats(rng, kN, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const auto grad = RandomBf16(rng, kN, 1.0f);
  std::vector<uint16_t> params(kN);
  ASSERT_TRUE(client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(20);  // a hang ends the child, which the parent sees
    const auto described = client->Describe();
    const bool refused = described.status().code() == absl::StatusCode::kFailedPrecondition &&
                         std::string(described.status().message()).find("fork") != std::string::npos;
    client.reset();  // hung in gRPC's shutdown before
    _exit(refused ? 0 : 3);
  }
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 300 && done == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    done = waitpid(child, &status, WNOHANG);
  }
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ASSERT_TRUE(client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
  EXPECT_EQ(client->step(), 2u);
}

}  // namespace
}  // namespace shardopt
