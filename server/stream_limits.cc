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

uint32_t StreamLimits::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

}  // namespace shardopt
