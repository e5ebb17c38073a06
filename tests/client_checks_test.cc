// What the client checks, against servers of the test's own that answer
// wrongly: a commit's chunk outside the server's own shards is refused
// before any byte of it is written (a node group's buffers hold only the
// ranges it owns), a shard whose params came twice in part and not at all
// in part is DATA_LOSS, not OK, and a push that ends OK without an answer is
// an error, not a partial norm of 0. And of its own inputs: a tensor's numel
// out of range is refused before any server is asked, and a failed attach
// leaves the client attached to nothing.
#include <limits>
#include <random>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "client/option_checks.h"
#include "rpc/barrier_timeout.h"
#include "rpc/initial_values.h"
#include "rpc/learning_rates.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt {
namespace {

// Takes any job but "refused"; answers a Commit with the bf16 chunks it was
// given, each (tensor, offset, elements) filled with its byte. Push goes to
// SilentMethods.
class ScriptedCommitService final : public v1::Optimizer::WithGenericMethod_Push<v1::Optimizer::Service> {
 public:
  struct Chunk {
    std::string tensor;
    uint64_t offset;
    uint64_t elements;
    char fill = '\x01';
    uint64_t steps_ahead = 0;  // sent as the commit's step plus this
  };
  explicit ScriptedCommitService(std::vector<Chunk> chunks) : chunks_(std::move(chunks)) {}

  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest* request,
                         v1::CreateJobResponse* r) override {
    if (request->job() == "refused") return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "refused");
    r->set_created(true);
    r->set_max_message_bytes(64 << 20);
    return grpc::Status::OK;
  }
  grpc::Status Commit(grpc::ServerContext*, const v1::CommitRequest* request,
                      grpc::ServerWriter<v1::ParamChunk>* writer) override {
    for (const Chunk& c : chunks_) {
      v1::ParamChunk chunk;
      chunk.set_tensor(c.tensor);
      chunk.set_offset(c.offset);
      chunk.set_step(request->step() + c.steps_ahead);
      chunk.set_data(std::string(c.elements * 2, c.fill));
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }

 private:
  const std::vector<Chunk> chunks_;
};

// Every other method (Push among them): reads the call's messages and ends
// it OK without an answer.
class SilentMethods final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() { StartRead(&in_); }
      void OnReadDone(bool ok) override {
        if (ok) return StartRead(&in_);
        Finish(grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer in_;
    };
    return new Reactor;
  }
};

// Servers running the scripted services, and a client attached to a job of
// one tensor "w" of `numel` elements over them.
class Cluster {
 public:
  Cluster(std::vector<std::vector<ScriptedCommitService::Chunk>> scripts, uint64_t numel) {
    ClientOptions options;
    options.max_attempts = 1;
    for (auto& script : scripts) {
      services_.push_back(std::make_unique<ScriptedCommitService>(std::move(script)));
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(services_.back().get());
      silent_.push_back(std::make_unique<SilentMethods>());  // one server each
      builder.RegisterCallbackGenericService(silent_.back().get());
      servers_.push_back(builder.BuildAndStart());
      options.servers.push_back(absl::StrCat("127.0.0.1:", port));
    }
    client_ = Client::Connect(options).value();
    JobOptions job;
    job.name = "scripted";
    job.world_size = 1;
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"w", numel, 0}};
    attached_ = client_->CreateOrAttach(job).status();
  }
  ~Cluster() {
    for (auto& s : servers_) s->Shutdown();
  }
  absl::Status attached() const { return attached_; }
  Client& client() { return *client_; }

 private:
  std::vector<std::unique_ptr<SilentMethods>> silent_;
  std::vector<std::unique_ptr<ScriptedCommitService>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::unique_ptr<Client> client_;
  absl::Status attached_;
};

TEST(ClientChecksTest, ParamsSentTwiceInPlaceOfMissingOnesAreDataLoss) {
  // 100 elements: [0, 50) twice, [50, 100) never. The count is right.
  Cluster cluster({{{"w", 0, 50}, {"w", 0, 50}}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<uint16_t> params(100, 0xFFFF);
  const absl::Status st = cluster.client().Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}});
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("overlap or leave a gap"), std::string::npos) << st;
}

TEST(ClientChecksTest, ParamsOutsideTheServersShardAreRefusedUnwritten) {
  // 10000 elements over two servers: the first holds [0, 4096), the second
  // the rest. The first sends params of the second's range (0x0202); the
  // second sends its own (0x0101).
  Cluster cluster({{{"w", 4096, 100, '\x02'}}, {{"w", 4096, 5904}}}, 10000);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<uint16_t> params(10000, 0xFFFF);
  const absl::Status st = cluster.client().Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("outside its shards"), std::string::npos) << st;
  for (uint64_t i = 4096; i < 4196; ++i) ASSERT_NE(params[i], 0x0202) << "element " << i << " was written";
}

// A server's params of another step (a server gone wrong) were copied into
// the caller's params before the step was looked at, and only then refused.
TEST(ClientChecksTest, ParamsOfAnotherStepAreRefusedUnwritten) {
  Cluster cluster({{{"w", 0, 100, '\x03', /*steps_ahead=*/1}}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<uint16_t> params(100, 0xFFFF);
  const absl::Status st = cluster.client().Commit(1, 1e-3, 1.0f, false, {{"w", params.data()}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("of another step"), std::string::npos) << st;
  for (uint64_t i = 0; i < 100; ++i) ASSERT_EQ(params[i], 0xFFFF) << "element " << i << " was written";
}

TEST(ClientChecksTest, APushEndedWithoutAnAnswerIsAnError) {
  Cluster cluster({{}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<uint16_t> g(100, 0x3f80);
  const auto pushed = cluster.client().Push(1, {{"w", g.data()}});
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInternal) << pushed.status();
  EXPECT_NE(pushed.status().message().find("without an answer"), std::string::npos) << pushed.status();
}

TEST(ClientChecksTest, ANumelOutOfRangeIsRefusedBeforeAnyServerIsAsked) {
  ClientOptions options;
  options.servers = {"127.0.0.1:1"};  // nobody: asking it would be UNAVAILABLE
  options.max_attempts = 1;
  auto client = Client::Connect(options).value();
  for (uint64_t numel : {uint64_t{0}, (uint64_t{1} << 40) + 1, ~uint64_t{0}}) {
    JobOptions job;
    job.name = "huge";
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"w", numel, 0}};
    const auto attached = client->CreateOrAttach(job);
    EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument) << numel << ": " << attached.status();
  }
}

// Names that are not UTF-8 are refused before any server is asked: protobuf
// sent them, printing two errors on the trainer's stderr, and the server
// refused the message whole.
TEST(ClientChecksTest, ANameThatIsNotUtf8IsRefusedBeforeAnyServerIsAsked) {
  ClientOptions options;
  options.servers = {"127.0.0.1:1"};  // nobody: asking it would be UNAVAILABLE
  options.max_attempts = 1;
  auto client = Client::Connect(options).value();
  auto valid = [] {
    JobOptions job;
    job.name = "j\xc3\xa9";  // UTF-8 is taken
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"w", 10, 0}};
    return job;
  };
  EXPECT_EQ(client->CreateOrAttach(valid()).status().code(), absl::StatusCode::kUnavailable);
  std::vector<JobOptions> refused(3, valid());
  refused[0].name = "j\xe9";
  refused[1].groups[0].name = "g\xff";
  refused[2].tensors[0].name = "w\xed\xa0\x80";  // a surrogate
  for (size_t i = 0; i < refused.size(); ++i) {
    const auto attached = client->CreateOrAttach(refused[i]);
    EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument) << i << ": " << attached.status();
    EXPECT_THAT(std::string(attached.status().message()), ::testing::HasSubstr("is not UTF-8")) << i;
  }
}

// The client refuses a name exactly where the server's parser would refuse
// the message, on byte strings drawn around the encoding's edges.
TEST(ClientChecksTest, TheNameCheckAgreesWithProtobufsParser) {
  google::protobuf::LogSilencer quiet;  // the serializer logs every string that is not UTF-8
  std::mt19937 rng(20261205);
  const uint8_t edges[] = {0x00, 0x41, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf,
                           0xe0, 0xe1, 0xec, 0xed, 0xee, 0xef, 0xf0, 0xf1, 0xf3, 0xf4, 0xf5, 0xff};
  int valid = 0;
  for (int n = 0; n < 200000; ++n) {
    std::string s(1 + rng() % 6, '\0');
    for (char& c : s) c = static_cast<char>(edges[rng() % sizeof edges]);
    v1::ReadRequest sent;
    sent.set_job(s);
    v1::ReadRequest parsed;
    const bool protobuf_takes = parsed.ParseFromString(sent.SerializeAsString());
    ASSERT_EQ(CheckNameIsUtf8("name", s).ok(), protobuf_takes) << absl::CHexEscape(s);
    valid += protobuf_takes;
  }
  EXPECT_GT(valid, 1000);  // both verdicts drawn often
  EXPECT_LT(valid, 190000);
}

TEST(ClientChecksTest, AFailedAttachLeavesTheClientAttachedToNothing) {
  Cluster cluster({{}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  JobOptions other;
  other.name = "refused";
  other.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
  other.tensors = {{"v", 5000, 0}};
  EXPECT_EQ(cluster.client().CreateOrAttach(other).status().code(), absl::StatusCode::kAlreadyExists);
  std::vector<uint16_t> g(5000, 0x3f80);
  const auto pushed = cluster.client().Push(1, {{"v", g.data()}});
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kFailedPrecondition) << pushed.status();
  EXPECT_NE(pushed.status().message().find("CreateOrAttach first"), std::string::npos) << pushed.status();
}

// A job the client itself refuses (no name, no tensors, a world_size of 0,
// an enum value that names nothing) is refused before any server is asked,
// and detaches the client from the job it had, as a server's refusal does.
TEST(ClientChecksTest, AJobTheClientRefusesIsRefusedBeforeAnyServerIsAskedAndDetaches) {
  Cluster cluster({{}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  auto valid = [] {
    JobOptions job;
    job.name = "other";
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"v", 5000, 0}};
    return job;
  };
  std::vector<JobOptions> refused(6, valid());
  refused[0].name.clear();
  refused[1].tensors.clear();
  refused[2].world_size = 0;
  refused[3].groups[0].precision = static_cast<StatePrecision>(9);
  refused[4].grad_type = static_cast<GradType>(5);
  refused[5].tensors[0].param_type = static_cast<ParamType>(7);
  for (size_t i = 0; i < refused.size(); ++i) {
    const auto attached = cluster.client().CreateOrAttach(refused[i]);
    EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument) << i << ": " << attached.status();
    std::vector<uint16_t> g(100, 0x3f80);
    const auto pushed = cluster.client().Push(1, {{"w", g.data()}});
    EXPECT_EQ(pushed.status().code(), absl::StatusCode::kFailedPrecondition) << i << ": " << pushed.status();
  }
}

// As the servers answer it, and the README's table says.
TEST(ClientChecksTest, AnUnknownTensorIsNotFound) {
  Cluster cluster({{}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<float> out(10);
  const absl::Status read = cluster.client().Read("zzz", StateToRead::kMaster, 0, 10, out.data());
  EXPECT_EQ(read.code(), absl::StatusCode::kNotFound) << read;
  std::vector<uint16_t> g(100, 0x3f80);
  EXPECT_EQ(cluster.client().InitBf16("zzz", g.data()).code(), absl::StatusCode::kNotFound);
}

// One of two gradients for a tensor would be pushed and the other ignored.
TEST(ClientChecksTest, AGradientGivenTwiceForATensorIsRefused) {
  Cluster cluster({{}}, 100);
  ASSERT_TRUE(cluster.attached().ok()) << cluster.attached();
  std::vector<uint16_t> g(100, 0x3f80), h(100, 0x4000);
  const auto pushed = cluster.client().Push(1, {{"w", g.data()}, {"w", h.data()}});
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInvalidArgument) << pushed.status();
}

TEST(ClientChecksTest, ATokenLosesItsSurroundingWhitespaceAndOtherControlBytesAreRefused) {
  EXPECT_EQ(CleanBearerToken("  0123456789abcdef\r\n").value(), "0123456789abcdef");
  const auto bad = CleanBearerToken("01234567\n89abcdef");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), ::testing::Not(::testing::HasSubstr("0123")));
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("character 9 is a line break"));
  // What each byte is, not "not printable ASCII" for a space, which is.
  const auto bearer = CleanBearerToken("Bearer 0123456789abcdef");
  EXPECT_THAT(std::string(bearer.status().message()),
              ::testing::HasSubstr("character 7 is a space: a token is one word (give it without 'Bearer ')"));
  // Whitespace alone (an empty Secret in SHARDOPT_TOKEN) is a mistake, not
  // "no token": it used to call without one, unsaid.
  EXPECT_EQ(CleanBearerToken(" \n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CleanBearerToken("").value(), "");
  ClientOptions options;
  options.servers = {"127.0.0.1:1"};
  options.token = "01234567\x01" "89abcdef";  // gRPC would abort the process on it
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
}

// TLS files a client could not use are refused at Connect, where gRPC would
// fail every call as UNAVAILABLE, as if the server were down.
TEST(ClientChecksTest, ACertificateWithoutItsKeyOrTextThatIsNotPemIsRefusedAtConnect) {
  const std::string pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  struct Case {
    std::string ca, cert, key, says;
  } cases[] = {
      {"", pem, "", "the certificate is given alone"},
      {pem, "", "-----BEGIN PRIVATE KEY-----\n", "the key is given alone"},
      {"not a certificate", "", "", "the CA file is not PEM text"},
      {pem, "garbage", "garbage", "the client certificate is not PEM text"},
      // PEM's frame around bytes that are no certificate (real files: tls_test).
      {pem, "", "", "the CA file holds no certificate OpenSSL can read"},
  };
  for (const Case& c : cases) {
    ClientOptions options;
    options.servers = {"127.0.0.1:1"};
    options.tls_root_certs = c.ca;
    options.tls_cert_chain = c.cert;
    options.tls_private_key = c.key;
    const auto client = Client::Connect(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << client.status();
    EXPECT_THAT(std::string(client.status().message()), ::testing::HasSubstr(c.says));
  }
  EXPECT_TRUE(CheckTlsPem("", "", "").ok());
}

TEST(ClientChecksTest, AServerListedTwiceIsRefusedAtConnect) {
  ClientOptions options;
  options.servers = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"};
  const auto client = Client::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << client.status();
}

// Options no call could go through with are refused at Connect, not met
// later as a server that seems down (a port gRPC takes as 443, a deadline
// of 0) or a share pushed twice.
TEST(ClientChecksTest, OptionsNoCallCouldGoThroughWithAreRefusedAtConnect) {
  struct Case {
    std::vector<std::string> servers;
    std::vector<uint32_t> push_servers;
    int max_attempts;
    uint32_t rpc_timeout_ms;
    std::string says;
  } cases[] = {
      {{"127.0.0.1"}, {}, 5, 1000, "is not host:port"},
      {{"shardopt-0.shardopt:"}, {}, 5, 1000, "is not host:port"},
      {{"127.0.0.1:65536"}, {}, 5, 1000, "is not host:port"},
      {{"127.0.0.1:0"}, {}, 5, 1000, "is not host:port"},  // taken before, as ExpandServerPattern refused it
      {{"ipv4:127.0.0.1:0"}, {}, 5, 1000, "after its scheme"},
      {{"::1:50051"}, {}, 5, 1000, "is not host:port"},
      {{"shardopt-0.shardopt:50o51"}, {}, 5, 1000, "is not host:port"},  // a port mistyped, not a scheme
      {{"host:notaport"}, {}, 5, 1000, "is not host:port"},
      {{"DNS:///localhost:50051"}, {}, 5, 1000, "in lower case"},  // gRPC looks schemes up as written
      {{"vsock:1:50051"}, {}, 5, 1000, "is not host:port"},          // no vsock resolver in gRPC 1.51
      {{"ipv4:127.0.0.1:50o51"}, {}, 5, 1000, "after its scheme"},    // gRPC dialed port 50
      {{"dns:///localhost"}, {}, 5, 1000, "after its scheme"},        // port 0
      {{"ipv4:127.0.0.1:1,127.0.0.1"}, {}, 5, 1000, "after its scheme"},
      {{""}, {}, 5, 1000, "is not host:port"},
      {{"127.0.0.1:1", "127.0.0.1:2"}, {1, 2}, 5, 1000, "push_servers names server 2 of 2"},
      {{"127.0.0.1:1", "127.0.0.1:2"}, {1, 0, 1}, 5, 1000, "push_servers names server 1 twice"},
      {{"127.0.0.1:1"}, {}, 0, 1000, "max_attempts must be at least 1"},
      {{"127.0.0.1:1"}, {}, -3, 1000, "max_attempts must be at least 1"},
      {{"127.0.0.1:1"}, {}, 5, 0, "rpc_timeout_ms must be at least 1"},
  };
  for (const Case& c : cases) {
    ClientOptions options;
    options.servers = c.servers;
    options.push_servers = c.push_servers;
    options.max_attempts = c.max_attempts;
    options.rpc_timeout_ms = c.rpc_timeout_ms;
    const auto client = Client::Connect(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << client.status();
    EXPECT_THAT(std::string(client.status().message()), ::testing::HasSubstr(c.says));
  }
  // What gRPC reads: host:port, a bracketed IPv6 address, targets with a
  // scheme; and one attempt, no retry.
  for (const std::string target : {"shardopt-0.shardopt:50051", "[::1]:50051", "localhost:1", "dns:///localhost:50051",
                                    "ipv4:127.0.0.1:50051", "unix:/tmp/shardopt.sock",
                                    "unix:///tmp/shardopt.sock", "ipv6:[::1]:50051", "unix-abstract:shardopt",
                                    "dns:localhost:50051", "dns://8.8.8.8/localhost:50051",
                                    "ipv4:127.0.0.1:1,127.0.0.1:2"}) {
    ClientOptions options;
    options.servers = {target};
    options.max_attempts = 1;
    options.rpc_timeout_ms = 1;
    EXPECT_TRUE(Client::Connect(options).ok()) << target;
  }
}

// Only a barrier's own DEADLINE_EXCEEDED is told as one, whose every retry
// waited out the barrier: not another deadline of the server's (a
// checkpoint still being written), nor the same words under another code.
TEST(ClientChecksTest, ABarrierTimeoutIsToldFromTheServersOtherDeadlines) {
  EXPECT_TRUE(IsBarrierTimeout(absl::DeadlineExceededError(
      absl::StrCat("127.0.0.1:5: ", BarrierTimedOut(3), " after 5s: ranks {1} of 2 ..."))));
  EXPECT_FALSE(IsBarrierTimeout(absl::DeadlineExceededError("127.0.0.1:5: a checkpoint of step 3 is still being written")));
  EXPECT_FALSE(IsBarrierTimeout(absl::UnavailableError(BarrierTimedOut(3))));
}

// An fp32 initial value of a group that keeps bf16 state is refused if it
// rounds to infinity there, and the message says so, with the value: it
// said "is not finite" of 3.4e38 (a probe). A value not finite as given
// is said to be so.
TEST(InitialValuesTest, AValueThatRoundsToInfinityInBf16StateIsSaidToDoSo) {
  const float values[] = {1.0f, 3.4e38f, std::numeric_limits<float>::infinity()};
  const char* bytes = reinterpret_cast<const char*>(values);
  EXPECT_TRUE(CheckInitialValues(bytes, 2, /*fp32=*/true, /*bf16_state=*/false, InitialKind::kMaster, "'w'", 0).ok());
  const absl::Status big = CheckInitialValues(bytes, 2, true, /*bf16_state=*/true, InitialKind::kMaster, "'w'", 0);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()), ::testing::HasSubstr("element 1 (3.4e+38) rounds to infinity in its group's bf16 state"));
  const absl::Status inf = CheckInitialValues(bytes + 8, 1, true, false, InitialKind::kMaster, "'w'", 2);
  EXPECT_THAT(std::string(inf.message()), ::testing::HasSubstr("element 2 is not finite"));
  // A second moment is the exception: +Inf is a v a run reaches, so one that
  // rounds to it in a bf16 group, or is it, is taken; -Inf and NaN are not.
  EXPECT_TRUE(CheckInitialValues(bytes, 3, true, /*bf16_state=*/true, InitialKind::kExpAvgSq, "'w'", 0).ok());
  const float never[] = {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(CheckInitialValues(reinterpret_cast<const char*>(never + i), 1, true, false, InitialKind::kExpAvgSq,
                                    "'w'", 0)
                     .ok())
        << i;
  }
}

// A loss_scale below 1 scales the gradients up (gscale > 1): finite ones
// then overflowed in the kernel's g = grad * gscale and made the masters
// NaN for good (a probe: loss_scale 1e-3, a gradient of 1e37), where torch's
// GradScaler, which looks for infs after unscaling, skips the step. Decide
// now skips a step whose gradient's norm, so scaled, passes fp32's range (no
// element exceeds the norm); a gscale of 1 or less cannot overflow a finite
// gradient, and takes every step it took.
TEST(DecideTest, AStepWhoseGradientsTheLossScaleWouldCarryPastFp32IsSkipped) {
  const auto decide = [](double norm, double loss_scale, uint32_t world_size, double max_grad_norm = 0) {
    PushResult push;
    push.sum_squares = norm * norm;
    StepOptions options;
    options.loss_scale = loss_scale;
    options.max_grad_norm = max_grad_norm;
    return Decide(push, world_size, options);
  };
  const Decision over = decide(1e37, 1e-3, 1);
  EXPECT_TRUE(over.skip);
  EXPECT_EQ(over.gscale, 1000.0f);  // as every skip's: 1 / (loss_scale x ranks)
  EXPECT_DOUBLE_EQ(over.grad_norm, 1e40);
  EXPECT_FALSE(decide(1e37, 1, 1).skip);     // gscale 1: the gradient as it is
  EXPECT_FALSE(decide(3e38, 1, 1).skip);
  EXPECT_FALSE(decide(1e37, 1e-3, 1000).skip);  // 1 / (loss_scale x ranks) = 1
  EXPECT_FALSE(decide(1e30, 1e-3, 1).skip);
  EXPECT_FALSE(decide(1e37, 1e-3, 1, /*max_grad_norm=*/1.0).skip);  // clipped to a norm of 1
  // At the edge, gscale 2: a norm that stays under fp32's largest once
  // doubled steps, one that does not skips.
  EXPECT_FALSE(decide(1.6e38, 0.5, 1).skip);
  EXPECT_TRUE(decide(1.8e38, 0.5, 1).skip);
}

// A plain client's Step averages over world_size x trainers_per_rank (0
// and 1 alike), as a node group does over world_size x G: the norm and the
// gscale both.
TEST(DecideTest, AStepAveragesOverEveryTrainerEachRankSums) {
  JobOptions job;
  job.world_size = 2;
  EXPECT_EQ(Trainers(job), 2u);
  job.trainers_per_rank = 1;
  EXPECT_EQ(Trainers(job), 2u);
  job.trainers_per_rank = 3;
  EXPECT_EQ(Trainers(job), 6u);
  job.world_size = 65536;
  job.trainers_per_rank = UINT32_MAX;  // no wrap in 32 bits
  EXPECT_EQ(Trainers(job), uint64_t{65536} * UINT32_MAX);
  PushResult push;
  push.sum_squares = 36;
  const Decision d = Decide(push, 6, StepOptions{});
  EXPECT_EQ(d.gscale, static_cast<float>(1.0 / 6));
  EXPECT_DOUBLE_EQ(d.grad_norm, 1.0);
}

// Each lr finite on its own, but the update's constants not as floats: the
// four a probe written from the proto sent, each of which wrote -inf into
// the master for good. The client checks them before a push, the server at
// the commit.
TEST(LearningRatesTest, LrsWhoseUpdateConstantsOverflowAFloatAreRefused) {
  const auto hyper = [](double beta1, double weight_decay, double lr_multiplier) {
    return AdamWHyper{beta1, 0.999, 1e-8f, weight_decay, lr_multiplier};
  };
  const AdamWHyper usual = hyper(0.9, 0.01, 1.0);
  EXPECT_TRUE(CheckLearningRates(1e-3, {}, {usual}, "j").ok());
  EXPECT_TRUE(CheckLearningRates(3e37, {}, {hyper(0.9, 0.0, 1.0)}, "j").ok());  // 3e38 as a step size
  const struct {
    double lr;
    std::vector<double> group_lr;
    AdamWHyper group;
    const char* says;
  } refused[] = {
      {3e38, {}, hyper(0.9, 0.01, 2.0), "step size"},
      {1e-3, {3.4e38}, usual, "step size"},
      {1e-3, {}, hyper(0.9, 1e300, 1.0), "decay"},
      {1e30, {}, hyper(0.9, 1e10, 1.0), "decay"},
  };
  for (const auto& r : refused) {
    const absl::Status st = CheckLearningRates(r.lr, r.group_lr, {r.group}, "j");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << r.lr;
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr(r.says)) << st;
  }
  // An lr past float's range is named in the digits that tell it from
  // float's largest, which is taken (both read "3.40282e+38" before: an
  // outside probe).
  const absl::Status past = CheckLearningRates(3.4028236e38, {}, {usual}, "j");
  EXPECT_THAT(std::string(past.message()), ::testing::HasSubstr("finite as a float, got 3.4028236e+38")) << past;
  const absl::Status group_past = CheckLearningRates(1e-3, {3.4028236e38}, {usual}, "j");
  EXPECT_THAT(std::string(group_past.message()), ::testing::HasSubstr("got 3.4028236e+38")) << group_past;
}

// A negative second moment is refused as given, also where it would round
// to -0 in a bf16 group (-1e-45 was taken there, and refused in an fp32
// one: an outside probe); -0 itself is zero, and taken.
TEST(InitialValuesTest, ANegativeSecondMomentIsRefusedWhateverItRoundsTo) {
  const float values[] = {-1e-45f, -1e-41f, -0.0f};
  const char* bytes = reinterpret_cast<const char*>(values);
  for (const bool bf16_state : {false, true}) {
    for (int i = 0; i < 2; ++i) {
      const absl::Status st = CheckInitialValues(bytes + 4 * i, 1, /*fp32=*/true, bf16_state, InitialKind::kExpAvgSq,
                                                 "'w'", 0);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bf16_state << " " << values[i];
      EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("is negative")) << st;
    }
    EXPECT_TRUE(CheckInitialValues(bytes + 8, 1, true, bf16_state, InitialKind::kExpAvgSq, "'w'", 0).ok());
  }
}

// A loss_scale too small for 1 / (loss_scale x ranks) to be a float is
// refused with the bound it must reach, and that bound is taken: the
// message said 2.9e-39, which is itself refused (an outside probe).
TEST(ClientChecksTest, ALossScaleTooSmallIsRefusedWithABoundThatIsTaken) {
  StepOptions options;
  options.lr = 1e-3;
  options.loss_scale = 2.9387e-39;
  const absl::Status refused = CheckStepOptions(options, 1);
  ASSERT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), testing::HasSubstr("loss_scale x ranks of 2.938736e-39 or more"));
  options.loss_scale = 2.938736e-39;
  EXPECT_TRUE(CheckStepOptions(options, 1).ok());
  options.loss_scale = 2.938736e-39 / 4;  // over 4 ranks, the same product
  EXPECT_TRUE(CheckStepOptions(options, 4).ok());
}

}  // namespace
}  // namespace shardopt
