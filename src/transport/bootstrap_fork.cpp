// Fork launcher: the parent creates a full mesh of socketpairs, forks one child per rank and reaps them with a
// deadline (children still running then are killed), so a test or tool built on it can never hang.
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "flatep/ipc.hpp"
#include "transport/bootstrap_mesh.hpp"

namespace flatep::transport {

namespace {

[[noreturn]] void run_child(int rank, int num_ranks, std::vector<std::array<int, 2>>& pairs, double timeout_s,
                            const std::function<int(int, std::shared_ptr<Bootstrap>)>& fn) {
    int code = kForkExitError;
    try {
        std::vector<ipc::Fd> sockets(num_ranks);
        for (int i = 0; i < num_ranks; ++i) {
            for (int j = i + 1; j < num_ranks; ++j) {
                std::array<int, 2>& pair = pairs[i * num_ranks + j];
                if (i == rank) {
                    sockets[j].reset(pair[0]);
                    ipc::close_quietly(pair[1]);
                } else if (j == rank) {
                    sockets[i].reset(pair[1]);
                    ipc::close_quietly(pair[0]);
                } else {
                    ipc::close_quietly(pair[0]);
                    ipc::close_quietly(pair[1]);
                }
            }
        }
        auto bootstrap = std::make_shared<MeshBootstrap>(rank, num_ranks, std::move(sockets), timeout_s, "fork");
        code = fn(rank, bootstrap);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "flatep rank %d (pid %d): %s\n", rank, static_cast<int>(::getpid()), e.what());
        code = kForkExitError;
    } catch (...) {
        std::fprintf(stderr, "flatep rank %d (pid %d): unknown exception\n", rank, static_cast<int>(::getpid()));
        code = kForkExitError;
    }
    std::fflush(nullptr);
    ::_exit(code & 0xff);
}

int exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
}

}  // namespace

}  // namespace flatep::transport

namespace flatep {

std::vector<int> run_forked(int num_ranks, const std::function<int(int rank, std::shared_ptr<Bootstrap>)>& fn,
                            const ForkOptions& options) {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "run_forked: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks);
    FLATEP_CHECK(static_cast<bool>(fn), "run_forked: fn is empty");
    const double timeout_s = env::resolve_timeout("run_forked", options.timeout_s);
    const double deadline_s = options.deadline_s == 0
                                  ? 3 * timeout_s + 10
                                  : env::check_timeout("run_forked", "deadline_s", options.deadline_s);

    std::vector<std::array<int, 2>> pairs(num_ranks * num_ranks, std::array<int, 2>{-1, -1});
    auto close_pairs = [&] {
        for (std::array<int, 2>& pair : pairs) {
            transport::ipc::close_quietly(pair[0]);
            transport::ipc::close_quietly(pair[1]);
            pair = {-1, -1};
        }
    };
    for (int i = 0; i < num_ranks; ++i) {
        for (int j = i + 1; j < num_ranks; ++j) {
            if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pairs[i * num_ranks + j].data()) !=
                0) {
                const std::string text = detail::errno_text();
                close_pairs();
                FLATEP_THROW(ErrorCategory::kRuntime, "run_forked: socketpair for ranks ", i, " and ", j,
                             " failed: ", text);
            }
        }
    }

    std::fflush(nullptr);  // buffered output would otherwise be written once per child
    std::vector<pid_t> pids(num_ranks, -1);
    for (int r = 0; r < num_ranks; ++r) {
        const pid_t pid = ::fork();
        if (pid == 0) transport::run_child(r, num_ranks, pairs, timeout_s, fn);
        if (pid < 0) {
            const std::string text = detail::errno_text();
            for (int q = 0; q < r; ++q) ::kill(pids[q], SIGKILL);
            for (int q = 0; q < r; ++q) ::waitpid(pids[q], nullptr, 0);
            close_pairs();
            FLATEP_THROW(ErrorCategory::kRuntime, "run_forked: fork of rank ", r, " failed: ", text);
        }
        pids[r] = pid;
    }
    close_pairs();

    std::vector<int> codes(num_ranks, -1);
    int num_running = num_ranks;
    const auto deadline = transport::ipc::deadline_after(deadline_s);
    while (num_running > 0 && transport::ipc::Clock::now() < deadline) {
        for (int r = 0; r < num_ranks; ++r) {
            if (pids[r] < 0) continue;
            int status = 0;
            if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
                codes[r] = transport::exit_code(status);
                pids[r] = -1;
                --num_running;
            }
        }
        if (num_running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (int r = 0; r < num_ranks; ++r) {
        if (pids[r] < 0) continue;
        FLATEP_LOG_WARN("run_forked: rank ", r, " (pid ", pids[r], ") still running after ", deadline_s,
                        " s: killing it");
        ::kill(pids[r], SIGKILL);
        int status = 0;
        if (::waitpid(pids[r], &status, 0) == pids[r]) codes[r] = transport::exit_code(status);
    }
    return codes;
}

}  // namespace flatep
