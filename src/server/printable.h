// Client-chosen strings (names, model ids) end up in logs, JSON documents and metrics labels:
// what is accepted as text, and how anything else is shown.
#pragma once

#include <string>
#include <string_view>

namespace kvtier::server {

// Valid UTF-8 with no control characters (C0, DEL, C1) and no surrogates or overlong forms.
bool IsPrintableUtf8(std::string_view s);

// `s` for a log line: bytes that are control characters or not printable UTF-8 become \xNN, so
// a client-chosen string can neither break a line nor forge one.
std::string LogSafe(std::string_view s);

}  // namespace kvtier::server
