// Initial values shared out over a job's ranks (Client::InitFp32/InitBf16
// with an InitShare, WaitForInitialValues), against real server processes:
// each rank's share is a slice of every server's part, the shares tile the
// tensors exactly, and the job takes no push until the last share is in.
#include <cmath>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "shardopt/client.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ServerProcess;

constexpr uint32_t kWorld = 4;

// Three tensors over two servers: one split between them, one smaller than
// the number of ranks (some shares of it are empty), one bf16.
JobOptions ShareJob() {
  JobOptions job;
  job.name = "shares";
  job.world_size = kWorld;
  job.groups = {GroupOptions{}};
  job.tensors = {{"a", 10007, 0}, {"b", 3, 0}, {"c", 50001, 0}};
  job.barrier_timeout_ms = 10000;
  return job;
}

class InitShareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      servers_.push_back(ServerProcess::Start({"--threads=1"}));
      ASSERT_NE(servers_.back(), nullptr);
    }
    for (uint32_t r = 0; r < kWorld; ++r) {
      ClientOptions o;
      o.servers = {servers_[0]->address(), servers_[1]->address()};
      o.rank = r;
      o.max_attempts = 1;
      clients_.push_back(Client::Connect(o).value());
      ASSERT_TRUE(clients_.back()->CreateOrAttach(job_).ok());
    }
  }

  uint32_t Uninitialized() { return testing::UninitializedParts(*clients_[0]); }

  // Rank r's share of every tensor: a and c as fp32, b as bf16.
  absl::Status WriteShare(uint32_t r, InitShare share) {
    if (auto st = clients_[r]->InitFp32("a", a_.data(), share); !st.ok()) return st;
    if (auto st = clients_[r]->InitBf16("b", b_.data(), share); !st.ok()) return st;
    return clients_[r]->InitFp32("c", c_.data(), share);
  }

  std::vector<float> ReadMaster(const std::string& tensor, uint64_t numel) {
    std::vector<float> m(numel, std::nanf(""));  // poisoned
    EXPECT_TRUE(clients_[0]->Read(tensor, StateToRead::kMaster, 0, numel, m.data()).ok());
    return m;
  }

  const JobOptions job_ = ShareJob();
  std::mt19937_64 rng_{std::random_device{}()};
  const std::vector<float> a_ = RandomFloats(rng_, 10007, -2, 2);
  const std::vector<uint16_t> b_ = RandomBf16(rng_, 3, 1.0f);
  const std::vector<float> c_ = RandomFloats(rng_, 50001, -2, 2);
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_F(InitShareTest, SharesTileTheTensorsBitwiseAndTheJobWaitsForTheLastOne) {
  // "a", "b" on server 0; "c" on both (placement: 4096-aligned halves of the
  // flat space), so four parts in all lack values at first.
  EXPECT_EQ(Uninitialized(), 4u);
  for (uint32_t r : {0u, 1u, 3u}) ASSERT_TRUE(WriteShare(r, {r, kWorld}).ok()) << "rank " << r;
  // Rank 2's share of every part is non-empty (b's is its element 1), so
  // every part still lacks some values.
  EXPECT_EQ(Uninitialized(), 4u);

  // Without rank 2's share: the wait times out naming a server, and a push
  // is refused and changes nothing.
  // A negative timeout is the caller's mistake, not a wait of "-5 ms".
  EXPECT_EQ(clients_[0]->WaitForInitialValues(-5).code(), absl::StatusCode::kInvalidArgument);
  const auto waited = clients_[0]->WaitForInitialValues(100);
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited)) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("still lack initial values"));
  // A rank that gave another job name waits too, on a job of its own.
  EXPECT_THAT(std::string(waited.message()), HasSubstr("with this job name and world_size?"));
  std::vector<std::vector<uint16_t>> grads;
  for (const TensorOptions& t : job_.tensors) grads.push_back(RandomBf16(rng_, t.numel, 1.0f));
  const std::vector<GradView> views = {{"a", grads[0].data()}, {"b", grads[1].data()}, {"c", grads[2].data()}};
  const auto refused = clients_[0]->Push(1, views);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("no initial value"));

  ASSERT_TRUE(WriteShare(2, {2, kWorld}).ok());
  for (auto& c : clients_) ASSERT_TRUE(c->WaitForInitialValues(5000).ok());
  EXPECT_EQ(Uninitialized(), 0u);
  EXPECT_EQ(ReadMaster("a", a_.size()), a_);
  std::vector<float> b;
  for (uint16_t h : b_) b.push_back(math::bf16_to_float(h));
  EXPECT_EQ(ReadMaster("b", b_.size()), b);
  EXPECT_EQ(ReadMaster("c", c_.size()), c_);

  // And the job steps: every rank's push of step 1 is taken.
  std::vector<std::thread> ranks;
  std::vector<absl::Status> pushed(kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] { pushed[r] = clients_[r]->Push(1, views).status(); });
  }
  for (auto& t : ranks) t.join();
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_TRUE(pushed[r].ok()) << "rank " << r << ": " << pushed[r];
}

TEST_F(InitShareTest, AShareOutOfRangeIsInvalidArgumentAndWritesNothing) {
  const std::vector<float> a_before = ReadMaster("a", a_.size()), c_before = ReadMaster("c", c_.size());
  for (InitShare bad : {InitShare{4, 4}, InitShare{0, 0}, InitShare{7, 3}}) {
    const auto st = WriteShare(0, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("out of range"));
  }
  EXPECT_EQ(Uninitialized(), 4u);
  EXPECT_EQ(ReadMaster("a", a_.size()), a_before);
  EXPECT_EQ(ReadMaster("c", c_.size()), c_before);
  // One rank writing everything (share 0 of 1, the default) still works.
  ASSERT_TRUE(WriteShare(0, {}).ok());
  EXPECT_TRUE(clients_[1]->WaitForInitialValues(1000).ok());
  EXPECT_EQ(ReadMaster("c", c_.size()), c_);
}

// Values the servers refuse (a NaN in the last element, a negative
// exp_avg_sq) are refused by the client before any chunk is sent. The
// servers check each chunk they get: what went before the refused one (the
// other server's part of "a", the exp_avg sent before the exp_avg_sq, the
// Adam step with it) was written.
TEST_F(InitShareTest, ValuesTheServersRefuseAreRefusedBeforeAnythingIsSent) {
  const std::vector<float> a_before = ReadMaster("a", a_.size());
  std::vector<float> bad = a_;
  bad.back() = std::nanf("");
  auto st = clients_[0]->InitFp32("a", bad.data());
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("element 10006 is not finite"));
  EXPECT_EQ(ReadMaster("a", a_.size()), a_before);
  const std::vector<float> m(a_.size(), 0.5f);
  std::vector<float> v(a_.size(), 0.25f);
  v.back() = -1;
  st = clients_[0]->InitAdamState("a", m.data(), v.data(), 3);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("is negative"));
  const auto steps = clients_[0]->AdamSteps();
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_EQ((*steps)[0], 0u);
  std::vector<float> exp_avg(a_.size(), 1.0f);
  ASSERT_TRUE(clients_[0]->Read("a", StateToRead::kExpAvg, 0, exp_avg.size(), exp_avg.data()).ok());
  EXPECT_EQ(exp_avg, std::vector<float>(a_.size(), 0.0f));
}

}  // namespace
}  // namespace shardopt
