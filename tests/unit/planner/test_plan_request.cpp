// The JSON reader (tools/json.hpp: nlohmann-json within limits) and the flatep-plan request parser
// (tools/plan_request.hpp): exact error messages with byte offsets, limits, and robustness on arbitrary bytes.
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
    const json::Value& a = r.value.at("a");
    ASSERT_EQ(a.size(), 8u);
    EXPECT_TRUE(a[0].is_number_integer());
    EXPECT_EQ(a[1].get<int64_t>(), -2);
    EXPECT_FALSE(a[2].is_number_integer());
    EXPECT_DOUBLE_EQ(a[2].get<double>(), 3.5);
    EXPECT_FALSE(a[3].is_number_integer());
    EXPECT_DOUBLE_EQ(a[3].get<double>(), 100.0);
    EXPECT_TRUE(a[4].get<bool>());
    EXPECT_TRUE(a[6].is_null());
    EXPECT_EQ(a[7].get<std::string>(), "x\n\xc3\xa9\xf0\x9f\x98\x80");
    EXPECT_TRUE(r.value.at("b").is_object());
    EXPECT_EQ(json::parse("-9223372036854775808").value.get<int64_t>(), INT64_MIN);
    EXPECT_TRUE(json::parse("9223372036854775808").value.is_number_unsigned());  // above int64: uint64
    EXPECT_TRUE(json::parse("18446744073709551616").value.is_number_float());    // above uint64: kept as a double
}

// The syntax errors are nlohmann-json's; the byte offset (of the last byte read) and the duplicate key are ours.
TEST(Json, ErrorsNameTheByteOffset) {
    EXPECT_EQ(json_error(""),
              "invalid JSON at byte 0: syntax error while parsing value - unexpected end of input; expected '[', '{', "
              "or a literal");
    EXPECT_EQ(json_error("[1, 2"),
              "invalid JSON at byte 5: syntax error while parsing array - unexpected end of input; expected ']'");
    EXPECT_EQ(json_error("[1 2]"),
              "invalid JSON at byte 3: syntax error while parsing array - unexpected number literal; expected ']'");
    EXPECT_EQ(json_error("{\"a\" 1}"),
              "invalid JSON at byte 5: syntax error while parsing object separator - unexpected number literal; "
              "expected ':'");
    EXPECT_EQ(json_error("{1: 2}"),
              "invalid JSON at byte 1: syntax error while parsing object key - unexpected number literal; expected "
              "string literal");
    EXPECT_EQ(json_error("{\"a\":1,\"a\":2}"), "invalid JSON at byte 9: duplicate key \"a\"");
    EXPECT_EQ(json_error("{\"a\":{\"b\":1,\"b\":2}}"), "invalid JSON at byte 14: duplicate key \"b\"");
    EXPECT_EQ(json_error("{\"a\":1,\"b\":{\"a\":2}}"), "");  // the same key in another object
    EXPECT_EQ(json_error("[01]"),
              "invalid JSON at byte 2: syntax error while parsing array - unexpected number literal; expected ']'");
    EXPECT_EQ(json_error("[1.]"),
              "invalid JSON at byte 3: syntax error while parsing value - invalid number; expected digit after '.'; "
              "last read: '1.]'");
    EXPECT_EQ(json_error("tru"),
              "invalid JSON at byte 3: syntax error while parsing value - invalid literal; last read: 'tru'");
    EXPECT_EQ(json_error("\"ab"),
              "invalid JSON at byte 3: syntax error while parsing value - invalid string: missing closing quote; last "
              "read: '\"ab'");
    EXPECT_EQ(json_error("\"a\\qb\""),
              "invalid JSON at byte 3: syntax error while parsing value - invalid string: forbidden character after "
              "backslash; last read: '\"a\\q'");
    EXPECT_EQ(json_error("\"\\ud800\""),
              "invalid JSON at byte 7: syntax error while parsing value - invalid string: surrogate U+D800..U+DBFF "
              "must be followed by U+DC00..U+DFFF; last read: '\"\\ud800\"'");
    EXPECT_EQ(json_error("1 2"),
              "invalid JSON at byte 2: syntax error while parsing value - unexpected number literal; expected end of "
              "input");
    EXPECT_EQ(json_error("\x01"),
              "invalid JSON at byte 0: syntax error while parsing value - invalid literal; last read: '<U+0001>'");
    EXPECT_EQ(json_error("[\"a\tb\"]"),
              "invalid JSON at byte 3: syntax error while parsing value - invalid string: control character U+0009 "
              "(HT) must be escaped to \\u0009 or \\t; last read: '\"a<U+0009>'");
    EXPECT_EQ(json_error("[1e400]"), "invalid JSON at byte 5: number overflow parsing '1e400'");
    EXPECT_EQ(json_error("{\n  \"a\": 1,\n  \"a\": 2\n}"), "invalid JSON at byte 16: duplicate key \"a\"");
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
    EXPECT_EQ(req.view.num_slots, -1);
    EXPECT_EQ(req.view.view_stride, 0);
}

TEST(PlanRequest, ServingFields) {
    PlanRequest req;
    const std::string head = "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[[6,1,1,0],[4,2,0,2]],";
    ASSERT_EQ(parse_plan_request(head + "\"num_slots\":1,\"view_stride\":3}", false, req), "");
    EXPECT_EQ(req.view.num_slots, 1);
    EXPECT_EQ(req.view.view_stride, 3);
    EXPECT_EQ(request_error(head + "\"num_slots\":3}"), "num_slots (B) must be -1 (= epn) or in [0, epn=2], got 3");
    EXPECT_EQ(request_error(head + "\"view_stride\":1}"),
              "view_stride (Q) must be 0 (= epn) or in [epn=2, 1048576], got 1");
    EXPECT_EQ(request_error(head + "\"num_slots\":1.5}"),
              "field \"num_slots\" must be an integer, got a non-integer number");
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
    EXPECT_EQ(request_error("{\"R\":9223372036854775808,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" = 9223372036854775808 does not fit int32");
    EXPECT_EQ(request_error("{\"R\":-2147483649,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" = -2147483649 does not fit int32");
    EXPECT_EQ(request_error("{\"R\":1e30,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[]}"),
              "field \"R\" must be an integer, got a non-integer number");
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
