// The input of flatep-plan: parse and validate a plan request, callable without the binary (tests, fuzzers).
//
// Format: {"R": int, "E": int, "S": int, "K": int, "align": int (default 128),
//          "capacity_factor": number (default 1.0), "num_slots": int (default -1: B = epn, the training layout),
//          "view_stride": int (default 0: Q = epn), "tpe": [[int, ...E], ...R]}
// Unknown or duplicate keys are errors. Every error is one line naming the field and the offending value.
// Size: at most kMaxRequestCounts counts (R*E), checked twice so that memory stays bounded (about 200 MB) whatever the
// input: the JSON parser stops after the values such a request can hold, and R*E is checked before the count matrix
// is allocated.
// Header-only on purpose: it depends only on json.hpp (nlohmann-json within limits) and the layout's validation
// (make_layout, through the internal API).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "flatep/types.hpp"
#include "internal/api.hpp"
#include "json.hpp"

namespace flatep {

inline constexpr int64_t kMaxRequestCounts = int64_t(1) << 20;
// Every value a request of kMaxRequestCounts counts holds: the counts, R <= kMaxRanks rows, the tpe array, the root
// and its six scalar fields (with room to spare).
inline constexpr size_t kMaxRequestValues = size_t(kMaxRequestCounts) + kMaxRanks + 16;

struct PlanRequest {
    Config config;             // hidden is not part of the request: 8; rank 0
    ViewShape view;            // num_slots and view_stride: the groups' layout (training unless given)
    std::vector<int32_t> tpe;  // [R][E] row-major
};

namespace plan_request_detail {

inline std::string describe(const json::Value& v) {
    if (v.is_number_integer()) return v.dump();
    if (v.is_number()) return "a non-integer number";
    if (v.is_boolean()) return "a bool";
    const bool vowel = v.is_array() || v.is_object();
    return std::string(vowel ? "an " : "a ") + v.type_name();
}

// An int32 field; "" or the error.
inline std::string read_int32(const json::Value& v, const std::string& name, int32_t& out) {
    if (!v.is_number_integer()) return name + " must be an integer, got " + describe(v);
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(INT32_MAX)
                                             : v.get<int64_t>() >= INT32_MIN && v.get<int64_t>() <= INT32_MAX;
    if (!fits) return name + " = " + v.dump() + " does not fit int32";
    out = v.get<int32_t>();
    return "";
}

}  // namespace plan_request_detail

// Parses and validates `text`. Returns "" and fills `out`, or returns the one-line error message. With
// allow_partial, rows may sum to less than S*K (ranks passing fewer tokens); otherwise each must equal S*K.
inline std::string parse_plan_request(std::string_view text, bool allow_partial, PlanRequest& out) {
    using plan_request_detail::describe;
    using plan_request_detail::read_int32;
    const json::ParseResult parsed = json::parse(text, kMaxRequestValues);
    if (parsed.too_many_values)
        return "the input holds more than " + std::to_string(kMaxRequestValues) +
               " JSON values, more than a request of at most R*E = " + std::to_string(kMaxRequestCounts) +
               " counts can hold (flatep-plan's limit)";
    if (!parsed.ok) return parsed.error;
    const json::Value& root = parsed.value;
    if (!root.is_object()) return "the input must be a JSON object, got " + describe(root);
    static const char* const kKnown[] = {"R",         "E",           "S",  "K", "align", "capacity_factor",
                                         "num_slots", "view_stride", "tpe"};
    for (auto m = root.begin(); m != root.end(); ++m) {
        bool known = false;
        for (const char* k : kKnown) known = known || m.key() == k;
        if (!known) return "unknown field \"" + json::printable(m.key()) + "\"";
    }
    Config c;
    ViewShape view;
    c.rank = 0;
    c.hidden = 8;
    struct IntField {
        const char* name;
        int* dst;
        bool required;
    };
    const IntField ints[] = {{"R", &c.num_ranks, true},
                             {"E", &c.num_experts, true},
                             {"S", &c.num_tokens, true},
                             {"K", &c.topk, true},
                             {"align", &c.align, false},
                             {"num_slots", &view.num_slots, false},
                             {"view_stride", &view.view_stride, false}};
    c.align = 128;
    for (const IntField& f : ints) {
        const auto v = root.find(f.name);
        if (v == root.end()) {
            if (f.required) return std::string("missing field \"") + f.name + "\"";
            continue;
        }
        int32_t value = 0;
        const std::string err = read_int32(*v, std::string("field \"") + f.name + "\"", value);
        if (!err.empty()) return err;
        *f.dst = value;
    }
    if (const auto v = root.find("capacity_factor"); v != root.end()) {
        if (!v->is_number()) return "field \"capacity_factor\" must be a number, got " + describe(*v);
        c.capacity_factor = v->get<double>();
    }
    const auto tpe = root.find("tpe");
    if (tpe == root.end()) return "missing field \"tpe\"";
    try {
        make_layout(c, PlannerKind::kBalanced, view);  // the config, then the view against it
    } catch (const Error& e) {
        return e.message();
    }
    if (!tpe->is_array()) return "field \"tpe\" must be an array of R arrays, got " + describe(*tpe);
    const int R = c.num_ranks, E = c.num_experts;
    if (int64_t(R) * E > kMaxRequestCounts)
        return "R*E = " + std::to_string(int64_t(R) * E) + " counts (R=" + std::to_string(R) +
               ", E=" + std::to_string(E) + ") is above flatep-plan's limit of " + std::to_string(kMaxRequestCounts);
    if (int64_t(tpe->size()) != R)
        return "tpe must have R = " + std::to_string(R) + " rows, got " + std::to_string(tpe->size());
    const int64_t sk = int64_t(c.num_tokens) * c.topk;
    std::vector<int32_t> counts(size_t(R) * size_t(E));
    for (int s = 0; s < R; ++s) {
        const json::Value& row = (*tpe)[size_t(s)];
        const std::string row_name = "tpe[" + std::to_string(s) + "]";
        if (!row.is_array()) return row_name + " must be an array of E integers, got " + describe(row);
        if (int64_t(row.size()) != E)
            return row_name + " must have E = " + std::to_string(E) + " entries, got " + std::to_string(row.size());
        int64_t sum = 0;
        for (int e = 0; e < E; ++e) {
            const std::string name = row_name + "[" + std::to_string(e) + "]";
            int32_t v = 0;
            const std::string err = read_int32(row[size_t(e)], name, v);
            if (!err.empty()) return err;
            if (v < 0) return name + " = " + std::to_string(v) + " is negative";
            counts[size_t(s) * E + e] = v;
            sum += v;
        }
        if (allow_partial ? sum > sk : sum != sk)
            return "tpe row " + std::to_string(s) + " sums to " + std::to_string(sum) +
                   (allow_partial ? ", above S*K = " : ", expected S*K = ") + std::to_string(sk) +
                   (allow_partial ? "" : " (use --allow-partial for partial batches)");
    }
    out.config = c;
    out.view = view;
    out.tpe = std::move(counts);
    return "";
}

}  // namespace flatep
