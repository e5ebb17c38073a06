// Integration: real shardopt-server processes on 127.0.0.1, real gRPC.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <cstring>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "base/status_macros.h"
#include "kernels/adamw_math.h"
#include "shardopt/client.h"
#include "client/wire.h"
#include "rpc/grpc_edge.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tests/testing/reference.h"
#include "tests/testing/generic_unary.h"
#include "tests/testing/raw_commit.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using testing::GenericUnary;

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ReferenceTensor;
using testing::ServerProcess;
namespace v1 = ::shardopt::v1;

constexpr AdamWHyper kHyper = testing::kDefaultHyper;

JobOptions MakeJob(const std::string& name, uint32_t world, std::vector<std::pair<std::string, uint64_t>> tensors,
                   StatePrecision precision = StatePrecision::kFp32) {
  JobOptions job;
  job.name = name;
  job.world_size = world;
  GroupOptions g;
  g.name = "all";
  g.beta1 = kHyper.beta1;
  g.beta2 = kHyper.beta2;
  g.eps = kHyper.eps;
  g.weight_decay = kHyper.weight_decay;
  g.precision = precision;
  job.groups = {g};
  for (auto& [n, numel] : tensors) job.tensors.push_back({n, numel, 0});
  job.barrier_timeout_ms = 10000;
  return job;
}

std::unique_ptr<Client> Connect(const std::string& address, uint32_t rank = 0) {
  ClientOptions o;
  o.servers = {address};
  o.rank = rank;
  return Client::Connect(o).value();
}

// `lookahead_bytes`: how far the server may send ahead of what this client
// reads (0: the client's own setting).
std::unique_ptr<v1::Optimizer::Stub> RawStub(const std::string& address, int lookahead_bytes = 0) {
  grpc::ChannelArguments args;
  TuneChannelArguments(&args);
  if (lookahead_bytes > 0) args.SetInt("grpc.http2.lookahead_bytes", lookahead_bytes);
  return v1::Optimizer::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// A push stream of `chunks`, ended by the client; the server's answer, or
// DEADLINE_EXCEEDED once `deadline` passes (a trainer that gave up waiting).
grpc::Status PushChunks(v1::Optimizer::Stub& stub, const std::vector<v1::GradChunk>& chunks,
                        std::chrono::milliseconds deadline = std::chrono::seconds(20)) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::PushResponse resp;
  auto w = stub.Push(&ctx, &resp);
  for (const v1::GradChunk& c : chunks) {
    if (!w->Write(c)) break;
  }
  w->WritesDone();
  return w->Finish();
}

// A job's whole state, as a client reads it back.
std::vector<float> ReadAll(Client& c, const JobOptions& job) {
  std::vector<float> out;
  for (const auto& t : job.tensors) {
    for (StateToRead k : {StateToRead::kMaster, StateToRead::kExpAvg, StateToRead::kExpAvgSq}) {
      std::vector<float> v(t.numel, NAN);
      EXPECT_TRUE(c.Read(t.name, k, 0, t.numel, v.data()).ok());
      out.insert(out.end(), v.begin(), v.end());
    }
  }
  return out;
}

// After a push that must count for nothing, the next step of tensor "w"
// (4096 elements, initial values `init`) is bitwise its own push alone.
void ExpectTheNextStepIsItsPushAlone(Client& client, const std::vector<float>& init, std::mt19937_64& rng) {
  auto good = RandomBf16(rng, 4096, 1.0f);
  std::vector<uint16_t> params(4096);
  StepOptions so;
  so.lr = 1e-2;
  auto r = client.Step({{"w", good.data()}}, so, {{"w", params.data()}});
  ASSERT_TRUE(r.ok()) << r.status();
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({good.data()}, so.lr, r->decision.gscale);
  EXPECT_EQ(params, ref.Params());
}

// A client of its own creates job `name` (one tensor of 100 elements, fresh
// random values) and steps it once: what tests run beside something that
// must not stall the server or the process. The params are checked against
// the reference when the step succeeds.
absl::Status StepASideJob(const std::string& address, const std::string& name, std::mt19937_64& rng) {
  auto side = Connect(address);
  SHARDOPT_RETURN_IF_ERROR(side->CreateOrAttach(MakeJob(name, 1, {{"w", 100}})).status());
  auto init = RandomFloats(rng, 100, -1, 1);
  SHARDOPT_RETURN_IF_ERROR(side->InitFp32("w", init.data()));
  auto g = RandomBf16(rng, 100, 1.0f);
  std::vector<uint16_t> p(100);
  StepOptions so;
  so.lr = 1e-3;
  auto stepped = side->Step({{"w", g.data()}}, so, {{"w", p.data()}});
  if (!stepped.ok()) return stepped.status();
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({g.data()}, so.lr, stepped->decision.gscale);
  EXPECT_EQ(p, ref.Params()) << "job " << name;
  return absl::OkStatus();
}

// A client left to choose its message size sends 4 MiB messages to a lone
// rank's default server, 256 KiB ones for 64 ranks, and half of what a
// server with --max_message_bytes=1 MiB takes; that server streams a
// commit's params and a read's fp32 master in pieces that fit it too. A
// client that insists on 4 MiB is refused there, so the sizes chosen are
// what let the steps through.
TEST(MessageSizeTest, AClientFitsItsMessagesToTheRanksAndToTheServersLimit) {
  auto roomy = ServerProcess::Start();
  auto tight = ServerProcess::Start({"--max_message_bytes=1048576"});
  ASSERT_NE(roomy, nullptr);
  ASSERT_NE(tight, nullptr);
  std::mt19937_64 rng(17);
  constexpr uint64_t kN = 3 << 20;  // 6 MiB of bf16 gradient, 12 MiB of FP32 params
  struct Case {
    std::string address;
    uint32_t world;
    uint64_t chunk_bytes;
  };
  for (const Case& c : {Case{roomy->address(), 1, 4 << 20}, Case{roomy->address(), 64, 256 << 10},
                        Case{tight->address(), 1, 512 << 10}}) {
    SCOPED_TRACE(::testing::Message() << c.address << " W=" << c.world);
    const JobOptions job = MakeJob(absl::StrCat("sized-", c.world), c.world, {{"w", kN}});
    auto client = Connect(c.address);
    ASSERT_TRUE(client->CreateOrAttach(job).ok());
    EXPECT_EQ(client->chunk_bytes(), c.chunk_bytes);
    if (c.world > 1) continue;  // the size is the point; one rank cannot step a job of 64
    auto init = RandomFloats(rng, kN, -1, 1);
    ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
    auto g = RandomBf16(rng, kN, 1.0f);
    std::vector<uint16_t> params(kN, 0xFFFF);  // poisoned
    StepOptions so;
    so.lr = 1e-3;
    auto stepped = client->Step({{"w", g.data()}}, so, {{"w", params.data()}});
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    ReferenceTensor ref(kHyper, init, false);
    ref.Step({g.data()}, so.lr, stepped->decision.gscale);
    EXPECT_EQ(params, ref.Params());
    std::vector<float> master(kN, NAN);  // FP32 state streams in 4 B elements
    ASSERT_TRUE(client->Read("w", StateToRead::kMaster, 0, kN, master.data()).ok());
    EXPECT_EQ(master, ref.p);
  }
  // Just above the smallest limit a server takes, the pieces of FP32 params
  // still fit: rounded down to whole units of work (a piece of 16385
  // elements rounded up to 32768 would be 128 KiB of params, over the limit).
  auto tightest = ServerProcess::Start({"--max_message_bytes=131080"});
  ASSERT_NE(tightest, nullptr);
  {
    JobOptions job = MakeJob("fp32-params", 1, {{"w", 100000}});
    job.tensors[0].param_type = ParamType::kFp32;
    auto client = Connect(tightest->address());
    ASSERT_TRUE(client->CreateOrAttach(job).ok());
    EXPECT_EQ(client->chunk_bytes(), uint64_t{131080 / 2});
    auto init = RandomFloats(rng, 100000, -1, 1), g = RandomFloats(rng, 100000, -1, 1);
    ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
    std::vector<float> params(100000, NAN);  // poisoned
    StepOptions so;
    so.lr = 1e-3;
    auto stepped = client->Step({{"w", g.data()}}, so, {{"w", params.data()}});
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    ReferenceTensor ref(kHyper, init, false);
    ref.StepAggregated(g, so.lr, stepped->decision.gscale);
    EXPECT_EQ(params, ref.p);
  }
  ClientOptions insisting;
  insisting.servers = {tight->address()};
  insisting.chunk_bytes = 4 << 20;
  insisting.max_attempts = 1;
  auto client = Client::Connect(insisting).value();
  // A size the caller chose that the server cannot take is said at attach,
  // naming the option and the limit, not as gRPC's RESOURCE_EXHAUSTED
  // ("Sent message larger than max") at each Init and Step.
  const absl::Status refused = client->CreateOrAttach(MakeJob("insisting", 1, {{"w", kN}})).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("ClientOptions::chunk_bytes is 4194304, more than half of server"));
  auto init = RandomFloats(rng, kN, -1, 1);
  EXPECT_EQ(client->InitFp32("w", init.data()).code(), absl::StatusCode::kFailedPrecondition);  // not attached
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = ServerProcess::Start({"--threads=2"});
    ASSERT_NE(server_, nullptr);
  }
  std::unique_ptr<ServerProcess> server_;
  std::mt19937_64 rng_{99};
};

TEST_F(ServiceTest, ThousandStepsAreBitwiseEqualToTheInProcessReference) {
  const JobOptions job = MakeJob("long", 1, {{"w", 6007}, {"gain", 64}});
  auto client = Connect(server_->address());
  ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);
  std::vector<ReferenceTensor> refs;
  for (const auto& t : job.tensors) {
    auto init = RandomFloats(rng_, t.numel, -1, 1);
    ASSERT_TRUE(client->InitFp32(t.name, init.data()).ok());
    refs.emplace_back(kHyper, init, false);
  }
  ASSERT_TRUE(client->VerifyState().ok());
  std::vector<std::vector<uint16_t>> params(job.tensors.size());
  for (size_t i = 0; i < params.size(); ++i) params[i].resize(job.tensors[i].numel);
  for (int step = 1; step <= 1000; ++step) {
    std::vector<std::vector<uint16_t>> grads;
    std::vector<GradView> gv;
    std::vector<ParamView> pv;
    for (size_t i = 0; i < job.tensors.size(); ++i) {
      grads.push_back(RandomBf16(rng_, job.tensors[i].numel, 0.3f));
      std::fill(params[i].begin(), params[i].end(), 0xFFFF);  // poisoned
      pv.push_back({job.tensors[i].name, params[i].data()});
    }
    for (size_t i = 0; i < job.tensors.size(); ++i) gv.push_back({job.tensors[i].name, grads[i].data()});
    StepOptions so;
    so.lr = 1e-3;
    auto r = client->Step(gv, so, pv);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->step, static_cast<uint64_t>(step));
    for (size_t i = 0; i < job.tensors.size(); ++i) {
      refs[i].Step({grads[i].data()}, so.lr, r->decision.gscale);
      ASSERT_EQ(params[i], refs[i].Params()) << "step " << step << " tensor " << job.tensors[i].name;
    }
  }
  std::vector<float> expected;
  for (const auto& ref : refs) {
    for (const auto* v : {&ref.p, &ref.m, &ref.v}) expected.insert(expected.end(), v->begin(), v->end());
  }
  EXPECT_EQ(ReadAll(*client, job), expected);
  auto described = client->Describe();
  ASSERT_TRUE(described.ok());
  EXPECT_EQ(described->at(0).step, 1000u);
  EXPECT_EQ(described->at(0).state_bytes, (6007u + 64u) * 12);
}

TEST_F(ServiceTest, RanksMeetAtTheBarrierOverTheNetwork) {
  const JobOptions job = MakeJob("ranks", 2, {{"w", 20000}});
  auto c0 = Connect(server_->address(), 0), c1 = Connect(server_->address(), 1);
  ASSERT_TRUE(c0->CreateOrAttach(job).ok());
  ASSERT_TRUE(c1->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 20000, -1, 1);
  ASSERT_TRUE(c0->InitFp32("w", init.data()).ok());
  ReferenceTensor ref(kHyper, init, false);
  std::vector<uint16_t> p0(20000), p1(20000);
  for (int step = 1; step <= 5; ++step) {
    auto g0 = RandomBf16(rng_, 20000, 1.0f), g1 = RandomBf16(rng_, 20000, 1.0f);
    StepOptions so;
    so.lr = 1e-2;
    so.max_grad_norm = 1.0;  // clipping on: both ranks must reach the same gscale
    absl::StatusOr<StepResult> r1;
    std::thread t([&] { r1 = c1->Step({{"w", g1.data()}}, so, {{"w", p1.data()}}); });
    auto r0 = c0->Step({{"w", g0.data()}}, so, {{"w", p0.data()}});
    t.join();
    ASSERT_TRUE(r0.ok()) << r0.status();
    ASSERT_TRUE(r1.ok()) << r1.status();
    EXPECT_EQ(r0->decision.gscale, r1->decision.gscale);
    EXPECT_LT(r0->decision.clip_factor, 1.0);
    ref.Step({g0.data(), g1.data()}, so.lr, r0->decision.gscale);
    EXPECT_EQ(p0, ref.Params());
    EXPECT_EQ(p1, ref.Params());
  }
}

// Ranks that skip a step for different reasons agree: one whose Step
// decided a skip (a NaN in its gradient), one whose loop skips it with its
// own lr and gscale, and a hand-written commit of a skip with a NaN lr.
// Every skip is the same commit (they were ABORTED, "ranks disagree"), and
// none changes the state.
TEST_F(ServiceTest, EverySkipOfAStepIsTheSameCommit) {
  const JobOptions job = MakeJob("skips", 2, {{"w", 5000}});
  auto c0 = Connect(server_->address(), 0), c1 = Connect(server_->address(), 1);
  ASSERT_TRUE(c0->CreateOrAttach(job).ok());
  ASSERT_TRUE(c1->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 5000, -1, 1);
  ASSERT_TRUE(c0->InitFp32("w", init.data()).ok());
  const std::vector<float> before = ReadAll(*c0, job);
  auto g0 = RandomBf16(rng_, 5000, 1.0f);
  g0[17] = 0x7FC0;  // NaN
  const auto g1 = RandomBf16(rng_, 5000, 1.0f);
  std::vector<uint16_t> p0(5000), p1(5000);
  StepOptions so;
  so.lr = 1e-2;
  absl::Status skipped_by_loop;
  std::thread t([&] {
    const auto pushed = c1->Push(1, {{"w", g1.data()}});
    skipped_by_loop = pushed.ok() ? c1->Commit(1, 3e-4, 0.25f, /*skip=*/true, {{"w", p1.data()}}, {7.0})
                                  : pushed.status();
  });
  const auto decided = c0->Step({{"w", g0.data()}}, so, {{"w", p0.data()}});
  t.join();
  ASSERT_TRUE(decided.ok()) << decided.status();
  EXPECT_TRUE(decided->decision.skip);
  EXPECT_TRUE(skipped_by_loop.ok()) << skipped_by_loop;
  v1::CommitRequest raw;
  raw.set_job("skips");
  raw.set_step(1);
  raw.set_lr(NAN);
  raw.set_gscale(NAN);
  raw.set_skip(true);
  const grpc::Status hand_written = testing::CommitAndDrain(*RawStub(server_->address()), raw);
  EXPECT_TRUE(hand_written.ok()) << hand_written.error_message();
  EXPECT_EQ(ReadAll(*c0, job), before);
  EXPECT_EQ(c0->AdamSteps().value(), std::vector<uint64_t>({0}));
}

TEST_F(ServiceTest, RetriedPushesAndCommitsOverGrpcCountOnce) {
  const JobOptions job = MakeJob("retries", 1, {{"w", 3000}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 3000, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  auto g = RandomBf16(rng_, 3000, 1.0f);
  auto first = client->Push(1, {{"w", g.data()}});
  auto second = client->Push(1, {{"w", g.data()}});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->sum_squares, second->sum_squares);
  std::vector<uint16_t> a(3000), b(3000, 0xFFFF);
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, {{"w", a.data()}}).ok());
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, {{"w", b.data()}}).ok());
  EXPECT_EQ(a, b);
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({g.data()}, 1e-3, 1.0f);
  EXPECT_EQ(a, ref.Params());
  EXPECT_EQ(ReadAll(*client, job), [&] {
    std::vector<float> e(ref.p);
    e.insert(e.end(), ref.m.begin(), ref.m.end());
    e.insert(e.end(), ref.v.begin(), ref.v.end());
    return e;
  }());
}

// PushInOrder's grad may block until backward produces the gradient: over a
// real server the push waits for it, calls it once per tensor in the given
// order, from one thread of the client's that is not the caller's (that it
// is none of gRPC's is AGradientNotYetProducedHoldsNoGrpcThread's test), and
// a null gradient declares the tensor without one. Small chunks put several
// messages of each tensor on the wire between the waits.
TEST_F(ServiceTest, PushInOrderWaitsForEachGradientInOrderAndAsksOnce) {
  const JobOptions job = MakeJob("in-order", 1, {{"a", 5000}, {"b", 3000}, {"c", 7000}});
  ClientOptions o;
  o.servers = {server_->address()};
  o.chunk_bytes = 2048;
  auto client = Client::Connect(o).value();
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  std::map<std::string, std::vector<float>> init;
  for (const auto& t : job.tensors) {
    init[t.name] = RandomFloats(rng_, t.numel, -1, 1);
    ASSERT_TRUE(client->InitFp32(t.name, init[t.name].data()).ok());
  }
  auto gb = RandomBf16(rng_, 3000, 1.0f), gc = RandomBf16(rng_, 7000, 1.0f);
  const std::vector<std::string> order = {"c", "a", "b"};
  const std::vector<const void*> grads = {gc.data(), nullptr, gb.data()};

  std::mutex mu;
  std::condition_variable changed;
  size_t released = 0;  // grad(i) answers once i < released
  std::vector<size_t> asked;
  std::set<std::thread::id> askers;
  auto grad = [&](size_t i) -> const void* {
    std::unique_lock<std::mutex> lock(mu);
    asked.push_back(i);
    askers.insert(std::this_thread::get_id());
    changed.notify_all();
    changed.wait(lock, [&] { return released > i; });
    return grads[i];
  };
  std::atomic<bool> done{false};
  absl::StatusOr<PushResult> pushed;
  std::thread pusher([&] {
    pushed = client->PushInOrder(1, order, grad);
    done = true;
  });
  const std::thread::id caller = pusher.get_id();
  for (size_t i = 0; i < order.size(); ++i) {
    std::unique_lock<std::mutex> lock(mu);
    changed.wait(lock, [&] { return asked.size() > i; });
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(done) << "the push ended while grad(" << i << ") had not answered";
    lock.lock();
    released = i + 1;
    changed.notify_all();
  }
  pusher.join();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(asked, (std::vector<size_t>{0, 1, 2}));
  ASSERT_EQ(askers.size(), 1u);
  EXPECT_NE(*askers.begin(), caller);

  std::vector<uint16_t> pa(5000, 0xFFFF), pb(3000, 0xFFFF), pc(7000, 0xFFFF);
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, {{"a", pa.data()}, {"b", pb.data()}, {"c", pc.data()}}).ok());
  ReferenceTensor ra(kHyper, init["a"], false), rb(kHyper, init["b"], false), rc(kHyper, init["c"], false);
  rb.Step({gb.data()}, 1e-3, 1.0f);
  rc.Step({gc.data()}, 1e-3, 1.0f);
  EXPECT_EQ(pa, ra.Params());  // no gradient: not updated
  EXPECT_EQ(pb, rb.Params());
  EXPECT_EQ(pc, rc.Params());
}

// A gradient that backward has not produced yet holds none of gRPC's
// threads: while both servers' streams of one client wait for it, another
// client in the same process steps. (Called on a gRPC callback thread, the
// two waits would hold both of the process's callback threads on 2 cores,
// and the other step could not go on until they returned.)
TEST_F(ServiceTest, AGradientNotYetProducedHoldsNoGrpcThread) {
  auto second = ServerProcess::Start({"--threads=2"});
  ASSERT_NE(second, nullptr);
  ClientOptions o;
  o.servers = {server_->address(), second->address()};
  auto waiting = Client::Connect(o).value();
  const JobOptions job = MakeJob("waits", 1, {{"w", 16384}});
  ASSERT_TRUE(waiting->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 16384, -1, 1);
  ASSERT_TRUE(waiting->InitFp32("w", init.data()).ok());
  auto g = RandomBf16(rng_, 16384, 1.0f);

  std::mutex mu;
  std::condition_variable changed;
  int asked = 0;
  bool released = false;
  std::thread pusher([&] {
    auto pushed = waiting->PushInOrder(1, {"w"}, [&](size_t) -> const void* {
      std::unique_lock<std::mutex> lock(mu);
      ++asked;
      changed.notify_all();
      changed.wait(lock, [&] { return released; });
      return g.data();
    });
    EXPECT_TRUE(pushed.ok()) << pushed.status();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(changed.wait_for(lock, std::chrono::seconds(10), [&] { return asked == 2; }));  // one per server
  }
  // If the side step hangs, the waits are released after 5 s regardless,
  // and the test fails on the order of events, not by hanging.
  std::thread release([&] {
    std::unique_lock<std::mutex> lock(mu);
    changed.wait_for(lock, std::chrono::seconds(5), [&] { return released; });
    released = true;
    changed.notify_all();
  });
  const absl::Status stepped = StepASideJob(server_->address(), "side", rng_);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_FALSE(released) << "the other client's step waited for the gradient";
    released = true;
    changed.notify_all();
  }
  release.join();
  pusher.join();
  EXPECT_TRUE(stepped.ok()) << stepped;
}

// A commit whose caller goes away after k of its pieces (the server applies
// a piece ahead of the one it sends) still applies the whole step, once:
// master, m and v are the reference's before any retry, and the retried
// commit returns the reference's params, at k = 1 and 3; at k = 0 (cancelled
// before reading) the commit may not have started, so the step is applied
// whole or not at all.
TEST_F(ServiceTest, ACommitCancelledMidStreamStillAppliesItsWholeStepOnce) {
  constexpr uint64_t kNumel = 3'000'001;  // several of the server's 1 MiB pieces
  const JobOptions job = MakeJob("cut", 1, {{"w", kNumel}});
  auto server = ServerProcess::StartLogged({"--threads=2"});
  ASSERT_NE(server, nullptr);
  auto client = Connect(server->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, kNumel, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  ReferenceTensor ref(kHyper, init, false);
  // A reader that lets the server only 64 KiB ahead, so that its cancel
  // finds the server's stream mid-way, not already sent.
  auto stub = RawStub(server->address(), 64 << 10);
  uint64_t step = 0;
  for (int read_before_cancel : {0, 1, 3}) {
    ++step;
    auto g = RandomBf16(rng_, kNumel, 1.0f);
    ASSERT_TRUE(client->Push(step, {{"w", g.data()}}).ok());
    {
      grpc::ClientContext ctx;
      v1::CommitRequest r;
      r.set_job("cut");
      r.set_step(step);
      r.set_lr(1e-3);
      r.set_gscale(1.0f);
      auto reader = stub->Commit(&ctx, r);
      v1::ParamChunk pc;
      for (int i = 0; i < read_before_cancel; ++i) ASSERT_TRUE(reader->Read(&pc)) << "piece " << i;
      ctx.TryCancel();
      reader->Finish().IgnoreError();  // CANCELLED here whatever the server did
    }
    auto state = [&ref] {
      std::vector<float> s(ref.p);
      s.insert(s.end(), ref.m.begin(), ref.m.end());
      s.insert(s.end(), ref.v.begin(), ref.v.end());
      return s;
    };
    const std::vector<float> before = state();
    ref.Step({g.data()}, 1e-3, 1.0f);
    const std::vector<float> expected = state();
    // Before any retry: a Read waits while a step is being applied, so this
    // is the state the cancelled commit left, which must be the whole step.
    // Cancelled before reading anything, the commit may not have reached
    // the server at all: then nothing is applied, but never part.
    const std::vector<float> left = ReadAll(*client, job);
    if (read_before_cancel == 0) {
      EXPECT_TRUE(left == expected || left == before) << "a commit cancelled at once left part of its step";
    } else {
      EXPECT_TRUE(left == expected) << "after " << read_before_cancel << " pieces read";
    }
    // The retry applies nothing again and returns the step's params.
    std::vector<uint16_t> params(kNumel, 0xFFFF);  // poisoned
    ASSERT_TRUE(client->Commit(step, 1e-3, 1.0f, false, {{"w", params.data()}}).ok());
    EXPECT_TRUE(params == ref.Params()) << "after " << read_before_cancel << " pieces read";
    EXPECT_TRUE(ReadAll(*client, job) == expected) << "after " << read_before_cancel << " pieces read";
  }
  // The server saw the callers go away mid-stream, not after it had sent
  // everything: at least when they had read 1 and 3 pieces.
  const std::string log = server->log();
  size_t cut = 0;
  for (size_t at = log.find("the caller stopped reading the params"); at != std::string::npos;
       at = log.find("the caller stopped reading the params", at + 1)) {
    ++cut;
  }
  EXPECT_GE(cut, 2u) << log;
}

// A commit that sets `pack` gets its small pieces several to a message, each
// message at most one bf16 piece's bytes (1 MiB here) and a piece of that
// size alone; a commit that does not (older clients, a stub of the proto)
// gets one piece a message and never `more`. Both streams carry the same
// pieces in the same order, bit for bit, and the C++ client, which packs,
// gets the same params.
TEST_F(ServiceTest, APackedCommitCarriesTheSamePiecesInFewerMessages) {
  std::vector<std::pair<std::string, uint64_t>> tensors;
  for (int i = 0; i < 300; ++i) tensors.emplace_back(absl::StrCat("small.", i), 1000 + i);
  tensors.insert(tensors.begin() + 150, {"large", 1'200'000});  // pieces of 512Ki, 512Ki and the rest
  JobOptions job = MakeJob("packed", 1, tensors);
  job.tensors[7].param_type = ParamType::kFp32;
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  std::vector<std::vector<float>> inits;
  std::vector<std::vector<float>> grads;  // fp32 for the fp32 param, else bf16 values widened
  std::vector<std::vector<uint16_t>> bf16_grads;
  std::vector<GradView> views;
  for (const TensorOptions& t : job.tensors) {
    inits.push_back(RandomFloats(rng_, t.numel, -1, 1));
    ASSERT_TRUE(client->InitFp32(t.name, inits.back().data()).ok());
    grads.push_back(RandomFloats(rng_, t.numel, -1, 1));
    bf16_grads.push_back(RandomBf16(rng_, t.numel, 1.0f));
  }
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    const bool fp32 = job.tensors[i].param_type == ParamType::kFp32;
    views.push_back({job.tensors[i].name, fp32 ? static_cast<const void*>(grads[i].data()) : bf16_grads[i].data()});
  }
  ASSERT_TRUE(client->Push(1, views).ok());
  std::vector<std::string> params;  // poisoned
  std::vector<ParamView> outs;
  for (const TensorOptions& t : job.tensors) {
    params.emplace_back(t.numel * (t.param_type == ParamType::kFp32 ? 4 : 2), '\xff');
    outs.push_back({t.name, params.back().data()});
  }
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, outs).ok());

  // The step again, read back over a stub: with pack unset, then set.
  struct Sent {
    std::vector<std::string> pieces;  // each piece serialized alone, `more` cleared
    std::vector<size_t> message_bytes;
    std::vector<int> per_message;
  };
  const auto commit = [&](bool pack) {
    Sent sent;
    grpc::ClientContext ctx;
    v1::CommitRequest r;
    r.set_job("packed");
    r.set_step(1);
    r.set_lr(1e-3);
    r.set_gscale(1.0f);
    r.set_pack(pack);
    auto stub = RawStub(server_->address());
    auto reader = stub->Commit(&ctx, r);
    for (v1::ParamChunk pc; reader->Read(&pc);) {
      sent.message_bytes.push_back(pc.ByteSizeLong());
      sent.per_message.push_back(1 + pc.more_size());
      v1::ParamChunk first = pc;
      first.clear_more();
      sent.pieces.push_back(first.SerializeAsString());
      for (const v1::ParamChunk& more : pc.more()) {
        EXPECT_EQ(more.more_size(), 0);
        sent.pieces.push_back(more.SerializeAsString());
      }
    }
    EXPECT_TRUE(reader->Finish().ok());
    return sent;
  };
  const Sent single = commit(false), packed = commit(true);
  ASSERT_EQ(single.pieces.size(), 303u);  // 300 small tensors, 3 pieces of the large one
  EXPECT_EQ(std::count(single.per_message.begin(), single.per_message.end(), 1), 303);
  EXPECT_TRUE(packed.pieces == single.pieces) << "the packed stream carries other pieces, or in another order";
  // The 150 small tensors before the large one (about 350 KB) in one
  // message; its two pieces of 1 MiB alone; its last (about 300 KB) with the
  // 150 small ones after it.
  EXPECT_EQ(packed.per_message, (std::vector<int>{150, 1, 1, 151}));
  for (size_t i = 0; i < packed.message_bytes.size(); ++i) {
    if (packed.per_message[i] > 1) {
      EXPECT_LE(packed.message_bytes[i], size_t{1} << 20) << "message " << i;
    }
  }
  // What the client wrote is the stream's data, tensor by tensor.
  std::map<std::string, std::string> streamed;
  for (const std::string& bytes : single.pieces) {
    v1::ParamChunk pc;
    ASSERT_TRUE(pc.ParseFromString(bytes));
    streamed[pc.tensor()] += pc.data();  // the pieces of a tensor come in order
  }
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    EXPECT_TRUE(params[i] == streamed[job.tensors[i].name]) << job.tensors[i].name;
  }
}

// A job of one large tensor whose step 1 is being applied: its committer
// reads one piece of the params and then no more until Release. The server
// applies each piece as gRPC takes the last, so the step stays half applied
// for a while (until gRPC has buffered the rest), and reads of the job that
// come meanwhile must wait for it.
class StalledCommit {
 public:
  static constexpr uint64_t kNumel = 16'000'001;  // 32 pieces of 1 MiB

  StalledCommit(const std::string& address, const std::string& job, std::mt19937_64& rng)
      : client_(Connect(address)), init_(RandomFloats(rng, kNumel, -1, 1)), applied_(kHyper, init_, false) {
    EXPECT_TRUE(client_->CreateOrAttach(MakeJob(job, 1, {{"w", kNumel}})).ok());
    EXPECT_TRUE(client_->InitFp32("w", init_.data()).ok());
    const auto g = RandomBf16(rng, kNumel, 1.0f);
    EXPECT_TRUE(client_->Push(1, {{"w", g.data()}}).ok());
    applied_.Step({g.data()}, 1e-3, 1.0f);
    stub_ = RawStub(address, 64 << 10);  // the server may send only 64 KiB ahead of the reader
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::CommitRequest r;
    r.set_job(job);
    r.set_step(1);
    r.set_lr(1e-3);
    r.set_gscale(1.0f);
    reader_ = stub_->Commit(&ctx_, r);
    v1::ParamChunk pc;
    EXPECT_TRUE(reader_->Read(&pc));
  }
  // The master once step 1 is applied.
  const std::vector<float>& applied() const { return applied_.p; }
  Client& client() { return *client_; }
  // Reads the rest of the params: the step is then whole.
  grpc::Status Release() {
    v1::ParamChunk pc;
    while (reader_->Read(&pc)) {
    }
    return reader_->Finish();
  }

 private:
  std::unique_ptr<Client> client_;
  std::vector<float> init_;
  ReferenceTensor applied_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::ParamChunk>> reader_;
};

// Reads of a job whose step is half applied wait for the whole step without
// holding a thread. Waiting on gRPC's threads, 48 reads parked every one, the
// commit's own reactions among them, and the whole server hung. Now another
// job steps meanwhile, and every read gets the applied step.
TEST_F(ServiceTest, ReadsOfAHalfAppliedStepWaitWithoutAThread) {
  constexpr uint64_t kLength = 1 << 20;  // of each read: the first elements
  constexpr int kReads = 48;
  StalledCommit stalled(server_->address(), "stalled", rng_);

  std::vector<grpc::Status> read_status(kReads);
  std::vector<std::vector<float>> read_values(kReads);
  std::vector<std::thread> readers;
  auto read_stub = RawStub(server_->address());
  for (int i = 0; i < kReads; ++i) {
    readers.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::ReadRequest req;
      req.set_job("stalled");
      req.set_tensor("w");
      req.set_length(kLength);
      req.set_kind(v1::MASTER);
      auto reader = read_stub->Read(&ctx, req);
      v1::StateChunk chunk;
      while (reader->Read(&chunk)) {
        const size_t n = chunk.data().size() / 4;
        const size_t at = read_values[i].size();
        read_values[i].resize(at + n);
        std::memcpy(read_values[i].data() + at, chunk.data().data(), n * 4);
      }
      read_status[i] = reader->Finish();
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the reads are in and waiting
  // The other job's step, given 10 s; if the server is stuck the test kills
  // it, so that it fails instead of hanging.
  std::promise<absl::Status> side;
  std::thread sider([&] { side.set_value(StepASideJob(server_->address(), "side", rng_)); });
  auto sided = side.get_future();
  if (sided.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    server_->Stop(SIGKILL);
    sider.join();
    for (auto& t : readers) t.join();
    FAIL() << "another job's step waited for the stalled job's reads";
  }
  sider.join();
  EXPECT_TRUE(sided.get().ok());

  EXPECT_TRUE(stalled.Release().ok());
  for (auto& t : readers) t.join();
  for (int i = 0; i < kReads; ++i) {
    ASSERT_TRUE(read_status[i].ok()) << "read " << i << ": " << read_status[i].error_message();
    ASSERT_TRUE(std::equal(read_values[i].begin(), read_values[i].end(), stalled.applied().begin()) &&
                read_values[i].size() == kLength)
        << "read " << i << " is not the applied step";
  }
}


TEST_F(ServiceTest, EveryBadInputGetsItsCodeOverGrpcAndChangesNothing) {
  const JobOptions job = MakeJob("bad", 2, {{"w", 3000}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 3000, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const std::vector<float> before = ReadAll(*client, job);
  auto stub = RawStub(server_->address());
  auto g = RandomBf16(rng_, 3000, 1.0f);

  auto push = [&](const std::vector<v1::GradChunk>& chunks) { return PushChunks(*stub, chunks); };
  auto chunk = [&](uint64_t step, uint32_t rank, const std::string& tensor, uint64_t offset, size_t bytes) {
    v1::GradChunk c;
    c.set_job("bad");
    c.set_step(step);
    c.set_rank(rank);
    c.set_tensor(tensor);
    c.set_offset(offset);
    c.set_dtype(v1::BF16);
    c.set_data(std::string(reinterpret_cast<const char*>(g.data()), std::min<size_t>(bytes, 6000)) +
               std::string(bytes > 6000 ? bytes - 6000 : 0, '\x3f'));
    return c;
  };
  auto commit = [&](uint64_t step, double lr, float gscale) {
    v1::CommitRequest r;
    r.set_job("bad");
    r.set_step(step);
    r.set_lr(lr);
    r.set_gscale(gscale);
    return testing::CommitAndDrain(*stub, r);
  };
  // A one-tensor job's CreateJob, by hand: what the client library refuses
  // before sending.
  const auto create = [&](const std::string& name, uint32_t world_size, uint32_t rank) {
    grpc::ClientContext ctx;
    v1::CreateJobRequest r;
    r.set_job(name);
    r.set_world_size(world_size);
    r.set_rank(rank);
    r.add_groups();
    v1::TensorSpec* t = r.add_tensors();
    t->set_name("w");
    t->set_numel(10);
    v1::CreateJobResponse resp;
    return stub->CreateJob(&ctx, r, &resp);
  };
  struct Case {
    const char* what;
    grpc::Status status;
    grpc::StatusCode code;
    const char* says;
  } cases[] = {
      {"offset+length past the tensor", push({chunk(1, 0, "w", 2990, 40)}), grpc::StatusCode::OUT_OF_RANGE, "past its end"},
      {"ragged data", push({chunk(1, 0, "w", 0, 41)}), grpc::StatusCode::INVALID_ARGUMENT, "whole number"},
      {"unknown tensor", push({chunk(1, 0, "v", 0, 40)}), grpc::StatusCode::NOT_FOUND, "no tensor 'v'"},
      {"rank out of range", push({chunk(1, 7, "w", 0, 40)}), grpc::StatusCode::INVALID_ARGUMENT, "rank 7"},
      {"stale step", push({chunk(0, 0, "w", 0, 40)}), grpc::StatusCode::FAILED_PRECONDITION, "stale"},
      {"future step", push({chunk(5, 0, "w", 0, 40)}), grpc::StatusCode::OUT_OF_RANGE, "future"},
      {"oversize message", push({chunk(1, 0, "w", 0, 9 << 20)}), grpc::StatusCode::RESOURCE_EXHAUSTED, ""},
      {"incomplete push commit", commit(1, 1e-3, 1.0f), grpc::StatusCode::FAILED_PRECONDITION, "push is incomplete"},
      {"NaN gscale", commit(1, 1e-3, NAN), grpc::StatusCode::INVALID_ARGUMENT, "gscale"},
      {"negative lr", commit(1, -1e-3, 1.0f), grpc::StatusCode::INVALID_ARGUMENT, "lr must be finite and >= 0"},
      // Finite as a float, but lr / (1 - beta1) is not: the master would be
      // -inf for good (a probe from the proto alone).
      {"lr whose step size is past the float range", commit(1, 3.3e38, 1.0f), grpc::StatusCode::INVALID_ARGUMENT,
       "step size"},
      {"unknown job", [&] {
         grpc::ClientContext ctx;
         v1::DescribeRequest r;
         r.set_job("nobody");
         v1::DescribeResponse resp;
         return stub->Describe(&ctx, r, &resp);
       }(), grpc::StatusCode::NOT_FOUND, "no job 'nobody'"},
      {"CreateJob rank out of range", create("bad-rank", 2, 2), grpc::StatusCode::INVALID_ARGUMENT,
       "rank 2 is out of range for world_size 2"},
      {"CreateJob world_size 0", create("bad-world", 0, 0), grpc::StatusCode::INVALID_ARGUMENT,
       "world_size is 0: a job has at least one rank"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.error_code(), c.code) << c.what << ": " << c.status.error_message();
    EXPECT_THAT(c.status.error_message(), HasSubstr(c.says)) << c.what;
  }
  // Re-creating with other shapes, through the client library.
  auto other = Connect(server_->address());
  auto recreated = other->CreateOrAttach(MakeJob("bad", 2, {{"w", 4096}}));
  EXPECT_EQ(recreated.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(recreated.status().message()), HasSubstr(server_->address()));
  EXPECT_EQ(ReadAll(*client, job), before);
  EXPECT_EQ(client->step(), 0u);
  {
    grpc::ClientContext ctx;
    v1::DescribeRequest r;
    r.set_job("bad-rank");
    v1::DescribeResponse resp;
    EXPECT_EQ(stub->Describe(&ctx, r, &resp).error_code(), grpc::StatusCode::NOT_FOUND) << "a job was made";
  }
}

// A Step refused for what its commit would carry is refused before its
// push: the servers would otherwise hold its gradients for the step, and
// the caller's next Step, with fresh ones, would be answered as a retry of
// that push and apply the refused call's gradients.
TEST_F(ServiceTest, AStepRefusedForItsCommitsArgumentsPushesNothing) {
  const JobOptions job = MakeJob("lr", 1, {{"w", 4096}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const std::vector<float> before = ReadAll(*client, job);
  std::vector<uint16_t> params(4096);
  const std::vector<ParamView> pv = {{"w", params.data()}};
  const std::vector<ParamView> unknown = {{"v", params.data()}};
  std::vector<uint16_t> other(4096);
  const std::vector<ParamView> twice = {{"w", params.data()}, {"w", other.data()}};
  struct Case {
    const char* what;
    double lr;
    std::vector<double> group_lr;
    const std::vector<ParamView>* params;
    absl::StatusCode code;
    double loss_scale = 1;
  } cases[] = {
      {"NaN lr", NAN, {}, &pv, absl::StatusCode::kInvalidArgument},
      {"negative lr", -1e-3, {}, &pv, absl::StatusCode::kInvalidArgument},
      {"infinite group_lr", 1e-3, {INFINITY}, &pv, absl::StatusCode::kInvalidArgument},
      {"group_lr of two for one group", 1e-3, {1e-3, 1e-3}, &pv, absl::StatusCode::kInvalidArgument},
      {"params of an unknown tensor", 1e-3, {}, &unknown, absl::StatusCode::kNotFound},
      // Found by a black-box probe: each was refused only at the commit, or
      // applied infinities, or left a buffer unwritten with the call OK.
      {"lr past the float range (every param inf)", 1e39, {}, &pv, absl::StatusCode::kInvalidArgument},
      {"lr whose step size lr / (1 - beta1) is past it", 3.3e38, {}, &pv, absl::StatusCode::kInvalidArgument},
      {"group_lr whose step size is past it", 1e-3, {3.3e38}, &pv, absl::StatusCode::kInvalidArgument},
      {"loss_scale whose 1/loss_scale is no float (gscale inf)", 1e-3, {}, &pv, absl::StatusCode::kInvalidArgument,
       1e-39},
      {"two params buffers for one tensor", 1e-3, {}, &twice, absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    const auto refused_grad = RandomBf16(rng_, 4096, 1.0f);
    StepOptions so;
    so.lr = c.lr;
    so.group_lr = c.group_lr;
    so.loss_scale = c.loss_scale;
    const auto refused = client->Step({{"w", refused_grad.data()}}, so, *c.params);
    EXPECT_EQ(refused.status().code(), c.code) << c.what << ": " << refused.status();
  }
  EXPECT_EQ(client->step(), 0u);
  EXPECT_EQ(ReadAll(*client, job), before);
  // The next Step is a step of its own gradients.
  ReferenceTensor ref(kHyper, init, false);
  const auto grad = RandomBf16(rng_, 4096, 1.0f);
  StepOptions so;
  so.lr = 1e-2;
  const auto stepped = client->Step({{"w", grad.data()}}, so, pv);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  ref.Step({grad.data()}, so.lr, stepped->decision.gscale);
  EXPECT_EQ(params, ref.Params());
}

// Two live trainers of one rank (a launch that forgot to give each its
// rank): the second to push is refused, not taken for a retry of the
// first's push with its own gradients dropped. A trainer started in place
// of one (attached after its pushes) goes on, and the one it replaced is
// refused from then on.
TEST_F(ServiceTest, ASecondLiveTrainerOfARankIsRefusedAndAReplacementTakesTheRankOver) {
  const JobOptions job = MakeJob("twins", 1, {{"w", 4096}});
  auto first = Connect(server_->address());
  auto second = Connect(server_->address());
  ASSERT_TRUE(first->CreateOrAttach(job).ok());
  ASSERT_TRUE(second->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(first->InitFp32("w", init.data()).ok());
  ReferenceTensor ref(kHyper, init, false);
  std::vector<uint16_t> params(4096);
  StepOptions so;
  so.lr = 1e-2;
  const auto step = [&](Client& c, const std::vector<uint16_t>& grad) {
    return c.Step({{"w", grad.data()}}, so, {{"w", params.data()}});
  };
  const auto g1 = RandomBf16(rng_, 4096, 1.0f);
  ASSERT_TRUE(step(*first, g1).ok());
  ref.Step({g1.data()}, so.lr, 1.0f);
  const std::vector<float> after_one = ReadAll(*first, job);
  // The second trainer's step 1 would have been answered as a retry.
  const auto twin = step(*second, RandomBf16(rng_, 4096, 1.0f));
  EXPECT_EQ(twin.status().code(), absl::StatusCode::kFailedPrecondition) << twin.status();
  EXPECT_THAT(std::string(twin.status().message()), HasSubstr("another trainer"));
  EXPECT_EQ(ReadAll(*first, job), after_one);
  const auto g2 = RandomBf16(rng_, 4096, 1.0f);
  ASSERT_TRUE(step(*first, g2).ok());
  ref.Step({g2.data()}, so.lr, 1.0f);
  EXPECT_EQ(params, ref.Params());
  // A replacement attaches after the first's pushes: its steps go through,
  // and the trainer it replaced is refused, changing nothing.
  auto replacement = Connect(server_->address());
  ASSERT_EQ(replacement->CreateOrAttach(job).value(), 2u);
  const auto g3 = RandomBf16(rng_, 4096, 1.0f);
  ASSERT_TRUE(step(*replacement, g3).ok());
  ref.Step({g3.data()}, so.lr, 1.0f);
  EXPECT_EQ(params, ref.Params());
  const std::vector<float> after_three = ReadAll(*replacement, job);
  const auto replaced = step(*first, RandomBf16(rng_, 4096, 1.0f));
  EXPECT_EQ(replaced.status().code(), absl::StatusCode::kFailedPrecondition) << replaced.status();
  EXPECT_EQ(ReadAll(*replacement, job), after_three);
}

// A second live trainer of a rank that pushes while the first's push is
// open is refused, and the first's step goes on whole. It was taken for a
// replacement (it attached after the first's push began): an outside
// probe's twin, attached while the first waited at the barrier, had its
// step reported done with its gradients dropped, and the first was the
// one refused, at its next step.
TEST_F(ServiceTest, ATrainerWhosePushStreamIsOpenKeepsItsRankFromAnotherTrainer) {
  const JobOptions job = MakeJob("twin-at-barrier", 2, {{"w", 20000}});
  auto first = Connect(server_->address(), 0), rank1 = Connect(server_->address(), 1);
  ASSERT_TRUE(first->CreateOrAttach(job).ok());
  ASSERT_TRUE(rank1->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 20000, -1, 1);
  ASSERT_TRUE(first->InitFp32("w", init.data()).ok());
  const std::vector<float> before = ReadAll(*first, job);
  const auto g0 = RandomBf16(rng_, 20000, 1.0f), g1 = RandomBf16(rng_, 20000, 1.0f);
  const auto twin_grad = RandomBf16(rng_, 20000, 1.0f);
  StepOptions so;
  so.lr = 1e-2;
  std::vector<uint16_t> p0(20000), p1(20000);
  absl::StatusOr<StepResult> r0;
  std::thread waits([&] { r0 = first->Step({{"w", g0.data()}}, so, {{"w", p0.data()}}); });
  // Once the server holds rank 0's whole push (it waits at the barrier for
  // rank 1), a twin of rank 0 attaches and pushes.
  std::unique_ptr<Client> twin;
  for (int i = 0; i < 200; ++i) {
    twin = Connect(server_->address(), 0);
    ASSERT_TRUE(twin->CreateOrAttach(job).ok());
    if (twin->pushed_ahead() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(twin->pushed_ahead(), 1u);
  std::vector<uint16_t> twin_params(20000);
  const auto refused = twin->Step({{"w", twin_grad.data()}}, so, {{"w", twin_params.data()}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("has a push stream open by another trainer"));
  EXPECT_EQ(ReadAll(*rank1, job), before);
  const auto r1 = rank1->Step({{"w", g1.data()}}, so, {{"w", p1.data()}});
  waits.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({g0.data(), g1.data()}, so.lr, r0->decision.gscale);
  EXPECT_EQ(p0, ref.Params());
  EXPECT_EQ(p1, ref.Params());
  // The twin calls Step again, the first trainer's push having ended: it is
  // refused still (it was taken for a replacement then, its step reported
  // done, and the first trainer refused from then on: an outside probe).
  const std::vector<float> after_one = ReadAll(*rank1, job);
  const auto again = twin->Step({{"w", twin_grad.data()}}, so, {{"w", twin_params.data()}});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("that push was answered since"));
  EXPECT_EQ(ReadAll(*rank1, job), after_one);
  // The first trainer goes on; the twin stays refused.
  const auto g0b = RandomBf16(rng_, 20000, 1.0f), g1b = RandomBf16(rng_, 20000, 1.0f);
  std::thread second([&] { r0 = first->Step({{"w", g0b.data()}}, so, {{"w", p0.data()}}); });
  ASSERT_TRUE(rank1->Step({{"w", g1b.data()}}, so, {{"w", p1.data()}}).ok());
  second.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ref.Step({g0b.data(), g1b.data()}, so.lr, r0->decision.gscale);
  EXPECT_EQ(p0, ref.Params());
  EXPECT_EQ(twin->Step({{"w", twin_grad.data()}}, so, {{"w", twin_params.data()}}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A second live trainer that attaches while the first's push waits at the
// barrier, and pushes only once that push is answered, before the commit:
// refused, where it passed as the first's replacement, its push answered as
// a retry of the first's, its gradients dropped (an outside probe). The
// answer shows that the first trainer lived after the second attached.
TEST_F(ServiceTest, ATrainerThatAttachedWhileAnotherTrainersPushWasOpenIsRefusedOnceItIsAnswered) {
  const JobOptions job = MakeJob("attached-during-push", 2, {{"w", 20000}});
  auto first = Connect(server_->address(), 0), rank1 = Connect(server_->address(), 1);
  ASSERT_TRUE(first->CreateOrAttach(job).ok());
  ASSERT_TRUE(rank1->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 20000, -1, 1);
  ASSERT_TRUE(first->InitFp32("w", init.data()).ok());
  const auto g0 = RandomBf16(rng_, 20000, 1.0f), g1 = RandomBf16(rng_, 20000, 1.0f);
  const auto late_grad = RandomBf16(rng_, 20000, 1.0f);
  absl::StatusOr<PushResult> pushed;
  std::thread waits([&] { pushed = first->Push(1, {{"w", g0.data()}}); });
  std::unique_ptr<Client> late;  // attached once the server holds the first's whole push
  for (int i = 0; i < 200; ++i) {
    late = Connect(server_->address(), 0);
    ASSERT_TRUE(late->CreateOrAttach(job).ok());
    if (late->pushed_ahead() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(late->pushed_ahead(), 1u);
  ASSERT_TRUE(rank1->Push(1, {{"w", g1.data()}}).ok());
  waits.join();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  const auto refused = late->Push(1, {{"w", late_grad.data()}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("has been pushed by another trainer since"));
  std::vector<uint16_t> p0(20000), p1(20000);
  ASSERT_TRUE(first->Commit(1, 1e-2, 0.5f, false, {{"w", p0.data()}}).ok());
  ASSERT_TRUE(rank1->Commit(1, 1e-2, 0.5f, false, {{"w", p1.data()}}).ok());
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({g0.data(), g1.data()}, 1e-2, 0.5f);
  EXPECT_EQ(p0, ref.Params());
  EXPECT_EQ(p1, ref.Params());
}

// A trainer attaching learns whether the server holds its rank's push of
// the next step (CreateJobResponse.rank_pushed), which the server would use
// in place of the trainer's own: a whole push of rank 1 waiting at the
// barrier is reported to a rank 1 that attaches, not to a rank 0, and no
// longer once the barrier's deadline has aborted the round.
TEST_F(ServiceTest, AnAttachingTrainerLearnsThatItsRanksPushOfTheNextStepStandsUntilTheDeadline) {
  JobOptions job = MakeJob("ahead", 2, {{"w", 20000}});
  job.barrier_timeout_ms = 2000;
  auto rank0 = Connect(server_->address(), 0);
  ASSERT_TRUE(rank0->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 20000, -1, 1);
  ASSERT_TRUE(rank0->InitFp32("w", init.data()).ok());
  ClientOptions once;  // the deadline's DEADLINE_EXCEEDED is the answer, not a retry
  once.servers = {server_->address()};
  once.rank = 1;
  once.max_attempts = 1;
  auto pusher = Client::Connect(once).value();
  ASSERT_TRUE(pusher->CreateOrAttach(job).ok());
  EXPECT_EQ(pusher->pushed_ahead(), 0u);
  const auto g = RandomBf16(rng_, 20000, 1.0f);
  absl::StatusOr<PushResult> pushed;
  std::thread push([&] { pushed = pusher->Push(1, {{"w", g.data()}}); });
  uint64_t ahead = 0;  // once the server has the whole push: at most a second
  for (int i = 0; i < 100 && ahead == 0; ++i) {
    auto replacement = Connect(server_->address(), 1);
    ASSERT_TRUE(replacement->CreateOrAttach(job).ok());
    ahead = replacement->pushed_ahead();
    if (ahead == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ahead, 1u);
  auto other_rank = Connect(server_->address(), 0);
  ASSERT_TRUE(other_rank->CreateOrAttach(job).ok());
  EXPECT_EQ(other_rank->pushed_ahead(), 0u);  // rank 1's push is not rank 0's
  push.join();
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kDeadlineExceeded) << pushed.status();
  auto after = Connect(server_->address(), 1);
  ASSERT_TRUE(after->CreateOrAttach(job).ok());
  EXPECT_EQ(after->pushed_ahead(), 0u);

  // Rank 1's trainer dies after its whole push (its stream cut off while it
  // waits at the barrier), and rank 0's never comes, so nothing ends the
  // round: the push stands until the deadline, and not after it, when the
  // next push would open a fresh round.
  const auto start = std::chrono::steady_clock::now();
  {
    v1::GradChunk c;
    c.set_job("ahead");
    c.set_step(1);
    c.set_rank(1);
    c.set_tensor("w");
    c.set_dtype(v1::BF16);
    c.set_data(std::string(reinterpret_cast<const char*>(g.data()), g.size() * 2));
    EXPECT_EQ(PushChunks(*RawStub(server_->address()), {c}, std::chrono::milliseconds(300)).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  auto orphaned = Connect(server_->address(), 1);
  ASSERT_TRUE(orphaned->CreateOrAttach(job).ok());
  EXPECT_EQ(orphaned->pushed_ahead(), 1u);
  std::this_thread::sleep_until(start + std::chrono::milliseconds(job.barrier_timeout_ms + 300));
  auto late = Connect(server_->address(), 1);
  ASSERT_TRUE(late->CreateOrAttach(job).ok());
  EXPECT_EQ(late->pushed_ahead(), 0u);
}

// A chunk of a tensor its own stream declared no_grad is refused before it
// is summed (summed, it could not be taken back, and the refusal at the
// stream's end would fail the round for every rank): the other rank, waiting
// at the barrier, goes on, and the step is the two ranks' sum.
TEST_F(ServiceTest, AChunkOfATensorItsStreamDeclaredNoGradIsRefusedBeforeItCounts) {
  const JobOptions job = MakeJob("declared", 2, {{"w", 3000}});
  ClientOptions once;  // a discarded round is DEADLINE_EXCEEDED, which a retry would hide
  once.servers = {server_->address()};
  once.rank = 1;
  once.max_attempts = 1;
  auto c0 = Connect(server_->address(), 0), c1 = Client::Connect(once).value();
  ASSERT_TRUE(c0->CreateOrAttach(job).ok());
  ASSERT_TRUE(c1->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 3000, -1, 1);
  ASSERT_TRUE(c0->InitFp32("w", init.data()).ok());
  auto g0 = RandomBf16(rng_, 3000, 1.0f), g1 = RandomBf16(rng_, 3000, 1.0f);
  absl::Status rank1;
  std::thread waiting([&] { rank1 = c1->Push(1, {{"w", g1.data()}}).status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // rank 1 is in, waiting for rank 0

  auto stub = RawStub(server_->address());
  grpc::ClientContext ctx;
  v1::PushResponse resp;
  auto w = stub->Push(&ctx, &resp);
  v1::GradChunk head;
  head.set_job("declared");
  head.set_step(1);
  head.set_rank(0);
  head.add_no_grad("w");
  v1::GradChunk chunk;
  chunk.set_tensor("w");
  chunk.set_dtype(v1::BF16);
  chunk.set_data(std::string(reinterpret_cast<const char*>(g0.data()), 40));
  w->Write(head);
  w->Write(chunk);
  w->WritesDone();
  const grpc::Status refused = w->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("declared it no_grad"));

  EXPECT_TRUE(c0->Push(1, {{"w", g0.data()}}).ok());
  waiting.join();
  EXPECT_TRUE(rank1.ok()) << "the waiting rank failed: " << rank1;
  std::vector<uint16_t> params(3000, 0xFFFF);
  ASSERT_TRUE(c0->Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}}).ok());
  ReferenceTensor ref(kHyper, init, false);
  ref.Step({g0.data(), g1.data()}, 1e-3, 1.0f);
  EXPECT_EQ(params, ref.Params());
}

TEST_F(ServiceTest, PushAfterTheBarrierDeadlineIsRefusedAndChangesNothing) {
  JobOptions job = MakeJob("late", 2, {{"w", 2000}});
  job.barrier_timeout_ms = 300;
  ClientOptions o;
  o.servers = {server_->address()};
  o.max_attempts = 1;  // see the deadline itself, not the retries
  auto client = Client::Connect(o).value();
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 2000, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const auto before = ReadAll(*client, job);
  auto g = RandomBf16(rng_, 2000, 1.0f);
  auto r = client->Push(1, {{"w", g.data()}});  // rank 1 never comes
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("ranks {1} of 2"));
  EXPECT_EQ(ReadAll(*client, job), before);
  // Each retry waits out the barrier again: the caller waited that many
  // deadlines, which the message now says (it read as one).
  o.max_attempts = 2;
  auto retrying = Client::Connect(o).value();
  ASSERT_TRUE(retrying->CreateOrAttach(job).ok());
  r = retrying->Push(1, {{"w", g.data()}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("(2 attempts; each waited out the barrier's deadline for the ranks named)"));
  EXPECT_EQ(ReadAll(*client, job), before);
}

// A job that leaves its barrier deadline to the server's flag: the client
// learns it from CreateJob and waits past it, so a push that the other rank
// never joins hears the server's answer naming that rank, not a bare
// DEADLINE_EXCEEDED of its own shorter call deadline.
TEST(BarrierTest, AJobWithTheServersBarrierWaitsForTheServersAnswer) {
  auto server = ServerProcess::Start({"--barrier_timeout_ms=2000"});
  ASSERT_NE(server, nullptr);
  JobOptions job = MakeJob("flagged", 2, {{"w", 2000}});
  job.barrier_timeout_ms = 0;  // the server's
  ClientOptions o;
  o.servers = {server->address()};
  o.max_attempts = 1;
  o.rpc_timeout_ms = 500;
  auto client = Client::Connect(o).value();
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  std::mt19937_64 rng(5);
  auto init = RandomFloats(rng, 2000, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  auto g = RandomBf16(rng, 2000, 1.0f);
  const auto r = client->Push(1, {{"w", g.data()}});  // rank 1 never comes
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("ranks {1} of 2"));
}

// The threads of a process, from /proc.
size_t ThreadCount(pid_t pid) {
  size_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec);
       it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Pushes waiting at the barrier are served on the callback API and hold no
// server thread: 200 of them leave the thread count far below one thread
// each, another job steps meanwhile, and the last rank's push releases them
// all. Alone the count stays where it was (13-17); gRPC's callback pool
// grows when its threads are starved of CPU, and in a parallel ctest on a
// loaded 2-core machine it once reached 63 from 14.
TEST_F(ServiceTest, PushesWaitingAtTheBarrierHoldNoServerThread) {
  constexpr uint32_t kWaiting = 200;
  JobOptions job = MakeJob("wide", kWaiting + 1, {{"w", 64}});
  job.barrier_timeout_ms = 60000;
  auto first = Connect(server_->address());
  ASSERT_TRUE(first->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 64, -1, 1);
  ASSERT_TRUE(first->InitFp32("w", init.data()).ok());
  const size_t idle = ThreadCount(server_->pid());
  std::vector<std::vector<uint16_t>> grads;
  for (uint32_t r = 0; r <= kWaiting; ++r) grads.push_back(RandomBf16(rng_, 64, 1.0f));
  std::vector<std::thread> ranks;
  std::atomic<int> answered{0};
  for (uint32_t r = 0; r < kWaiting; ++r) {
    ranks.emplace_back([&, r] {
      auto client = Connect(server_->address(), r);
      if (client->CreateOrAttach(job).ok() && client->Push(1, {{"w", grads[r].data()}}).ok()) ++answered;
    });
  }
  // Every waiting rank has pushed once the round lacks only the last.
  const JobOptions other = MakeJob("other", 1, {{"w", 100}});
  auto side = Connect(server_->address());
  ASSERT_TRUE(side->CreateOrAttach(other).ok());
  auto side_init = RandomFloats(rng_, 100, -1, 1);
  ASSERT_TRUE(side->InitFp32("w", side_init.data()).ok());
  size_t most = 0;
  for (int i = 0; i < 300 && answered == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    most = std::max(most, ThreadCount(server_->pid()));
    if (i % 10 == 0) {  // the other job keeps stepping
      auto g = RandomBf16(rng_, 100, 1.0f);
      std::vector<uint16_t> p(100);
      StepOptions so;
      so.lr = 1e-3;
      ASSERT_TRUE(side->Step({{"w", g.data()}}, so, {{"w", p.data()}}).ok());
    }
  }
  EXPECT_EQ(answered, 0) << "a push was answered before the last rank came";
  std::printf("server threads: %zu idle, at most %zu with %u pushes waiting\n", idle, most, kWaiting);
  EXPECT_LT(most, idle + 64) << "waiting pushes hold server threads";
  auto last = Connect(server_->address(), kWaiting);
  ASSERT_TRUE(last->CreateOrAttach(job).ok());
  EXPECT_TRUE(last->Push(1, {{"w", grads[kWaiting].data()}}).ok());
  for (auto& t : ranks) t.join();
  EXPECT_EQ(answered, static_cast<int>(kWaiting));
}

TEST_F(ServiceTest, TwoJobsAreIsolated) {
  const JobOptions ja = MakeJob("a", 1, {{"w", 5000}}), jb = MakeJob("b", 1, {{"w", 5000}}, StatePrecision::kBf16);
  auto ca = Connect(server_->address()), cb = Connect(server_->address());
  ASSERT_TRUE(ca->CreateOrAttach(ja).ok());
  ASSERT_TRUE(cb->CreateOrAttach(jb).ok());
  auto ia = RandomFloats(rng_, 5000, -1, 1), ib = RandomFloats(rng_, 5000, -1, 1);
  ASSERT_TRUE(ca->InitFp32("w", ia.data()).ok());
  ASSERT_TRUE(cb->InitFp32("w", ib.data()).ok());
  ReferenceTensor ra(kHyper, ia, false), rb(kHyper, ib, true);
  std::vector<uint16_t> pa(5000), pb(5000);
  for (int step = 1; step <= 20; ++step) {
    auto ga = RandomBf16(rng_, 5000, 1.0f), gb = RandomBf16(rng_, 5000, 1.0f);
    StepOptions so;
    so.lr = 1e-2;
    auto sa = ca->Step({{"w", ga.data()}}, so, {{"w", pa.data()}});
    ASSERT_TRUE(sa.ok());
    ra.Step({ga.data()}, so.lr, 1.0f);
    if (step % 2 == 0) {  // b moves at half the pace
      ASSERT_TRUE(cb->Step({{"w", gb.data()}}, so, {{"w", pb.data()}}).ok());
      rb.Step({gb.data()}, so.lr, 1.0f);
    }
  }
  EXPECT_EQ(pa, ra.Params());
  EXPECT_EQ(pb, rb.Params());
  EXPECT_EQ(ca->step(), 20u);
  EXPECT_EQ(cb->step(), 10u);
  ASSERT_TRUE(cb->Drop().ok());
  std::vector<float> master(5000);
  ASSERT_TRUE(ca->Read("w", StateToRead::kMaster, 0, 5000, master.data()).ok());
  EXPECT_EQ(master, ra.p);
}

// A trainer still running when its job is dropped (by an admin, another
// client) and made again by a new run under the same name must not step the
// new run's job: its calls are NOT_FOUND "was dropped", and the new job is
// left as it was. It used to be taken as the new job's next step.
TEST_F(ServiceTest, ATrainerOfAJobDroppedAndMadeAgainIsRefusedNotMergedIntoTheNewOne) {
  const JobOptions job = MakeJob("reused", 1, {{"w", 3000}});
  auto old_run = Connect(server_->address());
  ASSERT_TRUE(old_run->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 3000, -1, 1);
  ASSERT_TRUE(old_run->InitFp32("w", init.data()).ok());
  std::vector<uint16_t> params(3000);
  StepOptions so;
  so.lr = 1e-2;
  for (int step = 1; step <= 2; ++step) {
    auto g = RandomBf16(rng_, 3000, 1.0f);
    ASSERT_TRUE(old_run->Step({{"w", g.data()}}, so, {{"w", params.data()}}).ok());
  }
  auto admin = Connect(server_->address());
  ASSERT_TRUE(admin->CreateOrAttach(job).ok());
  ASSERT_TRUE(admin->Drop().ok());
  auto new_run = Connect(server_->address());
  ASSERT_EQ(new_run->CreateOrAttach(job).value_or(99), 0u);
  auto fresh = RandomFloats(rng_, 3000, -1, 1);
  ASSERT_TRUE(new_run->InitFp32("w", fresh.data()).ok());
  for (int step = 1; step <= 2; ++step) {
    auto g = RandomBf16(rng_, 3000, 1.0f);
    ASSERT_TRUE(new_run->Step({{"w", g.data()}}, so, {{"w", params.data()}}).ok());
  }
  std::vector<float> before(3000), after(3000);
  ASSERT_TRUE(new_run->Read("w", StateToRead::kMaster, 0, 3000, before.data()).ok());
  auto g = RandomBf16(rng_, 3000, 1.0f);
  const auto stepped = old_run->Step({{"w", g.data()}}, so, {{"w", params.data()}});
  EXPECT_EQ(stepped.status().code(), absl::StatusCode::kNotFound) << stepped.status();
  EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("was dropped on this server and made again"));
  EXPECT_EQ(old_run->InitFp32("w", init.data()).code(), absl::StatusCode::kNotFound);
  // Nor read it as its own, nor drop it (a trainer's cleanup at its end).
  std::vector<float> read(3000);
  EXPECT_EQ(old_run->Read("w", StateToRead::kMaster, 0, 3000, read.data()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(old_run->Describe().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(old_run->Drop().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(new_run->Read("w", StateToRead::kMaster, 0, 3000, after.data()).ok());
  EXPECT_EQ(after, before);
  auto described = new_run->Describe();
  ASSERT_TRUE(described.ok());
  EXPECT_EQ(described->front().step, 2u);
  // The new run goes on, its step its own.
  ASSERT_TRUE(new_run->Step({{"w", g.data()}}, so, {{"w", params.data()}}).ok());
  EXPECT_EQ(new_run->step(), 3u);
}

TEST_F(ServiceTest, VerifyStateFailsWhenStateIsNotHeldAtTheAskedPrecision) {
  // Another trainer created the job with bf16 state; this one asks for fp32
  // and must be refused rather than silently train on bf16 state.
  auto bf16_client = Connect(server_->address());
  ASSERT_TRUE(bf16_client->CreateOrAttach(MakeJob("prec", 1, {{"w", 100}}, StatePrecision::kBf16)).ok());
  ASSERT_TRUE(bf16_client->VerifyState().ok());
  auto fp32_client = Connect(server_->address());
  EXPECT_EQ(fp32_client->CreateOrAttach(MakeJob("prec", 1, {{"w", 100}})).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(fp32_client->VerifyState().code(), absl::StatusCode::kFailedPrecondition);  // never attached
}

// A job of many tensors asked again under other names differs in every
// one: the ALREADY_EXISTS names the first few, and its message fits in a
// header, where before the client got RESOURCE_EXHAUSTED ("received
// initial metadata size exceeds limit") instead.
TEST_F(ServiceTest, AnAlreadyExistsOfManyDifferencesStaysAnAlreadyExists) {
  std::vector<std::pair<std::string, uint64_t>> first, second;
  for (int i = 0; i < 3000; ++i) {
    first.emplace_back(absl::StrCat("layer.", i, ".weight.with.a.long.name"), 4);
    second.emplace_back(absl::StrCat("block.", i, ".weight.with.a.long.name"), 4);
  }
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(MakeJob("many", 1, first)).ok());
  auto other = Connect(server_->address());
  const absl::Status refused = other->CreateOrAttach(MakeJob("many", 1, second)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("more differences"));
  EXPECT_LT(refused.message().size(), kMaxStatusMessageBytes + 200);
}

// Any message past the bound is cut at a character's first byte, saying
// how much was left out.
TEST(GrpcEdgeTest, ALongStatusMessageIsCutAtACharacter) {
  const std::string long_text = std::string(kMaxStatusMessageBytes - 1, 'x') + "\xc3\xa9" + std::string(100, 'y');
  const grpc::Status cut = ToGrpcStatus(absl::NotFoundError(long_text));
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(cut.error_message(), std::string(kMaxStatusMessageBytes - 1, 'x') + "... (102 more bytes)");
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("short")).error_message(), "short");
}

TEST(ClientRetries, UnavailableIsRetriedUntilTheServerComes) {
  const int port = testing::FreeLoopbackPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ClientOptions once;
  once.servers = {address};
  once.max_attempts = 1;
  once.rpc_timeout_ms = 2000;
  auto impatient = Client::Connect(once).value();
  const absl::Status away = impatient->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})).status();
  EXPECT_EQ(away.code(), absl::StatusCode::kUnavailable);
  // What to do about it, not only what happened.
  EXPECT_THAT(std::string(away.message()),
              AllOf(HasSubstr(address), HasSubstr("(1 attempt;"), HasSubstr("safe to retry once the server is back")));

  // The default retries (backoff 100, 200, 400 and 800 ms: 1.5 s in all)
  // find a server that comes up 0.6 s into them. Before, the client saw its
  // channel connect only at gRPC's 5 s backup poll: 8-10 s late, past
  // every retry.
  ClientOptions patient = once;
  patient.max_attempts = ClientOptions().max_attempts;
  auto client = Client::Connect(patient).value();
  absl::StatusOr<uint64_t> step;
  std::thread trainer([&] { step = client->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})); });
  // Started from this thread: the server dies with the thread that forked it.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  auto server = ServerProcess::Start({"--port=" + std::to_string(port)});
  trainer.join();
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(step.ok()) << step.status();

  // A caller's own loop of single attempts, on the channel that failed
  // above, finds the server back from a restart within a few of them.
  server->Stop(SIGKILL);
  EXPECT_EQ(impatient->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})).status().code(), absl::StatusCode::kUnavailable);
  server = ServerProcess::Start({"--port=" + std::to_string(port)});
  ASSERT_NE(server, nullptr);
  const auto back = std::chrono::steady_clock::now();
  absl::StatusOr<uint64_t> again;
  do {
    again = impatient->CreateOrAttach(MakeJob("r", 1, {{"w", 10}}));
  } while (!again.ok() && std::chrono::steady_clock::now() - back < std::chrono::seconds(4));
  EXPECT_TRUE(again.ok()) << again.status() << " 4 s after the server was back";
}

// A server down for a while grows its clients' channel reconnect backoff
// to 1 s, and a channel in TRANSIENT_FAILURE fails calls at once until that
// timer runs out: a call with two attempts (150 ms) made once the server was
// back failed 5 times in 6, the call after it succeeded. Its first call now
// finds the server.
TEST(ClientRetries, TheFirstCallAfterARestartFindsTheServerWhateverTheChannelsBackoff) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({"--port=" + std::to_string(port)});
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.servers = {"127.0.0.1:" + std::to_string(port)};
  options.max_attempts = 2;
  options.rpc_timeout_ms = 2000;
  auto client = Client::Connect(options).value();
  ASSERT_TRUE(client->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})).ok());
  server->Stop(SIGKILL);
  // Down for 3 s of failing calls: the channel's backoff is at its 1 s cap.
  int failed = 0;
  for (const auto down = std::chrono::steady_clock::now();
       std::chrono::steady_clock::now() - down < std::chrono::seconds(3); ++failed) {
    ASSERT_EQ(client->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})).status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_GE(failed, 5);
  for (int round = 0; round < 3; ++round) {
    server = ServerProcess::Start({"--port=" + std::to_string(port)});
    ASSERT_NE(server, nullptr);
    const absl::StatusOr<uint64_t> back = client->CreateOrAttach(MakeJob("r", 1, {{"w", 10}}));
    EXPECT_TRUE(back.ok()) << "round " << round << ": " << back.status();
    server->Stop(SIGKILL);
    for (const auto down = std::chrono::steady_clock::now();
         std::chrono::steady_clock::now() - down < std::chrono::milliseconds(1500);) {
      ASSERT_FALSE(client->CreateOrAttach(MakeJob("r", 1, {{"w", 10}})).ok());
    }
  }
}

// Init streams that a client holds open without finishing hold no server
// thread either (they once pinned one each, until a task limit made every
// new call fail): 300 of them leave the thread count as it was, another job
// steps meanwhile, and each is answered once its client finishes it.
// A server that takes the connection and never answers (hung): the last
// attempt's DEADLINE_EXCEEDED says so and that the call is safe to retry,
// rather than gRPC's bare "Deadline Exceeded".
TEST(ClientRetries, AServerThatNeverAnswersIsDeadlineExceededWithAdvice) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 8), 0);  // the kernel completes connections; nobody reads
  socklen_t len = sizeof addr;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ClientOptions options;
  options.servers = {"127.0.0.1:" + std::to_string(ntohs(addr.sin_port))};
  options.max_attempts = 2;
  options.rpc_timeout_ms = 300;
  auto client = Client::Connect(options).value();
  const absl::Status hung = client->CreateOrAttach(MakeJob("hung", 1, {{"w", 10}})).status();
  close(fd);
  EXPECT_EQ(hung.code(), absl::StatusCode::kDeadlineExceeded) << hung;
  EXPECT_THAT(std::string(hung.message()),
              AllOf(HasSubstr(options.servers[0]), HasSubstr("(2 attempts;"), HasSubstr("safe to retry")));
}

// An Init message of fp32 values for tensor "w" of `job`, from `offset`, as
// a client written from the proto sends it.
v1::InitChunk InitOfW(const std::string& job, uint64_t offset, absl::Span<const float> values) {
  v1::InitChunk c;
  c.set_job(job);
  c.set_tensor("w");
  c.set_offset(offset);
  c.set_dtype(v1::FP32);
  c.set_data(values.data(), values.size() * 4);
  return c;
}

TEST_F(ServiceTest, InitStreamsHeldOpenHoldNoServerThread) {
  constexpr int kStreams = 300;
  const JobOptions held = MakeJob("held", 1, {{"w", 64}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(held).ok());
  const size_t idle = ThreadCount(server_->pid());
  auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  auto values = RandomFloats(rng_, 64, -1, 1);
  const std::string message = InitOfW("held", 0, values).SerializeAsString();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<wire::Stream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    streams.push_back(std::make_unique<wire::Stream>(&generic, contexts.back().get(), "/shardopt.v1.Optimizer/Init"));
    grpc::Slice slice(message);
    ASSERT_TRUE(streams.back()->Write(grpc::ByteBuffer(&slice, 1))) << "stream " << i;
  }
  const size_t open = ThreadCount(server_->pid());
  EXPECT_TRUE(StepASideJob(server_->address(), "other", rng_).ok());
  std::printf("server threads: %zu idle, %zu with %d Init streams open\n", idle, open, kStreams);
  EXPECT_LT(open, idle + 16) << "open Init streams hold server threads";
  for (auto& stream : streams) {
    stream->WritesDone();
    grpc::ByteBuffer answer;  // a generic call's status comes after its message is read
    EXPECT_TRUE(stream->Read(&answer));
    const grpc::Status done = stream->Finish();
    EXPECT_TRUE(done.ok()) << done.error_code() << " " << done.error_message();
  }
}

// Read streams whose caller does not take the chunks hold no thread either:
// Read is served on the callback API, the next chunk read from the job only
// once the last is written, so flow control holds it.
TEST_F(ServiceTest, ReadStreamsNotConsumedHoldNoServerThread) {
  constexpr int kStreams = 100;
  const JobOptions held = MakeJob("read-held", 1, {{"w", 8 << 20}});  // 32 MiB of master: many chunks
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(held).ok());
  std::vector<float> init(8 << 20, 0.5f);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const size_t idle = ThreadCount(server_->pid());
  auto stub = RawStub(server_->address());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::StateChunk>>> readers;
  v1::ReadRequest req;
  req.set_job("read-held");
  req.set_tensor("w");
  req.set_kind(v1::MASTER);
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    readers.push_back(stub->Read(contexts.back().get(), req));  // and never read
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const size_t open = ThreadCount(server_->pid());
  std::printf("server threads: %zu idle, %zu with %d Read streams not consumed\n", idle, open, kStreams);
  EXPECT_LT(open, idle + 16) << "Read streams hold server threads";
  // One of them, read to its end, has every byte.
  v1::StateChunk chunk;
  uint64_t bytes = 0;
  while (readers[0]->Read(&chunk)) bytes += chunk.data().size();
  EXPECT_TRUE(readers[0]->Finish().ok());
  EXPECT_EQ(bytes, uint64_t{8 << 20} * 4);
  for (size_t i = 1; i < readers.size(); ++i) {
    contexts[i]->TryCancel();
    readers[i]->Finish().IgnoreError();
  }
}

// A push stream that sends nothing for --idle_stream_timeout_ms is cancelled
// and counts for nothing; a push waiting at the barrier longer than that is
// the server's wait, not the stream's, and is answered.
TEST_F(ServiceTest, AnIdlePushStreamIsCancelledButAWaitAtTheBarrierIsNot) {
  auto server = ServerProcess::Start({"--idle_stream_timeout_ms=300"});
  ASSERT_NE(server, nullptr);
  const JobOptions job = MakeJob("idle", 1, {{"w", 4096}});
  auto client = Connect(server->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto init = RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  auto stale = RandomBf16(rng_, 4096, 1.0f);
  v1::GradChunk half;
  half.set_job("idle");
  half.set_step(1);
  half.set_tensor("w");
  half.set_dtype(v1::BF16);
  half.set_data(stale.data(), 2048 * 2);
  const auto started = std::chrono::steady_clock::now();
  grpc::Status idle;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    wire::Stream stream(&generic, &ctx, "/shardopt.v1.Optimizer/Push");
    grpc::Slice slice(half.SerializeAsString());
    ASSERT_TRUE(stream.Write(grpc::ByteBuffer(&slice, 1)));
    idle = stream.Finish();  // and then sends nothing
  }
  EXPECT_EQ(idle.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << idle.error_message();
  EXPECT_THAT(idle.error_message(), HasSubstr("sent nothing for"));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  // Its half counts for nothing: the step is the next push's alone.
  ExpectTheNextStepIsItsPushAlone(*client, init, rng_);

  // Two ranks: rank 0 waits at the barrier four idle timeouts for rank 1.
  const JobOptions pair = MakeJob("pair", 2, {{"w", 64}});
  auto first = Connect(server->address(), 0), second = Connect(server->address(), 1);
  ASSERT_TRUE(first->CreateOrAttach(pair).ok());
  ASSERT_TRUE(second->CreateOrAttach(pair).ok());
  auto pair_init = RandomFloats(rng_, 64, -1, 1);
  ASSERT_TRUE(first->InitFp32("w", pair_init.data()).ok());
  auto g0 = RandomBf16(rng_, 64, 1.0f), g1 = RandomBf16(rng_, 64, 1.0f);
  absl::StatusOr<PushResult> waited;
  std::thread rank0([&] { waited = first->Push(1, {{"w", g0.data()}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_TRUE(second->Push(1, {{"w", g1.data()}}).ok());
  rank0.join();
  EXPECT_TRUE(waited.ok()) << waited.status();
}

// A client stream of `messages` as bytes, through gRPC's generic stub (a
// client written from the proto may send anything): the status it ends with.
grpc::Status StreamOf(const std::string& address, const std::string& method, const std::vector<std::string>& messages) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  wire::Stream stream(&generic, &ctx, method);
  for (const std::string& m : messages) {
    grpc::Slice slice(m);
    if (!stream.Write(grpc::ByteBuffer(&slice, 1))) break;
  }
  stream.WritesDone();
  return stream.Finish();
}

// An Init stream is of one job, as a push stream is: a chunk naming another
// is refused (it wrote the other job's values, without tokens). A chunk
// refused for what it holds says how many elements the chunks before it
// wrote, as one that does not parse does: they stay written.
TEST_F(ServiceTest, AnInitStreamIsOfOneJobAndARefusalSaysWhatWasWritten) {
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(MakeJob("init-a", 1, {{"w", 64}})).ok());
  auto other = Connect(server_->address());
  ASSERT_TRUE(other->CreateOrAttach(MakeJob("init-b", 1, {{"w", 64}})).ok());
  const auto values = RandomFloats(rng_, 64, -1, 1);
  const auto chunk = [&](const std::string& job, uint64_t offset, float first) {
    std::vector<float> v(values.begin() + offset, values.begin() + offset + 16);
    v[0] = first;
    return InitOfW(job, offset, v).SerializeAsString();
  };
  const grpc::Status switched = StreamOf(server_->address(), "/shardopt.v1.Optimizer/Init",
                                         {chunk("init-a", 0, values[0]), chunk("init-b", 16, values[16])});
  EXPECT_EQ(switched.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << switched.error_message();
  EXPECT_THAT(switched.error_message(), HasSubstr("an Init stream is of one job: 'init-a', then 'init-b'"));
  EXPECT_THAT(switched.error_message(), HasSubstr("after 16 elements were written"));
  std::vector<float> b(64, NAN);
  EXPECT_EQ(other->Read("w", StateToRead::kMaster, 0, 64, b.data()).code(), absl::StatusCode::kOk);
  EXPECT_NE(b[16], values[16]);  // init-b's master was not written (no initial value: zeros)
  const grpc::Status nan = StreamOf(server_->address(), "/shardopt.v1.Optimizer/Init",
                                    {chunk("init-a", 16, values[16]), chunk("", 32, NAN)});
  EXPECT_EQ(nan.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << nan.error_message();
  EXPECT_THAT(nan.error_message(), HasSubstr("not finite; the stream is refused after 16 elements were written"));
}

// An Init stream is of the life of its job that its first chunk wrote, also
// when its chunks name none (incarnation 0): a chunk after the job was
// dropped and made again is NOT_FOUND, not written into the new run's job,
// whose master then held values of a stream begun against the dropped one
// and whose push was accepted (a probe).
TEST_F(ServiceTest, AnInitStreamIsOfOneLifeOfItsJob) {
  const JobOptions job = MakeJob("init-life", 1, {{"w", 64}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  const auto values = RandomFloats(rng_, 64, -1, 1);
  const auto chunk = [&](const std::string& name, uint64_t offset) {
    return InitOfW(name, offset, absl::MakeConstSpan(values).subspan(offset, 32));
  };
  const auto message = [](const v1::InitChunk& c) {
    grpc::Slice slice(c.SerializeAsString());
    return grpc::ByteBuffer(&slice, 1);
  };
  auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  wire::Stream stream(&generic, &ctx, "/shardopt.v1.Optimizer/Init");
  ASSERT_TRUE(stream.Write(message(chunk("init-life", 0))));
  std::vector<float> master(64, NAN);
  for (int k = 0; k < 200 && master[0] != values[0]; ++k) {  // the first chunk written
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_TRUE(client->Read("w", StateToRead::kMaster, 0, 64, master.data()).ok());
  }
  ASSERT_EQ(master[0], values[0]);
  ASSERT_TRUE(client->Drop().ok());
  auto next_run = Connect(server_->address());
  ASSERT_TRUE(next_run->CreateOrAttach(job).ok());
  stream.Write(message(chunk("", 32)));  // names no job and no life
  stream.WritesDone();
  grpc::ByteBuffer answer;
  EXPECT_FALSE(stream.Read(&answer)) << "answered as if its chunks were written";
  const grpc::Status second = stream.Finish();
  EXPECT_EQ(second.error_code(), grpc::StatusCode::NOT_FOUND) << second.error_message();
  EXPECT_THAT(second.error_message(), HasSubstr("after 32 elements were written"));
  std::vector<float> fresh(64, NAN);
  ASSERT_TRUE(next_run->Read("w", StateToRead::kMaster, 0, 64, fresh.data()).ok());
  EXPECT_EQ(fresh[32], 0.0f) << "the dropped run's stream wrote the new run's master";
  EXPECT_EQ(next_run->Describe().value()[0].uninitialized_tensors, 1u);
  // A chunk naming another life than the one the stream's first chunk found.
  v1::InitChunk other_life = chunk("", 32);
  other_life.set_incarnation(12345);
  const grpc::Status switched = StreamOf(server_->address(), "/shardopt.v1.Optimizer/Init",
                                         {chunk("init-life", 0).SerializeAsString(), other_life.SerializeAsString()});
  EXPECT_EQ(switched.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << switched.error_message();
  EXPECT_THAT(switched.error_message(), HasSubstr("an Init stream is of one life of job 'init-life'"));
}

// A stream message that does not parse is INVALID_ARGUMENT, never the
// stream's quiet end: an Init cut by one is not answered OK with part of the
// values, a Push with one is refused and counts for nothing, and so is a
// Read whose request does not parse.
TEST_F(ServiceTest, AnUnparseableStreamMessageIsInvalidArgumentAndChangesNothing) {
  const JobOptions job = MakeJob("garbled", 1, {{"w", 4096}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f", 6);  // field 1, a length past the message's end
  auto init = RandomFloats(rng_, 4096, -1, 1);
  const auto stream_of = [&](const std::string& method, const std::vector<std::string>& messages) {
    return StreamOf(server_->address(), method, messages);
  };

  const std::string half = InitOfW("garbled", 0, absl::MakeConstSpan(init).first(2048)).SerializeAsString();
  const grpc::Status cut = stream_of("/shardopt.v1.Optimizer/Init", {half, garbage});
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(cut.error_message(), HasSubstr("InitChunk message does not parse"));
  EXPECT_THAT(cut.error_message(), HasSubstr("after 2048 elements"));
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());

  const auto before = ReadAll(*client, job);
  auto bad = RandomBf16(rng_, 4096, 1.0f);
  v1::GradChunk whole;
  whole.set_job("garbled");
  whole.set_step(1);
  whole.set_tensor("w");
  whole.set_dtype(v1::BF16);
  whole.set_data(bad.data(), 4096 * 2);
  const grpc::Status refused = stream_of("/shardopt.v1.Optimizer/Push", {whole.SerializeAsString(), garbage});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("GradChunk message does not parse"));
  EXPECT_EQ(ReadAll(*client, job), before);

  // Read's request too (gRPC's typed path answered UNIMPLEMENTED).
  const grpc::Status unread = stream_of("/shardopt.v1.Optimizer/Read", {garbage});
  EXPECT_EQ(unread.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << unread.error_message();
  EXPECT_THAT(unread.error_message(), HasSubstr("ReadRequest message does not parse"));

  // The refused push's gradient counts for nothing.
  ExpectTheNextStepIsItsPushAlone(*client, init, rng_);
}

// A Read or Commit whose caller cancels it before its request has come
// (ReadMany cancels its other lanes when one fails) reaches the handler with
// no request at all: that is CANCELLED, not a request that "does not
// parse", which counted as bad input against the caller (a strike toward
// its tarpit) and logged a malformed client that was not there.
TEST(ServiceCancelTest, AStreamCancelledBeforeItsRequestCameIsCancelledNotBadInput) {
  const int metrics = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--metrics_port=", metrics)});
  ASSERT_NE(server, nullptr);
  grpc::GenericStub generic(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  for (const std::string method : {"Read", "Commit"}) {
    for (int i = 0; i < 20; ++i) {
      grpc::ClientContext ctx;
      grpc::CompletionQueue cq;
      auto call = generic.PrepareCall(&ctx, "/shardopt.v1.Optimizer/" + method, &cq);
      void* tag;
      bool ok;
      call->StartCall(reinterpret_cast<void*>(1));  // headers out, no request
      ASSERT_TRUE(cq.Next(&tag, &ok));
      ctx.TryCancel();
      grpc::Status status;
      call->Finish(&status, reinterpret_cast<void*>(2));
      ASSERT_TRUE(cq.Next(&tag, &ok));
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
      cq.Shutdown();
      while (cq.Next(&tag, &ok)) {
      }
    }
  }
  // The server's handlers end after the client has its answer.
  const auto counted = [&](const std::string& method, const std::string& code) {
    const double n = testing::MetricValue(
        metrics, absl::StrCat("shardopt_refusals_total{method=\"", method, "\",code=\"", code, "\"}"));
    return std::max(0.0, n);  // an unlisted series: none counted
  };
  for (int i = 0; i < 100 && (counted("Read", "CANCELLED") < 20 || counted("Commit", "CANCELLED") < 20); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (const std::string method : {"Read", "Commit"}) {
    EXPECT_EQ(counted(method, "CANCELLED"), 20) << method;
    EXPECT_EQ(counted(method, "INVALID_ARGUMENT"), 0) << method << ": taken for a request that does not parse";
  }
}

// A unary request gRPC cannot parse (here a job name that is not UTF-8,
// which proto3 refuses in a string field) is INVALID_ARGUMENT saying so, not
// the INTERNAL with no message that gRPC's own parse answers.
TEST_F(ServiceTest, AnUnparseableUnaryRequestIsInvalidArgument) {
  const JobOptions job = MakeJob("unicode", 1, {{"w", 64}});
  auto client = Connect(server_->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  const auto init = RandomFloats(rng_, 64, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  // Field 1 (job), 2 bytes that are not UTF-8: every one of these requests
  // has its job name there.
  const std::string not_utf8("\x0a\x02\xff\xfe", 4);
  for (const char* method : {"CreateJob", "Describe", "DropJob", "Checkpoint"}) {
    SCOPED_TRACE(method);
    auto [status, answer] = GenericUnary(server_->address(), absl::StrCat("/shardopt.v1.Optimizer/", method), not_utf8);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat(method, "Request message does not parse")));
  }
  // Nothing changed: the job is there, the same life (a job dropped and
  // made again would be NOT_FOUND to this client, or hold no values).
  std::vector<float> master(64, NAN);
  ASSERT_TRUE(client->Read("w", StateToRead::kMaster, 0, 64, master.data()).ok());
  EXPECT_EQ(master, init);
}

TEST_F(ServiceTest, HealthIsServedAndReflectionOnlyWhenAsked) {
  // grpc.health.v1.HealthCheckResponse{status: SERVING} is the bytes 08 01.
  auto [health_status, health] = GenericUnary(server_->address(), "/grpc.health.v1.Health/Check", "");
  ASSERT_TRUE(health_status.ok()) << health_status.error_message();
  EXPECT_EQ(health, std::string("\x08\x01", 2));

  // Reflection lists the services to anyone who asks: served only with
  // --reflection. It is a bidi stream: ask it to list the services.
  auto list_services = [](const std::string& address) {
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    grpc::GenericStub generic(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    // The generic stub streams only through a completion queue in 1.51.
    grpc::CompletionQueue cq;
    auto rs = generic.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
    void* tag;
    bool ok = false;
    std::string listed;
    rs->StartCall(reinterpret_cast<void*>(1));
    if (cq.Next(&tag, &ok) && ok) {
      grpc::Slice req(std::string("\x3a\x00", 2));  // list_services: ""
      grpc::ByteBuffer send(&req, 1), recv;
      rs->Write(send, reinterpret_cast<void*>(2));
      if (cq.Next(&tag, &ok) && ok) {
        rs->Read(&recv, reinterpret_cast<void*>(3));
        std::vector<grpc::Slice> slices;
        if (cq.Next(&tag, &ok) && ok && recv.Dump(&slices).ok()) {
          for (auto& s : slices) listed.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
    }
    ctx.TryCancel();
    grpc::Status status;
    rs->Finish(&status, reinterpret_cast<void*>(4));
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(4)) {
    }
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return listed;
  };
  EXPECT_EQ(list_services(server_->address()), "") << "reflection served without --reflection";
  auto reflecting = ServerProcess::Start({"--reflection"});
  ASSERT_NE(reflecting, nullptr);
  EXPECT_THAT(list_services(reflecting->address()), HasSubstr("shardopt.v1.Optimizer"));
}

// --health_port: a plaintext port with the health service alone, for probes
// that cannot speak TLS (Kubernetes' gRPC probes); the optimizer's service
// is not on it. Both ports answer a check alike: SERVING for the server
// ("") and for shardopt.v1.Optimizer, NOT_FOUND for another name (the
// health port said SERVING to any name, the main port NOT_FOUND to the
// optimizer's own).
TEST_F(ServiceTest, TheHealthPortServesHealthAloneAndAnswersAsTheMainPort) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--health_port=", port)});
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  const std::string optimizer = "shardopt.v1.Optimizer";
  for (const std::string& at : {address, server->address()}) {
    SCOPED_TRACE(at);
    // HealthCheckRequest{service}: field 1, length-delimited.
    for (const std::string& request : {std::string(), "\x0a" + std::string(1, char(optimizer.size())) + optimizer}) {
      auto [health_status, health] = GenericUnary(at, "/grpc.health.v1.Health/Check", request);
      ASSERT_TRUE(health_status.ok()) << health_status.error_message();
      EXPECT_EQ(health, std::string("\x08\x01", 2));
    }
    auto [unknown, unused] = GenericUnary(at, "/grpc.health.v1.Health/Check", "\x0a\x03" "foo");
    EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
  }
  auto [describe_status, unused] = GenericUnary(address, "/shardopt.v1.Optimizer/Describe", "");
  EXPECT_EQ(describe_status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << describe_status.error_message();
}

// A client of `server`, one attempt per call, attached to a new job of one
// tensor "w" (rank 0).
std::unique_ptr<Client> AttachOneTensorJob(const ServerProcess& server, const std::string& name, uint64_t numel,
                                           uint32_t world_size = 1) {
  ClientOptions o;
  o.servers = {server.address()};
  o.max_attempts = 1;
  auto client = Client::Connect(o).value();
  JobOptions job;
  job.name = name;
  job.world_size = world_size;
  job.groups = {GroupOptions{}};
  job.tensors = {{"w", numel, 0}};
  EXPECT_TRUE(client->CreateOrAttach(job).ok());
  return client;
}

// While a SIGTERM's drain writes the checkpoints, the health service says
// NOT_SERVING, so that probes and load balancers stop sending; before, it
// said SERVING until the process was gone.
TEST_F(ServiceTest, TheHealthServiceSaysNotServingWhileTheDrainWrites) {
  char tmpl[] = "/tmp/shardopt-drain-health-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--health_port=", port), "--checkpoint_dir=" + dir});
  ASSERT_NE(server, nullptr);
  constexpr uint64_t kN = uint64_t{32} << 20;  // 384 MiB of state: a drain of a few tenths of a second
  auto client = AttachOneTensorJob(*server, "drain", kN);
  std::mt19937_64 rng(5);
  const std::vector<float> values = testing::RandomFloats(rng, kN, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", values.data()).ok());
  const std::string address = absl::StrCat("127.0.0.1:", port);
  ASSERT_EQ(GenericUnary(address, "/grpc.health.v1.Health/Check", "").second, std::string("\x08\x01", 2));
  kill(server->pid(), SIGTERM);
  bool not_serving = false;
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
       !not_serving && std::chrono::steady_clock::now() < give_up;) {
    auto [status, health] = GenericUnary(address, "/grpc.health.v1.Health/Check", "");
    if (status.ok() && health == std::string("\x08\x02", 2)) not_serving = true;
    if (!status.ok()) break;  // the server has shut down
  }
  EXPECT_TRUE(not_serving) << "health never said NOT_SERVING before the server exited";
  EXPECT_EQ(server->Stop(SIGTERM) >> 8, 0);
  std::filesystem::remove_all(dir);
}

// A SIGTERM with a trainer connected and idle (attached, no call running),
// and a probe's connection to --health_port open, exits at once. gRPC's
// shutdown waited, up to the server's 5 s grace, for such a connection to
// close, which the client reads only at its channel's next backup poll: set
// here to a minute, so that the wait would be the whole 5 s (by default it
// was up to 5 s, whenever the poll came). Under ctest each test is a
// process of its own, whose first channel reads the variable.
TEST(ServerStopTest, IdleConnectionsDoNotHoldTheShutdown) {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "60000", 1);
  const int health_port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--health_port=", health_port)});
  ASSERT_NE(server, nullptr);
  auto client = AttachOneTensorJob(*server, "idle", 1024);
  auto probe = grpc::CreateChannel(absl::StrCat("127.0.0.1:", health_port), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(probe->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  const auto sent = std::chrono::steady_clock::now();
  EXPECT_EQ(server->Stop(SIGTERM) >> 8, 0);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - sent;
  EXPECT_LT(took.count(), 2.0);
  unsetenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS");
}

// A call in progress at SIGTERM is not cut short for being slow: a push
// waiting at the barrier for another rank holds the exit until the 5 s
// grace is over, as before the stop stopped waiting for idle connections.
// The health port closes with the main port meanwhile, not after the grace
// (an outside probe got NOT_SERVING from it for those 5 s).
TEST(ServerStopTest, ACallInProgressHasTheWholeGrace) {
  const int health_port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--health_port=", health_port)});
  ASSERT_NE(server, nullptr);
  auto client = AttachOneTensorJob(*server, "waits", 1024, /*world_size=*/2);
  std::vector<uint16_t> w(1024, 0x3f80), g(1024, 0x3c00);
  ASSERT_TRUE(client->InitBf16("w", w.data()).ok());
  absl::Status stepped;
  std::thread rank0([&] { stepped = client->Step({{"w", g.data()}}, {}, {{"w", w.data()}}).status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // its push waits for rank 1
  const auto sent = std::chrono::steady_clock::now();
  kill(server->pid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto [health, answer] =
      GenericUnary(absl::StrCat("127.0.0.1:", health_port), "/grpc.health.v1.Health/Check", "");
  EXPECT_EQ(health.error_code(), grpc::StatusCode::UNAVAILABLE) << health.error_message();
  EXPECT_EQ(server->Stop(SIGTERM) >> 8, 0);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - sent;
  rank0.join();
  EXPECT_GE(took.count(), 4.5);
  EXPECT_FALSE(stepped.ok());
}

}  // namespace
}  // namespace shardopt
