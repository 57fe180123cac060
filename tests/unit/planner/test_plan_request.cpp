// The JSON reader (tools/json.hpp) and the flatep-plan request parser (tools/plan_request.hpp): exact error
// messages with byte offsets, limits, and robustness on arbitrary bytes.
#include <gtest/gtest.h>

#include <string>

#include "json.hpp"
#include "plan_request.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

std::string json_error(std::string_view text) {
    const json::ParseResult r = json::parse(text);
    return r.ok ? "" : r.error;
}

TEST(Json, ParsesEveryKind) {
    const json::ParseResult r =
        json::parse(" {\"a\": [1, -2, 3.5, 1e2, true, false, null, \"x\\n\\u00e9\\ud83d\\ude00\"], \"b\": {}} ");
    ASSERT_TRUE(r.ok) << r.error;
    const json::Value* a = r.value.find("a");
    ASSERT_NE(a, nullptr);
    ASSERT_EQ(a->items.size(), 8u);
    EXPECT_TRUE(a->items[0].is_integer);
    EXPECT_EQ(a->items[1].integer, -2);
    EXPECT_FALSE(a->items[2].is_integer);
    EXPECT_DOUBLE_EQ(a->items[2].number, 3.5);
    EXPECT_FALSE(a->items[3].is_integer);
    EXPECT_DOUBLE_EQ(a->items[3].number, 100.0);
    EXPECT_TRUE(a->items[4].boolean);
    EXPECT_EQ(a->items[6].type, json::Type::kNull);
    EXPECT_EQ(a->items[7].string, "x\n\xc3\xa9\xf0\x9f\x98\x80");
    EXPECT_EQ(r.value.find("b")->type, json::Type::kObject);
    EXPECT_EQ(json::parse("-9223372036854775808").value.integer, INT64_MIN);
    EXPECT_FALSE(json::parse("9223372036854775808").value.is_integer);  // overflows int64: kept as a double
}

TEST(Json, ErrorsNameTheByteOffset) {
    EXPECT_EQ(json_error(""), "invalid JSON at byte 0: unexpected end of input, expected a value");
    EXPECT_EQ(json_error("[1, 2"), "invalid JSON at byte 5: unexpected end of input, expected ',' or ']'");
    EXPECT_EQ(json_error("[1 2]"), "invalid JSON at byte 3: unexpected '2', expected ',' or ']'");
    EXPECT_EQ(json_error("{\"a\" 1}"), "invalid JSON at byte 5: unexpected '1', expected ':'");
    EXPECT_EQ(json_error("{1: 2}"), "invalid JSON at byte 1: unexpected '1', expected a key string");
    EXPECT_EQ(json_error("{\"a\":1,\"a\":2}"), "invalid JSON at byte 12: duplicate key \"a\"");
    EXPECT_EQ(json_error("[01]"), "invalid JSON at byte 2: invalid number: leading zero");
    EXPECT_EQ(json_error("[1.]"), "invalid JSON at byte 3: invalid number: expected a digit after '.'");
    EXPECT_EQ(json_error("tru"), "invalid JSON at byte 0: invalid literal");
    EXPECT_EQ(json_error("\"ab"), "invalid JSON at byte 3: unterminated string");
    EXPECT_EQ(json_error("\"a\\qb\""), "invalid JSON at byte 3: invalid escape 'q'");
    EXPECT_EQ(json_error("\"\\ud800\""), "invalid JSON at byte 7: unpaired high surrogate");
    EXPECT_EQ(json_error("1 2"), "invalid JSON at byte 2: unexpected '2' after the value");
    EXPECT_EQ(json_error("\x01"), "invalid JSON at byte 0: unexpected byte 0x01, expected a value");
    EXPECT_EQ(json_error("[\"a\tb\"]"), "invalid JSON at byte 3: control character in string");
}

TEST(Json, DepthLimitAndNoRecursion) {
    std::string deep(json::kMaxDepth, '[');
    deep += std::string(json::kMaxDepth, ']');
    EXPECT_EQ(json_error(deep), "");
    std::string too_deep(json::kMaxDepth + 1, '[');
    EXPECT_EQ(json_error(too_deep), "invalid JSON at byte 64: nesting deeper than 64 levels");
    // A million opening brackets: rejected at the limit, no stack overflow.
    EXPECT_NE(json_error(std::string(1000000, '[')), "");
    EXPECT_NE(json_error(std::string(1000000, '{')), "");
}

TEST(Json, ArbitraryBytesNeverCrash) {
    // Random byte strings and random mutations of a valid request: the parser must answer (ok or an error with an
    // offset inside the input), never crash or read out of bounds (run under FLATEP_SANITIZE for the full effect).
    const std::string valid = "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[[6,1,1,0],[4,2,0,2]],\"x\":[\"\\u00e9\",1e5]}";
    int errors = 0;
    for (uint64_t i = 0; i < 20000; ++i) {
        std::string s = valid;
        const uint64_t h = routing::mix64(i);
        const int edits = 1 + int(h % 4);
        for (int k = 0; k < edits; ++k) {
            const uint64_t r = routing::mix64(h + uint64_t(k));
            const size_t at = size_t(r % s.size());
            switch ((r >> 32) % 3) {
                case 0:
                    s[at] = char(r >> 40);
                    break;
                case 1:
                    s.erase(at, 1 + (r >> 48) % 3);
                    break;
                default:
                    s.insert(at, 1, "[]{}\",:0-e.\\u"[(r >> 40) % 14]);
            }
        }
        const json::ParseResult pr = json::parse(s);
        if (!pr.ok) {
            ++errors;
            EXPECT_LE(pr.offset, s.size());
            EXPECT_EQ(pr.error.find('\n'), std::string::npos);
        }
        PlanRequest req;
        const std::string msg = parse_plan_request(s, true, req);
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
    EXPECT_GT(errors, 1000);
}

std::string request_error(std::string_view text, bool allow_partial = false) {
    PlanRequest req;
    return parse_plan_request(text, allow_partial, req);
}

TEST(PlanRequest, ValidRequestAndDefaults) {
    PlanRequest req;
    ASSERT_EQ(parse_plan_request("{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[[6,1,1,0],[4,2,0,2]]}", false, req), "");
    EXPECT_EQ(req.config.num_ranks, 2);
    EXPECT_EQ(req.config.align, 128);
    EXPECT_EQ(req.config.capacity_factor, 1.0);
    EXPECT_EQ(req.tpe, (std::vector<int32_t>{6, 1, 1, 0, 4, 2, 0, 2}));
    ASSERT_EQ(
        parse_plan_request(
            "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"align\":4,\"capacity_factor\":1.25,\"tpe\":[[6,1,1,0],[0,0,0,0]]}",
            true, req),
        "");
    EXPECT_EQ(req.config.align, 4);
    EXPECT_EQ(req.config.capacity_factor, 1.25);
}

TEST(PlanRequest, ErrorMessages) {
    const std::string head = "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,";
    EXPECT_EQ(request_error("[1]"), "the input must be a JSON object, got an array");
    EXPECT_EQ(request_error("{\"R\":2}"), "missing field \"E\"");
    EXPECT_EQ(request_error(head + "\"tpe\":[[6,1,1,0],[4,2,0,2]],\"zz\":1}"), "unknown field \"zz\"");
    EXPECT_EQ(request_error("{\"R\":\"2\",\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" must be an integer, got a string");
    EXPECT_EQ(request_error("{\"R\":2.5,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" must be an integer, got a non-integer number");
    EXPECT_EQ(request_error("{\"R\":4294967296,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" = 4294967296 does not fit int32");
    EXPECT_EQ(request_error(head + "\"capacity_factor\":true,\"tpe\":[]}"),
              "field \"capacity_factor\" must be a number, got a bool");
    EXPECT_EQ(request_error("{\"R\":3,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "num_experts (E) must be a multiple of num_ranks (R): E=4 R=3");
    EXPECT_EQ(request_error(head + "\"capacity_factor\":0.5,\"tpe\":[]}"),
              "capacity_factor must be in [1, 4], got 0.5");
    EXPECT_EQ(request_error(head + "\"tpe\":{}}"), "field \"tpe\" must be an array of R arrays, got an object");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0]]}"), "tpe must have R = 2 rows, got 1");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],7]}"), "tpe[1] must be an array of E integers, got 7");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[8,0,0]]}"), "tpe[1] must have E = 4 entries, got 3");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[9,0,0,-1]]}"), "tpe[1][3] = -1 is negative");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[8,0,null,0]]}"), "tpe[1][2] must be an integer, got a null");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[7,0,0,0]]}"),
              "tpe row 1 sums to 7, expected S*K = 8 (use --allow-partial for partial batches)");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[7,0,0,0]]}", true), "");
    EXPECT_EQ(request_error(head + "\"tpe\":[[8,0,0,0],[9,0,0,0]]}", true), "tpe row 1 sums to 9, above S*K = 8");
    EXPECT_EQ(request_error("{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"\\u0001\":1}"), "unknown field \"\\x01\"");
}

}  // namespace
}  // namespace flatep
