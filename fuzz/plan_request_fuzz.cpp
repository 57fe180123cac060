// libFuzzer target: the flatep-plan JSON reader (tools/json.hpp, nlohmann-json within limits) and the request parser
// (tools/plan_request.hpp).
//
// On any byte string: json::parse never crashes and agrees with nlohmann::json::parse (the same document, or an error
// that is one line "invalid JSON at byte N: ..." and, unless it is json::parse's own refusal of a duplicate key or of
// nesting past the limit, an input that nlohmann refuses too). parse_plan_request either accepts (then the config
// validates, tpe has R*E counts that planner::validate_counts accepts and, in strict mode, every row sums to S*K; small
// requests are planned and checked against design §4) or returns a one-line message.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "flatep/error.hpp"
#include "fuzz_input.hpp"
#include "json.hpp"
#include "layout/layout.hpp"
#include "plan_request.hpp"
#include "planner/planner.hpp"

namespace planner = flatep::planner;

namespace {

namespace json = flatep::json;

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);

    // json::parse (a SAX handler over nlohmann-json) against nlohmann's own DOM parser: the same document where it
    // accepts; where it refuses, a one-line error at an offset inside the input, and for a syntax error (not one of
    // its own limits) nlohmann refuses too.
    const json::ParseResult parsed = json::parse(text);
    const json::Value reference = json::Value::parse(text.begin(), text.end(), nullptr, false);
    if (parsed.ok) {
        FUZZ_ASSERT(parsed.value == reference, "json::parse and nlohmann::json::parse disagree: %s",
                    reference.dump().substr(0, 200).c_str());
    } else {
        FUZZ_ASSERT(
            parsed.error.rfind("invalid JSON at byte ", 0) == 0 && parsed.offset <= size && one_line(parsed.error),
            "bad parse error '%s' (offset %zu of %zu)", parsed.error.c_str(), parsed.offset, size);
        // Its own refusals name the key's closing quote or the bracket one level too deep.
        const char at = parsed.offset < size ? text[parsed.offset] : '\0';
        const bool own_limit =
            (parsed.error.find(": duplicate key \"") != std::string::npos && at == '"') ||
            (parsed.error.find(": nesting deeper than ") != std::string::npos && (at == '[' || at == '{'));
        FUZZ_ASSERT(own_limit || reference.is_discarded(), "json::parse refuses what nlohmann accepts: %s",
                    parsed.error.c_str());
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
        const flatep::Layout l = flatep::make_layout(c, flatep::PlannerKind::kBalanced, request.view);
        FUZZ_ASSERT(request.tpe.size() == size_t(l.num_ranks) * size_t(l.num_experts), "tpe has %zu counts for R*E=%d",
                    request.tpe.size(), l.num_ranks * l.num_experts);
        const std::string counts = planner::validate_counts(l, request.tpe.data());
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
                planner::HostPlan plan(l);
                std::copy(request.tpe.begin(), request.tpe.end(), plan.view.tpe_all);
                planner::plan_counts(l, kind, plan.view);
                const std::string violation = flatep::planner::check_plan(l, plan.view);
                FUZZ_ASSERT(violation.empty(), "%s plan of an accepted request violates design 4: %s",
                            flatep::planner_name(kind), violation.c_str());
            }
        }
    }
    return 0;
}
