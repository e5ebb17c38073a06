// --device selection: auto, cpu, cuda, cuda:N.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace shardopt {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, int cpu_threads);

}  // namespace shardopt
