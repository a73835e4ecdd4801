#include "support/run_cmd.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

extern char** environ;

namespace kvq::test {

static std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

cmd_result run_cmd(const std::vector<std::string>& argv) {
  cmd_result r;
  char out_tpl[] = "/tmp/kvq_cmd_out_XXXXXX", err_tpl[] = "/tmp/kvq_cmd_err_XXXXXX";
  const int fo = mkstemp(out_tpl), fe = mkstemp(err_tpl);
  if (fo < 0 || fe < 0) return r;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fo, 1);
  posix_spawn_file_actions_adddup2(&fa, fe, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ) == 0) {
    int st = 0;
    waitpid(pid, &st, 0);
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  posix_spawn_file_actions_destroy(&fa);
  close(fo);
  close(fe);
  r.out = slurp(out_tpl);
  r.err = slurp(err_tpl);
  std::remove(out_tpl);
  std::remove(err_tpl);
  return r;
}

}  // namespace kvq::test
