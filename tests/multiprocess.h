#pragma once
// Runs a test body on `world_size` real processes (fork) that talk over loopback: each child gets
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, as torchrun would
// set them, runs body(rank) and exits 0 only if it raised no test failure. Only a test binary
// labelled "processes" or "convergence" may start ranks (tests/CMakeLists.txt defines
// ZB_TESTS_START_PROCESSES for those): elsewhere the test fails, so that a test that starts
// processes cannot run under the "unit" label.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <ATen/Parallel.h>

namespace zb::multiprocess {

// A port for the ranks' store, free now: at random below the kernel's ephemeral range (32768 and
// up, where connections' own ports and port-0 binds come from, so that none of those can take it
// before rank 0 binds it), as tests/e2e/conftest.py's free_port.
inline int free_port() {
  static std::mt19937 pick(std::random_device{}());
  for (;;) {
    const int port = std::uniform_int_distribution<int>(20000, 32767)(pick);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (free) return port;
  }
}

inline void run_ranks(int world_size, const std::function<void(int rank)>& body) {
#ifndef ZB_TESTS_START_PROCESSES
  ADD_FAILURE() << "this test starts " << world_size << " processes: its file belongs to a test binary labelled "
                << "processes (tests/CMakeLists.txt), not to the unit tests";
  return;
#endif
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> children;
  for (int rank = 0; rank < world_size; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      at::set_num_threads(1);  // 2 cores shared by several ranks
      int code = 0;
      try {
        body(rank);
        code = ::testing::Test::HasFailure() ? 1 : 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = 2;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    children.push_back(pid);
  }
  for (int rank = 0; rank < world_size; ++rank) {
    int status = 0;
    ::waitpid(children[rank], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " of " << world_size << " failed (status " << status << ")";
  }
}

}  // namespace zb::multiprocess
