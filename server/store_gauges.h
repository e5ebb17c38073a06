// The gauges a scrape of /metrics reads from a server's store at that
// moment (metrics.h's Registry::SetGauges): its jobs, memory and tenants.
#pragma once

#include <string>
#include <vector>

#include "kernels/backend.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/metrics.h"

namespace shardopt {

// `device` is the backend's description (shardopt_build_info's label),
// `open_streams` the service's count of them now, and `auth` the server's
// tokens (null: none).
std::vector<metrics::Gauge> StoreGauges(JobStore& store, const Backend& backend, const std::string& device,
                                        uint32_t open_streams, const Authenticator* auth);

}  // namespace shardopt
