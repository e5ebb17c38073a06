#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "shardopt/client.h"

namespace shardopt {

namespace {
constexpr uint64_t kAlign = 4096;
uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
}  // namespace

std::vector<uint64_t> FlatOffsets(absl::Span<const TensorOptions> tensors) {
  // Each tensor starts 4096-aligned in the flat space, so a boundary there is
  // also 4096-aligned inside the tensor.
  std::vector<uint64_t> start(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) start[i + 1] = RoundUp(start[i] + tensors[i].numel, kAlign);
  return start;
}

std::vector<uint64_t> ServerBounds(absl::Span<const TensorOptions> tensors, uint32_t servers) {
  // Server s owns the blocks [s*B/S, (s+1)*B/S) of the B 4096-element
  // blocks: shares differ by at most one block, and no server is left empty
  // while another holds two or more blocks.
  if (servers == 0) return {};
  const uint64_t blocks = FlatOffsets(tensors).back() / kAlign;
  std::vector<uint64_t> bounds(uint64_t{servers} + 1);
  for (uint64_t s = 0; s <= servers; ++s) {  // (a uint32_t s would never pass UINT32_MAX)
    bounds[s] = static_cast<uint64_t>(static_cast<unsigned __int128>(s) * blocks / servers) * kAlign;
  }
  return bounds;
}

std::vector<ShardPlacement> PlaceTensors(absl::Span<const TensorOptions> tensors, uint32_t servers) {
  std::vector<ShardPlacement> out;
  if (servers == 0) return out;
  const std::vector<uint64_t> start = FlatOffsets(tensors);
  const std::vector<uint64_t> bounds = ServerBounds(tensors, servers);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t begin = start[i];
    const uint64_t end = begin + tensors[i].numel;
    uint32_t server = 0;
    for (uint64_t pos = begin; pos < end;) {
      // Bounded both ways for a flat space that wrapped (numel past what a
      // job may hold): no server past the last, no piece that ends before
      // it begins.
      while (server + 1 < servers && bounds[server + 1] <= pos) ++server;
      const uint64_t server_end = std::min(end, bounds[server + 1]);
      if (server_end <= pos) break;
      out.push_back({server, tensors[i].name, pos - begin, server_end - pos});
      pos = server_end;
    }
  }
  return out;
}

PushResult CombinePartials(std::vector<PushPartial> partials) {
  PushResult result;
  for (const PushPartial& p : partials) {
    result.sum_squares += p.sum_squares;
    result.nonfinite = result.nonfinite || p.nonfinite;
  }
  result.partials = std::move(partials);
  return result;
}

absl::StatusOr<std::vector<std::string>> ExpandServerPattern(const std::string& pattern, uint32_t count) {
  constexpr uint32_t kMaxServers = 65536;
  const size_t at = pattern.find("{i}");
  if (at == std::string::npos || pattern.find("{i}", at + 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("server pattern '", pattern, "' must hold \"{i}\" exactly once"));
  }
  const size_t colon = pattern.rfind(':');
  // Digits only: SimpleAtoi also takes "+80" and surrounding spaces, which
  // would make addresses gRPC cannot resolve.
  const std::string digits = colon == std::string::npos ? "" : pattern.substr(colon + 1);
  uint32_t port = 0;
  if (colon == std::string::npos || colon < at || digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) || !absl::SimpleAtoi(digits, &port) ||
      port == 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("server pattern '", pattern, "' must end in :PORT, PORT in [1, 65535]"));
  }
  if (count == 0 || count > kMaxServers) {
    return absl::InvalidArgumentError(absl::StrCat("server count must be in [1, ", kMaxServers, "], got ", count));
  }
  std::vector<std::string> out;
  for (uint32_t i = 0; i < count; ++i) {
    out.push_back(absl::StrCat(pattern.substr(0, at), i, pattern.substr(at + 3)));
  }
  return out;
}

uint64_t Trainers(const JobOptions& job) {
  return uint64_t{job.world_size} * std::max(job.trainers_per_rank, uint32_t{1});
}

Decision Decide(const PushResult& push, uint64_t trainers, const StepOptions& options) {
  Decision d;
  const double average_scale = options.loss_scale * static_cast<double>(trainers);
  const auto skip = [&] {
    d.skip = true;
    d.clip_factor = 1;
    d.gscale = static_cast<float>(1.0 / average_scale);
    return d;
  };
  d.grad_norm = std::sqrt(push.sum_squares) / average_scale;
  if (push.nonfinite || !std::isfinite(d.grad_norm)) return skip();
  if (options.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_'s rule.
    d.clip_factor = std::min(1.0, options.max_grad_norm / (d.grad_norm + 1e-6));
  }
  d.gscale = static_cast<float>(d.clip_factor / average_scale);
  // A gscale above 1 (loss_scale x trainers below the clip factor) scales
  // the gradients up, and a finite one could overflow in the kernel's
  // grad * gscale and make its master NaN for good; torch's GradScaler,
  // which looks for infs after unscaling, skips such a step. No element
  // exceeds the norm, so a norm that stays within fp32 once scaled overflows
  // nowhere; past it, a step may be skipped where no element would have
  // overflowed (the servers report sums of squares, not maxima).
  if (d.gscale > 1 && std::sqrt(push.sum_squares) * d.gscale > std::numeric_limits<float>::max()) return skip();
  return d;
}

}  // namespace shardopt
