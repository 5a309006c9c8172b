// The crash-leftover report that every offloadctl command writing to an nvme_path (or to a temp
// directory of its own) prints before it starts. Implemented in cmd_clean.cc, next to the
// `offloadctl clean` command it points to.
#pragma once

#include <string>
#include <vector>

namespace strata::cli {

// Scans each directory, and strata's per-run directories in it (nvme/leftovers.h), and when runs
// of any strata command that did not end cleanly left files there, says on stderr which, their
// sizes, and the `offloadctl clean --nvme-path DIR` command that removes them. Also names files
// under strata's names that are not strata's (left alone). Silent when there is nothing to say; a
// directory that cannot be read is left for the command itself to report.
void ReportLeftovers(const std::vector<std::string>& dirs);

// `s` quoted for a POSIX shell when it needs quoting (so a printed command can be pasted).
std::string ShellQuote(const std::string& s);

}  // namespace strata::cli
