// The local (threads) transport given a region handle that is not live: a copy of a region already released must not
// unmap or close what a later allocation got (the same address and the same descriptor number come back).
#include <gtest/gtest.h>

#include <fcntl.h>

#include <cstring>
#include <memory>
#include <string>

#include "transport/local_host.hpp"

namespace flatep {
namespace {

TEST(LocalHostFaults, ReleasingACopyOfAReleasedRegionLeavesTheNextRegionAlone) {
    transport::LocalHostWorld world(1, 5.0);
    std::shared_ptr<Transport> t = world.transport(0);
    SymmetricRegion first = t->allocate(100);
    const SymmetricRegion copy = first;
    t->release(first);
    EXPECT_EQ(first.local, nullptr);
    SymmetricRegion next = t->allocate(100);
    ASSERT_NE(next.local, nullptr);
    EXPECT_EQ(next.local_fd, copy.local_fd);  // the lowest free descriptor: the one the first region had

    // The stale copy, and a handle with the live id at another address: both refused.
    SymmetricRegion stale = copy, moved = next;
    moved.local += 1;
    ::testing::internal::CaptureStderr();
    t->release(stale);
    t->release(moved);
    const std::string log = ::testing::internal::GetCapturedStderr();
    auto warning = [](int id) {
        return "[flatep warning] local transport rank 0: region id " + std::to_string(id) +
               " is not a live region of this transport; ignored\n";
    };
    EXPECT_EQ(log, warning(copy.id) + warning(next.id));
    EXPECT_GE(::fcntl(next.local_fd, F_GETFD), 0);  // still open
    std::memset(next.local, 5, next.bytes);         // still mapped
    EXPECT_EQ(next.peers[0][99], 5);
    t->release(next);
    // With every region released, the transport's end logs nothing.
    ::testing::internal::CaptureStderr();
    t.reset();
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST(LocalHostFaults, ATransportEndingWithLiveRegionsSaysHowMany) {
    transport::LocalHostWorld world(1, 5.0);
    std::shared_ptr<Transport> t = world.transport(0);
    t->allocate(100);
    t->allocate(100);
    ::testing::internal::CaptureStderr();
    t.reset();
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "[flatep warning] local transport rank 0: 2 region(s) not released\n");
}

}  // namespace
}  // namespace flatep
