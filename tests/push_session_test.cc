// PushSession on a Job of its own: what a push message of packed chunks
// (GradChunk.more) holds against the job's window while part of it waits.
// Its bytes stay alive while any piece of them waits, so the whole message
// counts (Job::held_bytes), the chunks already folded and those queued
// behind the waiting one too; and it is let go once the message is taken.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/pieces.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "server/job_spec.h"
#include "server/memory_budget.h"
#include "server/push_session.h"
#include "server/wakeups.h"
#include "tests/testing/store_fixture.h"

namespace shardopt {
namespace {

using testing::RandomBf16;
using testing::StoreTest;

constexpr int kTensors = 8;
constexpr uint64_t kNumel = 16384;  // one block each: 32 KiB of bf16

class PushSessionTest : public StoreTest {
 protected:
  // Two ranks, the least window a job is given (two fp32 blocks), and
  // every shard taken as initialized (the values are not read here).
  void SetUp() override {
    std::vector<testing::TensorDef> tensors;
    for (int i = 0; i < kTensors; ++i) tensors.push_back({absl::StrCat("t", i), kNumel});
    auto spec = NormalizeJobSpec(JobRequest("held", 2, tensors), absl::Seconds(10));
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto job = Job::Create(*spec, backend_.get(), 1, &wakeups_, &budget_, &tenants_, JobOwner{});
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *std::move(job);
    absl::MutexLock lock(&job_->mu);
    job_->uninitialized_shards = 0;
  }

  uint64_t Held() {
    absl::MutexLock lock(&job_->mu);
    return job_->held_bytes;
  }

  MemoryBudget budget_{uint64_t{1} << 30};
  TenantLedger tenants_;
  Wakeups wakeups_;
  std::shared_ptr<Job> job_;
};

TEST_F(PushSessionTest, AWaitingPackedMessageIsHeldWholeUntilItIsTaken) {
  v1::GradChunk first;
  first.set_job("held");
  first.set_step(1);
  first.set_rank(1);
  auto session = PushSession::Begin(job_, first);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<GradPart> parts;
  for (int i = 0; i < kTensors; ++i) {
    const std::vector<uint16_t> g = RandomBf16(rng_, kNumel, 1.0f);
    v1::GradChunk head;
    head.set_tensor(absl::StrCat("t", i));
    head.set_dtype(v1::BF16);
    parts.push_back({head, Pieces::Own(std::string(reinterpret_cast<const char*>(g.data()), kNumel * 2))});
  }
  GradPart own = std::move(parts.front());
  parts.erase(parts.begin());
  // Rank 1 is not next: its chunks wait in the window, which holds two
  // fp32 blocks' bytes, four of the eight.
  auto taken = (*session)->Offer(own.head, own.data, std::move(parts), [] {});
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_FALSE(*taken);
  EXPECT_EQ(Held(), kTensors * kNumel * 2);
  session->reset();  // cut off: what it held goes back
  EXPECT_EQ(Held(), 0u);
}

}  // namespace
}  // namespace shardopt
