// The events publisher of a kvtier built without libzmq and msgpack-cxx: no options are valid
// and it cannot be started (both say what to install), so no other method is ever reached. It keeps
// one interface for the server either way, with no #ifdef at its call sites.
#include "events/publisher.h"

namespace kvtier::events {

class Publisher::Impl {};

// No options are valid here: the configuration is refused with what to install.
Status ValidatePublisherOptions(const PublisherOptions&) {
  return Status::Unimplemented(
      "--kv-events needs a kvtier built with libzmq and msgpack-cxx (scripts/install-deps.sh "
      "installs them)");
}

Result<std::shared_ptr<Publisher>> Publisher::Start(const PublisherOptions& options) {
  return ValidatePublisherOptions(options);
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() = default;
void Publisher::Stop() {}
std::string Publisher::endpoint() const { return {}; }
std::string Publisher::replay_endpoint() const { return {}; }
void Publisher::RegisterGroup(uint64_t, const GroupInfo&) {}
void Publisher::Bind(uint64_t, const ChunkKey&, uint32_t, const ChunkKey&) {}
Status Publisher::Describe(uint64_t, const ChunkKey&, std::span<const uint8_t>) {
  return Status::Ok();
}
void Publisher::OnTierChange(TierId, const ChunkKey&, bool) noexcept {}
std::string Publisher::ChunkDescriptor(const ChunkKey&) noexcept { return {}; }
void Publisher::SetDescriptorReader(DescriptorReader) {}
PublisherStats Publisher::Stats() const { return {}; }
bool Publisher::Flush(std::chrono::milliseconds) { return true; }

}  // namespace kvtier::events
