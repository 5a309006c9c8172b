// Helpers for the tests of files strata finds in an nvme_path (file_hardening_test,
// clean_cli_test): planting files, another user to own them, a pid that is not running.
#pragma once

#include <pwd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace strata::testing {

// Creates (or truncates) `path` holding `bytes` bytes.
inline void WriteFile(const std::string& path, size_t bytes = 0) {
  std::ofstream(path, std::ios::binary) << std::string(bytes, 'x');
}

// The uid of `nobody` when this process may give files away (root); -1 otherwise.
inline int NobodyUid() {
  if (geteuid() != 0) return -1;
  const passwd* pw = getpwnam("nobody");
  return pw != nullptr ? static_cast<int>(pw->pw_uid) : 65534;
}

// A pid that is not running: a child that has exited and been reaped.
inline pid_t DeadPid() {
  const pid_t pid = fork();
  if (pid == 0) std::_Exit(0);
  int status = 0;
  waitpid(pid, &status, 0);
  return pid;
}

}  // namespace strata::testing
