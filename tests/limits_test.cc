// One client cannot take a server down: real server processes with small
// limits, each attack of the security review against them, and each time the
// server still up and another job still stepping.
//   - the memory budget: a job too big for it, and jobs until it is full;
//   - stream caps, per client and per server;
//   - an Init stream that sends nothing, and a Push still open at its
//     barrier deadline, both cut.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/gpu.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tests/testing/blackhole_proxy.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/raw_commit.h"
#include "tests/testing/reference.h"
#include "tests/testing/generic_unary.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ServerProcess;
using testing::ConnectOnce;
using testing::OneTensorJob;

// The server's shardopt_open_streams, from GET /metrics on 127.0.0.1:port.
int OpenStreams(int port) { return static_cast<int>(testing::MetricValue(port, "shardopt_open_streams")); }

// Waits (10 s at most) until the server has `n` streams open.
bool AwaitOpenStreams(int metrics_port, int n) {
  int seen = -1;
  for (int i = 0; i < 200; ++i) {
    seen = OpenStreams(metrics_port);
    if (seen == n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "the server has " << seen << " streams open after 10 s, not " << n;
  return false;
}

// A job of its own that steps: made at once, then one step per call.
class Victim {
 public:
  Victim(const std::string& address, const std::string& name, const std::string& token = "")
      : client_(ConnectOnce(address, token)), job_(OneTensorJob(name, 4096)) {
    EXPECT_TRUE(client_->CreateOrAttach(job_).ok());
    auto init = RandomFloats(rng_, 4096, -1, 1);
    EXPECT_TRUE(client_->InitFp32("w", init.data()).ok());
  }
  absl::Status Step() {
    auto g = RandomBf16(rng_, 4096, 1.0f);
    std::vector<uint16_t> params(4096);
    StepOptions options;
    options.lr = 1e-3;
    auto r = client_->Step({{"w", g.data()}}, options, {{"w", params.data()}});
    return r.status();
  }

 private:
  std::mt19937_64 rng_{std::random_device{}()};
  std::unique_ptr<Client> client_;
  JobOptions job_;
};

// Case 3 of the review: the memory check was per job, against physical
// memory. A tensor of 1.2e9 elements passed it and the server was killed
// zeroing it; 95 jobs of 256 MiB filled the machine. Now one budget for the
// server is charged before anything is built.
TEST(LimitsTest, TheMemoryBudgetRefusesWhatDoesNotFitAndTheServerStaysUp) {
  constexpr uint64_t kLimit = uint64_t{384} << 20;
  auto server = ServerProcess::Start({absl::StrCat("--memory_limit=", kLimit)});
  ASSERT_NE(server, nullptr);
  Victim victim(server->address(), "victim");
  ASSERT_TRUE(victim.Step().ok());

  auto attacker = ConnectOnce(server->address());
  auto huge = attacker->CreateOrAttach(OneTensorJob("huge", uint64_t{1200} * 1000 * 1000));
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("needs"));
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("--memory_limit"));
  // 4M fp32 params: 72 MiB each, until the budget is full.
  int made = 0;
  for (; made < 20; ++made) {
    auto c = ConnectOnce(server->address());
    auto r = c->CreateOrAttach(OneTensorJob(absl::StrCat("fill", made), 4 << 20));
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      break;
    }
    std::vector<float> init(4 << 20, 0.5f);  // touched, so the pages are real
    ASSERT_TRUE(c->InitFp32("w", init.data()).ok());
    ASSERT_TRUE(victim.Step().ok());
  }
  EXPECT_GE(made, 2);
  EXPECT_LT(made, 6);
  ASSERT_TRUE(victim.Step().ok());
  auto described = attacker->CreateOrAttach(OneTensorJob("fill0", 4 << 20));
  ASSERT_TRUE(described.ok());
  auto state = attacker->Describe();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)[0].memory_limit_bytes, kLimit);
  EXPECT_LE((*state)[0].memory_used_bytes, kLimit);
  // A job of one tensor keeps a few KiB besides its state and staging.
  EXPECT_GT((*state)[0].bookkeeping_bytes, 4096u);
  EXPECT_LT((*state)[0].bookkeeping_bytes, 65536u);
  const uint64_t peak = testing::PeakRssBytes(server->pid());
  std::printf("server peak RSS %.0f MiB against a budget of %.0f MiB (%d jobs of 72 MiB)\n", peak / 1048576.0,
              kLimit / 1048576.0, made);
  // What the budget does not charge (binary, threads, gRPC) is the headroom's.
  EXPECT_LT(peak, kLimit + (uint64_t{96} << 20));
  // A drop gives its charge back.
  ASSERT_TRUE(attacker->Drop().ok());
  EXPECT_TRUE(ConnectOnce(server->address())->CreateOrAttach(OneTensorJob("after-drop", 4 << 20)).ok());
  ASSERT_TRUE(victim.Step().ok());
}

// A job that leaves the budget only its reserve (it takes about all that
// jobs may take of 160 MiB) still steps with many ranks of 4 MiB chunks, its
// rank 0 last. Three ways an outside probe's pushes were refused
// RESOURCE_EXHAUSTED there:
// - a chunk copied into the window stayed charged to the budget until the
//   stream's next read, which waits for the window: 23 ranks of 3.2 MB were
//   charged 74 MB beside their copies (3 runs of 4);
// - a stream's first read was counted at the 256 KiB a client chooses for
//   48 ranks, and 48 reads of 3.2 MB came against the window's 64 MiB;
// - after tensors of 1000, 300000 and 70000 elements, reads were counted at
//   the last chunk's 140 KB while 4 MiB ones came (0 steps in 3).
// Now the charge goes once the chunk is copied, and reads are counted at
// the most the push's first message said or its stream sent.
struct LargeChunks {
  uint32_t world;
  std::vector<uint64_t> sizes;  // the job's tensors, in push order
};
class LargeChunksTest : public ::testing::TestWithParam<LargeChunks> {};

TEST_P(LargeChunksTest, ALowestRankLateBehindManyFindsTheBudgetRoomy) {
  const uint32_t kWorld = GetParam().world;
  auto server = ServerProcess::Start({"--memory_limit=160Mi"});
  ASSERT_NE(server, nullptr);
  JobOptions job = OneTensorJob("many", 1, kWorld);
  job.tensors.clear();
  for (uint64_t numel : GetParam().sizes) job.tensors.push_back({absl::StrCat("t", job.tensors.size()), numel, 0});
  job.barrier_timeout_ms = 30000;
  std::vector<std::unique_ptr<Client>> ranks;
  for (uint32_t r = 0; r < kWorld; ++r) {
    ClientOptions o;
    o.servers = {server->address()};
    o.rank = r;
    o.max_attempts = 1;
    o.rpc_timeout_ms = 60000;
    o.chunk_bytes = 4 << 20;
    ranks.push_back(Client::Connect(o).value());
    ASSERT_TRUE(ranks.back()->CreateOrAttach(job).ok());
  }
  auto described = ranks[0]->Describe();
  ASSERT_TRUE(described.ok());
  // What jobs may not take, 40 MiB of 160, is about all that is left.
  const uint64_t left = (*described)[0].memory_limit_bytes - (*described)[0].memory_used_bytes;
  ASSERT_LT(left, uint64_t{48} << 20);
  // A small tensor first: its 2000-byte chunk comes before 3.2 MB ones.
  std::mt19937_64 rng(11);
  const size_t tensors = job.tensors.size();
  std::vector<std::vector<float>> init(tensors);
  std::vector<std::vector<std::vector<uint16_t>>> grads(tensors);  // [tensor][rank]
  std::vector<std::vector<uint16_t>> params(tensors);              // rank 0's
  for (size_t t = 0; t < tensors; ++t) {
    const TensorOptions& tensor = job.tensors[t];
    init[t] = RandomFloats(rng, tensor.numel, -1, 1);
    ASSERT_TRUE(ranks[0]->InitFp32(tensor.name, init[t].data()).ok());
    for (uint32_t r = 0; r < kWorld; ++r) grads[t].push_back(RandomBf16(rng, tensor.numel, 1.0f));
    params[t].resize(tensor.numel);
  }
  std::vector<absl::StatusOr<StepResult>> results(kWorld, absl::UnknownError("not run"));
  const auto step = [&](uint32_t r) {
    std::vector<std::vector<uint16_t>> theirs(tensors);
    std::vector<GradView> g;
    std::vector<ParamView> p;
    for (size_t t = 0; t < tensors; ++t) {
      theirs[t].resize(job.tensors[t].numel);
      g.push_back({job.tensors[t].name, grads[t][r].data()});
      p.push_back({job.tensors[t].name, r == 0 ? params[t].data() : theirs[t].data()});
    }
    results[r] = ranks[r]->Step(g, StepOptions{}, p);
  };
  std::vector<std::thread> others;
  for (uint32_t r = 1; r < kWorld; ++r) others.emplace_back(step, r);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // every other rank's first chunks are in
  step(0);
  for (auto& t : others) t.join();
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
  // Bitwise the rank-order sum's step.
  for (size_t t = 0; t < tensors; ++t) {
    testing::ReferenceTensor ref(testing::kDefaultHyper, init[t], false);
    std::vector<const uint16_t*> rank_grads;
    for (const auto& g : grads[t]) rank_grads.push_back(g.data());
    ref.Step(rank_grads, StepOptions{}.lr, results[0]->decision.gscale);
    EXPECT_EQ(ref.Params(), params[t]) << job.tensors[t].name;
  }
}

// 3.2 MB of bf16 in each large tensor of the first two: one message each.
INSTANTIATE_TEST_SUITE_P(Ranks, LargeChunksTest,
                         ::testing::Values(LargeChunks{24, {1000, 1600000, 1600000}},
                                           LargeChunks{48, {1000, 1600000, 1600000}},
                                           LargeChunks{24, {1000, 300000, 70000, 2889639}}));

// Case 4: streams held open took every server thread. Now a client's
// streams are capped, and so are the server's; another client still steps.
TEST(LimitsTest, StreamCapsPerClientAndPerServer) {
  char tmpl[] = "/tmp/shardopt-limits-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string a = "attacker-token-0123456789", b = "victim-token-0123456789";
  std::ofstream(dir + "/tokens") << "attacker trainer " << a << " a/\nvictim trainer " << b << " v/\n";
  const int metrics = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({"--tokens_file=" + dir + "/tokens", "--max_streams=6",
                                      "--max_streams_per_client=3", absl::StrCat("--metrics_port=", metrics)});
  ASSERT_NE(server, nullptr);
  Victim victim(server->address(), "v/job", b);
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  auto attacker = ConnectOnce(server->address(), a);
  ASSERT_TRUE(attacker->CreateOrAttach(OneTensorJob("a/job", 64, 2)).ok());

  // The attacker's held-open pushes: three are taken, the fourth refused.
  struct Held {
    grpc::ClientContext ctx;
    v1::PushResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::GradChunk>> writer;
  };
  std::vector<std::unique_ptr<Held>> held;
  auto open = [&](const std::string& token) {
    auto h = std::make_unique<Held>();
    h->ctx.AddMetadata("authorization", "Bearer " + token);
    h->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    h->writer = stub->Push(&h->ctx, &h->resp);
    return h;
  };
  for (int i = 0; i < 3; ++i) held.push_back(open(a));
  ASSERT_TRUE(AwaitOpenStreams(metrics, 3));
  auto fourth = open(a);
  const grpc::Status refused = fourth->writer->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("--max_streams_per_client"));
  // The victim, another client, still steps (one push and one commit stream).
  EXPECT_TRUE(victim.Step().ok());
  // The server's cap: the victim holds three too, and then nobody gets one.
  ASSERT_TRUE(AwaitOpenStreams(metrics, 3));
  for (int i = 0; i < 3; ++i) held.push_back(open(b));
  ASSERT_TRUE(AwaitOpenStreams(metrics, 6));
  const absl::Status full = victim.Step();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(std::string(full.message()), HasSubstr("--max_streams"));
  // Streams that end give their slots back.
  for (auto& h : held) {
    h->ctx.TryCancel();
    h->writer->Finish().ok();  // CANCELLED
  }
  held.clear();
  ASSERT_TRUE(AwaitOpenStreams(metrics, 0));
  EXPECT_TRUE(victim.Step().ok());
  std::filesystem::remove_all(dir);
}

// A stream's slot goes back as the server answers, so a client that opens
// one stream at a time (a step's push, then its commit) never meets its own
// last one at a cap of 1. It did, in 2 commits of 10, while the slot went
// back only once gRPC was done with the call, after the answer.
TEST(LimitsTest, OneStreamAtATimeFitsACapOfOne) {
  constexpr uint64_t kN = uint64_t{2} << 20, kChunk = 32768;
  auto server = ServerProcess::Start({"--max_streams_per_client=1"});
  ASSERT_NE(server, nullptr);
  {
    auto client = ConnectOnce(server->address());
    ASSERT_TRUE(client->CreateOrAttach(OneTensorJob("one-at-a-time", kN)).ok());
    std::mt19937_64 rng(std::random_device{}());
    const auto init = RandomFloats(rng, kN, -1, 1);
    ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  }
  // The calls as a bare gRPC client makes them, each call's next at once.
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  const std::vector<uint16_t> g(kChunk, 0x3f00);  // 0.5
  for (uint64_t t = 1; t <= 40; ++t) {
    {
      grpc::ClientContext ctx;
      v1::PushResponse answer;
      auto writer = stub->Push(&ctx, &answer);
      v1::GradChunk chunk;
      chunk.set_job("one-at-a-time");
      chunk.set_step(t);
      writer->Write(chunk);
      for (uint64_t offset = 0; offset < kN; offset += kChunk) {
        chunk.Clear();
        chunk.set_tensor("w");
        chunk.set_offset(offset);
        chunk.set_dtype(v1::BF16);
        chunk.set_data(g.data(), kChunk * 2);
        writer->Write(chunk);
      }
      writer->WritesDone();
      const grpc::Status pushed = writer->Finish();
      ASSERT_TRUE(pushed.ok()) << "push " << t << ": " << pushed.error_message();
    }
    v1::CommitRequest request;
    request.set_job("one-at-a-time");
    request.set_step(t);
    request.set_lr(1e-3);
    request.set_gscale(1);
    const grpc::Status committed = testing::CommitAndDrain(*stub, request);
    ASSERT_TRUE(committed.ok()) << "commit " << t << ": " << committed.error_message();
  }
}

// ReadMany reads a server's ranges on up to 4 streams at once, and a
// server counts them all against its caps (a token's ranks, or an
// address's, share --max_streams_per_client). Here another stream of the
// same address holds the cap full while the read starts: its lanes are
// refused, and the read is made again one stream at a time, with the
// call's backoff until a slot is free, whole and bitwise. Before, the
// refusal (RESOURCE_EXHAUSTED) failed the read.
TEST(LimitsTest, AReadOfManyTensorsOverAServersStreamCapIsMadeOneStreamAtATime) {
  constexpr uint64_t kTensors = 64, kN = 4096;
  const int metrics = testing::FreeLoopbackPort();
  auto server =
      ServerProcess::Start({"--max_streams_per_client=1", absl::StrCat("--metrics_port=", metrics)});
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.servers = {server->address()};
  options.max_attempts = 8;  // backoffs of 50 ms to 2 s: past the held stream's 0.5 s
  auto client = Client::Connect(options).value();
  JobOptions job = OneTensorJob("lanes", kN);
  job.tensors.clear();
  for (uint64_t t = 0; t < kTensors; ++t) job.tensors.push_back({absl::StrCat("t", t), kN, 0});
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  std::mt19937_64 rng(std::random_device{}());
  const auto init = RandomFloats(rng, kTensors * kN, -1, 1);
  std::vector<TensorValues> values(kTensors);
  for (uint64_t t = 0; t < kTensors; ++t) {
    values[t].tensor = job.tensors[t].name;
    values[t].fp32 = init.data() + t * kN;
  }
  ASSERT_TRUE(client->InitMany(values).ok());

  // A push stream of the same address holds the cap, for half a second.
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext held;
  v1::PushResponse answer;
  auto writer = stub->Push(&held, &answer);
  ASSERT_TRUE(AwaitOpenStreams(metrics, 1));
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    held.TryCancel();
  });
  std::vector<float> read(kTensors * kN, NAN);
  std::vector<StateRead> reads;
  for (uint64_t t = 0; t < kTensors; ++t) {
    reads.push_back({job.tensors[t].name, StateToRead::kMaster, 0, kN, read.data() + t * kN});
  }
  const absl::Status st = client->ReadMany(reads);
  release.join();
  writer->Finish().ok();  // CANCELLED
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(std::memcmp(read.data(), init.data(), init.size() * 4), 0);
  // The series is listed, at 0, from the server's start: its value says.
  EXPECT_GT(testing::MetricValue(metrics, "shardopt_refusals_total{method=\"Read\",code=\"RESOURCE_EXHAUSTED\"}"), 0)
      << "the held stream refused none of the read's";
}

// A compressed message is refused before it is inflated: gRPC 1.51 inflated
// it whole before checking --max_message_bytes, so a 64 KiB gzip of a
// 64 MiB request, from a caller without a token, made the server hold the
// 64 MiB (256 MiB held from 256 KiB sent, in a black-box probe).
TEST(LimitsTest, ACompressedMessageIsRefusedUninflated) {
  const int health_port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({"--max_message_bytes=1048576", absl::StrCat("--health_port=", health_port)});
  ASSERT_NE(server, nullptr);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(1 << 30);
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args));
  v1::DescribeRequest bomb;
  bomb.set_job(std::string(uint64_t{64} << 20, 'a'));
  const uint64_t before = testing::PeakRssBytes(server->pid());
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    ctx.set_compression_algorithm(GRPC_COMPRESS_GZIP);
    v1::DescribeResponse response;
    const grpc::Status refused = stub->Describe(&ctx, bomb, &response);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("'gzip' is disabled"));
  }
  // The plaintext health port too, which answers anyone: a health check
  // naming a 64 MiB service, gzipped.
  std::string check = "\x0a";  // HealthCheckRequest.service, then its length as a varint
  for (uint64_t n = bomb.job().size(); ; n >>= 7) {
    check.push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
    if (n < 0x80) break;
  }
  check += bomb.job();
  const grpc::Status refused =
      testing::GenericUnary(absl::StrCat("127.0.0.1:", health_port), "/grpc.health.v1.Health/Check", check,
                            GRPC_COMPRESS_GZIP)
          .first;
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << refused.error_message();
  const uint64_t after = testing::PeakRssBytes(server->pid());
  EXPECT_LT(after, before + (uint64_t{16} << 20)) << "peak RSS " << before << " B, then " << after << " B";
  grpc::ClientContext ctx;
  v1::DescribeRequest plain;
  plain.set_job("nobody");
  v1::DescribeResponse response;
  EXPECT_EQ(stub->Describe(&ctx, plain, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A client whose machine died, or whose path went away without a reset,
// left its connection open on the server for good: with nothing to send,
// the server's TCP never learns. The server pings every connection each
// --keepalive_seconds, an idle one too, and closes one whose ping goes 10 s
// unanswered, but not one whose client answers (an idle gRPC client answers
// at its backup poll, every 5 s); with 0 it pings none, and a dead
// connection stays open.
TEST(LimitsTest, AServerClosesAConnectionThatStoppedAnsweringItsPings) {
  struct Server {
    std::unique_ptr<ServerProcess> process;
    std::unique_ptr<testing::BlackholeProxy> proxy;
    std::unique_ptr<v1::Optimizer::Stub> stub;
    grpc::Status List() const {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::ListJobsResponse listed;
      return stub->ListJobs(&ctx, v1::ListJobsRequest(), &listed);
    }
  };
  Server pinging, silent;  // --keepalive_seconds=1 and 0
  for (Server* server : {&pinging, &silent}) {
    server->process = ServerProcess::Start({server == &pinging ? "--keepalive_seconds=1" : "--keepalive_seconds=0"});
    ASSERT_NE(server->process, nullptr);
    server->proxy = std::make_unique<testing::BlackholeProxy>(server->process->port());
    server->stub = v1::Optimizer::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->proxy->port()),
                                                              grpc::InsecureChannelCredentials()));
    ASSERT_TRUE(server->List().ok());  // open, and idle from here on
  }
  std::this_thread::sleep_for(std::chrono::seconds(7));  // pinged each second, answered at backup polls
  EXPECT_EQ(pinging.proxy->UpstreamsClosed(), 0);
  EXPECT_TRUE(pinging.List().ok());
  EXPECT_EQ(pinging.proxy->Connections(), 1);
  for (Server* server : {&pinging, &silent}) server->proxy->BlackholeOpenConnections();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (pinging.proxy->UpstreamsClosed() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(pinging.proxy->UpstreamsClosed(), 1) << "the dead connection was not closed within 20 s";
  EXPECT_EQ(silent.proxy->UpstreamsClosed(), 0);
}

// An Init stream that sends nothing is cut at the idle timeout, saying how
// much it wrote; the job then takes the rest from another stream.
TEST(LimitsTest, AnIdleInitStreamIsCut) {
  auto server = ServerProcess::Start({"--idle_stream_timeout_ms=400"});
  ASSERT_NE(server, nullptr);
  auto client = ConnectOnce(server->address());
  ASSERT_TRUE(client->CreateOrAttach(OneTensorJob("idle-init", 64)).ok());
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::InitResponse resp;
  auto writer = stub->Init(&ctx, &resp);
  v1::InitChunk chunk;
  chunk.set_job("idle-init");
  chunk.set_tensor("w");
  chunk.set_dtype(v1::FP32);
  chunk.set_kind(v1::MASTER);
  std::mt19937_64 rng(1);
  const std::vector<float> init = RandomFloats(rng, 64, -1, 1);
  chunk.set_data(init.data(), 32 * 4);
  ASSERT_TRUE(writer->Write(chunk));
  const auto started = std::chrono::steady_clock::now();
  const grpc::Status st = writer->Finish();  // without WritesDone: the server waits, then cuts it
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("32 elements were written"));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  EXPECT_TRUE(Victim(server->address(), "after-idle").Step().ok());
}

// A Read or Commit whose caller stops reading is cut once a write has waited
// the idle timeout: it held its stream slot (and, with a cap of one, every
// stream of the client) until the caller's own deadline, if it had one (a
// probe from the proto: six such commits refused every later stream).
// 32 MiB of bf16 params, 64 MiB of fp32 master: a commit of them, or a read,
// is past any window a caller that reads nothing lets through.
constexpr uint64_t kPastAnyWindow = uint64_t{16} << 20;

// Makes job `name` of one tensor "w" of kPastAnyWindow elements from random
// initial values, and pushes its step 1.
void MakeAndPushStepOne(Client* client, const std::string& name, uint64_t seed) {
  ASSERT_TRUE(client->CreateOrAttach(OneTensorJob(name, kPastAnyWindow)).ok());
  std::mt19937_64 rng(seed);
  const auto init = RandomFloats(rng, kPastAnyWindow, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
  const auto grad = RandomBf16(rng, kPastAnyWindow, 1.0f);
  const auto pushed = client->Push(1, {{"w", grad.data()}});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
}

TEST(LimitsTest, AReadOrCommitWhoseCallerStopsReadingIsCut) {
  auto server = ServerProcess::Start({"--idle_stream_timeout_ms=2000", "--max_streams_per_client=1"});
  ASSERT_NE(server, nullptr);
  auto client = ConnectOnce(server->address());
  ASSERT_NO_FATAL_FAILURE(MakeAndPushStepOne(client.get(), "unread", 5));
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  const auto unread = [&](const char* what, auto open) {
    SCOPED_TRACE(what);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = open(&ctx);
    const auto started = std::chrono::steady_clock::now();
    // Nothing read: the server's writes fill the window and wait, and the
    // stream holds the client's one slot. Another stream of this client gets
    // through once the server has cut this one.
    std::vector<float> some(16);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const absl::Status held = client->Read("w", StateToRead::kMaster, 0, 16, some.data());
    ASSERT_EQ(held.code(), absl::StatusCode::kResourceExhausted) << "the stream did not hold its slot: " << held;
    absl::Status other;
    do {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      other = client->Read("w", StateToRead::kMaster, 0, 16, some.data());
    } while (!other.ok() && std::chrono::steady_clock::now() - started < std::chrono::seconds(20));
    EXPECT_TRUE(other.ok()) << other;
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
    ctx.TryCancel();
    reader->Finish().IgnoreError();
  };
  unread("read", [&](grpc::ClientContext* ctx) {
    v1::ReadRequest request;
    request.set_job("unread");
    request.set_tensor("w");
    request.set_kind(v1::MASTER);
    return stub->Read(ctx, request);
  });
  unread("commit", [&](grpc::ClientContext* ctx) {
    v1::CommitRequest request;
    request.set_job("unread");
    request.set_step(1);
    request.set_lr(1e-3);
    request.set_gscale(1.0f);
    return stub->Commit(ctx, request);
  });
  // The cut commit applied its whole step on the server, once: a retry
  // with the same arguments is answered from it.
  const auto described = client->Describe();
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ((*described)[0].step, 1u);
  std::vector<uint16_t> params(kPastAnyWindow);
  ASSERT_TRUE(client->Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}}).ok());
  EXPECT_EQ(client->Describe().value()[0].step, 1u);
}

// A Checkpoint behind a step whose committer stopped reading waits only as
// long as its caller, and says why it gave up: the answer goes out a little
// before the caller's deadline (a tenth of the time, at most 1 s), where it
// went out at the deadline and lost to the caller's own bare "Deadline
// Exceeded" (an outside probe).
TEST(LimitsTest, ACheckpointBehindAStalledApplyNamesTheStepBeforeItsCallerGivesUp) {
  const std::string dir = ::testing::TempDir() + "/stalled-apply-checkpoints";
  std::filesystem::remove_all(dir);
  auto server = ServerProcess::Start({"--checkpoint_dir=" + dir});
  ASSERT_NE(server, nullptr);
  auto client = ConnectOnce(server->address());
  ASSERT_NO_FATAL_FAILURE(MakeAndPushStepOne(client.get(), "stalled", 6));
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext commit_ctx;
  v1::CommitRequest commit;
  commit.set_job("stalled");
  commit.set_step(1);
  commit.set_lr(1e-3);
  commit.set_gscale(1.0f);
  auto unread = stub->Commit(&commit_ctx, commit);  // nothing read: the apply stops at the window
  v1::CheckpointRequest request;
  request.set_job("stalled");
  request.set_step(1);
  grpc::Status late;
  // Until the commit has begun to apply: before, the job is at step 0.
  for (int i = 0; i < 50; ++i) {
    grpc::ClientContext ctx;
    // 10 s: the answer goes out 1 s before, time enough on a loaded machine.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::CheckpointResponse response;
    late = stub->Checkpoint(&ctx, request, &response);
    if (late.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << late.error_message();
  EXPECT_THAT(late.error_message(), HasSubstr("still applying step 1")) << "the caller's own deadline came first";
  commit_ctx.TryCancel();
  unread->Finish().IgnoreError();
  std::filesystem::remove_all(dir);
}

// A push still sending when its round's barrier deadline passes is cut with
// the round, not left to its idle timeout (two minutes by default; 20 s
// here): the server holds nothing of a round that is over. Rank 1 sends
// half its gradient and nothing more; with `another_rank_waits`, rank 0
// pushes its whole gradient and waits at the barrier, and its wait may be
// what ends the round. Returns the half push's answer.
grpc::Status PartialPushAtTheDeadline(const std::string& name, bool another_rank_waits) {
  auto server = ServerProcess::Start({"--idle_stream_timeout_ms=20000"});
  if (server == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "no server");
  JobOptions job = OneTensorJob(name, 4096, 2);
  job.barrier_timeout_ms = 600;
  auto client = ConnectOnce(server->address());
  EXPECT_TRUE(client->CreateOrAttach(job).ok());
  std::mt19937_64 rng(2);
  const std::vector<float> init = RandomFloats(rng, 4096, -1, 1);
  EXPECT_TRUE(client->InitFp32("w", init.data()).ok());
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  const std::vector<uint16_t> g = RandomBf16(rng, 4096, 1.0f);
  auto chunk = [&](uint32_t rank, uint64_t elements) {
    v1::GradChunk c;
    c.set_job(name);
    c.set_step(1);
    c.set_rank(rank);
    c.set_tensor("w");
    c.set_dtype(v1::BF16);
    c.set_data(g.data(), elements * 2);
    return c;
  };
  grpc::ClientContext partial_ctx, whole_ctx;
  partial_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  whole_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::PushResponse partial_resp, whole_resp;
  const auto started = std::chrono::steady_clock::now();
  auto partial = stub->Push(&partial_ctx, &partial_resp);
  EXPECT_TRUE(partial->Write(chunk(1, 2048)));  // the stream stays open
  if (another_rank_waits) {
    auto whole = stub->Push(&whole_ctx, &whole_resp);
    EXPECT_TRUE(whole->Write(chunk(0, 4096)));
    EXPECT_TRUE(whole->WritesDone());
    const grpc::Status waited = whole->Finish();  // at the barrier until the deadline ends the round
    EXPECT_EQ(waited.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << waited.error_message();
  }
  const grpc::Status cut = partial->Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << cut.error_message();
  EXPECT_THAT(cut.error_message(), Not(HasSubstr("sent nothing")));
  EXPECT_TRUE(Victim(server->address(), "after-" + name).Step().ok());
  return cut;
}

TEST(LimitsTest, TheBarrierDeadlineCutsTheRoundsOpenStreams) {
  EXPECT_THAT(PartialPushAtTheDeadline("deadline", false).error_message(), HasSubstr("barrier deadline"));
}

// Before 2026-12-07, once another rank's wait had ended the round, the
// stream had no cut-off (its round was no longer its job's) and was
// answered at its idle timeout, as if idle (an outside probe: at 5 s, the
// round gone at 1 s).
TEST(LimitsTest, TheBarrierDeadlineCutsAnOpenStreamWhenAnotherRanksWaitEndsTheRound) {
  // The round's own answer.
  EXPECT_THAT(PartialPushAtTheDeadline("ended-by-another", true).error_message(), HasSubstr("ranks {1} of 2"));
}

// Case 5: Describe of a job of many tensors was one answer that could pass
// the message limit. It pages: at most 4096 tensors an answer, and the
// client reads every page.
TEST(LimitsTest, DescribePagesAndTheClientReadsEveryPage) {
  auto server = ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  JobOptions job = OneTensorJob("wide", 1);
  job.tensors.clear();
  for (int i = 0; i < 5000; ++i) job.tensors.push_back({absl::StrCat("t", i), 1, 0});
  auto client = ConnectOnce(server->address());
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  auto steps = client->AdamSteps();  // through Describe, every page
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_EQ(steps->size(), 5000u);

  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  auto page = [&](uint32_t offset, uint32_t max, v1::DescribeResponse* resp) {
    grpc::ClientContext ctx;
    v1::DescribeRequest req;
    req.set_job("wide");
    req.set_tensor_offset(offset);
    req.set_max_tensors(max);
    return stub->Describe(&ctx, req, resp);
  };
  v1::DescribeResponse first, rest, small, past;
  ASSERT_TRUE(page(0, 0, &first).ok());
  EXPECT_EQ(first.tensors_size(), 4096);
  EXPECT_EQ(first.tensor_count(), 5000u);
  ASSERT_TRUE(page(4096, 0, &rest).ok());
  EXPECT_EQ(rest.tensors_size(), 904);
  EXPECT_EQ(rest.tensor_offset(), 4096u);
  EXPECT_EQ(rest.tensors(0).name(), "t4096");
  ASSERT_TRUE(page(10, 3, &small).ok());
  ASSERT_EQ(small.tensors_size(), 3);
  EXPECT_EQ(small.tensors(0).name(), "t10");
  EXPECT_EQ(page(6000, 0, &past).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(Victim(server->address(), "beside-wide").Step().ok());
}

// At the smallest --max_message_bytes, a job of long names that a CreateJob
// without shards (each tensor whole) fits in: an answer names each tensor
// twice, so a page of 4096 tensors would not fit, and Describe answered
// RESOURCE_EXHAUSTED for any page. Pages now end at the limit, and reading
// on from each page's end gives every tensor.
TEST(LimitsTest, DescribePagesEndAtTheMessageLimit) {
  auto server = ServerProcess::Start({"--max_message_bytes=131072"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  v1::CreateJobRequest create;
  create.set_job("long-names");
  create.set_world_size(1);
  v1::Group* group = create.add_groups();
  group->set_beta1(0.9f);
  group->set_beta2(0.999f);
  group->set_eps(1e-8f);
  for (int i = 0; i < 580; ++i) {
    v1::TensorSpec* t = create.add_tensors();
    t->set_name(absl::StrCat(std::string(190, 'n'), i));
    t->set_numel(1);
  }
  ASSERT_LT(create.ByteSizeLong(), 131072u);
  {
    grpc::ClientContext ctx;
    v1::CreateJobResponse created;
    const grpc::Status st = stub->CreateJob(&ctx, create, &created);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  uint32_t read = 0, pages = 0;
  while (read < 580) {
    grpc::ClientContext ctx;
    v1::DescribeRequest req;
    req.set_job("long-names");
    req.set_tensor_offset(read);
    v1::DescribeResponse page;
    const grpc::Status st = stub->Describe(&ctx, req, &page);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_GT(page.tensors_size(), 0);
    EXPECT_LE(page.ByteSizeLong(), 131072u);
    EXPECT_EQ(page.tensors(0).name(), create.tensors(static_cast<int>(read)).name());
    read += page.tensors_size();
    ++pages;
  }
  EXPECT_EQ(read, 580u);
  EXPECT_GT(pages, 1u);
}

// Case 1: a push that names more no_grad tensors than a stream may is refused
// before its message is parsed (counted by skipping over the fields), so a
// flood of names costs the server little; the job still steps.
TEST(LimitsTest, APushNamingTooManyNoGradTensorsIsRefusedBeforeItIsParsed) {
  auto server = ServerProcess::Start({"--max_tensors_per_job=100"});
  ASSERT_NE(server, nullptr);
  Victim victim(server->address(), "nograd-flood");
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  for (int names : {101, 60000}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::PushResponse resp;
    auto writer = stub->Push(&ctx, &resp);
    v1::GradChunk chunk;
    chunk.set_job("nograd-flood");
    chunk.set_step(1);
    for (int i = 0; i < names; ++i) chunk.add_no_grad(std::string(100, 'x'));
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    // 60000 names are past the fields a message may have: the scan stops
    // there, and says the message names more than it counted.
    EXPECT_THAT(st.error_message(), HasSubstr(names == 101 ? "names 101 no_grad tensors" : "names more than "));
    EXPECT_THAT(st.error_message(), HasSubstr("no_grad tensors; this stream may name 100 more at most"));
  }
  EXPECT_TRUE(victim.Step().ok());
}

// The tarpit: a client refused for bad input more than 20 times in a second
// has its next streams' first read held back for a second, so a flood waits
// on flow control instead of being read and refused; another client is not
// slowed, and the first client is out again after a second.
TEST(LimitsTest, AClientThatKeepsSendingBadInputIsHeldBack) {
  char tmpl[] = "/tmp/shardopt-tarpit-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string bad = "flooding-token-0123456789", good = "victim-token-0123456789";
  std::ofstream(dir + "/tokens") << "flood trainer " << bad << " *\nvictim trainer " << good << " *\n";
  auto server = ServerProcess::Start({"--tokens_file=" + dir + "/tokens"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  // One Init stream of one unknown job, timed from its start to its answer.
  auto refused_init = [&](const std::string& token) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::InitResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    auto writer = stub->Init(&ctx, &resp);
    v1::InitChunk chunk;
    chunk.set_job("no-such-job");
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    return std::chrono::steady_clock::now() - t0;
  };
  // Quick refusals until the tarpit: the first past 20 in a second waits.
  // (On a loaded machine the count may start over before 20; keep going.)
  int held_at = 0;
  for (int i = 1; i <= 300 && held_at == 0; ++i) {
    if (refused_init(bad) > std::chrono::milliseconds(800)) held_at = i;
  }
  EXPECT_GE(held_at, 21);                                         // never before 20 strikes
  EXPECT_LT(refused_init(good), std::chrono::milliseconds(500));  // another client is not held
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_LT(refused_init(bad), std::chrono::milliseconds(500));   // out again
  EXPECT_TRUE(Victim(server->address(), "beside-the-flood", good).Step().ok());
  std::filesystem::remove_all(dir);
}

// The GPU image passes --auto_requires_gpu: there --device=auto without a
// usable GPU stops the server (exit 1) rather than run it on the host's
// cores; an explicit --device=cpu still runs.
TEST(LimitsTest, AutoRequiresGpuFailsLoudlyWithoutOne) {
  if (UsableGpuCount() > 0) {  // a GPU machine: auto takes it
    EXPECT_NE(ServerProcess::Start({"--device=auto", "--auto_requires_gpu"}), nullptr);
    return;
  }
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--device=auto", "--auto_requires_gpu"}, &log), 1);
  EXPECT_THAT(log, HasSubstr("found no usable GPU"));
  EXPECT_THAT(log, HasSubstr("pass --device=cpu"));
  EXPECT_NE(ServerProcess::Start({"--device=cpu", "--auto_requires_gpu"}), nullptr);
}

// A --flagfile with Windows line ends gave every value a trailing carriage
// return, and the refusal showed none: "--device must be auto, cpu, cuda or
// cuda:N; got 'cpu'". It is now named (exit 2).
TEST(LimitsTest, AFlagfileWithWindowsLineEndsIsNamed) {
  const std::string path = (std::filesystem::temp_directory_path() / ("shardopt-crlf-" + std::to_string(getpid()))).string();
  std::ofstream(path) << "--device=cpu\r\n--max_streams=7\r\n";
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--flagfile=" + path}, &log), 2);
  EXPECT_THAT(log, HasSubstr("value holds a carriage return"));
  EXPECT_THAT(log, HasSubstr("Windows line ends (CRLF)"));
  std::remove(path.c_str());
}

// So is a line with a trailing blank, which the value kept: an outside
// probe's server made and used a checkpoint directory "ck " beside "ck",
// and one with "--host=127.0.0.1 " failed its start saying only "cannot
// listen on 127.0.0.1 :0".
TEST(LimitsTest, AFlagfileLineWithATrailingBlankIsNamed) {
  const std::string base = (std::filesystem::temp_directory_path() / ("shardopt-blank-" + std::to_string(getpid()))).string();
  std::ofstream(base + ".flags") << "--device=cpu\n--checkpoint_dir=" << base << "-ck \n";
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--flagfile=" + base + ".flags"}, &log), 2);
  EXPECT_THAT(log, HasSubstr("--checkpoint_dir's value '" + base + "-ck ' ends with a blank"));
  EXPECT_FALSE(std::filesystem::exists(base + "-ck "));
  std::ofstream(base + ".flags") << "--host=\t127.0.0.1\n";
  EXPECT_EQ(testing::ServerExitCode({"--flagfile=" + base + ".flags"}, &log), 2);
  EXPECT_THAT(log, HasSubstr("--host's value '\t127.0.0.1' begins with a blank"));
  std::remove((base + ".flags").c_str());
}

// A --port_file that cannot be written stops the server (exit 1, naming
// it): a harness waiting for the file would otherwise wait for good. It
// does so before the log says "started", which it used to say first.
TEST(LimitsTest, APortFileThatCannotBeWrittenStopsTheServer) {
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--port_file=/nonexistent-shardopt-dir/port"}, &log), 1);
  EXPECT_THAT(log, HasSubstr("cannot write --port_file=/nonexistent-shardopt-dir/port"));
  EXPECT_THAT(log, Not(HasSubstr(" started ")));
  // A directory in its place: refused before "started" too, no .tmp left.
  char tmpl[] = "/tmp/shardopt-port-dir-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  EXPECT_EQ(testing::ServerExitCode({"--port_file=" + dir}, &log), 1);
  EXPECT_THAT(log, Not(HasSubstr(" started ")));
  EXPECT_FALSE(std::filesystem::exists(dir + ".tmp"));
  std::filesystem::remove_all(dir);
}

// A --checkpoint_dir the server cannot write stops it at the start (exit
// 1, naming it), not at the drain, where every job would lose its state.
TEST(LimitsTest, ACheckpointDirThatCannotBeWrittenStopsTheServer) {
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--checkpoint_dir=/proc/shardopt-cannot-be-here"}, &log), 1);
  EXPECT_THAT(log, HasSubstr("--checkpoint_dir=/proc/shardopt-cannot-be-here is not a writable directory: "));
  // With the system's reason, which decides the fix (a full disk was said
  // to be "not a writable directory" alone: an outside probe).
  EXPECT_THAT(log, HasSubstr("No such file or directory"));
  // One that could not be made says so, with why (it said the probe's
  // "No such file or directory" for a directory on a read-only volume).
  char tmpl[] = "/tmp/shardopt-file-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_EQ(testing::ServerExitCode({absl::StrCat("--checkpoint_dir=", tmpl, "/checkpoints")}, &log), 1);
  EXPECT_THAT(log, HasSubstr("is not a writable directory: cannot create it: Not a directory"));
  std::filesystem::remove(tmpl);
}

// Flags out of range are usage errors (exit 2, naming the flag), not a port
// that glibc truncates (70000 listened on 4464), "none" for a negative one,
// or an abort in std::thread.
TEST(LimitsTest, FlagsOutOfRangeAreUsageErrors) {
  for (const std::string flag : {"--metrics_port=70000", "--metrics_port=-1", "--health_port=65536",
                                 "--threads=100000000", "--threads=-1", "--device=tpu", "--device=cuda:x",
                                 "--device=cuda:-1", "--device=cuda:", "--device=cuda:+1", "--device=cuda: 1",
                                 "--keepalive_seconds=86401"}) {
    std::string log;
    EXPECT_EQ(testing::ServerExitCode({flag}, &log), 2) << flag;
    EXPECT_THAT(log, HasSubstr(flag.substr(0, flag.find('=')))) << flag;
  }
  // An empty --host says so: it was refused as plaintext off loopback
  // (also exit 2, naming --host), or with --insecure failed at the bind.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--host="}, std::vector<std::string>{"--host=", "--insecure"}}) {
    std::string log;
    EXPECT_EQ(testing::ServerExitCode(args, &log), 2) << args.size();
    EXPECT_THAT(log, HasSubstr("--host is empty")) << args.size();
  }
}

}  // namespace
}  // namespace shardopt
