// Runs a program (no shell) and captures its exit code, stdout and stderr; used by CLI tests.
#pragma once
#include <string>
#include <vector>

namespace kvq::test {

struct cmd_result {
  int rc = -1;  // exit status, or 128 + signal when killed by a signal
  std::string out, err;
};

cmd_result run_cmd(const std::vector<std::string>& argv);

}  // namespace kvq::test
