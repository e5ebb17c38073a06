// Client::ReadMany against two real server processes: many ranges of many
// tensors in one call, each bitwise the state a scalar reference reaches
// (tensors split between the servers, ranges that cross the split, bf16
// params and fp32 master and moments), into buffers poisoned beforehand;
// and a call with one bad range anywhere reads nothing.
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "tests/testing/reference.h"
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

class ReadManyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      servers_.push_back(ServerProcess::Start({"--threads=1"}));
      ASSERT_NE(servers_.back(), nullptr);
    }
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
    std::mt19937_64 rng(20261206);
    for (const auto& [name, numel] : kTensors) {
      auto init = RandomFloats(rng, numel, -1.0f, 1.0f);
      ASSERT_TRUE(client_->InitFp32(name, init.data()).ok());
      refs_.emplace_back(testing::kDefaultHyper, init, false);
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<uint16_t>> grads;
      std::vector<GradView> views;
      for (const auto& [name, numel] : kTensors) grads.push_back(RandomBf16(rng, numel, 1.0f));
      for (size_t t = 0; t < kTensors.size(); ++t) views.push_back({kTensors[t].first, grads[t].data()});
      StepOptions so;
      so.lr = 1e-2;
      auto r = client_->Step(views, so, {});
      ASSERT_TRUE(r.ok()) << r.status();
      for (size_t t = 0; t < kTensors.size(); ++t) refs_[t].Step({grads[t].data()}, so.lr, r->decision.gscale);
    }
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::unique_ptr<Client> client_;
  std::vector<ReferenceTensor> refs_;  // in kTensors order
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

TEST_F(ReadManyTest, EveryRangeOfEveryTensorIsTheReferencesBitwise) {
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

TEST_F(ReadManyTest, OneBadRangeAnywhereReadsNothing) {
  std::vector<float> a(5000, NAN), c(300, NAN), b(1001, NAN);
  const std::vector<std::pair<StateRead, absl::StatusCode>> bad = {
      {{"b", StateToRead::kMaster, 9000, 1001, b.data()}, absl::StatusCode::kOutOfRange},
      {{"b", StateToRead::kMaster, 10001, 0, nullptr}, absl::StatusCode::kOutOfRange},
      {{"nope", StateToRead::kMaster, 0, 1, c.data()}, absl::StatusCode::kNotFound},
      {{"b", StateToRead::kMaster, 0, 1, nullptr}, absl::StatusCode::kInvalidArgument},
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

}  // namespace
}  // namespace shardopt
