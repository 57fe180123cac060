// JSON for FlatEP's tools: nlohmann-json (Debian's nlohmann-json3-dev) with the limits an untrusted request needs.
//
// parse() builds a nlohmann::json through the library's SAX interface, so that it refuses, while reading, what
// nlohmann::json::parse would accept: nesting deeper than kMaxDepth, a duplicate key (nlohmann keeps the last one),
// more than max_values values (every scalar, array and object counts one; parsing stops there, so memory stays bounded
// whatever the input). Every error is one line naming the byte offset where it was found. Header-only, so tests and
// fuzzers use it without linking the tools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flatep::json {

using Value = nlohmann::json;

inline constexpr int kMaxDepth = 64;

// Result of parse(): ok, or the error with the byte offset where it was found.
struct ParseResult {
    bool ok = false;
    Value value;
    size_t offset = 0;             // of the error: the last byte read (the input's size for its end)
    std::string error;             // "invalid JSON at byte <offset>: <what>", or the value limit's own text
    bool too_many_values = false;  // the document holds more than max_values values
};

// One-line printable form of a byte string for error messages (non-printable bytes as \xNN): quoted input (keys,
// option values) is cut at 40 bytes; pass a larger max_bytes for text the user needs whole, such as a file path.
inline std::string printable(std::string_view in, size_t max_bytes = 40) {
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (size_t i = 0; i < in.size() && i < max_bytes; ++i) {
        const unsigned char u = static_cast<unsigned char>(in[i]);
        if (u >= 0x20 && u < 0x7f && u != '"' && u != '\\') {
            out += char(u);
        } else {
            out += "\\x";
            out += hex[u >> 4];
            out += hex[u & 15];
        }
    }
    if (in.size() > max_bytes) out += "...";
    return out;
}

namespace detail {

// The input as nlohmann's parser reads it, byte by byte, recording the last byte read: SAX events carry no position,
// and when start_array, start_object or key is called that byte is the bracket or the key's closing quote.
struct TrackedIterator {
    using iterator_category = std::input_iterator_tag;
    using value_type = char;
    using difference_type = std::ptrdiff_t;
    using pointer = const char*;
    using reference = const char&;
    const char* at;
    const char** last_read;
    reference operator*() const {
        *last_read = at;
        return *at;
    }
    TrackedIterator& operator++() {
        ++at;
        return *this;
    }
    TrackedIterator operator++(int) {
        TrackedIterator before = *this;
        ++at;
        return before;
    }
    bool operator==(const TrackedIterator& other) const { return at == other.at; }
    bool operator!=(const TrackedIterator& other) const { return at != other.at; }
};

// nlohmann's SAX handler that builds the document (as nlohmann's own DOM parser does) within the limits above.
class BoundedBuilder {
  public:
    BoundedBuilder(std::string_view text, size_t max_values, ParseResult& result)
        : text_(text), max_values_(max_values), result_(result) {}
    const char* last_read = nullptr;

    bool null() { return add(nullptr) != nullptr; }
    bool boolean(bool v) { return add(v) != nullptr; }
    bool number_integer(Value::number_integer_t v) { return add(v) != nullptr; }
    bool number_unsigned(Value::number_unsigned_t v) { return add(v) != nullptr; }
    bool number_float(Value::number_float_t v, const Value::string_t&) { return add(v) != nullptr; }
    bool string(Value::string_t& v) { return add(std::move(v)) != nullptr; }
    bool binary(Value::binary_t& v) { return add(Value::binary(std::move(v))) != nullptr; }
    bool start_object(size_t) { return open(Value::object()); }
    bool start_array(size_t) { return open(Value::array()); }
    bool end_object() { return close(); }
    bool end_array() { return close(); }
    bool key(Value::string_t& name) {
        Value& object = *open_.back();
        if (object.contains(name)) return fail(last_offset(), "duplicate key \"" + printable(name) + "\"");
        member_ = &object[name];
        return true;
    }
    // position: the bytes read, the failing one (or the end of the input) included.
    bool parse_error(size_t position, const std::string&, const Value::exception& e) {
        return fail(position > 0 ? position - 1 : 0, reason(e.what()));
    }

  private:
    std::string_view text_;
    size_t max_values_;
    size_t num_values_ = 0;
    ParseResult& result_;
    std::vector<Value*> open_;  // the containers being built, the innermost last
    Value* member_ = nullptr;   // the object member whose value comes next

    size_t last_offset() const { return last_read ? size_t(last_read - text_.data()) : 0; }

    // nlohmann's "[json.exception.parse_error.101] parse error at line 1, column 6: syntax error while parsing ..."
    // without the exception's name and its position (ours, the byte offset, replaces it).
    static std::string reason(std::string_view what) {
        if (const size_t name_end = what.find("] "); what.rfind("[json.exception.", 0) == 0 && name_end != what.npos)
            what.remove_prefix(name_end + 2);
        if (const size_t colon = what.find(": "); what.rfind("parse error", 0) == 0 && colon != what.npos)
            what.remove_prefix(colon + 2);
        return std::string(what);
    }

    bool fail(size_t offset, const std::string& what) {
        result_.offset = offset;
        result_.error = "invalid JSON at byte " + std::to_string(offset) + ": " + what;
        return false;
    }

    // Stores v where the document expects its next value; nullptr past the value limit.
    Value* add(Value v) {
        if (++num_values_ > max_values_) {
            result_.too_many_values = true;
            result_.offset = last_offset();
            result_.error = "JSON document of more than " + std::to_string(max_values_) + " values (the limit)";
            return nullptr;
        }
        if (open_.empty()) {
            result_.value = std::move(v);
            return &result_.value;
        }
        if (open_.back()->is_array()) {
            open_.back()->push_back(std::move(v));  // its earlier items are complete: no pointer to them is kept
            return &open_.back()->back();
        }
        *member_ = std::move(v);
        return member_;
    }

    bool open(Value container) {
        if (open_.size() >= size_t(kMaxDepth))
            return fail(last_offset(), "nesting deeper than " + std::to_string(kMaxDepth) + " levels");
        Value* v = add(std::move(container));
        if (v == nullptr) return false;
        open_.push_back(v);
        return true;
    }

    bool close() {
        open_.pop_back();
        return true;
    }
};

}  // namespace detail

// Parses a whole document (one value, surrounding whitespace allowed) of at most max_values values.
inline ParseResult parse(std::string_view text, size_t max_values = SIZE_MAX) {
    ParseResult result;
    detail::BoundedBuilder builder(text, max_values, result);
    const detail::TrackedIterator first{text.data(), &builder.last_read};
    const detail::TrackedIterator last{text.data() + text.size(), &builder.last_read};
    result.ok = Value::sax_parse(first, last, &builder);
    if (!result.ok) result.value = Value();
    return result;
}

}  // namespace flatep::json
