// Feeds arbitrary bytes to every decoder of the server protocol, as the server and the client
// would receive them. Any crash, sanitizer report or out-of-bounds read is a bug; every input
// must decode to a value or a Status.
#include <cstddef>
#include <cstdint>
#include <span>

#include "server/codec.h"

using namespace kvtier;
using namespace kvtier::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  std::span<const uint8_t> in(data + 1, size - 1);
  const uint32_t max = 64;

  // A frame as a server reads it: header checks, then the body decoder its opcode selects.
  if (in.size() >= kHeaderBytes) {
    FrameHeader h = DecodeHeader(in.data());
    std::span<const uint8_t> body = in.subspan(kHeaderBytes);
    if (CheckRequestHeader(h, 4096).ok() && body.size() >= h.body_length) {
      body = body.first(h.body_length);
      switch (static_cast<Opcode>(h.opcode)) {
        case Opcode::kHello: (void)DecodeHelloRequest(body); break;
        case Opcode::kLookup:
        case Opcode::kReserve:
        case Opcode::kPrepareLoad: (void)DecodeKeysRequest(body, max); break;
        case Opcode::kCommit:
        case Opcode::kAbort:
        case Opcode::kRelease: (void)DecodeSlotsRequest(body, max); break;
        case Opcode::kStats:
        case Opcode::kPing: (void)DecodeEmptyRequest(body); break;
        case Opcode::kDescribe: (void)DecodeDescribeRequest(body, max); break;
      }
    }
  }

  // Every body decoder directly, and every reply decoder, as the client reads them.
  switch (selector % 13) {
    case 0: (void)DecodeHelloRequest(in); break;
    case 12: (void)DecodeDescribeRequest(in, max); break;
    case 1: (void)DecodeKeysRequest(in, max); break;
    case 2: (void)DecodeSlotsRequest(in, max); break;
    case 3: (void)DecodeEmptyRequest(in); break;
    default: {
      Reader r(in);
      Status remote;
      if (!DecodeReplyStatus(r, &remote).ok() || !remote.ok()) break;
      switch (selector % 13) {
        case 4: (void)DecodeHelloReply(r); break;
        case 5: (void)DecodeLookupReply(r); break;
        case 6: (void)DecodeSlotsReply(r, max); break;
        case 7: (void)DecodeU32Reply(r); break;
        case 8: (void)DecodePrepareLoadReply(r, max); break;
        case 9: (void)DecodeTextReply(r); break;
        default: (void)DecodeEmptyReply(r); break;
      }
    }
  }
  return 0;
}
