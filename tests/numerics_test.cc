// The per-element contract, the CPU backend against it, and the bits that must
// not depend on threads, instruction set or rank count.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/step_scalars.h"
#include "tests/testing/reference.h"

namespace shardopt {
namespace {

using testing::RandomBf16;
using testing::RandomFloats;
using testing::ReferenceTensor;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 rounding by a different route: pick the nearer of the two bf16
// neighbours in double, ties to the even one.
uint16_t SlowBf16(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((Bits(f) >> 16) | 0x40);
  const uint32_t u = Bits(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);
  if ((u & 0xFFFF) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);  // away from zero, in magnitude
  const double x = f;
  const double dd = std::fabs(x - static_cast<double>(FromBits(uint32_t{down} << 16)));
  const double upv = (up & 0x7F80) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), x)  // past max: Inf's slot
                                             : static_cast<double>(FromBits(uint32_t{up} << 16));
  const double du = std::fabs(upv - x);
  if (dd < du) return down;
  if (du < dd) return up;
  return (down & 1) ? up : down;
}

TEST(Bf16, RoundsToNearestEvenOnEdgeCases) {
  struct Case {
    uint32_t in;
    uint16_t out;
  } cases[] = {
      {0x3F800000, 0x3F80},  // 1.0
      {0x3F808000, 0x3F80},  // tie, even stays
      {0x3F818000, 0x3F82},  // tie, odd rounds up
      {0x3F808001, 0x3F81},  // just above the tie
      {0x7F800000, 0x7F80},  // +Inf
      {0xFF800000, 0xFF80},  // -Inf
      {0x7F7FFFFF, 0x7F80},  // FLT_MAX overflows to Inf
      {0x00000001, 0x0000},  // smallest subnormal rounds to +0
      {0x00018000, 0x0002},  // subnormal tie, odd rounds up
      {0x80000000, 0x8000},  // -0 keeps its sign
      {0x7FC00001, 0x7FC0},  // quiet NaN
      {0x7F800001, 0x7FC0},  // signalling NaN with low payload stays NaN, quiet
      {0xFF810000, 0xFFC1},  // negative NaN keeps sign and payload top bits
  };
  for (const Case& c : cases) {
    EXPECT_EQ(math::float_to_bf16(FromBits(c.in)), c.out) << std::hex << c.in;
    EXPECT_EQ(SlowBf16(FromBits(c.in)), c.out) << "slow reference disagrees on " << std::hex << c.in;
  }
}

TEST(Bf16, MatchesSlowReferenceOnRandomBitPatterns) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < (1 << 22); ++i) {
    const float f = FromBits(static_cast<uint32_t>(rng()));
    const uint16_t got = math::float_to_bf16(f);
    ASSERT_EQ(got, SlowBf16(f)) << std::hex << Bits(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(math::bf16_to_float(got)));
    }
  }
}

// The formula of docs/design.md (section 3) evaluated in double, with the
// step's scalars in double.
struct Float64Adam {
  std::vector<double> p, m, v;
  void Step(const AdamWHyper& h, const std::vector<uint16_t>& grad, double lr, double gscale, uint64_t t) {
    const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = math::bf16_to_float(grad[i]) * gscale;
      p[i] *= 1 - lr * h.weight_decay;
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      p[i] -= lr / bc1 * (m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps));
    }
  }
};

struct Job {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<JobState> state;
};

std::vector<ShardStep> WholeShardZero(const math::AdamWScalars& scalars) {
  ShardStep step;
  step.grads.shard = 0;
  step.grads.ranks = {0};
  step.scalars = scalars;
  return {step};
}

Job MakeJob(const CpuBackendOptions& opts, std::vector<uint64_t> numels, Precision precision, uint32_t world,
            DType grad_dtype = DType::kBf16) {
  Job job;
  job.backend = MakeCpuBackend(opts);
  JobLayout layout;
  layout.world_size = world;
  layout.grad_dtype = grad_dtype;
  for (uint64_t n : numels) layout.shards.push_back({n, precision});
  job.state = job.backend->Allocate(layout).value();
  return job;
}

std::vector<float> ReadFloats(const JobState& s, uint32_t shard, StateKind kind, uint64_t n) {
  std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());  // poisoned
  EXPECT_TRUE(s.ReadState(shard, kind, 0, n, DType::kFp32, out.data()).ok());
  return out;
}

std::vector<uint16_t> ReadParams(const JobState& s, uint32_t shard, uint64_t n) {
  std::vector<uint16_t> out(n, 0xFFFF);  // poisoned: a NaN no update writes
  EXPECT_TRUE(s.ReadState(shard, StateKind::kParamBf16, 0, n, DType::kBf16, out.data()).ok());
  return out;
}

TEST(CpuBackend, AgreesWithFloat64ReferenceWithinStatedBound) {
  constexpr size_t kN = 20000;
  constexpr int kSteps = 200;
  std::mt19937_64 rng(11);
  const AdamWHyper h{0.9, 0.999, 1e-8f, 0.01, 1.0};
  const std::vector<float> init = RandomFloats(rng, kN, -1, 1);
  Job job = MakeJob({}, {kN}, Precision::kFp32, 1);
  ASSERT_TRUE(job.state->WriteState(0, StateKind::kMaster, 0, DType::kFp32, init.data(), kN).ok());
  Float64Adam ref{{init.begin(), init.end()}, std::vector<double>(kN), std::vector<double>(kN)};
  const double lr = 1e-3;
  for (int t = 1; t <= kSteps; ++t) {
    const auto g = RandomBf16(rng, kN, 0.1f);
    ASSERT_TRUE(job.state->WriteGrad(0, 0, 0, DType::kBf16, g.data(), kN).ok());
    ASSERT_TRUE(job.state->Apply(WholeShardZero(ComputeAdamWScalars(h, lr, 1.0f, t))).ok());
    ref.Step(h, g, lr, 1.0, t);
  }
  const auto p = ReadFloats(*job.state, 0, StateKind::kMaster, kN);
  double worst = 0;
  for (size_t i = 0; i < kN; ++i) worst = std::max(worst, std::fabs(p[i] - ref.p[i]));
  // The bound: each step adds at most a few float ulps at |p| <= ~1.2 (2^-23
  // each); 200 steps stay far below lr * 1e-2. Measured: see the log line.
  std::printf("max |fp32 - float64| after %d steps: %.3g\n", kSteps, worst);
  EXPECT_LT(worst, 2e-5);
}

// Both of the lerp's forms (β1 of 0.9, and of 0.3, under 0.5).
TEST(CpuBackend, BitwiseEqualToScalarReferenceForEveryThreadCountAndIsa) {
  constexpr int kSteps = 20;
  const std::vector<uint64_t> sizes = {1, 7, 4095, 4097, 100003};
  for (const AdamWHyper h : {AdamWHyper{0.9, 0.95, 1e-8f, 0.1, 1.0}, AdamWHyper{0.3, 0.95, 1e-8f, 0.1, 1.0}})
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    for (uint32_t world : {1u, 3u}) {
      std::mt19937_64 rng(21 + world);
      std::vector<ReferenceTensor> refs;
      std::vector<std::vector<float>> inits;
      for (uint64_t n : sizes) {
        inits.push_back(RandomFloats(rng, n, -2, 2));
        refs.emplace_back(h, inits.back(), precision == Precision::kBf16);
      }
      std::vector<std::vector<std::vector<uint16_t>>> grads(kSteps);  // [step][shard*world + rank]
      for (int t = 0; t < kSteps; ++t) {
        for (size_t s = 0; s < sizes.size(); ++s) {
          for (uint32_t r = 0; r < world; ++r) grads[t].push_back(RandomBf16(rng, sizes[s], 0.5f));
        }
      }
      for (size_t s = 0; s < sizes.size(); ++s) {
        for (int t = 0; t < kSteps; ++t) {
          std::vector<const uint16_t*> rg;
          for (uint32_t r = 0; r < world; ++r) rg.push_back(grads[t][s * world + r].data());
          refs[s].Step(rg, 1e-2, 0.25f);
        }
      }
      for (cpu::Isa isa : cpu::SupportedIsas()) {
        for (int threads : {1, 2, 3, 8}) {
          SCOPED_TRACE(::testing::Message() << cpu::IsaName(isa) << " threads=" << threads << " world=" << world
                                          << " " << PrecisionName(precision) << " beta1=" << h.beta1);
          Job job = MakeJob({threads, isa}, sizes, precision, world);
          for (size_t s = 0; s < sizes.size(); ++s) {
            ASSERT_TRUE(job.state->WriteState(s, StateKind::kMaster, 0, DType::kFp32, inits[s].data(), sizes[s]).ok());
          }
          for (int t = 0; t < kSteps; ++t) {
            std::vector<ShardStep> steps;
            for (size_t s = 0; s < sizes.size(); ++s) {
              ShardGrads sg{static_cast<uint32_t>(s), {}};
              for (uint32_t r = 0; r < world; ++r) {
                ASSERT_TRUE(job.state->WriteGrad(s, r, 0, DType::kBf16, grads[t][s * world + r].data(), sizes[s]).ok());
                sg.ranks.push_back(r);
              }
              steps.push_back({sg, ComputeAdamWScalars(h, 1e-2, 0.25f, t + 1)});
            }
            ASSERT_TRUE(job.state->Apply(steps).ok());
          }
          for (size_t s = 0; s < sizes.size(); ++s) {
            EXPECT_EQ(ReadFloats(*job.state, s, StateKind::kMaster, sizes[s]), refs[s].p);
            EXPECT_EQ(ReadFloats(*job.state, s, StateKind::kExpAvg, sizes[s]), refs[s].m);
            EXPECT_EQ(ReadFloats(*job.state, s, StateKind::kExpAvgSq, sizes[s]), refs[s].v);
            EXPECT_EQ(ReadParams(*job.state, s, sizes[s]), refs[s].Params());
          }
        }
      }
    }
  }
}

// With β1 under 0.5, m is torch's lerp taken from g: m + w*(g - m) would
// cancel, and with β1 = 0 a gradient of 1e-6 after one of 100 left m at 0.
TEST(CpuBackend, ASmallBeta1KeepsTheMomentsSmallValues) {
  const AdamWHyper h{0.0, 0.999, 1e-8f, 0.0, 1.0};
  Job job = MakeJob({}, {2}, Precision::kFp32, 1, DType::kFp32);
  const std::vector<float> init = {0.5f, -0.25f};
  ASSERT_TRUE(job.state->WriteState(0, StateKind::kMaster, 0, DType::kFp32, init.data(), 2).ok());
  const std::vector<float> big = {100.0f, -100.0f}, small = {1e-6f, 3e-7f};
  ASSERT_TRUE(job.state->WriteGrad(0, 0, 0, DType::kFp32, big.data(), 2).ok());
  ASSERT_TRUE(job.state->Apply(WholeShardZero(ComputeAdamWScalars(h, 1e-3, 1.0f, 1))).ok());
  ASSERT_TRUE(job.state->WriteGrad(0, 0, 0, DType::kFp32, small.data(), 2).ok());
  ASSERT_TRUE(job.state->Apply(WholeShardZero(ComputeAdamWScalars(h, 1e-3, 1.0f, 2))).ok());
  EXPECT_EQ(ReadFloats(*job.state, 0, StateKind::kExpAvg, 2), small);  // torch: exp_avg is the gradient
}

TEST(CpuBackend, UpdatingAShardInPiecesEqualsOneCall) {
  constexpr uint64_t kN = 5 * kApplyAlignment + 321;
  const AdamWHyper h{0.9, 0.999, 1e-8f, 0.01, 1.0};
  std::mt19937_64 rng(17);
  const auto init = RandomFloats(rng, kN, -1, 1);
  const auto g = RandomBf16(rng, kN, 1.0f);
  Job whole = MakeJob({}, {kN}, Precision::kFp32, 1), pieces = MakeJob({}, {kN}, Precision::kFp32, 1);
  for (Job* j : {&whole, &pieces}) {
    ASSERT_TRUE(j->state->WriteState(0, StateKind::kMaster, 0, DType::kFp32, init.data(), kN).ok());
    ASSERT_TRUE(j->state->WriteGrad(0, 0, 0, DType::kBf16, g.data(), kN).ok());
  }
  const auto scalars = ComputeAdamWScalars(h, 1e-3, 1.0f, 1);
  ASSERT_TRUE(whole.state->Apply(WholeShardZero(scalars)).ok());
  std::vector<ShardStep> steps = WholeShardZero(scalars);
  for (uint64_t off : {3 * kApplyAlignment, 0ul, kApplyAlignment}) {  // out of order, uneven
    steps[0].offset = off;
    steps[0].length = off == kApplyAlignment ? 2 * kApplyAlignment : off == 0 ? kApplyAlignment : 0;
    ASSERT_TRUE(pieces.state->Apply(steps).ok());
  }
  EXPECT_EQ(ReadFloats(*pieces.state, 0, StateKind::kMaster, kN), ReadFloats(*whole.state, 0, StateKind::kMaster, kN));
  EXPECT_EQ(ReadParams(*pieces.state, 0, kN), ReadParams(*whole.state, 0, kN));
  steps[0].offset = 100;  // not on a boundary
  EXPECT_EQ(pieces.state->Apply(steps).code(), absl::StatusCode::kInvalidArgument);
  steps[0].offset = kApplyAlignment;
  steps[0].length = kN;  // past the end
  EXPECT_EQ(pieces.state->Apply(steps).code(), absl::StatusCode::kOutOfRange);
}

// Prefault maps a fresh array's pages in (mincore: none resident before,
// all after), and changes no value, even while the same array is being
// written on another thread, as a restore writes it. Needs Linux 5.14's
// MADV_POPULATE_WRITE, without which Prefault does nothing.
TEST(CpuBackend, PrefaultMapsTheStateInAndChangesNoValueWhileItIsWritten) {
  {
    void* probe = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(probe, MAP_FAILED);
    const bool supported = madvise(probe, 4096, MADV_POPULATE_WRITE) == 0;
    munmap(probe, 4096);
    if (!supported) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  }
  constexpr uint64_t kN = uint64_t{3} << 20;  // 12 MiB an array: mapped, not allocated
  std::mt19937_64 rng(23);
  Job job = MakeJob({}, {kN}, Precision::kFp32, 1);
  char* m = job.state->HostFp32State(0, StateKind::kExpAvg);
  ASSERT_NE(m, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE)), pages = (kN * 4 + page - 1) / page;
  auto resident = [&] {
    std::vector<unsigned char> in(pages);
    EXPECT_EQ(mincore(m, kN * 4, in.data()), 0);
    return static_cast<size_t>(std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; }));
  };
  EXPECT_EQ(resident(), 0u);
  job.state->Prefault(0, StateKind::kExpAvg, 0, kN);
  EXPECT_EQ(resident(), pages);

  const auto values = RandomFloats(rng, kN, -1, 1);
  std::atomic<bool> written{false};
  std::thread prefaulting([&] {
    while (!written) {
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        job.state->Prefault(0, kind, 0, kN);
      }
    }
  });
  bool all_written = true;
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    for (uint64_t at = 0; at < kN; at += 1 << 18) {
      all_written = all_written && job.state->WriteState(0, kind, at, DType::kFp32, values.data() + at, 1 << 18).ok();
    }
  }
  written = true;
  prefaulting.join();
  ASSERT_TRUE(all_written);
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    EXPECT_TRUE(ReadFloats(*job.state, 0, kind, kN) == values);
  }
}

// Params a commit holds (HoldState, sent as they lie) stay as they were
// while an update or a write of the master changes the job's, and the job's
// are the same bits as a job's that nobody held.
TEST(CpuBackend, HeldParamsStayUnchangedWhileTheJobMovesOn) {
  constexpr uint64_t kN = 3 * kApplyAlignment + 777;
  std::mt19937_64 rng(19);
  const auto init = RandomFloats(rng, kN, -1, 1);
  const auto g = RandomBf16(rng, kN, 1.0f);
  Job held = MakeJob({}, {kN}, Precision::kFp32, 1), free = MakeJob({}, {kN}, Precision::kFp32, 1);
  for (Job* j : {&held, &free}) {
    ASSERT_TRUE(j->state->WriteState(0, StateKind::kMaster, 0, DType::kFp32, init.data(), kN).ok());
    ASSERT_TRUE(j->state->WriteGrad(0, 0, 0, DType::kBf16, g.data(), kN).ok());
  }
  const std::vector<uint16_t> before = ReadParams(*held.state, 0, kN);
  auto joined = [](const Pieces& h) {
    std::string out(h.size(), '\0');
    h.CopyTo(out.data());
    return out;
  };
  // Unaligned ranges across regions, and a region held twice.
  auto a = held.state->HoldState(0, StateKind::kParamBf16, 100, 2 * kApplyAlignment, DType::kBf16);
  auto b = held.state->HoldState(0, StateKind::kParamBf16, kApplyAlignment + 5, kN - kApplyAlignment - 5, DType::kBf16);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string a_bytes(reinterpret_cast<const char*>(before.data() + 100), 2 * kApplyAlignment * 2);
  const std::string b_bytes(reinterpret_cast<const char*>(before.data() + kApplyAlignment + 5),
                            (kN - kApplyAlignment - 5) * 2);
  ASSERT_EQ(joined(*a), a_bytes);
  // What is not held in place is read into a buffer the result owns: the
  // master, as an FP32-param tensor's commit sends it.
  auto master = held.state->HoldState(0, StateKind::kMaster, 5, kN - 5, DType::kFp32);
  ASSERT_TRUE(master.ok());
  const std::vector<float> master_before = ReadFloats(*held.state, 0, StateKind::kMaster, kN);
  EXPECT_EQ(joined(*master), std::string(reinterpret_cast<const char*>(master_before.data() + 5), (kN - 5) * 4));
  const auto scalars = ComputeAdamWScalars(testing::kDefaultHyper, 1e-3, 1.0f, 1);
  for (Job* j : {&held, &free}) ASSERT_TRUE(j->state->Apply(WholeShardZero(scalars)).ok());
  EXPECT_EQ(joined(*a), a_bytes);
  EXPECT_EQ(joined(*b), b_bytes);
  EXPECT_NE(ReadParams(*held.state, 0, kN), before);
  EXPECT_EQ(ReadParams(*held.state, 0, kN), ReadParams(*free.state, 0, kN));
  // A write of part of the master while held: the rest of its regions is kept.
  const auto part = RandomFloats(rng, 1000, -1, 1);
  for (Job* j : {&held, &free}) {
    ASSERT_TRUE(j->state->WriteState(0, StateKind::kMaster, kApplyAlignment + 3, DType::kFp32, part.data(), 1000).ok());
  }
  EXPECT_EQ(joined(*b), b_bytes);
  EXPECT_EQ(ReadParams(*held.state, 0, kN), ReadParams(*free.state, 0, kN));
  *a = Pieces();
  *b = Pieces();  // let go: the next update writes in place
  for (Job* j : {&held, &free}) ASSERT_TRUE(j->state->Apply(WholeShardZero(scalars)).ok());
  EXPECT_EQ(ReadParams(*held.state, 0, kN), ReadParams(*free.state, 0, kN));
  EXPECT_EQ(ReadFloats(*held.state, 0, StateKind::kMaster, kN), ReadFloats(*free.state, 0, StateKind::kMaster, kN));
}

TEST(CpuBackend, SumOfSquaresIsTheFixedTreeForEveryThreadCount) {
  constexpr uint64_t kN = 5 * 16 * 4096 + 1234;  // several of the pool's 16-block items, and a ragged tail
  std::mt19937_64 rng(5);
  const auto r0 = RandomBf16(rng, kN, 3.0f), r1 = RandomBf16(rng, kN, 3.0f);
  std::vector<float> agg(kN);
  for (uint64_t i = 0; i < kN; ++i) agg[i] = math::bf16_to_float(r0[i]) + math::bf16_to_float(r1[i]);
  const double expected = testing::TreeSumsq(agg);
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    for (int threads : {1, 2, 5}) {
      Job job = MakeJob({threads, isa}, {kN}, Precision::kFp32, 2);
      ASSERT_TRUE(job.state->WriteGrad(0, 0, 0, DType::kBf16, r0.data(), kN).ok());
      ASSERT_TRUE(job.state->WriteGrad(0, 1, 0, DType::kBf16, r1.data(), kN).ok());
      auto stats = job.state->ReduceGrads({{0, {0, 1}}});
      ASSERT_TRUE(stats.ok());
      EXPECT_EQ(Bits(static_cast<float>(stats->sum_squares)), Bits(static_cast<float>(expected)));
      EXPECT_EQ(stats->sum_squares, expected);
      EXPECT_FALSE(stats->nonfinite);
      // Only rank 1 contributing is a different gradient.
      auto only1 = job.state->ReduceGrads({{0, {1}}});
      std::vector<float> g1(kN);
      for (uint64_t i = 0; i < kN; ++i) g1[i] = math::bf16_to_float(r1[i]);
      EXPECT_EQ(only1->sum_squares, testing::TreeSumsq(g1));
    }
  }
}

// A running sum (one fp32 slot, folded rank by rank from runs at any
// address, each tile's sum of squares taken early or not) gives the bits of
// per-rank slots added in rank order: the sum of squares, and the update.
// The CPU keeps a tile of one bf16 rank as bf16 until a second rank comes.
TEST(CpuBackend, RunningSumGivesTheBitsOfRankSlotsInEveryForm) {
  const std::vector<uint64_t> numels = {3 * kApplyAlignment + 1000, 2 * 4096 + 17};
  const std::vector<DType> dtypes = {DType::kBf16, DType::kFp32};  // an FP32-param tensor's gradients
  std::mt19937_64 rng(21);
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    for (uint32_t world : {1u, 2u, 3u}) {
      Job sum = MakeJob({2, isa}, numels, Precision::kFp32, 1, DType::kFp32);
      Job slots = MakeJob({1, isa}, numels, Precision::kFp32, world, DType::kFp32);
      std::vector<ShardGrads> summed, ranked;
      for (uint32_t si = 0; si < numels.size(); ++si) {
        const auto init = RandomFloats(rng, numels[si], -1, 1);
        for (Job* j : {&sum, &slots}) {
          ASSERT_TRUE(j->state->WriteState(si, StateKind::kMaster, 0, DType::kFp32, init.data(), numels[si]).ok());
        }
        for (uint32_t r = 0; r < world; ++r) {
          // The rank's gradient, bf16 values whatever the dtype, so the
          // fp32 ones are exact in both forms.
          const auto g = RandomBf16(rng, numels[si], 2.0f);
          std::string bytes;
          for (uint16_t h : g) {
            if (dtypes[si] == DType::kBf16) {
              bytes.append(reinterpret_cast<const char*>(&h), 2);
            } else {
              const float f = math::bf16_to_float(h);
              bytes.append(reinterpret_cast<const char*>(&f), 4);
            }
          }
          ASSERT_TRUE(slots.state->WriteGrad(si, r, 0, dtypes[si], bytes.data(), numels[si]).ok());
          // Folded in calls of random lengths, each from runs at odd addresses.
          const uint64_t esize = DTypeSize(dtypes[si]);
          for (uint64_t at = 0; at < numels[si];) {
            const uint64_t n = std::min<uint64_t>(numels[si] - at, 1 + rng() % 9000);
            std::vector<std::string> held;
            std::vector<absl::string_view> runs;
            for (uint64_t done = 0; done < n;) {
              const uint64_t part = std::min<uint64_t>(n - done, 1 + rng() % 3000);
              held.push_back("x" + bytes.substr((at + done) * esize, part * esize));
              done += part;
            }
            for (const std::string& h : held) runs.push_back(absl::string_view(h).substr(1));
            ASSERT_TRUE(sum.state->AccumulateGrad(si, at, dtypes[si], runs, r == 0).ok());
            at += n;
          }
        }
        // Some blocks' sums of squares taken when they became final, some not.
        for (uint64_t at = 0; at < numels[si]; at += kApplyAlignment) {
          if (rng() % 2 == 0) sum.state->GradBlockDone(si, at, std::min(kApplyAlignment, numels[si] - at));
        }
        summed.push_back({si, {0}});
        std::vector<uint32_t> all(world);
        std::iota(all.begin(), all.end(), 0u);
        ranked.push_back({si, all});
      }
      auto want = slots.state->ReduceGrads(ranked);
      auto got = sum.state->ReduceGrads(summed);
      ASSERT_TRUE(want.ok() && got.ok());
      EXPECT_EQ(got->sum_squares, want->sum_squares) << cpu::IsaName(isa) << " W=" << world;
      const math::AdamWScalars scalars = ComputeAdamWScalars(testing::kDefaultHyper, 1e-3, 0.5f, 1);
      std::vector<ShardStep> sum_steps, slot_steps;
      for (uint32_t si = 0; si < numels.size(); ++si) {
        sum_steps.push_back({summed[si], scalars});
        slot_steps.push_back({ranked[si], scalars});
      }
      ASSERT_TRUE(sum.state->Apply(sum_steps).ok());
      ASSERT_TRUE(slots.state->Apply(slot_steps).ok());
      for (uint32_t si = 0; si < numels.size(); ++si) {
        for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
          EXPECT_EQ(ReadFloats(*sum.state, si, kind, numels[si]), ReadFloats(*slots.state, si, kind, numels[si]))
              << cpu::IsaName(isa) << " W=" << world << " shard " << si << " " << StateKindName(kind);
        }
        EXPECT_EQ(ReadParams(*sum.state, si, numels[si]), ReadParams(*slots.state, si, numels[si]));
      }
    }
  }
}

TEST(CpuBackend, NonfiniteGradientIsFlagged) {
  constexpr uint64_t kN = 10000;
  for (uint16_t bad : {uint16_t{0x7FC0}, uint16_t{0xFF80}}) {  // NaN, -Inf
    std::mt19937_64 rng(3);
    auto g = RandomBf16(rng, kN, 1.0f);
    g[kN - 17] = bad;
    Job job = MakeJob({}, {kN}, Precision::kFp32, 1);
    ASSERT_TRUE(job.state->WriteGrad(0, 0, 0, DType::kBf16, g.data(), kN).ok());
    EXPECT_TRUE(job.state->ReduceGrads({{0, {0}}})->nonfinite);
  }
}

// shardopt's reason to exist (docs/design.md, section 1): an update below half
// of bf16's spacing at 1.0 rounds away in bf16 state and accumulates in fp32
// state.
TEST(CpuBackend, Fp32StateMovesGainsThatBf16StateLeavesAtOne) {
  constexpr uint64_t kN = 4096;
  constexpr int kSteps = 100;
  const AdamWHyper h{0.9, 0.999, 1e-8f, 0.0, 1.0};
  const double lr = 1e-3;  // |update| <= ~lr, below 2^-9, half the spacing just below 1.0
  std::mt19937_64 rng(9);
  Job fp32 = MakeJob({}, {kN}, Precision::kFp32, 1);
  Job bf16 = MakeJob({}, {kN}, Precision::kBf16, 1);
  const std::vector<float> ones(kN, 1.0f);
  for (Job* j : {&fp32, &bf16}) ASSERT_TRUE(j->state->WriteState(0, StateKind::kMaster, 0, DType::kFp32, ones.data(), kN).ok());
  for (int t = 1; t <= kSteps; ++t) {
    // A consistent sign, as a gain under a steady pull would see.
    auto g = RandomBf16(rng, kN, 0.1f);
    for (auto& x : g) x |= 0x8000;
    for (Job* j : {&fp32, &bf16}) {
      ASSERT_TRUE(j->state->WriteGrad(0, 0, 0, DType::kBf16, g.data(), kN).ok());
      ASSERT_TRUE(j->state->Apply(WholeShardZero(ComputeAdamWScalars(h, lr, 1.0f, t))).ok());
    }
  }
  const auto p32 = ReadFloats(*fp32.state, 0, StateKind::kMaster, kN);
  const auto p16 = ReadFloats(*bf16.state, 0, StateKind::kMaster, kN);
  const auto out32 = ReadParams(*fp32.state, 0, kN);
  size_t moved32 = 0, moved16 = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    EXPECT_EQ(p16[i], 1.0f) << i;
    moved16 += p16[i] != 1.0f;
    moved32 += out32[i] != 0x3F80;
    EXPECT_GT(p32[i], 1.05f) << i;  // 100 steps of ~1e-3 each
  }
  EXPECT_EQ(moved16, 0u);
  EXPECT_EQ(moved32, kN);
}

}  // namespace
}  // namespace shardopt
