// The attacks of shardopt-bench abuse: the six the security review found,
// each run by an Attacker until a deadline, its answers counted by code.
// bench/abuse_bench.cc runs them against a server while a victim steps.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt::bench {

using AbuseClock = std::chrono::steady_clock;

// The attacker's token: a trainer of the prefix attacker/.
inline constexpr char kAttackerToken[] = "attacker-token-0123456789abcdef";

// What the attacker was answered, by gRPC code name.
class Answers {
 public:
  void Add(const grpc::Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[std::string(absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())))];
    ++calls_;
  }
  nlohmann::json Json() const {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [code, n] : counts_) j[code] = n;
    return j;
  }
  uint64_t calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> counts_;
  uint64_t calls_ = 0;
};

// The attacker's raw calls, each with its token and a deadline.
class Attacker {
 public:
  explicit Attacker(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub_(v1::Optimizer::NewStub(channel_)) {}
  std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kAttackerToken));
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    return ctx;
  }
  v1::Optimizer::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  // CreateJob, remembering what it made, for the clean-up after the attack.
  grpc::Status Create(const v1::CreateJobRequest& request);
  std::vector<std::string> jobs() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::string> jobs_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
};

struct Attack {
  const char* name;
  std::function<void(Attacker&, Answers&, AbuseClock::time_point until)> run;
};
// The six of the review, in its order, and the packed flood after the
// no_grad one (bench/abuse_attacks.cc).
const std::vector<Attack>& Attacks();

}  // namespace shardopt::bench
