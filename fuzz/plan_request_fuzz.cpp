// libFuzzer target: the flatep-plan JSON reader (tools/json.hpp) and the request parser (tools/plan_request.hpp).
//
// On any byte string: json::parse never crashes; a document it accepts is written back (json::Writer, compact) and
// parsed again to the same value (structure, strings, booleans, integers; other numbers equal as doubles, non-finite
// ones written as null); an error is one line "invalid JSON at byte N: ...". parse_plan_request either accepts
// (then the config validates, tpe has R*E counts that validate_counts accepts and, in strict mode, every row sums to
// S*K; small requests are planned and checked against design §4) or returns a one-line message.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "flatep/error.hpp"
#include "fuzz_input.hpp"
#include "json.hpp"
#include "layout/layout.hpp"
#include "plan_request.hpp"
#include "planner/planner.hpp"

namespace {

namespace json = flatep::json;

void write(json::Writer& w, const json::Value& v) {
    switch (v.type) {
        case json::Type::kNull:
            w.null();
            break;
        case json::Type::kBool:
            w.value(v.boolean);
            break;
        case json::Type::kNumber:
            if (v.is_integer) {
                w.value(v.integer);
            } else {
                w.value(v.number);
            }
            break;
        case json::Type::kString:
            w.value(std::string_view(v.string));
            break;
        case json::Type::kArray:
            w.begin_array();
            for (const json::Value& item : v.items) write(w, item);
            w.end_array();
            break;
        case json::Type::kObject:
            w.begin_object();
            for (const auto& m : v.members) {
                w.key(m.first);
                write(w, m.second);
            }
            w.end_object();
            break;
    }
}

// a (original) and b (reparsed) are the same value.
bool same(const json::Value& a, const json::Value& b) {
    if (a.type == json::Type::kNumber && !a.is_integer && !std::isfinite(a.number)) return b.type == json::Type::kNull;
    if (a.type != b.type) return false;
    switch (a.type) {
        case json::Type::kNull:
            return true;
        case json::Type::kBool:
            return a.boolean == b.boolean;
        case json::Type::kNumber:
            if (a.is_integer) return b.is_integer && a.integer == b.integer;
            return a.number == b.number;
        case json::Type::kString:
            return a.string == b.string;
        case json::Type::kArray:
            if (a.items.size() != b.items.size()) return false;
            for (size_t i = 0; i < a.items.size(); ++i)
                if (!same(a.items[i], b.items[i])) return false;
            return true;
        case json::Type::kObject:
            if (a.members.size() != b.members.size()) return false;
            for (size_t i = 0; i < a.members.size(); ++i)
                if (a.members[i].first != b.members[i].first || !same(a.members[i].second, b.members[i].second))
                    return false;
            return true;
    }
    return false;
}

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);

    const json::ParseResult parsed = json::parse(text);
    if (parsed.ok) {
        json::Writer writer(true);
        write(writer, parsed.value);
        const json::ParseResult again = json::parse(writer.str());
        FUZZ_ASSERT(again.ok, "the writer's output does not parse: %s", again.error.c_str());
        FUZZ_ASSERT(same(parsed.value, again.value), "the value changed through write + parse: %s",
                    writer.str().substr(0, 200).c_str());
    } else {
        FUZZ_ASSERT(parsed.error.rfind("invalid JSON at byte ", 0) == 0 && parsed.offset <= size,
                    "bad parse error '%s' (offset %zu of %zu)", parsed.error.c_str(), parsed.offset, size);
    }

    for (const bool allow_partial : {false, true}) {
        flatep::PlanRequest request;
        const std::string error = flatep::parse_plan_request(text, allow_partial, request);
        if (!error.empty()) {
            // Messages may quote user bytes (printable() escapes control characters), but stay on one line.
            FUZZ_ASSERT(one_line(error), "the error is not one line: '%s'", error.c_str());
            continue;
        }
        FUZZ_ASSERT(parsed.ok, "parse_plan_request accepted text that json::parse rejects");
        const flatep::Config& c = request.config;
        try {
            c.validate();
        } catch (const flatep::Error& e) {
            FUZZ_ASSERT(false, "accepted request has an invalid config: %s", e.what());
        }
        const flatep::Layout l = flatep::make_layout(c);
        FUZZ_ASSERT(request.tpe.size() == size_t(l.num_ranks) * size_t(l.num_experts), "tpe has %zu counts for R*E=%d",
                    request.tpe.size(), l.num_ranks * l.num_experts);
        const std::string counts = flatep::validate_counts(l, request.tpe.data());
        FUZZ_ASSERT(counts.empty(), "accepted request has invalid counts: %s", counts.c_str());
        if (!allow_partial) {
            for (int s = 0; s < l.num_ranks; ++s) {
                int64_t sum = 0;
                for (int e = 0; e < l.num_experts; ++e) sum += request.tpe[size_t(s) * l.num_experts + e];
                FUZZ_ASSERT(sum == int64_t(l.num_tokens) * l.topk, "strict request row %d sums to %lld", s,
                            (long long)sum);
            }
        }
        // Plan it when the plan arrays stay small (S*K and NvS words are allocated).
        if (int64_t(l.num_tokens) * l.topk <= (1 << 16) && l.num_recv_rows <= (1 << 18)) {
            for (const flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
                flatep::HostPlan plan(l);
                std::copy(request.tpe.begin(), request.tpe.end(), plan.view.tpe_all);
                flatep::plan_counts(l, kind, plan.view);
                const std::string violation = flatep::check_plan(l, plan.view);
                FUZZ_ASSERT(violation.empty(), "%s plan of an accepted request violates design 4: %s",
                            flatep::planner_name(kind), violation.c_str());
            }
        }
    }
    return 0;
}
