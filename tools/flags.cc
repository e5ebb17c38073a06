#include "tools/flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace {
std::string& ProgramName() {
  static std::string* name = new std::string("shardopt");  // never destroyed: read while exiting
  return *name;
}
}  // namespace

// absl calls this after printing a fatal usage error ("ERROR: Unknown command
// line flag 'x'"), and then exits 1. Exiting here first gives a bad flag the
// exit status of every other bad argument, 2. It is absl's declared hook for
// this (usage_config.h), defined weak in absl.
extern "C" void ABSL_INTERNAL_C_SYMBOL(AbslInternalReportFatalUsageError)(absl::string_view) {
  std::cerr << "Try '" << ProgramName() << " --help'." << std::endl;
  std::exit(2);
}

namespace shardopt {

std::string Version() { return SHARDOPT_VERSION; }

namespace {
bool IsNegativeNumber(absl::string_view arg) {
  return arg.size() > 1 && arg[0] == '-' && absl::ascii_isdigit(static_cast<unsigned char>(arg[1]));
}
}  // namespace

std::vector<std::string> ParseFlags(int argc, char** argv, absl::string_view usage) {
  if (argc > 0) {
    const absl::string_view path = argv[0];
    ProgramName() = std::string(path.substr(path.rfind('/') + 1));  // npos + 1 == 0: no directory
  }
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  // A binary's own flags are the ones not defined by Abseil (--flagfile,
  // --fromenv, ...); those stay for --helpfull.
  const auto own = [](absl::string_view file) { return !absl::StrContains(file, "absl/"); };
  config.contains_help_flags = own;
  config.contains_helpshort_flags = own;
  config.version_string = [] { return absl::StrCat("shardopt ", Version(), "\n"); };
  // Files as the source tree names them ("server/main.cc"), whether the
  // compiler got an absolute path or one relative to the build directory (as
  // ccache's CCACHE_BASEDIR rewrites it).
  config.normalize_filename = [](absl::string_view file) {
    absl::ConsumePrefix(&file, SHARDOPT_SOURCE_DIR "/");
    while (absl::ConsumePrefix(&file, "../") || absl::ConsumePrefix(&file, "./")) {
    }
    return std::string(file);
  };
  absl::SetFlagsUsageConfig(config);

  // absl::ParseCommandLine exits 1 after printing --help, but help that was
  // asked for is a success. So the usage flags are handled here, through the
  // internal functions ParseCommandLine itself calls (absl 20220623, Debian
  // 12's, the version scripts/install-deps.sh pins).
  //
  // Abseil reads "-1" as a flag named 1, where a command's argument is a
  // negative number ("Unknown command line flag '1'"). No flag's name starts
  // with a digit, so such an argument is hidden from the parser as an empty
  // string, which no flag is either, and put back among the positionals.
  // Not one that follows a flag without '=': that may be the flag's value
  // ("--timeout_s -5"), which the parser must see.
  std::vector<char*> hidden(argv, argv + argc);
  std::vector<char*> negatives;
  static char kNegative[] = "";
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    const absl::string_view before = argv[i - 1];
    const bool may_be_a_value = i > 1 && absl::StartsWith(before, "-") && before != "--" &&
                                !absl::StrContains(before, '=') && !IsNegativeNumber(before);
    if (IsNegativeNumber(arg) && !may_be_a_value) {
      negatives.push_back(argv[i]);
      hidden[i] = kNegative;
    }
  }
  const std::vector<char*> args = absl::flags_internal::ParseCommandLineImpl(
      argc, hidden.data(), absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage, absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) {
    std::cout.flush();
    std::exit(0);
  }
  // A --flagfile saved with Windows line ends gives each value a trailing
  // carriage return, which no message shows ("must be cpu ...; got 'cpu'");
  // a line with a trailing blank gives it that blank, which a path keeps
  // (a checkpoint directory "ck " made beside "ck") and an address does not
  // show ("cannot listen on 127.0.0.1 :0"). No flag means either.
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string value = flag->CurrentValue();
    if (absl::StrContains(value, '\r')) {
      UsageError(absl::StrCat("--", name, "'s value holds a carriage return (\\r): a --flagfile with Windows line "
                              "ends (CRLF)? Save it with Unix ones (LF)"));
    }
    if (!value.empty() && (absl::ascii_isblank(value.front()) || absl::ascii_isblank(value.back()))) {
      UsageError(absl::StrCat("--", name, "'s value '", value, "' ", absl::ascii_isblank(value.back()) ? "ends" : "begins",
                              " with a blank (a --flagfile line with a trailing space?); remove it"));
    }
  }
  std::vector<std::string> positionals;
  auto next_negative = negatives.begin();
  for (auto it = args.begin() + 1; it != args.end(); ++it) {  // args[0] is argv[0]
    positionals.emplace_back(*it == kNegative ? *next_negative++ : *it);
  }
  return positionals;
}

void UsageError(absl::string_view message) {
  std::cerr << ProgramName() << ": " << message << "\nTry '" << ProgramName() << " --help'." << std::endl;
  std::exit(2);
}

}  // namespace shardopt
