#include "server/stream_limits.h"

#include "absl/strings/str_cat.h"

namespace shardopt {

StreamLimits::Slot::~Slot() { limits_->Close(client_); }

absl::StatusOr<std::unique_ptr<StreamLimits::Slot>> StreamLimits::Open(const std::string& client) {
  absl::MutexLock lock(&mu_);
  if (max_ > 0 && open_ >= max_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this server has ", open_, " streams open, its cap (--max_streams); try again later"));
  }
  auto it = per_client_.find(client);
  const uint32_t mine = it == per_client_.end() ? 0 : it->second;
  if (max_per_client_ > 0 && mine >= max_per_client_) {
    return absl::ResourceExhaustedError(absl::StrCat("client '", client, "' has ", mine,
                                                     " streams open, the cap per client (--max_streams_per_client)"));
  }
  ++per_client_[client];
  ++open_;
  return std::unique_ptr<Slot>(new Slot(this, client));
}

void StreamLimits::Close(const std::string& client) {
  absl::MutexLock lock(&mu_);
  --open_;
  if (auto it = per_client_.find(client); it != per_client_.end() && --it->second == 0) per_client_.erase(it);
}

void StreamLimits::Strike(const std::string& client) {
  const auto now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  if (strikes_.size() > 10000) strikes_.clear();  // names a client invents must not grow without end
  Strikes& s = strikes_[client];
  if (now - s.second >= std::chrono::seconds(1)) {
    s.second = now;
    s.count = 0;
  }
  if (++s.count > kStrikesPerSecond) s.until = now + std::chrono::seconds(1);
}

std::chrono::steady_clock::duration StreamLimits::Penalty(const std::string& client) const {
  const auto now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  auto it = strikes_.find(client);
  if (it == strikes_.end() || it->second.until <= now) return std::chrono::steady_clock::duration::zero();
  return it->second.until - now;
}

uint32_t StreamLimits::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

}  // namespace shardopt
