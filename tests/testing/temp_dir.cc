#include "tests/testing/temp_dir.h"

#include <stdlib.h>

#include <filesystem>

namespace shardopt::testing {

TempDir::TempDir() {
  char tmpl[] = "/tmp/shardopt-ckpt-XXXXXX";
  path_ = mkdtemp(tmpl);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace shardopt::testing
