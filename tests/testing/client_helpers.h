// What the integration tests build their clients and jobs from: a job of one
// tensor "w" in one default group, and a client of one server that tries
// each call once (a test wants the server's first answer, not a retry's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "shardopt/client.h"

namespace shardopt::testing {

inline JobOptions OneTensorJob(const std::string& name, uint64_t numel, uint32_t world_size = 1) {
  JobOptions job;
  job.name = name;
  job.world_size = world_size;
  job.groups = {GroupOptions{}};
  job.tensors = {{"w", numel, 0}};
  job.barrier_timeout_ms = 10000;
  return job;
}

// `token` empty: none.
inline std::unique_ptr<Client> ConnectOnce(const std::string& address, const std::string& token = "",
                                           uint32_t rank = 0) {
  ClientOptions o;
  o.servers = {address};
  o.token = token;
  o.rank = rank;
  o.max_attempts = 1;
  o.rpc_timeout_ms = 20000;
  return Client::Connect(o).value();
}

// The parts of the client's job still without initial values, over all its
// servers (Describe's uninitialized_tensors); a failed Describe fails the test.
inline uint32_t UninitializedParts(Client& client) {
  auto described = client.Describe();
  EXPECT_TRUE(described.ok()) << described.status();
  uint32_t n = 0;
  if (described.ok()) {
    for (const ServerState& s : *described) n += s.uninitialized_tensors;
  }
  return n;
}

}  // namespace shardopt::testing
