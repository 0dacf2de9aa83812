// kvtier._native: the Python bindings of the kvtier core (nanobind). python/kvtier re-exports it.
//
// Rules every binding here follows:
//  * Zero-copy: chunk data moves between the caller's buffers (buffer protocol, or a CPU tensor's
//    data_ptr) and the store in C++; it never becomes a Python bytes object. A Store/Load op
//    holds the caller's buffers (a buffer export, which also stops a bytearray or numpy array
//    from being resized) until the operation is done.
//  * The GIL is released around every call that may block or take long: lookups, submissions,
//    zero-copy RPCs, waits, copies, opening and connecting.
//  * Errors are Python exceptions carrying the C++ Status message: kvtier.KvtierError with a
//    snake_case .code, kvtier.InvalidArgumentError (also a ValueError) for invalid arguments.
//    Every argument is checked before it reaches C++, including slot numbers: each store keeps a
//    ledger of the slots it reserved and the pins it holds, so a wrong slot is an error and not
//    a corrupted pool.
//  * Dropping a Python object never blocks its caller. C++ objects whose destructors may block
//    (an Engine finishes queued writes, a Client waits for copies, a remote PrepareLoad releases
//    its pins with an RPC, a CUDA copier synchronizes its streams) are destroyed by one reaper
//    thread. It is drained and joined by an atexit hook, before the interpreter finalizes, so it
//    never touches Python during finalization; later drops are destroyed inline.
//
// One file per area, each adding its part of the module through a Register* function
// (binding.h): errors.cc, keys.cc, chunk_store.cc, server.cc, kv_copier.cc, file_tier.cc; the
// helpers they share are in buffers.cc (borrowed memory, arguments), reaper.cc and stats.cc.
#include <Python.h>  // first, as Python's headers require
#include <nanobind/nanobind.h>

#include "common/logging.h"
#include "python/binding.h"

namespace kvtier::python {
namespace {

void InitModule(nb::module_& m) {
  m.doc() = "kvtier's C++ core: chunk keys, the tiered engine, the server client, KV copiers.";
  m.attr("__version__") = KVTIER_VERSION;
  InitLogging();  // log lines to stderr: a benchmark's JSON on stdout stays parseable
  RegisterErrors(m);
  RegisterKeys(m);
  RegisterChunkStore(m);
  RegisterServer(m);
  RegisterCopier(m);
  RegisterFileTier(m);
  RegisterReaper(m);
}

}  // namespace
}  // namespace kvtier::python

NB_MODULE(_native, m) { kvtier::python::InitModule(m); }
