// Bearer tokens against a real server process: every RPC against every kind
// of caller (none, an unknown token, a trainer of other jobs, the job's
// trainer, an admin), each refusal checked to change nothing; the tokens
// file's checks; and a reload on SIGHUP.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tests/testing/generic_unary.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ServerProcess;

constexpr char kAlice[] = "alice-token-0123456789abcdef";  // trainer of team-a/
constexpr char kBob[] = "bob-token-0123456789abcdef";      // trainer of team-b/
constexpr char kRoot[] = "root-token-0123456789abcdef";    // admin
constexpr uint64_t kNumel = 64;

std::string TokensFile(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/tokens";
  std::ofstream(path + ".tmp") << text;
  std::filesystem::rename(path + ".tmp", path);
  return path;
}

std::string StandardTokens() {
  return absl::StrCat("# name role token prefixes\n", "alice trainer ", kAlice, " team-a/\n", "bob trainer ", kBob,
                      " team-b/ shared/\n", "root admin ", kRoot, "\n");
}

// One valid call of each RPC on job `job`, with these 'authorization'
// entries (none, one, or more).
class Caller {
 public:
  Caller(std::shared_ptr<grpc::Channel> channel, std::vector<std::string> headers)
      : stub_(v1::Optimizer::NewStub(std::move(channel))), headers_(std::move(headers)) {}

  grpc::Status CreateJob(const std::string& job, v1::CreateJobResponse* out = nullptr) {
    auto ctx = Context();
    v1::CreateJobRequest req;
    req.set_job(job);
    req.set_world_size(1);
    v1::Group* g = req.add_groups();
    g->set_beta1(0.9);
    g->set_beta2(0.999);
    g->set_eps(1e-8f);
    v1::TensorSpec* t = req.add_tensors();
    t->set_name("w");
    t->set_numel(kNumel);
    v1::CreateJobResponse resp;
    return stub_->CreateJob(ctx.get(), req, out != nullptr ? out : &resp);
  }
  grpc::Status Init(const std::string& job, const std::vector<float>& values, v1::StateKind kind = v1::MASTER) {
    auto ctx = Context();
    v1::InitResponse resp;
    auto writer = stub_->Init(ctx.get(), &resp);
    v1::InitChunk chunk;
    chunk.set_job(job);
    chunk.set_tensor("w");
    chunk.set_dtype(v1::FP32);
    chunk.set_kind(kind);
    chunk.set_data(values.data(), values.size() * 4);
    writer->Write(chunk);
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Push(const std::string& job, uint64_t step, const std::vector<uint16_t>& grad) {
    auto ctx = Context();
    v1::PushResponse resp;
    auto writer = stub_->Push(ctx.get(), &resp);
    v1::GradChunk chunk;
    chunk.set_job(job);
    chunk.set_step(step);
    chunk.set_tensor("w");
    chunk.set_dtype(v1::BF16);
    chunk.set_data(grad.data(), grad.size() * 2);
    writer->Write(chunk);
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Commit(const std::string& job, uint64_t step) {
    auto ctx = Context();
    v1::CommitRequest req;
    req.set_job(job);
    req.set_step(step);
    req.set_lr(1e-2);
    req.set_gscale(1.0f);
    auto reader = stub_->Commit(ctx.get(), req);
    v1::ParamChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  }
  grpc::Status Describe(const std::string& job, v1::DescribeResponse* resp = nullptr) {
    auto ctx = Context();
    v1::DescribeRequest req;
    req.set_job(job);
    v1::DescribeResponse ignored;
    return stub_->Describe(ctx.get(), req, resp ? resp : &ignored);
  }
  grpc::Status Read(const std::string& job, std::vector<float>* master = nullptr) {
    auto ctx = Context();
    v1::ReadRequest req;
    req.set_job(job);
    req.set_tensor("w");
    req.set_kind(v1::MASTER);
    auto reader = stub_->Read(ctx.get(), req);
    v1::StateChunk chunk;
    std::string bytes;
    while (reader->Read(&chunk)) bytes += chunk.data();
    if (master != nullptr) {
      master->resize(bytes.size() / 4);
      std::memcpy(master->data(), bytes.data(), bytes.size());
    }
    return reader->Finish();
  }
  grpc::Status Checkpoint(const std::string& job, uint64_t step) {
    auto ctx = Context();
    v1::CheckpointRequest req;
    req.set_job(job);
    req.set_step(step);
    v1::CheckpointResponse resp;
    return stub_->Checkpoint(ctx.get(), req, &resp);
  }
  // Every page of ListJobs, the jobs' names in the order given.
  grpc::Status List(std::vector<std::string>* names, uint32_t max_jobs = 0) {
    names->clear();
    v1::ListJobsRequest req;
    req.set_max_jobs(max_jobs);
    for (int pages = 0; pages < 100; ++pages) {
      auto ctx = Context();
      v1::ListJobsResponse resp;
      if (grpc::Status st = stub_->ListJobs(ctx.get(), req, &resp); !st.ok()) return st;
      for (const v1::JobSummary& job : resp.jobs()) names->push_back(job.job());
      if (!resp.more() || resp.jobs_size() == 0) break;
      req.set_after(names->back());
    }
    return grpc::Status::OK;
  }
  grpc::Status Drop(const std::string& job, uint64_t incarnation = 0, bool undo = false) {
    auto ctx = Context();
    v1::DropJobRequest req;
    req.set_job(job);
    req.set_incarnation(incarnation);
    req.set_undo(undo);
    v1::DropJobResponse resp;
    return stub_->DropJob(ctx.get(), req, &resp);
  }

 private:
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    for (const std::string& header : headers_) ctx->AddMetadata("authorization", header);
    return ctx;
  }

  std::unique_ptr<v1::Optimizer::Stub> stub_;
  const std::vector<std::string> headers_;
};

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shardopt-auth-XXXXXX";
    dir_ = mkdtemp(tmpl);
    tokens_ = TokensFile(dir_, StandardTokens());
    metrics_port_ = testing::FreeLoopbackPort();
    server_ = ServerProcess::Start({"--tokens_file=" + tokens_, "--checkpoint_dir=" + dir_ + "/ckpt",
                                    absl::StrCat("--metrics_port=", metrics_port_)});
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  Caller As(const std::string& header) { return Caller(channel_, {header}); }
  Caller As(std::vector<std::string> headers) { return Caller(channel_, std::move(headers)); }
  static std::string Bearer(const char* token) { return absl::StrCat("Bearer ", token); }
  // After the tokens file changed: waits (up to 5 s) until `gone` is refused
  // and `added` is taken for `job`, and expects both.
  void ExpectTokensSwapped(const char* gone, const char* added, const std::string& job) {
    grpc::Status before, after;
    for (int i = 0; i < 50; ++i) {
      before = As(Bearer(gone)).Describe(job);
      after = As(Bearer(added)).Describe(job);
      if (before.error_code() == grpc::StatusCode::UNAUTHENTICATED && after.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_EQ(before.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_TRUE(after.ok()) << after.error_message();
  }

  std::mt19937_64 rng_{std::random_device{}()};
  std::string dir_, tokens_;
  int metrics_port_ = 0;
  std::unique_ptr<ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

// Every RPC x {no token, a token the server does not know, a malformed
// header, a trainer of other jobs, the job's trainer, an admin}. A refused
// call is UNAUTHENTICATED or PERMISSION_DENIED and leaves the job as it was:
// same step, same master bits.
TEST_F(AuthTest, EveryRpcAgainstEveryKindOfCaller) {
  Caller admin = As(Bearer(kRoot));
  const std::string job = "team-a/matrix";
  ASSERT_TRUE(admin.CreateJob(job).ok());
  const std::vector<float> init = RandomFloats(rng_, kNumel, -1, 1);
  ASSERT_TRUE(admin.Init(job, init).ok());

  struct Refused {
    std::string name;
    std::vector<std::string> headers;
    grpc::StatusCode code;
  };
  const std::vector<Refused> refused = {
      {"no token", {}, grpc::StatusCode::UNAUTHENTICATED},
      {"unknown token", {Bearer("not-a-token-the-server-knows")}, grpc::StatusCode::UNAUTHENTICATED},
      {"a prefix of a real token", {Bearer(std::string(kAlice, 20).c_str())}, grpc::StatusCode::UNAUTHENTICATED},
      {"no Bearer scheme", {kAlice}, grpc::StatusCode::UNAUTHENTICATED},
      {"trainer of other jobs", {Bearer(kBob)}, grpc::StatusCode::PERMISSION_DENIED},
      // A proxy that adds an entry would otherwise choose who the caller is
      // (the first entry was taken).
      {"two entries, the job's trainer's first", {Bearer(kAlice), Bearer(kBob)}, grpc::StatusCode::UNAUTHENTICATED},
      {"two entries, the job's trainer's second", {Bearer(kBob), Bearer(kAlice)}, grpc::StatusCode::UNAUTHENTICATED},
  };
  const std::vector<float> other = RandomFloats(rng_, kNumel, -1, 1);
  const std::vector<uint16_t> grad = RandomBf16(rng_, kNumel, 1.0f);
  for (const Refused& r : refused) {
    SCOPED_TRACE(r.name);
    Caller c = As(r.headers);
    const std::vector<std::pair<const char*, std::function<grpc::Status()>>> calls = {
        {"CreateJob", [&] { return c.CreateJob(job); }},
        {"CreateJob of a new job", [&] { return c.CreateJob("team-a/new-" + r.name); }},
        {"Init", [&] { return c.Init(job, other); }},
        {"Push", [&] { return c.Push(job, 1, grad); }},
        {"Commit", [&] { return c.Commit(job, 1); }},
        {"Describe", [&] { return c.Describe(job); }},
        {"Read", [&] { return c.Read(job); }},
        {"Checkpoint", [&] { return c.Checkpoint(job, 0); }},
        {"DropJob", [&] { return c.Drop(job); }},
    };
    for (const auto& [rpc, call] : calls) {
      const grpc::Status st = call();
      EXPECT_EQ(st.error_code(), r.code) << rpc << ": " << st.error_message();
    }
    // Nothing changed: no job was made, and the job is at step 0 with its bits.
    v1::DescribeResponse d;
    ASSERT_TRUE(admin.Describe(job, &d).ok());
    EXPECT_EQ(d.step(), 0u);
    EXPECT_EQ(admin.Describe("team-a/new-" + r.name).error_code(), grpc::StatusCode::NOT_FOUND);
    std::vector<float> master;
    ASSERT_TRUE(admin.Read(job, &master).ok());
    ASSERT_EQ(master.size(), init.size());
    EXPECT_EQ(std::memcmp(master.data(), init.data(), init.size() * 4), 0);
  }

  // The job's trainer: every RPC but DropJob.
  Caller alice = As(Bearer(kAlice));
  EXPECT_TRUE(alice.CreateJob(job).ok());  // attaches
  EXPECT_TRUE(alice.Init(job, other).ok());
  EXPECT_TRUE(alice.Push(job, 1, grad).ok());
  EXPECT_TRUE(alice.Commit(job, 1).ok());
  EXPECT_TRUE(alice.Describe(job).ok());
  EXPECT_TRUE(alice.Read(job).ok());
  EXPECT_TRUE(alice.Checkpoint(job, 1).ok());
  const grpc::Status drop = alice.Drop(job);
  EXPECT_EQ(drop.error_code(), grpc::StatusCode::PERMISSION_DENIED) << drop.error_message();
  EXPECT_THAT(drop.error_message(), HasSubstr("admin"));
  EXPECT_TRUE(alice.CreateJob("team-a/second").ok());  // a new job under its prefix
  const grpc::Status outside = alice.CreateJob("team-b/mine");
  EXPECT_EQ(outside.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(outside.error_message(), HasSubstr("alice"));
  EXPECT_THAT(outside.error_message(), ::testing::Not(HasSubstr(kAlice)));  // the token is never echoed
  // A long name outside the prefixes is refused as such, echoed cut short:
  // whole, it would overflow gRPC's metadata and arrive as another code.
  const grpc::Status long_name = alice.CreateJob("team-b/" + std::string(20000, 'x'));
  EXPECT_EQ(long_name.error_code(), grpc::StatusCode::PERMISSION_DENIED) << long_name.error_message().size();
  EXPECT_LT(long_name.error_message().size(), 300u);

  // The admin: everything, on any job.
  EXPECT_TRUE(admin.Push(job, 2, grad).ok());
  EXPECT_TRUE(admin.Commit(job, 2).ok());
  EXPECT_TRUE(admin.Read(job).ok());
  EXPECT_TRUE(admin.Checkpoint(job, 2).ok());
  EXPECT_TRUE(admin.CreateJob("anything/at-all").ok());
  EXPECT_TRUE(admin.Drop(job).ok());
  EXPECT_EQ(admin.Describe(job).error_code(), grpc::StatusCode::NOT_FOUND);
}

// The caller is known before anything of its request counts: a unary
// request that gRPC cannot parse (a job name that is not UTF-8) was
// INVALID_ARGUMENT whoever sent it, where a stream's was UNAUTHENTICATED
// (a probe); now it is UNAUTHENTICATED without a token the server knows.
// And a request that names no job is INVALID_ARGUMENT for a trainer as for
// an admin, as the docs say, where a trainer's was PERMISSION_DENIED.
TEST_F(AuthTest, AnUnparseableRequestIsTheCallersOnceKnownAndNoJobIsInvalidForEveryone) {
  const std::string not_utf8("\x0a\x05\xff\xfe\xfd\xfc\xfb", 7);  // field 1, job, of each request below
  const struct {
    const char* name;
    std::vector<std::string> authorization;
    grpc::StatusCode code;
  } callers[] = {
      {"no token", {}, grpc::StatusCode::UNAUTHENTICATED},
      {"unknown token", {Bearer("not-a-token-the-server-knows")}, grpc::StatusCode::UNAUTHENTICATED},
      {"two entries", {Bearer(kAlice), Bearer(kRoot)}, grpc::StatusCode::UNAUTHENTICATED},
      {"trainer", {Bearer(kAlice)}, grpc::StatusCode::INVALID_ARGUMENT},
      {"admin", {Bearer(kRoot)}, grpc::StatusCode::INVALID_ARGUMENT},
  };
  for (const auto& c : callers) {
    for (const char* method : {"CreateJob", "Describe", "Checkpoint", "DropJob"}) {
      const grpc::Status st = testing::GenericUnary(server_->address(), absl::StrCat("/shardopt.v1.Optimizer/", method),
                                                    not_utf8, GRPC_COMPRESS_NONE, c.authorization)
                                  .first;
      EXPECT_EQ(st.error_code(), c.code) << c.name << " " << method << ": " << st.error_message();
      if (c.code == grpc::StatusCode::INVALID_ARGUMENT) {
        EXPECT_THAT(st.error_message(), HasSubstr("does not parse")) << c.name << " " << method;
      }
    }
  }
  for (const char* token : {kAlice, kRoot}) {
    SCOPED_TRACE(token);
    Caller caller = As(Bearer(token));
    const std::vector<std::pair<const char*, std::function<grpc::Status()>>> calls = {
        {"CreateJob", [&] { return caller.CreateJob(""); }},
        {"Init", [&] { return caller.Init("", RandomFloats(rng_, kNumel, -1, 1)); }},
        {"Push", [&] { return caller.Push("", 1, RandomBf16(rng_, kNumel, 1.0f)); }},
        {"Commit", [&] { return caller.Commit("", 1); }},
        {"Describe", [&] { return caller.Describe(""); }},
        {"Read", [&] { return caller.Read(""); }},
        {"Checkpoint", [&] { return caller.Checkpoint("", 0); }},
        {"DropJob", [&] { return caller.Drop("", 1); }},
        {"DropJob undo", [&] { return caller.Drop("", 1, /*undo=*/true); }},
    };
    for (const auto& [rpc, call] : calls) {
      const grpc::Status st = call();
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << rpc << ": " << st.error_message();
    }
  }
  std::vector<std::string> names;
  ASSERT_TRUE(As(Bearer(kRoot)).List(&names).ok());
  EXPECT_THAT(names, ::testing::IsEmpty());
}

// A list shows each caller the jobs its token may describe, and nothing of
// the others; a caller the server does not know gets no list at all.
TEST_F(AuthTest, AListShowsEachTokenOnlyTheJobsOfItsPrefixes) {
  Caller admin = As(Bearer(kRoot));
  for (const char* job : {"team-b/z", "team-a/y", "shared/w", "other", "team-a/x"}) {
    ASSERT_TRUE(admin.CreateJob(job).ok()) << job;
  }
  std::vector<std::string> names;
  ASSERT_TRUE(admin.List(&names).ok());
  EXPECT_THAT(names, ::testing::ElementsAre("other", "shared/w", "team-a/x", "team-a/y", "team-b/z"));
  ASSERT_TRUE(admin.List(&names, /*max_jobs=*/2).ok());  // three pages
  EXPECT_THAT(names, ::testing::ElementsAre("other", "shared/w", "team-a/x", "team-a/y", "team-b/z"));
  ASSERT_TRUE(As(Bearer(kAlice)).List(&names).ok());
  EXPECT_THAT(names, ::testing::ElementsAre("team-a/x", "team-a/y"));
  ASSERT_TRUE(As(Bearer(kBob)).List(&names, 1).ok());
  EXPECT_THAT(names, ::testing::ElementsAre("shared/w", "team-b/z"));
  for (const std::vector<std::string>& headers :
       {std::vector<std::string>{}, {Bearer("not-a-token-the-server-knows")}, {Bearer(kAlice), Bearer(kBob)}}) {
    EXPECT_EQ(As(headers).List(&names).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_TRUE(names.empty());
  }
  ASSERT_TRUE(admin.Drop("team-a/x").ok());
  ASSERT_TRUE(As(Bearer(kAlice)).List(&names).ok());
  EXPECT_THAT(names, ::testing::ElementsAre("team-a/y"));

  // The CLI prints what the token sees, as JSON.
  const std::string token_file = dir_ + "/alice.token";
  std::ofstream(token_file) << kAlice << "\n";
  const std::string command = absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server_->address(),
                                           " --token_file=", token_file, " list 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  EXPECT_EQ(pclose(pipe), 0) << out;
  EXPECT_THAT(out, HasSubstr("\"job\": \"team-a/y\""));
  EXPECT_THAT(out, HasSubstr("\"worldSize\": 1"));
  EXPECT_THAT(out, HasSubstr("\"more\": false"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("team-b")));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("other")));
}

// A server with tokens charges each job to the token that made it: a token's
// max_memory caps its jobs there, and another token is not held back by it.
// A reload that adds the cap applies it to the jobs made from then on.
TEST_F(AuthTest, ATokensMaxMemoryCapsTheJobsItMakes) {
  Caller admin = As(Bearer(kRoot)), alice = As(Bearer(kAlice)), bob = As(Bearer(kBob));
  ASSERT_TRUE(alice.CreateJob("team-a/1").ok());
  v1::DescribeResponse d;
  ASSERT_TRUE(alice.Describe("team-a/1", &d).ok());
  EXPECT_EQ(d.owner(), "alice");
  const uint64_t job_bytes = d.state_bytes() + d.staging_bytes() + d.bookkeeping_bytes();
  TokensFile(dir_, absl::StrCat("alice trainer ", kAlice, " team-a/ max_memory=", job_bytes * 5 / 2, "\n",
                                "bob trainer ", kBob, " team-b/ shared/ max_memory=", job_bytes, "\n",
                                "root admin ", kRoot, "\n"));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  // Until the reload is in: alice's third job is refused.
  ASSERT_TRUE(alice.CreateJob("team-a/2").ok());
  grpc::Status third;
  for (int i = 0; i < 50; ++i) {
    third = alice.CreateJob("team-a/3");
    if (!third.ok()) break;
    ASSERT_TRUE(admin.Drop("team-a/3").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  EXPECT_THAT(third.error_message(), HasSubstr("'alice' may hold"));
  EXPECT_THAT(third.error_message(), HasSubstr("max_memory"));
  EXPECT_EQ(admin.Describe("team-a/3").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(alice.CreateJob("team-a/1").ok());  // attaching costs nothing
  EXPECT_TRUE(bob.CreateJob("team-b/1").ok());
  EXPECT_EQ(bob.CreateJob("shared/1").error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Whoever attaches, the job stays its maker's.
  ASSERT_TRUE(admin.CreateJob("team-b/1").ok());
  ASSERT_TRUE(admin.Describe("team-b/1", &d).ok());
  EXPECT_EQ(d.owner(), "bob");
  EXPECT_TRUE(admin.CreateJob("anything/1").ok());  // no cap
  // What each tenant's jobs hold, for an alert before its cap.
  const auto tenant_line = [](const char* tenant, uint64_t bytes) {
    return absl::StrCat("\nshardopt_tenant_job_bytes{tenant=\"", tenant, "\"} ", bytes, "\n");
  };
  std::string metrics = testing::GetMetrics(metrics_port_);
  EXPECT_THAT(metrics, HasSubstr(tenant_line("alice", 2 * job_bytes)));
  EXPECT_THAT(metrics, HasSubstr(tenant_line("bob", job_bytes)));
  EXPECT_THAT(metrics, HasSubstr(tenant_line("root", job_bytes)));
  // And each token's cap, for those that have one.
  const auto cap_line = [](const char* tenant, uint64_t bytes) {
    return absl::StrCat("\nshardopt_tenant_max_memory_bytes{tenant=\"", tenant, "\"} ", bytes, "\n");
  };
  EXPECT_THAT(metrics, HasSubstr(cap_line("alice", job_bytes * 5 / 2)));
  EXPECT_THAT(metrics, HasSubstr(cap_line("bob", job_bytes)));
  EXPECT_THAT(metrics, ::testing::Not(HasSubstr("shardopt_tenant_max_memory_bytes{tenant=\"root\"}")));
  // Each job's own series, whoever made it.
  const auto job_line = [](const char* family, uint64_t value) {
    return absl::StrCat("\n", family, "{job=\"team-b/1\"} ", value, "\n");
  };
  EXPECT_THAT(metrics, HasSubstr(job_line("shardopt_job_state_bytes", d.state_bytes())));
  EXPECT_THAT(metrics, HasSubstr(job_line("shardopt_job_staging_bytes", d.staging_bytes())));
  EXPECT_THAT(metrics, HasSubstr("\nshardopt_job_step{job=\"team-b/1\"} 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\nshardopt_jobs 4\n"));  // team-a/1, team-a/2, team-b/1, anything/1
  ASSERT_TRUE(admin.Drop("team-a/2").ok());
  EXPECT_THAT(testing::GetMetrics(metrics_port_), HasSubstr(tenant_line("alice", job_bytes)));
  EXPECT_TRUE(alice.CreateJob("team-a/3").ok());
}

// A trainer may undo a create of its own, as a client's re-attach does with
// a job it made afresh on a restarted server: the life it names of a job of
// its prefixes that holds nothing yet (DropJobRequest.undo, or, as clients
// before it sent it, a trainer's drop naming a life). Anything else stays
// an admin's, who may ask for the undo too, and is held to it.
TEST_F(AuthTest, ATrainerMayDropOnlyAnEmptyJobOfItsPrefixesNamingItsLife) {
  Caller alice = As(Bearer(kAlice)), bob = As(Bearer(kBob));
  v1::CreateJobResponse made;
  ASSERT_TRUE(alice.CreateJob("team-a/fresh", &made).ok());
  ASSERT_NE(made.incarnation(), 0u);
  EXPECT_EQ(alice.Drop("team-a/fresh").error_code(), grpc::StatusCode::PERMISSION_DENIED);  // no life named
  EXPECT_EQ(bob.Drop("team-a/fresh", made.incarnation()).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(alice.Drop("team-a/fresh", made.incarnation() ^ 1).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(alice.Describe("team-a/fresh").ok());
  EXPECT_TRUE(alice.Drop("team-a/fresh", made.incarnation()).ok());
  EXPECT_EQ(alice.Describe("team-a/fresh").error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(alice.CreateJob("team-a/full", &made).ok());
  const uint64_t made_full = made.incarnation();
  const std::vector<float> init = RandomFloats(rng_, kNumel, -1, 1);
  ASSERT_TRUE(alice.Init("team-a/full", init).ok());
  const grpc::Status refused = alice.Drop("team-a/full", made.incarnation());
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(refused.error_message(), HasSubstr("holds state"));
  std::vector<float> master;
  ASSERT_TRUE(alice.Read("team-a/full", &master).ok());
  EXPECT_EQ(master, init);
  // Moments alone (no Adam step given) are state too.
  ASSERT_TRUE(alice.CreateJob("team-a/moments", &made).ok());
  ASSERT_TRUE(alice.Init("team-a/moments", init, v1::EXP_AVG).ok());
  EXPECT_EQ(alice.Drop("team-a/moments", made.incarnation()).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(alice.Describe("team-a/moments").ok());

  // With `undo`: the same for a trainer, and none outside its prefixes.
  ASSERT_TRUE(alice.CreateJob("team-a/undone", &made).ok());
  EXPECT_EQ(bob.Drop("team-a/undone", made.incarnation(), /*undo=*/true).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(alice.Drop("team-a/undone", 0, /*undo=*/true).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(alice.Describe("team-a/undone").ok());
  EXPECT_TRUE(alice.Drop("team-a/undone", made.incarnation(), /*undo=*/true).ok());
  EXPECT_EQ(alice.Describe("team-a/undone").error_code(), grpc::StatusCode::NOT_FOUND);
  // An admin's undo of a job that holds state is refused, and drops nothing.
  Caller admin = As(Bearer(kRoot));
  EXPECT_EQ(admin.Drop("team-a/full", made_full, /*undo=*/true).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(alice.Read("team-a/full", &master).ok());
  EXPECT_EQ(master, init);
}

// SIGHUP reloads the tokens file: a removed token stops working and an added
// one starts, without a restart; a broken file keeps the old tokens.
TEST_F(AuthTest, SighupReloadsTheTokensFile) {
  ASSERT_TRUE(As(Bearer(kAlice)).CreateJob("team-a/reload").ok());
  constexpr char kCarol[] = "carol-token-0123456789abcdef";
  TokensFile(dir_, absl::StrCat("carol trainer ", kCarol, " team-a/\nroot admin ", kRoot, "\n"));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  // The reload happens on the server's main loop, within about a second.
  ExpectTokensSwapped(kAlice, kCarol, "team-a/reload");

  TokensFile(dir_, "carol trainer short team-a/\n");  // a token under 16 characters
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_TRUE(As(Bearer(kCarol)).Describe("team-a/reload").ok());
  EXPECT_TRUE(As(Bearer(kRoot)).Describe("team-a/reload").ok());
}

// A token removed while one of its streams is open stops that stream too:
// each message is checked with the tokens as they are then. An Init stream
// opened before alice's token went wrote every later chunk (one every 5 s
// for 45 s, a probe found), and so could a push stream.
TEST_F(AuthTest, ATokenRemovedStopsTheStreamsItHasOpen) {
  ASSERT_TRUE(As(Bearer(kAlice)).CreateJob("team-a/open").ok());
  auto stub = v1::Optimizer::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  ctx.AddMetadata("authorization", Bearer(kAlice));
  v1::InitResponse resp;
  auto writer = stub->Init(&ctx, &resp);
  const auto chunk = [](uint64_t offset, float value) {
    v1::InitChunk c;
    c.set_job("team-a/open");
    c.set_tensor("w");
    c.set_offset(offset);
    c.set_dtype(v1::FP32);
    const std::vector<float> values(kNumel / 2, value);
    c.set_data(values.data(), values.size() * 4);
    return c;
  };
  ASSERT_TRUE(writer->Write(chunk(0, 1.5f)));
  std::vector<float> master;
  for (int i = 0; i < 100 && (master.empty() || master[0] != 1.5f); ++i) {  // the first chunk is written
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(As(Bearer(kRoot)).Read("team-a/open", &master).ok());
  }
  ASSERT_EQ(master[0], 1.5f);
  constexpr char kCarol[] = "carol-token-0123456789abcdef";
  TokensFile(dir_, absl::StrCat("carol trainer ", kCarol, " team-a/\nroot admin ", kRoot, "\n"));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  ExpectTokensSwapped(kAlice, kCarol, "team-a/open");
  writer->Write(chunk(kNumel / 2, 2.5f));
  writer->WritesDone();
  const grpc::Status ended = writer->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAUTHENTICATED) << ended.error_message();
  ASSERT_TRUE(As(Bearer(kRoot)).Read("team-a/open", &master).ok());
  EXPECT_NE(master[kNumel / 2], 2.5f) << "a chunk was written after its token was removed";

  // A push stream of carol's, whose token goes before its second message:
  // refused, and the round its first message began ends with nothing applied.
  ASSERT_TRUE(As(Bearer(kCarol)).Init("team-a/open", std::vector<float>(kNumel, 0.5f)).ok());
  grpc::ClientContext push_ctx;
  push_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  push_ctx.AddMetadata("authorization", Bearer(kCarol));
  v1::PushResponse pushed;
  auto push = stub->Push(&push_ctx, &pushed);
  const std::vector<uint16_t> grad(kNumel / 2, 0x3f80);  // bf16 1.0
  v1::GradChunk g;
  g.set_job("team-a/open");
  g.set_step(1);
  g.set_tensor("w");
  g.set_dtype(v1::BF16);
  g.set_data(grad.data(), grad.size() * 2);
  ASSERT_TRUE(push->Write(g));
  TokensFile(dir_, absl::StrCat("alice trainer ", kAlice, " team-a/\nroot admin ", kRoot, "\n"));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  ExpectTokensSwapped(kCarol, kAlice, "team-a/open");
  g.clear_job();
  g.set_offset(kNumel / 2);
  push->Write(g);
  push->WritesDone();
  const grpc::Status push_ended = push->Finish();
  EXPECT_EQ(push_ended.error_code(), grpc::StatusCode::UNAUTHENTICATED) << push_ended.error_message();
  v1::DescribeResponse d;
  ASSERT_TRUE(As(Bearer(kRoot)).Describe("team-a/open", &d).ok());
  EXPECT_EQ(d.step(), 0u);
}

// A tokens file that changes is reloaded without a SIGHUP, as a mounted
// Kubernetes Secret changes (a new file behind the same path), within a few
// seconds.
TEST_F(AuthTest, AChangedTokensFileIsReloadedWithoutASignal) {
  ASSERT_TRUE(As(Bearer(kAlice)).CreateJob("team-a/watched").ok());
  constexpr char kDave[] = "dave-token-0123456789abcdef01";
  const std::string next = dir_ + "/tokens.next";
  std::ofstream(next) << "dave trainer " << kDave << " team-a/\nroot admin " << kRoot << "\n";
  ASSERT_EQ(std::rename(next.c_str(), (dir_ + "/tokens").c_str()), 0);
  ExpectTokensSwapped(kAlice, kDave, "team-a/watched");
}

// The server does not start on a tokens file it cannot use.
TEST_F(AuthTest, AnUnusableTokensFileStopsTheServer) {
  for (const std::string& text : {std::string("alice trainer short team-a/\n"),
                                  absl::StrCat("alice trainer ", kAlice, "\n"),  // a trainer of no job
                                  absl::StrCat("alice owner ", kAlice, " team-a/\n"),
                                  absl::StrCat("a trainer ", kAlice, " x/\nb trainer ", kAlice, " y/\n")}) {
    const std::string path = TokensFile(dir_, text);
    EXPECT_EQ(testing::ServerExitCode({"--tokens_file=" + path}), 1) << text;
  }
  EXPECT_EQ(testing::ServerExitCode({"--tokens_file=" + dir_ + "/missing"}), 1);
  // A directory (a Secret mounted where its file was meant) is named as
  // such, not as a file that "has no token".
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--tokens_file=" + dir_}, &log), 1);
  EXPECT_THAT(log, HasSubstr(dir_ + " is a directory, not a tokens file")) << log;
}

// The table alone: roles, prefixes, the '*' prefix, and what errors say.
TEST(TokenTableTest, RolesPrefixesAndErrors) {
  auto table = TokenTable::Parse(absl::StrCat("alice trainer ", kAlice, " team-a/ team-c/\n",
                                              "all trainer ", kBob, " *   # every job\n", "root admin ", kRoot, "\n"));
  ASSERT_TRUE(table.ok()) << table.status();
  auto alice = table->Authenticate(absl::StrCat("Bearer ", kAlice));
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->name, "alice");
  EXPECT_TRUE(alice->Allows(Action::kPush, "team-c/x").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(alice->Allows(Action::kPush, "team-b/x")));
  EXPECT_TRUE(absl::IsPermissionDenied(alice->Allows(Action::kDrop, "team-a/x")));
  // Each refused drop says why: the exception for a trainer's own empty job
  // is named, and a job of other prefixes is told as such (it read as the
  // admin-only rule too).
  EXPECT_THAT(std::string(alice->Allows(Action::kDrop, "team-a/x").message()),
              HasSubstr("but for a job of the trainer's prefixes that holds nothing yet"));
  EXPECT_THAT(std::string(alice->Allows(Action::kDrop, "team-b/x").message()),
              HasSubstr("outside the token's job prefixes"));
  auto all = table->Authenticate(absl::StrCat("Bearer ", kBob));
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->Allows(Action::kRead, "whatever").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(all->Allows(Action::kDrop, "whatever")));
  auto root = table->Authenticate(absl::StrCat("Bearer ", kRoot));
  ASSERT_TRUE(root.ok());
  EXPECT_TRUE(root->Allows(Action::kDrop, "team-b/x").ok());
  for (const std::string& bad : {std::string(""), std::string("Bearer "), absl::StrCat("Bearer ", kAlice, "x"),
                                 absl::StrCat("Bearer", kAlice), absl::StrCat("Bearer ", kAlice, " x"),
                                 std::string(kAlice)}) {
    EXPECT_TRUE(absl::IsUnauthenticated(table->Authenticate(bad).status())) << bad;
  }
  // The scheme in any case (RFC 7235), spaces around the token: no token
  // holds one (the file's columns are split on them).
  for (const std::string& good : {absl::StrCat("bearer ", kAlice), absl::StrCat("BEARER  ", kAlice, " ")}) {
    auto caller = table->Authenticate(good);
    ASSERT_TRUE(caller.ok()) << good << ": " << caller.status();
    EXPECT_EQ(caller->name, "alice");
  }
  auto short_token = TokenTable::Parse("alice trainer 0123456789 team-a/\n");
  EXPECT_TRUE(absl::IsInvalidArgument(short_token.status()));
  EXPECT_THAT(short_token.status().message(), HasSubstr("line 1"));
  EXPECT_THAT(short_token.status().message(), ::testing::Not(HasSubstr("0123456789")));
  // A byte no client can send in a header: the token would load and never
  // match, its holder locked out without a word.
  auto unsendable = TokenTable::Parse("alice trainer 0123\xc3\xa9" "456789abcdef team-a/\n");
  EXPECT_TRUE(absl::IsInvalidArgument(unsendable.status())) << unsendable.status();
  EXPECT_THAT(unsendable.status().message(), HasSubstr("not printable ASCII"));
  EXPECT_THAT(unsendable.status().message(), ::testing::Not(HasSubstr("0123")));
  // An admin may use every job: a prefix on its line is refused, not kept
  // as a scope that nothing enforces.
  auto scoped_admin = TokenTable::Parse(absl::StrCat("ops admin ", kAlice, " team-a/\n"));
  EXPECT_TRUE(absl::IsInvalidArgument(scoped_admin.status())) << scoped_admin.status();
  EXPECT_THAT(scoped_admin.status().message(), HasSubstr("an admin with job prefixes"));
  EXPECT_TRUE(TokenTable::Parse(absl::StrCat("ops admin ", kAlice, " *\n")).ok());  // what it has anyway
}

// A '#' begins a comment only where it begins the line or a field: one
// inside a prefix or a token is part of it. A prefix "ml#a/" was cut to
// "ml", and its tenant read and stepped the jobs of "ml#b/" (an outside
// probe); a token cut at its '#' matched a shorter one.
TEST(TokenTableTest, AHashInsideAFieldIsPartOfIt) {
  const std::string hashed_token = absl::StrCat(kBob, "#rest");
  auto table = TokenTable::Parse(absl::StrCat("# tenants\n", "carol trainer ", kAlice, " ml#a/  # carol's\n",
                                              "dave trainer ", hashed_token, " ml#b/\t#dave's\n"));
  ASSERT_TRUE(table.ok()) << table.status();
  auto carol = table->Authenticate(absl::StrCat("Bearer ", kAlice));
  ASSERT_TRUE(carol.ok()) << carol.status();
  EXPECT_TRUE(carol->Allows(Action::kPush, "ml#a/x").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(carol->Allows(Action::kRead, "ml#b/secret")));
  EXPECT_TRUE(absl::IsPermissionDenied(carol->Allows(Action::kCreate, "mlops/x")));
  EXPECT_TRUE(absl::IsUnauthenticated(table->Authenticate(absl::StrCat("Bearer ", kBob)).status()));
  auto dave = table->Authenticate(absl::StrCat("Bearer ", hashed_token));
  ASSERT_TRUE(dave.ok()) << dave.status();
  EXPECT_EQ(dave->name, "dave");
  EXPECT_TRUE(dave->Allows(Action::kRead, "ml#b/secret").ok());
}

// max_memory=, last on a line, caps a token's jobs, for any role; without it
// there is no cap. A bad one, one before another field (a second one, or a
// unit cut off by a space, which would be taken as a prefix), one not in
// lower case (which would be a prefix, the token uncapped), or a trainer
// with no prefix besides it, stops the file, naming the line only.
TEST(TokenTableTest, MaxMemoryIsTheTokensCapAndNotAPrefix) {
  auto table = TokenTable::Parse(absl::StrCat("alice trainer ", kAlice, " team-a/ shared/ max_memory=64Gi\n",
                                              "bob trainer ", kBob, " team-b/\n", "root admin ", kRoot,
                                              " max_memory=500M\n"));
  ASSERT_TRUE(table.ok()) << table.status();
  auto alice = table->Authenticate(absl::StrCat("Bearer ", kAlice));
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->max_memory, uint64_t{64} << 30);
  EXPECT_THAT(alice->prefixes, ::testing::ElementsAre("team-a/", "shared/"));
  EXPECT_EQ(table->Authenticate(absl::StrCat("Bearer ", kBob))->max_memory, 0u);
  auto root = table->Authenticate(absl::StrCat("Bearer ", kRoot));
  ASSERT_TRUE(root.ok());
  EXPECT_EQ(root->max_memory, 500u * 1000 * 1000);
  EXPECT_TRUE(root->prefixes.empty());
  for (const auto& [line, why] : std::vector<std::pair<std::string, std::string>>{
           {" team-a/ max_memory=lots", "positive byte count"},
           {" team-a/ max_memory=0", "positive byte count"},
           {" team-a/ max_memory=", "positive byte count"},
           {" team-a/ max_memory=1Gi max_memory=2Gi", "must be the line's last field"},
           {" team-a/ max_memory=5 Mi", "must be the line's last field"},
           {" team-a/ max_memory=1Gi shared/", "must be the line's last field"},
           {" team-a/ MAX_MEMORY=5Mi", "lower case"},
           {" max_memory=1Gi", "a trainer without a job prefix"},
       }) {
    auto bad = TokenTable::Parse(absl::StrCat("# first\nalice trainer ", kAlice, line, "\n"));
    EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << line;
    EXPECT_THAT(bad.status().message(), HasSubstr("line 2")) << line;
    EXPECT_THAT(bad.status().message(), HasSubstr(why)) << line;
    EXPECT_THAT(bad.status().message(), ::testing::Not(HasSubstr(kAlice))) << line;
  }
}

// A line missing a column puts the token where a name or a role was
// expected: no error may quote a field (these were logged at a SIGHUP).
TEST(TokenTableTest, ErrorsOfMalformedLinesNeverQuoteAField) {
  const std::string token = "6f1d0c1e9b2a4f7e8c3d5a6b";
  for (const std::string& text : {absl::StrCat("trainer ", token, " team-a/\n"),          // no name
                                  absl::StrCat(token, " trainer short team-a/\n"),        // token first
                                  absl::StrCat(token, " admin x\n", token, " admin y\n"),  // a name again
                                  absl::StrCat("a admin ", token, "\nb admin ", token, "\n"),  // a token again
                                  absl::StrCat(token, " trainer ", token, "\n")}) {      // no prefix
    auto table = TokenTable::Parse(text);
    ASSERT_TRUE(absl::IsInvalidArgument(table.status())) << text;
    EXPECT_THAT(table.status().message(), HasSubstr("line ")) << text;
    EXPECT_THAT(table.status().message(), ::testing::Not(HasSubstr(token.substr(0, 8)))) << table.status();
  }
}

}  // namespace
}  // namespace shardopt
