// Helpers shared by the tests that run a program (offloadctl, a rank program) as a user would:
// run a shell command capturing its stdout and exit code, and parse JSON output without throwing.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace strata::testing {

struct ProcessResult {
  int exit_code = -1;  // -1: popen failed or the command did not exit normally (signal)
  std::string out;     // what the command wrote to stdout (callers redirect stderr as they need)
};

// Runs `cmd` through /bin/sh (popen) and waits for it. Fails the test if popen fails.
inline ProcessResult RunShell(const std::string& cmd) {
  ProcessResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << "popen: " << cmd;
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Parses `text` as JSON; on a parse error fails the test (printing the text) and returns a
// discarded value (is_discarded() is true).
inline nlohmann::json ParseJson(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON:\n" << text;
  return j;
}

}  // namespace strata::testing
