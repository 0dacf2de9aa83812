// Internal: plain libcurl, the reference that benchmarks compare the S3 env with. One easy
// handle (one kept-alive connection) per client, one blocking request per call: a whole object
// by one PUT or one GET, signed by curl's SigV4 as the env's requests are. Use one per thread.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kvtier/status.h"

namespace kvtier::io {

class S3RawClient {
 public:
  // For objects under `url` (s3://BUCKET[/PREFIX]); endpoint and credentials as NewS3Env.
  static Result<std::unique_ptr<S3RawClient>> Connect(const std::string& url);
  ~S3RawClient();
  S3RawClient(const S3RawClient&) = delete;
  S3RawClient& operator=(const S3RawClient&) = delete;

  // PUTs `data` as the object at `url` (s3://BUCKET/KEY).
  Status WriteFile(const std::string& url, std::span<const uint8_t> data);
  // GETs the object at `url` into `out`; an object of another size is an error.
  Status ReadFile(const std::string& url, std::span<uint8_t> out);

  class Impl;

 private:
  S3RawClient() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::io
