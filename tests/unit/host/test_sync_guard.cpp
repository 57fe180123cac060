// The host barrier's pieces and the poisoning guard of Buffer / ExpertPools, driven on one thread with flag words
// written by hand (sync/sync.hpp, sync/barrier_host.hpp, runtime/collective_guard.hpp): every op's printed name, the
// flag states of an aborted peer, a wait that fails at its first read, the barrier of a rank that failed before, the
// default text of an unknown status code, and the guard's choice of what to raise and when to poison. Exact texts.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "flatep/error.hpp"
#include "runtime/collective_guard.hpp"
#include "sync/barrier_host.hpp"
#include "sync/sync.hpp"

namespace flatep {
namespace {

using namespace sync;

Error error(ErrorCategory c, const std::string& text) { return Error(c, "x.cpp", 1, text); }

// The error fn() throws, as (category, message); (kRuntime, "(no error)") when none.
template <class F>
std::pair<ErrorCategory, std::string> thrown(F&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return {e.category(), e.message()};
    }
    return {ErrorCategory::kRuntime, "(no error)"};
}

TEST(SyncHost, EveryOpHasItsName) {
    const char* names[] = {"none",
                           "plan",
                           "dispatch",
                           "combine",
                           "prefetch",
                           "reduce_grad",
                           "entry_values",
                           "dispatch_fp8",
                           "dispatch (plan_ordered)",
                           "combine (plan_ordered)",
                           "dispatch_fp8 (plan_ordered)"};
    for (int op = 0; op <= kOpDispatchFp8Ordered; ++op) EXPECT_STREQ(op_name(OpId(op)), names[op]) << op;
    EXPECT_STREQ(op_name(OpId(11)), "unknown op");
    EXPECT_STREQ(op_name(OpId(-1)), "unknown op");
}

TEST(SyncHost, FlagStatesOfAnAbortedPeer) {
    const uint64_t mine = flag_word(5, kOpDispatch, 9);
    // Aborted at a later barrier: it passed this one.
    EXPECT_EQ(flag_state(flag_word(6, kOpCombine, 9) | kFlagAbortBit, mine), 1);
    // Aborted at this barrier in the same (op, step): it gave up; in another op or step: a mismatch.
    EXPECT_EQ(flag_state(mine | kFlagAbortBit, mine), -kStatusPeerAborted);
    EXPECT_EQ(flag_state(flag_word(5, kOpCombine, 9) | kFlagAbortBit, mine), -kStatusMismatch);
    EXPECT_EQ(flag_state(flag_word(5, kOpDispatch, 8) | kFlagAbortBit, mine), -kStatusMismatch);
    // Aborted at an earlier barrier, whatever its tags: it gave up.
    EXPECT_EQ(flag_state(flag_word(4, kOpCombine, 1) | kFlagAbortBit, mine), -kStatusPeerAborted);
}

TEST(SyncHost, StatusRecordAndDefaultMessage) {
    host::record_status(nullptr, kStatusTimeout, 1, 2, 3);  // no status words: nothing to do, no crash
    int32_t status[4] = {0, 0, 0, 0};
    host::record_status(status, kStatusMismatch, 2, 3, 1);
    host::record_status(status, kStatusTimeout, 7, 7, 7);  // the first error stays
    EXPECT_EQ(status[kStatusCode], kStatusMismatch);
    EXPECT_EQ(status[kStatusIndex], 2);
    EXPECT_EQ(status[kStatusValue], 3);
    EXPECT_EQ(status[kStatusPeer], 1);
    EXPECT_EQ(host::wait_failure_message(9, kOpPlan, 2, 0, 0, 0, 0, 1.0), "plan: rank 2: wait failed with status 9");
    EXPECT_EQ(host::wait_failure_category(9), ErrorCategory::kRuntime);
    EXPECT_EQ(host::wait_failure_category(kStatusPeerAborted), ErrorCategory::kRuntime);
}

// The peer's word already carries the abort bit at this barrier: the wait fails at its first read, records the
// failure (index = op, value = the epoch seen, peer) and throws kRuntime naming the peer.
TEST(SyncHost, WaitFailsAtTheFirstReadOfAnAbortedPeer) {
    int32_t status[4] = {0, 0, 0, 0};
    SyncArgs s{};
    s.status = status;
    s.rank = 0;
    s.num_ranks = 2;
    s.timeout_s = 30;
    s.step = 4;
    const uint64_t mine = flag_word(3, kOpCombine, 4);
    const uint64_t peer_word = mine | kFlagAbortBit;
    const auto [category, text] = thrown([&] { host::wait_flag_at_least(s, kOpCombine, 1, &peer_word, mine, 0); });
    EXPECT_EQ(category, ErrorCategory::kRuntime);
    EXPECT_EQ(text, "combine: rank 0 gives up: peer 1 failed an earlier wait (its own error says why)");
    EXPECT_EQ(status[kStatusCode], kStatusPeerAborted);
    EXPECT_EQ(status[kStatusIndex], kOpCombine);
    EXPECT_EQ(status[kStatusValue], 3);
    EXPECT_EQ(status[kStatusPeer], 1);
}

// One rank alone: the barrier only bumps its epoch and stores its word; with a fatal status it refuses at once and
// stores nothing.
TEST(SyncHost, BarrierOfOneRankAndOfARankThatFailedBefore) {
    uint64_t flags[kMaxRanks] = {};
    uint64_t epoch[kEpochWords] = {};
    SyncArgs s{};
    s.flags[0] = flags;
    s.epoch = epoch;
    s.rank = 0;
    s.num_ranks = 1;
    s.timeout_s = 1;
    s.step = 2;
    host::barrier(s, kOpPlan);  // no status words
    EXPECT_EQ(epoch[kEpochCounter], 1u);
    EXPECT_EQ(flags[0], flag_word(1, kOpPlan, 2));
    int32_t status[4] = {kStatusBadExpert, 0, 0, 0};  // not fatal
    s.status = status;
    host::barrier(s, kOpDispatch);
    EXPECT_EQ(epoch[kEpochCounter], 2u);
    status[kStatusCode] = kStatusTimeout;
    const auto [category, text] = thrown([&] { host::barrier(s, kOpCombine); });
    EXPECT_EQ(category, ErrorCategory::kRuntime);
    EXPECT_EQ(text,
              "combine: rank 0 failed an earlier cross-rank wait; build a new Buffer / ExpertPools on every rank");
    EXPECT_EQ(epoch[kEpochCounter], 2u);
    EXPECT_EQ(flags[0], flag_word(2, kOpDispatch, 2));
}

// The peer is one barrier behind at the first read (not yet), then aborts at this barrier while this rank waits: the
// wait fails at the read that sees it, long before its timeout, with the peer-aborted text and record.
TEST(SyncHost, WaitFailsWhenThePeerAbortsDuringIt) {
    int32_t status[4] = {0, 0, 0, 0};
    SyncArgs s{};
    s.status = status;
    s.rank = 1;
    s.num_ranks = 2;
    s.timeout_s = 60;
    s.step = 4;
    const uint64_t mine = flag_word(3, kOpDispatch, 4);
    uint64_t peer_word = flag_word(2, kOpDispatch, 4);
    std::thread peer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::atomic_ref<uint64_t>(peer_word).store(mine | kFlagAbortBit, std::memory_order_release);
    });
    const double start = host::now_s();
    const auto [category, text] = thrown([&] { host::wait_flag_at_least(s, kOpDispatch, 0, &peer_word, mine, start); });
    peer.join();
    EXPECT_LT(host::now_s() - start, 30.0);
    EXPECT_EQ(category, ErrorCategory::kRuntime);
    EXPECT_EQ(text, "dispatch: rank 1 gives up: peer 0 failed an earlier wait (its own error says why)");
    EXPECT_EQ(status[kStatusCode], kStatusPeerAborted);
    EXPECT_EQ(status[kStatusValue], 3);
    EXPECT_EQ(status[kStatusPeer], 0);
}

TEST(CollectiveGuard, DeviceFailurePoisonsOnce) {
    CollectiveGuard g("Buffer");
    g.enter("plan", "", 0);
    EXPECT_FALSE(g.poisoned());
    auto first = thrown([&] { g.enter("dispatch", "timeout in dispatch: rank 0 waited", kStatusTimeout); });
    EXPECT_EQ(first.first, ErrorCategory::kTimeout);
    EXPECT_EQ(first.second, "dispatch: timeout in dispatch: rank 0 waited");
    EXPECT_EQ(g.reason(), "timeout in dispatch: rank 0 waited");
    const std::string unusable =
        ": this Buffer is unusable after an earlier cross-rank failure (timeout in dispatch: "
        "rank 0 waited); destroy it and build a new one on every rank";
    for (const char* device : {"", "another record"}) {  // a later record does not replace the first reason
        auto later = thrown([&] { g.enter("combine", device, kStatusMismatch); });
        EXPECT_EQ(later.first, ErrorCategory::kRuntime);
        EXPECT_EQ(later.second, "combine" + unusable);
    }
    CollectiveGuard m("ExpertPools");
    auto mismatch = thrown([&] { m.enter("prefetch", "ranks differ", kStatusMismatch); });
    EXPECT_EQ(mismatch.first, ErrorCategory::kMismatch);
    EXPECT_EQ(mismatch.second, "prefetch: ranks differ");
}

TEST(CollectiveGuard, RunPoisonsOnlyOnAFatalStatus) {
    CollectiveGuard g("Buffer");
    const auto fail = [](ErrorCategory c, const char* text) { return [=] { throw error(c, text); }; };
    // No status words, or a status that is not fatal: the error goes on, the guard stays usable.
    EXPECT_EQ(thrown([&] { g.run(nullptr, fail(ErrorCategory::kTimeout, "t0")); }).second, "t0");
    int32_t status[4] = {kStatusBadExpert, 0, 0, 1};
    EXPECT_EQ(thrown([&] { g.run(status, fail(ErrorCategory::kInvalidArgument, "bad id")); }).second, "bad id");
    EXPECT_FALSE(g.poisoned());
    g.run(status, [] {});  // a body that succeeds
    // A fatal status and a mismatch: poisoned with the error's text, which goes on unchanged.
    status[kStatusCode] = kStatusMismatch;
    auto e = thrown([&] { g.run(status, fail(ErrorCategory::kMismatch, "first")); });
    EXPECT_EQ(e, std::make_pair(ErrorCategory::kMismatch, std::string("first")));
    EXPECT_EQ(g.reason(), "first");
    e = thrown([&] { g.run(status, fail(ErrorCategory::kMismatch, "second")); });  // the first reason stays
    EXPECT_EQ(e.second, "second");
    EXPECT_EQ(g.reason(), "first");
    // A timeout of a guard with no site: nothing elsewhere to name.
    CollectiveGuard t("Buffer");
    status[kStatusCode] = kStatusTimeout;
    e = thrown([&] { t.run(status, fail(ErrorCategory::kTimeout, "late")); });
    EXPECT_EQ(e, std::make_pair(ErrorCategory::kTimeout, std::string("late")));
    EXPECT_EQ(t.reason(), "late");
}

// A timeout waiting for peer 1, whose word in another registered object of this rank on the same transport is ahead
// of that object's epoch: the error and the reason name what the peer is doing there.
TEST(CollectiveGuard, TimeoutNamesThePeerInAnotherObject) {
    int transport = 0, other_transport = 0;
    uint64_t flags_a[kMaxRanks] = {}, flags_b[kMaxRanks] = {}, flags_c[kMaxRanks] = {};
    uint64_t epoch_a = 3, epoch_b = 2, epoch_c = 0;
    CollectiveGuard a("Buffer"), b("ExpertPools"), c("Buffer");
    a.set_site({&transport, flags_a, &epoch_a});
    b.set_site({&transport, flags_b, &epoch_b});
    c.set_site({&other_transport, flags_c, &epoch_c});  // another transport: never named
    flags_c[1] = flag_word(9, kOpPlan, 1);
    int32_t status[4] = {kStatusTimeout, kOpPlan, 0, 1};
    const auto timeout = [] { throw error(ErrorCategory::kTimeout, "timeout in plan"); };

    flags_b[1] = flag_word(2, kOpDispatch, 7);  // at b's epoch: not ahead
    CollectiveGuard* g = &a;
    EXPECT_EQ(thrown([&] { g->run(status, timeout); }).second, "timeout in plan");
    EXPECT_EQ(a.reason(), "timeout in plan");

    CollectiveGuard fresh("Buffer");
    fresh.set_site({&transport, flags_a, &epoch_a});
    flags_b[1] = flag_word(3, kOpDispatch, 70000);  // ahead: step 70000 mod 2^16 = 4464
    const std::string named =
        "timeout in plan; peer 1 was in dispatch of another ExpertPools on this transport "
        "(step 4464 mod 2^16): every rank must call the same objects in the same order";
    auto e = thrown([&] { fresh.run(status, timeout); });
    EXPECT_EQ(e, std::make_pair(ErrorCategory::kTimeout, named));
    EXPECT_EQ(fresh.reason(), named);
    e = thrown([&] { fresh.run(status, timeout); });  // again: the same text raised, the first reason kept
    EXPECT_EQ(e.second, named);
    EXPECT_EQ(fresh.reason(), named);

    for (int32_t peer : {-1, kMaxRanks}) {  // a peer word out of range: nothing to look up
        CollectiveGuard odd("Buffer");
        odd.set_site({&transport, flags_a, &epoch_a});
        status[kStatusPeer] = peer;
        EXPECT_EQ(thrown([&] { odd.run(status, timeout); }).second, "timeout in plan") << peer;
    }
    status[kStatusPeer] = 1;
    b.set_site({});  // unregistered: nothing ahead elsewhere
    CollectiveGuard alone("Buffer");
    alone.set_site({&transport, flags_a, &epoch_a});
    EXPECT_EQ(thrown([&] { alone.run(status, timeout); }).second, "timeout in plan");
}

}  // namespace
}  // namespace flatep
