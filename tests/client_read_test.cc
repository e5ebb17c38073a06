// Client::Read against a server that ends a Read stream OK before it has
// sent the whole range: DATA_LOSS, saying how much came, rather than OK
// with the rest of the caller's buffer left as it was; and against one that
// sends another tensor's chunk, or one of another dtype: INTERNAL, rather
// than those bytes in the caller's buffer; and ReadMany against one whose
// tensors' chunks are of two steps: ABORTED, not a state dict torn between
// steps.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt {
namespace {

// Takes any job. Answers a Read of job "short" with the first half of the
// range only; of "other-tensor" with the whole range named as tensor "x";
// of "other-dtype" with the whole range as BF16, for a read of the master;
// of "two-steps" with tensor x's chunks at step 2 and w's at step 1.
class ShortReadService final : public v1::Optimizer::Service {
 public:
  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest*, v1::CreateJobResponse* r) override {
    r->set_created(true);
    r->set_max_message_bytes(64 << 20);
    return grpc::Status::OK;
  }
  grpc::Status Read(grpc::ServerContext*, const v1::ReadRequest* request,
                    grpc::ServerWriter<v1::StateChunk>* writer) override {
    v1::StateChunk chunk;
    chunk.set_tensor(request->job() == "other-tensor" ? "x" : request->tensor());
    chunk.set_offset(request->offset());
    if (request->job() == "other-dtype") chunk.set_dtype(v1::BF16);
    chunk.set_step(request->job() == "two-steps" && request->tensor() == "x" ? 2 : 1);
    chunk.set_data(std::string((request->job() == "short" ? request->length() / 2 : request->length()) * 4, '\x01'));
    writer->Write(chunk);
    return grpc::Status::OK;
  }
};

class ClientReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(); }

  // A client attached to job `name` (tensors w and x, 100 elements each) on
  // the server.
  std::unique_ptr<Client> Attached(const std::string& name) {
    ClientOptions options;
    options.servers = {absl::StrCat("127.0.0.1:", port_)};
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    JobOptions job;
    job.name = name;
    job.world_size = 1;
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"w", 100, 0}, {"x", 100, 0}};
    EXPECT_TRUE((*client)->CreateOrAttach(job).ok());
    return *std::move(client);
  }

  ShortReadService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(ClientReadTest, AServerThatSendsPartOfTheRangeIsDataLoss) {
  auto client = Attached("short");
  ASSERT_NE(client, nullptr);
  std::vector<float> out(100, 0.0f);
  const absl::Status read = client->Read("w", StateToRead::kMaster, 0, 100, out.data());
  EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
  EXPECT_NE(read.message().find("50 of the 100 elements"), std::string::npos) << read;
  // A count of 0 asks no server (this one would answer 0 of 0 elements):
  // OK up to the tensor's end, as client.h says, and OUT_OF_RANGE past it.
  EXPECT_TRUE(client->Read("w", StateToRead::kMaster, 100, 0, nullptr).ok());
  EXPECT_EQ(client->Read("w", StateToRead::kMaster, 101, 0, nullptr).code(), absl::StatusCode::kOutOfRange);
}

// ReadMany's lanes read one server's ranges at once: the first to fail
// cancels the others, and the caller is given its error, not theirs.
TEST_F(ClientReadTest, AReadOfManyRangesGivesTheErrorOfTheRangeThatFailedNotACancellation) {
  auto client = Attached("short");
  ASSERT_NE(client, nullptr);
  std::vector<float> out(8 * 50);
  std::vector<StateRead> reads;
  for (int i = 0; i < 8; ++i) reads.push_back({i % 2 ? "x" : "w", StateToRead::kMaster, 0, 50, out.data() + 50 * i});
  const absl::Status read = client->ReadMany(reads);
  EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
  EXPECT_NE(read.message().find("25 of the 50 elements"), std::string::npos) << read;
}

TEST_F(ClientReadTest, AChunkOfAnotherTensorOrDtypeIsRefused) {
  for (const std::string name : {"other-tensor", "other-dtype"}) {
    auto client = Attached(name);
    ASSERT_NE(client, nullptr);
    std::vector<float> out(100, 0.0f);
    const absl::Status read = client->Read("w", StateToRead::kMaster, 0, 100, out.data());
    EXPECT_EQ(read.code(), absl::StatusCode::kInternal) << name << ": " << read;
    EXPECT_EQ(out, std::vector<float>(100, 0.0f)) << name << ": the chunk's bytes went into the buffer";
  }
}

TEST_F(ClientReadTest, ReadsOfTensorsThatSeeTwoStepsAreAborted) {
  auto client = Attached("two-steps");
  ASSERT_NE(client, nullptr);
  std::vector<float> w(100), x(100);
  // Each tensor alone is of one step.
  EXPECT_TRUE(client->Read("w", StateToRead::kMaster, 0, 100, w.data()).ok());
  EXPECT_TRUE(client->Read("x", StateToRead::kMaster, 0, 100, x.data()).ok());
  EXPECT_TRUE(client->ReadMany({{"w", StateToRead::kMaster, 0, 100, w.data()},
                                {"w", StateToRead::kExpAvg, 0, 100, x.data()}})
                  .ok());
  const absl::Status read =
      client->ReadMany({{"w", StateToRead::kMaster, 0, 100, w.data()}, {"x", StateToRead::kMaster, 0, 100, x.data()}});
  EXPECT_EQ(read.code(), absl::StatusCode::kAborted) << read;
  EXPECT_NE(read.message().find("stepped during the read"), std::string::npos) << read;
}

}  // namespace
}  // namespace shardopt
