// What the integration tests build their clients and jobs from: a job of one
// tensor "w" in one default group, and a client of one server that tries
// each call once (a test wants the server's first answer, not a retry's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

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

}  // namespace shardopt::testing
