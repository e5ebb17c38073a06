#include "client/fanout.h"

namespace shardopt::fanout {

thread_local Fanout* current = nullptr;

bool Fanout::Register(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return false;
  active_.push_back(ctx);
  return true;
}

void Fanout::Unregister(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  active_.erase(std::find(active_.begin(), active_.end(), ctx));
}

void Fanout::Fail() {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = true;
  for (grpc::ClientContext* ctx : active_) ctx->TryCancel();
}

void AwaitChannel(grpc::Channel* channel, std::chrono::milliseconds pause) {
  if (pause.count() <= 0) return;
  const auto until = std::chrono::system_clock::now() + pause;
  if (channel->GetState(false) == GRPC_CHANNEL_READY) {
    std::this_thread::sleep_until(until);  // the server answered: give it the whole pause
    return;
  }
  channel->WaitForConnected(until);
}

}  // namespace shardopt::fanout
