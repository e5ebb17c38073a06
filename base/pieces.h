// Bytes in pieces, viewed where they lie and kept alive by an owner: the
// slices of a received gRPC message, so that a gradient chunk goes from the
// transport's buffers straight into the reduction, and a backend's params,
// so that a commit sends them without copying them (docs/design.md, section
// 10.2). No gRPC here: the kernels, the protocol core and both edges use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace shardopt {

// An immutable view of [begin, begin + size) of a list of pieces, which
// `owner` keeps alive. Copies share the list and the owner; Sub is O(1).
class Pieces {
 public:
  Pieces() = default;
  // `owner` keeps the memory the pieces point into alive.
  Pieces(std::vector<absl::string_view> pieces, std::shared_ptr<const void> owner);
  // One piece that owns its bytes.
  static Pieces Own(std::string bytes);

  uint64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // [begin, begin + n) of this view; the caller keeps it inside size().
  Pieces Sub(uint64_t begin, uint64_t n) const;
  // Copies the view's bytes to `dst` (size() bytes).
  void CopyTo(char* dst) const;
  // Calls fn(const char*, uint64_t) for each contiguous part of the view.
  template <typename Fn>
  void ForEachPart(Fn fn) const;
  // What keeps the bytes alive.
  const std::shared_ptr<const void>& owner() const;
  // The view as runs of whole `unit`-byte elements, in order: each run is a
  // pointer into a piece (not aligned to anything) or, for an element split
  // between two pieces, into `scratch`, which must outlive the runs. size()
  // must be a multiple of `unit`.
  void Runs(uint64_t unit, std::vector<absl::string_view>* runs, std::string* scratch) const;

  // Reads the view front to back, a byte at a time or skipping ahead.
  class Cursor {
   public:
    explicit Cursor(const Pieces& pieces);
    uint64_t position() const { return at_ - pieces_.begin_; }
    // False at the view's end.
    bool Next(uint8_t* byte);
    // False, at the end, if fewer than n bytes are left.
    bool Skip(uint64_t n);

   private:
    const Pieces& pieces_;
    uint64_t at_;   // in the list's bytes
    size_t piece_;  // the piece holding at_, while at_ is inside the view
  };

 private:
  struct List {
    std::vector<absl::string_view> pieces;
    std::vector<uint64_t> starts;  // [i]: where piece i begins, in the list's bytes
    std::shared_ptr<const void> owner;
  };
  // The index of the piece holding byte `at` of the list.
  size_t PieceAt(uint64_t at) const;

  std::shared_ptr<const List> list_;
  uint64_t begin_ = 0;
  uint64_t size_ = 0;
};

template <typename Fn>
void Pieces::ForEachPart(Fn fn) const {
  if (size_ == 0) return;
  uint64_t at = begin_;
  const uint64_t end = begin_ + size_;
  for (size_t i = PieceAt(at); at < end; ++i) {
    const absl::string_view p = list_->pieces[i];
    const uint64_t skip = at - list_->starts[i];
    const uint64_t n = std::min<uint64_t>(p.size() - skip, end - at);
    fn(p.data() + skip, n);
    at += n;
  }
}

}  // namespace shardopt
