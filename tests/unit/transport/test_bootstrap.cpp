// Bootstraps of the multi-process world: the fork launcher (socketpair mesh) and the socket rendezvous.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "common/check.hpp"
#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/ipc_socket.hpp"
#include "unit/transport/test_ipc_util.hpp"

namespace flatep {
namespace {

namespace ipc = transport::ipc;

using test::expect_timeout_naming;
using test::Failure;
using test::seconds_since;
using test::victim;
using Clock = std::chrono::steady_clock;

// Rank r's blob in round `round`: sizes differ per rank, and one round sends 1 MiB (more than a socket buffer) so
// that every rank is sending and receiving at once.
std::string blob_of(int rank, int round) {
    const size_t num_bytes = round == 1 ? (1u << 20) + 7 * rank : static_cast<size_t>(3 * rank + round);
    std::string blob(num_bytes, '\0');
    for (size_t i = 0; i < num_bytes; ++i) blob[i] = static_cast<char>((i * 31 + rank * 7 + round) & 0xff);
    return blob;
}

int check_all_gather(int rank, Bootstrap& bootstrap, int num_ranks) {
    CHILD_CHECK(bootstrap.rank() == rank && bootstrap.size() == num_ranks, "rank/size ", bootstrap.rank(), "/",
                bootstrap.size());
    for (int round = 0; round < 3; ++round) {
        const std::vector<std::string> all = bootstrap.all_gather(blob_of(rank, round));
        CHILD_CHECK(static_cast<int>(all.size()) == num_ranks, "got ", all.size(), " blobs");
        for (int r = 0; r < num_ranks; ++r)
            CHILD_CHECK(all[r] == blob_of(r, round), "round ", round, " blob of rank ", r);
    }
    return 0;
}

class ForkAllGather : public ::testing::TestWithParam<int> {};

TEST_P(ForkAllGather, EveryRankGetsEveryBlobInRankOrder) {
    const int num_ranks = GetParam();
    const std::vector<int> codes = run_forked(
        num_ranks, [&](int rank, std::shared_ptr<Bootstrap> boot) { return check_all_gather(rank, *boot, num_ranks); },
        ForkOptions{10.0, 60.0});
    EXPECT_EQ(codes, std::vector<int>(num_ranks, 0))
        << "repro: flatep_transport_tests --gtest_filter='*ForkAllGather*'";
}

INSTANTIATE_TEST_SUITE_P(Ranks, ForkAllGather, ::testing::Values(1, 2, 4, 8));

TEST(RunForked, ReturnsExitCodesByRankAndReportsExceptions) {
    const std::vector<int> codes = run_forked(
        4,
        [](int rank, std::shared_ptr<Bootstrap>) -> int {
            if (rank == 3) FLATEP_THROW(ErrorCategory::kRuntime, "rank 3 fails on purpose");
            return 10 + rank;
        },
        ForkOptions{5.0, 30.0});
    EXPECT_EQ(codes, (std::vector<int>{10, 11, 12, kForkExitError}));
}

TEST(RunForked, KillsChildrenPastTheDeadline) {
    const auto start = Clock::now();
    const std::vector<int> codes = run_forked(
        2,
        [](int rank, std::shared_ptr<Bootstrap>) {
            if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
            return 0;
        },
        ForkOptions{5.0, 0.5});
    EXPECT_EQ(codes, (std::vector<int>{0, 128 + SIGKILL}));
    EXPECT_LT(seconds_since(start), 5.0);
}

TEST(RunForked, RejectsBadRankCounts) {
    auto fn = [](int, std::shared_ptr<Bootstrap>) { return 0; };
    EXPECT_THROW(run_forked(0, fn), Error);
    EXPECT_THROW(run_forked(kMaxRanks + 1, fn), Error);
}

class BootstrapPeerFailure : public ::testing::TestWithParam<Failure> {};

TEST_P(BootstrapPeerFailure, SurvivorsTimeOutNamingTheRank) {
    const Failure failure = GetParam();
    constexpr double kTimeout = 1.0;
    const auto start = Clock::now();
    const std::vector<int> codes = run_forked(
        4,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            boot->all_gather("before");
            if (rank == 2) return victim(failure);
            return expect_timeout_naming(2, kTimeout, [&] { boot->all_gather("after"); });
        },
        ForkOptions{kTimeout, 20.0});
    const int victim_code = failure == Failure::kSigkill ? 128 + SIGKILL : 3;
    EXPECT_EQ(codes, (std::vector<int>{0, 0, victim_code, 0}));
    EXPECT_LT(seconds_since(start), 8.0);
}

INSTANTIATE_TEST_SUITE_P(Failures, BootstrapPeerFailure,
                         ::testing::Values(Failure::kExit, Failure::kSigkill, Failure::kStall));

std::string unique_job_id() { return "test-" + ipc::random_hex(8); }

TEST(SocketBootstrap, RendezvousOfSeparateProcesses) {
    constexpr int kNumRanks = 4;
    const std::string job_id = unique_job_id();
    // run_forked only provides the processes here: each child joins the rendezvous on its own.
    const std::vector<int> codes = run_forked(
        kNumRanks,
        [&](int rank, std::shared_ptr<Bootstrap>) {
            // Stagger the starts: later ranks must wait for earlier ones and vice versa.
            std::this_thread::sleep_for(std::chrono::milliseconds(50 * ((rank * 3) % kNumRanks)));
            std::shared_ptr<Bootstrap> boot = make_socket_bootstrap(job_id, rank, kNumRanks, 10.0);
            return check_all_gather(rank, *boot, kNumRanks);
        },
        ForkOptions{10.0, 60.0});
    EXPECT_EQ(codes, std::vector<int>(kNumRanks, 0));
}

TEST(SocketBootstrap, MissingRankTimesOutNamingIt) {
    const std::string job_id = unique_job_id();
    const std::vector<int> codes = run_forked(
        3,
        [&](int rank, std::shared_ptr<Bootstrap>) {
            if (rank == 2) return 3;  // never joins
            const auto start = Clock::now();
            try {
                make_socket_bootstrap(job_id, rank, 3, 1.0);
            } catch (const Error& e) {
                CHILD_CHECK(e.category() == ErrorCategory::kTimeout, e.what());
                CHILD_CHECK(e.message().find("rank 2") != std::string::npos, e.what());
                CHILD_CHECK(seconds_since(start) < 1.75, "took ", seconds_since(start), " s");
                return 0;
            }
            CHILD_CHECK(false, "rendezvous completed without rank 2");
            return 1;
        },
        ForkOptions{5.0, 20.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 3}));
}

TEST(SocketBootstrap, FromEnvironment) {
    const std::string job_id = unique_job_id();
    const std::vector<int> codes = run_forked(
        3,
        [&](int rank, std::shared_ptr<Bootstrap>) {
            ::setenv("FLATEP_JOB_ID", job_id.c_str(), 1);
            ::setenv("FLATEP_RANK", std::to_string(rank).c_str(), 1);
            ::setenv("FLATEP_NUM_RANKS", "3", 1);
            std::shared_ptr<Bootstrap> boot = make_socket_bootstrap_from_env(10.0);
            return check_all_gather(rank, *boot, 3);
        },
        ForkOptions{10.0, 60.0});
    EXPECT_EQ(codes, std::vector<int>(3, 0));
    // In this process none of the variables is set.
    ::unsetenv("FLATEP_JOB_ID");
    EXPECT_THROW(make_socket_bootstrap_from_env(1.0), Error);
}

TEST(SocketBootstrap, RejectsBadArguments) {
    EXPECT_THROW(make_socket_bootstrap("", 0, 2, 1.0), Error);
    EXPECT_THROW(make_socket_bootstrap("bad/name", 0, 2, 1.0), Error);
    EXPECT_THROW(make_socket_bootstrap(std::string(65, 'a'), 0, 2, 1.0), Error);
    EXPECT_THROW(make_socket_bootstrap("ok", 2, 2, 1.0), Error);
    EXPECT_THROW(make_socket_bootstrap("ok", 0, 0, 1.0), Error);
}

TEST(SocketBootstrap, SingleRankNeedsNoPeers) {
    std::shared_ptr<Bootstrap> boot = make_socket_bootstrap(unique_job_id(), 0, 1, 1.0);
    EXPECT_EQ(boot->all_gather("x"), std::vector<std::string>{"x"});
}

TEST(IpcMesh, RankClaimedFromAnotherRanksPidIsRefused) {
    // Ranks 1 and 2 are expected as threads of this process (one pid for both), rank 3 from another pid. A
    // connection from this pid matches no single rank by its pid; one that claims rank 3 passes the hello checks and
    // must be refused by the pid of the rank it claims.
    const pid_t me = ::getpid();
    const pid_t other = me == 1 ? 2 : 1;
    ipc::MeshSpec base;
    base.name_prefix = "flatep-test-mesh-" + unique_job_id();
    base.token = "job-token";
    base.size = 4;
    base.expected_pids = {me, me, me, other};
    base.timeout_s = 1.5;
    base.what = "test mesh";
    auto spec_of = [&base](int rank) {
        ipc::MeshSpec s = base;
        s.rank = rank;
        return s;
    };
    ipc::Fd listener0 = ipc::listen_abstract(ipc::mesh_socket_name(spec_of(0), 0), 8);
    ipc::Fd listener3 = ipc::listen_abstract(ipc::mesh_socket_name(spec_of(3), 3), 8);
    ::testing::internal::CaptureStderr();
    int refused = 0;
    std::string rank0_error, impostor_error;
    double rank0_seconds = 0;
    std::thread rank0([&] {
        const auto start = Clock::now();
        try {
            ipc::build_mesh(spec_of(0), listener0.get(), &refused);
        } catch (const Error& e) {
            rank0_error = e.what();
        }
        rank0_seconds = seconds_since(start);
    });
    // The impostor connects while ranks 1 and 2 are both still pending at rank 0, and fails once rank 0 refuses it.
    std::thread impostor([&] {
        try {
            ipc::build_mesh(spec_of(3), listener3.get(), nullptr);
        } catch (const Error& e) {
            impostor_error = e.what();
        }
    });
    impostor.join();
    rank0.join();
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(refused, 1);
    EXPECT_NE(log.find("claims rank 3, whose pid is " + std::to_string(other)), std::string::npos) << log;
    EXPECT_NE(impostor_error.find("closed the connection"), std::string::npos) << impostor_error;
    EXPECT_NE(rank0_error.find("rank 3 (pid " + std::to_string(other) + ") did not connect"), std::string::npos)
        << rank0_error;
    // Rank 0 gives up on the missing ranks at its timeout (1.5 s), not before and not long after.
    EXPECT_GE(rank0_seconds, base.timeout_s * 0.95);
    EXPECT_LT(rank0_seconds, base.timeout_s + 1.5);
}

}  // namespace
}  // namespace flatep
