// The contract's later clauses, without a network: per-tensor param dtypes,
// per-group learning rates, resuming Adam's state, and the small wrong
// answers that once got the wrong code or changed state on a refusal.
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/initial_values.h"
#include "tests/testing/reference.h"
#include "tests/testing/store_fixture.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ReferenceTensor;
using testing::StoreTest;

constexpr AdamWHyper kHyper = testing::kDefaultHyper;

class ContractTest : public StoreTest {
 protected:
  // A push of whole tensors, each chunk in the dtype given for its tensor
  // (FP32 data as float, BF16 as bits).
  absl::StatusOr<v1::PushResponse> PushTyped(const std::string& job, uint64_t step, uint32_t rank,
                                             const std::map<std::string, std::vector<float>>& fp32,
                                             const std::map<std::string, std::vector<uint16_t>>& bf16) {
    auto session = StartPush(job, step, rank);
    if (!session.ok()) return session.status();
    for (const auto& [name, g] : fp32) {
      v1::GradChunk c;
      c.set_tensor(name);
      c.set_dtype(v1::FP32);
      c.set_data(g.data(), g.size() * 4);
      if (auto st = (*session)->Add(c); !st.ok()) return st;
    }
    for (const auto& [name, g] : bf16) {
      if (auto st = (*session)->Add(Chunk(name, 0, g.data(), g.size())); !st.ok()) return st;
    }
    return (*session)->Finish();
  }

  // A commit's params as raw bytes per tensor, with the dtype each came in.
  struct Streamed {
    std::map<std::string, std::string> bytes;
    std::map<std::string, v1::DType> dtype;
  };
  absl::StatusOr<Streamed> CommitRaw(const v1::CommitRequest& r) {
    Streamed out;
    auto st = store_.Commit(r, [&](const v1::ParamChunk& c) {
      out.dtype[c.tensor()] = c.dtype();
      std::string& b = out.bytes[c.tensor()];
      const size_t esize = c.dtype() == v1::FP32 ? 4 : 2;
      if (b.size() < (c.offset() * esize) + c.data().size()) b.resize(c.offset() * esize + c.data().size());
      std::memcpy(b.data() + c.offset() * esize, c.data().data(), c.data().size());
      return true;
    });
    if (!st.ok()) return st;
    return out;
  }

  static v1::CommitRequest CommitRequest(const std::string& job, uint64_t step, double lr,
                                         const std::vector<double>& group_lr = {}) {
    v1::CommitRequest r;
    r.set_job(job);
    r.set_step(step);
    r.set_lr(lr);
    r.set_gscale(1.0f);
    for (double g : group_lr) r.add_group_lr(g);
    return r;
  }
};

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

TEST_F(ContractTest, Fp32ParamsTakeFp32GradientsAndGetTheMasterBackBitwise) {
  // One fp32-param tensor and one bf16-param tensor in one job: the job keeps
  // fp32 slots, the bf16 pushes are widened, and each tensor's params come
  // back in its own dtype.
  v1::CreateJobRequest req = JobRequest("mixed", 2, {{"w", 5000}, {"g", 300}});
  req.mutable_tensors(0)->set_param_dtype(v1::FP32);
  auto init = Create(req);
  ReferenceTensor w(kHyper, init["w"], false), g(kHyper, init["g"], false);
  for (uint64_t t = 1; t <= 3; ++t) {
    std::vector<std::vector<float>> wg;
    std::vector<std::vector<uint16_t>> gg;
    for (uint32_t r = 0; r < 2; ++r) {
      wg.push_back(RandomFloats(rng_, 5000, -1, 1));
      gg.push_back(RandomBf16(rng_, 300, 1.0f));
    }
    std::vector<std::thread> ranks;  // each rank's push waits at the barrier for the other
    for (uint32_t r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] { EXPECT_TRUE(PushTyped("mixed", t, r, {{"w", wg[r]}}, {{"g", gg[r]}}).ok()); });
    }
    for (auto& th : ranks) th.join();
    auto streamed = CommitRaw(CommitRequest("mixed", t, 1e-3));
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    std::vector<float> sum(5000);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = wg[0][i] + wg[1][i];  // rank order, fp32
    w.StepAggregated(sum, 1e-3, 1.0f);
    g.Step({gg[0].data(), gg[1].data()}, 1e-3, 1.0f);
    EXPECT_EQ(streamed->dtype["w"], v1::FP32);
    EXPECT_EQ(streamed->dtype["g"], v1::DTYPE_UNSPECIFIED);  // bf16, as before param_dtype
    const std::vector<float> got = Floats(streamed->bytes["w"]);
    ASSERT_EQ(got.size(), w.p.size());
    EXPECT_EQ(std::memcmp(got.data(), w.p.data(), got.size() * 4), 0) << "step " << t;
    EXPECT_EQ(got, ReadFloats("mixed", "w", v1::MASTER));
    const std::vector<uint16_t> want = g.Params();
    ASSERT_EQ(streamed->bytes["g"].size(), want.size() * 2);
    EXPECT_EQ(std::memcmp(streamed->bytes["g"].data(), want.data(), want.size() * 2), 0) << "step " << t;
  }
}

TEST_F(ContractTest, EachTensorTakesOnlyItsOwnGradientDtype) {
  v1::CreateJobRequest req = JobRequest("dtypes", 1, {{"w", 64}, {"g", 64}});
  req.mutable_tensors(0)->set_param_dtype(v1::FP32);
  Create(req);
  const std::string before = Snapshot("dtypes");
  auto wrong = PushTyped("dtypes", 1, 0, {{"g", RandomFloats(rng_, 64, -1, 1)}}, {{"w", RandomBf16(rng_, 64, 1)}});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("takes BF16 gradients; this chunk is FP32"));
  EXPECT_EQ(Snapshot("dtypes"), before);
  EXPECT_TRUE(PushTyped("dtypes", 1, 0, {{"w", RandomFloats(rng_, 64, -1, 1)}}, {{"g", RandomBf16(rng_, 64, 1)}}).ok());
}

TEST_F(ContractTest, ParamDtypeBf16IsTheDefaultSpelledEitherWay) {
  v1::CreateJobRequest req = JobRequest("spelled", 1, {{"w", 64}});
  Create(req);
  req.mutable_tensors(0)->set_param_dtype(v1::BF16);
  auto attached = store_.CreateJob(req);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_FALSE(attached->created());
  req.mutable_tensors(0)->set_param_dtype(v1::FP32);
  EXPECT_EQ(store_.CreateJob(req).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(ContractTest, GroupLrReplacesLrPerGroupAndARetryMustRepeatIt) {
  v1::CreateJobRequest req = JobRequest("groups", 1, {{"a", 700}, {"b", 900}});
  *req.add_groups() = req.groups(0);
  req.mutable_groups(1)->set_weight_decay(0.0);
  req.mutable_groups(1)->set_lr_multiplier(0.5);  // still applies on top of group_lr
  req.mutable_tensors(1)->set_group(1);
  auto init = Create(req);
  AdamWHyper no_decay = kHyper;
  no_decay.weight_decay = 0.0;
  no_decay.lr_multiplier = 0.5;
  ReferenceTensor a(kHyper, init["a"], false), b(no_decay, init["b"], false);
  for (uint64_t t = 1; t <= 3; ++t) {
    const auto ga = RandomBf16(rng_, 700, 1), gb = RandomBf16(rng_, 900, 1);
    ASSERT_TRUE(Push("groups", t, 0, {{"a", ga}, {"b", gb}}).ok());
    const std::vector<double> lrs = {1e-3 * static_cast<double>(t), 3e-3 / static_cast<double>(t)};
    ASSERT_TRUE(CommitRaw(CommitRequest("groups", t, 7.0, lrs)).ok());  // lr is unused when group_lr is given
    a.Step({ga.data()}, lrs[0], 1.0f);
    b.Step({gb.data()}, lrs[1], 1.0f);
    EXPECT_EQ(ReadFloats("groups", "a", v1::MASTER), a.p) << "step " << t;
    EXPECT_EQ(ReadFloats("groups", "b", v1::MASTER), b.p) << "step " << t;
    // The same step again with other group lrs is a disagreement between ranks.
    const std::string before = Snapshot("groups");
    auto other = CommitRaw(CommitRequest("groups", t, 7.0, {lrs[0], lrs[1] * 2}));
    EXPECT_EQ(other.status().code(), absl::StatusCode::kAborted);
    EXPECT_EQ(CommitRaw(CommitRequest("groups", t, 7.0)).status().code(), absl::StatusCode::kAborted);
    EXPECT_EQ(Snapshot("groups"), before);
    EXPECT_TRUE(CommitRaw(CommitRequest("groups", t, 7.0, lrs)).ok());
  }
  const std::string before = Snapshot("groups");
  ASSERT_TRUE(Push("groups", 4, 0, {{"a", RandomBf16(rng_, 700, 1)}, {"b", RandomBf16(rng_, 900, 1)}}).ok());
  EXPECT_EQ(CommitRaw(CommitRequest("groups", 4, 1e-3, {1e-3})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CommitRaw(CommitRequest("groups", 4, 1e-3, {1e-3, -1})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Snapshot("groups"), before);
}

TEST_F(ContractTest, InitOfAdamStateResumesBitwiseAsTheUninterruptedRun) {
  const std::vector<testing::TensorDef> tensors = {{"w", 20000}, {"g", 77}};
  auto init = Create(JobRequest("whole", 1, tensors));
  std::vector<std::map<std::string, std::vector<uint16_t>>> grads;
  for (int t = 0; t < 6; ++t) grads.push_back({{"w", RandomBf16(rng_, 20000, 1)}, {"g", RandomBf16(rng_, 77, 1)}});
  // Two gradients whose (1 - beta2) g g passes fp32's range: their v is
  // +Inf from then on, a state the run reaches that the resume must take
  // back (a probe's state dict of one could not be loaded).
  const std::vector<uint16_t> huge = testing::ToBf16({1e22f, -3e21f});
  grads[0]["w"][5] = huge[0];
  grads[0]["w"][17] = huge[1];
  for (uint64_t t = 1; t <= 3; ++t) {
    ASSERT_TRUE(Push("whole", t, 0, grads[t - 1]).ok());
    ASSERT_TRUE(Commit("whole", t, 1e-3).ok());
  }
  const std::vector<float> v = ReadFloats("whole", "w", v1::EXP_AVG_SQ);
  ASSERT_EQ(v[5], std::numeric_limits<float>::infinity());
  ASSERT_EQ(v[17], std::numeric_limits<float>::infinity());
  ASSERT_TRUE(std::isfinite(ReadFloats("whole", "w", v1::MASTER)[5]));
  // A new job gets the first one's state at step 3 through Init alone.
  ASSERT_TRUE(store_.CreateJob(JobRequest("resumed", 1, tensors)).ok());
  for (const auto& t : tensors) {
    for (v1::StateKind kind : {v1::EXP_AVG, v1::EXP_AVG_SQ, v1::MASTER}) {
      const std::vector<float> values = ReadFloats("whole", t.name, kind);
      v1::InitChunk c;
      c.set_job("resumed");
      c.set_tensor(t.name);
      c.set_dtype(v1::FP32);
      c.set_kind(kind);
      c.set_adam_step(3);
      c.set_data(values.data(), values.size() * 4);
      auto written = store_.Init(c);
      ASSERT_EQ(written.value_or(0), t.numel) << written.status();
    }
  }
  for (uint64_t t = 4; t <= 6; ++t) {
    ASSERT_TRUE(Push("whole", t, 0, grads[t - 1]).ok());
    ASSERT_TRUE(Push("resumed", t - 3, 0, grads[t - 1]).ok());
    ASSERT_TRUE(Commit("whole", t, 1e-3).ok());
    ASSERT_TRUE(Commit("resumed", t - 3, 1e-3).ok());
  }
  for (const auto& t : tensors) {
    for (v1::StateKind kind : {v1::MASTER, v1::EXP_AVG, v1::EXP_AVG_SQ}) {
      EXPECT_EQ(ReadFloats("whole", t.name, kind), ReadFloats("resumed", t.name, kind)) << t.name << " " << kind;
    }
  }
  auto described = store_.Describe("resumed");
  ASSERT_TRUE(described.ok());
  for (const auto& ts : described->tensors()) EXPECT_EQ(ts.adam_step(), 6u) << ts.name();
}

TEST_F(ContractTest, InitRefusesNegativeSecondMomentsAndParamsAndChangesNothing) {
  Create(JobRequest("moments", 1, {{"w", 16}}));
  const std::string before = Snapshot("moments");
  std::vector<float> v = RandomFloats(rng_, 16, 0.1f, 1);
  v[5] = -v[5];
  v1::InitChunk c;
  c.set_job("moments");
  c.set_tensor("w");
  c.set_dtype(v1::FP32);
  c.set_kind(v1::EXP_AVG_SQ);
  c.set_data(v.data(), v.size() * 4);
  EXPECT_EQ(store_.Init(c).status().code(), absl::StatusCode::kInvalidArgument);
  // +Inf is a v a run reaches; NaN and -Inf are not.
  for (float never : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    v[5] = never;
    c.set_data(v.data(), v.size() * 4);
    EXPECT_EQ(store_.Init(c).status().code(), absl::StatusCode::kInvalidArgument) << never;
  }
  c.set_kind(v1::PARAM_BF16);
  v[5] = 0.25f;
  c.set_data(v.data(), v.size() * 4);
  EXPECT_EQ(store_.Init(c).status().code(), absl::StatusCode::kInvalidArgument);
  // A count the next update would wrap to 0 (bias correction 0: NaN state),
  // and the first one over the bound.
  c.set_kind(v1::EXP_AVG_SQ);
  for (uint64_t adam_step : {~uint64_t{0}, kMaxAdamStep + 1}) {
    c.set_adam_step(adam_step);
    EXPECT_EQ(store_.Init(c).status().code(), absl::StatusCode::kInvalidArgument) << adam_step;
  }
  EXPECT_EQ(Snapshot("moments"), before);
  c.set_adam_step(kMaxAdamStep);
  EXPECT_TRUE(store_.Init(c).ok());
}

// no_grad names are resolved as they arrive: an unknown one is refused at
// its chunk, not after the stream has sent all it likes; a stream names at
// most as many as the job has tensors (INVALID_ARGUMENT past that); and a
// repeat within that costs nothing (the session keeps one bit per tensor).
TEST_F(ContractTest, NoGradNamesAreCheckedAsTheyArriveAndRepeatsCountOnce) {
  auto init = Create(JobRequest("nograd", 1, {{"a", 100}, {"b", 100}}));
  const std::string before = Snapshot("nograd");
  {
    auto session = StartPush("nograd", 1, 0);
    ASSERT_TRUE(session.ok());
    v1::GradChunk names;
    names.add_no_grad("b");
    ASSERT_TRUE((*session)->Add(names).ok());
    v1::GradChunk unknown;
    unknown.add_no_grad(std::string(100, 'x'));
    const absl::Status refused = (*session)->Add(unknown);
    EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(std::string(refused.message()), HasSubstr("which job 'nograd' lacks"));
  }
  {
    auto session = StartPush("nograd", 1, 0);
    ASSERT_TRUE(session.ok());
    v1::GradChunk flood;
    for (int i = 0; i < 60000; ++i) flood.add_no_grad("b");
    const absl::Status refused = (*session)->Add(flood);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()), HasSubstr("names 60000 no_grad tensors; job 'nograd' has 2"));
  }
  EXPECT_EQ(Snapshot("nograd"), before);
  // The repeats declared `b` once: a push of `a` alone with them seals.
  const auto ga = RandomBf16(rng_, 100, 1);
  auto session = StartPush("nograd", 1, 0);
  ASSERT_TRUE(session.ok());
  v1::GradChunk names;
  names.add_no_grad("b");
  names.add_no_grad("b");  // a repeat, within the job's two tensors
  ASSERT_TRUE((*session)->Add(names).ok());
  ASSERT_TRUE((*session)->Add(Chunk("a", 0, ga.data(), 100)).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(Commit("nograd", 1, 1e-3).ok());
  ReferenceTensor a(kHyper, init["a"], false);
  a.Step({ga.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("nograd", "a", v1::MASTER), a.p);
  EXPECT_EQ(ReadFloats("nograd", "b", v1::MASTER), init["b"]);
}

// A stream refused halfway must leave the round as if it never came: here
// the valid chunk of `b` it sent first once made the rank's next push, which
// declares `b` without a gradient, fail as "both pushed and declared".
TEST_F(ContractTest, ARefusedPushStreamLeavesNothingInTheRound) {
  auto init = Create(JobRequest("refused", 1, {{"a", 100}, {"b", 100}}));
  {
    auto session = StartPush("refused", 1, 0);
    ASSERT_TRUE(session.ok());
    const auto gb = RandomBf16(rng_, 100, 1);
    ASSERT_TRUE((*session)->Add(Chunk("b", 0, gb.data(), 100)).ok());
    v1::GradChunk odd = Chunk("b", 0, gb.data(), 1);
    odd.mutable_data()->resize(1);
    EXPECT_EQ((*session)->Add(odd).code(), absl::StatusCode::kInvalidArgument);
  }  // the service drops the session with the stream
  const auto ga = RandomBf16(rng_, 100, 1);
  auto pushed = Push("refused", 1, 0, {{"a", ga}}, 1000, 0, {"b"});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(Commit("refused", 1, 1e-3).ok());
  ReferenceTensor a(kHyper, init["a"], false);
  a.Step({ga.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("refused", "a", v1::MASTER), a.p);
  EXPECT_EQ(ReadFloats("refused", "b", v1::MASTER), init["b"]);  // no gradient: unchanged
}

// A push that sent no chunk and did not declare every tensor no_grad is
// refused before it starts the barrier round: no round is left running,
// whose deadline would count from the refused push.
TEST_F(ContractTest, AnEmptyPushRefusedStartsNoRound) {
  Create(JobRequest("empty", 2, {{"a", 100}}));
  {
    auto session = StartPush("empty", 1, 0);
    ASSERT_TRUE(session.ok());
    v1::GradChunk head;
    head.set_job("empty");
    head.set_step(1);
    head.set_rank(0);
    ASSERT_TRUE((*session)->Add(head).ok());
    auto finished = (*session)->Finish();
    EXPECT_EQ(finished.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(finished.status().message()), HasSubstr("ended without tensor 'a'"));
  }
  auto commit = Commit("empty", 1, 1e-3);
  EXPECT_EQ(commit.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(commit.status().message()), HasSubstr("no rank has pushed step 1"));
}

// An abandoned stream must not undo a newer stream of the same rank (a
// retry that overtook it) nor a push that finished.
TEST_F(ContractTest, AnAbandonedStreamLeavesANewerStreamsChunksAlone) {
  Create(JobRequest("overtaken", 2, {{"a", 100}}));
  const auto ga = RandomBf16(rng_, 100, 1);
  auto old_stream = StartPush("overtaken", 1, 0);
  ASSERT_TRUE(old_stream.ok());
  ASSERT_TRUE((*old_stream)->Add(Chunk("a", 0, ga.data(), 50)).ok());
  auto retry = StartPush("overtaken", 1, 0);
  ASSERT_TRUE(retry.ok());
  ASSERT_TRUE((*retry)->Add(Chunk("a", 0, ga.data(), 100)).ok());
  old_stream->reset();  // the old stream's end arrives late
  // Rank 0's retry still finishes: its coverage survived. Rank 1 completes the round.
  std::thread rank1([&] { EXPECT_TRUE(Push("overtaken", 1, 1, {{"a", RandomBf16(rng_, 100, 1)}}).ok()); });
  auto answer = (*retry)->Finish();
  rank1.join();
  EXPECT_TRUE(answer.ok()) << answer.status();
}

TEST_F(ContractTest, GroupNamesAreForMessagesOnly) {
  v1::CreateJobRequest req = JobRequest("named", 1, {{"w", 64}});
  req.mutable_groups(0)->set_name("decay");
  Create(req);
  req.mutable_groups(0)->set_name("another name");
  auto attached = store_.CreateJob(req);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_FALSE(attached->created());
}

TEST_F(ContractTest, NamesOverTheCapAreRefusedAndEchoedShort) {
  const std::string long_name(201, 'j');
  auto too_long = store_.CreateJob(JobRequest(long_name, 1, {{"w", 64}}));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(too_long.status().message().size(), 300u);
  // 100 bytes, but 300 once %-escaped for the checkpoint directory.
  EXPECT_EQ(store_.CreateJob(JobRequest(std::string(100, '/'), 1, {{"w", 64}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_.CreateJob(JobRequest("t", 1, {{std::string(201, 't'), 64}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_.CreateJob(JobRequest(std::string(200, 'j'), 1, {{std::string(200, 't'), 64}})).ok());
  // Unknown names of any length come back cut short.
  const std::string huge(8192, 'x');
  auto missing = store_.Describe(huge);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(missing.status().message().size(), 200u);
  Create(JobRequest("known", 1, {{"w", 64}}));
  v1::ReadRequest read;
  read.set_job("known");
  read.set_tensor(huge);
  read.set_kind(v1::MASTER);
  auto st = store_.Read(read, [](const v1::StateChunk&) { return true; });
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(st.message().size(), 200u);
}

TEST_F(ContractTest, AReadAtTheShardsEndIsOutOfRange) {
  v1::CreateJobRequest req = JobRequest("ends", 1, {{"w", 8192}});
  v1::ShardRange* shard = req.add_shards();
  shard->set_tensor("w");
  shard->set_offset(4096);
  shard->set_length(4096);
  ASSERT_TRUE(store_.CreateJob(req).ok());
  v1::ReadRequest read;
  read.set_job("ends");
  read.set_tensor("w");
  read.set_kind(v1::MASTER);
  int chunks = 0;
  auto count = [&](const v1::StateChunk&) { ++chunks; return true; };
  read.set_offset(8192);
  EXPECT_EQ(store_.Read(read, count).code(), absl::StatusCode::kOutOfRange);
  read.set_offset(4096 + 4095);  // the shard's last element: one element, OK
  EXPECT_TRUE(store_.Read(read, count).ok());
  EXPECT_EQ(chunks, 1);
}

// The caps on one CreateJob: more tensors, groups (one per tensor at most)
// or ranks than the server takes is
// RESOURCE_EXHAUSTED naming the flag, before anything is built, and leaves
// no job behind; at the cap it is accepted.
class CapsTest : public StoreTest {
 protected:
  CapsTest() : StoreTest(Options()) {}
  static JobStoreOptions Options() {
    JobStoreOptions o;
    o.max_tensors_per_job = 3;
    o.max_world_size = 4;
    o.max_name_bytes = 8;
    return o;
  }
};

TEST_F(CapsTest, TensorsAndRanksOverTheServersCapsAreRefusedAndBuildNothing) {
  auto tensors = store_.CreateJob(JobRequest("wide", 1, {{"a", 10}, {"b", 10}, {"c", 10}, {"d", 10}}));
  EXPECT_EQ(tensors.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(tensors.status().message()), HasSubstr("at most 3 (--max_tensors_per_job)"));
  v1::CreateJobRequest grouped = JobRequest("grouped", 1, {{"a", 10}});
  for (int g = 0; g < 3; ++g) *grouped.add_groups() = grouped.groups(0);
  auto groups = store_.CreateJob(grouped);
  EXPECT_EQ(groups.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(groups.status().message()), HasSubstr("4 groups; this server takes at most 3"));
  EXPECT_EQ(store_.Describe("grouped").status().code(), absl::StatusCode::kNotFound);
  auto ranks = store_.CreateJob(JobRequest("many", 5, {{"a", 10}}));
  EXPECT_EQ(ranks.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(ranks.status().message()), HasSubstr("at most 4 (--max_world_size)"));
  EXPECT_EQ(store_.Describe("wide").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.Describe("many").status().code(), absl::StatusCode::kNotFound);
  auto named = store_.CreateJob(JobRequest("named", 1, {{"a-long-name", 10}}));
  EXPECT_EQ(named.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(named.status().message()), HasSubstr("at most 8 (--max_name_bytes)"));
  const auto long_job = store_.CreateJob(JobRequest("job-name-9", 1, {{"a", 10}}));
  EXPECT_EQ(long_job.status().code(), absl::StatusCode::kInvalidArgument);
  // Shown whole, so without an ellipsis.
  EXPECT_THAT(std::string(long_job.status().message()), HasSubstr("job name 'job-name-9' (10 bytes) is longer"));
  EXPECT_EQ(store_.Describe("named").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_.CreateJob(JobRequest("fits", 4, {{"a", 10}, {"b", 10}, {"c", 10}})).ok());
}

TEST_F(ContractTest, TheDefaultCapRefusesAJobOfManyTinyTensors) {
  std::vector<testing::TensorDef> tiny;
  for (int i = 0; i < 20000; ++i) tiny.push_back({absl::StrCat("t", i), 1});
  auto r = store_.CreateJob(JobRequest("tiny", 1, tiny));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("at most 16384"));
}

}  // namespace
}  // namespace shardopt
