// What the command lines of shardopt's binaries (shardopt-server, shardopt,
// shardopt-bench, demo_trainer) share: absl flags, parsed one way.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace shardopt {

// Parses argv's flags (defined with ABSL_FLAG) and returns the positional
// arguments, without argv[0]. `usage` heads --help's output.
//   --help, --helpshort, --helpfull, ...: print `usage` and the flags to
//     stdout and exit 0; --help lists every flag the binary defines, not only
//     those of a file named after the program, absl's default.
//   --version: prints "shardopt X.Y.Z", the version of CMake's
//     project(VERSION), and exits 0.
//   an unknown flag, a flag without a value, a value that does not parse:
//     absl's message on stderr, and exit 2.
std::vector<std::string> ParseFlags(int argc, char** argv, absl::string_view usage);

// A bad argument found after parsing: prints "PROGRAM: message" and where to
// find the usage on stderr, and exits 2.
[[noreturn]] void UsageError(absl::string_view message);

// "X.Y.Z", CMake's project(VERSION).
std::string Version();

}  // namespace shardopt
