// A small JSON reader and writer for FlatEP's tools (flatep-plan and friends).
//
// The reader is header-only (so tests and fuzzers use it without linking the tools) and safe on any byte string:
// it never recurses (an explicit stack, nesting limited to kMaxDepth), checks integer overflow, and reports the
// first error with its byte offset. A caller may bound the values a document holds (parse's max_values): the parser
// then stops at the first value past the bound, so its memory (a few dozen bytes per value) stays bounded whatever
// the input. Numbers keep whether they were written as integers: an integer literal that fits
// int64 has is_integer set; every number also carries its double value. Strings are byte strings: escapes are
// decoded (\uXXXX to UTF-8, surrogate pairs joined), other bytes are kept as they are.
//
// The writer (json.cpp) prints compact JSON or an indented form in which arrays of scalars stay on one line.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flatep::json {

inline constexpr int kMaxDepth = 64;

enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

inline const char* type_name(Type t) {
    switch (t) {
        case Type::kNull:
            return "null";
        case Type::kBool:
            return "bool";
        case Type::kNumber:
            return "number";
        case Type::kString:
            return "string";
        case Type::kArray:
            return "array";
        case Type::kObject:
            return "object";
    }
    return "?";
}

struct Value {
    Type type = Type::kNull;
    bool boolean = false;
    bool is_integer = false;  // a number written without fraction or exponent that fits int64
    int64_t integer = 0;
    double number = 0.0;
    std::string string;
    std::vector<Value> items;                            // array
    std::vector<std::pair<std::string, Value>> members;  // object, in input order

    // First member named `key`, or nullptr.
    const Value* find(std::string_view key) const {
        for (const auto& m : members)
            if (m.first == key) return &m.second;
        return nullptr;
    }
};

// Result of parse(): ok, or the error with the byte offset where it was found.
struct ParseResult {
    bool ok = false;
    Value value;
    size_t offset = 0;
    std::string error;             // "invalid JSON at byte <offset>: <what>", or the value limit's own text
    bool too_many_values = false;  // the document holds more than max_values values
};

namespace detail {

class Parser {
  public:
    Parser(std::string_view text, size_t max_values) : s_(text), max_values_(max_values) {}

    ParseResult run() {
        ParseResult r;
        // Frames of the containers being built; the innermost is last.
        struct Frame {
            Value container;
            std::string key;  // object: key of the member whose value is being parsed
        };
        std::vector<Frame> stack;
        Value done;
        bool have_done = false;
        for (;;) {
            // Expect a value.
            skip_ws();
            if (pos_ >= s_.size()) return fail(r, "unexpected end of input, expected a value");
            if (++num_values_ > max_values_) {
                fail(r, "");
                r.too_many_values = true;
                r.error = "JSON document of more than " + std::to_string(max_values_) +
                          " values (the limit, reached at byte " + std::to_string(pos_) + ")";
                return r;
            }
            const char c = s_[pos_];
            Value v;
            bool complete = true;
            if (c == '{' || c == '[') {
                if (int(stack.size()) >= kMaxDepth)
                    return fail(r, "nesting deeper than " + std::to_string(kMaxDepth) + " levels");
                ++pos_;
                Frame f;
                f.container.type = c == '{' ? Type::kObject : Type::kArray;
                skip_ws();
                const char close = c == '{' ? '}' : ']';
                if (pos_ < s_.size() && s_[pos_] == close) {
                    ++pos_;
                    v = std::move(f.container);
                } else {
                    stack.push_back(std::move(f));
                    complete = false;
                    if (c == '{' && !read_key(r, stack.back().key)) return r;
                }
            } else if (c == '"') {
                v.type = Type::kString;
                if (!read_string(r, v.string)) return r;
            } else if (c == 't' || c == 'f' || c == 'n') {
                const std::string_view word = c == 't' ? "true" : (c == 'f' ? "false" : "null");
                if (s_.substr(pos_, word.size()) != word) return fail(r, "invalid literal");
                pos_ += word.size();
                v.type = c == 'n' ? Type::kNull : Type::kBool;
                v.boolean = c == 't';
            } else if (c == '-' || (c >= '0' && c <= '9')) {
                if (!read_number(r, v)) return r;
            } else {
                return fail(r, std::string("unexpected ") + describe(c) + ", expected a value");
            }
            if (!complete) continue;
            // Hand the value to its container; close every container that ends here.
            for (;;) {
                if (stack.empty()) {
                    done = std::move(v);
                    have_done = true;
                    break;
                }
                Frame& top = stack.back();
                if (top.container.type == Type::kArray) {
                    top.container.items.push_back(std::move(v));
                } else {
                    for (const auto& m : top.container.members)
                        if (m.first == top.key) return fail(r, "duplicate key \"" + printable(top.key) + "\"");
                    top.container.members.emplace_back(std::move(top.key), std::move(v));
                    top.key.clear();
                }
                skip_ws();
                const char close = top.container.type == Type::kArray ? ']' : '}';
                if (pos_ >= s_.size())
                    return fail(r, std::string("unexpected end of input, expected ',' or '") + close + "'");
                if (s_[pos_] == ',') {
                    ++pos_;
                    if (top.container.type == Type::kObject && !read_key(r, top.key)) return r;
                    break;  // parse the next value
                }
                if (s_[pos_] != close)
                    return fail(r,
                                std::string("unexpected ") + describe(s_[pos_]) + ", expected ',' or '" + close + "'");
                ++pos_;
                v = std::move(top.container);
                stack.pop_back();
            }
            if (have_done) break;
        }
        skip_ws();
        if (pos_ != s_.size()) return fail(r, std::string("unexpected ") + describe(s_[pos_]) + " after the value");
        r.ok = true;
        r.value = std::move(done);
        return r;
    }

  private:
    std::string_view s_;
    size_t pos_ = 0;
    size_t max_values_;
    size_t num_values_ = 0;

    static std::string describe(char c) {
        const unsigned char u = static_cast<unsigned char>(c);
        if (u >= 0x21 && u < 0x7f) return std::string("'") + c + "'";
        static const char* hex = "0123456789abcdef";
        return std::string("byte 0x") + hex[u >> 4] + hex[u & 15];
    }

    ParseResult& fail(ParseResult& r, const std::string& what) {
        r.ok = false;
        r.offset = pos_;
        r.error = "invalid JSON at byte " + std::to_string(pos_) + ": " + what;
        return r;
    }

    void skip_ws() {
        while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
            ++pos_;
    }

    // After '{' or ',' inside an object: "key" ':'
    bool read_key(ParseResult& r, std::string& key) {
        skip_ws();
        if (pos_ >= s_.size()) return fail(r, "unexpected end of input, expected a key"), false;
        if (s_[pos_] != '"') return fail(r, "unexpected " + describe(s_[pos_]) + ", expected a key string"), false;
        if (!read_string(r, key)) return false;
        skip_ws();
        if (pos_ >= s_.size() || s_[pos_] != ':') {
            fail(r, pos_ >= s_.size() ? std::string("unexpected end of input, expected ':'")
                                      : "unexpected " + describe(s_[pos_]) + ", expected ':'");
            return false;
        }
        ++pos_;
        return true;
    }

    static int hex_value(char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    }

    bool read_hex4(ParseResult& r, uint32_t& out) {
        if (pos_ + 4 > s_.size()) return fail(r, "truncated \\u escape"), false;
        out = 0;
        for (int i = 0; i < 4; ++i) {
            const int h = hex_value(s_[pos_ + i]);
            if (h < 0) return fail(r, "invalid \\u escape"), false;
            out = out * 16 + uint32_t(h);
        }
        pos_ += 4;
        return true;
    }

    static void append_utf8(std::string& out, uint32_t cp) {
        if (cp < 0x80) {
            out += char(cp);
        } else if (cp < 0x800) {
            out += char(0xc0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            out += char(0xe0 | (cp >> 12));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        } else {
            out += char(0xf0 | (cp >> 18));
            out += char(0x80 | ((cp >> 12) & 0x3f));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        }
    }

    bool read_string(ParseResult& r, std::string& out) {
        ++pos_;  // opening quote
        out.clear();
        for (;;) {
            if (pos_ >= s_.size()) return fail(r, "unterminated string"), false;
            const char c = s_[pos_];
            if (c == '"') {
                ++pos_;
                return true;
            }
            if (static_cast<unsigned char>(c) < 0x20) return fail(r, "control character in string"), false;
            if (c != '\\') {
                out += c;
                ++pos_;
                continue;
            }
            if (pos_ + 1 >= s_.size()) return fail(r, "unterminated string"), false;
            const char esc = s_[pos_ + 1];
            pos_ += 2;
            switch (esc) {
                case '"':
                case '\\':
                case '/':
                    out += esc;
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'n':
                    out += '\n';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'u': {
                    uint32_t cp = 0;
                    if (!read_hex4(r, cp)) return false;
                    if (cp >= 0xdc00 && cp <= 0xdfff) return fail(r, "unpaired low surrogate"), false;
                    if (cp >= 0xd800 && cp <= 0xdbff) {
                        if (pos_ + 2 > s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
                            return fail(r, "unpaired high surrogate"), false;
                        pos_ += 2;
                        uint32_t lo = 0;
                        if (!read_hex4(r, lo)) return false;
                        if (lo < 0xdc00 || lo > 0xdfff) return fail(r, "invalid low surrogate"), false;
                        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    }
                    append_utf8(out, cp);
                    break;
                }
                default:
                    pos_ -= 1;
                    return fail(r, "invalid escape " + describe(esc)), false;
            }
        }
    }

    bool read_number(ParseResult& r, Value& v) {
        const size_t start = pos_;
        bool negative = false;
        if (s_[pos_] == '-') {
            negative = true;
            ++pos_;
        }
        auto digit = [&](size_t i) { return i < s_.size() && s_[i] >= '0' && s_[i] <= '9'; };
        if (!digit(pos_)) return fail(r, "invalid number: expected a digit"), false;
        bool fits = true;
        int64_t mag = 0;  // accumulated as a negative number, so INT64_MIN fits
        if (s_[pos_] == '0') {
            ++pos_;
            if (digit(pos_)) return fail(r, "invalid number: leading zero"), false;
        } else {
            while (digit(pos_)) {
                const int d = s_[pos_] - '0';
                if (fits && (__builtin_mul_overflow(mag, 10, &mag) || __builtin_sub_overflow(mag, d, &mag)))
                    fits = false;
                ++pos_;
            }
        }
        bool integral = true;
        if (pos_ < s_.size() && s_[pos_] == '.') {
            integral = false;
            ++pos_;
            if (!digit(pos_)) return fail(r, "invalid number: expected a digit after '.'"), false;
            while (digit(pos_)) ++pos_;
        }
        if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
            integral = false;
            ++pos_;
            if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
            if (!digit(pos_)) return fail(r, "invalid number: expected a digit in the exponent"), false;
            while (digit(pos_)) ++pos_;
        }
        v.type = Type::kNumber;
        if (integral && fits && (negative || mag != INT64_MIN)) {
            v.is_integer = true;
            v.integer = negative ? mag : -mag;
            v.number = double(v.integer);
            return true;
        }
        // from_chars is locale-independent; out-of-range values saturate to +-inf / 0 by our choice.
        double d = 0.0;
        const auto res = std::from_chars(s_.data() + start, s_.data() + pos_, d);
        if (res.ec == std::errc::result_out_of_range) {
            // Decide overflow vs underflow from the exponent sign: a huge mantissa or positive exponent overflows.
            const std::string_view text = s_.substr(start, pos_ - start);
            const size_t epos = text.find_first_of("eE");
            const bool tiny = epos != std::string_view::npos && epos + 1 < text.size() && text[epos + 1] == '-';
            d = tiny ? 0.0 : (negative ? -1e308 * 10 : 1e308 * 10);
        }
        v.number = d;
        return true;
    }

  public:
    // Printable, one-line form of a byte string for error messages (non-printable bytes as \xNN, cut at max_bytes).
    static std::string printable(std::string_view in, size_t max_bytes = 40) {
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
};

}  // namespace detail

// Parses a whole document (one value, surrounding whitespace allowed) of at most max_values values (every scalar,
// array and object counts one).
inline ParseResult parse(std::string_view text, size_t max_values = SIZE_MAX) {
    return detail::Parser(text, max_values).run();
}

// One-line printable form of a byte string for error messages: quoted input (keys, option values) is cut at 40 bytes;
// pass a larger max_bytes for text the user needs whole, such as a file path.
inline std::string printable(std::string_view text, size_t max_bytes = 40) {
    return detail::Parser::printable(text, max_bytes);
}

// JSON writer: compact, or indented with arrays of scalars on one line.
class Writer {
  public:
    explicit Writer(bool compact) : compact_(compact) {}
    void begin_object();
    void end_object();
    void begin_array();
    void end_array();
    void key(std::string_view name);  // inside an object, before the member's value
    void value(int64_t v);
    void value(double v);
    void value(bool v);
    void value(std::string_view v);
    void value(int v) { value(int64_t(v)); }
    void value(const char* v) { value(std::string_view(v)); }
    void null();
    const std::string& str() const { return out_; }

  private:
    struct Frame {
        bool object;
        int count;
        bool has_container;  // a member or item of this container is itself a container
    };
    void before_value(bool is_container);
    void write_string(std::string_view v);
    void newline(int depth);
    bool compact_;
    bool after_key_ = false;
    std::string out_;
    std::vector<Frame> stack_;
};

}  // namespace flatep::json
