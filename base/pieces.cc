#include "base/pieces.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace shardopt {

Pieces::Pieces(std::vector<absl::string_view> pieces, std::shared_ptr<const void> owner) {
  auto list = std::make_shared<List>();
  uint64_t at = 0;
  for (absl::string_view p : pieces) {
    if (p.empty()) continue;  // so that PieceAt never lands on an empty piece
    list->pieces.push_back(p);
    list->starts.push_back(at);
    at += p.size();
  }
  list->owner = std::move(owner);
  list_ = std::move(list);
  size_ = at;
}

Pieces Pieces::Own(std::string bytes) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  return Pieces({absl::string_view(*owned)}, owned);
}

const std::shared_ptr<const void>& Pieces::owner() const {
  static const std::shared_ptr<const void> kNone;
  return list_ ? list_->owner : kNone;
}

Pieces Pieces::Sub(uint64_t begin, uint64_t n) const {
  Pieces sub = *this;
  sub.begin_ = begin_ + begin;
  sub.size_ = n;
  return sub;
}

size_t Pieces::PieceAt(uint64_t at) const {
  const std::vector<uint64_t>& starts = list_->starts;
  return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin()) - 1;
}

void Pieces::CopyTo(char* dst) const {
  ForEachPart([&](const char* p, uint64_t n) {
    std::memcpy(dst, p, n);
    dst += n;
  });
}

void Pieces::Runs(uint64_t unit, std::vector<absl::string_view>* runs, std::string* scratch) const {
  runs->clear();
  scratch->clear();
  // At most one split element per boundary between pieces: reserved up
  // front, so the runs that point into `scratch` stay valid as it grows.
  size_t parts = 0;
  ForEachPart([&](const char*, uint64_t) { ++parts; });
  scratch->reserve(parts * unit);
  uint64_t carried = 0;  // bytes of a split element already in scratch
  ForEachPart([&](const char* p, uint64_t n) {
    if (carried > 0) {
      const uint64_t take = std::min(unit - carried, n);
      scratch->append(p, take);
      carried += take;
      p += take;
      n -= take;
      if (carried < unit) return;
      runs->emplace_back(scratch->data() + scratch->size() - unit, unit);
      carried = 0;
    }
    const uint64_t whole = n / unit * unit;
    if (whole > 0) runs->emplace_back(p, whole);
    if (n > whole) {
      scratch->append(p + whole, n - whole);
      carried = n - whole;
    }
  });
}

Pieces::Cursor::Cursor(const Pieces& pieces)
    : pieces_(pieces), at_(pieces.begin_), piece_(pieces.size_ > 0 ? pieces.PieceAt(pieces.begin_) : 0) {}

bool Pieces::Cursor::Next(uint8_t* byte) {
  if (at_ >= pieces_.begin_ + pieces_.size_) return false;
  const List& list = *pieces_.list_;
  while (at_ >= list.starts[piece_] + list.pieces[piece_].size()) ++piece_;
  *byte = static_cast<uint8_t>(list.pieces[piece_][at_ - list.starts[piece_]]);
  ++at_;
  return true;
}

bool Pieces::Cursor::Skip(uint64_t n) {
  const uint64_t end = pieces_.begin_ + pieces_.size_;
  if (n > end - at_) {
    at_ = end;
    return false;
  }
  at_ += n;
  if (at_ < end) piece_ = pieces_.PieceAt(at_);
  return true;
}

}  // namespace shardopt
