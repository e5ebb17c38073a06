// A directory of a test's own under /tmp, removed with everything in it
// when the object goes.
#pragma once

#include <string>

namespace shardopt::testing {

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace shardopt::testing
