// Fault injection on the CPU backend with one process per rank (run_forked + the ipc transport on host memory,
// 1 s timeouts). For every collective op (plan, dispatch, combine, entry_values, prefetch, reduce_grad), a victim
// rank is killed (SIGKILL) or stalled (SIGSTOP) either before the op or inside it (after it has passed the op's first
// barrier): every survivor must throw kTimeout "timeout in <op>: rank <r> waited 1.0 s for peer <victim> (...)"
// (the flags in the message show whether it waited at the op's first barrier or a later one) within the timeout,
// record it in the status word (check_status), and exit cleanly. Plus the design §8 mismatch
// errors across processes: a rank with a different config or different pools, and plans of another Buffer.
//
// How "inside" is staged: survivors hold back until the victim is down; the victim enters the op alone, posts its
// arrival at the op's first barrier and spins there; a watchdog thread in the victim then marks it down in a shared
// page and kills or stops the whole process. Survivors pass the first barrier (the victim's flag is there), do
// their part of the op and time out at the next barrier. A stalled victim is resumed (SIGCONT) by the last
// survivor and exits with code 3.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "routing/routing.hpp"
#include "unit/host/rank_threads.hpp"
#include "unit/transport/test_ipc_util.hpp"

namespace flatep {
namespace {

using test::seconds_since;
using Clock = std::chrono::steady_clock;

constexpr double kTimeout = 1.0;
constexpr int kRanks = 3;
constexpr int kVictim = 1;
constexpr int kStalledExit = 3;

enum class Op { kPlan, kDispatch, kCombine, kEntryValues, kPrefetch, kReduceGrad };
enum class Fault { kKillBefore, kStallBefore, kKillInside, kStallInside };

const char* op_text(Op op) {
    switch (op) {
        case Op::kPlan:
            return "plan";
        case Op::kDispatch:
            return "dispatch";
        case Op::kCombine:
            return "combine";
        case Op::kEntryValues:
            return "entry_values";
        case Op::kPrefetch:
            return "prefetch";
        case Op::kReduceGrad:
            return "reduce_grad";
    }
    return "?";
}

const char* fault_text(Fault f) {
    switch (f) {
        case Fault::kKillBefore:
            return "KillBefore";
        case Fault::kStallBefore:
            return "StallBefore";
        case Fault::kKillInside:
            return "KillInside";
        case Fault::kStallInside:
            return "StallInside";
    }
    return "?";
}

bool is_stall(Fault f) { return f == Fault::kStallBefore || f == Fault::kStallInside; }
bool is_inside(Fault f) { return f == Fault::kKillInside || f == Fault::kStallInside; }

// A page shared by the parent and all children (MAP_SHARED before the fork).
struct SharedState {
    std::atomic<int> victim_pid;
    std::atomic<int> victim_down;  // set right before the victim kills or stops itself
    std::atomic<int> survivors_done;
};

class SharedPage {
  public:
    SharedPage() {
        void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
        state_ = new (p) SharedState{};
    }
    ~SharedPage() { ::munmap(state_, 4096); }
    SharedState* get() { return state_; }

  private:
    SharedState* state_;
};

Config config_of(int rank) { return testing::make_config(kRanks, 2 * kRanks, 16, 2, 16, 4, 1.0, rank); }

// The victim takes itself down: SIGKILL, or SIGSTOP until the last survivor sends SIGCONT, then exits.
[[noreturn]] void take_down(SharedState* shared, Fault fault) {
    shared->victim_down.store(1);
    if (is_stall(fault)) {
        ::kill(::getpid(), SIGSTOP);
        ::_exit(kStalledExit);  // resumed: give up without touching the (now inconsistent) Buffer
    }
    ::kill(::getpid(), SIGKILL);
    ::_exit(99);  // not reached
}

int run_rank(Op op, Fault fault, SharedState* shared, int rank, std::shared_ptr<Bootstrap> boot) {
    std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, kTimeout);
    const Config cfg = config_of(rank);
    Buffer buffer(cfg, transport);
    const Layout& l = internal::layout(buffer);
    const int epn = l.experts_per_rank;
    ExpertPools pools(transport, epn, {{8, 16}});
    ExpertLayer layer = pools.register_layer();

    std::vector<int32_t> idx(size_t(cfg.num_tokens) * cfg.topk);
    routing::sample_topk(routing::popularity(cfg.num_experts, 2.0, 5), cfg.num_tokens, cfg.topk, 5, rank, idx.data());
    std::vector<uint16_t> x(size_t(cfg.num_tokens) * cfg.hidden, 0x3f80), out(x.size());
    std::vector<uint16_t> recv(size_t(l.num_recv_rows) * cfg.hidden);
    std::vector<float> row_values(size_t(l.num_recv_rows), 1.0f), entry_out(idx.size());
    // Every op but plan needs a plan of a completed step (collective, before any fault).
    const Plan plan = op == Op::kPlan ? Plan() : buffer.plan(idx.data(), 4, cfg.num_tokens);

    auto run_op = [&] {
        switch (op) {
            case Op::kPlan:
                buffer.plan(idx.data(), 4, cfg.num_tokens);
                break;
            case Op::kDispatch:
                buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr);
                break;
            case Op::kCombine:
                buffer.combine(plan, recv.data(), nullptr, out.data());
                break;
            case Op::kEntryValues:
                buffer.entry_values(plan, row_values.data(), entry_out.data());
                break;
            case Op::kPrefetch:
                pools.prefetch(plan, layer);
                break;
            case Op::kReduceGrad:
                pools.reduce_grad(plan, layer);
                break;
        }
    };

    if (rank == kVictim) {
        shared->victim_pid.store(::getpid());
        if (!is_inside(fault)) take_down(shared, fault);
        // Inside: enter the op alone (survivors wait for victim_down), so the victim arrives at its first barrier and
        // spins there; the watchdog takes the process down meanwhile.
        std::thread watchdog([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(150));
            take_down(shared, fault);
        });
        try {
            run_op();
        } catch (...) {
        }
        watchdog.join();  // never returns: take_down exits the process
        return 98;
    }

    // Survivors: wait until the victim is down, then run the op.
    const auto wait_start = Clock::now();
    while (shared->victim_down.load() == 0) {
        CHILD_CHECK(seconds_since(wait_start) < 10.0, "the victim never went down");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto finish = [&](int code) {
        // The last survivor resumes a stalled victim, which then exits on its own.
        if (shared->survivors_done.fetch_add(1) + 1 == kRanks - 1 && is_stall(fault))
            ::kill(shared->victim_pid.load(), SIGCONT);
        return code;
    };
    const auto start = Clock::now();
    try {
        run_op();
    } catch (const Error& e) {
        const double elapsed = seconds_since(start);
        const std::string prefix = detail::concat("timeout in ", op_text(op), ": rank ", rank, " waited ");
        // Which barrier it gave up at shows in the flags: before the op, the victim's flag is still at the op's start
        // epoch `base` (the Buffer's plan took 3 barriers; the pools count their own); inside, the victim passed one.
        const int base = (op == Op::kPlan || op == Op::kPrefetch || op == Op::kReduceGrad) ? 0 : 3;
        const int observed = base + (is_inside(fault) ? 1 : 0);
        const std::string suffix =
            detail::concat(" s for peer ", kVictim, " (flag ", observed, " < expected ", observed + 1, ")");
        const std::string& m = e.message();
        if (e.category() != ErrorCategory::kTimeout || m.rfind(prefix, 0) != 0 || m.size() < suffix.size() ||
            m.compare(m.size() - suffix.size(), suffix.size(), suffix) != 0) {
            std::fprintf(stderr, "rank %d: unexpected error: %s\n", rank, e.what());
            return finish(1);
        }
        if (elapsed < kTimeout * 0.95 || elapsed > kTimeout + 1.0) {
            std::fprintf(stderr, "rank %d: timed out after %.2f s (timeout %.1f s)\n", rank, elapsed, kTimeout);
            return finish(1);
        }
        if (op != Op::kPrefetch && op != Op::kReduceGrad) {
            // The status word keeps the timeout for the next synchronising point.
            const std::string want =
                detail::concat("rank ", rank, ": ", op_text(op), " timed out waiting for peer ", kVictim, " (flag ");
            try {
                buffer.check_status();
                std::fprintf(stderr, "rank %d: check_status reported nothing\n", rank);
                return finish(1);
            } catch (const Error& s) {
                if (s.category() != ErrorCategory::kTimeout || s.message().rfind(want, 0) != 0) {
                    std::fprintf(stderr, "rank %d: unexpected status: %s\n", rank, s.what());
                    return finish(1);
                }
            }
        }
        return finish(0);
    }
    std::fprintf(stderr, "rank %d: %s succeeded without rank %d\n", rank, op_text(op), kVictim);
    return finish(1);
}

using FaultCase = std::tuple<Op, Fault>;

class FaultInjection : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultInjection, SurvivorsTimeOutNamingOpAndPeerAndExitCleanly) {
    const auto [op, fault] = GetParam();
    SharedPage page;
    SharedState* shared = page.get();
    const auto start = Clock::now();
    const std::vector<int> codes = run_forked(
        kRanks, [&](int rank, std::shared_ptr<Bootstrap> boot) { return run_rank(op, fault, shared, rank, boot); },
        ForkOptions{kTimeout, 15.0});
    const int victim_code = is_stall(fault) ? kStalledExit : 128 + SIGKILL;
    EXPECT_EQ(codes, (std::vector<int>{0, victim_code, 0}))
        << "reproduce: flatep_hardening_tests --gtest_filter='*FaultInjection*" << op_text(op) << "_"
        << fault_text(fault) << "*'";
    EXPECT_LT(seconds_since(start), kTimeout + 4.0);
}

INSTANTIATE_TEST_SUITE_P(Ops, FaultInjection,
                         ::testing::Combine(::testing::Values(Op::kPlan, Op::kDispatch, Op::kCombine, Op::kEntryValues,
                                                              Op::kPrefetch, Op::kReduceGrad),
                                            ::testing::Values(Fault::kKillBefore, Fault::kStallBefore,
                                                              Fault::kKillInside, Fault::kStallInside)),
                         [](const ::testing::TestParamInfo<FaultCase>& info) {
                             return std::string(op_text(std::get<0>(info.param))) + "_" +
                                    fault_text(std::get<1>(info.param));
                         });

// ---- Mismatches across processes (design §8) ----

struct Caught {
    bool thrown = false;
    ErrorCategory category = ErrorCategory::kRuntime;
    std::string message;
};

template <typename Fn>
Caught catch_error(Fn&& fn) {
    Caught c;
    try {
        fn();
    } catch (const Error& e) {
        c.thrown = true;
        c.category = e.category();
        c.message = e.message();
    }
    return c;
}

struct FieldCase {
    const char* field;
    void (*change)(Config&, PlannerKind&);
    const char* mine;    // rank 0's value as printed
    const char* theirs;  // rank 2's value
};

const FieldCase kFieldCases[] = {
    {"num_experts", [](Config& c, PlannerKind&) { c.num_experts = 9; }, "6", "9"},
    {"num_tokens", [](Config& c, PlannerKind&) { c.num_tokens = 8; }, "16", "8"},
    {"topk", [](Config& c, PlannerKind&) { c.topk = 3; }, "2", "3"},
    {"hidden", [](Config& c, PlannerKind&) { c.hidden = 32; }, "16", "32"},
    {"align", [](Config& c, PlannerKind&) { c.align = 1; }, "4", "1"},
    {"capacity_factor", [](Config& c, PlannerKind&) { c.capacity_factor = 1.5; }, "1", "1.5"},
    {"planner", [](Config&, PlannerKind& k) { k = PlannerKind::kGreedy; }, "balanced", "greedy"},
};

// Rank 2 constructs its Buffer with one field changed: every rank throws kMismatch naming the peer and the field.
TEST(ProcessMismatch, ConfigDifferenceIsReportedOnEveryRankForEveryField) {
    for (const FieldCase& fc : kFieldCases) {
        const std::vector<int> codes = run_forked(
            kRanks,
            [&](int rank, std::shared_ptr<Bootstrap> boot) {
                std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
                Config cfg = config_of(rank);
                PlannerKind planner = PlannerKind::kBalanced;
                if (rank == 2) fc.change(cfg, planner);
                const Caught c = catch_error([&] { Buffer buffer(cfg, transport, planner); });
                const std::string want =
                    rank == 2
                        ? detail::concat("config mismatch with rank 0: ", fc.field, ": ", fc.theirs, " vs ", fc.mine)
                        : detail::concat("config mismatch with rank 2: ", fc.field, ": ", fc.mine, " vs ", fc.theirs);
                CHILD_CHECK(c.thrown && c.category == ErrorCategory::kMismatch && c.message == want, "field ", fc.field,
                            ": got '", c.message, "', want '", want, "'");
                return 0;
            },
            ForkOptions{5.0, 30.0});
        EXPECT_EQ(codes, (std::vector<int>{0, 0, 0})) << "field " << fc.field;
    }
}

// A rank whose config disagrees with its own transport (num_ranks) fails locally before the collective; the others
// time out in the construction's all-gather naming it.
TEST(ProcessMismatch, RankRejectingItsOwnConfigIsNamedByTheOthers) {
    const std::vector<int> codes = run_forked(
        kRanks,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, kTimeout);
            Config cfg = config_of(rank);
            if (rank == 2) {
                cfg.num_ranks = 2 * kRanks;
                const Caught c = catch_error([&] { Buffer buffer(cfg, transport); });
                CHILD_CHECK(c.category == ErrorCategory::kInvalidArgument &&
                                c.message == "Buffer: config.num_ranks (6) differs from the transport's (3)",
                            c.message);
                return 0;
            }
            return test::expect_timeout_naming(
                2, kTimeout, [&] { Buffer buffer(cfg, transport); }, kRanks);
        },
        ForkOptions{kTimeout, 20.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
}

// ExpertPools with a different experts_per_rank on one rank: the pools' collective allocation fails with kMismatch
// naming a peer on every rank.
TEST(ProcessMismatch, PoolsOfDifferentShapesAreRejectedOnEveryRank) {
    const std::vector<int> codes = run_forked(
        kRanks,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, 5.0);
            const Caught c = catch_error([&] { ExpertPools pools(transport, rank == 2 ? 3 : 2, {{64, 64}}); });
            const int peer = rank == 2 ? 0 : 2;
            CHILD_CHECK(c.thrown && c.category == ErrorCategory::kMismatch, "got '", c.message, "'");
            CHILD_CHECK(c.message.find(detail::concat("rank ", peer, " (pid")) != std::string::npos,
                        "does not name rank ", peer, ": ", c.message);
            return 0;
        },
        ForkOptions{5.0, 30.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
}

// Plans of another Buffer are rejected on every rank before any collective starts, so the rejected call leaves
// the barrier epochs consistent: the next valid ops of both Buffers still work (and give the same rows as before).
TEST(ProcessMismatch, ForeignPlanIsRejectedOnEveryRankWithoutDesynchronising) {
    const std::vector<int> codes = run_forked(
        kRanks,
        [&](int rank, std::shared_ptr<Bootstrap> boot) {
            std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kHost, kTimeout);
            const Config cfg = config_of(rank);
            Buffer a(cfg, transport), b(cfg, transport);
            std::vector<int32_t> idx(size_t(cfg.num_tokens) * cfg.topk);
            routing::sample_topk(routing::popularity(cfg.num_experts, 1.0, 3), cfg.num_tokens, cfg.topk, 3, rank,
                                 idx.data());
            const Plan pa = a.plan(idx.data(), 4, cfg.num_tokens);
            std::vector<uint16_t> x(size_t(cfg.num_tokens) * cfg.hidden), out(x.size());
            for (size_t i = 0; i < x.size(); ++i) x[i] = uint16_t(0x3f80 + (i % 64) + 64 * rank);
            const size_t recv_elems = size_t(a.num_recv_rows()) * cfg.hidden;
            std::vector<uint16_t> recv_a(recv_elems), recv_b(recv_elems);
            std::vector<float> values(size_t(a.num_recv_rows())), entry_out(idx.size());
            const std::string want =
                detail::concat(" plan was made by buffer ", a.id(), ", not by this buffer (", b.id(), ")");
            const Caught d = catch_error([&] { b.dispatch(pa, x.data(), nullptr, recv_b.data(), nullptr); });
            const Caught c = catch_error([&] { b.combine(pa, recv_b.data(), nullptr, out.data()); });
            const Caught v = catch_error([&] { b.entry_values(pa, values.data(), entry_out.data()); });
            CHILD_CHECK(d.category == ErrorCategory::kMismatch && d.message == "dispatch:" + want, d.message);
            CHILD_CHECK(c.category == ErrorCategory::kMismatch && c.message == "combine:" + want, c.message);
            CHILD_CHECK(v.category == ErrorCategory::kMismatch && v.message == "entry_values:" + want, v.message);
            // Both Buffers still work and agree.
            const Plan pb = b.plan(idx.data(), 4, cfg.num_tokens);
            a.dispatch(pa, x.data(), nullptr, recv_a.data(), nullptr);
            b.dispatch(pb, x.data(), nullptr, recv_b.data(), nullptr);
            CHILD_CHECK(std::vector<int32_t>(pa.alloc().begin(), pa.alloc().end()) ==
                            std::vector<int32_t>(pb.alloc().begin(), pb.alloc().end()),
                        "the plans differ");
            const int32_t rows = pa.cu_seqlens(rank).back();
            CHILD_CHECK(std::memcmp(recv_a.data(), recv_b.data(), size_t(rows) * cfg.hidden * 2) == 0,
                        "the dispatched rows differ");
            return 0;
        },
        ForkOptions{kTimeout, 20.0});
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
}

}  // namespace
}  // namespace flatep
