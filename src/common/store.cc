#include "kvtier/store.h"

namespace kvtier {

namespace {
class FinishedOp final : public AsyncOp::Impl {
 public:
  explicit FinishedOp(OpResult r) : result_(std::move(r)) {}
  bool Done() override { return true; }
  std::optional<OpResult> WaitFor(std::optional<std::chrono::nanoseconds>) override {
    return result_;
  }

 private:
  const OpResult result_;
};
}  // namespace

AsyncOp AsyncOp::Finished(OpResult result) {
  return AsyncOp(std::make_shared<FinishedOp>(std::move(result)));
}

}  // namespace kvtier
