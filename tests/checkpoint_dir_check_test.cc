// Rank 0's attach compares the checkpoint directories its servers report
// (DescribeResponse.checkpoint_dir_id), against servers that report chosen
// ids: different ids are refused naming both servers, and so is a server
// without a directory beside one with; a server older than the field, one
// that holds no part of the job, and, without checkpoint_every, one that
// does not answer Describe are not compared.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// What a server's Describe says of its directory: kOld, nothing (a server
// older than the fields); kNone, that it has none; else its id.
constexpr char kOld[] = "";
constexpr char kNone[] = "(none)";

// Takes any job; answers Describe with `id`, or UNIMPLEMENTED without one.
class DirectoryService final : public v1::Optimizer::Service {
 public:
  explicit DirectoryService(std::optional<std::string> id) : id_(std::move(id)) {}
  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest*, v1::CreateJobResponse* r) override {
    r->set_created(true);
    r->set_max_message_bytes(64 << 20);
    return grpc::Status::OK;
  }
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*, v1::DescribeResponse* r) override {
    if (!id_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no Describe here");
    if (*id_ == kNone) {
      r->set_checkpoint_dir(false);
    } else if (*id_ != kOld) {
      r->set_checkpoint_dir(true);
      r->set_checkpoint_dir_id(*id_);
    }
    return grpc::Status::OK;
  }

 private:
  const std::optional<std::string> id_;
};

class Servers {
 public:
  explicit Servers(const std::vector<std::optional<std::string>>& ids) {
    for (const auto& id : ids) {
      services_.push_back(std::make_unique<DirectoryService>(id));
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(services_.back().get());
      servers_.push_back(builder.BuildAndStart());
      addresses_.push_back(absl::StrCat("127.0.0.1:", port));
    }
  }
  ~Servers() {
    for (auto& s : servers_) s->Shutdown();
  }
  const std::string& address(int i) const { return addresses_[i]; }

  // Rank `rank`'s attach to a job of one tensor of `numel` elements, which
  // a server holds part of if numel reaches its share (4096 elements each).
  absl::Status Attach(uint64_t numel, uint32_t checkpoint_every = 0, uint32_t rank = 0) {
    ClientOptions options;
    options.servers = addresses_;
    options.rank = rank;
    options.checkpoint_every = checkpoint_every;
    auto client = Client::Connect(options);
    if (!client.ok()) return client.status();
    JobOptions job;
    job.name = "dirs";
    job.world_size = 2;
    job.groups = {{"g", 0.9, 0.95, 1e-8f, 0.0}};
    job.tensors = {{"w", numel, 0}};
    return (*client)->CreateOrAttach(job).status();
  }

 private:
  std::vector<std::unique_ptr<DirectoryService>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
};

constexpr uint64_t kOnEveryServer = 3 * 4096 + 100;

TEST(CheckpointDirCheckTest, DifferentIdsAreRefusedNamingBothServersAndAServerTooOldToSayIsNotCompared) {
  Servers servers({"aaaa", kOld, "bbbb"});
  const absl::Status refused = servers.Attach(kOnEveryServer);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr("different checkpoint directories"), HasSubstr(servers.address(0)),
                    HasSubstr(servers.address(2)), HasSubstr("aaaa"), HasSubstr("bbbb")));
  EXPECT_THAT(std::string(refused.message()), ::testing::Not(HasSubstr(servers.address(1))));
  // Only rank 0 asks.
  const absl::Status rank1 = servers.Attach(kOnEveryServer, 0, /*rank=*/1);
  EXPECT_TRUE(rank1.ok()) << rank1;
}

TEST(CheckpointDirCheckTest, AServerWithoutADirectoryBesideOneWithIsRefusedAndNoneAtAllIsTaken) {
  Servers servers({"aaaa", kNone});
  const absl::Status refused = servers.Attach(kOnEveryServer);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr(servers.address(0) + " of job 'dirs' has a --checkpoint_dir and server " +
                              servers.address(1) + " has none"),
                    HasSubstr("the same --checkpoint_dir, or none")));
  const absl::Status none = Servers({kNone, kNone}).Attach(kOnEveryServer);
  EXPECT_TRUE(none.ok()) << none;
}

TEST(CheckpointDirCheckTest, TheSameIdAndAServerHoldingNoPartAreTaken) {
  const absl::Status same = Servers({"aaaa", kOld, "aaaa"}).Attach(kOnEveryServer);
  EXPECT_TRUE(same.ok()) << same;
  // 100 elements: all on the first server; the second's directory is not the job's.
  Servers two({"aaaa", "bbbb"});
  const absl::Status one_holds = two.Attach(100);
  EXPECT_TRUE(one_holds.ok()) << one_holds;
  EXPECT_EQ(two.Attach(kOnEveryServer).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CheckpointDirCheckTest, AServerThatDoesNotAnswerIsNotComparedUnlessCheckpointEveryNeedsItsDirectory) {
  Servers servers({"aaaa", std::nullopt, "aaaa"});
  const absl::Status silent = servers.Attach(kOnEveryServer);
  EXPECT_TRUE(silent.ok()) << silent;
  const absl::Status every = servers.Attach(kOnEveryServer, /*checkpoint_every=*/1);
  EXPECT_EQ(every.code(), absl::StatusCode::kUnimplemented) << every;
  EXPECT_THAT(std::string(every.message()), HasSubstr(servers.address(1)));
  // A server that does not answer does not hide two that differ.
  EXPECT_EQ(Servers({"aaaa", std::nullopt, "bbbb"}).Attach(kOnEveryServer).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shardopt
