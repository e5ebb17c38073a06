// Client::InitMany and Client::ReadMany against two real server processes:
// many tensors' values, or many ranges of their state, in one call. Values
// written are read back bitwise and step as a scalar reference does from
// them; ranges read (tensors split between the servers, ranges that cross
// the split, bf16 params and fp32 master and moments) are bitwise the
// state the reference reaches, in buffers poisoned beforehand; and a call
// with one bad value or range anywhere writes or reads nothing.
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "shardopt/client.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/reference.h"
#include "tests/testing/scripted_trainer.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using testing::RandomBf16;
using testing::RandomFloats;
using testing::ReferenceTensor;
using testing::ServerProcess;

// Over two servers (each tensor starts 4096-aligned in the flat space, which
// is split at a 4096-element block): "a" on the first, "b" split between
// them at its element 4096, "c" on the second.
const std::vector<std::pair<std::string, uint64_t>> kTensors = {{"a", 5000}, {"b", 10000}, {"c", 300}};

class ManyTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    servers_ = testing::StartServers(2, "");
    ClientOptions o;
    o.servers = {servers_[0]->address(), servers_[1]->address()};
    o.max_attempts = 1;
    client_ = Client::Connect(o).value();
    JobOptions job;
    job.name = "read-many";
    job.world_size = 1;
    job.groups = {GroupOptions{}};
    for (const auto& [name, numel] : kTensors) job.tensors.push_back({name, numel, 0});
    ASSERT_TRUE(client_->CreateOrAttach(job).ok());
  }

  // Random initial values, each tensor by InitFp32, and three random steps,
  // which the references take too.
  void InitAndStep() {
    std::mt19937_64 rng(20261206);
    for (const auto& [name, numel] : kTensors) {
      auto init = RandomFloats(rng, numel, -1.0f, 1.0f);
      ASSERT_TRUE(client_->InitFp32(name, init.data()).ok());
      refs_.emplace_back(testing::kDefaultHyper, init, false);
    }
    for (int step = 0; step < 3; ++step) ASSERT_NO_FATAL_FAILURE(Step(rng, refs_));
  }

  // One step of random gradients, taken by the job and by `refs` (in
  // kTensors order).
  void Step(std::mt19937_64& rng, std::vector<ReferenceTensor>& refs) {
    std::vector<std::vector<uint16_t>> grads;
    std::vector<GradView> views;
    for (const auto& [name, numel] : kTensors) grads.push_back(RandomBf16(rng, numel, 1.0f));
    for (size_t t = 0; t < kTensors.size(); ++t) views.push_back({kTensors[t].first, grads[t].data()});
    StepOptions so;
    so.lr = 1e-2;
    auto r = client_->Step(views, so, {});
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t t = 0; t < kTensors.size(); ++t) refs[t].Step({grads[t].data()}, so.lr, r->decision.gscale);
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::unique_ptr<Client> client_;
  std::vector<ReferenceTensor> refs_;  // in kTensors order

  uint32_t Uninitialized() { return testing::UninitializedParts(*client_); }
};

// The reference's values of one state, as the read returns them: float bits
// for master and moments, bf16 bits for params.
std::vector<uint8_t> Expected(const ReferenceTensor& ref, StateToRead what, uint64_t offset, uint64_t count) {
  std::vector<uint8_t> out;
  if (what == StateToRead::kParamBf16) {
    const std::vector<uint16_t> p = ref.Params();
    const auto* b = reinterpret_cast<const uint8_t*>(p.data() + offset);
    return std::vector<uint8_t>(b, b + count * 2);
  }
  const std::vector<float>& v = what == StateToRead::kMaster ? ref.p : what == StateToRead::kExpAvg ? ref.m : ref.v;
  const auto* b = reinterpret_cast<const uint8_t*>(v.data() + offset);
  return std::vector<uint8_t>(b, b + count * 4);
}

TEST_F(ManyTensorsTest, EveryRangeReadIsTheReferencesBitwise) {
  ASSERT_NO_FATAL_FAILURE(InitAndStep());
  struct Range {
    size_t tensor;
    StateToRead what;
    uint64_t offset, count;
  };
  std::vector<Range> ranges;
  for (size_t t = 0; t < kTensors.size(); ++t) {
    for (StateToRead what : {StateToRead::kMaster, StateToRead::kExpAvg, StateToRead::kExpAvgSq,
                             StateToRead::kParamBf16}) {
      ranges.push_back({t, what, 0, kTensors[t].second});
    }
  }
  ranges.push_back({1, StateToRead::kMaster, 3900, 500});  // across the servers' split
  ranges.push_back({1, StateToRead::kExpAvg, 4096, 1});    // the second server's first element of it
  ranges.push_back({1, StateToRead::kExpAvgSq, 4095, 1});  // the first server's last
  ranges.push_back({0, StateToRead::kMaster, 0, 1});       // "a" again, in the same call
  ranges.push_back({2, StateToRead::kMaster, 300, 0});     // nothing, at the end
  std::vector<std::vector<uint8_t>> out;
  std::vector<StateRead> reads;
  for (const Range& r : ranges) {
    const size_t esize = r.what == StateToRead::kParamBf16 ? 2 : 4;
    out.emplace_back(r.count * esize + 8, 0xA5);  // poisoned, with 8 bytes past the range that must stay so
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    reads.push_back({kTensors[ranges[i].tensor].first, ranges[i].what, ranges[i].offset, ranges[i].count,
                     out[i].data()});
  }
  ASSERT_TRUE(client_->ReadMany(reads).ok());
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    const std::vector<uint8_t> want = Expected(refs_[r.tensor], r.what, r.offset, r.count);
    EXPECT_EQ(std::vector<uint8_t>(out[i].begin(), out[i].begin() + want.size()), want) << "range " << i;
    EXPECT_EQ(std::vector<uint8_t>(out[i].begin() + want.size(), out[i].end()), std::vector<uint8_t>(8, 0xA5))
        << "range " << i << " wrote past its end";
  }
}

TEST_F(ManyTensorsTest, OneBadRangeAnywhereReadsNothing) {
  ASSERT_NO_FATAL_FAILURE(InitAndStep());
  std::vector<float> a(5000, NAN), c(300, NAN), b(1001, NAN);
  const std::vector<std::pair<StateRead, absl::StatusCode>> bad = {
      {{"b", StateToRead::kMaster, 9000, 1001, b.data()}, absl::StatusCode::kOutOfRange},
      {{"b", StateToRead::kMaster, 10001, 0, nullptr}, absl::StatusCode::kOutOfRange},
      {{"nope", StateToRead::kMaster, 0, 1, c.data()}, absl::StatusCode::kNotFound},
      {{"b", StateToRead::kMaster, 0, 1, nullptr}, absl::StatusCode::kInvalidArgument},
      {{"b", static_cast<StateToRead>(9), 0, 1, b.data()}, absl::StatusCode::kInvalidArgument},
  };
  for (const auto& [read, code] : bad) {
    const std::vector<StateRead> reads = {{"a", StateToRead::kMaster, 0, 5000, a.data()},
                                          read,
                                          {"c", StateToRead::kExpAvg, 0, 300, c.data()}};
    EXPECT_EQ(client_->ReadMany(reads).code(), code) << read.tensor << " " << read.offset << " " << read.count;
    for (float x : a) ASSERT_TRUE(std::isnan(x)) << "a read went ahead of the check";
    for (float x : c) ASSERT_TRUE(std::isnan(x)) << "a read went ahead of the check";
    for (float x : b) ASSERT_TRUE(std::isnan(x)) << "a read went ahead of the check";
  }
}

// A tensor's values for InitMany (C++17: no designated initializers).
TensorValues Of(const std::string& tensor, const float* fp32, const uint16_t* bf16 = nullptr,
                const float* exp_avg = nullptr, const float* exp_avg_sq = nullptr, uint64_t adam_step = 0) {
  TensorValues t;
  t.tensor = tensor;
  t.fp32 = fp32;
  t.bf16 = bf16;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.adam_step = adam_step;
  return t;
}

// "a" a fp32 master and moments at Adam step 5, "b" a bf16 master only,
// "c" a fp32 master and moments at Adam step 7: all in one InitMany.
struct Values {
  std::vector<float> a, a_m, a_v, c, c_m, c_v;
  std::vector<uint16_t> b;

  explicit Values(std::mt19937_64& rng)
      : a(RandomFloats(rng, 5000, -1, 1)), a_m(RandomFloats(rng, 5000, -0.1f, 0.1f)),
        a_v(RandomFloats(rng, 5000, 1e-6f, 1e-2f)), c(RandomFloats(rng, 300, -1, 1)),
        c_m(RandomFloats(rng, 300, -0.1f, 0.1f)), c_v(RandomFloats(rng, 300, 1e-6f, 1e-2f)),
        b(RandomBf16(rng, 10000, 1.0f)) {}
  std::vector<TensorValues> Many() const {
    return {Of("a", a.data(), nullptr, a_m.data(), a_v.data(), 5), Of("b", nullptr, b.data()),
            Of("c", c.data(), nullptr, c_m.data(), c_v.data(), 7)};
  }
};

std::vector<float> Widened(const std::vector<uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (size_t i = 0; i < bf16.size(); ++i) out[i] = math::bf16_to_float(bf16[i]);
  return out;
}

TEST_F(ManyTensorsTest, InitManyWritesEveryTensorsValuesAndTheyStepAsTheReference) {
  std::mt19937_64 rng(7);
  const Values values(rng);
  ASSERT_EQ(Uninitialized(), 4u);  // a and b's first part on one server, b's second part and c on the other
  ASSERT_TRUE(client_->InitMany(values.Many()).ok());
  EXPECT_EQ(Uninitialized(), 0u);
  EXPECT_EQ(client_->AdamSteps().value(), (std::vector<uint64_t>{5, 0, 7}));

  std::vector<ReferenceTensor> refs = {{testing::kDefaultHyper, values.a, false},
                                       {testing::kDefaultHyper, Widened(values.b), false},
                                       {testing::kDefaultHyper, values.c, false}};
  refs[0].m = values.a_m, refs[0].v = values.a_v, refs[0].adam_step = 5;
  refs[2].m = values.c_m, refs[2].v = values.c_v, refs[2].adam_step = 7;
  ASSERT_NO_FATAL_FAILURE(Step(rng, refs));

  for (size_t t = 0; t < kTensors.size(); ++t) {
    const uint64_t n = kTensors[t].second;
    std::vector<float> p(n, NAN), m(n, NAN), v(n, NAN);
    ASSERT_TRUE(client_->ReadMany({{kTensors[t].first, StateToRead::kMaster, 0, n, p.data()},
                                   {kTensors[t].first, StateToRead::kExpAvg, 0, n, m.data()},
                                   {kTensors[t].first, StateToRead::kExpAvgSq, 0, n, v.data()}})
                    .ok());
    EXPECT_EQ(std::memcmp(p.data(), refs[t].p.data(), n * 4), 0) << kTensors[t].first;
    EXPECT_EQ(std::memcmp(m.data(), refs[t].m.data(), n * 4), 0) << kTensors[t].first;
    EXPECT_EQ(std::memcmp(v.data(), refs[t].v.data(), n * 4), 0) << kTensors[t].first;
  }
  EXPECT_EQ(client_->AdamSteps().value(), (std::vector<uint64_t>{6, 1, 8}));
}

// Shares as ranks send them (InitShare{r, W}): each a slice of every part,
// the parts lacking values until the last share is in, then bitwise whole.
TEST_F(ManyTensorsTest, InitManyInSharesTilesEveryTensor) {
  std::mt19937_64 rng(13);
  const Values values(rng);
  ASSERT_TRUE(client_->InitMany(values.Many(), {0, 3}).ok());
  ASSERT_TRUE(client_->InitMany(values.Many(), {2, 3}).ok());
  EXPECT_EQ(Uninitialized(), 4u);
  ASSERT_TRUE(client_->InitMany(values.Many(), {1, 3}).ok());
  EXPECT_EQ(Uninitialized(), 0u);
  std::vector<float> a(5000, NAN), a_v(5000, NAN), b(10000, NAN), c_m(300, NAN);
  ASSERT_TRUE(client_->ReadMany({{"a", StateToRead::kMaster, 0, 5000, a.data()},
                                 {"a", StateToRead::kExpAvgSq, 0, 5000, a_v.data()},
                                 {"b", StateToRead::kMaster, 0, 10000, b.data()},
                                 {"c", StateToRead::kExpAvg, 0, 300, c_m.data()}})
                  .ok());
  EXPECT_EQ(std::memcmp(a.data(), values.a.data(), a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a_v.data(), values.a_v.data(), a_v.size() * 4), 0);
  EXPECT_EQ(std::memcmp(b.data(), Widened(values.b).data(), b.size() * 4), 0);
  EXPECT_EQ(std::memcmp(c_m.data(), values.c_m.data(), c_m.size() * 4), 0);
}

TEST_F(ManyTensorsTest, InitManyWithOneBadValueAnywhereWritesNothing) {
  std::mt19937_64 rng(11);
  Values values(rng);
  values.c_v.back() = NAN;  // the last value of the last tensor
  auto many = values.Many();
  EXPECT_EQ(client_->InitMany(many).code(), absl::StatusCode::kInvalidArgument);
  values.c_v.back() = 1e-3f;
  values.a_v[17] = -1e-3f;  // a negative second moment
  EXPECT_EQ(client_->InitMany(many).code(), absl::StatusCode::kInvalidArgument);
  values.a_v[17] = 1e-3f;
  const std::vector<std::pair<TensorValues, absl::StatusCode>> bad = {
      {Of("b", values.c.data(), values.b.data()), absl::StatusCode::kInvalidArgument},
      {Of("c", nullptr, nullptr, values.c_m.data()), absl::StatusCode::kInvalidArgument},
      {Of("c", nullptr, nullptr, nullptr, values.c_v.data()), absl::StatusCode::kInvalidArgument},
      {Of("c", nullptr), absl::StatusCode::kInvalidArgument},
      {Of("c", values.c.data(), nullptr, nullptr, nullptr, 3), absl::StatusCode::kInvalidArgument},
      {Of("c", nullptr, nullptr, values.c_m.data(), values.c_v.data(), (1ull << 53) + 1),
       absl::StatusCode::kInvalidArgument},
      {Of("nope", values.c.data()), absl::StatusCode::kNotFound},
  };
  for (const auto& [last, code] : bad) {
    many = values.Many();
    many.back() = last;
    EXPECT_EQ(client_->InitMany(many).code(), code) << last.tensor;
  }
  EXPECT_EQ(Uninitialized(), 4u) << "a value went ahead of the check";
  EXPECT_EQ(client_->AdamSteps().value(), (std::vector<uint64_t>{0, 0, 0}));
  ASSERT_TRUE(client_->InitMany(values.Many()).ok());  // the same, mended
  EXPECT_EQ(Uninitialized(), 0u);
}

}  // namespace
}  // namespace shardopt
