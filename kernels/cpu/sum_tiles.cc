#include "kernels/cpu/sum_tiles.h"

#include <algorithm>
#include <cstring>

namespace shardopt::cpu {

SumTiles::SumTiles(uint64_t numel, char* slot, const LoopTable* loops)
    : numel_(numel), slot_(slot), loops_(loops), bf16_((numel + kTile - 1) / kTile, 0),
      summed_(bf16_.size(), 0), sumsq_(bf16_.size(), 0) {}

uint64_t SumTiles::BookkeepingBytes(uint64_t numel) { return (numel + kTile - 1) / kTile * (2 + sizeof(double)); }

uint64_t SumTiles::Length(uint64_t t) const { return std::min(kTile, numel_ - t * kTile); }

void SumTiles::Fold(uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs, bool first) {
  uint64_t at = offset;
  for (absl::string_view run : runs) {
    const char* src = run.data();
    for (uint64_t n = run.size() / DTypeSize(dtype); n > 0;) {
      const uint64_t t = at / kTile;
      const uint64_t take = std::min(n, (t + 1) * kTile - at);
      FoldTile(t, at, dtype, src, take, first);
      src += take * DTypeSize(dtype);
      at += take;
      n -= take;
    }
  }
}

void SumTiles::FoldTile(uint64_t t, uint64_t at, DType dtype, const char* src, uint64_t n, bool first) {
  summed_[t] = 0;
  if (first && dtype == DType::kBf16) {
    bf16_[t] = 1;
    std::memcpy(Room(t) + (at - t * kTile) * 2, src, n * 2);
    return;
  }
  if (bf16_[t]) {
    if (!first) {  // a second rank: the first one's values widened, in place
      alignas(64) uint16_t held[kTile];
      std::memcpy(held, Room(t), Length(t) * 2);
      loops_->accumulate(reinterpret_cast<float*>(Room(t)), held, DType::kBf16, Length(t), true);
    }
    bf16_[t] = 0;
  }
  loops_->accumulate(reinterpret_cast<float*>(slot_) + at, src, dtype, n, first);
}

void SumTiles::Done(uint64_t offset, uint64_t count) {
  for (uint64_t t = offset / kTile; t * kTile < offset + count; ++t) {
    sumsq_[t] = Tree(t);
    summed_[t] = 1;
  }
}

void SumTiles::Forget(uint64_t offset, uint64_t count) {
  if (count == 0) return;
  for (uint64_t t = offset / kTile; t <= (offset + count - 1) / kTile; ++t) {
    bf16_[t] = 0;
    summed_[t] = 0;
  }
}

double SumTiles::Sumsq(uint64_t t) const { return summed_[t] ? sumsq_[t] : Tree(t); }

double SumTiles::Tree(uint64_t t) const {
  if (bf16_[t]) return loops_->sumsq_block_bf16(reinterpret_cast<const uint16_t*>(Room(t)), Length(t));
  return loops_->sumsq_block(reinterpret_cast<const float*>(Room(t)), Length(t));
}

const void* SumTiles::Grad(uint64_t t, DType* dtype) const {
  *dtype = bf16_[t] ? DType::kBf16 : DType::kFp32;
  return Room(t);
}

}  // namespace shardopt::cpu
