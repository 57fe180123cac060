// flatep-plan's input bounds (tools/plan_request.hpp, tools/json.hpp): a request's memory stays bounded whatever its
// size or its claimed dimensions, and every refusal is one line saying which limit it hit. The binary's own bounds
// (directories, unreadable files, inputs over 32 MiB) are tested through it in tests/cli/run_plan_cli.cmake.
#include <gtest/gtest.h>

#include <array>
#include <string>

#include "json.hpp"
#include "plan_request.hpp"

namespace flatep {
namespace {

// A request of R ranks x E experts, one entry per count (S*K = E), written like flatep-plan's own output.
std::string request_of(int R, int E, int S, int K) {
    std::string row = "[1";
    for (int e = 1; e < E; ++e) row += ", 1";
    row += "]";
    std::string text = "{\"R\": " + std::to_string(R) + ", \"E\": " + std::to_string(E) +
                       ", \"S\": " + std::to_string(S) + ", \"K\": " + std::to_string(K) +
                       ", \"align\": 1, \"tpe\": [\n";
    for (int r = 0; r < R; ++r) text += "  " + row + (r + 1 < R ? ",\n" : "\n");
    return text + "]}";
}

TEST(PlanRequestBounds, JsonStopsAtTheValueLimit) {
    const json::ParseResult r = json::parse("[1, 2, 3]", 3);  // the array and three numbers: four values
    EXPECT_FALSE(r.ok);
    EXPECT_TRUE(r.too_many_values);
    EXPECT_EQ(r.error, "JSON document of more than 3 values (the limit)");
    EXPECT_TRUE(json::parse("[1, 2, 3]", 4).ok);
    EXPECT_TRUE(json::parse("[1, 2, 3]").ok);  // no limit by default
}

TEST(PlanRequestBounds, DimensionsAboveTheLimitAreRefusedBeforeTheMatrixIsBuilt) {
    // 64 empty rows claiming E = 2^23: the count matrix would be 2 GiB (before: allocated, then "tpe[0] must have
    // E = 8388608 entries, got 0").
    std::string rows = "[]";
    for (int r = 1; r < 64; ++r) rows += ",[]";
    PlanRequest req;
    EXPECT_EQ(
        parse_plan_request("{\"R\":64,\"E\":8388608,\"S\":1,\"K\":1,\"align\":1,\"tpe\":[" + rows + "]}", false, req),
        "R*E = 536870912 counts (R=64, E=8388608) is above flatep-plan's limit of 1048576");
    EXPECT_EQ(parse_plan_request("{\"R\":1,\"E\":1048577,\"S\":1,\"K\":1,\"align\":1,\"tpe\":[]}", false, req),
              "R*E = 1048577 counts (R=1, E=1048577) is above flatep-plan's limit of 1048576");
}

TEST(PlanRequestBounds, InputsHoldingMoreValuesThanTheLargestRequestAreRefusedWhileParsing) {
    // Before: every value was parsed into the document (3.5 GB for a 50 MB input) before the shape was checked.
    std::string text = "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[0";
    text.reserve(2 * kMaxRequestValues + 64);
    for (size_t i = 0; i < kMaxRequestValues; ++i) text += ",0";
    text += "]}";
    PlanRequest req;
    EXPECT_EQ(parse_plan_request(text, false, req),
              "the input holds more than 1048656 JSON values, more than a request of at most R*E = 1048576 counts can "
              "hold (flatep-plan's limit)");
}

TEST(PlanRequestBounds, TheLargestRequestsAreAccepted) {
    for (const auto& [R, E, S, K] :
         {std::array<int, 4>{64, 16384, 2048, 8}, std::array<int, 4>{1, 1 << 20, 1 << 17, 8}}) {
        PlanRequest req;
        EXPECT_EQ(parse_plan_request(request_of(R, E, S, K), false, req), "") << "R=" << R << " E=" << E;
        EXPECT_EQ(req.tpe.size(), size_t(kMaxRequestCounts));
    }
}

}  // namespace
}  // namespace flatep
